//! LoRA agents go through the gates full agents do — one finiteness
//! rule for their matrices and their base, PEFT's own patterns, the base they were trained on,
//! slices. Each test is a hostile input that gave a silent wrong model before these gates.

mod common;
use common::*;
use safetensors::tensor::Dtype;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// A copy of the model folder `from` in `to`: its weight file `weights` passed tensor by tensor
/// through `edit_tensor` (name, f32 values), the JSON file `config` through `edit_config`, the
/// other files as they are.
fn folder_copy(
    from: &Path,
    to: &Path,
    (weights, config): (&str, &str),
    edit_tensor: &dyn Fn(&str, &mut Vec<f32>),
    edit_config: &dyn Fn(&mut serde_json::Value),
) -> PathBuf {
    std::fs::create_dir_all(to).unwrap();
    for f in std::fs::read_dir(from).unwrap() {
        let f = f.unwrap().file_name();
        if f != weights && f != config {
            std::fs::copy(from.join(&f), to.join(&f)).unwrap();
        }
    }
    let tensors = read_file(&from.join(weights));
    let edited: BTreeMap<String, (Dtype, Vec<usize>, Vec<u8>)> = tensors
        .into_iter()
        .map(|(name, (dt, shape, bytes))| {
            let mut v = from_bytes(dt, &bytes);
            edit_tensor(&name, &mut v);
            (name, (dt, shape, to_bytes(dt, &v)))
        })
        .collect();
    write_file(&to.join(weights), &edited);
    let mut json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(from.join(config)).unwrap()).unwrap();
    edit_config(&mut json);
    std::fs::write(to.join(config), json.to_string()).unwrap();
    to.to_path_buf()
}

/// A copy of the coder-lora adapter in `to`, its tensors passed through `edit_tensor` (name,
/// f32 values) and its config through `edit_config`.
fn adapter_copy(
    to: &Path,
    edit_tensor: &dyn Fn(&str, &mut Vec<f32>),
    edit_config: &dyn Fn(&mut serde_json::Value),
) -> PathBuf {
    folder_copy(
        &models().join("coder-lora"),
        to,
        ("adapter_model.safetensors", "adapter_config.json"),
        edit_tensor,
        edit_config,
    )
}

fn no_edit(_: &str, _: &mut Vec<f32>) {}

fn no_config(_: &mut serde_json::Value) {}

/// `rlmerge run RECIPE -q -o OUT ARGS…`.
fn run_recipe(recipe: &Path, out: &Path, args: &[&str]) -> std::process::Output {
    rlmerge()
        .arg("run")
        .arg(recipe)
        .args(["-q", "-o"])
        .arg(out)
        .args(args)
        .output()
        .unwrap()
}

/// NaN or ±Inf in lora_A / lora_B, a lora_alpha whose scale is no f32, and finite matrices whose
/// update s·B·A overflows: each refused for every method, on every backend, naming the adapter
/// file and tensor, with nothing written — as the same value in a full agent is.
/// The adapters of [`lora_values_pass_the_finiteness_gate_for_every_method_and_backend`], written
/// into `dir`, each with what its error names: NaN in lora_A, +Inf in lora_B, a lora_alpha of
/// 1e39, and finite matrices whose product overflows.
fn hostile_adapters(dir: &Path) -> Vec<(PathBuf, &'static [&'static str])> {
    let q0 = "base_model.model.model.layers.0.self_attn.q_proj";
    let nan_a = adapter_copy(
        &dir.join("nan-a"),
        &|n, v| {
            if n == format!("{q0}.lora_A.weight") {
                v[5] = f32::NAN;
            }
        },
        &no_config,
    );
    let inf_b = adapter_copy(
        &dir.join("inf-b"),
        &|n, v| {
            if n.ends_with("layers.2.mlp.down_proj.lora_B.weight") {
                v[3] = f32::INFINITY;
            }
        },
        &no_config,
    );
    let alpha = adapter_copy(&dir.join("alpha"), &no_edit, &|c| {
        c["lora_alpha"] = serde_json::json!(1e39)
    });
    let overflow = adapter_copy(
        &dir.join("overflow"),
        &|n, v| {
            if n == format!("{q0}.lora_A.weight") {
                v.iter_mut().for_each(|x| *x = 3e38);
            }
            if n == format!("{q0}.lora_B.weight") {
                v.iter_mut().for_each(|x| *x = 1e3);
            }
        },
        &no_config,
    );
    vec![
        (
            nan_a,
            &["lora_A.weight", "non-finite value (NaN) at element 5"],
        ),
        (
            inf_b,
            &["layers.2.mlp.down_proj.lora_B.weight", "(inf) at element 3"],
        ),
        (alpha, &["lora_alpha / r", "not a finite"]),
        (overflow, &["s·B·A", "self_attn.q_proj.weight", "overflow"]),
    ]
}

