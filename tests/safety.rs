//! A merge never destroys data: wherever `-o` points, whatever appears there during a merge, and
//! whatever else runs beside it (issue #12, "Data loss"; README "Guarantees"); a killed merge's
//! scratch is named until it is removed.

mod common;
use common::*;
use safetensors::tensor::Dtype;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// A folder `M` holding base, agents and a user's file, the way people keep checkpoints.
struct Models {
    _dir: tempfile::TempDir,
    m: PathBuf,
    f: Fixture,
}

fn models() -> Models {
    let dir = tempfile::tempdir().unwrap();
    let m = dir.path().join("M");
    std::fs::create_dir(&m).unwrap();
    let mut f = fixture(7, Dtype::BF16, &odd_shapes(), &DENSITIES[..2], 1);
    // Move the fixture's folders into M.
    let mut moved = Vec::new();
    for p in std::iter::once(&f.base).chain(&f.agents) {
        let to = m.join(p.file_name().unwrap());
        std::fs::rename(p, &to).unwrap();
        moved.push(to);
    }
    f.base = moved[0].clone();
    f.agents = moved[1..].to_vec();
    std::fs::write(m.join("notes.txt"), b"weeks of GPU time").unwrap();
    Models { _dir: dir, m, f }
}

/// Digest of every file under `dir`, recursively (names and bytes).
fn tree(dir: &Path) -> Vec<(PathBuf, Vec<u8>)> {
    let mut all = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                stack.push(p);
            } else {
                all.push((p.clone(), std::fs::read(&p).unwrap()));
            }
        }
    }
    all.sort();
    all
}

#[test]
fn force_never_writes_at_around_or_inside_an_input() {
    let Models { m, f, _dir } = models();
    let before = tree(m.parent().unwrap());
    let link = m.parent().unwrap().join("alias");
    std::os::unix::fs::symlink(&m, &link).unwrap();
    let outs: Vec<(PathBuf, &str)> = vec![
        (m.clone(), "contains the input"),
        (f.base.clone(), "is the input"),
        (f.agents[1].clone(), "is the input"),
        (f.base.join("sub"), "lies inside the input"),
        (f.agents[0].join("sub/deeper"), "lies inside the input"),
        (m.join("."), "contains the input"),
        (f.base.join("..").join("agent0"), "is the input"),
        (link.join("base"), "is the input"),
        (f.base.join("model.safetensors"), "lies inside the input"),
    ];
    for (out, why) in &outs {
        let o = merge_cmd(&f, out, &["--force"]).output().unwrap();
        assert_eq!(
            o.status.code(),
            Some(2),
            "-o {}: {}",
            out.display(),
            err_of(&o)
        );
        assert!(
            err_of(&o).contains(why),
            "-o {}: {}",
            out.display(),
            err_of(&o)
        );
    }
    std::fs::remove_file(&link).unwrap();
    assert_eq!(tree(m.parent().unwrap()), before, "an input changed");
}

#[test]
fn a_recipe_file_is_an_input_too() {
    let Models { m, f, _dir } = models();
    let recipe = m.parent().unwrap().join("recipe.yml");
    let text = format!(
        "merge_method: ties\nbase_model: {}\nmodels:\n  - model: {}\n    parameters: {{density: 0.5, weight: 1}}\n",
        f.base.display(),
        f.agents[0].display()
    );
    std::fs::write(&recipe, &text).unwrap();
    for out in [recipe.clone(), recipe.parent().unwrap().to_path_buf()] {
        let o = rlmerge()
            .args(["run", "--quiet", "--force"])
            .arg(&recipe)
            .arg("-o")
            .arg(&out)
            .output()
            .unwrap();
        assert_eq!(o.status.code(), Some(2), "{}", err_of(&o));
    }
    assert_eq!(std::fs::read_to_string(&recipe).unwrap(), text);
}

