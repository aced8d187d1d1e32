//! DoRA agents: a PEFT adapter with `use_dora`, whose agent is each row of θ₀ + s·B·A rescaled to
//! its magnitude m_i / ‖row i‖ (SPEC §5). Against the independent reference of the LoRA tests
//! (`common::lora_merged_by_hand`, written from SPEC §5: the adapter merged into a full f32
//! checkpoint by the test), for several methods and tilings that cut rows; and the hostile cases
//! — NaN/±Inf in m, a row of norm 0, m of a wrong shape, m without `use_dora`, `use_dora` without
//! m — each an error naming the file or tensor, nothing written.

mod common;
use common::*;
use safetensors::tensor::{Dtype, TensorView};
use std::path::{Path, PathBuf};

fn models() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/mergekit/models")
}

/// A change to an adapter's config and tensors before they are written.
type Edit<'a> = dyn Fn(&mut serde_json::Value, &mut Vec<(String, Read)>) + 'a;

/// A DoRA adapter in `dir/name`: the fixture `coder-lora`'s A and B, `use_dora` set, and for each
/// module a magnitude vector of `dtype` with `m(module, row)` (`edit` may change the config and
/// the tensors before they are written).
fn dora_adapter(
    dir: &Path,
    name: &str,
    dtype: Dtype,
    m: &dyn Fn(&str, usize) -> f32,
    edit: &Edit<'_>,
) -> PathBuf {
    let from = models().join("coder-lora");
    let to = dir.join(name);
    std::fs::create_dir_all(&to).unwrap();
    let mut tensors: Vec<(String, Read)> = read_file(&from.join("adapter_model.safetensors"))
        .into_iter()
        .collect();
    let modules: Vec<(String, usize)> = tensors
        .iter()
        .filter_map(|(k, (_, shape, _))| Some((k.strip_suffix(".lora_B.weight")?, shape[0])))
        .map(|(module, rows)| (module.to_string(), rows))
        .collect();
    for (module, rows) in modules {
        let values: Vec<f32> = (0..rows).map(|i| m(&module, i)).collect();
        tensors.push((
            format!("{module}.lora_magnitude_vector"),
            (dtype, vec![rows], to_bytes(dtype, &values)),
        ));
    }
    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(from.join("adapter_config.json")).unwrap())
            .unwrap();
    config["use_dora"] = true.into();
    edit(&mut config, &mut tensors);
    write_file(
        &to.join("adapter_model.safetensors"),
        tensors.iter().map(|(k, t)| (k, t)),
    );
    std::fs::write(to.join("adapter_config.json"), config.to_string()).unwrap();
    to
}

/// Magnitudes near the rows' own norms (the fixture's rows have norms about 0.5–3): each row
/// grows or shrinks a little, as a trained DoRA adapter's do.
fn some_m(module: &str, row: usize) -> f32 {
    let salt = module.len() * 31 + row * 17;
    0.5 + (salt % 23) as f32 / 11.0
}

fn nothing(_: &mut serde_json::Value, _: &mut Vec<(String, Read)>) {}

/// The adapter merged by hand (s = alpha / r from the config's patterns, as tests/lora.rs).
fn by_hand(adapter: &Path, out: &Path) {
    let config: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(adapter.join("adapter_config.json")).unwrap(),
    )
    .unwrap();
    // The fixture's patterns: down_proj has rank 2, v_proj alpha 2.
    let scale = |module: &str, r: usize| {
        let alpha = if module.ends_with("v_proj") {
            config["alpha_pattern"]["v_proj"].as_f64().unwrap()
        } else {
            config["lora_alpha"].as_f64().unwrap()
        };
        (alpha / r as f64) as f32
    };
    lora_merged_by_hand(&models().join("base"), adapter, out, &scale);
}

fn merge(out: &Path, agents: &[PathBuf], args: &[&str]) -> std::process::Output {
    let mut cmd = merge_of(models().join("base"), agents);
    cmd.args(["-q", "-o"]).arg(out).args(args);
    cmd.output().unwrap()
}

