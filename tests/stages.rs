//! Multi-stage recipes (issue #53 item 3), as mergekit-multi reads them: several YAML documents,
//! each a merge with a `name:`, later stages naming earlier ones as models. `rlmerge run` runs
//! them in order through the merge service, earlier stages in scratch (or kept with
//! `--intermediate-dir`), and the final output is what running the stages by hand gives, byte for
//! byte, with every stage in its record, card and saved recipe.

mod common;
use common::*;
use std::path::Path;
use std::time::Duration;

/// Three stages: two pairs of the demo's agents, then their average (naming both).
const THREE: &str = "\
name: pair_a
merge_method: ties
base_model: base
parameters: {density: 0.5}
models:
  - model: coding-agent
    parameters: {weight: 1.0}
  - model: tool-agent
    parameters: {weight: 1.0}
---
merge_method: linear
models:
  - model: pair_a
    parameters: {weight: 0.5}
  - model: pair_b
    parameters: {weight: 0.5}
---
name: pair_b
merge_method: ram+
base_model: base
models:
  - model: tool-agent
  - model: memory-agent
";

fn run_in(dir: &Path, args: &[&str]) -> std::process::Output {
    rlmerge()
        .current_dir(dir)
        .args(["run", "-q"])
        .args(args)
        .output()
        .unwrap()
}

fn weights(dir: &Path) -> Vec<u8> {
    std::fs::read(dir.join("model.safetensors")).unwrap()
}

#[test]
fn three_stages_equal_the_stages_run_by_hand() {
    let d = demo_in_d();
    let dir = d.path().join("d");
    std::fs::write(dir.join("multi.yml"), THREE).unwrap();
    let o = run_in(&dir, &["multi.yml", "out"]);
    assert!(o.status.success(), "{}", err_of(&o));
    assert!(
        String::from_utf8_lossy(&o.stdout).contains("the last of 3 stages"),
        "{}",
        String::from_utf8_lossy(&o.stdout)
    );
    assert_eq!(leftovers(&dir), Vec::<String>::new());
    // By hand: each stage a recipe of its own, the last naming the first two's folders.
    let docs: Vec<&str> = THREE.split("---\n").collect();
    let strip = |doc: &str| -> String {
        doc.lines()
            .filter(|l| !l.starts_with("name:"))
            .map(|l| format!("{l}\n"))
            .collect()
    };
    std::fs::write(dir.join("a.yml"), strip(docs[0])).unwrap();
    std::fs::write(dir.join("b.yml"), strip(docs[2])).unwrap();
    let last = strip(docs[1])
        .replace("pair_a", "hand_a")
        .replace("pair_b", "hand_b");
    std::fs::write(dir.join("c.yml"), last).unwrap();
    for (recipe, out) in [("a.yml", "hand_a"), ("b.yml", "hand_b"), ("c.yml", "hand")] {
        let o = run_in(&dir, &[recipe, out]);
        assert!(o.status.success(), "{recipe}: {}", err_of(&o));
    }
    assert_eq!(weights(&dir.join("out")), weights(&dir.join("hand")));
    // Every stage in the record, the card and the saved recipe; the saved recipe, run from
    // elsewhere, makes it again.
    let record: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(dir.join("out/rlmerge_record.json")).unwrap(),
    )
    .unwrap();
    let stages: Vec<&str> = record["stages"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["name"].as_str().unwrap())
        .collect();
    assert_eq!(stages, ["pair_a", "pair_b"]);
    assert_eq!(
        record["stages"][1]["record"]["method"]["method"], "ram+",
        "{record}"
    );
    assert_eq!(record["stages"][0]["record"]["base"], "../base");
    assert_eq!(record["agents"][1]["path"], "stage:pair_b");
    let card = std::fs::read_to_string(dir.join("out/README.md")).unwrap();
    assert!(
        card.contains("## Stages") && card.contains("`pair_b`: ram"),
        "{card}"
    );
    let saved = std::fs::read_to_string(dir.join("out/mergekit_config.yml")).unwrap();
    assert_eq!(saved.matches("---\n").count(), 3, "{saved}");
    let elsewhere = tempfile::tempdir().unwrap();
    let o = run_in(
        elsewhere.path(),
        &[
            dir.join("out/mergekit_config.yml").to_str().unwrap(),
            "again",
        ],
    );
    assert!(o.status.success(), "{}", err_of(&o));
    assert_eq!(
        weights(&dir.join("out")),
        weights(&elsewhere.path().join("again"))
    );
    // verify checks the output; --against says why it cannot recompute scratch stages.
    let o = rlmerge()
        .current_dir(&dir)
        .args(["verify", "out"])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", err_of(&o));
    let o = rlmerge()
        .current_dir(&dir)
        .args(["verify", "out", "--against"])
        .output()
        .unwrap();
    assert!(!o.status.success());
    assert!(err_of(&o).contains("multi-stage"), "{}", err_of(&o));
}

