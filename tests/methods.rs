//! The mergekit-family methods through the CLI: hand-computed small cases (SPEC §4), DARE's kept
//! fraction and L1 rescale measured statistically, mergekit's documented recipes run unchanged, and
//! recipe errors.

mod common;
use common::*;

#[test]
fn task_arithmetic_by_hand() {
    let d = tempfile::tempdir().unwrap();
    // τ_a = (1, 0, −2, 0), τ_b = (0.5, 1, 1, 0); Δ = τ_a + 0.5 τ_b = (1.25, 0.5, −1.5, 0); λ = 2.
    write_cases(
        d.path(),
        &[4],
        &[1., 2., 3., 4.],
        &[&[2., 2., 1., 4.], &[1.5, 3., 4., 4.]],
    );
    let y = "merge_method: task_arithmetic\nbase_model: base\nmodels:\n  - model: a\n    parameters: {weight: 1}\n  - model: b\n    parameters: {weight: 0.5}\nparameters: {lambda: 2}\n";
    assert_near(&run_case(d.path(), y, &[]), &[3.5, 3.0, 0.0, 4.0]);
}

#[test]
fn ties_by_hand() {
    let d = tempfile::tempdir().unwrap();
    write_cases(
        d.path(),
        &[4],
        &[1., 2., 3., 4.],
        &[&[2., 2., 1., 4.], &[1.5, 3., 4., 4.]],
    );
    // density 0.5 → k = 2. τ̂_a keeps |1| and |−2| (indices 0, 2); τ̂_b keeps the two 1s (1, 2).
    // Σ = (1, 1, −1, 0): index 2 goes negative, so only a's −2 counts; index 3 has no change.
    let y = "merge_method: ties\nbase_model: base\nmodels:\n  - model: a\n    parameters: {weight: 1, density: 0.5}\n  - model: b\n    parameters: {weight: 1, density: 0.5}\n";
    assert_near(&run_case(d.path(), y, &[]), &[2.0, 3.0, 1.0, 4.0]);
    // Ties at the threshold go to the lower index: τ = (1, 1, 1, 1), k = 2 keeps indices 0 and 1.
    write_cases(d.path(), &[4], &[0.; 4], &[&[1.; 4], &[0.; 4]]);
    assert_near(&run_case(d.path(), y, &[]), &[1.0, 1.0, 0.0, 0.0]);
}

/// `shared: consensus` in a recipe (SPEC §2b): τ_a = (0.5, −1, 1), τ_b = (1.5, 2, 0),
/// τ_c = (−1, 1, 0). Element 0: Σ = 1 ≥ 0, so a and b: (0.5 + 1.5) / 2 = 1 (the mean: 1/3).
/// Element 1: Σ = 2, b and c: 1.5. Element 2: a alone, kept. The record and the model card say so;
/// a method outside the RAM family refuses the key.
#[test]
fn shared_consensus_by_hand() {
    let d = tempfile::tempdir().unwrap();
    write_cases(
        d.path(),
        &[3],
        &[0.; 3],
        &[&[0.5, -1., 1.], &[1.5, 2., 0.], &[-1., 1., 0.]],
    );
    let models_yaml = "base_model: base\nmodels:\n  - model: a\n  - model: b\n  - model: c\n";
    let y = format!("merge_method: ram\nparameters: {{shared: consensus}}\n{models_yaml}");
    assert_near(&run_case(d.path(), &y, &[]), &[1.0, 1.5, 1.0]);
    let y = format!("merge_method: ram\n{models_yaml}");
    assert_near(&run_case(d.path(), &y, &[]), &[1.0 / 3.0, 2.0 / 3.0, 1.0]);
    let y = format!("merge_method: ramplus_tl\nparameters: {{shared: consensus}}\n{models_yaml}");
    run_case(d.path(), &y, &[]);
    let record = std::fs::read_to_string(d.path().join("out/rlmerge_record.json")).unwrap();
    assert!(record.contains("\"shared\": \"consensus\""), "{record}");
    let card = std::fs::read_to_string(d.path().join("out/README.md")).unwrap();
    assert!(card.contains("shared consensus"), "{card}");
    for (yaml, want) in [
        (
            format!("merge_method: ties\nparameters: {{shared: consensus}}\n{models_yaml}"),
            "unknown parameter 'shared'",
        ),
        (
            format!("merge_method: ram\nparameters: {{shared: median}}\n{models_yaml}"),
            "must be one of mean, consensus",
        ),
    ] {
        std::fs::write(d.path().join("bad.yml"), yaml).unwrap();
        let o = rlmerge()
            .current_dir(d.path())
            .args(["run", "bad.yml", "-q", "-o", "bad-out"])
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(2), "{err}");
        assert!(err.contains(want), "{err}");
    }
}

