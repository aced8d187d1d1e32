//! Iso-C (SPEC §4c) against an independent reference written from the SPEC, not from the code:
//! no SVD — the polar factor U Vᵀ of Σ τ_t by Newton–Schulz iteration, and mean(S) as
//! trace(Qᵀ M) / r — on matrices; α·mean τ on tensors that are not matrices. Also: the method is
//! listed with its parameter, a recipe names it, and the GPU backend writes the CPU's bytes.

mod common;
use common::*;
use safetensors::tensor::Dtype;

/// a (m × k) · b (k × n), row-major, f64.
fn matmul(a: &[f64], b: &[f64], (m, k, n): (usize, usize, usize)) -> Vec<f64> {
    let mut c = vec![0.0; m * n];
    for i in 0..m {
        for p in 0..k {
            let x = a[i * k + p];
            for j in 0..n {
                c[i * n + j] += x * b[p * n + j];
            }
        }
    }
    c
}

fn transpose(a: &[f64], (m, n): (usize, usize)) -> Vec<f64> {
    let mut t = vec![0.0; m * n];
    for i in 0..m {
        for j in 0..n {
            t[j * m + i] = a[i * n + j];
        }
    }
    t
}

/// The orthogonal polar factor Q = U Vᵀ of a full-rank m × n matrix: Newton–Schulz,
/// X ← 1.5·X − 0.5·X Xᵀ X from X = M / ‖M‖_F (every singular value then lies in (0, 1]).
fn polar(mat: &[f64], (m, n): (usize, usize)) -> Vec<f64> {
    let norm = mat.iter().map(|x| x * x).sum::<f64>().sqrt();
    let mut x: Vec<f64> = mat.iter().map(|v| v / norm).collect();
    for _ in 0..200 {
        let xxt = matmul(&x, &transpose(&x, (m, n)), (m, n, m));
        let xxtx = matmul(&xxt, &x, (m, m, n));
        x = x
            .iter()
            .zip(&xxtx)
            .map(|(a, b)| 1.5 * a - 0.5 * b)
            .collect();
    }
    x
}

/// What SPEC §4c says the merged tensor is, from the fixture's values.
fn iso_c_by_hand(base: &T, agents: &[&T], alpha: f64) -> Vec<f32> {
    let taus: Vec<Vec<f32>> = agents
        .iter()
        .map(|a| {
            a.values
                .iter()
                .zip(&base.values)
                .map(|(x, b)| x - b)
                .collect()
        })
        .collect();
    match base.shape[..] {
        [m, n] => {
            let sum: Vec<f64> = (0..m * n)
                .map(|i| taus.iter().map(|t| f64::from(t[i])).sum())
                .collect();
            let q = polar(&sum, (m, n));
            let qtm = matmul(&transpose(&q, (m, n)), &sum, (n, m, n));
            let r = m.min(n);
            let mean_s = (0..n).map(|i| qtm[i * n + i]).sum::<f64>() / r as f64;
            base.values
                .iter()
                .zip(&q)
                .map(|(b, q)| b + (alpha * mean_s * q) as f32)
                .collect()
        }
        _ => {
            let w = 1.0 / agents.len() as f32;
            (0..base.values.len())
                .map(|i| {
                    let delta = taus.iter().fold(0.0f32, |s, t| s + t[i] * w);
                    base.values[i] + delta * alpha as f32
                })
                .collect()
        }
    }
}

fn iso_c_fixture() -> Fixture {
    fixture(
        41,
        Dtype::F32,
        &[
            ("layers.0.w", vec![24, 40]),
            ("layers.0.v", vec![40, 16]),
            ("layers.0.b", vec![40]),
        ],
        &[0.3, 0.5, 0.7],
        1,
    )
}

#[test]
fn iso_c_matches_a_reference_without_svd() {
    let f = iso_c_fixture();
    let out = f.dir.path().join("out");
    let method = ["--method", "iso_c", "--param", "scaling_factor=1.3"];
    merge_cmd(&f, &out, &[&method[..], &["--device", "cpu"]].concat())
        .assert()
        .success();
    let merged = read_folder(&out);
    for (i, base) in f.base_tensors.iter().enumerate() {
        let agents: Vec<&T> = f.agent_tensors.iter().map(|a| &a[i]).collect();
        let want = iso_c_by_hand(base, &agents, 1.3);
        let got = from_bytes(Dtype::F32, &merged[&base.name].2);
        let moved = got.iter().zip(&base.values).any(|(g, b)| g != b);
        assert!(moved, "{}: the merge changed nothing", base.name);
        for (k, (g, w)) in got.iter().zip(&want).enumerate() {
            // f64 SVD against f64 Newton–Schulz, both rounded to f32 once: a few ulp apart.
            let tol = 1e-5 * w.abs().max(1e-2);
            assert!(
                (g - w).abs() <= tol,
                "{} element {k}: got {g}, the reference {w}",
                base.name
            );
        }
    }
}

