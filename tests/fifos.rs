//! FIFOs where rlmerge reads or writes — a weight file, a config, a recipe, a record, a file it
//! checks — are refused by kind, never opened: nothing blocks (each test fails after 30 s if it
//! did).

mod common;
use common::bad_case::*;
use std::path::Path;

/// A FIFO where a weight file or index should be — safetensors, torch.save's, a verl rank
/// file, a DCP checkpoint's metadata: refused without reading it (a read blocks until a writer comes, i.e. forever).
#[test]
fn fifos_are_refused_without_blocking() {
    for name in [
        "model.safetensors",
        "model.safetensors.index.json",
        "pytorch_model.bin",
        "pytorch_model.bin.index.json",
        "model_world_size_1_rank_0.pt",
        ".metadata",
    ] {
        let c = case();
        std::fs::create_dir_all(&c.bad).unwrap();
        assert!(std::process::Command::new("mkfifo")
            .arg(c.bad.join(name))
            .status()
            .unwrap()
            .success());
        let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_rlmerge"))
            .args(["merge", "--quiet", "--base"])
            .arg(&c.base)
            .arg("--model")
            .arg(&c.bad)
            .arg("-o")
            .arg(c.dir.path().join("out"))
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let start = std::time::Instant::now();
        let status = loop {
            if let Some(s) = child.try_wait().unwrap() {
                break s;
            }
            if start.elapsed() > std::time::Duration::from_secs(30) {
                child.kill().unwrap();
                panic!("{name}: rlmerge blocked on a FIFO");
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        };
        assert_eq!(status.code(), Some(1));
        let mut err = String::new();
        std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut err).unwrap();
        assert!(err.contains("not a regular file"), "{name}: {err}");
    }
}

/// Runs `cmd`, failing the test if it has not exited within 30 s (it blocked on a FIFO).
fn run_unblocked(mut cmd: std::process::Command, what: &str) -> (Option<i32>, String) {
    let mut child = cmd
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let start = std::time::Instant::now();
    loop {
        if child.try_wait().unwrap().is_some() {
            let o = child.wait_with_output().unwrap();
            let text = String::from_utf8_lossy(&o.stdout).to_string() + &err_of(&o);
            return (o.status.code(), text);
        }
        if start.elapsed() > std::time::Duration::from_secs(30) {
            child.kill().unwrap();
            panic!("{what}: rlmerge blocked on a FIFO");
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
}

fn mkfifo(path: &Path) {
    assert!(std::process::Command::new("mkfifo")
        .arg(path)
        .status()
        .unwrap()
        .success());
}

/// FIFOs where rlmerge reads a recipe, a merged folder's recipe or a file `verify` checksums are
/// refused without being opened for reading.
#[test]
fn fifos_as_recipes_and_checked_files_are_refused_without_blocking() {
    let c = case();
    good_model(&c.bad, 1.0);
    let bin = env!("CARGO_BIN_EXE_rlmerge");
    // `run` and `merge --config` with a FIFO as the recipe.
    let recipe = c.dir.path().join("recipe.yml");
    mkfifo(&recipe);
    for args in [vec!["run"], vec!["merge", "--config"]] {
        let mut cmd = std::process::Command::new(bin);
        cmd.args(&args)
            .arg(&recipe)
            .arg("-o")
            .arg(c.dir.path().join("o"));
        let (code, text) = run_unblocked(cmd, "recipe FIFO");
        assert_eq!(code, Some(1), "{text}");
        assert!(text.contains("not a regular file"), "{text}");
    }
    // A merged folder whose output file, then whose recipe, is a FIFO: verify refuses it.
    let (o, out) = merge_out(&c, &[&c.good, &c.bad], &[]);
    assert!(o.status.success());
    std::fs::remove_file(out.join("config.json")).unwrap();
    mkfifo(&out.join("config.json"));
    let mut cmd = std::process::Command::new(bin);
    cmd.arg("verify").arg(&out);
    let (code, text) = run_unblocked(cmd, "output FIFO");
    assert_eq!(code, Some(1), "{text}");
    assert!(text.contains("not a regular file"), "{text}");
    std::fs::remove_file(out.join("rlmerge_record.json")).unwrap();
    mkfifo(&out.join("rlmerge_record.json"));
    let mut cmd = std::process::Command::new(bin);
    cmd.arg("verify").arg(&out);
    let (code, text) = run_unblocked(cmd, "recipe FIFO in a merged folder");
    assert_eq!(code, Some(1), "{text}");
    // --force onto that folder: its manifest is no regular file, so it is not replaceable.
    let mut cmd = std::process::Command::new(bin);
    cmd.args(["merge", "--quiet", "--force", "--base"])
        .arg(&c.base)
        .arg("--model")
        .arg(&c.good)
        .arg("-o")
        .arg(&out);
    let (code, text) = run_unblocked(cmd, "--force onto a FIFO manifest");
    assert_eq!(code, Some(2), "{text}");
    assert!(out.join("model.safetensors").exists());
}