#[test]
fn force_replaces_only_empty_or_rlmerge_folders() {
    let Models { m, f, _dir } = models();
    let top = m.parent().unwrap();
    // A regular file, a FIFO and a device node are never replaced.
    let file = top.join("file.bin");
    std::fs::write(&file, b"precious").unwrap();
    let fifo = top.join("fifo");
    assert!(std::process::Command::new("mkfifo")
        .arg(&fifo)
        .status()
        .unwrap()
        .success());
    for out in [&file, &fifo, &PathBuf::from("/dev/null")] {
        let o = merge_cmd(&f, out, &["--force"]).output().unwrap();
        assert_eq!(o.status.code(), Some(2), "{}", err_of(&o));
        assert!(err_of(&o).contains("not a folder"), "{}", err_of(&o));
    }
    assert_eq!(std::fs::read(&file).unwrap(), b"precious");
    assert!(leftovers(top).is_empty(), "{:?}", leftovers(top));
    // A folder of the user's files is not replaced.
    let theirs = top.join("theirs");
    std::fs::create_dir(&theirs).unwrap();
    std::fs::write(theirs.join("eval.json"), b"{}").unwrap();
    let o = merge_cmd(&f, &theirs, &["--force"]).output().unwrap();
    assert_eq!(o.status.code(), Some(2));
    assert!(err_of(&o).contains("did not write"), "{}", err_of(&o));
    assert_eq!(std::fs::read(theirs.join("eval.json")).unwrap(), b"{}");
    // A merged folder is replaced, but not once the user added a file to it.
    let out = top.join("out");
    merge_cmd(&f, &out, &[]).assert().success();
    merge_cmd(&f, &out, &["--force", "--method", "ram"])
        .assert()
        .success();
    std::fs::write(out.join("results.md"), b"mine").unwrap();
    let o = merge_cmd(&f, &out, &["--force"]).output().unwrap();
    assert_eq!(o.status.code(), Some(2));
    assert!(err_of(&o).contains("results.md"), "{}", err_of(&o));
    assert_eq!(std::fs::read(out.join("results.md")).unwrap(), b"mine");
}

/// `--force` judges each entry by what it is, not by its name (issue #42): a user's folder, or a
/// user's file of the same size, sitting at a name the old record lists is not rlmerge's.
#[test]
fn force_spares_what_carries_a_listed_name_but_is_not_the_file_rlmerge_wrote() {
    let Models { m, f, _dir } = models();
    let top = m.parent().unwrap();
    let out = top.join("out");
    merge_cmd(&f, &out, &[]).assert().success();
    // A folder of the user's where the record lists config.json.
    std::fs::remove_file(out.join("config.json")).unwrap();
    std::fs::create_dir(out.join("config.json")).unwrap();
    std::fs::write(out.join("config.json").join("run.log"), b"mine").unwrap();
    let o = merge_cmd(&f, &out, &["--force"]).output().unwrap();
    assert_eq!(o.status.code(), Some(2), "{}", err_of(&o));
    assert!(
        err_of(&o).contains("'config.json' is a folder"),
        "{}",
        err_of(&o)
    );
    assert_eq!(
        std::fs::read(out.join("config.json").join("run.log")).unwrap(),
        b"mine"
    );
    assert!(leftovers(top).is_empty(), "{:?}", leftovers(top));
    // The same bytes' length, other bytes: a file the user put there, not rlmerge's.
    let out = top.join("out2");
    merge_cmd(&f, &out, &[]).assert().success();
    let config = out.join("config.json");
    let mut bytes = std::fs::read(&config).unwrap();
    bytes[0] ^= 0x20;
    std::fs::write(&config, &bytes).unwrap();
    let o = merge_cmd(&f, &out, &["--force"]).output().unwrap();
    assert_eq!(o.status.code(), Some(2), "{}", err_of(&o));
    assert!(err_of(&o).contains("it changed"), "{}", err_of(&o));
    assert_eq!(std::fs::read(&config).unwrap(), bytes);
    // A link at a listed name is not a file rlmerge wrote either.
    let out = top.join("out3");
    merge_cmd(&f, &out, &[]).assert().success();
    std::fs::remove_file(out.join("config.json")).unwrap();
    std::os::unix::fs::symlink(top.join("M"), out.join("config.json")).unwrap();
    let o = merge_cmd(&f, &out, &["--force"]).output().unwrap();
    assert_eq!(o.status.code(), Some(2), "{}", err_of(&o));
    assert!(err_of(&o).contains("a symbolic link"), "{}", err_of(&o));
    assert!(m.join("notes.txt").exists());
}

#[test]
fn a_folder_that_appears_during_the_merge_is_never_replaced_without_force() {
    let f = slow_fixture(21);
    let out = f.dir.path().join("out");
    let child = slow_merge(&f, &out);
    wait_until_running(f.dir.path());
    std::fs::create_dir(&out).unwrap();
    std::fs::write(out.join("theirs.txt"), b"appeared").unwrap();
    let o = child.wait_with_output().unwrap();
    assert_eq!(o.status.code(), Some(1), "{}", err_of(&o));
    assert!(err_of(&o).contains("appeared"), "{}", err_of(&o));
    assert_eq!(std::fs::read(out.join("theirs.txt")).unwrap(), b"appeared");
    assert_eq!(std::fs::read_dir(&out).unwrap().count(), 1);
    assert!(leftovers(f.dir.path()).is_empty());
    // Even an empty folder that appears is not replaced.
    std::fs::remove_dir_all(&out).unwrap();
    let child = slow_merge(&f, &out);
    wait_until_running(f.dir.path());
    std::fs::create_dir(&out).unwrap();
    assert_eq!(child.wait_with_output().unwrap().status.code(), Some(1));
    assert_eq!(std::fs::read_dir(&out).unwrap().count(), 0);
}

