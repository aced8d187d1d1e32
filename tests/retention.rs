//! `analyze --merged`: how much of each agent's change a merged folder kept (issue #15, part 2),
//! against what each method must keep by construction, on f32 models so rounding stays far below
//! the tolerances.

mod common;
use common::*;
use safetensors::tensor::Dtype;
use serde_json::Value;
use std::path::Path;

fn shapes() -> Vec<(&'static str, Vec<usize>)> {
    vec![
        ("model.embed_tokens.weight", vec![64, 48]),
        ("model.layers.0.self_attn.q_proj.weight", vec![48, 48]),
        ("model.layers.0.mlp.up_proj.weight", vec![96, 48]),
        ("model.layers.0.input_layernorm.weight", vec![48]),
    ]
}

/// `analyze --json --merged` of the fixture's models: per agent, [unique, shared, all] as
/// (retention, share of signs kept).
fn retention(f: &Fixture, merged: &Path) -> Vec<[(f64, f64); 3]> {
    let mut cmd = rlmerge();
    cmd.args(["analyze", "--json", "-q", "--base"]).arg(&f.base);
    for a in &f.agents {
        cmd.arg("--model").arg(a);
    }
    let o = cmd.arg("--merged").arg(merged).output().unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let v: Value = serde_json::from_slice(&o.stdout).unwrap();
    v["retention"]["agents"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| {
            ["unique", "shared", "all"].map(|r| {
                (
                    a[r]["retention"].as_f64().unwrap(),
                    a[r]["sign_kept"].as_f64().unwrap(),
                )
            })
        })
        .collect()
}

fn merged(f: &Fixture, name: &str, args: &[&str]) -> std::path::PathBuf {
    let out = f.dir.path().join(name);
    merge_cmd(f, &out, args).assert().success();
    out
}

fn close(got: f64, want: f64, what: &str) {
    assert!(
        (got - want).abs() <= 1e-4 * want.abs().max(1.0),
        "{what}: {got} vs {want}"
    );
}

/// RAM keeps each unique change whole (r = 1, every sign), RAM+ scales it by the agent's λ, and
/// task arithmetic with weight w keeps w of it.
#[test]
fn retention_on_unique_elements_is_what_the_method_keeps() {
    let f = fixture(41, Dtype::F32, &shapes(), &DENSITIES[..3], 1);
    for (t, r) in retention(&f, &merged(&f, "ram", &["--method", "ram"]))
        .iter()
        .enumerate()
    {
        close(r[0].0, 1.0, &format!("ram agent {t} unique"));
        close(r[0].1, 1.0, &format!("ram agent {t} unique signs"));
    }
    let plus = merged(&f, "plus", &["--method", "ram+"]);
    let record: Value =
        serde_json::from_str(&std::fs::read_to_string(plus.join("rlmerge_record.json")).unwrap())
            .unwrap();
    for (t, r) in retention(&f, &plus).iter().enumerate() {
        let lambda = record["agents"][t]["lambda"].as_f64().unwrap();
        assert!(lambda > 1.0, "agent {t}: λ {lambda}");
        close(r[0].0, lambda, &format!("ram+ agent {t} unique"));
    }
    let ta = merged(
        &f,
        "ta",
        &["--method", "task_arithmetic", "--param", "weight=0.5"],
    );
    for (t, r) in retention(&f, &ta).iter().enumerate() {
        close(r[0].0, 0.5, &format!("task_arithmetic agent {t} unique"));
    }
}

/// A "merge" that is the base plus changes unrelated to the agents keeps about nothing of them,
/// and about half of the signs.
#[test]
fn an_unrelated_merge_retains_nothing() {
    let f = fixture(42, Dtype::F32, &shapes(), &DENSITIES[..3], 1);
    let mut z = 12345u64;
    let noise: Vec<T> = f
        .base_tensors
        .iter()
        .map(|b| T {
            values: b
                .values
                .iter()
                .map(|&v| {
                    z = z
                        .wrapping_mul(6364136223846793005)
                        .wrapping_add(1442695040888963407);
                    v + ((z >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 0.02
                })
                .collect(),
            ..b.clone()
        })
        .collect();
    let out = f.dir.path().join("noise");
    write_folder(&out, &noise, 1);
    for (t, r) in retention(&f, &out).iter().enumerate() {
        assert!(r[2].0.abs() < 0.15, "agent {t}: r = {}", r[2].0);
        assert!((r[2].1 - 0.5).abs() < 0.1, "agent {t}: signs {}", r[2].1);
    }
}

/// A merged folder that lacks a tensor, or holds another shape, is an error naming the tensor.
#[test]
fn a_merged_folder_without_the_base_tensors_is_refused() {
    let f = fixture(43, Dtype::F32, &shapes(), &DENSITIES[..2], 1);
    let out = f.dir.path().join("partial");
    write_folder(&out, &f.base_tensors[..2], 1);
    let mut cmd = rlmerge();
    cmd.args(["analyze", "-q", "--base"]).arg(&f.base);
    for a in &f.agents {
        cmd.arg("--model").arg(a);
    }
    let o = cmd.arg("--merged").arg(&out).output().unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{err}");
    // The first base tensor (in storage order) that the folder lacks is named.
    let missing = [
        "model.layers.0.mlp.up_proj.weight",
        "model.layers.0.input_layernorm.weight",
    ];
    assert!(
        missing.iter().any(|m| err.contains(m)) && err.contains("missing in the merged"),
        "{err}"
    );
}
