//! Models named by Hugging Face Hub id, resolved from a local HF cache laid out as the official
//! client writes it (blobs, snapshot symlinks, refs): the same bytes as the merge from folders,
//! revisions by branch and commit, HF_HUB_CACHE / HF_HOME / HOME, and clear failures offline.
//! (Downloads through HF_ENDPOINT are tested in python/tests/test_hub.py against a local server
//! the official Python client also reads.) A stalled download gives up and says where; the rule
//! between local folders and Hub ids is one, stated.

mod common;
use common::*;
use safetensors::tensor::Dtype;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

const COMMITS: [&str; 3] = [
    "1111111111111111111111111111111111111111",
    "2222222222222222222222222222222222222222",
    "3333333333333333333333333333333333333333",
];

/// Puts `folder` into `cache` as `org/name` at `commit`, with `refs/<rev>` for each of `refs`:
/// files as blobs named by their hash, snapshot entries as relative symlinks to them.
fn cache_model(cache: &Path, folder: &Path, id: &str, commit: &str, refs: &[&str]) -> PathBuf {
    let repo = cache.join(format!("models--{}", id.replace('/', "--")));
    let snapshot = repo.join("snapshots").join(commit);
    std::fs::create_dir_all(&snapshot).unwrap();
    std::fs::create_dir_all(repo.join("blobs")).unwrap();
    for entry in std::fs::read_dir(folder).unwrap() {
        let entry = entry.unwrap();
        let bytes = std::fs::read(entry.path()).unwrap();
        let blob = format!("{:016x}{:08x}", rlmerge_hash(&bytes), bytes.len());
        std::fs::write(repo.join("blobs").join(&blob), &bytes).unwrap();
        std::os::unix::fs::symlink(
            Path::new("../../blobs").join(&blob),
            snapshot.join(entry.file_name()),
        )
        .unwrap();
    }
    for r in refs {
        let path = repo.join("refs").join(r);
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(path, commit).unwrap();
    }
    snapshot
}

fn rlmerge_hash(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf29ce484222325u64, |h, &b| {
        (h ^ b as u64).wrapping_mul(0x100000001b3)
    })
}

/// A merge of ids with only `env` set for the Hub (HOME, HF_* cleared first).
fn merge_ids(
    out: &Path,
    base: &str,
    agents: &[&str],
    env: &[(&str, &Path)],
) -> assert_cmd::Command {
    let mut cmd = rlmerge();
    cmd.args(["merge", "-q", "--method", "ram+", "--base", base]);
    for a in agents {
        cmd.args(["--model", a]);
    }
    cmd.arg("-o").arg(out);
    for k in ["HF_HUB_CACHE", "HF_HOME", "HF_ENDPOINT", "HF_TOKEN"] {
        cmd.env_remove(k);
    }
    cmd.env("HF_HUB_OFFLINE", "1");
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd
}

fn setup() -> (Fixture, PathBuf) {
    let f = fixture(81, Dtype::BF16, &odd_shapes(), &DENSITIES[..2], 2);
    let cache = f.dir.path().join("hub-cache");
    cache_model(&cache, &f.base, "org/base", COMMITS[0], &["main"]);
    cache_model(
        &cache,
        &f.agents[0],
        "org/coder",
        COMMITS[1],
        &["main", "v1"],
    );
    cache_model(
        &cache,
        &f.agents[1],
        "team-x/tools.v2",
        COMMITS[2],
        &["refs/pr/7"],
    );
    (f, cache)
}

#[test]
fn ids_from_the_cache_give_the_bytes_of_the_folders() {
    let (f, cache) = setup();
    let folders = f.dir.path().join("from-folders");
    merge_cmd(&f, &folders, &["--method", "ram+"])
        .assert()
        .success();
    let want = read_folder(&folders);
    let variants: [(&str, [&str; 2]); 3] = [
        ("branch", ["org/coder", "team-x/tools.v2@refs/pr/7"]),
        ("tag", ["org/coder@v1", "team-x/tools.v2@refs/pr/7"]),
        (
            "commit",
            [
                "org/coder@2222222222222222222222222222222222222222",
                "team-x/tools.v2@3333333333333333333333333333333333333333",
            ],
        ),
    ];
    for (name, agents) in variants {
        let out = f.dir.path().join(name);
        merge_ids(&out, "org/base", &agents, &[("HF_HUB_CACHE", &cache)])
            .assert()
            .success();
        assert_eq!(read_folder(&out), want, "{name}");
        let record = std::fs::read_to_string(out.join("rlmerge_record.json")).unwrap();
        for id in [
            "org/base@1111111111111111111111111111111111111111",
            "org/coder@2222222222222222222222222222222222222222",
            "team-x/tools.v2@3333333333333333333333333333333333333333",
        ] {
            assert!(record.contains(id), "{name}: {id} not in the record");
        }
        let card = std::fs::read_to_string(out.join("README.md")).unwrap();
        assert!(
            card.contains("base_model:\n- \"org/base\"\n- \"org/coder\"\n"),
            "{card}"
        );
        assert!(
            card.contains("`org/coder@2222222222222222222222222222222222222222`"),
            "{card}"
        );
        // The record names the snapshots by id (no path of this machine): found in the cache.
        rlmerge()
            .args(["verify", "--against"])
            .arg(&out)
            .env("HF_HUB_CACHE", &cache)
            .assert()
            .success();
    }
}