#[test]
fn intermediate_dir_keeps_the_stages_and_verify_recomputes_from_them() {
    let d = demo_in_d();
    let dir = d.path().join("d");
    std::fs::write(dir.join("multi.yml"), THREE).unwrap();
    let o = run_in(&dir, &["multi.yml", "out", "--intermediate-dir", "kept"]);
    assert!(o.status.success(), "{}", err_of(&o));
    for stage in ["pair_a", "pair_b"] {
        assert!(dir
            .join("kept")
            .join(stage)
            .join("model.safetensors")
            .exists());
    }
    let o = rlmerge()
        .current_dir(&dir)
        .args(["verify", "out", "--against", "--device", "cpu"])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", err_of(&o));
    // A kept stage is an output like any: not replaced without --force.
    let o = run_in(&dir, &["multi.yml", "out2", "-I", "kept"]);
    assert_eq!(o.status.code(), Some(2), "{}", err_of(&o));
    assert!(err_of(&o).contains("already exists"), "{}", err_of(&o));
    assert!(!dir.join("out2").exists());
    // mergekit-multi's --out-path names the output as -o does.
    let o = run_in(
        &dir,
        &["multi.yml", "--out-path", "out2", "-I", "kept", "--force"],
    );
    assert!(o.status.success(), "{}", err_of(&o));
    assert_eq!(weights(&dir.join("out")), weights(&dir.join("out2")));
    // A stage folder that is a file is refused, nothing written.
    let o = run_in(&dir, &["multi.yml", "out3", "-I", "multi.yml"]);
    assert!(!o.status.success());
    assert!(err_of(&o).contains("multi.yml"), "{}", err_of(&o));
    assert!(!dir.join("out3").exists());
    assert_eq!(leftovers(&dir), Vec::<String>::new());
    // One document takes no stage folder.
    let o = run_in(&dir, &["recipe.yml", "one", "-I", "kept"]);
    assert_eq!(o.status.code(), Some(2), "{}", err_of(&o));
}

