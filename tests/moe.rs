//! `rlmerge moe` (issue #54 item 2): a mixture of experts from fine-tunes of one base. Against
//! mergekit-moe 0.1.5's own outputs (tests/fixtures/mergekit/expected/moe_*, made by
//! scripts/mergekit_goldens.py): every expert and base tensor byte for byte, the cheap_embed
//! routers to f32 rounding, for Mixtral and Qwen2-MoE. Then the gates every output passes: the
//! saved config remakes it, `verify` checks it, LoRA experts are their adapters applied, the bytes
//! do not depend on the thread count, bad configs and inputs are refused by name with nothing
//! written, and Ctrl-C leaves nothing.

mod common;
use common::*;
use safetensors::tensor::Dtype;
use std::path::{Path, PathBuf};

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/mergekit")
}

/// The fixture config `name` with its bare model names made absolute, written into `dir`.
fn fixture_config(name: &str, dir: &Path) -> PathBuf {
    let mut text = std::fs::read_to_string(root().join("moe").join(format!("{name}.yml"))).unwrap();
    for m in ["memory", "coder", "tools", "base"] {
        let folder = root().join("models").join(m);
        for key in ["base_model", "source_model"] {
            text = text.replace(
                &format!("{key}: {m}\n"),
                &format!("{key}: {}\n", folder.display()),
            );
        }
    }
    let path = dir.join(format!("{name}.yml"));
    std::fs::write(&path, text).unwrap();
    path
}

fn moe(config: &Path, out: &Path, extra: &[&str]) -> std::process::Output {
    rlmerge()
        .arg("moe")
        .arg(config)
        .arg(out)
        .args(extra)
        .output()
        .unwrap()
}

#[test]
fn rlmerge_moe_writes_what_mergekit_moe_writes() {
    for (name, routers) in [("mixtral", 4), ("qwen", 8)] {
        let d = tempfile::tempdir().unwrap();
        let out = d.path().join("out");
        let o = moe(&fixture_config(name, d.path()), &out, &[]);
        assert!(o.status.success(), "{name}: {}", err_of(&o));
        let want = read_file(
            &root()
                .join("expected")
                .join(format!("moe_{name}.safetensors")),
        );
        let got = read_folder(&out);
        assert_eq!(
            got.keys().collect::<Vec<_>>(),
            want.keys().collect::<Vec<_>>(),
            "{name}"
        );
        let mut compared = 0;
        for (t, (dtype, shape, bytes)) in &want {
            let (gd, gs, gb) = &got[t];
            assert_eq!((gd, gs), (dtype, shape), "{name}: {t}");
            if t.ends_with("gate.weight") {
                // Unit rows whose norms are summed in another order than torch's: each value
                // within 2 of its own ULPs and 4 of f32's at 1 (the rows' scale).
                let (a, b) = (from_bytes(*dtype, bytes), from_bytes(*dtype, gb));
                let ulp = |x: f32| match dtype {
                    Dtype::F32 => f32::EPSILON * x.abs(),
                    _ => (1.0 / 128.0) * x.abs(),
                };
                for (x, y) in a.iter().zip(&b) {
                    let tolerance = 2.0 * ulp(*x) + 4.0 * f32::EPSILON;
                    assert!(
                        (x - y).abs() <= tolerance,
                        "{name}: {t}: {x} vs mergekit's {y}"
                    );
                }
                compared += 1;
            } else {
                assert!(gb == bytes, "{name}: {t} differs from mergekit's");
            }
        }
        assert_eq!(compared, routers, "{name}");
        let want: serde_json::Value = serde_json::from_str(
            &std::fs::read_to_string(
                root()
                    .join("expected")
                    .join(format!("moe_{name}.config.json")),
            )
            .unwrap(),
        )
        .unwrap();
        let got: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(out.join("config.json")).unwrap())
                .unwrap();
        for key in [
            "architectures",
            "model_type",
            "num_local_experts",
            "num_experts",
            "num_experts_per_tok",
            "moe_intermediate_size",
            "shared_expert_intermediate_size",
            "norm_topk_prob",
            "decoder_sparse_step",
            "dtype",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
        ] {
            assert_eq!(got[key], want[key], "{name}: config.json's {key}");
        }
    }
}

