//! The CLI's output equals a plain scalar reference of SPEC §1–3, byte for byte, on real files.

mod common;
use common::*;
use safetensors::tensor::Dtype;

#[derive(Clone, Copy, Debug)]
enum Variant {
    Ram,
    PaperGlobal,
    OfficialGlobal,
    PaperTensor,
    PaperLayer,
    OfficialModule,
}

/// The λ group of tensor `name` in layer scope (`module` false) or module scope, written out for
/// the names of `odd_shapes()` (SPEC §3: a layer's tensors together, the others by module kind).
fn group_of(name: &str, module: bool) -> &'static str {
    match (name, module) {
        ("model.embed_tokens.weight", _) => "embed",
        ("lm_head.weight", _) => "lm_head",
        (n, false) if n.starts_with("model.layers.0.") => "layer 0",
        ("model.layers.0.self_attn.q_proj.weight", true) => "attn",
        ("model.layers.0.mlp.up_proj.weight", true) => "mlp",
        ("model.layers.0.input_layernorm.weight", true) => "norm",
        _ => panic!("no group written for {name}"),
    }
}

impl Variant {
    fn args(self) -> Vec<&'static str> {
        match self {
            Variant::Ram => vec!["--method", "ram"],
            Variant::PaperGlobal => vec!["--method", "ram+"],
            Variant::OfficialGlobal => vec!["--method", "ram+", "--rule", "official"],
            Variant::PaperTensor => vec!["--method", "ram+", "--scope", "tensor"],
            Variant::PaperLayer => vec!["--method", "ram+", "--scope", "layer"],
            Variant::OfficialModule => {
                vec![
                    "--method", "ram+", "--scope", "module", "--rule", "official",
                ]
            }
        }
    }

    /// λ per agent for tensor `i` (global variants ignore `i`).
    fn lambdas(self, f: &Fixture, i: usize) -> Vec<f32> {
        let eps = 1e-5;
        let n = f.agents.len();
        match self {
            Variant::Ram => vec![1.0; n],
            Variant::PaperGlobal => reference_counts(&f.base_tensors, &f.agent_tensors, eps)
                .into_iter()
                .map(|c| lambda_paper(c, 0.1, 2.0) as f32)
                .collect(),
            Variant::OfficialGlobal => reference_counts(&f.base_tensors, &f.agent_tensors, eps)
                .into_iter()
                .map(|c| lambda_official(c, 1.2) as f32)
                .collect(),
            Variant::PaperTensor => {
                let base = vec![f.base_tensors[i].clone()];
                let agents: Vec<Vec<T>> =
                    f.agent_tensors.iter().map(|a| vec![a[i].clone()]).collect();
                reference_counts(&base, &agents, eps)
                    .into_iter()
                    .map(|c| lambda_paper(c, 0.1, 0.2) as f32)
                    .collect()
            }
            Variant::PaperLayer | Variant::OfficialModule => {
                let module = matches!(self, Variant::OfficialModule);
                let group = group_of(&f.base_tensors[i].name, module);
                let members: Vec<usize> = (0..f.base_tensors.len())
                    .filter(|&j| group_of(&f.base_tensors[j].name, module) == group)
                    .collect();
                let base: Vec<T> = members.iter().map(|&j| f.base_tensors[j].clone()).collect();
                let agents: Vec<Vec<T>> = f
                    .agent_tensors
                    .iter()
                    .map(|a| members.iter().map(|&j| a[j].clone()).collect())
                    .collect();
                reference_counts(&base, &agents, eps)
                    .into_iter()
                    .map(|c| match self {
                        Variant::PaperLayer => lambda_paper(c, 0.1, 2.0) as f32,
                        _ => lambda_official(c, 1.2) as f32,
                    })
                    .collect()
            }
        }
    }
}