/// Bad multi-stage recipes are refused by name, with the file's line, before or as the stage
/// runs — and leave nothing at the output nor beside it.
#[test]
fn bad_stages_are_refused_by_name_and_leave_nothing() {
    let d = demo_in_d();
    let dir = d.path().join("d");
    let ram = |name: &str, models: &str| {
        format!("name: {name}\nmerge_method: ram\nbase_model: base\nmodels: [{models}]\n")
    };
    let cases = [
        (
            format!("{}---\n{}", ram("a", "{model: b}"), ram("b", "{model: a}"))
                + "---\n"
                + "merge_method: linear\nmodels: [{model: a}]\n",
            "circle",
        ),
        (
            format!(
                "{}---\n{}",
                ram("a", "{model: tool-agent}"),
                ram("a", "{model: tool-agent}")
            ),
            "two stages are named 'a'",
        ),
        (
            format!(
                "{}---\n{}",
                ram("../x", "{model: tool-agent}"),
                ram("y", "{model: x}")
            ),
            "folder name",
        ),
        (
            "merge_method: ram\nbase_model: base\nmodels: [{model: tool-agent}]\n---\n\
             merge_method: ram\nbase_model: base\nmodels: [{model: tool-agent}]\n"
                .to_string(),
            "more than one document has no name",
        ),
        // The second stage fails as it is read: its stage and the file's line are named.
        (
            format!(
                "{}---\nmerge_method: ties\nbase_model: base\nparameters: {{density: 7}}\n\
                 models: [{{model: a}}, {{model: memory-agent}}]\n",
                ram("a", "{model: tool-agent}, {model: coding-agent}")
            ),
            "line 8",
        ),
        (
            format!(
                "{}---\nmerge_method: ram\nbase_model: base\nmodels: [{{model: nowhere}}]\n",
                ram("a", "{model: tool-agent}")
            ),
            "nowhere",
        ),
    ];
    for (text, needle) in &cases {
        std::fs::write(dir.join("bad.yml"), text).unwrap();
        let o = run_in(&dir, &["bad.yml", "out"]);
        assert!(!o.status.success(), "{needle}");
        assert!(err_of(&o).contains(needle), "{needle}: {}", err_of(&o));
        assert!(!dir.join("out").exists(), "{needle}");
        assert_eq!(leftovers(&dir), Vec::<String>::new(), "{needle}");
    }
    // An output that exists is refused before any stage runs; merge --config points to run.
    std::fs::write(dir.join("multi.yml"), THREE).unwrap();
    std::fs::create_dir(dir.join("taken")).unwrap();
    std::fs::write(dir.join("taken/x"), b"mine").unwrap();
    let o = run_in(&dir, &["multi.yml", "taken"]);
    assert_eq!(o.status.code(), Some(2), "{}", err_of(&o));
    assert!(!err_of(&o).contains("stage 1"), "{}", err_of(&o));
    let o = rlmerge()
        .current_dir(&dir)
        .args(["merge", "--config", "multi.yml", "-o", "m"])
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(2), "{}", err_of(&o));
    assert!(err_of(&o).contains("rlmerge run"), "{}", err_of(&o));
}

/// Ctrl-C in the middle of a later stage: nothing at the output, the stages' scratch removed.
#[test]
fn an_interrupted_multi_stage_run_leaves_nothing() {
    let f = slow_fixture(31);
    let recipe = f.dir.path().join("multi.yml");
    let (b, a0, a1) = (&f.base, &f.agents[0], &f.agents[1]);
    std::fs::write(
        &recipe,
        format!(
            "name: first\nmerge_method: ram\nbase_model: {}\nmodels: [{{model: {}}}]\n---\n\
             merge_method: ram+\nbase_model: {}\nmodels: [{{model: first}}, {{model: {}}}]\n",
            b.display(),
            a0.display(),
            b.display(),
            a1.display()
        ),
    )
    .unwrap();
    let out = f.dir.path().join("out");
    let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_rlmerge"));
    cmd.args([
        "run",
        "-q",
        "--device",
        "cpu",
        "--threads",
        "1",
        "--tile-elems",
        "1",
    ])
    .arg(&recipe)
    .arg(&out)
    .stdout(std::process::Stdio::null())
    .stderr(std::process::Stdio::piped());
    default_signals(&mut cmd);
    let child = cmd.spawn().unwrap();
    // Once the first stage is in place, the second is under way.
    let t = std::time::Instant::now();
    let first_done = || {
        std::fs::read_dir(f.dir.path()).unwrap().flatten().any(|e| {
            let n = e.file_name().to_string_lossy().to_string();
            n.contains(".rlmerge-stages") && e.path().join("first/config.json").exists()
        })
    };
    while !first_done() {
        assert!(
            t.elapsed() < Duration::from_secs(60),
            "the first stage did not finish"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    assert_interrupted(child, f.dir.path(), &out);
}