#[test]
fn with_force_a_folder_that_appears_is_replaced_only_if_replaceable() {
    let f = slow_fixture(22);
    let out = f.dir.path().join("out");
    let child = slow_merge_with(&f, &out, &["--force"]);
    wait_until_running(f.dir.path());
    std::fs::create_dir(&out).unwrap();
    std::fs::write(out.join("theirs.txt"), b"appeared").unwrap();
    let o = child.wait_with_output().unwrap();
    assert_eq!(o.status.code(), Some(1), "{}", err_of(&o));
    assert!(err_of(&o).contains("will not replace"), "{}", err_of(&o));
    assert_eq!(std::fs::read(out.join("theirs.txt")).unwrap(), b"appeared");
    assert!(leftovers(f.dir.path()).is_empty());
}

#[test]
fn two_merges_into_one_new_output_one_wins_and_one_fails() {
    let f = slow_fixture(23);
    let out = f.dir.path().join("out");
    let (a, b) = (slow_merge(&f, &out), slow_merge(&f, &out));
    let codes: Vec<Option<i32>> = [a, b]
        .into_iter()
        .map(|c| c.wait_with_output().unwrap().status.code())
        .collect();
    let mut sorted = codes.clone();
    sorted.sort();
    assert_eq!(sorted, [Some(0), Some(1)], "{codes:?}");
    read_folder(&out);
    rlmerge().arg("verify").arg(&out).assert().success();
    assert!(leftovers(f.dir.path()).is_empty());
}

#[test]
fn a_live_merge_elsewhere_keeps_its_scratch_folder() {
    let f = slow_fixture(24);
    let out = f.dir.path().join("out");
    // Another host's or PID namespace's merge: a PID that is dead here, but its lock is held.
    let foreign = f.dir.path().join(".out.rlmerge-tmp-1-0123456789abcdef");
    std::fs::create_dir(&foreign).unwrap();
    std::fs::write(foreign.join("model.safetensors"), b"in progress").unwrap();
    let lock = std::fs::File::create(
        f.dir
            .path()
            .join(".out.rlmerge-tmp-1-0123456789abcdef.lock"),
    )
    .unwrap();
    lock.lock().unwrap();
    // A dead one: its lock file is free.
    let dead = f
        .dir
        .path()
        .join(".out.rlmerge-tmp-999999-fedcba9876543210");
    std::fs::create_dir(&dead).unwrap();
    std::fs::write(
        f.dir
            .path()
            .join(".out.rlmerge-tmp-999999-fedcba9876543210.lock"),
        b"",
    )
    .unwrap();
    // An old-style folder without a lock file is left alone too.
    let unknown = f.dir.path().join(".out.rlmerge-tmp-4242");
    std::fs::create_dir(&unknown).unwrap();
    merge_cmd(&f, &out, &[]).assert().success();
    assert_eq!(
        std::fs::read(foreign.join("model.safetensors")).unwrap(),
        b"in progress"
    );
    assert!(!dead.exists());
    assert!(unknown.exists());
    drop(lock);
}

