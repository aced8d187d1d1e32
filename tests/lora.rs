//! LoRA agents: a PEFT adapter folder (or mergekit's BASE+ADAPTER) merged as the agent
//! θ₀ + s·B·A, computed tile by tile. Against an independent reference: the same merge with each
//! adapter first merged into a full f32 checkpoint by the test, for every method, on both
//! backends; and the errors a user can run into. (tests/mergekit_goldens.rs checks LoRA merges
//! against mergekit + PEFT themselves.)

mod common;
use common::*;
use safetensors::tensor::Dtype;
use std::path::{Path, PathBuf};

fn models() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/mergekit/models")
}

/// The adapter in `adapter` merged into the base as PEFT defines it ([`lora_merged_by_hand`]),
/// s = alpha / r (rsLoRA: alpha / √r) from the config's patterns.
fn merged_by_hand(adapter: &Path, out: &Path) {
    let config: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(adapter.join("adapter_config.json")).unwrap(),
    )
    .unwrap();
    // PEFT's rule: each key a regular expression matched as `(.*\.)?(KEY)$` (the fixtures have
    // one key per pattern, so the file's order — which PEFT follows — does not matter here;
    // tests/lora_gates.rs checks the order).
    let pattern = |key: &str, module: &str| -> Option<f64> {
        config[key]
            .as_object()?
            .iter()
            .find(|(k, _)| {
                regex::Regex::new(&format!("^(?:.*\\.)?(?:{k})$"))
                    .unwrap()
                    .is_match(module)
            })
            .and_then(|(_, v)| v.as_f64())
    };
    let scale = |module: &str, _: usize| {
        let r = pattern("rank_pattern", module).unwrap_or(config["r"].as_f64().unwrap());
        let alpha =
            pattern("alpha_pattern", module).unwrap_or(config["lora_alpha"].as_f64().unwrap());
        if config["use_rslora"].as_bool().unwrap_or(false) {
            (alpha / r.sqrt()) as f32
        } else {
            (alpha / r) as f32
        }
    };
    lora_merged_by_hand(&models().join("base"), adapter, out, &scale);
}

fn merge_cmd(out: &Path, agents: &[PathBuf], args: &[&str]) -> assert_cmd::Command {
    let mut cmd = merge_of(models().join("base"), agents);
    cmd.args(["-q", "-o"]).arg(out).args(args);
    cmd
}

fn merge(out: &Path, agents: &[PathBuf], args: &[&str]) {
    merge_cmd(out, agents, args).assert().success();
}

#[test]
fn lora_agents_merge_as_their_full_checkpoints_for_every_method() {
    let d = tempfile::tempdir().unwrap();
    let full: Vec<PathBuf> = ["coder-lora", "tools-lora"]
        .iter()
        .map(|a| {
            let out = d.path().join(format!("{a}-full"));
            merged_by_hand(&models().join(a), &out);
            out
        })
        .collect();
    // The adapter folder, and mergekit's BASE+ADAPTER.
    let lora = vec![
        models().join("coder-lora"),
        PathBuf::from(format!(
            "{}+{}",
            models().join("base").display(),
            models().join("tools-lora").display()
        )),
    ];
    // RAM, and the methods that decompose whole matrices (their scans read the LoRA agent's
    // θ₀ + s·B·A too; ResMerge's several times).
    let ram: [(&str, &[&str]); 5] = [
        ("ram", &[]),
        ("ram+", &[]),
        ("iso_c", &[]),
        ("tsv", &[]),
        ("resmerge", &["rank_topk=2"]),
    ];
    for (i, (method, params)) in METHODS.iter().chain(&ram).enumerate() {
        let owned = method_args(method, params);
        let args: Vec<&str> = owned.iter().map(String::as_str).collect();
        let (a, b) = (
            d.path().join(format!("{i}-lora")),
            d.path().join(format!("{i}-full")),
        );
        merge(&a, &lora, &args);
        // The full checkpoints' f32 values are the update itself, not master weights to round.
        let raw: Vec<&str> = args.iter().copied().chain(["--raw-f32-agents"]).collect();
        merge(&b, &full, &raw);
        assert_eq!(read_folder(&a), read_folder(&b), "{method} {params:?}");
        if i == 0 {
            // The update's kernel gives the same bits in its narrower SIMD builds.
            for cap in ["baseline", "avx2"] {
                let c = d.path().join(format!("{i}-lora-{cap}"));
                merge_cmd(&c, &lora, &args)
                    .env("RLMERGE_SIMD", cap)
                    .assert()
                    .success();
                assert_eq!(read_folder(&a), read_folder(&c), "{method}: SIMD {cap}");
            }
            // The record names the adapters, and verify --against reruns the merge.
            rlmerge()
                .args(["verify", "--against"])
                .arg(&a)
                .assert()
                .success();
        }
    }
}