#[test]
fn dora_agents_merge_as_their_full_checkpoints() {
    let d = tempfile::tempdir().unwrap();
    let dora = dora_adapter(d.path(), "coder-dora", Dtype::BF16, &some_m, &nothing);
    let full = d.path().join("coder-dora-full");
    by_hand(&dora, &full);
    let memory = models().join("memory");
    let methods: [&[&str]; 3] = [
        &["--method", "ram"],
        &["--method", "task_arithmetic", "--param", "weight=0.5"],
        &at_half_density("ties"),
    ];
    for (i, args) in methods.iter().enumerate() {
        let want = d.path().join(format!("{i}-full"));
        let raw: Vec<&str> = args.iter().copied().chain(["--raw-f32-agents"]).collect();
        let o = merge(&want, &[full.clone(), memory.clone()], &raw);
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        let want = read_folder(&want);
        // Tiles of 12 f32 elements cut the 16- and 40-column rows: a row's norm is the same
        // whichever tile holds which part of it.
        for tile in [None, Some("24"), Some("4096")] {
            let got = d.path().join(format!("{i}-dora-{tile:?}"));
            let mut a = args.to_vec();
            if let Some(t) = tile {
                a.extend(["--tile-elems", t]);
            }
            let o = merge(&got, &[dora.clone(), memory.clone()], &a);
            assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
            assert_eq!(read_folder(&got), want, "{args:?}, tile {tile:?}");
        }
    }
    // The GPU merges the same tiles (the rows are rescaled as they are read, on the host).
    let (cpu, gpu) = (d.path().join("cpu"), d.path().join("gpu"));
    let agents = [dora.clone(), memory.clone()];
    assert!(merge(&cpu, &agents, &["--device", "cpu"]).status.success());
    let o = merge(&gpu, &agents, &["--device", "gpu"]);
    if o.status.success() {
        assert_eq!(read_folder(&cpu), read_folder(&gpu));
    } else {
        // No adapter here (see tests/gpu_parity.rs): nothing to compare.
        assert!(String::from_utf8_lossy(&o.stderr).contains("adapter"));
    }
    // The rescale changes the agent: the DoRA merge is not the plain LoRA merge.
    let (a, b) = (d.path().join("lora"), d.path().join("dora"));
    assert!(
        merge(&a, &[models().join("coder-lora"), memory.clone()], &[])
            .status
            .success()
    );
    assert!(merge(&b, &[dora, memory], &[]).status.success());
    assert_ne!(read_folder(&a), read_folder(&b));
}

#[test]
fn bad_dora_adapters_are_refused() {
    let d = tempfile::tempdir().unwrap();
    let q0 = "base_model.model.model.layers.0.self_attn.q_proj";
    let nan_at_3 = |module: &str, row: usize| {
        if module.ends_with("layers.1.mlp.down_proj") && row == 3 {
            f32::NAN
        } else {
            some_m(module, row)
        }
    };
    let inf = |_: &str, _: usize| f32::INFINITY;
    let cases: Vec<(PathBuf, &str)> = vec![
        (
            dora_adapter(d.path(), "nan", Dtype::F32, &nan_at_3, &nothing),
            "layers.1.mlp.down_proj.lora_magnitude_vector' in",
        ),
        (
            dora_adapter(d.path(), "inf", Dtype::BF16, &inf, &nothing),
            "lora_magnitude_vector' in",
        ),
        (
            dora_adapter(d.path(), "shape", Dtype::F32, &some_m, &|_, t| {
                let m = t
                    .iter_mut()
                    .find(|(k, _)| k.ends_with("lora_magnitude_vector"))
                    .unwrap();
                m.1 = (Dtype::F32, vec![3], to_bytes(Dtype::F32, &[1.0; 3]));
            }),
            "magnitude vector",
        ),
        (
            dora_adapter(d.path(), "no-dora", Dtype::F32, &some_m, &|c, _| {
                c["use_dora"] = false.into()
            }),
            "does not set use_dora",
        ),
        (
            dora_adapter(d.path(), "missing", Dtype::F32, &some_m, &|_, t| {
                t.retain(|(k, _)| k != &format!("{q0}.lora_magnitude_vector"))
            }),
            "has no lora_magnitude_vector",
        ),
        (
            dora_adapter(d.path(), "fan", Dtype::F32, &some_m, &|c, _| {
                c["fan_in_fan_out"] = true.into()
            }),
            "fan_in_fan_out",
        ),
    ];
    for (i, (agent, want)) in cases.into_iter().enumerate() {
        let out = d.path().join(format!("out{i}"));
        let o = merge(
            &out,
            &[agent, models().join("memory")],
            &["--method", "ram"],
        );
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(1), "case {i}: {err}");
        assert!(err.contains(want), "case {i}: {err}");
        assert!(err.contains("adapter_"), "case {i}: {err}");
        assert!(!out.exists(), "case {i}");
    }
}