fn check(f: &Fixture, variant: Variant, out_dtype: Option<Dtype>, extra: &[&str]) {
    let out = f
        .dir
        .path()
        .join(format!("out-{variant:?}-{out_dtype:?}-{}", extra.join("")));
    let mut args = variant.args();
    let dt_arg;
    if let Some(d) = out_dtype {
        dt_arg = match d {
            Dtype::BF16 => "bf16",
            Dtype::F16 => "f16",
            _ => "f32",
        };
        args.extend(["--out-dtype", dt_arg]);
    }
    args.extend(extra);
    merge_cmd(f, &out, &args).assert().success();
    let merged = read_folder(&out);
    assert_eq!(merged.len(), f.base_tensors.len());
    for (i, b) in f.base_tensors.iter().enumerate() {
        let lambdas = variant.lambdas(f, i);
        let agents: Vec<&T> = f.agent_tensors.iter().map(|a| &a[i]).collect();
        let want_dtype = out_dtype.unwrap_or(b.dtype);
        let consensus = extra.windows(2).any(|w| w == ["--shared", "consensus"]);
        let want = reference_merge_shared(b, &agents, 1e-5, &lambdas, want_dtype, consensus);
        let (dtype, shape, bytes) = &merged[&b.name];
        assert_eq!(*dtype, want_dtype, "{}", b.name);
        assert_eq!(shape, &b.shape, "{}", b.name);
        assert_same_bytes(
            &format!(
                "{variant:?} {:?} N={} tensor {}",
                b.dtype,
                f.agents.len(),
                b.name
            ),
            want_dtype,
            bytes,
            &want,
        );
    }
}

/// One fixture per dtype (bf16, f16, f32) and agent count in `agents`, seeded from `seed`, the
/// base in one or two shards.
fn fixtures(seed: u64, agents: &[usize]) -> Vec<Fixture> {
    let mut all = Vec::new();
    for (d, dtype) in [Dtype::BF16, Dtype::F16, Dtype::F32]
        .into_iter()
        .enumerate()
    {
        for &n in agents {
            let seed = seed + 10 * d as u64 + n as u64;
            all.push(fixture(
                seed,
                dtype,
                &odd_shapes(),
                &DENSITIES[..n],
                1 + n % 2,
            ));
        }
    }
    all
}

#[test]
fn every_variant_dtype_and_agent_count_matches_the_reference() {
    for f in fixtures(100, &[1, 2, 3, 4, 5, 6]) {
        for v in [
            Variant::Ram,
            Variant::PaperGlobal,
            Variant::OfficialGlobal,
            Variant::PaperTensor,
        ] {
            check(&f, v, None, &[]);
        }
    }
}

/// `--shared consensus` (SPEC §2b) equals the reference for RAM and RAM+ in both scopes, every
/// dtype and 2 to 5 agents, and differs from the mean where agents disagree in sign.
#[test]
fn shared_consensus_matches_the_reference() {
    let consensus = ["--shared", "consensus"];
    for f in fixtures(300, &[2, 3, 4, 5]) {
        for v in [Variant::Ram, Variant::PaperGlobal, Variant::PaperTensor] {
            check(&f, v, None, &consensus);
        }
        check(&f, Variant::PaperLayer, None, &consensus);
    }
    // The rule changes something: some shared element of opposing signs merges otherwise.
    let f = fixture(399, Dtype::F32, &odd_shapes(), &DENSITIES[..4], 1);
    let (mean, cons) = (f.dir.path().join("mean"), f.dir.path().join("cons"));
    merge_cmd(&f, &mean, &["--method", "ram"])
        .assert()
        .success();
    merge_cmd(&f, &cons, &["--method", "ram", "--shared", "consensus"])
        .assert()
        .success();
    assert_ne!(read_folder(&mean), read_folder(&cons));
}

/// `--scope layer` and `--scope module` (SPEC §3): λ from the counts of the tensor's layer (the
/// tensors outside the layers by module kind) or module kind, with the rule's global defaults;
/// the record lists λ per group.
#[test]
fn layer_and_module_scopes_match_the_reference() {
    for f in fixtures(500, &[1, 2, 4, 6]) {
        check(&f, Variant::PaperLayer, None, &[]);
        check(&f, Variant::OfficialModule, None, &[]);
    }
    let f = fixture(599, Dtype::BF16, &odd_shapes(), &DENSITIES[..3], 1);
    let out = f.dir.path().join("layer");
    merge_cmd(&f, &out, &["--method", "ram+", "--scope", "layer"])
        .assert()
        .success();
    let record: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("rlmerge_record.json")).unwrap())
            .unwrap();
    let groups: Vec<&str> = record["group_lambdas"]
        .as_array()
        .unwrap()
        .iter()
        .map(|g| g[0].as_str().unwrap())
        .collect();
    assert_eq!(groups, ["embed", "lm_head", "layer 0"]);
    assert_eq!(record["method"]["scope"], "layer");
    assert!(record["agents"][0]["lambda"].is_null());
    // `analyze --per-tensor` reports the same λ per layer as the merge used.
    let mut cmd = rlmerge();
    cmd.args(["analyze", "--json", "--per-tensor", "-q", "--base"])
        .arg(&f.base);
    for a in &f.agents {
        cmd.arg("--model").arg(a);
    }
    let o = cmd.output().unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let report: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let by_layer = report["lambda_by_layer"].as_array().unwrap();
    assert_eq!(by_layer.len(), groups.len());
    for (entry, group) in by_layer
        .iter()
        .zip(record["group_lambdas"].as_array().unwrap())
    {
        assert_eq!(entry["group"], group[0]);
        assert_eq!(entry["lambda_ram_plus_paper"], group[1]);
    }
}

