//! SVC, the spectral calibration modifier (SPEC §4e), against an independent reference written
//! from the SPEC with no SVD library (common::linalg: the singular triplets of Δ_m from a Jacobi
//! eigendecomposition of its Gram matrix): on top of task arithmetic, TIES and RAM, from the
//! method's own f32 output; the SPEC's toy example; flags, recipes, Python-free record and
//! verify; the GPU's bytes; and the bad values of α.

mod common;
use common::linalg::{jacobi_eigen, matmul, transpose};
use common::*;
use safetensors::tensor::Dtype;
use std::path::Path;

/// What SPEC §4e says the calibrated update of an m × n matrix is, from the merged update Δ_m and
/// the models' task vectors (row-major f64).
fn svc_by_hand(dm: &[f64], taus: &[Vec<f64>], (m, n): (usize, usize), alpha: f64) -> Vec<f64> {
    // The singular triplets of Δ_m from the eigenvectors of its smaller Gram matrix.
    let (wide, k) = (m <= n, m.min(n));
    let gram = if wide {
        matmul(dm, &transpose(dm, (m, n)), (m, n, m))
    } else {
        matmul(&transpose(dm, (m, n)), dm, (n, m, n))
    };
    let (eig, vecs) = jacobi_eigen(&gram, k);
    let s_max = eig.iter().cloned().fold(0.0f64, f64::max).sqrt();
    let floor = s_max * m.max(n) as f64 * f64::EPSILON;
    let mut update = vec![0.0f64; m * n];
    for j in 0..k {
        let sigma = eig[j].max(0.0).sqrt();
        if sigma <= floor {
            continue;
        }
        let e: Vec<f64> = (0..k).map(|i| vecs[i * k + j]).collect();
        // u = e, v = Δ_mᵀ u / σ (wide); v = e, u = Δ_m v / σ (tall).
        let (u, v): (Vec<f64>, Vec<f64>) = if wide {
            let v = (0..n)
                .map(|c| (0..m).map(|i| dm[i * n + c] * e[i]).sum::<f64>() / sigma)
                .collect();
            (e, v)
        } else {
            let u = (0..m)
                .map(|i| (0..n).map(|c| dm[i * n + c] * e[c]).sum::<f64>() / sigma)
                .collect();
            (u, e)
        };
        let mut sum = 0.0;
        for tau in taus {
            let a: Vec<f64> = (0..n)
                .map(|c| (0..m).map(|i| u[i] * tau[i * n + c]).sum())
                .collect();
            let norm2: f64 = a.iter().map(|x| x * x).sum();
            let dot: f64 = a.iter().zip(&v).map(|(x, y)| x * y * sigma).sum();
            sum += if norm2 > 0.0 {
                (dot / norm2).max(alpha)
            } else {
                alpha
            };
        }
        let gamma = taus.len() as f64 / sum;
        for i in 0..m {
            for c in 0..n {
                update[i * n + c] += gamma * sigma * u[i] * v[c];
            }
        }
    }
    update
}

/// SPEC §4e's toy example: Δ_m = diag(2, 1) from τ₁ = [[1, 0], [0, 0]], τ₂ = [[1, 0], [0, 1]]
/// becomes diag(1, 1.8182).
#[test]
fn the_svc_reference_gives_the_spec_example() {
    let taus = [vec![1.0, 0.0, 0.0, 0.0], vec![1.0, 0.0, 0.0, 1.0]];
    let got = svc_by_hand(&[2.0, 0.0, 0.0, 1.0], &taus, (2, 2), 0.1);
    let want = [1.0, 0.0, 0.0, 2.0 / 1.1];
    for (g, w) in got.iter().zip(want) {
        assert!((g - w).abs() < 1e-9, "{got:?}");
    }
}

fn values(dir: &Path, name: &str) -> Vec<f32> {
    from_bytes(Dtype::F32, &read_folder(dir)[name].2)
}

/// For each method, the merge with `--svc 0.3` equals the reference computed from the same
/// merge without it (its f32 output is the method's merged tensor): matrices calibrated, the
/// vector as the method merged it, bit for bit.
#[test]
fn svc_calibrates_what_any_method_merged() {
    let f = f32_matrices(57);
    let methods: [&[&str]; 3] = [
        &["--method", "task_arithmetic", "--param", "weight=1"],
        &[
            "--method",
            "ties",
            "--param",
            "weight=1",
            "--param",
            "density=0.6",
        ],
        &["--method", "ram"],
    ];
    for (i, method) in methods.iter().enumerate() {
        let plain = f.dir.path().join(format!("plain{i}"));
        let svc = f.dir.path().join(format!("svc{i}"));
        merge_cmd(&f, &plain, &[&method[..], &["--device", "cpu"]].concat())
            .assert()
            .success();
        merge_cmd(
            &f,
            &svc,
            &[&method[..], &["--device", "cpu", "--svc", "0.3"]].concat(),
        )
        .assert()
        .success();
        for (k, base) in f.base_tensors.iter().enumerate() {
            let merged = values(&plain, &base.name);
            let got = values(&svc, &base.name);
            let [m, n] = base.shape[..] else {
                assert_eq!(got, merged, "{method:?} {}: not a matrix", base.name);
                continue;
            };
            let dm: Vec<f64> = merged
                .iter()
                .zip(&base.values)
                .map(|(x, b)| f64::from(x - b))
                .collect();
            let want = base_plus(
                &base.values,
                &svc_by_hand(&dm, &taus_of(&f, k), (m, n), 0.3),
            );
            assert!(
                got != merged,
                "{method:?} {}: SVC changed nothing",
                base.name
            );
            assert_close(&format!("{method:?} {}", base.name), &got, &want, 1e-5);
        }
    }
}