#[test]
fn lora_agents_merge_to_the_same_bytes_on_the_gpu() {
    let d = tempfile::tempdir().unwrap();
    let agents = vec![models().join("coder-lora"), models().join("tools-lora")];
    for (i, args) in [&["--method", "ram+"][..], &at_half_density("ties")]
        .into_iter()
        .enumerate()
    {
        let (cpu, gpu) = (
            d.path().join(format!("cpu{i}")),
            d.path().join(format!("gpu{i}")),
        );
        merge(&cpu, &agents, &[args, &["--device", "cpu"]].concat());
        let o = rlmerge()
            .arg("merge")
            .arg("--base")
            .arg(models().join("base"))
            .arg("--model")
            .arg(&agents[0])
            .arg("--model")
            .arg(&agents[1])
            .args(["-q", "--device", "gpu", "-o"])
            .arg(&gpu)
            .args(args)
            .output()
            .unwrap();
        if !o.status.success() {
            // No adapter here (see tests/gpu_parity.rs): nothing to compare.
            assert!(String::from_utf8_lossy(&o.stderr).contains("adapter"));
            return;
        }
        assert_eq!(read_folder(&cpu), read_folder(&gpu), "{args:?}");
    }
}

/// The coder-lora adapter copied into `dir/name`, its config passed through `edit`.
fn copy(dir: &Path, name: &str, edit: &dyn Fn(&mut serde_json::Value)) -> PathBuf {
    let to = dir.join(name);
    std::fs::create_dir_all(&to).unwrap();
    let from = models().join("coder-lora");
    std::fs::copy(
        from.join("adapter_model.safetensors"),
        to.join("adapter_model.safetensors"),
    )
    .unwrap();
    let mut c: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(from.join("adapter_config.json")).unwrap())
            .unwrap();
    edit(&mut c);
    std::fs::write(to.join("adapter_config.json"), c.to_string()).unwrap();
    to
}

/// An adapter folder `dir/name` with this config text, with or without the coder-lora weights.
fn broken(dir: &Path, name: &str, config: &str, weights: bool) -> PathBuf {
    let to = dir.join(name);
    std::fs::create_dir_all(&to).unwrap();
    std::fs::write(to.join("adapter_config.json"), config).unwrap();
    if weights {
        let w = models().join("coder-lora/adapter_model.safetensors");
        std::fs::copy(w, to.join("adapter_model.safetensors")).unwrap();
    }
    to
}

/// What a user can get wrong: an adapter on another base, an adapter for modules the base lacks,
/// a rank that disagrees with the matrices or is 0, DoRA without its magnitudes. Each an error naming the file; nothing written.
#[test]
fn bad_lora_agents_are_refused() {
    let d = tempfile::tempdir().unwrap();
    let cases: Vec<(PathBuf, &str, i32)> = vec![
        (
            PathBuf::from(format!(
                "{}+{}",
                models().join("tools").display(),
                models().join("coder-lora").display()
            )),
            "is not the merge's base",
            2,
        ),
        (
            copy(d.path(), "rank", &|c| c["r"] = 8.into()),
            "the config's rank for it is 8",
            1,
        ),
        (
            copy(d.path(), "rank0", &|c| {
                c["rank_pattern"]["q_proj"] = 0.into()
            }),
            "has rank 0; a LoRA rank is at least 1",
            1,
        ),
        (
            copy(d.path(), "dora", &|c| c["use_dora"] = true.into()),
            "has no lora_magnitude_vector",
            1,
        ),
        (
            copy(d.path(), "peft", &|c| c["peft_type"] = "IA3".into()),
            "only LORA adapters",
            1,
        ),
        (
            PathBuf::from(format!(
                "{}+{}",
                models().join("base").display(),
                models().join("tools").display()
            )),
            "is not a PEFT adapter folder",
            1,
        ),
        // BASE+ with nothing after the +: a path, which does not exist (a usage error, with the
        // folder meant).
        (
            PathBuf::from(format!("{}+", models().join("base").display())),
            "does not exist (did you mean",
            2,
        ),
        (
            broken(d.path(), "json", "{\"r\": ", true),
            "not a LoRA adapter config",
            1,
        ),
        (
            broken(
                d.path(),
                "noweights",
                "{\"r\": 4, \"lora_alpha\": 8}",
                false,
            ),
            "adapter_model.safetensors",
            1,
        ),
        (
            copy(d.path(), "zero", &|c| c["r"] = 0.into()),
            "r must be at least 1",
            1,
        ),
    ];
    for (i, (agent, want, code)) in cases.into_iter().enumerate() {
        let out = d.path().join(format!("out{i}"));
        let o = rlmerge()
            .arg("merge")
            .arg("--base")
            .arg(models().join("base"))
            .arg("--model")
            .arg(&agent)
            .arg("--model")
            .arg(models().join("memory"))
            .args(["-q", "--method", "ram", "-o"])
            .arg(&out)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(code), "case {i}: {err}");
        assert!(err.contains(want), "case {i}: {err}");
        assert!(!out.exists(), "case {i}");
    }
}

