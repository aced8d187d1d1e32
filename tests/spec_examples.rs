//! SPEC.md's hand-computed examples and λ edge cases, through the backend API and the CLI.

mod common;
use common::*;
use rlmerge::backend::cpu::CpuBackend;
use rlmerge::backend::{Backend, MergeParams, Tile};
use rlmerge::checkpoint::DType;
use rlmerge::method::SharedRule;
use safetensors::tensor::Dtype;

/// Merges f32 τ rows on a zero base with the CPU backend; returns the merged Δ per element.
fn merge_rows(agents: &[[f32; 3]], lambdas: &[f32], out: DType) -> Vec<f32> {
    merge_rows_shared(agents, lambdas, out, SharedRule::Mean)
}

/// [`merge_rows`] with a shared-region rule.
fn merge_rows_shared(
    agents: &[[f32; 3]],
    lambdas: &[f32],
    out: DType,
    shared: SharedRule,
) -> Vec<f32> {
    let base = to_bytes(Dtype::F32, &[0.0; 3]);
    let agent_bytes: Vec<Vec<u8>> = agents.iter().map(|a| to_bytes(Dtype::F32, a)).collect();
    let slices: Vec<&[u8]> = agent_bytes.iter().map(|v| v.as_slice()).collect();
    let tile = Tile {
        dtype: DType::F32,
        len: 3,
        base: &base,
        agents: &slices,
    };
    let params = MergeParams {
        epsilon: 1e-5,
        lambdas,
        out_dtype: out,
        shared,
    };
    let mut bytes = vec![0u8; 3 * out.size()];
    CpuBackend::new(1)
        .unwrap()
        .merge(&tile, &params, &mut bytes)
        .unwrap();
    let dt = match out {
        DType::BF16 => Dtype::BF16,
        DType::F16 => Dtype::F16,
        DType::F32 => Dtype::F32,
    };
    from_bytes(dt, &bytes)
}

/// SPEC §2b's toy checks of `shared: consensus`, on every CPU build: τ = (0.02, −0.04, 0.05) → Σ =
/// 0.03 ≥ 0, so the two positive changes are averaged: +0.035 (the mean would give +0.01);
/// (−0.02, 0.01, 0) → Σ < 0: −0.02 alone, not boosted by λ; unique and unchanged elements as before.
#[test]
fn toy_checks_of_spec_section_2b() {
    let rows: [([f32; 3], f32); 5] = [
        ([0.02, -0.04, 0.05], 0.035),
        ([-0.02, 0.01, 0.0], -0.02),
        ([0.02, 0.04, 0.0], 0.03),
        ([0.02, 0.0, 0.0], 0.02 * 1.5),
        ([5e-6, 0.0, 0.0], 0.0),
    ];
    for (taus, want) in rows {
        let agents: Vec<[f32; 3]> = taus.iter().map(|&t| [t, 0.0, 0.0]).collect();
        let got = merge_rows_shared(&agents, &[1.5; 3], DType::F32, SharedRule::Consensus)[0];
        // Within the rounding of the f32 sum and the one division.
        let ulp = f32::from_bits(want.abs().to_bits() + 1) - want.abs();
        assert!(
            (got - want).abs() <= 2.0 * ulp,
            "τ = {taus:?}: {got} vs {want}"
        );
    }
}

#[test]
fn toy_table_of_spec_section_2() {
    // Element e of the merged Δ for agents' τ = column e: each row of the spec is one element here.
    let rows: [([f32; 3], f32); 5] = [
        ([0.02, 0.0, 0.0], 0.02),
        ([0.02, 0.04, 0.0], 0.03),
        ([0.02, -0.04, 0.05], 0.01),
        ([5e-6, 0.04, 0.0], 0.04),
        ([5e-6, 0.0, 0.0], 0.0),
    ];
    for (taus, want) in rows {
        // Agent t's tensor holds τ_t at element 0.
        let agents: Vec<[f32; 3]> = taus.iter().map(|&t| [t, 0.0, 0.0]).collect();
        let bf = merge_rows(&agents, &[1.0; 3], DType::BF16)[0];
        assert_eq!(
            bf,
            half::bf16::from_f32(want).to_f32(),
            "τ = {taus:?} in bf16"
        );
        let f = merge_rows(&agents, &[1.0; 3], DType::F32)[0];
        let ulp = f32::from_bits(want.to_bits() + 1) - want;
        assert!(
            (f - want).abs() <= ulp,
            "τ = {taus:?} in f32: {f} vs {want}"
        );
    }
    // Below-ε changes are reset to the base: exact zero.
    assert_eq!(merge_rows(&[[5e-6, 0.0, 0.0]], &[1.0], DType::F32)[0], 0.0);
}