#[test]
fn the_saved_config_remakes_the_moe_and_verify_checks_it() {
    let d = tempfile::tempdir().unwrap();
    let out = d.path().join("out");
    assert!(moe(&fixture_config("mixtral", d.path()), &out, &[])
        .status
        .success());
    // Run from elsewhere: the saved config names the models by their path from the output.
    let again = d.path().join("again");
    let o = rlmerge()
        .current_dir(std::env::temp_dir())
        .arg("moe")
        .arg(out.join("mergekit_moe_config.yml"))
        .arg(&again)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", err_of(&o));
    for f in [
        "model.safetensors",
        "config.json",
        "mergekit_moe_config.yml",
    ] {
        assert!(
            std::fs::read(out.join(f)).unwrap() == std::fs::read(again.join(f)).unwrap(),
            "{f}"
        );
    }
    let card = std::fs::read_to_string(out.join("README.md")).unwrap();
    assert!(card.contains("MixtralForCausalLM") && card.contains("fix the bug"));
    let verify = |extra: &[&str]| {
        rlmerge()
            .arg("verify")
            .arg(&out)
            .args(extra)
            .output()
            .unwrap()
    };
    assert!(verify(&[]).status.success(), "{}", err_of(&verify(&[])));
    // --against builds it again from the saved config and compares every output file.
    let o = verify(&["--against"]);
    assert!(o.status.success(), "{}", err_of(&o));
    let said = String::from_utf8_lossy(&o.stdout);
    assert!(
        said.contains("rebuilt") && said.contains("model.safetensors"),
        "{said}"
    );
    assert_eq!(leftovers(d.path()), Vec::<String>::new());
    // A moved input is skipped and said, as a merge's is; --against then cannot build it again.
    let record: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("rlmerge_record.json")).unwrap())
            .unwrap();
    let input = out.join(record["inputs"][1]["path"].as_str().unwrap());
    let moved = d.path().join("moved");
    std::fs::rename(&input, &moved).unwrap();
    let o = verify(&[]);
    let said = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success() && said.contains("skip  input"), "{said}");
    let o = verify(&["--against"]);
    assert_eq!(o.status.code(), Some(1), "{}", err_of(&o));
    assert!(String::from_utf8_lossy(&o.stdout).contains("missing or changed"));
    std::fs::rename(&moved, &input).unwrap();
    // A changed byte of the weights is found.
    let weights = out.join("model.safetensors");
    let mut bytes = std::fs::read(&weights).unwrap();
    let last = bytes.len() - 1;
    bytes[last] ^= 1;
    std::fs::write(&weights, bytes).unwrap();
    assert!(!verify(&[]).status.success());
    assert!(!verify(&["--against"]).status.success());
}

/// A LoRA expert is its adapter applied to its base, as `rlmerge convert BASE+ADAPTER` applies
/// it (the merge path's reading of adapters).
#[test]
fn lora_experts_are_their_adapters_applied() {
    let d = tempfile::tempdir().unwrap();
    let models = root().join("models");
    let lora = format!(
        "{}+{}",
        models.join("base").display(),
        models.join("coder-lora").display()
    );
    let config = d.path().join("moe.yml");
    std::fs::write(
        &config,
        format!(
            "base_model: {}\ngate_mode: random\ndtype: bfloat16\nexperts:\n  - source_model: \
             {lora}\n  - source_model: {}\n",
            models.join("base").display(),
            models.join("coder-lora").display()
        ),
    )
    .unwrap();
    let out = d.path().join("out");
    let o = moe(&config, &out, &["--allow-all-same"]);
    assert!(o.status.success(), "{}", err_of(&o));
    let converted = d.path().join("converted");
    let o = rlmerge()
        .args(["convert", &lora, "--out-dtype", "bfloat16", "-o"])
        .arg(&converted)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", err_of(&o));
    let (got, want) = (read_folder(&out), read_folder(&converted));
    for layer in 0..4 {
        let (_, shape, down) = &got[&format!("model.layers.{layer}.mlp.experts.down_proj")];
        assert_eq!(shape[0], 2);
        let (_, _, truth) = &want[&format!("model.layers.{layer}.mlp.down_proj.weight")];
        // Both experts (BASE+ADAPTER, and the bare adapter on the MoE's base) are the same.
        assert!(down[..truth.len()] == truth[..] && down[truth.len()..] == truth[..]);
    }
}