/// `--svc` and a recipe's `svc: {alpha}` make the same bytes; the record keeps α, verify
/// --against recomputes it, the saved recipe reruns it; the GPU writes the CPU's bytes.
#[test]
fn svc_from_flags_recipes_and_the_record_alike_and_on_both_backends() {
    let f = f32_matrices(57);
    let flags = f.dir.path().join("flags");
    let method = [&at_half_density("ties")[..], &["--svc", "0.2"]].concat();
    merge_cmd(&f, &flags, &[&method[..], &["--device", "cpu"]].concat())
        .assert()
        .success();
    let record: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(flags.join("rlmerge_record.json")).unwrap())
            .unwrap();
    assert_eq!(record["svc"], 0.2);
    rlmerge()
        .args(["verify", "--against"])
        .arg(&flags)
        .assert()
        .success();
    let from_recipe = f.dir.path().join("recipe");
    let head = "merge_method: ties\nparameters:\n  weight: 1\n  density: 0.5\nsvc:\n  alpha: 0.2\n";
    run_recipe(&f, head, &from_recipe);
    assert_eq!(read_folder(&flags), read_folder(&from_recipe));
    // The recipe the merge saved reruns it.
    let rerun = f.dir.path().join("rerun");
    rlmerge()
        .args(["run", "-q", "--device", "cpu"])
        .arg(flags.join("mergekit_config.yml"))
        .arg("-o")
        .arg(&rerun)
        .assert()
        .success();
    assert_eq!(read_folder(&flags), read_folder(&rerun));
    if !gpu_available("the GPU half of this test") {
        return;
    }
    let on_gpu = |out: &std::path::Path| {
        merge_cmd(&f, out, &[&method[..], &["--device", "gpu"]].concat())
            .assert()
            .success();
    };
    let gpu = f.dir.path().join("gpu");
    on_gpu(&gpu);
    assert_gpu_close(&flags, &gpu, 1e-6, on_gpu);
}

/// α is a finite number ≥ 10⁻⁶, from the flag or a recipe; anything else is a usage error naming
/// svc (exit 2), nothing written. A NaN input is refused by name before any SVD.
#[test]
fn bad_svc_requests_are_refused() {
    let f = f32_matrices(57);
    let out = f.dir.path().join("out");
    for value in ["-1", "0", "nan", "inf", "1e400", "much", ""] {
        let o = merge_cmd(&f, &out, &["--method", "ram", "--svc", value])
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(2), "--svc {value}: {err}");
        assert!(err.contains("svc"), "--svc {value}: {err}");
        assert!(!out.exists());
    }
    for svc in ["{beta: 1}", "-0.5", "[1]"] {
        let recipe = f.dir.path().join("bad.yml");
        std::fs::write(
            &recipe,
            format!(
                "merge_method: ram\nbase_model: {}\nsvc: {svc}\nmodels:\n  - model: {}\n  - model: {}\n",
                f.base.display(),
                f.agents[0].display(),
                f.agents[1].display()
            ),
        )
        .unwrap();
        let o = rlmerge()
            .args(["run", "-q"])
            .arg(&recipe)
            .arg("-o")
            .arg(&out)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(2), "svc: {svc}: {err}");
        assert!(err.contains("svc"), "svc: {svc}: {err}");
        assert!(!out.exists());
    }
    // A method that merges without θ₀ has no update to calibrate.
    let o = merge_cmd(
        &f,
        &out,
        &["--method", "linear", "--param", "weight=1", "--svc", "0.1"],
    )
    .output()
    .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(err.contains("svc") && err.contains("linear"), "{err}");
    assert!(!out.exists());
    let mut tensors = f.agent_tensors[0].clone();
    tensors[0].values[3] = f32::NAN;
    write_folder(&f.agents[0], &tensors, 1);
    let o = merge_cmd(&f, &out, &SVC_OVER_TASK_ARITHMETIC)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(err.contains("layers.0.w") && err.contains("NaN"), "{err}");
    assert!(!err.contains("SVD"), "{err}");
    assert!(!out.exists());
}