/// The methods a LoRA agent's values are gated for: each kind of read (merge kernels, scans,
/// ranks, ResMerge's whole matrices before the merge pass).
const GATED_METHODS: [&[&str]; 8] = [
    &["--method", "ram"],
    &["--method", "task_arithmetic", "--param", "weight=1"],
    &at_half_density("ties"),
    &at_half_density("dare_ties"),
    &at_half_density("della"),
    &at_half_density("breadcrumbs"),
    &["--method", "model_stock"],
    &["--method", "resmerge"],
];

/// NaN or ±Inf in lora_A / lora_B, a lora_alpha whose scale is no f32, and finite matrices whose
/// update s·B·A overflows: each refused for every method, on every backend, naming the adapter
/// file and tensor, with nothing written — as the same value in a full agent is.
#[test]
fn lora_values_pass_the_finiteness_gate_for_every_method_and_backend() {
    let d = tempfile::tempdir().unwrap();
    let cases = hostile_adapters(d.path());
    let nan_a = cases[0].0.clone();
    let mut devices = vec!["cpu"];
    if gpu_available("the GPU backend's runs") {
        devices.push("gpu");
    }
    let memory = models().join("memory");
    let mut n = 0;
    for (adapter, wants) in &cases {
        for method in GATED_METHODS {
            for device in &devices {
                let out = d.path().join(format!("out{n}"));
                n += 1;
                let mut args = method.to_vec();
                args.extend(["--device", device]);
                let o = merge_with(&[adapter.as_path(), &memory], &out, &args);
                let err = err_of(&o);
                assert_eq!(
                    o.status.code(),
                    Some(1),
                    "{adapter:?} {method:?} {device}: {err}"
                );
                for want in wants.iter() {
                    assert!(err.contains(want), "{adapter:?} {method:?}: {err}");
                }
                assert!(
                    err.contains("adapter_model.safetensors")
                        || err.contains("adapter_config.json"),
                    "{err}"
                );
                assert!(!out.exists(), "{adapter:?} {method:?}");
            }
        }
    }
    // analyze reads through the same gate.
    let o = rlmerge()
        .arg("analyze")
        .arg("--base")
        .arg(models().join("base"))
        .arg("--model")
        .arg(&nan_a)
        .arg("--model")
        .arg(&memory)
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(1), "{}", err_of(&o));
    assert!(err_of(&o).contains("lora_A.weight"), "{}", err_of(&o));
    // --allow-nonfinite lets them through by IEEE rules, as for full agents.
    let out = d.path().join("allowed");
    let o = merge_with(
        &[&nan_a, &memory],
        &out,
        &["--method", "ram", "--allow-nonfinite"],
    );
    assert!(o.status.success(), "{}", err_of(&o));
}