/// A Llama-shaped family of `dtype`: a base and two agents of `layers` dense MLPs of `(hidden,
/// intermediate)`, with an attention projection and embeddings where `attention`.
fn llama_family(
    seed: u64,
    dtype: Dtype,
    (layers, hidden, inter): (usize, usize, usize),
    attention: bool,
) -> Fixture {
    let mut shapes: Vec<(String, Vec<usize>)> = Vec::new();
    for l in 0..layers {
        if attention {
            let q = format!("model.layers.{l}.self_attn.q_proj.weight");
            shapes.push((q, vec![hidden, hidden]));
        }
        for p in ["gate_proj", "up_proj", "down_proj"] {
            let shape = match p {
                "down_proj" => vec![hidden, inter],
                _ => vec![inter, hidden],
            };
            shapes.push((format!("model.layers.{l}.mlp.{p}.weight"), shape));
        }
    }
    if attention {
        shapes.push(("model.embed_tokens.weight".into(), vec![16, hidden]));
    }
    let named: Vec<(&str, Vec<usize>)> = shapes
        .iter()
        .map(|(n, s)| (n.as_str(), s.clone()))
        .collect();
    let f = fixture(seed, dtype, &named, &[0.5, 0.5], 1);
    let config = serde_json::json!({"model_type": "llama", "num_hidden_layers": layers,
        "hidden_size": hidden, "intermediate_size": inter, "hidden_act": "silu"});
    for dir in std::iter::once(&f.base).chain(&f.agents) {
        std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
    }
    f
}

/// The hostile cases' family: f32, two layers of 8 × 12 MLPs.
fn family(seed: u64) -> Fixture {
    llama_family(seed, Dtype::F32, (2, 8, 12), true)
}

/// A config of `f`'s two agents as experts, with `extra` lines at its top level.
fn family_config(f: &Fixture, extra: &str) -> PathBuf {
    let path = f.dir.path().join("moe.yml");
    std::fs::write(
        &path,
        format!(
            "base_model: {}\ngate_mode: random\nexperts:\n  - source_model: {}\n    noise_scale: \
             0.01\n  - source_model: {}\n    residual_scale: 0.5\n{extra}",
            f.base.display(),
            f.agents[0].display(),
            f.agents[1].display()
        ),
    )
    .unwrap();
    path
}

#[test]
fn thread_counts_and_seeds_give_the_same_bytes() {
    let f = family(81);
    let config = family_config(&f, "dtype: float16\n");
    let runs: Vec<Vec<(String, Vec<u8>)>> = ["1", "2", "3"]
        .iter()
        .map(|t| {
            let out = f.dir.path().join(format!("t{t}"));
            let o = moe(&config, &out, &["--threads", t, "--seed", "5"]);
            assert!(o.status.success(), "{}", err_of(&o));
            files_of(&out, |p| p.extension().is_some_and(|e| e == "safetensors"))
        })
        .collect();
    assert_eq!(runs[0], runs[1]);
    assert_eq!(runs[0], runs[2]);
    let other = f.dir.path().join("seed6");
    assert!(moe(&config, &other, &["--seed", "6"]).status.success());
    assert_ne!(
        files_of(&other, |p| p
            .extension()
            .is_some_and(|e| e == "safetensors")),
        runs[0]
    );
}