#[test]
fn demo_never_replaces_the_users_files() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path().join("demo");
    let run = || {
        rlmerge()
            .args(["demo", "--quiet"])
            .arg(&d)
            .output()
            .unwrap()
    };
    assert!(run().status.success());
    // Run again: its own folders are replaced.
    assert!(run().status.success());
    for sub in ["base", "tool-agent", "merged-ram-plus"] {
        let mine = d.join(sub).join("mine.txt");
        std::fs::write(&mine, b"mine").unwrap();
        let before = tree(&d);
        let o = run();
        assert_eq!(o.status.code(), Some(2), "{sub}: {}", err_of(&o));
        assert!(err_of(&o).contains("mine.txt"), "{}", err_of(&o));
        assert_eq!(tree(&d), before, "{sub}: the demo touched files");
        std::fs::remove_file(&mine).unwrap();
    }
    // A folder the user made under a demo name.
    std::fs::remove_dir_all(d.join("coding-agent")).unwrap();
    std::fs::create_dir(d.join("coding-agent")).unwrap();
    std::fs::write(d.join("coding-agent/model.safetensors"), b"theirs").unwrap();
    assert_eq!(run().status.code(), Some(2));
    assert_eq!(
        std::fs::read(d.join("coding-agent/model.safetensors")).unwrap(),
        b"theirs"
    );
    // The demo's recipe.yml: the user's own file of that name, a link to one, or a FIFO is
    // refused up front (exit 2, nothing written, the link's target untouched).
    std::fs::remove_dir_all(&d).unwrap();
    let theirs = dir.path().join("theirs.yml");
    std::fs::write(&theirs, b"merge_method: mine\n").unwrap();
    for plant in ["file", "link", "fifo"] {
        std::fs::create_dir_all(&d).unwrap();
        let recipe = d.join("recipe.yml");
        match plant {
            "file" => std::fs::write(&recipe, b"merge_method: mine\n").unwrap(),
            "link" => std::os::unix::fs::symlink(&theirs, &recipe).unwrap(),
            _ => assert!(std::process::Command::new("mkfifo")
                .arg(&recipe)
                .status()
                .unwrap()
                .success()),
        }
        let o = run();
        assert_eq!(o.status.code(), Some(2), "{plant}: {}", err_of(&o));
        assert!(err_of(&o).contains("recipe.yml"), "{}", err_of(&o));
        assert!(
            !d.join("base").exists(),
            "{plant}: the demo wrote models first"
        );
        assert_eq!(std::fs::read(&theirs).unwrap(), b"merge_method: mine\n");
        std::fs::remove_dir_all(&d).unwrap();
    }
    // Its own recipe is rewritten, as its own folders are.
    assert!(run().status.success());
    assert!(run().status.success());
}

#[test]
fn sigterm_and_sigint_remove_the_scratch_folder() {
    for signal in ["TERM", "INT", "HUP"] {
        let f = slow_fixture(25);
        let out = f.dir.path().join("out");
        let child = slow_merge(&f, &out);
        let o = signal_once_running(&f, signal, child);
        assert_eq!(o.status.code(), Some(130), "{signal}: {}", err_of(&o));
        assert!(!out.exists());
        assert_eq!(leftovers(f.dir.path()), Vec::<String>::new(), "{signal}");
    }
}

/// Sends `signal` (a `kill` name: TERM, INT, HUP) to `child`, a merge of `f`, once it is under
/// way, and waits for it to end.
fn signal_once_running(
    f: &Fixture,
    signal: &str,
    child: std::process::Child,
) -> std::process::Output {
    wait_until_running(f.dir.path());
    std::thread::sleep(Duration::from_millis(100));
    send_signal(child, signal)
}

/// A signal the merge started with ignored stays ignored: `nohup` ignores SIGHUP so a merge
/// outlives its terminal, a shell's background job SIGINT. The merge runs on through it and
/// completes.
#[test]
fn signals_ignored_at_start_stay_ignored() {
    for signal in ["HUP", "INT"] {
        let f = slow_fixture(27);
        let out = f.dir.path().join("out");
        let merge = slow_merge_command(&f, &out, &[]);
        // `trap ''` ignores the signal, and exec keeps it ignored in the merge.
        let child = std::process::Command::new("sh")
            .arg("-c")
            .arg(format!("trap '' {signal}; exec \"$0\" \"$@\""))
            .arg(merge.get_program())
            .args(merge.get_args())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let o = signal_once_running(&f, signal, child);
        assert_eq!(o.status.code(), Some(0), "{signal}: {}", err_of(&o));
        read_folder(&out);
        assert_eq!(leftovers(f.dir.path()), Vec::<String>::new(), "{signal}");
    }
}

#[test]
fn the_output_s_missing_parent_folders_are_created() {
    let f = fixture(26, Dtype::BF16, &odd_shapes(), &DENSITIES[..2], 1);
    let out = f.dir.path().join("runs/2026/merged");
    merge_cmd(&f, &out, &[]).assert().success();
    read_folder(&out);
}

