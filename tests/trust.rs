//! Trust, round two (issue #24): the input kinds and writers added after the first safety round
//! — LoRA agents, architectures, figures, Hub ids, names shown in cards and terminals, records
//! read back by `verify` — go through the same gates: one finiteness rule, one output-path rule,
//! one escaping rule. Each test is a hostile input that gave a silent wrong model, touched what
//! it should not, or hung before these gates.

mod common;
use common::*;
use safetensors::tensor::{Dtype, TensorView};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

fn models() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/mergekit/models")
}

fn err_of(o: &std::process::Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

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
    let views: Vec<(String, TensorView)> = edited
        .iter()
        .map(|(n, (dt, shape, b))| (n.clone(), TensorView::new(*dt, shape.clone(), b).unwrap()))
        .collect();
    safetensors::serialize_to_file(views, None, &to.join(weights)).unwrap();
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

fn merge_with(agents: &[&Path], out: &Path, args: &[&str]) -> std::process::Output {
    let mut cmd = merge_of(models().join("base"), agents);
    cmd.args(["-q", "-o"]).arg(out).args(args).output().unwrap()
}

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

fn gpu_available() -> bool {
    if std::env::var_os("XDG_RUNTIME_DIR").is_none() {
        std::env::set_var("XDG_RUNTIME_DIR", std::env::temp_dir());
    }
    let ok = !rlmerge::backend::gpu::list_adapters().is_empty();
    assert!(
        ok || std::env::var_os("RLMERGE_REQUIRE_GPU").is_none(),
        "RLMERGE_REQUIRE_GPU is set but wgpu sees no adapter"
    );
    ok
}

/// NaN or ±Inf in lora_A / lora_B, a lora_alpha whose scale is no f32, and finite matrices whose
/// update s·B·A overflows: each refused for every method, on every backend, naming the adapter
/// file and tensor, with nothing written — as the same value in a full agent is.
#[test]
fn lora_values_pass_the_finiteness_gate_for_every_method_and_backend() {
    let d = tempfile::tempdir().unwrap();
    let q0 = "base_model.model.model.layers.0.self_attn.q_proj";
    let nan_a = adapter_copy(
        &d.path().join("nan-a"),
        &|n, v| {
            if n == format!("{q0}.lora_A.weight") {
                v[5] = f32::NAN;
            }
        },
        &no_config,
    );
    let inf_b = adapter_copy(
        &d.path().join("inf-b"),
        &|n, v| {
            if n.ends_with("layers.2.mlp.down_proj.lora_B.weight") {
                v[3] = f32::INFINITY;
            }
        },
        &no_config,
    );
    let alpha = adapter_copy(&d.path().join("alpha"), &no_edit, &|c| {
        c["lora_alpha"] = serde_json::json!(1e39)
    });
    let overflow = adapter_copy(
        &d.path().join("overflow"),
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
    let cases: [(&Path, &[&str]); 4] = [
        (
            &nan_a,
            &["lora_A.weight", "non-finite value (NaN) at element 5"],
        ),
        (
            &inf_b,
            &["layers.2.mlp.down_proj.lora_B.weight", "(inf) at element 3"],
        ),
        (&alpha, &["lora_alpha / r", "not a finite"]),
        (&overflow, &["s·B·A", "self_attn.q_proj.weight", "overflow"]),
    ];
    let methods: [&[&str]; 8] = [
        &["--method", "ram"],
        &["--method", "task_arithmetic", "--param", "weight=1"],
        &[
            "--method",
            "ties",
            "--param",
            "weight=1",
            "--param",
            "density=0.5",
        ],
        &[
            "--method",
            "dare_ties",
            "--param",
            "weight=1",
            "--param",
            "density=0.5",
        ],
        &[
            "--method",
            "della",
            "--param",
            "weight=1",
            "--param",
            "density=0.5",
        ],
        &[
            "--method",
            "breadcrumbs",
            "--param",
            "weight=1",
            "--param",
            "density=0.5",
        ],
        &["--method", "model_stock"],
        // Its scans read whole matrices before the merge pass.
        &["--method", "resmerge"],
    ];
    let mut devices = vec!["cpu"];
    if gpu_available() {
        devices.push("gpu");
    }
    let memory = models().join("memory");
    let mut n = 0;
    for (adapter, wants) in cases {
        for method in methods {
            for device in &devices {
                let out = d.path().join(format!("out{n}"));
                n += 1;
                let mut args = method.to_vec();
                args.extend(["--device", device]);
                let o = merge_with(&[adapter, &memory], &out, &args);
                let err = err_of(&o);
                assert_eq!(
                    o.status.code(),
                    Some(1),
                    "{adapter:?} {method:?} {device}: {err}"
                );
                for want in wants {
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
    if gpu_available() {
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
    std::fs::copy(models().join("base/config.json"), out.join("config.json")).unwrap();
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

/// A model folder with `tensors` and config `config` (JSON text), at `dir`.
fn model_with(dir: &Path, tensors: &[T], config: &str) -> PathBuf {
    write_folder(dir, tensors, 1);
    std::fs::write(dir.join("config.json"), config).unwrap();
    dir.to_path_buf()
}

fn t(name: &str, shape: &[usize], v: f32) -> T {
    T {
        name: name.into(),
        dtype: Dtype::BF16,
        shape: shape.to_vec(),
        values: vec![v; shape.iter().product()],
    }
}

/// Agents of another architecture are refused up front (exit 2) with the config key that
/// differs; without a config, a shape that differs says "different architecture" and names the
/// base's key of that size.
#[test]
fn agents_of_another_architecture_are_refused() {
    let d = tempfile::tempdir().unwrap();
    let config = |model_type: &str, layers: usize, inter: usize| {
        format!(
            r#"{{"model_type": "{model_type}", "num_hidden_layers": {layers}, "hidden_size": 4, "intermediate_size": {inter}}}"#
        )
    };
    let layer = |i: usize, inter: usize, v: f32| {
        vec![
            t(
                &format!("model.layers.{i}.mlp.up_proj.weight"),
                &[inter, 4],
                v,
            ),
            t(&format!("model.layers.{i}.input_layernorm.weight"), &[4], v),
        ]
    };
    let base_tensors: Vec<T> = (0..2).flat_map(|i| layer(i, 8, 0.0)).collect();
    let base = model_with(
        &d.path().join("base"),
        &base_tensors,
        &config("llama", 2, 8),
    );
    let good_tensors: Vec<T> = (0..2).flat_map(|i| layer(i, 8, 0.5)).collect();
    let good = model_with(
        &d.path().join("good"),
        &good_tensors,
        &config("llama", 2, 8),
    );
    let qwen = model_with(
        &d.path().join("qwen"),
        &good_tensors,
        &config("qwen2", 2, 8),
    );
    let deeper_tensors: Vec<T> = (0..3).flat_map(|i| layer(i, 8, 0.5)).collect();
    let deeper = model_with(
        &d.path().join("deeper"),
        &deeper_tensors,
        &config("llama", 3, 8),
    );
    let wider_tensors: Vec<T> = (0..2).flat_map(|i| layer(i, 16, 0.5)).collect();
    let wider = d.path().join("wider");
    write_folder(&wider, &wider_tensors, 1);
    std::fs::remove_file(wider.join("config.json")).unwrap();
    let run = |agent: &Path, extra: &[&str]| {
        let out = d.path().join("out");
        let o = rlmerge()
            .arg("merge")
            .arg("--base")
            .arg(&base)
            .arg("--model")
            .arg(&good)
            .arg("--model")
            .arg(agent)
            .args(["-q", "--method", "ram", "-o"])
            .arg(&out)
            .args(extra)
            .output()
            .unwrap();
        assert!(!out.exists() || o.status.success());
        let _ = std::fs::remove_dir_all(&out);
        o
    };
    let o = run(&qwen, &[]);
    assert_eq!(o.status.code(), Some(2), "{}", err_of(&o));
    assert!(err_of(&o).contains("different architecture") && err_of(&o).contains("'model_type'"));
    let o = run(&deeper, &[]);
    assert_eq!(o.status.code(), Some(2), "{}", err_of(&o));
    assert!(
        err_of(&o).contains("'num_hidden_layers' is 3"),
        "{}",
        err_of(&o)
    );
    // --allow-missing-tensors lets tensors through, never another architecture.
    let o = run(&deeper, &["--allow-missing-tensors"]);
    assert_eq!(o.status.code(), Some(2), "{}", err_of(&o));
    let o = run(&wider, &[]);
    assert_eq!(o.status.code(), Some(1), "{}", err_of(&o));
    assert!(
        err_of(&o).contains("different architecture")
            && err_of(&o).contains("'intermediate_size' is 8"),
        "{}",
        err_of(&o)
    );
    // Analyze applies the same rule.
    let o = rlmerge()
        .arg("analyze")
        .arg("--base")
        .arg(&base)
        .arg("--model")
        .arg(&qwen)
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(2), "{}", err_of(&o));
}

/// A bare fixture: base and two agents with a tensor of a hostile name, for analyze and merge.
fn small(dir: &Path, agent_names: &[&str]) -> (PathBuf, Vec<PathBuf>) {
    let base = dir.join("base");
    write_folder(
        &base,
        &[t("model.layers.0.mlp.up_proj.weight", &[6, 4], 0.0)],
        1,
    );
    let agents = agent_names
        .iter()
        .enumerate()
        .map(|(i, n)| {
            let a = dir.join(n);
            let mut v = vec![0.0; 24];
            v[i] = 1.0;
            v[10] = 0.5 + i as f32;
            write_folder(
                &a,
                &[T {
                    name: "model.layers.0.mlp.up_proj.weight".into(),
                    dtype: Dtype::BF16,
                    shape: vec![6, 4],
                    values: v,
                }],
                1,
            );
            a
        })
        .collect();
    (base, agents)
}

fn analyze_plot(
    base: &Path,
    agents: &[PathBuf],
    plot: &Path,
    extra: &[&str],
) -> std::process::Output {
    let mut cmd = rlmerge();
    cmd.arg("analyze").arg("--base").arg(base);
    for a in agents {
        cmd.arg("--model").arg(a);
    }
    cmd.arg("--plot").arg(plot).args(["-q"]).args(extra);
    cmd.timeout(Duration::from_secs(60)).output().unwrap()
}

/// `analyze --plot` writes under the output rules: never through a symbolic link, never into a
/// FIFO (and never blocks on one), never into a merged folder (whose files verify checks), and
/// all figures at once; a figure a previous run wrote is replaced.
#[test]
fn figures_go_through_the_output_rules() {
    let d = tempfile::tempdir().unwrap();
    let (base, agents) = small(d.path(), &["a", "b"]);
    // A symbolic link named overlap.svg, to a file of the user's.
    let figs = d.path().join("figs");
    std::fs::create_dir(&figs).unwrap();
    let precious = d.path().join("precious.txt");
    std::fs::write(&precious, "keep").unwrap();
    std::os::unix::fs::symlink(&precious, figs.join("overlap.svg")).unwrap();
    let o = analyze_plot(&base, &agents, &figs, &[]);
    assert_eq!(o.status.code(), Some(2), "{}", err_of(&o));
    assert!(err_of(&o).contains("symbolic link"), "{}", err_of(&o));
    assert_eq!(std::fs::read_to_string(&precious).unwrap(), "keep");
    assert!(
        !figs.join("layers.svg").exists(),
        "nothing is written when one target is refused"
    );
    // A FIFO named layers.svg: refused at once, never opened.
    let fifo_dir = d.path().join("fifo");
    std::fs::create_dir(&fifo_dir).unwrap();
    assert!(std::process::Command::new("mkfifo")
        .arg(fifo_dir.join("layers.svg"))
        .status()
        .unwrap()
        .success());
    let start = Instant::now();
    let o = analyze_plot(&base, &agents, &fifo_dir, &[]);
    assert!(start.elapsed() < Duration::from_secs(50));
    assert_eq!(o.status.code(), Some(2), "{}", err_of(&o));
    assert!(err_of(&o).contains("FIFO"), "{}", err_of(&o));
    assert!(!fifo_dir.join("overlap.svg").exists());
    // A merged folder: its files are verify's.
    let merged = d.path().join("merged");
    let mut cmd = merge_of(&base, &agents);
    cmd.args(["-q", "--method", "ram", "-o"])
        .arg(&merged)
        .assert()
        .success();
    let o = analyze_plot(&base, &agents, &merged, &[]);
    assert_eq!(o.status.code(), Some(2), "{}", err_of(&o));
    assert!(err_of(&o).contains("merged folder"), "{}", err_of(&o));
    rlmerge().arg("verify").arg(&merged).assert().success();
    // A plain folder: written, no scratch left; again: replaced.
    let plain = d.path().join("plain");
    for _ in 0..2 {
        let o = analyze_plot(&base, &agents, &plain, &[]);
        assert!(o.status.success(), "{}", err_of(&o));
        let mut names: Vec<String> = std::fs::read_dir(&plain)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        assert_eq!(names, ["layers.svg", "overlap.svg"]);
    }
}

/// Names are data in every medium: a tensor name or folder name holding Markdown, HTML, escape
/// sequences, bidi overrides or characters XML forbids cannot forge card headings, images or
/// links, leave its code span, drive the terminal, or make an SVG invalid.
#[test]
fn hostile_names_are_escaped_in_cards_terminals_and_figures() {
    let d = tempfile::tempdir().unwrap();
    let names = [
        "coder`] ![x](http://e/x.png) <img src=x onerror=alert(1)>",
        "tools\u{1b}]0;pwned\u{7}\u{202e}gpj.exe",
        "mem\u{ffff}\u{fffe}\u{1}&<>\"'",
    ];
    let (base, agents) = small(d.path(), &names);
    // A base tensor one agent lacks, with a hostile name: it goes into the record's notes.
    let hostile_tensor = "x\n# Pwned heading\n<script>alert(1)</script>[link](http://e)\u{1b}[31m";
    let mut base_tensors = vec![t("model.layers.0.mlp.up_proj.weight", &[6, 4], 0.0)];
    base_tensors.push(t(hostile_tensor, &[3], 0.0));
    write_folder(&base, &base_tensors, 1);
    for a in &agents[..2] {
        let mut tensors = read_folder(a)
            .into_iter()
            .map(|(n, (dt, shape, b))| T {
                name: n,
                dtype: dt,
                shape,
                values: from_bytes(dt, &b),
            })
            .collect::<Vec<_>>();
        tensors.push(t(hostile_tensor, &[3], 0.25));
        write_folder(a, &tensors, 1);
    }
    let out = d.path().join("out");
    let mut cmd = merge_of(&base, &agents);
    let o = cmd
        .args(["--method", "ram+", "--allow-missing-tensors", "-o"])
        .arg(&out)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", err_of(&o));
    for (what, text) in [("stdout", &o.stdout), ("stderr", &o.stderr)] {
        let text = String::from_utf8_lossy(text);
        for bad in ['\u{1b}', '\u{7}', '\u{202e}', '\u{ffff}', '\u{1}'] {
            assert!(!text.contains(bad), "{what} holds {bad:?}: {text:?}");
        }
    }
    let card = std::fs::read_to_string(out.join("README.md")).unwrap();
    for bad in ['\u{1b}', '\u{7}', '\u{202e}', '\u{ffff}'] {
        assert!(!card.contains(bad), "card holds {bad:?}");
    }
    // Outside the front matter (YAML metadata, double-quoted) and outside code spans (literal
    // text), nothing of a name may be Markdown or HTML.
    let body = card.splitn(3, "---\n").nth(2).unwrap();
    for line in body.lines().map(without_code_spans) {
        assert_inert(&line);
    }
    // Each agent's code span holds its whole name: its fence is longer than any backtick run.
    assert!(
        card.contains(&format!("``{}``", agents[0].display())),
        "{card}"
    );
    // A mergekit method's card shows its recipe (the names in it) in a fenced block that no
    // line of it can close: outside that block, the same rules hold.
    let out = d.path().join("out-ties");
    let mut cmd = merge_of(&base, &agents);
    let o = cmd
        .args([
            "--method",
            "ties",
            "--param",
            "weight=1",
            "--param",
            "density=0.5",
        ])
        .args(["--allow-missing-tensors", "-o"])
        .arg(&out)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", err_of(&o));
    let card = std::fs::read_to_string(out.join("README.md")).unwrap();
    for bad in ['\u{1b}', '\u{7}', '\u{202e}', '\u{ffff}'] {
        assert!(!card.contains(bad), "card holds {bad:?}");
    }
    let body = card.splitn(3, "---\n").nth(2).unwrap();
    let mut fence: Option<String> = None;
    let mut fenced = 0;
    for line in body.lines() {
        let ticks: String = line.chars().take_while(|&c| c == '`').collect();
        match &fence {
            Some(f) if line == f => fence = None,
            Some(f) => {
                assert!(
                    !line.starts_with(f.as_str()),
                    "a line closes the fence: {line:?}"
                );
                fenced += 1;
                continue;
            }
            None if ticks.len() >= 3 => {
                fence = Some(ticks);
                continue;
            }
            None => {}
        }
        assert_inert(&without_code_spans(line));
    }
    assert!(fence.is_none(), "an unclosed fence");
    assert!(fenced > 5 && card.contains("merge_method: ties"), "{card}");
    // The figures are well-formed XML, with the names in them.
    let plot = d.path().join("plot");
    let o = analyze_plot(&base, &agents, &plot, &["--allow-missing-tensors"]);
    assert!(o.status.success(), "{}", err_of(&o));
    for f in ["overlap.svg", "layers.svg"] {
        let text = std::fs::read_to_string(plot.join(f)).unwrap();
        roxmltree::Document::parse(&text).unwrap_or_else(|e| panic!("{f}: {e}"));
        assert!(
            !text.contains('\u{202e}') && !text.contains('\u{ffff}'),
            "{f}"
        );
    }
}

/// `line` with its Markdown code spans (a run of n backticks to the next run of exactly n) cut.
fn without_code_spans(line: &str) -> String {
    let b = line.as_bytes();
    let run = |at: usize| b[at..].iter().take_while(|&&c| c == b'`').count();
    let (mut out, mut i) = (String::new(), 0);
    while i < b.len() {
        if b[i] != b'`' {
            out.push(b[i] as char);
            i += 1;
            continue;
        }
        let n = run(i);
        let mut j = i + n;
        let close = loop {
            match b[j..].iter().position(|&c| c == b'`') {
                None => break None,
                Some(k) => {
                    let m = run(j + k);
                    if m == n {
                        break Some(j + k + m);
                    }
                    j += k + m;
                }
            }
        };
        match close {
            Some(end) => i = end,
            None => {
                out.push_str(&line[i..i + n]);
                i += n;
            }
        }
    }
    out
}

/// A model card's line outside code spans and blocks: nothing of a name in it may be Markdown or
/// HTML — no forged heading, raw HTML or live link.
fn assert_inert(line: &str) {
    assert!(
        !line.starts_with('#') || line == "# Merged model" || line.starts_with("## "),
        "a forged heading: {line:?}"
    );
    assert!(
        !line.contains("<img") && !line.contains("<script"),
        "raw HTML: {line:?}"
    );
    assert!(!line.contains("](http://e"), "a live link: {line:?}");
}

/// A tampered record cannot send verify outside the folder: file names must be plain names.
#[test]
fn verify_refuses_records_that_name_files_outside_the_folder() {
    let d = tempfile::tempdir().unwrap();
    let (base, agents) = small(d.path(), &["a", "b"]);
    let out = d.path().join("out");
    let mut cmd = merge_of(&base, &agents);
    cmd.args(["-q", "--method", "ram", "-o"])
        .arg(&out)
        .assert()
        .success();
    let record_path = out.join("rlmerge_record.json");
    let good = std::fs::read_to_string(&record_path).unwrap();
    for name in [
        "../../etc/passwd",
        "/etc/passwd",
        "..",
        "sub/x.safetensors",
        "a\u{1b}[2J",
    ] {
        let plain = !name.contains(['/', '.']);
        for (key, pointer) in [
            ("outputs", "/outputs/0/file"),
            ("inputs", "/inputs/0/files/0/file"),
        ] {
            let mut r: serde_json::Value = serde_json::from_str(&good).unwrap();
            *r.pointer_mut(pointer).unwrap() = name.into();
            std::fs::write(&record_path, r.to_string()).unwrap();
            let o = rlmerge().arg("verify").arg(&out).output().unwrap();
            assert_eq!(o.status.code(), Some(1), "{key} {name:?}: {}", err_of(&o));
            // A plain name is looked for in the folder, and shown escaped.
            assert_eq!(
                err_of(&o).contains("not a plain file name"),
                !plain,
                "{}",
                err_of(&o)
            );
            assert!(!err_of(&o).contains('\u{1b}'));
        }
    }
    std::fs::write(&record_path, good).unwrap();
    rlmerge().arg("verify").arg(&out).assert().success();
}

/// A server that accepts connections and never answers: a download gives up after
/// HF_HUB_DOWNLOAD_TIMEOUT seconds with one line naming the endpoint and the limit, and says the
/// name was no local folder either; nothing is written.
#[test]
fn a_stalled_hub_download_times_out() {
    let d = tempfile::tempdir().unwrap();
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let held = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    {
        let held = held.clone();
        std::thread::spawn(move || {
            // Bounded: at most 16 connections, each kept open and silent until the test ends.
            for stream in listener.incoming().take(16).flatten() {
                held.lock().unwrap().push(stream);
            }
        });
    }
    let out = d.path().join("out");
    let start = Instant::now();
    let o = rlmerge()
        .arg("merge")
        .arg("--base")
        .arg(models().join("base"))
        .args([
            "--model",
            "org/never-answers",
            "-q",
            "--method",
            "ram",
            "-o",
        ])
        .arg(&out)
        .env("HF_ENDPOINT", format!("http://127.0.0.1:{port}"))
        .env("HF_HUB_CACHE", d.path().join("cache"))
        .env("HF_HUB_DOWNLOAD_TIMEOUT", "1")
        .env_remove("HF_HUB_OFFLINE")
        .timeout(Duration::from_secs(120))
        .output()
        .unwrap();
    let err = err_of(&o);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(
        start.elapsed() < Duration::from_secs(60),
        "took {:?}",
        start.elapsed()
    );
    assert!(err.contains("did not answer for 1 s"), "{err}");
    assert!(err.contains("no folder org/never-answers here"), "{err}");
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(!out.exists());
}

/// The rule between local folders and Hub ids: an existing folder wins and a note says so; a
/// name that is neither says both facts; a ref must hold a commit, not a path elsewhere.
#[test]
fn local_folders_and_hub_ids_follow_one_stated_rule() {
    let d = tempfile::tempdir().unwrap();
    let (base, agents) = small(d.path(), &["a"]);
    let org = d.path().join("org");
    std::fs::create_dir(&org).unwrap();
    std::fs::rename(&agents[0], org.join("coder")).unwrap();
    let cache = d.path().join("cache");
    let merge = |model: &str, out: &str| {
        rlmerge()
            .current_dir(d.path())
            .arg("merge")
            .arg("--base")
            .arg(&base)
            .args(["--model", model, "-q", "--method", "ram", "-o", out])
            .env("HF_HUB_CACHE", &cache)
            .env("HF_HUB_OFFLINE", "1")
            .output()
            .unwrap()
    };
    // Not in the cache: the folder, nothing to say.
    let o = merge("org/coder", "o0");
    assert!(o.status.success(), "{}", err_of(&o));
    assert!(!err_of(&o).contains("note:"), "{}", err_of(&o));
    // In the cache too: the folder, and a note saying so.
    let commit = "0123456789abcdef0123456789abcdef01234567";
    let snapshot = cache.join("models--org--coder/snapshots").join(commit);
    std::fs::create_dir_all(&snapshot).unwrap();
    for f in ["model.safetensors", "config.json"] {
        std::fs::copy(org.join("coder").join(f), snapshot.join(f)).unwrap();
    }
    std::fs::create_dir_all(cache.join("models--org--coder/refs")).unwrap();
    std::fs::write(cache.join("models--org--coder/refs/main"), commit).unwrap();
    let o = merge("org/coder", "o1");
    assert!(o.status.success(), "{}", err_of(&o));
    assert!(
        err_of(&o).contains("org/coder is a local folder, taken instead of the Hub id"),
        "{}",
        err_of(&o)
    );
    let o = merge("org/codr", "o2");
    assert_eq!(o.status.code(), Some(1), "{}", err_of(&o));
    assert!(
        err_of(&o).contains("no folder org/codr here")
            && err_of(&o).contains("Hub id org/codr@main could not be fetched"),
        "{}",
        err_of(&o)
    );
    // refs/main holding a path: not followed.
    let repo = cache.join("models--evil--model");
    std::fs::create_dir_all(repo.join("refs")).unwrap();
    std::fs::write(
        repo.join("refs/main"),
        org.join("coder").display().to_string(),
    )
    .unwrap();
    let o = merge("evil/model", "o3");
    assert_eq!(o.status.code(), Some(1), "{}", err_of(&o));
    assert!(!d.path().join("o3").exists());
}

/// Every test README's Guarantees table cites exists, under the name it gives (a name ending in
/// "…" is a prefix).
#[test]
fn every_test_readme_cites_exists() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let readme = std::fs::read_to_string(root.join("README.md")).unwrap();
    let table = readme
        .split("## Guarantees")
        .nth(1)
        .unwrap()
        .split("\n## ")
        .next()
        .unwrap();
    let cite =
        regex::Regex::new(r"`((?:tests|python/tests)/[\w/]+\.(?:rs|py))` \(([^)]*)\)").unwrap();
    let name = regex::Regex::new(r"`([A-Za-z_][\w]*(?:…)?)`").unwrap();
    let mut checked = 0;
    for c in cite.captures_iter(table) {
        let file = root.join(&c[1]);
        let text = std::fs::read_to_string(&file)
            .unwrap_or_else(|_| panic!("README cites {}, which does not exist", &c[1]));
        for n in name.captures_iter(&c[2]) {
            let n = &n[1];
            let (prefix, whole) = match n.strip_suffix('…') {
                Some(p) => (p, false),
                None => (n, true),
            };
            let found = text.lines().any(|l| {
                let l = l.trim_start();
                let def = l
                    .strip_prefix("fn ")
                    .or_else(|| l.strip_prefix("def "))
                    .or_else(|| l.strip_prefix("async fn "));
                def.is_some_and(|rest| {
                    rest.starts_with(prefix) && (!whole || rest[prefix.len()..].starts_with('('))
                })
            });
            assert!(
                found,
                "README cites {n} in {}, which has no such test",
                &c[1]
            );
            checked += 1;
        }
    }
    assert!(
        checked >= 20,
        "only {checked} cited tests found: is the table's format the same?"
    );
}

/// A multimodal-shaped model: a decoder of `layers` layers (`model.language_model.layers.N`),
/// a vision tower of 3 (`model.vision_tower.layers.N`), embeddings and lm_head; values `v`.
fn multimodal(dir: &Path, layers: usize, config_layers: usize, v: f32) -> PathBuf {
    let mut tensors = vec![t("model.language_model.embed_tokens.weight", &[8, 4], v)];
    for i in 0..3 {
        tensors.push(t(
            &format!("model.vision_tower.layers.{i}.attn.weight"),
            &[4, 4],
            v + i as f32,
        ));
    }
    for i in 0..layers {
        tensors.push(t(
            &format!("model.language_model.layers.{i}.mlp.weight"),
            &[4, 4],
            v + 10.0 * i as f32,
        ));
    }
    tensors.push(t("lm_head.weight", &[8, 4], v));
    let config = serde_json::json!({
        "model_type": "llava", "architectures": ["LlavaForConditionalGeneration"],
        "eos_token_id": [1, 2], "image_token_index": 5,
        "text_config": {"model_type": "llama", "num_hidden_layers": config_layers, "hidden_size": 4,
                        "layer_types": (0..config_layers).map(|i| format!("t{i}")).collect::<Vec<_>>()},
        "vision_config": {"num_hidden_layers": 3, "hidden_size": 4}
    });
    model_with(dir, &tensors, &config.to_string())
}

/// Slices cut the decoder's stack alone: a vision tower's layers stay whole (from the first
/// slice, with the embeddings), only per-layer config lists are rebuilt (not `eos_token_id` or
/// `architectures`, even when they are as long as the layer count), the count is set where the
/// config keeps it (`text_config`), and a config counting layers the files lack is refused.
#[test]
fn slices_cut_only_the_decoder_layers() {
    let d = tempfile::tempdir().unwrap();
    let a = multimodal(&d.path().join("a"), 2, 2, 0.0);
    let b = multimodal(&d.path().join("b"), 2, 2, 100.0);
    let recipe = d.path().join("r.yml");
    std::fs::write(
        &recipe,
        "slices:\n  - sources:\n    - model: a\n      layer_range: [0, 2]\n  - sources:\n    - model: b\n      layer_range: [1, 2]\nmerge_method: passthrough\n",
    )
    .unwrap();
    let run = |out: &str| {
        rlmerge()
            .current_dir(d.path())
            .arg("run")
            .arg(&recipe)
            .args(["-q", "-o", out])
            .output()
            .unwrap()
    };
    let o = run("out");
    assert!(o.status.success(), "{}", err_of(&o));
    let out = read_folder(&d.path().join("out"));
    let names: Vec<&str> = out.keys().map(String::as_str).collect();
    for i in 0..3 {
        assert!(
            names.contains(&format!("model.language_model.layers.{i}.mlp.weight").as_str()),
            "{names:?}"
        );
        assert!(
            names.contains(&format!("model.vision_tower.layers.{i}.attn.weight").as_str()),
            "{names:?}"
        );
    }
    assert_eq!(names.len(), 3 + 3 + 2, "{names:?}");
    // Output layer 2 is b's layer 1; the vision tower is a's.
    let b_layer1 = &read_folder(&b)["model.language_model.layers.1.mlp.weight"];
    assert_eq!(&out["model.language_model.layers.2.mlp.weight"], b_layer1);
    let a_vision = &read_folder(&a)["model.vision_tower.layers.2.attn.weight"];
    assert_eq!(&out["model.vision_tower.layers.2.attn.weight"], a_vision);
    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(d.path().join("out/config.json")).unwrap())
            .unwrap();
    assert_eq!(config["text_config"]["num_hidden_layers"], 3);
    assert_eq!(
        config["text_config"]["layer_types"],
        serde_json::json!(["t0", "t1", "t1"])
    );
    assert_eq!(config["vision_config"]["num_hidden_layers"], 3);
    assert_eq!(config["eos_token_id"], serde_json::json!([1, 2]));
    assert_eq!(
        config["architectures"],
        serde_json::json!(["LlavaForConditionalGeneration"])
    );
    // A config that claims 3 decoder layers where the files hold 2.
    multimodal(&d.path().join("a"), 2, 3, 0.0);
    std::fs::write(
        &recipe,
        "slices:\n  - sources:\n    - model: a\n      layer_range: [0, 1]\n  - sources:\n    - model: a\n      layer_range: [1, 3]\nmerge_method: passthrough\n",
    )
    .unwrap();
    let o = run("bad");
    assert_eq!(o.status.code(), Some(1), "{}", err_of(&o));
    assert!(
        err_of(&o).contains("counts 3 decoder layers"),
        "{}",
        err_of(&o)
    );
    assert!(!d.path().join("bad").exists());
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
        let o = run_recipe(&r, &out, &[]);
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

/// The smaller mistakes of issue #24 each get an error that names the problem and the fix, at
/// once, with nothing written.
#[test]
fn smaller_mistakes_say_what_is_wrong_and_the_fix() {
    let d = tempfile::tempdir().unwrap();
    let memory = models().join("memory");
    let refused = |o: std::process::Output, code: i32, wants: &[&str], out: &Path| {
        let err = err_of(&o);
        assert_eq!(o.status.code(), Some(code), "{wants:?}: {err}");
        for w in wants {
            assert!(err.contains(w), "want {w:?} in: {err}");
        }
        assert!(err.lines().count() == 1, "{err}");
        assert!(!out.exists());
    };
    // A tokenizer file that is a FIFO: refused before the merge, never opened.
    let base = d.path().join("base");
    std::fs::create_dir(&base).unwrap();
    for f in ["config.json", "model.safetensors"] {
        std::fs::copy(models().join("base").join(f), base.join(f)).unwrap();
    }
    assert!(std::process::Command::new("mkfifo")
        .arg(base.join("tokenizer.json"))
        .status()
        .unwrap()
        .success());
    let out = d.path().join("o1");
    let o = rlmerge()
        .arg("merge")
        .arg("--base")
        .arg(&base)
        .arg("--model")
        .arg(&memory)
        .args(["-q", "--method", "ram", "-o"])
        .arg(&out)
        .timeout(Duration::from_secs(60))
        .output()
        .unwrap();
    refused(o, 1, &["tokenizer.json", "not a regular file"], &out);
    // An adapter saved as a PyTorch pickle only.
    let bin = d.path().join("bin-adapter");
    std::fs::create_dir(&bin).unwrap();
    std::fs::copy(
        models().join("coder-lora/adapter_config.json"),
        bin.join("adapter_config.json"),
    )
    .unwrap();
    std::fs::write(bin.join("adapter_model.bin"), b"not read").unwrap();
    let out = d.path().join("o2");
    refused(
        merge_with(&[&bin], &out, &["--method", "ram"]),
        1,
        &["adapter_model.bin", "pickle", "safetensors"],
        &out,
    );
    // An adapter given as the base.
    let out = d.path().join("o3");
    let o = rlmerge()
        .arg("merge")
        .arg("--base")
        .arg(models().join("coder-lora"))
        .arg("--model")
        .arg(&memory)
        .args(["-q", "--method", "ram", "-o"])
        .arg(&out)
        .output()
        .unwrap();
    refused(
        o,
        1,
        &["is a LoRA adapter, not a full model", "--model"],
        &out,
    );
    // A method without a parameter it needs: before any tensor is read, exit 2, with the fix.
    let out = d.path().join("o4");
    refused(
        merge_with(&[&memory], &out, &["--method", "ties"]),
        2,
        &["needs parameter 'weight'", "--param weight="],
        &out,
    );
    // A huge value is shown short.
    let out = d.path().join("o5");
    let o = merge_with(
        &[&memory],
        &out,
        &[
            "--method",
            "ties",
            "--param",
            "weight=1",
            "--param",
            "density=1e300",
        ],
    );
    assert!(
        err_of(&o).contains("got 1e300") && err_of(&o).len() < 200,
        "{}",
        err_of(&o)
    );
    refused(o, 2, &["density"], &out);
    // A tokenizer source where the base's config vocab_size is not its embedding rows.
    let vbase = d.path().join("vbase");
    std::fs::create_dir(&vbase).unwrap();
    for f in [
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ] {
        std::fs::copy(models().join("base").join(f), vbase.join(f)).unwrap();
    }
    let mut c: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(models().join("base/config.json")).unwrap())
            .unwrap();
    c["vocab_size"] = 64.into();
    std::fs::write(vbase.join("config.json"), c.to_string()).unwrap();
    let out = d.path().join("o6");
    let o = rlmerge()
        .arg("merge")
        .arg("--base")
        .arg(&vbase)
        .arg("--model")
        .arg(models().join("tools-tok"))
        .args([
            "-q",
            "--method",
            "task_arithmetic",
            "--param",
            "weight=1",
            "--tokenizer-source",
            "union",
            "-o",
        ])
        .arg(&out)
        .output()
        .unwrap();
    refused(o, 1, &["config.json vocab_size", "says 64"], &out);
}

/// A signal that lands while the merge commits (or just after) never leaves a complete output
/// beside "nothing was written": either the run was interrupted and nothing is at the output
/// path (exit 130), or the output is complete, verifies, and the run says so (exit 0).
#[test]
fn a_signal_at_the_commit_never_misreports_the_output() {
    let d = tempfile::tempdir().unwrap();
    let (base, agents) = small(d.path(), &["a", "b"]);
    // How long one merge takes here, to aim signals at its end.
    let time_one = || {
        let start = Instant::now();
        let out = d.path().join("timing");
        let _ = std::fs::remove_dir_all(&out);
        let mut cmd = merge_of(&base, &agents);
        cmd.args(["-q", "--device", "cpu", "--method", "ram", "-o"])
            .arg(&out)
            .assert()
            .success();
        start.elapsed()
    };
    let typical = (0..3).map(|_| time_one()).min().unwrap();
    let (mut interrupted, mut completed) = (0, 0);
    for k in 0..30u32 {
        let out = d.path().join(format!("out{k}"));
        let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_rlmerge"));
        cmd.arg("merge").arg("--base").arg(&base);
        for a in &agents {
            cmd.arg("--model").arg(a);
        }
        let child = cmd
            .args(["-q", "--device", "cpu", "--method", "ram", "-o"])
            .arg(&out)
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        // From 40 % to 120 % of a typical run, spread over the tries.
        std::thread::sleep(typical * (40 + 80 * k / 29) / 100);
        unsafe { libc::kill(child.id() as i32, libc::SIGINT) };
        let o = child.wait_with_output().unwrap();
        let err = err_of(&o);
        match o.status.code() {
            Some(130) => {
                interrupted += 1;
                assert!(
                    !out.exists(),
                    "exit 130 said nothing was written, but {out:?} exists"
                );
                assert!(err.contains("nothing was written"), "{err}");
            }
            Some(0) => {
                completed += 1;
                assert!(String::from_utf8_lossy(&o.stdout).contains("merged 2 model(s)"));
                rlmerge().arg("verify").arg(&out).assert().success();
            }
            // Killed by the signal itself: it landed before main installed the handler (a
            // loaded machine can take that long to start the process), so before anything was
            // written — no scratch folder either (checked below).
            None if std::os::unix::process::ExitStatusExt::signal(&o.status)
                == Some(libc::SIGINT) =>
            {
                interrupted += 1;
                assert!(!out.exists(), "killed at start, yet {out:?} exists");
            }
            other => panic!("exit {other:?}: {err}"),
        }
        let left: Vec<String> = std::fs::read_dir(d.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|n| n.contains(".rlmerge-"))
            .collect();
        assert!(left.is_empty(), "{left:?}");
    }
    eprintln!("{interrupted} interrupted, {completed} completed");
}

/// retention.svg reads λ from the merged folder's record: a record that is a FIFO is never
/// opened (analyze finishes, without λ), and a record of other agents gives none for them — only
/// the record of a merge of these very agents gives theirs.
#[test]
fn retention_reads_lambda_only_from_a_regular_record_of_these_agents() {
    let d = tempfile::tempdir().unwrap();
    let (base, agents) = small(d.path(), &["a", "b"]);
    let merged = d.path().join("merged");
    let mut cmd = merge_of(&base, &agents);
    let o = cmd
        .args(["-q", "--method", "ram+", "-o"])
        .arg(&merged)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", err_of(&o));
    let has_lambda = |case: &str| {
        let plot = d.path().join(format!("plot-{case}"));
        let o = analyze_plot(
            &base,
            &agents,
            &plot,
            &["--merged", merged.to_str().unwrap()],
        );
        assert!(o.status.success(), "{case}: {}", err_of(&o));
        std::fs::read_to_string(plot.join("retention.svg"))
            .unwrap()
            .contains("λ = ")
    };
    assert!(has_lambda("record"), "a merge of these agents gives its λ");
    // The same weights with another merge's record: its agents are not these.
    let record = merged.join("rlmerge_record.json");
    let text = std::fs::read_to_string(&record).unwrap();
    let other = text.replace(&agents[0].display().to_string(), "/elsewhere/a");
    std::fs::write(&record, other).unwrap();
    let a_lambda = {
        let plot = d.path().join("plot-other");
        let o = analyze_plot(
            &base,
            &agents,
            &plot,
            &["--merged", merged.to_str().unwrap()],
        );
        assert!(o.status.success(), "{}", err_of(&o));
        std::fs::read_to_string(plot.join("retention.svg")).unwrap()
    };
    assert_eq!(
        a_lambda.matches("λ = ").count(),
        1,
        "only agent b is this merge's"
    );
    std::fs::remove_file(&record).unwrap();
    assert!(std::process::Command::new("mkfifo")
        .arg(&record)
        .status()
        .unwrap()
        .success());
    let start = Instant::now();
    assert!(!has_lambda("fifo"), "a FIFO record gives no λ");
    assert!(
        start.elapsed() < Duration::from_secs(30),
        "the FIFO was opened"
    );
}
