//! Agents saved in F32 over a BF16 base — fp32 master weights, what RL trainers keep (issue #50
//! item 8): they drift below a BF16 step almost everywhere, so read raw every element would count
//! as changed. They are read as their BF16 rounding (to nearest even, as a trainer's converter
//! writes them): the dense-agent warning does not fire, RAM counts and merges what the rounded
//! agent changed — the same bytes as a merge of the agent rounded by the test — and stderr and
//! the card say so; `--raw-f32-agents` reads them as stored.

mod common;
use common::*;
use safetensors::tensor::Dtype;
use std::path::PathBuf;

/// Agent `t` of `f` as fp32 masters: its BF16 values, each nudged by less than a quarter of a
/// BF16 step (what the optimizer's sub-step updates leave), written in F32.
fn masters(f: &Fixture, t: usize, seed: u64) -> PathBuf {
    let mut rng = Rng(seed);
    let tensors: Vec<T> = f.agent_tensors[t]
        .iter()
        .map(|x| T {
            dtype: Dtype::F32,
            values: x
                .values
                .iter()
                .map(|&v| {
                    let step = f32::from_bits((v.abs().to_bits() & 0x7f80_0000) | 0x0001_0000)
                        - f32::from_bits(v.abs().to_bits() & 0x7f80_0000);
                    v + (rng.f32() - 0.5) * 0.5 * step
                })
                .collect(),
            ..x.clone()
        })
        .collect();
    let dir = f.dir.path().join(format!("masters{t}"));
    write_folder(&dir, &tensors, 1);
    // A master that rounds back to its BF16 value: the nudge is below half a step.
    for (x, m) in f.agent_tensors[t].iter().zip(&tensors) {
        for (a, b) in x.values.iter().zip(&m.values) {
            assert_eq!(round_to(Dtype::BF16, *b), *a);
        }
    }
    dir
}

#[test]
fn fp32_masters_merge_as_their_bf16_rounding() {
    let f = fixture(
        58,
        Dtype::BF16,
        &[
            ("model.layers.0.mlp.up_proj.weight", vec![64, 48]),
            ("model.layers.0.self_attn.q_proj.weight", vec![48, 48]),
            ("model.norm.weight", vec![48]),
        ],
        &[0.02, 0.05],
        1,
    );
    let m0 = masters(&f, 0, 1);
    let m1 = masters(&f, 1, 2);
    for method in [
        &["--method", "ram"][..],
        &["--method", "ram+"][..],
        &at_half_density("ties")[..],
    ] {
        let (rounded, from_masters) = (f.dir.path().join("rounded"), f.dir.path().join("masters"));
        let merge = |agents: &[&PathBuf], out: &PathBuf| {
            let _ = std::fs::remove_dir_all(out);
            let mut cmd = merge_of(&f.base, agents);
            let o = cmd
                .args(["-q", "-o"])
                .arg(out)
                .args(method)
                .output()
                .unwrap();
            assert!(o.status.success(), "{}", err_of(&o));
            err_of(&o)
        };
        merge(&[&f.agents[0], &f.agents[1]], &rounded);
        let err = merge(&[&m0, &m1], &from_masters);
        let said = !err.contains("--allow-dense") && err.contains("bf16 rounding");
        assert!(said, "no dense-agent warning, the masters rounded: {err}");
        assert_eq!(
            read_folder(&rounded),
            read_folder(&from_masters),
            "{method:?}: the masters merge as their BF16 rounding"
        );
        let card = std::fs::read_to_string(from_masters.join("README.md")).unwrap();
        assert!(card.contains("bf16 rounding"), "{card}");
    }
    // The λ RAM+ gives them is the rounded agents' (one report each way).
    let report = |agents: &[&PathBuf], extra: &[&str]| {
        let o = rlmerge()
            .arg("analyze")
            .arg("--base")
            .arg(&f.base)
            .args(
                agents
                    .iter()
                    .flat_map(|a| [std::ffi::OsStr::new("--model"), a.as_os_str()]),
            )
            .arg("--json")
            .args(extra)
            .output()
            .unwrap();
        assert!(o.status.success(), "{}", err_of(&o));
        let mut v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
        for a in v["agents"].as_array_mut().unwrap() {
            a.as_object_mut().unwrap().remove("agent");
        }
        v["agents"].clone()
    };
    assert_eq!(
        report(&[&m0, &m1], &[]),
        report(&[&f.agents[0], &f.agents[1]], &[])
    );
    // As stored, most elements differ (all but the near-zero ones, whose drift is below ε).
    for agent in report(&[&m0, &m1], &["--raw-f32-agents"])
        .as_array()
        .unwrap()
    {
        assert!(agent["density"].as_f64().unwrap() > 0.5, "{agent}");
    }
    let raw = f.dir.path().join("raw");
    let o = merge_of(&f.base, [&m0, &m1])
        .args(["-q", "--raw-f32-agents", "--method", "ram", "-o"])
        .arg(&raw)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", err_of(&o));
    assert!(!err_of(&o).contains("rounding"), "{}", err_of(&o));
    let record: serde_json::Value =
        serde_json::from_slice(&std::fs::read(raw.join("rlmerge_record.json")).unwrap()).unwrap();
    assert_eq!(record["raw_f32_agents"], true);
    let recipe = std::fs::read_to_string(raw.join("mergekit_config.yml")).unwrap();
    assert!(recipe.contains("raw_f32_agents: true"), "{recipe}");
    rlmerge()
        .args(["verify", "--against"])
        .arg(&raw)
        .assert()
        .success();
}

/// A finite F32 master beyond BF16's range rounds to ±Inf: refused by name, nothing written.
#[test]
fn a_master_beyond_bf16s_range_is_refused() {
    let f = fixture(
        59,
        Dtype::BF16,
        &[("model.layers.0.mlp.up_proj.weight", vec![8, 8])],
        &[0.1],
        1,
    );
    let mut tensors: Vec<T> = f.agent_tensors[0]
        .iter()
        .map(|x| T {
            dtype: Dtype::F32,
            ..x.clone()
        })
        .collect();
    tensors[0].values[5] = f32::MAX;
    let dir = f.dir.path().join("huge");
    write_folder(&dir, &tensors, 1);
    let out = f.dir.path().join("out");
    let o = merge_of(&f.base, [&dir])
        .args(["-q", "-o"])
        .arg(&out)
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(1), "{}", err_of(&o));
    assert!(
        err_of(&o).contains("element 5") && err_of(&o).contains("beyond bf16's range"),
        "{}",
        err_of(&o)
    );
    assert!(!out.exists());
}
