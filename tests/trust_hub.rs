//! Trust, round two (issue #24): Hub ids — a stalled download gives up and says where; the rule
//! between local folders and Hub ids is one, stated.

mod common;
use common::*;
use std::time::{Duration, Instant};

/// A server that accepts connections and never answers: a download gives up after
/// HF_HUB_DOWNLOAD_TIMEOUT seconds with one line naming the endpoint and the limit, and says the
/// name was no local folder either; nothing is written.
#[test]
fn a_stalled_hub_download_times_out() {
    let d = tempfile::tempdir().unwrap();
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let held = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    {
        let held = held.clone();
        std::thread::spawn(move || {
            // Bounded: at most 16 connections, each kept open and silent until the test ends.
            for stream in listener.incoming().take(16).flatten() {
                held.lock().unwrap().push(stream);
            }
        });
    }
    let out = d.path().join("out");
    let start = Instant::now();
    let o = rlmerge()
        .arg("merge")
        .arg("--base")
        .arg(models().join("base"))
        .args([
            "--model",
            "org/never-answers",
            "-q",
            "--method",
            "ram",
            "-o",
        ])
        .arg(&out)
        .env("HF_ENDPOINT", format!("http://127.0.0.1:{port}"))
        .env("HF_HUB_CACHE", d.path().join("cache"))
        .env("HF_HUB_DOWNLOAD_TIMEOUT", "1")
        .env_remove("HF_HUB_OFFLINE")
        .timeout(Duration::from_secs(120))
        .output()
        .unwrap();
    let err = err_of(&o);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(
        start.elapsed() < Duration::from_secs(60),
        "took {:?}",
        start.elapsed()
    );
    assert!(err.contains("did not answer for 1 s"), "{err}");
    assert!(err.contains("no folder org/never-answers here"), "{err}");
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(!out.exists());
}

/// The rule between local folders and Hub ids: an existing folder wins and a note says so; a
/// name that is neither says both facts; a ref must hold a commit, not a path elsewhere.
#[test]
fn local_folders_and_hub_ids_follow_one_stated_rule() {
    let d = tempfile::tempdir().unwrap();
    let (base, agents) = small(d.path(), &["a"]);
    let org = d.path().join("org");
    std::fs::create_dir(&org).unwrap();
    std::fs::rename(&agents[0], org.join("coder")).unwrap();
    let cache = d.path().join("cache");
    let merge = |model: &str, out: &str| {
        rlmerge()
            .current_dir(d.path())
            .arg("merge")
            .arg("--base")
            .arg(&base)
            .args(["--model", model, "-q", "--method", "ram", "-o", out])
            .env("HF_HUB_CACHE", &cache)
            .env("HF_HUB_OFFLINE", "1")
            .output()
            .unwrap()
    };
    // Not in the cache: the folder, nothing to say.
    let o = merge("org/coder", "o0");
    assert!(o.status.success(), "{}", err_of(&o));
    assert!(!err_of(&o).contains("note:"), "{}", err_of(&o));
    // In the cache too: the folder, and a note saying so.
    let commit = "0123456789abcdef0123456789abcdef01234567";
    let snapshot = cache.join("models--org--coder/snapshots").join(commit);
    std::fs::create_dir_all(&snapshot).unwrap();
    for f in ["model.safetensors", "config.json"] {
        std::fs::copy(org.join("coder").join(f), snapshot.join(f)).unwrap();
    }
    std::fs::create_dir_all(cache.join("models--org--coder/refs")).unwrap();
    std::fs::write(cache.join("models--org--coder/refs/main"), commit).unwrap();
    let o = merge("org/coder", "o1");
    assert!(o.status.success(), "{}", err_of(&o));
    assert!(
        err_of(&o).contains("org/coder is a local folder, taken instead of the Hub id"),
        "{}",
        err_of(&o)
    );
    // Issue #45: `org/` is a local folder, so a mistyped `org/codr` is a path, not an id to
    // download: neither a folder nor a cached id, with the folder meant, exit 2.
    let o = merge("org/codr", "o2");
    assert_eq!(o.status.code(), Some(2), "{}", err_of(&o));
    assert!(
        err_of(&o).contains("org/codr is neither a folder nor a Hub id in the cache")
            && err_of(&o).contains("did you mean 'org/coder'"),
        "{}",
        err_of(&o)
    );
    // refs/main holding a path: not followed.
    let repo = cache.join("models--evil--model");
    std::fs::create_dir_all(repo.join("refs")).unwrap();
    std::fs::write(
        repo.join("refs/main"),
        org.join("coder").display().to_string(),
    )
    .unwrap();
    let o = merge("evil/model", "o3");
    assert_eq!(o.status.code(), Some(1), "{}", err_of(&o));
    assert!(!d.path().join("o3").exists());
}