#[test]
fn output_dtype_conversion_matches_the_reference() {
    let f = fixture(7, Dtype::BF16, &odd_shapes(), &DENSITIES[..3], 1);
    check(&f, Variant::PaperGlobal, Some(Dtype::F32), &[]);
    check(&f, Variant::PaperGlobal, Some(Dtype::F16), &[]);
    let g = fixture(8, Dtype::F32, &odd_shapes(), &DENSITIES[..3], 2);
    check(&g, Variant::Ram, Some(Dtype::BF16), &[]);
}

#[test]
fn tile_size_does_not_change_the_bytes() {
    let f = fixture(9, Dtype::BF16, &odd_shapes(), &DENSITIES[..4], 1);
    for tile in ["1", "7", "64", "4096"] {
        check(&f, Variant::PaperTensor, None, &["--tile-elems", tile]);
        check(
            &f,
            Variant::PaperGlobal,
            None,
            &["--tile-elems", tile, "--threads", "1"],
        );
    }
}

#[test]
fn sharded_output_has_hugging_face_layout() {
    let f = fixture(10, Dtype::BF16, &odd_shapes(), &DENSITIES[..3], 2);
    let out = f.dir.path().join("sharded");
    // 2000 bytes: the 2026-byte up_proj gets its own shard, the rest pack greedily.
    merge_cmd(&f, &out, &["--shard-size", "2000"])
        .assert()
        .success();
    let mut files: Vec<String> = std::fs::read_dir(&out)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().to_string())
        .collect();
    files.sort();
    let shards: Vec<&String> = files
        .iter()
        .filter(|f| f.ends_with(".safetensors"))
        .collect();
    let n = shards.len();
    assert!(n >= 3, "{files:?}");
    for (i, s) in shards.iter().enumerate() {
        assert_eq!(**s, format!("model-{:05}-of-{:05}.safetensors", i + 1, n));
    }
    for want in [
        "config.json",
        "generation_config.json",
        "tokenizer.json",
        "README.md",
        "rlmerge_record.json",
        "model.safetensors.index.json",
    ] {
        assert!(
            files.iter().any(|f| f == want),
            "{want} missing in {files:?}"
        );
    }
    let index: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(out.join("model.safetensors.index.json")).unwrap(),
    )
    .unwrap();
    let total: u64 = read_folder(&out)
        .values()
        .map(|(_, _, b)| b.len() as u64)
        .sum();
    assert_eq!(index["metadata"]["total_size"].as_u64().unwrap(), total);
    assert_eq!(
        index["weight_map"].as_object().unwrap().len(),
        odd_shapes().len()
    );
    // Every shard carries the {"format": "pt"} metadata.
    for s in shards {
        let data = std::fs::read(out.join(s)).unwrap();
        let (_, meta) = safetensors::SafeTensors::read_metadata(&data).unwrap();
        assert_eq!(
            meta.metadata()
                .as_ref()
                .unwrap()
                .get("format")
                .map(String::as_str),
            Some("pt")
        );
    }
    // And the content is right.
    check(&f, Variant::PaperGlobal, None, &["--shard-size", "2000"]);
}