#[test]
fn breadcrumbs_by_hand() {
    let d = tempfile::tempdir().unwrap();
    let tau: Vec<f32> = (1..=10).map(|i| i as f32).collect();
    write_cases(d.path(), &[10], &[0.; 10], &[&tau]);
    // 10 elements, density 0.5, γ 0.2: drop the 2 largest and the 3 smallest, keep 4..=8.
    let y = "merge_method: breadcrumbs\nbase_model: base\nmodels:\n  - model: a\n    parameters: {weight: 1, density: 0.5, gamma: 0.2}\n";
    assert_near(
        &run_case(d.path(), y, &[]),
        &[0., 0., 0., 4., 5., 6., 7., 8., 0., 0.],
    );
}

#[test]
fn linear_and_passthrough_by_hand() {
    let d = tempfile::tempdir().unwrap();
    write_cases(d.path(), &[2], &[9., 9.], &[&[2., 4.], &[4., 8.]]);
    // (1·2 + 3·4) / 4 = 3.5, (1·4 + 3·8) / 4 = 7; the base only gives the layout.
    let y = "merge_method: linear\nmodels:\n  - model: a\n    parameters: {weight: 1}\n  - model: b\n    parameters: {weight: 3}\n";
    assert_near(&run_case(d.path(), y, &[]), &[3.5, 7.0]);
    let y = "merge_method: passthrough\nmodels:\n  - model: b\n    parameters: {scale: 0.5}\n";
    assert_near(&run_case(d.path(), y, &[]), &[2.0, 4.0]);
}

#[test]
fn slerp_by_hand() {
    let d = tempfile::tempdir().unwrap();
    // One angle for the whole tensor (mergekit 0.1.5): θ₀ = (1, 0, 2, 0), θ₁ = (0, 1, 4, 0),
    // cos θ = 8/√85; t = 0.5 gives both the coefficient sin(θ/2)/sin θ = 1/(2 cos(θ/2)).
    write_cases(d.path(), &[2, 2], &[1., 0., 2., 0.], &[&[0., 1., 4., 0.]]);
    let y = "merge_method: slerp\nbase_model: base\nmodels:\n  - model: base\n  - model: a\nparameters:\n  t: 0.5\n";
    let theta = (8.0 / 85f64.sqrt()).acos();
    let c = (1.0 / (2.0 * (theta / 2.0).cos())) as f32;
    assert_near(&run_case(d.path(), y, &[]), &[c, c, 6.0 * c, 0.0]);
    // Parallel tensors: plain lerp, 0.5·(2, 0) + 0.5·(4, 0).
    write_cases(d.path(), &[2], &[2., 0.], &[&[4., 0.]]);
    assert_near(&run_case(d.path(), y, &[]), &[3.0, 0.0]);
}

#[test]
fn model_stock_by_hand() {
    let d = tempfile::tempdir().unwrap();
    // Parallel task vectors (cos 1): t = 2·1 / (1 + 1) = 1 → the mean of the models.
    write_cases(d.path(), &[2], &[0., 0.], &[&[1., 0.], &[2., 0.]]);
    let y = "merge_method: model_stock\nbase_model: base\nmodels:\n  - model: a\n  - model: b\n";
    assert_near(&run_case(d.path(), y, &[]), &[1.5, 0.0]);
    // Orthogonal ones (cos 0): t = 0 → the base.
    write_cases(d.path(), &[2], &[5., 5.], &[&[6., 5.], &[5., 6.]]);
    assert_near(&run_case(d.path(), y, &[]), &[5.0, 5.0]);
}

