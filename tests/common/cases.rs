//! Small hand-checked cases: one-tensor f32 models written under a folder, a recipe run over
//! them, the merged tensor compared with the value computed by hand.

use super::{from_bytes, read_folder, rlmerge, write_folder, T};
use safetensors::tensor::Dtype;
use std::path::Path;

/// A one-tensor f32 model's tensor.
pub fn case_tensor(name: &str, shape: &[usize], values: &[f32]) -> T {
    T {
        name: name.into(),
        dtype: Dtype::F32,
        shape: shape.to_vec(),
        values: values.to_vec(),
    }
}

/// Writes one-tensor f32 models `base`, `a`, `b`, … under `dir`.
pub fn write_cases(dir: &Path, shape: &[usize], base: &[f32], agents: &[&[f32]]) {
    write_folder(
        &dir.join("base"),
        &[case_tensor("model.layers.0.w", shape, base)],
        1,
    );
    for (i, a) in agents.iter().enumerate() {
        let name = ((b'a' + i as u8) as char).to_string();
        write_folder(
            &dir.join(name),
            &[case_tensor("model.layers.0.w", shape, a)],
            1,
        );
    }
}

/// Runs recipe `yaml` in `dir` (model names relative to it) and returns the merged tensor.
pub fn run_case(dir: &Path, yaml: &str, extra: &[&str]) -> Vec<f32> {
    let recipe = dir.join("recipe.yml");
    std::fs::write(&recipe, yaml).unwrap();
    let out = dir.join("out");
    rlmerge()
        .current_dir(dir)
        .args(["run", "recipe.yml", "-q", "--force", "-o", "out"])
        .args(extra)
        .assert()
        .success();
    let (dt, _, bytes) = read_folder(&out).remove("model.layers.0.w").unwrap();
    from_bytes(dt, &bytes)
}

/// `got` equals `want` within 10⁻⁶ (relative above 1).
pub fn assert_near(got: &[f32], want: &[f32]) {
    assert_eq!(got.len(), want.len());
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(
            (g - w).abs() <= 1e-6 * w.abs().max(1.0),
            "element {i}: got {g}, want {w} ({got:?})"
        );
    }
}

/// The arguments of a sparsifying method (`ties`, `dare_ties`, `della`, `breadcrumbs`, …) at
/// weight 1 and density 0.5: the tests' usual dense-update merge.
pub const fn at_half_density(method: &'static str) -> [&'static str; 6] {
    [
        "--method",
        method,
        "--param",
        "weight=1",
        "--param",
        "density=0.5",
    ]
}

/// SVC (α = 0.1) over task arithmetic at weight 1.
pub const SVC_OVER_TASK_ARITHMETIC: [&str; 6] = [
    "--method",
    "task_arithmetic",
    "--param",
    "weight=1",
    "--svc",
    "0.1",
];
