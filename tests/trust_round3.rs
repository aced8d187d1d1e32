//! Trust, round three (issue #42): what a hostile pass found after round two — a killed merge's
//! scratch nobody mentioned, a config number written as a float taken for another architecture,
//! a method's model count found only inside the merge. (The Python API's cases are in
//! `python/tests/test_api.py`, `--force`'s in `tests/safety.rs`, parameters' types in
//! `tests/bad_requests.rs`.)

mod common;
use common::*;
use safetensors::tensor::Dtype;
use std::path::Path;

fn stderr(o: &std::process::Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// A merge into `out` killed with SIGKILL (the OOM killer, `docker kill`, Slurm) once it is under
/// way: its full scratch folder stays beside `out`.
fn killed_merge(f: &Fixture, out: &Path) {
    let mut child = slow_merge(f, out);
    let parent = out.parent().unwrap();
    wait_until_running(parent);
    // Killed once the output's shard is in its scratch folder (after RAM+'s probe).
    let t = std::time::Instant::now();
    let shard_there = || {
        leftovers(parent)
            .iter()
            .any(|l| std::fs::read_dir(parent.join(l)).is_ok_and(|mut d| d.next().is_some()))
    };
    while !shard_there() {
        assert!(t.elapsed().as_secs() < 30, "the merge wrote nothing");
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    child.kill().unwrap();
    child.wait().unwrap();
    assert!(!out.exists());
    assert!(!leftovers(out.parent().unwrap()).is_empty());
}

/// After SIGKILL, the scratch left beside `-o` is named — with its size and the command that
/// removes it — by `verify` of a folder beside it, `analyze` of models beside it, and a merge
/// into another folder beside it; a merge into the same output removes it and says how much.
#[test]
fn a_killed_merges_scratch_is_named_until_it_is_removed() {
    let f = slow_fixture(42);
    let top = f.dir.path();
    let out = top.join("out");
    merge_cmd(&f, &top.join("done"), &[]).assert().success();
    killed_merge(&f, &out);
    let named = |o: &std::process::Output| {
        let err = stderr(o);
        assert!(
            err.contains("note: ")
                && err.contains(".out.rlmerge-tmp-")
                && err.contains("was killed")
                && err.contains(" MB) is the scratch folder")
                && err.contains("rm -rf '"),
            "{err}"
        );
    };
    let verify = rlmerge()
        .arg("verify")
        .arg(top.join("done"))
        .output()
        .unwrap();
    assert!(verify.status.success(), "{}", stderr(&verify));
    named(&verify);
    let mut analyze = rlmerge();
    analyze.args(["analyze", "--quiet", "--device", "cpu", "--base"]);
    analyze.arg(&f.base);
    for a in &f.agents {
        analyze.arg("--model").arg(a);
    }
    let analyze = analyze.output().unwrap();
    assert!(analyze.status.success(), "{}", stderr(&analyze));
    named(&analyze);
    let other = merge_cmd(&f, &top.join("other"), &["--method", "ram"])
        .output()
        .unwrap();
    assert!(other.status.success(), "{}", stderr(&other));
    named(&other);
    // A merge into the same output removes what the killed one left, and says so.
    let again = merge_cmd(&f, &out, &["--method", "ram"]).output().unwrap();
    assert!(again.status.success(), "{}", stderr(&again));
    assert!(
        stderr(&again).contains("note: removed") && stderr(&again).contains("killed merge"),
        "{}",
        stderr(&again)
    );
    assert!(leftovers(top).is_empty(), "{:?}", leftovers(top));
    let quiet = rlmerge().arg("verify").arg(&out).output().unwrap();
    assert!(!stderr(&quiet).contains("note: "), "{}", stderr(&quiet));
}

/// `num_hidden_layers: 2.0` (a tool that writes every number as a float) is the base's 2 layers:
/// the same architecture, merged and sliced.
#[test]
fn a_config_number_written_as_a_float_is_the_same_number() {
    let f = fixture(
        5,
        Dtype::BF16,
        &[
            ("model.layers.0.mlp.up_proj.weight", vec![4, 6]),
            ("model.layers.1.mlp.up_proj.weight", vec![4, 6]),
        ],
        &DENSITIES[..2],
        1,
    );
    let config = |layers: serde_json::Value| {
        serde_json::json!({"model_type": "llama", "num_hidden_layers": layers, "hidden_size": 6})
            .to_string()
    };
    std::fs::write(f.base.join("config.json"), config(2.into())).unwrap();
    for a in &f.agents {
        std::fs::write(a.join("config.json"), config(2.0.into())).unwrap();
    }
    let out = f.dir.path().join("out");
    let o = merge_cmd(&f, &out, &["--method", "ram"]).output().unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    // Slices read the layer count from a float too.
    std::fs::write(f.base.join("config.json"), config(2.0.into())).unwrap();
    let recipe = f.dir.path().join("slices.yml");
    std::fs::write(
        &recipe,
        format!(
            "merge_method: passthrough\nslices:\n  - sources:\n      - model: {}\n        \
             layer_range: [1, 2]\n",
            f.agents[0].display()
        ),
    )
    .unwrap();
    let sliced = rlmerge()
        .args(["run", "--quiet"])
        .arg(&recipe)
        .arg("-o")
        .arg(f.dir.path().join("sliced"))
        .output()
        .unwrap();
    assert!(sliced.status.success(), "{}", stderr(&sliced));
}

/// nuslerp takes two models: a third is a usage error before anything is read (exit 2), not a
/// failure inside the merge.
#[test]
fn a_methods_model_count_is_checked_before_the_merge() {
    let f = fixture(6, Dtype::BF16, &[("w", vec![8, 4])], &DENSITIES[..3], 1);
    let out = f.dir.path().join("out");
    let o = merge_cmd(&f, &out, &["--method", "nuslerp", "--param", "weight=1"])
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(
        stderr(&o).contains("nuslerp needs exactly two models, got 3"),
        "{}",
        stderr(&o)
    );
    assert!(!out.exists() && leftovers(f.dir.path()).is_empty());
}
