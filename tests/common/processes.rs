//! Merges seen running: slowed down so a test can act while they run (signals, folders that
//! appear), and what they leave beside their output.

use super::{err_of, fixture, Fixture, DENSITIES};
use safetensors::tensor::Dtype;
use std::path::Path;

/// Names in `dir` that a merge leaves only while it runs.
pub fn leftovers(dir: &Path) -> Vec<String> {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().to_string())
        .filter(|n| n.contains(".rlmerge-"))
        .collect()
}

/// Sends `signal` (a `kill` name: TERM, INT, HUP) to `child` and waits for it to end.
pub fn send_signal(child: std::process::Child, signal: &str) -> std::process::Output {
    let sent = std::process::Command::new("kill")
        .arg(format!("-{signal}"))
        .arg(child.id().to_string())
        .status()
        .unwrap();
    assert!(sent.success());
    child.wait_with_output().unwrap()
}

/// Sends SIGINT to `child`, a run writing `out` with its scratch in `dir`, and checks that it
/// ended as an interrupted run ends: exit 130, nothing at `out`, no scratch left in `dir`.
pub fn assert_interrupted(child: std::process::Child, dir: &Path, out: &Path) {
    let o = send_signal(child, "INT");
    assert_eq!(o.status.code(), Some(130), "{}", err_of(&o));
    assert!(!out.exists());
    assert_eq!(leftovers(dir), Vec::<String>::new());
}

/// Runs `cmd`, a run writing `out` with its scratch in `dir`, with signals at their defaults
/// (stdout dropped, stderr kept), and once it is under way (its scratch there, then 200 ms)
/// checks that SIGINT ends it as an interrupted run ends ([`assert_interrupted`]).
pub fn interrupt_midway(mut cmd: std::process::Command, dir: &Path, out: &Path) {
    cmd.stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped());
    default_signals(&mut cmd);
    let child = cmd.spawn().unwrap();
    wait_until_running(dir);
    std::thread::sleep(std::time::Duration::from_millis(200));
    assert_interrupted(child, dir, out);
}

/// A merge slowed down by one-element tiles, so a test can act while it runs (on
/// [`slow_fixture`]'s inputs: a second or so).
pub fn slow_merge(f: &Fixture, out: &Path) -> std::process::Child {
    slow_merge_with(f, out, &[])
}

/// [`slow_merge`] with more arguments.
pub fn slow_merge_with(f: &Fixture, out: &Path, extra: &[&str]) -> std::process::Child {
    slow_merge_command(f, out, extra).spawn().unwrap()
}

/// The command [`slow_merge_with`] runs, stderr piped.
pub fn slow_merge_command(f: &Fixture, out: &Path, extra: &[&str]) -> std::process::Command {
    let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_rlmerge"));
    cmd.args([
        "merge",
        "--quiet",
        "--device",
        "cpu",
        "--threads",
        "1",
        "--tile-elems",
        "1",
        "--method",
        "ram+",
    ]);
    cmd.arg("--base").arg(&f.base);
    for a in &f.agents {
        cmd.arg("--model").arg(a);
    }
    cmd.arg("-o")
        .arg(out)
        .args(extra)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped());
    default_signals(&mut cmd);
    cmd
}

/// Sets the signals the tests send to their defaults in `cmd`'s process, whatever this test
/// process inherited (a shell's background job ignores SIGINT, and rlmerge keeps what it starts
/// with ignored).
pub fn default_signals(cmd: &mut std::process::Command) {
    #[cfg(unix)]
    {
        use std::os::unix::process::CommandExt;
        // SAFETY: the closure runs between fork and exec, and only calls signal(), which is
        // async-signal-safe.
        unsafe {
            cmd.pre_exec(|| {
                for s in [libc::SIGINT, libc::SIGTERM, libc::SIGHUP] {
                    libc::signal(s, libc::SIG_DFL);
                }
                Ok(())
            });
        }
    }
}

/// Inputs of [`slow_merge`]: 2 M elements, so its merge runs for about a second, although the
/// engine reads small tiles in runs (about 0.4 µs per one-element tile in a release build; 0.2 M
/// elements sufficed when each tile read its inputs alone, at 3.5 µs).
pub fn slow_fixture(seed: u64) -> Fixture {
    fixture(
        seed,
        Dtype::BF16,
        &[("w", vec![2000, 1003]), ("v", vec![1001])],
        &DENSITIES[..3],
        1,
    )
}

/// Waits until the merge has created its temporary folder (it is under way).
pub fn wait_until_running(parent: &Path) {
    let t = std::time::Instant::now();
    while leftovers(parent).is_empty() {
        assert!(
            t.elapsed() < std::time::Duration::from_secs(20),
            "merge did not start"
        );
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
}