#[test]
fn bad_configs_and_inputs_are_refused_by_name_with_nothing_written() {
    let f = family(82);
    let out = f.dir.path().join("out");
    let refused = |config: &Path, needles: &[&str], code: Option<i32>| {
        let o = moe(config, &out, &[]);
        let err = err_of(&o);
        assert!(!o.status.success(), "accepted: {needles:?}");
        if code.is_some() {
            assert_eq!(o.status.code(), code, "{err}");
        }
        for n in needles {
            assert!(err.contains(n), "{n:?} not in: {err}");
        }
        assert!(!out.exists());
        assert_eq!(leftovers(f.dir.path()), Vec::<String>::new());
    };
    let c = |extra: &str| family_config(&f, extra);
    refused(&c("gate_mode: hidden\n"), &["duplicate"], Some(2));
    let text = std::fs::read_to_string(c("")).unwrap();
    let hidden = f.dir.path().join("hidden.yml");
    std::fs::write(
        &hidden,
        text.replace("gate_mode: random", "gate_mode: hidden"),
    )
    .unwrap();
    refused(&hidden, &["forward pass", "cheap_embed"], Some(2));
    refused(
        &c("experts_per_token: 3\n"),
        &["experts_per_token"],
        Some(2),
    );
    refused(&c("routers: 3\n"), &["routers"], Some(2));
    refused(
        &c("architecture: deepseek\n"),
        &["not written by rlmerge"],
        Some(2),
    );
    refused(
        &c("architecture: qwen3\n"),
        &["Qwen3 MoE", "not llama"],
        Some(2),
    );
    refused(&c("dtype: int8\n"), &["int8"], Some(2));
    // cheap_embed needs prompts, and a tokenizer.
    let cheap = f.dir.path().join("cheap.yml");
    std::fs::write(
        &cheap,
        text.replace("gate_mode: random", "gate_mode: cheap_embed"),
    )
    .unwrap();
    refused(&cheap, &["positive_prompts"], Some(2));
    // An expert whose MLP has another shape, or holds a NaN, is named.
    let mut tensors = f.agent_tensors[0].clone();
    let i = tensors
        .iter()
        .position(|t| t.name.ends_with("1.mlp.up_proj.weight"))
        .unwrap();
    tensors[i].values[5] = f32::NAN;
    // The first expert's weights rewritten, its config the base's (write_folder writes its own).
    let expert_of = |tensors: &[T]| {
        write_folder(&f.agents[0], tensors, 1);
        std::fs::copy(f.base.join("config.json"), f.agents[0].join("config.json")).unwrap();
    };
    expert_of(&tensors);
    let config = c("");
    refused(
        &config,
        &["model.layers.1.mlp.up_proj.weight", "NaN", "element 5"],
        None,
    );
    tensors.remove(i);
    expert_of(&tensors);
    refused(
        &config,
        &["has no 'model.layers.1.mlp.up_proj.weight'"],
        Some(2),
    );
    // An expert of another activation is no fine-tune of the base.
    write_folder(&f.agents[0], &f.agent_tensors[0], 1);
    std::fs::write(
        f.agents[0].join("config.json"),
        r#"{"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 8, "intermediate_size": 12, "hidden_act": "gelu"}"#,
    )
    .unwrap();
    refused(&config, &["hidden_act"], Some(2));
}

/// A multi-stage recipe whose final stage is a MoE config: `rlmerge moe` makes the merges
/// before it and takes them as experts by name — the MoE is the one built from the same models
/// as folders; its saved config holds every stage and remakes it; `verify` skips the scratch
/// stage and `--against` builds it all again. `rlmerge run` refuses it (and a lone MoE config),
/// a MoE config that is not the final stage is refused.
#[test]
fn a_final_moe_stage_takes_the_merges_before_it() {
    let f = family(86);
    let config = family_config(&f, "");
    let text = std::fs::read_to_string(&config).unwrap();
    // A linear merge of one model at weight 1 is that model, to the bit (f32).
    let merge = format!(
        "name: merged\nmerge_method: linear\nmodels: [{{model: {}, parameters: {{weight: 1}}}}]\n",
        f.agents[0].display()
    );
    let staged = f.dir.path().join("staged.yml");
    let first = format!("source_model: {}\n", f.agents[0].display());
    let moe_doc = text.replacen(&first, "source_model: merged\n", 1);
    std::fs::write(&staged, format!("{merge}---\n{moe_doc}")).unwrap();
    let (direct, from_stages) = (f.dir.path().join("direct"), f.dir.path().join("staged-out"));
    assert!(moe(&config, &direct, &["--seed", "4"]).status.success());
    let o = moe(&staged, &from_stages, &["--seed", "4"]);
    assert!(o.status.success(), "{}", err_of(&o));
    let weights = |d: &Path| std::fs::read(d.join("model.safetensors")).unwrap();
    assert!(weights(&direct) == weights(&from_stages));
    assert_eq!(leftovers(f.dir.path()), Vec::<String>::new());
    let saved = std::fs::read_to_string(from_stages.join("mergekit_moe_config.yml")).unwrap();
    assert!(
        saved.contains("name: merged") && saved.contains("source_model: merged"),
        "{saved}"
    );
    let again = f.dir.path().join("again");
    let o = moe(&from_stages.join("mergekit_moe_config.yml"), &again, &[]);
    assert!(o.status.success(), "{}", err_of(&o));
    assert!(weights(&again) == weights(&from_stages));
    let o = rlmerge()
        .arg("verify")
        .arg(&from_stages)
        .arg("--against")
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", err_of(&o));
    assert!(String::from_utf8_lossy(&o.stdout).contains("rebuilt"));
    // -I keeps the merge.
    let kept = f.dir.path().join("kept");
    let o = moe(
        &staged,
        &f.dir.path().join("kept-out"),
        &["-I", kept.to_str().unwrap()],
    );
    assert!(o.status.success(), "{}", err_of(&o));
    assert!(kept.join("merged").join("model.safetensors").is_file());
    // rlmerge run refuses a MoE config, alone or as the final stage; a MoE stage must be last.
    let out = f.dir.path().join("out");
    for (recipe, says) in [
        (&config, "`rlmerge moe CONFIG OUT` builds it"),
        (&staged, "is a mergekit-moe config: `rlmerge moe"),
    ] {
        let o = rlmerge().arg("run").arg(recipe).arg(&out).output().unwrap();
        assert_eq!(o.status.code(), Some(2));
        assert!(err_of(&o).contains(says), "{}", err_of(&o));
    }
    let misplaced = f.dir.path().join("misplaced.yml");
    std::fs::write(&misplaced, format!("name: early\n{moe_doc}---\n{merge}")).unwrap();
    let o = moe(&misplaced, &out, &[]);
    assert_eq!(o.status.code(), Some(2));
    assert!(err_of(&o).contains("only the final"), "{}", err_of(&o));
    assert!(!out.exists());
}