#[test]
fn seed_example_with_explicit_lambdas() {
    let coding = [0.10, 0.0, 0.05];
    let memory = [0.0, 0.08, 0.05];
    let got = merge_rows(&[coding, memory], &[1.1, 1.05], DType::F32);
    let want = [0.11f32, 0.084, 0.05];
    for (g, w) in got.iter().zip(want) {
        assert!((g - w).abs() <= 2.0 * f32::EPSILON * w, "{got:?}");
    }
    assert_eq!(
        merge_rows(&[coding, memory], &[1.1, 1.05], DType::BF16),
        want.map(|w| half::bf16::from_f32(w).to_f32())
    );
}

/// A base and three agents: the first changes nothing, the other two change the same elements.
fn edge_fixture() -> (tempfile::TempDir, Vec<std::path::PathBuf>) {
    let dir = tempfile::tempdir().unwrap();
    let base: Vec<f32> = (0..101).map(|i| (i as f32 - 50.0) / 64.0).collect();
    let shared: Vec<f32> = base
        .iter()
        .enumerate()
        .map(|(i, b)| if i % 3 == 0 { b + 0.25 } else { *b })
        .collect();
    let mk = |v: &Vec<f32>| {
        vec![T {
            name: "w".into(),
            dtype: Dtype::BF16,
            shape: vec![101],
            values: v.clone(),
        }]
    };
    let mut paths = vec![];
    for (name, v) in [
        ("base", &base),
        ("idle", &base),
        ("a", &shared),
        ("b", &shared),
    ] {
        let p = dir.path().join(name);
        write_folder(&p, &mk(v), 1);
        paths.push(p);
    }
    (dir, paths)
}

fn record_lambdas(out: &std::path::Path) -> Vec<f64> {
    let record: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("rlmerge_record.json")).unwrap())
            .unwrap();
    record["agents"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| a["lambda"].as_f64().unwrap())
        .collect()
}

#[test]
fn lambda_edge_cases_no_change_and_all_shared() {
    let (dir, p) = edge_fixture();
    for (rule, cap) in [
        (vec![], 1.2),
        (vec!["--rule", "official"], 1.2),
        (vec!["--alpha", "0.5"], 1.05),
    ] {
        let out = dir.path().join(format!("out{}", rule.join("")));
        let mut cmd = rlmerge();
        cmd.args(["merge", "--quiet", "--method", "ram+"])
            .args(&rule);
        cmd.arg("--base").arg(&p[0]);
        for a in &p[1..] {
            cmd.arg("--model").arg(a);
        }
        cmd.arg("-o").arg(&out).assert().success();
        let l = record_lambdas(&out);
        // No changed element: ρ = 0, λ = 1. All shared: ρ = ∞, λ at the cap.
        assert_eq!(l[0], 1.0, "{rule:?}");
        assert!((l[1] - cap).abs() < 1e-12, "{rule:?}: {l:?}");
        assert!((l[2] - cap).abs() < 1e-12, "{rule:?}: {l:?}");
    }
}

#[test]
fn analyze_reports_counts_histogram_and_lambdas() {
    let (_dir, p) = edge_fixture();
    let mut cmd = rlmerge();
    cmd.args(["analyze", "--json", "--per-tensor", "--quiet"])
        .arg("--base")
        .arg(&p[0]);
    for a in &p[1..] {
        cmd.arg("--model").arg(a);
    }
    let out = cmd.assert().success().get_output().stdout.clone();
    let v: serde_json::Value = serde_json::from_slice(&out).unwrap();
    let agents = v["agents"].as_array().unwrap();
    // Elements 0, 3, …, 99: 34 changed by both a and b.
    assert_eq!(agents[0]["changed"], 0);
    assert_eq!(agents[0]["rho"], 0.0);
    assert_eq!(agents[0]["lambda"]["ram_plus_paper"], 1.0);
    for a in &agents[1..] {
        assert_eq!(a["changed"], 34);
        assert_eq!(a["unique"], 0);
        assert_eq!(a["shared"], 34);
        assert_eq!(a["rho"], "inf");
        assert_eq!(a["shared_with_k_others"], serde_json::json!([0, 34, 0]));
        assert!((a["lambda"]["ram_plus_official"].as_f64().unwrap() - 1.2).abs() < 1e-12);
        assert!((a["density"].as_f64().unwrap() - 34.0 / 101.0).abs() < 1e-12);
    }
    assert_eq!(v["per_tensor"][0]["name"], "w");
    assert!(v["modules"]["other"].is_object());
    // The text form names every agent.
    let mut cmd = rlmerge();
    cmd.args(["analyze", "--per-tensor", "--quiet"])
        .arg("--base")
        .arg(&p[0]);
    for a in &p[1..] {
        cmd.arg("--model").arg(a);
    }
    let text = String::from_utf8(cmd.assert().success().get_output().stdout.clone()).unwrap();
    assert!(text.contains("shared with k other agents"));
    assert!(text.contains(&p[3].display().to_string()));
    assert!(text.contains("by tensor"));
}