#[test]
fn record_and_card_hold_method_parameters_lambdas_and_inputs() {
    let f = fixture(11, Dtype::BF16, &odd_shapes(), &DENSITIES[..3], 1);
    let out = f.dir.path().join("out");
    merge_cmd(
        &f,
        &out,
        &[
            "--method",
            "ram+",
            "--rule",
            "official",
            "--rescale-factor",
            "1.3",
        ],
    )
    .assert()
    .success();
    let record: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("rlmerge_record.json")).unwrap())
            .unwrap();
    assert_eq!(record["method"]["method"], "ram+");
    assert_eq!(record["method"]["rule"]["rule"], "official");
    assert_eq!(record["method"]["rule"]["rescale_factor"], 1.3);
    let counts = reference_counts(&f.base_tensors, &f.agent_tensors, 1e-5);
    for (t, a) in record["agents"].as_array().unwrap().iter().enumerate() {
        // Relative to the output (issue #45): the record names no path of this machine.
        let name = f.agents[t].file_name().unwrap().to_string_lossy();
        assert_eq!(a["path"], format!("../{name}"));
        let want = lambda_official(counts[t], 1.3);
        assert!((a["lambda"].as_f64().unwrap() - want).abs() < 1e-12);
        assert_eq!(a["counts"]["unique"].as_u64().unwrap(), counts[t].0);
        assert_eq!(a["counts"]["shared"].as_u64().unwrap(), counts[t].1);
    }
    let card = std::fs::read_to_string(out.join("README.md")).unwrap();
    // Local folders are not Hub ids: the front matter names none (tests/hub.rs: Hub ids do).
    assert!(
        card.starts_with("---\nlibrary_name: transformers\n"),
        "{card}"
    );
    let front = card.split("---\n").nth(1).unwrap();
    assert!(!front.contains("base_model:"), "{card}");
    assert!(card.contains("dtype bfloat16"), "{card}");
    assert!(
        card.contains("AutoModelForCausalLM.from_pretrained(path, torch_dtype=\"auto\")"),
        "{card}"
    );
    assert!(
        card.contains("ram+ (rule official, R = 1.3, scope global)"),
        "{card}"
    );
    // Inputs are named relative to the output, as the record names them.
    assert!(card.contains("`../agent2`"), "{card}");
    assert!(card.contains("λ = "));
    // config.json comes from the base with torch_dtype set to the output dtype.
    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("config.json")).unwrap()).unwrap();
    assert_eq!(config["model_type"], "llama");
    assert_eq!(config["torch_dtype"], "bfloat16");
}

/// A mergekit method merged from the command line saves the recipe mergekit would take
/// (`mergekit_config.yml`), the model card shows it, and `rlmerge run` of it makes the same bytes.
#[test]
fn command_line_merges_save_a_recipe_that_makes_the_same_merge() {
    let f = fixture(12, Dtype::BF16, &odd_shapes(), &DENSITIES[..3], 1);
    for (method, params) in [
        ("ties", &["weight=1", "density=0.4"][..]),
        ("dare_ties", &["weight=1", "density=0.6"][..]),
        ("linear", &["weight=0.7"][..]),
    ] {
        let out = f.dir.path().join(format!("out-{method}"));
        let args = method_args(method, params);
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        merge_cmd(&f, &out, &args).assert().success();
        let recipe = std::fs::read_to_string(out.join("mergekit_config.yml")).unwrap();
        assert!(
            recipe.contains(&format!("merge_method: {method}")),
            "{recipe}"
        );
        assert_eq!(
            recipe.contains("\nseed: 3\n"),
            method == "dare_ties",
            "{recipe}"
        );
        let card = std::fs::read_to_string(out.join("README.md")).unwrap();
        assert!(card.contains("## Reproduce"), "{card}");
        assert!(card.contains(&format!("merge_method: {method}")), "{card}");
        // Each agent's line says what it was merged with, not a pointer to nothing.
        assert!(
            card.contains("Parameters: ") && card.contains("`weight`"),
            "{card}"
        );
        let again = f.dir.path().join(format!("again-{method}"));
        // The seed is the recipe's: no --seed needed.
        rlmerge()
            .args(["run", "--quiet"])
            .arg(out.join("mergekit_config.yml"))
            .arg("-o")
            .arg(&again)
            .assert()
            .success();
        for shard in ["model.safetensors", "mergekit_config.yml"] {
            assert_eq!(
                std::fs::read(out.join(shard)).unwrap(),
                std::fs::read(again.join(shard)).unwrap(),
                "{method}: {shard}"
            );
        }
    }
    // The RAM family too (issue #45): every merge's card gives the recipe that makes it again.
    let out = f.dir.path().join("out-ram");
    merge_cmd(&f, &out, &["--method", "ram", "--shared", "consensus"])
        .assert()
        .success();
    let recipe = std::fs::read_to_string(out.join("mergekit_config.yml")).unwrap();
    assert!(
        recipe.contains("merge_method: ram\n") && recipe.contains("shared: consensus"),
        "{recipe}"
    );
}