#[test]
fn iso_c_is_listed_read_from_recipes_and_the_same_on_both_backends() {
    let listed = rlmerge().args(["methods", "--json"]).output().unwrap();
    let methods: serde_json::Value = serde_json::from_slice(&listed.stdout).unwrap();
    let iso = methods
        .as_array()
        .unwrap()
        .iter()
        .find(|m| m["name"] == "iso_c")
        .expect("iso_c is listed");
    assert_eq!(iso["parameters"][0]["name"], "scaling_factor", "{iso}");

    let f = iso_c_fixture();
    let flags = f.dir.path().join("flags");
    merge_cmd(&f, &flags, &["--device", "cpu", "--method", "iso_c"])
        .assert()
        .success();
    let recipe = f.dir.path().join("iso.yml");
    let models: String = f
        .agents
        .iter()
        .map(|a| format!("  - model: {}\n", a.display()))
        .collect();
    std::fs::write(
        &recipe,
        format!(
            "merge_method: iso_c\nbase_model: {}\nparameters:\n  scaling_factor: 1.0\nmodels:\n{models}",
            f.base.display()
        ),
    )
    .unwrap();
    let from_recipe = f.dir.path().join("recipe");
    rlmerge()
        .args(["run", "-q", "--device", "cpu"])
        .arg(&recipe)
        .arg("-o")
        .arg(&from_recipe)
        .assert()
        .success();
    assert_eq!(read_folder(&flags), read_folder(&from_recipe));
    if rlmerge::backend::gpu::list_adapters().is_empty() {
        eprintln!("no GPU adapter: the GPU half of this test is skipped");
        return;
    }
    let gpu = f.dir.path().join("gpu");
    merge_cmd(&f, &gpu, &["--device", "gpu", "--method", "iso_c"])
        .assert()
        .success();
    assert_eq!(read_folder(&flags), read_folder(&gpu));
}

/// Iso-C's whole-matrix scan goes through the same finiteness gate as every read: a NaN or an
/// infinity in an agent's matrix is refused, naming the tensor, before any SVD and with nothing
/// written; with `--allow-nonfinite` a matrix that cannot be decomposed is an error naming it.
#[test]
fn iso_c_refuses_non_finite_matrices_before_decomposing_them() {
    for (bad, allow) in [(f32::NAN, false), (f32::INFINITY, false), (f32::NAN, true)] {
        let f = iso_c_fixture();
        let mut tensors = f.agent_tensors[0].clone();
        tensors[0].values[7] = bad;
        write_folder(&f.agents[0], &tensors, 1);
        let out = f.dir.path().join("out");
        let extra: &[&str] = if allow { &["--allow-nonfinite"] } else { &[] };
        let o = merge_cmd(
            &f,
            &out,
            &[&["--device", "cpu", "--method", "iso_c"], extra].concat(),
        )
        .output()
        .unwrap();
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(1), "{bad} allow={allow}: {err}");
        assert!(err.contains("layers.0.w"), "{bad} allow={allow}: {err}");
        if !allow {
            assert!(err.contains("NaN") || err.contains("inf"), "{err}");
            assert!(!err.contains("SVD"), "refused before the SVD: {err}");
        }
        assert!(!out.exists());
    }
}

/// scaling_factor is a finite number ≥ 0: anything else is a usage error naming it (exit 2).
#[test]
fn iso_c_refuses_absurd_scaling_factors() {
    let f = iso_c_fixture();
    for value in ["-1", "nan", "inf", "1e400", "much", ""] {
        let out = f.dir.path().join("out");
        let o = merge_cmd(
            &f,
            &out,
            &[
                "--method",
                "iso_c",
                "--param",
                &format!("scaling_factor={value}"),
            ],
        )
        .output()
        .unwrap();
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(2), "scaling_factor={value}: {err}");
        assert!(err.contains("scaling_factor"), "{value}: {err}");
        assert!(!out.exists());
    }
}