#[test]
fn demo_writes_merges_and_reports() {
    let dir = tempfile::tempdir().unwrap();
    let demo = dir.path().join("demo");
    let out = rlmerge()
        .arg("demo")
        .arg(&demo)
        .arg("--quiet")
        .assert()
        .success()
        .get_output()
        .stdout
        .clone();
    let text = String::from_utf8(out).unwrap();
    assert!(text.contains("merged checkpoint"));
    let merged = read_folder(&demo.join("merged-ram-plus"));
    // Qwen2, 2 layers: embeddings, final norm, lm_head + 12 per layer (7 projections, q/k/v
    // biases, 2 norms).
    assert_eq!(merged.len(), 27);
    // The memory agent is sharded.
    assert!(demo
        .join("memory-agent/model.safetensors.index.json")
        .exists());
    // Densities near the planted 3.2 %, 46.2 %, 54.3 %.
    let mut cmd = rlmerge();
    cmd.args(["analyze", "--json", "--quiet"])
        .arg("--base")
        .arg(demo.join("base"));
    for a in ["coding-agent", "tool-agent", "memory-agent"] {
        cmd.arg("--model").arg(demo.join(a));
    }
    let v: serde_json::Value =
        serde_json::from_slice(&cmd.assert().success().get_output().stdout).unwrap();
    for (a, want) in v["agents"]
        .as_array()
        .unwrap()
        .iter()
        .zip([0.032, 0.462, 0.543])
    {
        assert!((a["density"].as_f64().unwrap() - want).abs() < 0.01, "{a}");
    }
    // Running the demo again replaces its own folders.
    rlmerge()
        .arg("demo")
        .arg(&demo)
        .arg("--quiet")
        .assert()
        .success();
}

/// Every "SPEC §n" the code, shaders, tests and README cite names a section SPEC.md has: the
/// spec the code follows is in the repository, and a renumbered section fails here.
#[test]
fn every_cited_spec_section_exists() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let spec = std::fs::read_to_string(root.join("SPEC.md")).unwrap();
    let sections: Vec<String> = spec
        .lines()
        .filter(|l| l.starts_with('#'))
        .filter_map(|l| l.split('§').nth(1))
        .map(|s| s.split_whitespace().next().unwrap_or("").to_string())
        .collect();
    let mut files = vec![root.join("README.md")];
    let mut dirs = vec![
        root.join("src"),
        root.join("shaders"),
        root.join("tests"),
        root.join("benches"),
        root.join("docs"),
    ];
    while let Some(d) = dirs.pop() {
        for e in std::fs::read_dir(d).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                dirs.push(p);
            } else if p
                .extension()
                .is_some_and(|x| x == "rs" || x == "wgsl" || x == "md")
            {
                files.push(p);
            }
        }
    }
    let mut cited = 0;
    for f in files {
        let text = std::fs::read_to_string(&f).unwrap();
        for (at, _) in text.match_indices("SPEC") {
            let rest = text[at + 4..].trim_start_matches(".md").trim_start();
            let Some(rest) = rest.strip_prefix('§') else {
                continue;
            };
            let section: String = rest
                .trim_start()
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric())
                .collect();
            // "SPEC §n" in prose names the form, not a section.
            if !section.starts_with(|c: char| c.is_ascii_digit()) {
                continue;
            }
            cited += 1;
            assert!(
                sections.contains(&section),
                "{} cites SPEC §{section}, which SPEC.md does not have (it has {sections:?})",
                f.display()
            );
        }
    }
    assert!(
        cited >= 30,
        "only {cited} citations found: is the search broken?"
    );
}