/// A row whose θ₀ + s·B·A is all zeros has no direction: m / 0 is refused with the tensor, the row
/// and the adapter named, unless --allow-nonfinite (then IEEE rules, as for every input).
#[test]
fn a_row_of_norm_zero_is_refused() {
    let d = tempfile::tempdir().unwrap();
    let (rows, cols) = (4, 8);
    let name = "model.layers.0.self_attn.q_proj.weight";
    // Row 2 of the base is zero, and B's row 2 too: θ₀ + s·B·A has a zero row.
    let base = d.path().join("base");
    let w: Vec<f32> = (0..rows * cols)
        .map(|k| {
            if k / cols == 2 {
                0.0
            } else {
                0.25 + k as f32 / 64.0
            }
        })
        .collect();
    write_folder(
        &base,
        &[T {
            name: name.into(),
            dtype: Dtype::BF16,
            shape: vec![rows, cols],
            values: w,
        }],
        1,
    );
    std::fs::copy(models().join("base/config.json"), base.join("config.json")).unwrap();
    let adapter = |dir: &str, m: f32| -> PathBuf {
        let to = d.path().join(dir);
        std::fs::create_dir_all(&to).unwrap();
        let a: Vec<f32> = (0..2 * cols).map(|k| k as f32 / 16.0 - 0.5).collect();
        let b: Vec<f32> = (0..rows * 2)
            .map(|k| if k / 2 == 2 { 0.0 } else { 0.1 })
            .collect();
        let mags = vec![m; rows];
        let module = "base_model.model.model.layers.0.self_attn.q_proj";
        let (ab, bb, mb) = (
            to_bytes(Dtype::F32, &a),
            to_bytes(Dtype::F32, &b),
            to_bytes(Dtype::F32, &mags),
        );
        let views = [
            (
                format!("{module}.lora_A.weight"),
                TensorView::new(Dtype::F32, vec![2, cols], &ab).unwrap(),
            ),
            (
                format!("{module}.lora_B.weight"),
                TensorView::new(Dtype::F32, vec![rows, 2], &bb).unwrap(),
            ),
            (
                format!("{module}.lora_magnitude_vector"),
                TensorView::new(Dtype::F32, vec![rows], &mb).unwrap(),
            ),
        ];
        safetensors::serialize_to_file(views, None, &to.join("adapter_model.safetensors")).unwrap();
        let config = serde_json::json!({"peft_type": "LORA", "r": 2, "lora_alpha": 2,
            "use_dora": true, "target_modules": ["q_proj"]});
        std::fs::write(to.join("adapter_config.json"), config.to_string()).unwrap();
        to
    };
    let agents = [adapter("one", 1.0), adapter("two", 2.0)];
    let out = d.path().join("out");
    let o = merge_of(&base, &agents)
        .args(["-q", "--method", "ram", "-o"])
        .arg(&out)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(
        err.contains(name) && err.contains("‖row 2‖") && err.contains("one"),
        "{err}"
    );
    assert!(!out.exists());
    let o = merge_of(&base, &agents)
        .args(["-q", "--method", "ram", "--allow-nonfinite", "-o"])
        .arg(&out)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
}