/// NaN in the *base* beside a LoRA agent: the agent's θ₀ is the base's tile (copied when the base
/// reads the same layer, read as a base tensor when a slice takes another layer), so the base's
/// gate is the agent's too. Refused for every method and backend, naming the base's file and the
/// tensor, with nothing written; in slices, the layer read only as the LoRA agent's θ₀ as well —
/// named as the file stores it (layer 2), with the merged tensor it was read for (layer 0).
#[test]
fn nan_in_the_base_beside_a_lora_agent_is_refused() {
    let d = tempfile::tempdir().unwrap();
    let poisoned = |layer: usize| {
        let name = format!("model.layers.{layer}.self_attn.q_proj.weight");
        folder_copy(
            &models().join("base"),
            &d.path().join(format!("base-nan{layer}")),
            ("model.safetensors", "config.json"),
            &|n, v| {
                if n == name {
                    v[7] = f32::NAN;
                }
            },
            &no_config,
        )
    };
    // The adapter names the model it was trained on: here, the poisoned copy.
    let trained_on = |base: &Path| {
        let named = base.display().to_string();
        adapter_copy(&base.with_extension("lora"), &no_edit, &|c| {
            c["base_model_name_or_path"] = named.clone().into()
        })
    };
    let base = poisoned(0);
    let adapter = trained_on(&base);
    let memory = models().join("memory");
    let mut devices = vec!["cpu"];
    if gpu_available("the GPU backend's runs") {
        devices.push("gpu");
    }
    let wants = [
        "model.layers.0.self_attn.q_proj.weight",
        "non-finite value (NaN) at element 7",
    ];
    let methods: [(&str, &[&str]); 6] = [
        ("ram", &[]),
        ("ram+", &[]),
        ("task_arithmetic", &["weight=1"]),
        ("ties", &["weight=1", "density=0.5"]),
        ("della", &["weight=1", "density=0.5"]),
        // Its scans read whole matrices before the merge pass.
        ("resmerge", &[]),
    ];
    for (i, (method, params)) in methods.into_iter().enumerate() {
        for device in &devices {
            let out = d.path().join(format!("out-{i}-{device}"));
            let o = merge_of(&base, [&adapter, &memory])
                .args(["-q", "-o"])
                .arg(&out)
                .args(method_args(method, params))
                .args(["--device", device])
                .output()
                .unwrap();
            let err = err_of(&o);
            assert_eq!(o.status.code(), Some(1), "{method} {device}: {err}");
            for want in wants {
                assert!(err.contains(want), "{method} {device}: {err}");
            }
            assert!(err.contains("base-nan0"), "{method} {device}: {err}");
            assert!(!out.exists(), "{method} {device}");
        }
    }
    // Slices whose base takes layers 0–1 twice: layer 2 of the base is read only as the LoRA
    // agent's θ₀ (the first slice's agent takes layers 2–3).
    let base = poisoned(2);
    let adapter = trained_on(&base);
    let lora = format!("{}+{}", base.display(), adapter.display());
    let recipe = d.path().join("slices.yml");
    std::fs::write(
        &recipe,
        format!(
            "slices:\n  - sources:\n    - model: {b}\n      layer_range: [0, 2]\n    - model: {lora}\n      layer_range: [2, 4]\n  - sources:\n    - model: {b}\n      layer_range: [0, 2]\n    - model: {lora}\n      layer_range: [0, 2]\nmerge_method: task_arithmetic\nbase_model: {b}\nparameters:\n  weight: 1\n",
            b = base.display()
        ),
    )
    .unwrap();
    for device in &devices {
        let out = d.path().join(format!("slices-{device}"));
        let o = run_recipe(&recipe, &out, &["--device", device]);
        let err = err_of(&o);
        assert_eq!(o.status.code(), Some(1), "slices {device}: {err}");
        assert!(
            err.contains(
                "tensor 'model.layers.2.self_attn.q_proj.weight' in \
                 "
            ) && err
                .contains("(read for the merged tensor 'model.layers.0.self_attn.q_proj.weight')")
                && err.contains("non-finite value (NaN) at element 7")
                && err.contains("base-nan2"),
            "slices {device}: {err}"
        );
        assert!(!out.exists(), "slices {device}");
    }
}

/// The agent PEFT itself would build from an adapter, by hand ([`lora_merged_by_hand`]): per
/// module, s = alpha / r with alpha from `alpha_of`; the base's config beside it.
fn lora_by_hand(adapter: &Path, out: &Path, alpha_of: &dyn Fn(&str) -> f64) {
    let scale = |module: &str, r: usize| (alpha_of(module) / r as f64) as f32;
    lora_merged_by_hand(&models().join("base"), adapter, out, &scale);
}

/// Writes an adapter config whose `alpha_pattern` is `pattern` (JSON text, keys in that order),
/// the rest of the fixture's config kept.
fn with_alpha_pattern(dir: &Path, pattern: &str, drop: &[&str]) -> PathBuf {
    let a = adapter_copy(dir, &no_edit, &|c| {
        c.as_object_mut().unwrap().remove("alpha_pattern");
        for k in drop {
            c.as_object_mut().unwrap().remove(*k);
        }
    });
    // Spliced as text: the key order is the file's, which PEFT follows.
    let text = std::fs::read_to_string(a.join("adapter_config.json")).unwrap();
    let text = format!("{{\"alpha_pattern\": {pattern}, {}", &text[1..]);
    std::fs::write(a.join("adapter_config.json"), text).unwrap();
    a
}