#[test]
fn demo_sizes_are_honoured_and_a_killed_demo_leaves_no_partial_model() {
    let dir = tempfile::tempdir().unwrap();
    let size = |d: &Path| {
        std::fs::metadata(d.join("base/model.safetensors"))
            .unwrap()
            .len()
    };
    for (arg, bytes) in [("2MiB", 2u64 << 20), ("24MiB", 24 << 20)] {
        let d = dir.path().join(arg);
        rlmerge()
            .args(["demo", "--quiet", "--write-only", "--model-size", arg])
            .arg(&d)
            .assert()
            .success();
        let got = size(&d);
        assert!(got >= bytes && got < 2 * bytes, "{arg}: {got} bytes");
    }
    // Killed while writing: nothing but finished folders under their names.
    let d = dir.path().join("killed");
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_rlmerge"))
        .args(["demo", "--quiet", "--write-only", "--model-size", "300MiB"])
        .arg(&d)
        .spawn()
        .unwrap();
    let t = std::time::Instant::now();
    while !d.exists() || leftovers(&d).is_empty() {
        assert!(t.elapsed() < Duration::from_secs(30), "demo did not start");
        std::thread::sleep(Duration::from_millis(5));
    }
    child.kill().unwrap();
    child.wait().unwrap();
    assert!(!d.join("base").exists(), "a partial base folder is visible");
    // Run again: the dead run's scratch folder goes, and the demo completes.
    rlmerge()
        .args(["demo", "--quiet", "--write-only", "--model-size", "2MiB"])
        .arg(&d)
        .assert()
        .success();
    assert!(leftovers(&d).is_empty(), "{:?}", leftovers(&d));
}

/// `-o` given as nothing or as the root folder, and `--base`/`--model` given as a file, a device or
/// nothing: usage errors or clear failures, never a write.
#[test]
fn absurd_paths_are_refused() {
    let f = fixture(27, Dtype::BF16, &odd_shapes(), &DENSITIES[..2], 1);
    for out in ["", "/"] {
        let o = merge_cmd(&f, Path::new(out), &["--force"])
            .output()
            .unwrap();
        assert_eq!(o.status.code(), Some(2), "-o '{out}': {}", err_of(&o));
    }
    let file = f.dir.path().join("file.bin");
    std::fs::write(&file, b"x").unwrap();
    for bad in [file.as_path(), Path::new("/dev/null"), Path::new("")] {
        for flag in ["--base", "--model"] {
            let mut cmd = rlmerge();
            cmd.args(["merge", "--quiet"]);
            if flag == "--base" {
                cmd.arg("--base").arg(bad).arg("--model").arg(&f.agents[0]);
            } else {
                cmd.arg("--base").arg(&f.base).arg("--model").arg(bad);
            }
            let out = f.dir.path().join("out");
            let o = cmd.arg("-o").arg(&out).output().unwrap();
            assert_ne!(o.status.code(), Some(0), "{flag} '{}'", bad.display());
            assert!(!out.exists());
            assert_eq!(
                err_of(&o)
                    .lines()
                    .filter(|l| l.starts_with("error:"))
                    .count(),
                1
            );
        }
    }
    assert_eq!(std::fs::read(&file).unwrap(), b"x");
}

/// A merge into `out` killed with SIGKILL (the OOM killer, `docker kill`, Slurm) once it is under
/// way: its full scratch folder stays beside `out`.
fn killed_merge(f: &Fixture, out: &Path) {
    let mut child = slow_merge(f, out);
    let parent = out.parent().unwrap();
    wait_until_running(parent);
    // Killed once the output's shard is in its scratch folder with its bytes (after RAM+'s
    // probe; a shard just created, still empty, would leave a scratch of 0 B on a loaded machine).
    let t = std::time::Instant::now();
    let shard_there = || {
        leftovers(parent).iter().any(|l| {
            std::fs::read_dir(parent.join(l)).is_ok_and(|d| {
                d.flatten()
                    .any(|e| e.metadata().is_ok_and(|m| m.len() >= 1 << 20))
            })
        })
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
        let err = err_of(o);
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
    assert!(verify.status.success(), "{}", err_of(&verify));
    named(&verify);
    let mut analyze = rlmerge();
    analyze.args(["analyze", "--quiet", "--device", "cpu", "--base"]);
    analyze.arg(&f.base);
    for a in &f.agents {
        analyze.arg("--model").arg(a);
    }
    let analyze = analyze.output().unwrap();
    assert!(analyze.status.success(), "{}", err_of(&analyze));
    named(&analyze);
    let other = merge_cmd(&f, &top.join("other"), &["--method", "ram"])
        .output()
        .unwrap();
    assert!(other.status.success(), "{}", err_of(&other));
    named(&other);
    // A merge into the same output removes what the killed one left, and says so.
    let again = merge_cmd(&f, &out, &["--method", "ram"]).output().unwrap();
    assert!(again.status.success(), "{}", err_of(&again));
    assert!(
        err_of(&again).contains("note: removed") && err_of(&again).contains("killed merge"),
        "{}",
        err_of(&again)
    );
    assert!(leftovers(top).is_empty(), "{:?}", leftovers(top));
    let quiet = rlmerge().arg("verify").arg(&out).output().unwrap();
    assert!(!err_of(&quiet).contains("note: "), "{}", err_of(&quiet));
}
