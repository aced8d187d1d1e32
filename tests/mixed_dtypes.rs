//! Inputs of mixed dtypes (SPEC §5): a bf16 base with an f32 agent and an f16 agent merges, for
//! every method and on both backends, to the bytes of the same merge with every input first
//! converted to f32 (exactly: bf16 and f16 are subsets of f32) and the output in the base's dtype.

mod common;
use common::*;
use safetensors::tensor::Dtype;
use std::path::{Path, PathBuf};

/// `tensors` as `dtype`, with values rounded to it (what a trainer saving in that dtype writes).
fn as_dtype(tensors: &[T], dtype: Dtype) -> Vec<T> {
    tensors
        .iter()
        .map(|t| T {
            name: t.name.clone(),
            dtype,
            shape: t.shape.clone(),
            values: from_bytes(dtype, &to_bytes(dtype, &t.values)),
        })
        .collect()
}

struct Mixed {
    f: Fixture,
    mixed: (PathBuf, Vec<PathBuf>),
    all_f32: (PathBuf, Vec<PathBuf>),
}

fn mixed() -> Mixed {
    let f = fixture(91, Dtype::BF16, &odd_shapes(), &DENSITIES[..3], 2);
    let root = f.dir.path().to_path_buf();
    // Agents 0 and 1 saved in f32 and f16; agent 2 stays bf16.
    let saved = [
        as_dtype(&f.agent_tensors[0], Dtype::F32),
        as_dtype(&f.agent_tensors[1], Dtype::F16),
        f.agent_tensors[2].clone(),
    ];
    let mut mixed = vec![];
    let mut all_f32 = vec![];
    for (t, tensors) in saved.iter().enumerate() {
        let m = root.join(format!("mixed{t}"));
        write_folder(&m, tensors, 1 + t % 2);
        mixed.push(m);
        let a = root.join(format!("f32-{t}"));
        write_folder(&a, &as_dtype(tensors, Dtype::F32), 1);
        all_f32.push(a);
    }
    let base32 = root.join("f32-base");
    write_folder(&base32, &as_dtype(&f.base_tensors, Dtype::F32), 1);
    let base = f.base.clone();
    Mixed {
        f,
        mixed: (base, mixed),
        all_f32: (base32, all_f32),
    }
}

fn merge(base: &Path, agents: &[PathBuf], out: &Path, args: &[String]) -> std::process::Output {
    let mut cmd = rlmerge();
    cmd.arg("merge").arg("-q").arg("--base").arg(base);
    for a in agents {
        cmd.arg("--model").arg(a);
    }
    cmd.arg("-o").arg(out).args(args).output().unwrap()
}

#[test]
fn mixed_dtypes_merge_as_if_every_input_were_f32() {
    let m = mixed();
    let ram: [(&str, &[&str]); 4] = [
        ("ram", &[]),
        ("ram+", &[]),
        ("ram+", &["scope=tensor"]),
        ("ram", &["shared=consensus"]),
    ];
    let mut checked = 0;
    for (i, (method, params)) in METHODS.iter().chain(&ram).enumerate() {
        let args = method_args(method, params);
        for device in devices() {
            let a = [args.clone(), vec!["--device".into(), device.into()]].concat();
            let got = m.f.dir.path().join(format!("m{i}-{device}"));
            let o = merge(&m.mixed.0, &m.mixed.1, &got, &a);
            assert!(
                o.status.success(),
                "{method}: {}",
                String::from_utf8_lossy(&o.stderr)
            );
            let want = m.f.dir.path().join(format!("w{i}-{device}"));
            let w = [a.clone(), vec!["--out-dtype".into(), "bf16".into()]].concat();
            let o = merge(&m.all_f32.0, &m.all_f32.1, &want, &w);
            assert!(
                o.status.success(),
                "{method}: {}",
                String::from_utf8_lossy(&o.stderr)
            );
            let (got, want) = (read_folder(&got), read_folder(&want));
            assert_eq!(
                got.keys().collect::<Vec<_>>(),
                want.keys().collect::<Vec<_>>()
            );
            for (name, (dt, shape, bytes)) in &got {
                assert_eq!(*dt, Dtype::BF16, "{method} {device}: the base's dtype");
                assert_eq!(
                    (dt, shape, bytes),
                    (&want[name].0, &want[name].1, &want[name].2),
                    "{method} {device}: {name}"
                );
            }
            checked += 1;
        }
    }
    assert!(checked >= METHODS.len() + 4);
}

#[test]
fn analyze_counts_mixed_dtypes_as_their_f32_values() {
    let m = mixed();
    let json = |(base, agents): &(PathBuf, Vec<PathBuf>)| -> serde_json::Value {
        let mut cmd = rlmerge();
        cmd.args(["analyze", "--json", "-q", "--base"]).arg(base);
        for a in agents {
            cmd.arg("--model").arg(a);
        }
        let mut v: serde_json::Value =
            serde_json::from_slice(&cmd.assert().success().get_output().stdout).unwrap();
        for a in v["agents"].as_array_mut().unwrap() {
            a["agent"] = serde_json::Value::Null;
        }
        v
    };
    assert_eq!(json(&m.mixed), json(&m.all_f32));
}
