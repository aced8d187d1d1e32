//! ResMerge (SPEC §4f) against an independent reference written from the SPEC, dense and with no
//! SVD library (common::linalg: each head's singular triplets from a Jacobi eigendecomposition),
//! on agents whose residuals agree (the spherical backbone) and on agents whose residuals do
//! not (the mean); the SPEC's toy examples; the elementwise rule on embeddings, norms and
//! vectors; recipes, the GPU's bytes, and bad parameters.

mod common;
use common::linalg::{jacobi_eigen, matmul, transpose};
use common::*;
use safetensors::tensor::Dtype;

const EPS: f64 = 1e-8;

struct Params {
    k: usize,
    beta_min: f64,
    beta_max: f64,
    rho: f64,
}

fn dot(a: &[f64], b: &[f64]) -> f64 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

fn norm(a: &[f64]) -> f64 {
    dot(a, a).sqrt()
}

fn cos(a: &[f64], b: &[f64]) -> f64 {
    dot(a, b) / (norm(a) * norm(b) + EPS)
}

/// Mean over pairs a < b (1 without pairs).
fn pairs_mean(items: &[Vec<f64>], f: impl Fn(&[f64], &[f64]) -> f64) -> f64 {
    let mut v = Vec::new();
    for a in 0..items.len() {
        for b in a + 1..items.len() {
            v.push(f(&items[a], &items[b]));
        }
    }
    if v.is_empty() {
        1.0
    } else {
        v.iter().sum::<f64>() / v.len() as f64
    }
}

/// τ's rank-K head Σ s u vᵀ, the triplets from the eigenvectors of τ τᵀ (m ≤ n) or τᵀ τ.
fn head(tau: &[f64], (m, n): (usize, usize), k: usize) -> Vec<f64> {
    let mut h = vec![0.0; m * n];
    if norm(tau) == 0.0 {
        return h;
    }
    let wide = m <= n;
    let r = m.min(n);
    let gram = if wide {
        matmul(tau, &transpose(tau, (m, n)), (m, n, m))
    } else {
        matmul(&transpose(tau, (m, n)), tau, (n, m, n))
    };
    let (eig, vecs) = jacobi_eigen(&gram, r);
    let mut order: Vec<usize> = (0..r).collect();
    order.sort_by(|&a, &b| eig[b].total_cmp(&eig[a]));
    for &j in order.iter().take(k) {
        let s = eig[j].max(0.0).sqrt();
        if s == 0.0 {
            continue;
        }
        let e: Vec<f64> = (0..r).map(|i| vecs[i * r + j]).collect();
        for i in 0..m {
            for c in 0..n {
                // s·u_i·v_c with u = e, v = τᵀe/s (wide) or v = e, u = τe/s (tall).
                h[i * n + c] += if wide {
                    e[i] * (0..m).map(|x| tau[x * n + c] * e[x]).sum::<f64>()
                } else {
                    e[c] * (0..n).map(|y| tau[i * n + y] * e[y]).sum::<f64>()
                };
            }
        }
    }
    h
}