/// An adapter for modules a base does not have is named as such.
#[test]
fn an_adapter_for_modules_the_base_lacks_is_named() {
    let d = tempfile::tempdir().unwrap();
    // An adapter for modules a base does not have: named.
    let other = d.path().join("other-base");
    write_folder(
        &other,
        &[T {
            name: "model.layers.0.mlp.up_proj.weight".into(),
            dtype: Dtype::BF16,
            shape: vec![40, 16],
            values: vec![0.5; 640],
        }],
        1,
    );
    std::fs::copy(models().join("base/config.json"), other.join("config.json")).unwrap();
    let o = rlmerge()
        .arg("merge")
        .arg("--base")
        .arg(&other)
        .arg("--model")
        .arg(models().join("coder-lora"))
        .args(["-q", "--method", "ram", "-o"])
        .arg(d.path().join("x"))
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("which the base") && err.contains("does not have"),
        "{err}"
    );
}

/// A LoRA agent's θ₀ is the base's tile, copied, where the base's tile holds the same layer;
/// in slices whose LoRA agent takes other layers than the base, each layer's θ₀ is that layer of
/// the base, read as such: the merge equals the same recipe with the adapter merged by hand.
#[test]
fn a_lora_agent_sliced_from_other_layers_than_the_base_merges_as_its_checkpoint() {
    let d = tempfile::tempdir().unwrap();
    let full = d.path().join("coder-full");
    merged_by_hand(&models().join("coder-lora"), &full);
    // Slices read the layer count from the agent's config: the base's.
    std::fs::copy(models().join("base/config.json"), full.join("config.json")).unwrap();
    let recipe = |agent: &Path| {
        format!(
            "slices:
  - sources:
    - model: {base}
      layer_range: [0, 2]
    - model: {agent}
      layer_range: [2, 4]
  - sources:
    - model: {base}
      layer_range: [2, 4]
    - model: {agent}
      layer_range: [0, 2]
merge_method: task_arithmetic
base_model: {base}
parameters:
  weight: 1
",
            base = models().join("base").display(),
            agent = agent.display()
        )
    };
    // In slices a LoRA agent is written BASE+ADAPTER.
    let lora = PathBuf::from(format!(
        "{}+{}",
        models().join("base").display(),
        models().join("coder-lora").display()
    ));
    let merged: Vec<_> = [lora, full]
        .iter()
        .enumerate()
        .map(|(i, agent)| {
            let yml = d.path().join(format!("recipe{i}.yml"));
            std::fs::write(&yml, recipe(agent)).unwrap();
            let out = d.path().join(format!("out{i}"));
            rlmerge()
                .arg("run")
                .arg(&yml)
                .args(["-q", "--raw-f32-agents", "-o"])
                .arg(&out)
                .assert()
                .success();
            read_folder(&out)
        })
        .collect();
    assert_eq!(merged[0], merged[1]);
    // Layer 0 of the output holds the base's layer 0 plus the adapter's layer-2 update on the
    // base's layer 2: not the base's layer 0 again.
    let base = read_folder(&models().join("base"));
    let name = "model.layers.0.self_attn.q_proj.weight";
    assert_ne!(merged[0][name], base[name]);
}