#[test]
fn mixtral_refuses_attention_biases_it_would_drop() {
    let f = family(83);
    let mut tensors = f.base_tensors.clone();
    tensors.push(T {
        name: "model.layers.0.self_attn.q_proj.bias".into(),
        dtype: Dtype::F32,
        shape: vec![8],
        values: vec![0.1; 8],
    });
    write_folder(&f.base, &tensors, 1);
    std::fs::write(
        f.base.join("config.json"),
        r#"{"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 8, "intermediate_size": 12}"#,
    )
    .unwrap();
    let out = f.dir.path().join("out");
    let o = moe(&family_config(&f, ""), &out, &[]);
    assert_eq!(o.status.code(), Some(2));
    assert!(err_of(&o).contains("q_proj.bias"), "{}", err_of(&o));
    assert!(!out.exists());
}

/// An expert's residual_scale over a tensor of more elements than a chunk (4 M): every element,
/// past the chunk's end too, is the expert's value times the factor rounded to bf16, as
/// mergekit-moe computes it in the expert's dtype.
#[test]
fn residual_scales_hold_across_chunks() {
    let (h, i) = (2048, 2100);
    let f = llama_family(85, Dtype::BF16, (1, h, i), false);
    let config = f.dir.path().join("moe.yml");
    std::fs::write(
        &config,
        format!(
            "base_model: {}\ngate_mode: random\ndtype: bfloat16\nexperts:\n  - source_model: {}\n  \
             - source_model: {}\n    residual_scale: 0.3\n",
            f.base.display(),
            f.agents[0].display(),
            f.agents[1].display()
        ),
    )
    .unwrap();
    let out = f.dir.path().join("out");
    let o = moe(&config, &out, &["--threads", "2"]);
    assert!(o.status.success(), "{}", err_of(&o));
    let got = read_folder(&out);
    let (_, shape, down) = &got["model.layers.0.mlp.experts.down_proj"];
    assert_eq!(shape, &vec![2, h, i]);
    let down = from_bytes(Dtype::BF16, down);
    let theirs = |t: usize| {
        f.agent_tensors[t]
            .iter()
            .find(|x| x.name.ends_with("down_proj.weight"))
            .unwrap()
    };
    assert!(h * i > 1 << 22);
    assert_eq!(&down[..h * i], &theirs(0).values[..]);
    for (k, (&got, &x)) in down[h * i..].iter().zip(&theirs(1).values).enumerate() {
        assert_eq!(got, round_to(Dtype::BF16, x * 0.3), "element {k}");
    }
}

/// Ctrl-C in the middle of a MoE: exit 130, nothing at the output, no scratch left.
#[test]
fn an_interrupted_moe_leaves_nothing() {
    let f = llama_family(84, Dtype::F32, (2, 512, 2048), false);
    // Noise on every element: seconds of work in a debug build.
    let config = family_config(&f, "");
    let out = f.dir.path().join("out");
    let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_rlmerge"));
    cmd.args(["moe", "--threads", "1"]).arg(&config).arg(&out);
    interrupt_midway(cmd, f.dir.path(), &out);
}