/// What SPEC §4f says ResMerge's update A + C of one matrix is.
fn resmerge_by_hand(
    taus: &[Vec<f64>],
    shape: (usize, usize),
    p: &Params,
    family: bool,
) -> Vec<f64> {
    let t = taus.len() as f64;
    let heads: Vec<Vec<f64>> = taus.iter().map(|x| head(x, shape, p.k)).collect();
    let res: Vec<Vec<f64>> = taus
        .iter()
        .zip(&heads)
        .map(|(x, h)| x.iter().zip(h).map(|(a, b)| a - b).collect())
        .collect();
    let len = taus[0].len();
    let mean = |v: &[Vec<f64>]| -> Vec<f64> {
        (0..len)
            .map(|i| v.iter().map(|x| x[i]).sum::<f64>() / t)
            .collect()
    };
    let norms: Vec<f64> = res.iter().map(|r| norm(r)).collect();
    let backbone: Vec<f64> = if norms.iter().all(|&x| x <= EPS) {
        vec![0.0; len]
    } else {
        let q: Vec<Vec<f64>> = res
            .iter()
            .zip(&norms)
            .map(|(r, n)| r.iter().map(|x| x / (n + EPS)).collect())
            .collect();
        let qsum: Vec<f64> = (0..len).map(|i| q.iter().map(|x| x[i]).sum()).collect();
        let qn = norm(&qsum);
        if qn <= EPS {
            mean(&res)
        } else {
            let src: Vec<f64> = qsum.iter().map(|x| x / (qn + EPS)).collect();
            let c = (q.iter().map(|x| cos(x, &src)).sum::<f64>() / t).clamp(0.0, 1.0);
            if c <= 1.0 / t.sqrt() {
                mean(&res)
            } else {
                let s_bar = ((pairs_mean(&q, cos) + 1.0) / 2.0).clamp(0.0, 1.0);
                let c_bar = ((c + 1.0) / 2.0).clamp(0.0, 1.0);
                let f = if family { 1.0 } else { 0.0 };
                let score = (0.5 * (s_bar + c_bar) * f).clamp(0.0, 1.0);
                let beta = p.beta_max - (p.beta_max - p.beta_min) * score;
                let scale = c.powf(beta) * norms.iter().sum::<f64>() / t;
                src.iter().map(|x| x * scale).collect()
            }
        }
    };
    let live: Vec<Vec<f64>> = heads
        .iter()
        .filter(|h| norm(h) > EPS)
        .map(|h| h.iter().map(|x| x / norm(h)).collect())
        .collect();
    let agreement = if live.is_empty() {
        0.0
    } else {
        pairs_mean(&live, |a, b| cos(a, b).max(0.0)).clamp(0.0, 1.0)
    };
    let hbar = mean(&heads);
    let (an, hn) = (norm(&backbone), norm(&hbar));
    let budget = p.rho * agreement;
    let coef = if budget > 0.0 && an > EPS && hn > EPS {
        budget * an / hn
    } else {
        0.0
    };
    backbone
        .iter()
        .zip(&hbar)
        .map(|(a, h)| a + coef * h)
        .collect()
}

#[test]
fn the_resmerge_reference_gives_the_spec_examples() {
    let p = Params {
        k: 1,
        beta_min: 0.7,
        beta_max: 1.0,
        rho: 0.2,
    };
    let cancel = resmerge_by_hand(
        &[vec![3.0, 0.0, 0.0, 1.0], vec![3.0, 0.0, 0.0, -1.0]],
        (2, 2),
        &p,
        true,
    );
    assert!(cancel.iter().all(|x| x.abs() < 1e-12), "{cancel:?}");
    let same = resmerge_by_hand(
        &[vec![3.0, 0.0, 0.0, 1.0], vec![3.0, 0.0, 0.0, 1.0]],
        (2, 2),
        &p,
        true,
    );
    for (g, w) in same.iter().zip([0.2, 0.0, 0.0, 1.0]) {
        assert!((g - w).abs() < 1e-6, "{same:?}");
    }
}

/// Base and three agents of f32 tensors: each agent's τ of a matrix is `shared` times a common
/// matrix plus its own noise (shared 0: unrelated agents).
fn agents_fixture(shared: f32, seed: u64) -> Fixture {
    let shapes: [(&str, Vec<usize>); 6] = [
        ("model.layers.0.mlp.up_proj.weight", vec![12, 20]),
        // Large enough that the heads' Lanczos process stops on convergence, not on room.
        ("model.layers.0.mlp.down_proj.weight", vec![96, 64]),
        ("model.layers.0.self_attn.o_proj.weight", vec![20, 10]),
        ("model.layers.0.other.weight", vec![8, 8]),
        ("model.embed_tokens.weight", vec![16, 6]),
        ("model.norm.weight", vec![6]),
    ];
    let mut rng = Rng(seed);
    let mut base_tensors = Vec::new();
    let mut agent_tensors = vec![Vec::new(); 3];
    for (name, shape) in shapes {
        let numel: usize = shape.iter().product();
        let base: Vec<f32> = (0..numel).map(|_| rng.f32() - 0.5).collect();
        let common: Vec<f32> = (0..numel).map(|_| rng.f32() - 0.5).collect();
        for agent in agent_tensors.iter_mut() {
            let values = (0..numel)
                .map(|i| base[i] + 0.1 * (shared * common[i] + (rng.f32() - 0.5)))
                .collect();
            agent.push(T {
                name: name.into(),
                dtype: Dtype::F32,
                shape: shape.clone(),
                values,
            });
        }
        base_tensors.push(T {
            name: name.into(),
            dtype: Dtype::F32,
            shape,
            values: base,
        });
    }
    fixture_of(base_tensors, agent_tensors, 1, |_| 1)
}