#[test]
fn model_stock_filter_wise_by_hand() {
    let d = tempfile::tempdir().unwrap();
    // Row 0: parallel task vectors (t = 1, the mean of the models); row 1: orthogonal ones
    // (t = 0, the base). Over the whole tensor the cosine would mix them.
    write_cases(
        d.path(),
        &[2, 2],
        &[0., 0., 5., 5.],
        &[&[1., 0., 6., 5.], &[2., 0., 5., 6.]],
    );
    let y = "merge_method: model_stock\nbase_model: base\nmodels:\n  - model: a\n  - model: b\nparameters:\n  filter_wise: true\n";
    assert_near(&run_case(d.path(), y, &[]), &[1.5, 0.0, 5.0, 5.0]);
    // A vector is one row.
    write_cases(d.path(), &[2], &[0., 0.], &[&[1., 0.], &[2., 0.]]);
    assert_near(&run_case(d.path(), y, &[]), &[1.5, 0.0]);
}

/// arcee_fusion by hand: a vector is one row, so one KL for all elements and importance ∝ |τ|;
/// the fence Q2 + 1.5·IQR of |τ|·KL keeps the outliers only.
#[test]
fn arcee_fusion_by_hand() {
    let d = tempfile::tempdir().unwrap();
    // 8 elements, τ = (0, 0, 0, 0.01, 0.01, 0.02, 0.02, 1): sorted importances ∝ the same;
    // Q1 = sorted[⌊0.25·7⌋ = 1] = 0, Q2 = sorted[3] = 0.01·KL, Q3 = sorted[5] = 0.02·KL:
    // fence = (0.01 + 1.5·0.02)·KL = 0.04·KL, so only τ = 1 is kept.
    let base = [0.5f32, -0.25, 0.125, 1.0, -1.0, 0.75, 0.0, 0.25];
    let tau = [0.0f32, 0.0, 0.0, 0.01, -0.01, 0.02, 0.02, 1.0];
    let model: Vec<f32> = base.iter().zip(&tau).map(|(b, t)| b + t).collect();
    write_cases(d.path(), &[8], &base, &[&model]);
    let y =
        "merge_method: arcee_fusion\nbase_model: base\nmodels:\n  - model: base\n  - model: a\n";
    let mut want = base.to_vec();
    want[7] = model[7];
    assert_eq!(run_case(d.path(), y, &[]), want);
    // Every τ equal: Q1 = Q2 = Q3, the fence is Q2 and everything is kept.
    let model: Vec<f32> = base.iter().map(|b| b + 0.5).collect();
    write_cases(d.path(), &[8], &base, &[&model]);
    assert_eq!(run_case(d.path(), y, &[]), model);
    // Two models besides the base: refused before any tensor is read.
    write_cases(d.path(), &[8], &base, &[&model, &model]);
    std::fs::write(
        d.path().join("two.yml"),
        "merge_method: arcee_fusion\nbase_model: base\nmodels:\n  - model: a\n  - model: b\n",
    )
    .unwrap();
    let out = rlmerge()
        .current_dir(d.path())
        .args(["run", "two.yml", "-o", "two"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(
        err.contains("arcee_fusion needs exactly one model besides the base"),
        "{err}"
    );
    assert!(!d.path().join("two").exists());
}

#[test]
fn nuslerp_rows_and_columns_by_hand() {
    let d = tempfile::tempdir().unwrap();
    let h = 0.5f32.sqrt();
    // τ_a = [[1, 0], [1, 0]], τ_b = [[0, 1], [2, 0]], t = 0.5.
    write_cases(
        d.path(),
        &[2, 2],
        &[0.; 4],
        &[&[1., 0., 1., 0.], &[0., 1., 2., 0.]],
    );
    let recipe = |flatten: bool, row_wise: bool| {
        format!("merge_method: nuslerp\nbase_model: base\nmodels:\n  - model: a\n    parameters: {{weight: 1}}\n  - model: b\n    parameters: {{weight: 1}}\nparameters:\n  nuslerp_flatten: {flatten}\n  nuslerp_row_wise: {row_wise}\n")
    };
    // Rows: row 0 orthogonal (both sin(π/4)); row 1 collinear, so a lerp: (1.5, 0).
    assert_near(
        &run_case(d.path(), &recipe(false, false), &[]),
        &[h, h, 1.5, 0.0],
    );
    // Columns: column 0 is (1, 1) and (0, 2), 45° apart: both coefficients sin(π/8)/sin(π/4);
    // column 1 is (0, 0) and (1, 0): a zero vector is orthogonal to everything, so sin(π/4)·(1, 0).
    let c = ((std::f64::consts::PI / 8.0).sin() / (std::f64::consts::PI / 4.0).sin()) as f32;
    assert_near(
        &run_case(d.path(), &recipe(false, true), &[]),
        &[c, h, 3.0 * c, 0.0],
    );
    // Flattening (the default) wins over row_wise: one angle for the whole tensor.
    let whole = run_case(d.path(), &recipe(true, true), &[]);
    assert_eq!(whole, run_case(d.path(), &recipe(true, false), &[]));
    assert_ne!(whole, run_case(d.path(), &recipe(false, false), &[]));
}

#[test]
fn spherical_methods_by_hand() {
    let d = tempfile::tempdir().unwrap();
    let h = 0.5f32.sqrt();
    // nuslerp: orthogonal task vectors, t = w₁/(w₀ + w₁) = 0.5 → both coefficients sin(π/4).
    write_cases(d.path(), &[2], &[0., 0.], &[&[1., 0.], &[0., 1.]]);
    let y = "merge_method: nuslerp\nbase_model: base\nmodels:\n  - model: a\n    parameters: {weight: 1}\n  - model: b\n    parameters: {weight: 1}\n";
    assert_near(&run_case(d.path(), y, &[]), &[h, h]);
    // multislerp: (2, 0) and (0, 2), equal weights: the unit mean's direction (√½, √½) times the
    // mean norm 2.
    write_cases(d.path(), &[2], &[0., 0.], &[&[2., 0.], &[0., 2.]]);
    let y = "merge_method: multislerp\nbase_model: base\nmodels:\n  - model: a\n    parameters: {weight: 1}\n  - model: b\n    parameters: {weight: 1}\n";
    assert_near(&run_case(d.path(), y, &[]), &[2.0 * h, 2.0 * h]);
    // karcher: (3, 0) and (0, 1): the geodesic midpoint (√½, √½) times the mean norm 2.
    write_cases(d.path(), &[2], &[9., 9.], &[&[3., 0.], &[0., 1.]]);
    let y = "merge_method: karcher\nmodels:\n  - model: a\n  - model: b\n";
    assert_near(&run_case(d.path(), y, &[]), &[2.0 * h, 2.0 * h]);
}

#[test]
fn sce_by_hand() {
    let d = tempfile::tempdir().unwrap();
    // τ_a = (1, 2, 0, −1), τ_b = (1, −2, 0, 3): variances (0, 4, 0, 4). select_topk 0.5 of the two
    // non-zero ones keeps one, the tie going to index 1. There Σ τ̂ = 0 counts as +, so only a
    // (weight ½ of the equal mean squares) agrees: 2·½ / ½ = 2.
    write_cases(
        d.path(),
        &[4],
        &[0.; 4],
        &[&[1., 2., 0., -1.], &[1., -2., 0., 3.]],
    );
    let y = "merge_method: sce\nbase_model: base\nmodels:\n  - model: a\n  - model: b\nparameters: {select_topk: 0.5}\n";
    assert_near(&run_case(d.path(), y, &[]), &[0.0, 2.0, 0.0, 0.0]);
    // No selection: weights = mean squares 1.5 and 3.5 over their sum; each element takes the
    // weighted mean of the agents on the majority sign.
    let y = "merge_method: sce\nbase_model: base\nmodels:\n  - model: a\n  - model: b\n";
    assert_near(&run_case(d.path(), y, &[]), &[1.0, 2.0, 0.0, 3.0]);
}

#[test]
fn fisher_by_hand() {
    let d = tempfile::tempdir().unwrap();
    write_cases(d.path(), &[2], &[9., 9.], &[&[2., 4.], &[6., 8.]]);
    write_folder(
        &d.path().join("fa"),
        &[case_tensor("model.layers.0.w", &[2], &[1., 0.])],
        1,
    );
    write_folder(
        &d.path().join("fb"),
        &[case_tensor("model.layers.0.w", &[2], &[3., 0.])],
        1,
    );
    // Element 0: (1·1·2 + 2·3·6) / (1·1 + 2·3) = 38/7. Element 1: every F is 0, so the plain
    // weighted mean (1·4 + 2·8) / 3.
    let y = "merge_method: fisher\nmodels:\n  - model: a\n    parameters: {fisher: fa}\n  - model: b\n    parameters: {fisher: fb, weight: 2}\n";
    assert_near(&run_case(d.path(), y, &[]), &[38.0 / 7.0, 20.0 / 3.0]);
    // A Fisher folder without the tensor, or no Fisher folder: clear errors, no output.
    write_folder(
        &d.path().join("fc"),
        &[case_tensor("other", &[2], &[1., 1.])],
        1,
    );
    for (yaml, want) in [
        (
            y.replace("fisher: fb", "fisher: fc"),
            "missing in the Fisher folder",
        ),
        (
            y.replace("{fisher: fb, weight: 2}", "{weight: 2}"),
            "needs parameter 'fisher'",
        ),
    ] {
        std::fs::write(d.path().join("f.yml"), yaml).unwrap();
        let out = rlmerge()
            .current_dir(d.path())
            .args(["run", "f.yml", "-q", "-o", "fout"])
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success() && err.contains(want), "{err}");
        assert!(!d.path().join("fout").exists());
    }
}

#[test]
fn nearswap_by_hand() {
    let d = tempfile::tempdir().unwrap();
    // t = 0.5: |τ| = 0.25 ≤ t → the model's value; |τ| = 2 → w = 0.25: 0.25·2 + 0.75·0 = 0.5;
    // τ = 0 → the base.
    write_cases(d.path(), &[3], &[0., 0., 7.], &[&[0.25, 2., 7.]]);
    let y =
        "merge_method: nearswap\nbase_model: base\nmodels:\n  - model: a\nparameters: {t: 0.5}\n";
    assert_near(&run_case(d.path(), y, &[]), &[0.25, 0.5, 7.0]);
}

/// DARE keeps each element with probability `density` and rescales the survivors so the task
/// vector's L1 norm is unchanged; the mask depends on the seed, never on tiling or backend.
#[test]
fn dare_keeps_density_and_l1_norm() {
    let d = tempfile::tempdir().unwrap();
    let n = 200_000;
    let base = vec![0.0f32; n];
    let tau: Vec<f32> = (0..n).map(|i| 0.01 * (1 + i % 7) as f32).collect();
    write_cases(d.path(), &[n], &base, &[&tau]);
    for density in [0.1, 0.3, 0.8] {
        let y = format!("merge_method: dare_linear\nbase_model: base\nmodels:\n  - model: a\n    parameters: {{weight: 1, density: {density}}}\n");
        let out = run_case(d.path(), &y, &["--seed", "7"]);
        let kept = out.iter().filter(|&&x| x != 0.0).count() as f64 / n as f64;
        // Binomial: σ = √(p(1−p)/n) ≤ 0.0012; allow 5σ.
        assert!(
            (kept - density).abs() < 0.006,
            "density {density}: kept {kept}"
        );
        let l1_in: f64 = tau.iter().map(|&x| x as f64).sum();
        let l1_out: f64 = out.iter().map(|&x| x.abs() as f64).sum();
        assert!(
            (l1_out / l1_in - 1.0).abs() < 1e-5,
            "density {density}: L1 {l1_out} vs {l1_in}"
        );
        // Kept elements are τ · ‖τ‖₁/‖m⊙τ‖₁, one factor for the tensor.
        let factor = out
            .iter()
            .zip(&tau)
            .find(|(o, _)| **o != 0.0)
            .map(|(o, t)| o / t)
            .unwrap();
        assert!(
            (factor as f64 - 1.0 / kept).abs() < 0.02 / density,
            "factor {factor}"
        );
        // Same seed, other tiles: same bytes. Other seed: another mask.
        assert_eq!(
            run_case(d.path(), &y, &["--seed", "7", "--tile-elems", "4099"]),
            out
        );
        assert_ne!(run_case(d.path(), &y, &["--seed", "8"]), out);
    }
}

/// DELLA keeps an element with probability from density − ε (smallest |τ| of its row) to
/// density + ε (largest), then L1-rescales.
#[test]
fn della_keeps_by_rank_within_rows() {
    let d = tempfile::tempdir().unwrap();
    let (rows, cols) = (400, 500);
    // Within every row |τ| grows with the column, so rank = column + 1.
    let tau: Vec<f32> = (0..rows * cols)
        .map(|i| 0.001 * (1 + i % cols) as f32 * if i % 3 == 0 { -1.0 } else { 1.0 })
        .collect();
    write_cases(d.path(), &[rows, cols], &vec![0.0; rows * cols], &[&tau]);
    let y = "merge_method: della_linear\nbase_model: base\nmodels:\n  - model: a\n    parameters: {weight: 1, density: 0.5, epsilon: 0.3}\n";
    let out = run_case(d.path(), y, &["--seed", "5"]);
    let kept_in = |c0: usize, c1: usize| {
        let (mut kept, mut all) = (0usize, 0usize);
        for r in 0..rows {
            for c in c0..c1 {
                all += 1;
                kept += (out[r * cols + c] != 0.0) as usize;
            }
        }
        kept as f64 / all as f64
    };
    // Expected p at the first and last 50 columns: 0.2 + 0.6·(24.5/499) ≈ 0.23 and ≈ 0.77.
    let (low, high, all) = (kept_in(0, 50), kept_in(cols - 50, cols), kept_in(0, cols));
    assert!((low - 0.229).abs() < 0.02, "lowest columns kept {low}");
    assert!((high - 0.771).abs() < 0.02, "highest columns kept {high}");
    assert!((all - 0.5).abs() < 0.01, "kept {all}");
    let l1_in: f64 = tau.iter().map(|x| x.abs() as f64).sum();
    let l1_out: f64 = out.iter().map(|x| x.abs() as f64).sum();
    assert!(
        (l1_out / l1_in - 1.0).abs() < 1e-5,
        "L1 {l1_out} vs {l1_in}"
    );
    // Without the L1 rescale there is no statistics scan to keep the decisions: the merge makes
    // them tile by tile, and they must be the same — the same elements, each τ unscaled.
    let plain = format!("{y}parameters: {{rescale: false}}\n");
    let unscaled = run_case(d.path(), &plain, &["--seed", "5", "--tile-elems", "1000"]);
    for (i, (&u, &o)) in unscaled.iter().zip(&out).enumerate() {
        assert_eq!(u != 0.0, o != 0.0, "element {i}: kept differently");
        assert!(u == 0.0 || u == tau[i], "element {i}: {u} for τ {}", tau[i]);
    }
}

/// DELLA on a tensor of three dimensions [a, b, c] ranks along dimension 1, as mergekit does: the
/// b elements that share (i, k) form a group, so the keep probability follows j in [i, j, k].
#[test]
fn della_ranks_along_dimension_one_of_3d_tensors() {
    let d = tempfile::tempdir().unwrap();
    let (a, b, c) = (40, 50, 60);
    // |τ| grows with j and shrinks with k: ranking along the last dimension would invert it.
    let tau: Vec<f32> = (0..a * b * c)
        .map(|i| {
            let (j, k) = ((i / c) % b, i % c);
            0.001 * (1 + j) as f32 * (1.0 - k as f32 / (2 * c) as f32)
        })
        .collect();
    write_cases(d.path(), &[a, b, c], &vec![0.0; a * b * c], &[&tau]);
    let y = "merge_method: della_linear\nbase_model: base\nmodels:\n  - model: a\n    parameters: {weight: 1, density: 0.5, epsilon: 0.3}\n";
    let out = run_case(d.path(), y, &["--seed", "9"]);
    let kept_at = |j: usize| {
        let kept = (0..a * c)
            .filter(|&ik| out[(ik / c) * b * c + j * c + ik % c] != 0.0)
            .count();
        kept as f64 / (a * c) as f64
    };
    // p = 0.2 + 0.6·j/49: 0.2 at j = 0, 0.8 at j = 49 (2,400 draws each).
    let (low, high) = (kept_at(0), kept_at(b - 1));
    assert!((low - 0.2).abs() < 0.04, "j = 0 kept {low}");
    assert!((high - 0.8).abs() < 0.04, "j = 49 kept {high}");
}