/// PEFT's rule for rank_pattern / alpha_pattern: each key a regular expression matched as
/// `(.*\.)?(KEY)$` against the module name, the first key in the file's order that matches
/// wins; a config without `lora_alpha` means 8. Checked against the agent built by hand.
#[test]
fn alpha_and_rank_patterns_follow_peft() {
    let d = tempfile::tempdir().unwrap();
    let same = |adapter: &Path, alpha_of: &dyn Fn(&str) -> f64, what: &str| {
        let full = d.path().join(format!("{what}-full"));
        lora_by_hand(adapter, &full, alpha_of);
        let args = [
            "--method",
            "task_arithmetic",
            "--param",
            "weight=1",
            "--out-dtype",
            "f32",
            "--raw-f32-agents",
        ];
        let (x, y) = (
            d.path().join(format!("{what}-x")),
            d.path().join(format!("{what}-y")),
        );
        let o = merge_with(&[adapter], &x, &args);
        assert!(o.status.success(), "{what}: {}", err_of(&o));
        let o = merge_with(&[&full], &y, &args);
        assert!(o.status.success(), "{what}: {}", err_of(&o));
        assert_eq!(read_folder(&x), read_folder(&y), "{what}");
    };
    // A regular expression: layer 0's q_proj alone.
    let a = with_alpha_pattern(
        &d.path().join("regex"),
        r#"{"layers\\.0\\.self_attn\\.q_proj": 32}"#,
        &[],
    );
    same(
        &a,
        &|m| {
            if m == "model.layers.0.self_attn.q_proj" {
                32.0
            } else {
                8.0
            }
        },
        "regex",
    );
    // The first key in the file's order wins, not the longest or the sorted first.
    let a = with_alpha_pattern(
        &d.path().join("order"),
        r#"{"q_proj": 2, "layers.0.self_attn.q_proj": 40}"#,
        &[],
    );
    same(
        &a,
        &|m| if m.ends_with("q_proj") { 2.0 } else { 8.0 },
        "order",
    );
    // A key matches whole module-name components: "proj" is no suffix of "q_proj" here.
    let a = with_alpha_pattern(&d.path().join("whole"), r#"{"proj": 64, "v_proj": 4}"#, &[]);
    same(
        &a,
        &|m| if m.ends_with("v_proj") { 4.0 } else { 8.0 },
        "whole",
    );
    // PEFT's default alpha: 8.
    let a = with_alpha_pattern(
        &d.path().join("noalpha"),
        r#"{"v_proj": 2}"#,
        &["lora_alpha"],
    );
    same(
        &a,
        &|m| if m.ends_with("v_proj") { 2.0 } else { 8.0 },
        "noalpha",
    );
    // PEFT's default rank: 8, which these rank-4 matrices are not.
    let a = adapter_copy(&d.path().join("norank"), &no_edit, &|c| {
        c.as_object_mut().unwrap().remove("r");
        c.as_object_mut().unwrap().remove("rank_pattern");
    });
    let o = merge_with(&[&a], &d.path().join("norank-out"), &["--method", "ram"]);
    assert_eq!(o.status.code(), Some(1));
    assert!(
        err_of(&o).contains("the config's rank for it is 8"),
        "{}",
        err_of(&o)
    );
    // A key that is no regular expression is named.
    let a = with_alpha_pattern(&d.path().join("bad"), r#"{"q_proj(": 2}"#, &[]);
    let o = merge_with(&[&a], &d.path().join("bad-out"), &["--method", "ram"]);
    assert_eq!(o.status.code(), Some(1));
    assert!(
        err_of(&o).contains("alpha_pattern key q_proj("),
        "{}",
        err_of(&o)
    );
}

/// An adapter is applied to the merge's base, and must have been trained on it: a recipe
/// without base_model cannot take a bare adapter; an adapter naming another local model is
/// refused; one naming a copy of the base, or a Hub id, is taken (the id with a warning when the
/// base folder's name differs).
#[test]
fn an_adapter_is_applied_only_to_the_model_it_was_trained_on() {
    let d = tempfile::tempdir().unwrap();
    let recipe = d.path().join("r.yml");
    std::fs::write(
        &recipe,
        format!(
            "merge_method: linear\nmodels:\n  - model: {}\n    parameters: {{weight: 0.5}}\n  - model: {}\n    parameters: {{weight: 0.5}}\n",
            models().join("tools").display(),
            models().join("coder-lora").display()
        ),
    )
    .unwrap();
    let out = d.path().join("linear");
    let o = run_recipe(&recipe, &out, &[]);
    assert_eq!(o.status.code(), Some(2), "{}", err_of(&o));
    assert!(
        err_of(&o).contains("has no base_model to apply it to"),
        "{}",
        err_of(&o)
    );
    assert!(!out.exists());

    let named = |name: &str, path: &str| {
        adapter_copy(&d.path().join(name), &no_edit, &|c| {
            c["base_model_name_or_path"] = path.into()
        })
    };
    let other = named("other", &models().join("tools").display().to_string());
    let o = merge_with(&[&other], &d.path().join("o1"), &["--method", "ram"]);
    assert_eq!(o.status.code(), Some(2), "{}", err_of(&o));
    assert!(
        err_of(&o).contains("was trained on") && err_of(&o).contains("tools"),
        "{}",
        err_of(&o)
    );
    assert!(!d.path().join("o1").exists());
    // A copy of the base (a clone elsewhere) is the same model.
    let copy = d.path().join("base-copy");
    std::fs::create_dir_all(&copy).unwrap();
    for f in ["config.json", "model.safetensors"] {
        std::fs::copy(models().join("base").join(f), copy.join(f)).unwrap();
    }
    let cloned = named("cloned", &copy.display().to_string());
    let o = merge_with(&[&cloned], &d.path().join("o2"), &["--method", "ram"]);
    assert!(o.status.success(), "{}", err_of(&o));
    // A Hub id: taken, with a warning naming it when the base folder is named otherwise.
    let hub = named("hub", "Qwen/Qwen2.5-7B-Instruct");
    let o = merge_with(&[&hub], &d.path().join("o3"), &["--method", "ram"]);
    assert!(o.status.success(), "{}", err_of(&o));
    assert!(
        err_of(&o).contains("trained on Qwen/Qwen2.5-7B-Instruct"),
        "{}",
        err_of(&o)
    );
}

/// A LoRA agent as a slice source (`BASE+ADAPTER`), per-slice merges included: the same bytes as
/// the slice merge of that adapter first merged into a full checkpoint by hand.
#[test]
fn lora_agents_work_in_slices() {
    let d = tempfile::tempdir().unwrap();
    let base = models().join("base");
    let adapter = models().join("coder-lora");
    let full = d.path().join("coder-full");
    // coder-lora's config: lora_alpha 8, alpha_pattern {v_proj: 2}.
    lora_by_hand(&adapter, &full, &|m| {
        if m.ends_with("v_proj") {
            2.0
        } else {
            8.0
        }
    });
    let recipe = |agent: &str| {
        format!(
            "slices:\n  - sources:\n    - model: {b}\n      layer_range: [0, 2]\n    - model: {agent}\n      layer_range: [0, 2]\n  - sources:\n    - model: {b}\n      layer_range: [2, 4]\n    - model: {agent}\n      layer_range: [2, 4]\nmerge_method: task_arithmetic\nbase_model: {b}\nparameters:\n  weight: 1\nout_dtype: float32\n",
            b = base.display()
        )
    };
    let mut outs = Vec::new();
    for (name, agent) in [
        ("lora", format!("{}+{}", base.display(), adapter.display())),
        ("full", full.display().to_string()),
    ] {
        let r = d.path().join(format!("{name}.yml"));
        std::fs::write(&r, recipe(&agent)).unwrap();
        let out = d.path().join(format!("out-{name}"));
        let o = run_recipe(&r, &out, &["--raw-f32-agents"]);
        assert!(o.status.success(), "{name}: {}", err_of(&o));
        outs.push(read_folder(&out));
    }
    assert_eq!(outs[0], outs[1]);
    // A bare adapter folder in slices names the fix.
    let r = d.path().join("bare.yml");
    std::fs::write(&r, recipe(&adapter.display().to_string())).unwrap();
    let o = run_recipe(&r, &d.path().join("bare"), &[]);
    assert_eq!(o.status.code(), Some(2), "{}", err_of(&o));
    assert!(
        err_of(&o).contains("write it as BASE+ADAPTER"),
        "{}",
        err_of(&o)
    );
}