/// The merged folder `out` of fixture `f` is what SPEC §4f says with parameters `p`: each
/// decomposed matrix θ₀ + the reference's A + C, every other tensor the mean τ.
fn assert_matches_reference(f: &Fixture, out: &std::path::Path, p: &Params, what: &str) {
    let merged = read_folder(out);
    for (i, base) in f.base_tensors.iter().enumerate() {
        let taus = taus_of(f, i);
        let name = base.name.as_str();
        let decomposed = !name.contains("embed") && !name.contains("norm");
        let want: Vec<f32> = match base.shape[..] {
            [m, n] if decomposed => {
                let family = !name.contains("other");
                base_plus(&base.values, &resmerge_by_hand(&taus, (m, n), p, family))
            }
            // θ₀ + Σ τ·f32(1/T) in f32, in model order.
            _ => (0..base.values.len())
                .map(|e| {
                    let w = 1.0f32 / 3.0;
                    let d = f
                        .agent_tensors
                        .iter()
                        .fold(0.0f32, |s, a| s + (a[i].values[e] - base.values[e]) * w);
                    base.values[e] + d
                })
                .collect(),
        };
        let got = from_bytes(Dtype::F32, &merged[name].2);
        assert_close(&format!("{what}, {name}"), &got, &want, 1e-5);
    }
}

#[test]
fn resmerge_matches_a_dense_reference() {
    let p = Params {
        k: 2,
        beta_min: 0.5,
        beta_max: 1.2,
        rho: 0.3,
    };
    // Agreeing residuals (the backbone on the sphere) and unrelated ones (their mean).
    for (shared, seed) in [(3.0, 5), (0.0, 6)] {
        let f = agents_fixture(shared, seed);
        let out = f.dir.path().join("out");
        merge_cmd(
            &f,
            &out,
            &[
                "--device",
                "cpu",
                "--method",
                "resmerge",
                "--param",
                "rank_topk=2",
                "--param",
                "beta_min=0.5",
                "--param",
                "beta_max=1.2",
                "--param",
                "head_ratio_budget=0.3",
            ],
        )
        .assert()
        .success();
        assert_matches_reference(&f, &out, &p, &format!("shared {shared}"));
    }
}

/// The largest K the range allows, far above every matrix's rank: each head is the whole τ (the
/// residuals rounding noise), and the merge still matches the reference.
#[test]
fn resmerge_with_the_largest_rank_topk() {
    let f = agents_fixture(3.0, 7);
    let out = f.dir.path().join("out");
    merge_cmd(
        &f,
        &out,
        &["--method", "resmerge", "--param", "rank_topk=65536"],
    )
    .assert()
    .success();
    let p = Params {
        k: 65536,
        beta_min: 0.7,
        beta_max: 1.0,
        rho: 0.2,
    };
    assert_matches_reference(&f, &out, &p, "rank_topk 65536");
}

#[test]
fn resmerge_from_recipes_on_both_backends_and_its_bad_parameters() {
    let f = agents_fixture(2.0, 9);
    let flags = f.dir.path().join("flags");
    merge_cmd(&f, &flags, &["--device", "cpu", "--method", "resmerge"])
        .assert()
        .success();
    let from_recipe = f.dir.path().join("recipe");
    let head = "merge_method: resmerge\nparameters:\n  rank_topk: 1\n";
    run_recipe(&f, head, &from_recipe);
    assert_eq!(read_folder(&flags), read_folder(&from_recipe));
    let out = f.dir.path().join("bad");
    for (param, want) in [
        ("rank_topk=0", "rank_topk"),
        ("rank_topk=1.5", "rank_topk"),
        ("rank_topk=65537", "rank_topk"),
        ("beta_min=-1", "beta_min"),
        ("beta_min=2", "must not exceed beta_max"),
        ("head_ratio_budget=nan", "head_ratio_budget"),
    ] {
        let o = merge_cmd(&f, &out, &["--method", "resmerge", "--param", param])
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(2), "{param}: {err}");
        assert!(err.contains(want), "{param}: {err}");
        assert!(!out.exists());
    }
    if !gpu_available("the GPU half of this test") {
        return;
    }
    let gpu = f.dir.path().join("gpu");
    merge_cmd(&f, &gpu, &["--device", "gpu", "--method", "resmerge"])
        .assert()
        .success();
    assert_eq!(read_folder(&flags), read_folder(&gpu));
}