#[test]
fn the_cache_is_found_through_hf_home_and_home() {
    let (f, cache) = setup();
    let want = {
        let out = f.dir.path().join("folders");
        merge_cmd(&f, &out, &["--method", "ram+"])
            .assert()
            .success();
        read_folder(&out)
    };
    // HF_HOME/hub, then ~/.cache/huggingface/hub.
    let home = f.dir.path().join("hf-home");
    std::fs::create_dir_all(&home).unwrap();
    std::fs::rename(&cache, home.join("hub")).unwrap();
    let out = f.dir.path().join("via-hf-home");
    merge_ids(
        &out,
        "org/base",
        &["org/coder", "team-x/tools.v2@refs/pr/7"],
        &[("HF_HOME", &home)],
    )
    .assert()
    .success();
    assert_eq!(read_folder(&out), want);
    let user = f.dir.path().join("user");
    std::fs::create_dir_all(user.join(".cache/huggingface")).unwrap();
    std::fs::rename(home.join("hub"), user.join(".cache/huggingface/hub")).unwrap();
    let out = f.dir.path().join("via-home");
    merge_ids(
        &out,
        "org/base",
        &["org/coder", "team-x/tools.v2@refs/pr/7"],
        &[("HOME", &user)],
    )
    .assert()
    .success();
    assert_eq!(read_folder(&out), want);
}

#[test]
fn offline_misses_fail_naming_the_id_and_the_cache() {
    let (f, cache) = setup();
    // A ref to a commit whose snapshot is not there, a snapshot without weights, an unknown id.
    let coder = cache.join("models--org--coder");
    std::fs::write(
        coder.join("refs/gone"),
        "4444444444444444444444444444444444444444",
    )
    .unwrap();
    let partial = coder.join("snapshots/5555555555555555555555555555555555555555");
    std::fs::create_dir_all(&partial).unwrap();
    std::fs::write(partial.join("config.json"), "{}").unwrap();
    for (agent, what) in [
        ("org/coder@gone", "models--org--coder"),
        (
            "org/coder@5555555555555555555555555555555555555555",
            "models--org--coder",
        ),
        ("org/nothere", "models--org--nothere"),
        ("org/coder@no-such-branch", "models--org--coder"),
    ] {
        let out = f.dir.path().join("out");
        let o = merge_ids(&out, "org/base", &[agent], &[("HF_HUB_CACHE", &cache)])
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(1), "{agent}: {err}");
        let name = agent.split('@').next().unwrap();
        assert!(err.contains(name) && err.contains(what), "{agent}: {err}");
        assert!(err.contains("HF_HUB_OFFLINE"), "{err}");
        assert!(!out.exists());
    }
    // Neither a folder nor an id: the usual missing-folder error.
    let out = f.dir.path().join("out");
    let o = merge_ids(
        &out,
        "org/base",
        &["no/such/folder"],
        &[("HF_HUB_CACHE", &cache)],
    )
    .output()
    .unwrap();
    assert_eq!(
        o.status.code(),
        Some(2),
        "a missing folder is a usage error"
    );
    assert!(String::from_utf8_lossy(&o.stderr).contains("no/such/folder"));
}

#[test]
fn a_mergekit_recipe_naming_ids_runs_from_the_cache() {
    let (f, cache) = setup();
    let recipe = |base: &str, a: &str, b: &str| {
        format!(
            "merge_method: ties\nbase_model: {base}\nparameters:\n  density: 0.5\ndtype: bfloat16\n\
             models:\n  - model: {a}\n    parameters:\n      weight: 0.6\n  - model: {b}\n    parameters:\n      weight: 0.4\n"
        )
    };
    let run = |text: String, out: &Path| {
        let path = f.dir.path().join("recipe.yml");
        std::fs::write(&path, text).unwrap();
        let mut cmd = rlmerge();
        cmd.arg("run").arg(&path).arg("-q").arg("-o").arg(out);
        cmd.env_remove("HF_HOME")
            .env("HF_HUB_CACHE", &cache)
            .env("HF_HUB_OFFLINE", "1");
        cmd.assert().success();
        read_folder(out)
    };
    let (base, a, b) = (
        f.base.display().to_string(),
        f.agents[0].display().to_string(),
        f.agents[1].display().to_string(),
    );
    let from_folders = run(recipe(&base, &a, &b), &f.dir.path().join("r1"));
    let from_ids = run(
        recipe("org/base", "org/coder@v1", "team-x/tools.v2@refs/pr/7"),
        &f.dir.path().join("r2"),
    );
    assert_eq!(from_ids, from_folders);
    // The saved recipe names each model by the snapshot it read (org/name@commit), not by a
    // path into this machine's cache, and makes the same merge.
    let saved = f.dir.path().join("r2/mergekit_config.yml");
    let config = std::fs::read_to_string(&saved).unwrap();
    assert!(
        config.contains("model: org/coder@") && !config.contains("org/coder@v1"),
        "{config}"
    );
    assert!(!config.contains(&*cache.to_string_lossy()), "{config}");
    let again = run(config, &f.dir.path().join("r3"));
    assert_eq!(again, from_ids);
}

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