/// analyze takes LoRA agents too, and reports them as dense (a low-rank update touches every
/// element of the matrices it targets).
#[test]
fn analyze_reports_a_lora_agent() {
    let o = rlmerge()
        .arg("analyze")
        .arg("--base")
        .arg(models().join("base"))
        .arg("--model")
        .arg(models().join("coder-lora"))
        .arg("--model")
        .arg(models().join("coder"))
        .arg("--json")
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let text = v.to_string();
    assert!(text.contains("coder-lora"), "{text}");
}

/// Each pass reads every A/B pair of the adapter once, whatever the tiling and the workers, and
/// holds one at a time: many small tiles of each tensor on 4 workers (which once could decode a
/// pair twice at the same time, or again after the cache let it go, and held one pair per
/// worker).
#[test]
fn the_adapter_is_read_once_per_pass_and_one_pair_is_held_at_a_time() {
    use rlmerge::backend::cpu::CpuBackend;
    use rlmerge::engine::{merge, MergeOptions};
    use rlmerge::inputs::Inputs;
    use rlmerge::job::MethodFlags;
    let d = tempfile::tempdir().unwrap();
    let backend = CpuBackend::new(4).unwrap();
    for (i, (method, params, passes)) in [
        ("ram", vec![], 1),
        ("ram+", vec![], 2),
        ("ties", vec!["weight=1", "density=0.5"], 2),
    ]
    .into_iter()
    .enumerate()
    {
        let inputs = Inputs::open(
            &models().join("base"),
            &[models().join("coder-lora"), models().join("tools")],
        )
        .unwrap();
        let flags = MethodFlags {
            method: rlmerge::method::Kind::from_name(method),
            params: params
                .iter()
                .map(|p| rlmerge::job::parse_param(p).unwrap())
                .collect(),
            ..Default::default()
        };
        let merging = rlmerge::method::Merging::of(flags.method_for(2).unwrap());
        let mut options = MergeOptions::new(merging, &backend);
        options.pass.tile_elems = 24;
        merge(
            &inputs,
            &options,
            &backend,
            &d.path().join(format!("out{i}")),
        )
        .unwrap();
        let lora = inputs.agents[0].lora.as_ref().unwrap();
        assert_eq!(lora.pairs_read(), passes * lora.len(), "{method}");
        assert_eq!(lora.most_pairs_held(), 1, "{method}");
    }
}

/// The tiles of a LoRA merge hold the pass's tile bytes: a tensor a LoRA agent updates is read in
/// f32, so its tiles hold half the elements of a bf16 one's; the others keep theirs. One
/// tensor's A/B pairs are held beside them (checked by the test above): tiles are not cut to
/// make room for the pairs, which made two-row tiles at 7B shapes (docs/performance.md, "LoRA
/// agents").
#[test]
fn a_lora_merge_keeps_the_passs_tile_bytes() {
    use rlmerge::inputs::Inputs;
    let inputs = Inputs::open(
        &models().join("base"),
        &[models().join("coder-lora"), models().join("tools")],
    )
    .unwrap();
    let lora = inputs.agents[0].lora.as_ref().unwrap();
    let (mut updated, mut plain) = (0, 0);
    for plan in &inputs.tensors {
        // The fixtures are bf16; updated tensors are read in f32.
        let size = if lora.update(plan.name()).is_some() {
            updated += 1;
            4
        } else {
            plain += 1;
            2
        };
        for elems in [1, 24, 8192, 65536, 1 << 20] {
            let e = rlmerge::engine::tile_elems(plan, &inputs, elems);
            assert_eq!(e, (elems * 2 / size).max(1), "{} {elems}", plan.name());
        }
    }
    assert!(updated > 0 && plain > 0);
}

/// A merge without LoRA agents (all bf16) keeps the planned tiles.
#[test]
fn tiles_of_a_merge_without_lora_agents_are_the_planned_ones() {
    use rlmerge::inputs::Inputs;
    let inputs = Inputs::open(&models().join("base"), &[models().join("tools")]).unwrap();
    for plan in &inputs.tensors {
        for elems in [24, 65536, 1 << 20] {
            assert_eq!(
                rlmerge::engine::tile_elems(plan, &inputs, elems),
                elems,
                "{}",
                plan.name()
            );
        }
    }
}