/// Two agents whose updates are rank 2 (as LoRA agents' are), in f32.
fn low_rank_agents() -> Fixture {
    let mut rng = Rng(77);
    let (m, n) = (24usize, 16usize);
    let names = [
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.0.mlp.up_proj.weight",
    ];
    let mut base = Vec::new();
    let mut agents = vec![Vec::new(), Vec::new()];
    for name in names {
        let b: Vec<f32> = (0..m * n).map(|_| (rng.f32() - 0.5) * 0.2).collect();
        for agent in agents.iter_mut() {
            let mut w = b.clone();
            for _ in 0..2 {
                let u: Vec<f32> = (0..m).map(|_| rng.f32() - 0.5).collect();
                let v: Vec<f32> = (0..n).map(|_| (rng.f32() - 0.5) * 0.05).collect();
                for i in 0..m {
                    for j in 0..n {
                        w[i * n + j] += u[i] * v[j];
                    }
                }
            }
            agent.push(T {
                name: name.into(),
                dtype: Dtype::F32,
                shape: vec![m, n],
                values: w,
            });
        }
        base.push(T {
            name: name.into(),
            dtype: Dtype::F32,
            shape: vec![m, n],
            values: b,
        });
    }
    fixture_of(base, agents, 1, |_| 1)
}

/// Issue #50 item 5: ResMerge merges what each agent's top rank_topk directions leave; of agents
/// whose update those directions hold whole (low-rank, LoRA), it keeps nothing — the output is
/// the base. The merge says so: each agent's kept share in the record and the card, and a
/// warning below a tenth of a mean's share; a rank_topk below the agents' rank keeps some.
#[test]
fn resmerge_says_when_it_keeps_nothing_of_an_agent() {
    let f = low_rank_agents();
    let kept = |out: &std::path::Path| -> Vec<f64> {
        let record: serde_json::Value =
            serde_json::from_slice(&std::fs::read(out.join("rlmerge_record.json")).unwrap())
                .unwrap();
        record["agents"]
            .as_array()
            .unwrap()
            .iter()
            .map(|a| a["kept"].as_f64().unwrap())
            .collect()
    };
    let whole = f.dir.path().join("k4");
    let o = merge_cmd(
        &f,
        &whole,
        &["--method", "resmerge", "--param", "rank_topk=4"],
    )
    .output()
    .unwrap();
    assert!(o.status.success(), "{}", err_of(&o));
    assert!(
        err_of(&o).contains("resmerge kept") && err_of(&o).contains("lower rank_topk"),
        "{}",
        err_of(&o)
    );
    assert!(
        kept(&whole).iter().all(|&k| k.abs() < 1e-3),
        "{:?}",
        kept(&whole)
    );
    let card = std::fs::read_to_string(whole.join("README.md")).unwrap();
    assert!(card.contains("of its update"), "{card}");
    // `analyze --merged` measures the same retention.
    let o = rlmerge()
        .arg("analyze")
        .arg("--base")
        .arg(&f.base)
        .args(["--model"])
        .arg(&f.agents[0])
        .args(["--model"])
        .arg(&f.agents[1])
        .arg("--merged")
        .arg(&whole)
        .arg("--json")
        .output()
        .unwrap();
    let json: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let all = json["retention"]["agents"][0]["all"]["retention"]
        .as_f64()
        .unwrap();
    assert!(
        (all - kept(&whole)[0]).abs() < 1e-9,
        "{all} vs {:?}",
        kept(&whole)
    );
    // Below the agents' rank the residual is merged: kept, no warning.
    let part = f.dir.path().join("k1");
    let o = merge_cmd(
        &f,
        &part,
        &["--method", "resmerge", "--param", "rank_topk=1"],
    )
    .output()
    .unwrap();
    assert!(o.status.success(), "{}", err_of(&o));
    assert!(!err_of(&o).contains("resmerge kept"), "{}", err_of(&o));
    assert!(kept(&part).iter().all(|&k| k > 0.05), "{:?}", kept(&part));
}