/// Every path and flag `rlmerge moe` takes, pointed at the wrong thing: a config that is a
/// folder, nowhere or a FIFO (refused unread), an output inside an input or at a device, absurd
/// --threads and --shard-size, --intermediate-dir for a one-document config, --allow-nonfinite
/// letting a NaN through. Each named, exit ≠ 0, nothing written.
#[test]
fn paths_and_flags_are_checked_before_anything_is_written() {
    let f = family(87);
    let config = family_config(&f, "");
    let out = f.dir.path().join("out");
    let fifo = f.dir.path().join("fifo.yml");
    assert!(std::process::Command::new("mkfifo")
        .arg(&fifo)
        .status()
        .unwrap()
        .success());
    let inside = f.base.join("inside");
    let cases: Vec<(PathBuf, PathBuf, Vec<&str>, &str)> = vec![
        (
            f.dir.path().to_path_buf(),
            out.clone(),
            vec![],
            "is a folder",
        ),
        (
            f.dir.path().join("nowhere.yml"),
            out.clone(),
            vec![],
            "No such file",
        ),
        (fifo, out.clone(), vec![], "not a regular file"),
        (
            config.clone(),
            inside.clone(),
            vec![],
            "lies inside the input folder",
        ),
        (config.clone(), "/dev/null".into(), vec![], "already exists"),
        (
            config.clone(),
            out.clone(),
            vec!["--threads", "100000"],
            "--threads 100000",
        ),
        (
            config.clone(),
            out.clone(),
            vec!["--shard-size", "0"],
            "at least one byte",
        ),
        (
            config.clone(),
            out.clone(),
            vec!["-I", "kept"],
            "multi-stage recipe",
        ),
    ];
    for (config, to, extra, says) in cases {
        let o = moe(&config, &to, &extra);
        assert!(!o.status.success(), "accepted: {says}");
        assert!(err_of(&o).contains(says), "{says:?} not in: {}", err_of(&o));
    }
    assert!(!out.exists() && !inside.exists() && !f.dir.path().join("kept").exists());
    assert_eq!(leftovers(f.dir.path()), Vec::<String>::new());
    // --allow-nonfinite copies a NaN an expert holds, as it is.
    let mut tensors = f.agent_tensors[0].clone();
    let gate = tensors
        .iter_mut()
        .find(|t| t.name.ends_with("0.mlp.gate_proj.weight"))
        .unwrap();
    gate.values[0] = f32::NAN;
    write_folder(&f.agents[0], &tensors, 1);
    std::fs::copy(f.base.join("config.json"), f.agents[0].join("config.json")).unwrap();
    assert!(!moe(&config, &out, &[]).status.success());
    let o = moe(&config, &out, &["--allow-nonfinite"]);
    assert!(o.status.success(), "{}", err_of(&o));
    let (dtype, _, bytes) = &read_folder(&out)["model.layers.0.mlp.experts.gate_up_proj"];
    assert!(from_bytes(*dtype, bytes)[0].is_nan());
}

/// A prompt is data in the card: a fence, a heading or HTML in it neither leaves its table cell
/// nor closes the configuration's code block.
#[test]
fn hostile_prompts_stay_data_in_the_card() {
    let f = family(88);
    let hostile = "x\n```\n# Injected <img src=y>\n```";
    let config = f.dir.path().join("moe.yml");
    let text = std::fs::read_to_string(family_config(&f, "")).unwrap();
    let text = text
        .replace(
            "gate_mode: random\n",
            "gate_mode: random\nexperts_per_token: 1\n",
        )
        .replacen(
            "    noise_scale: 0.01\n",
            &format!("    noise_scale: 0.01\n    positive_prompts: [{hostile:?}]\n"),
            1,
        );
    std::fs::write(&config, text).unwrap();
    let out = f.dir.path().join("out");
    let o = moe(&config, &out, &[]);
    assert!(o.status.success(), "{}", err_of(&o));
    let card = std::fs::read_to_string(out.join("README.md")).unwrap();
    assert!(card.contains("Injected"), "{card}");
    // No heading: the table cell keeps it in a code span, the block indents and fences it.
    assert!(!card.lines().any(|l| l.starts_with("# Injected")), "{card}");
    // Every fence that opens a block is closed by a fence of its own length.
    let fences: Vec<&str> = card.lines().filter(|l| l.starts_with("```")).collect();
    assert_eq!(fences.len(), 2, "{card}");
    assert!(
        fences[0].starts_with("````") && fences[1].trim() == "````",
        "{card}"
    );
}
