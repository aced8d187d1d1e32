//! `rlmerge verify`: the merge record's checksums catch a flipped byte in any output or input file, and
//! `--against` recomputes the merge and compares bytes.

mod common;
use common::*;
use safetensors::tensor::Dtype;
use std::path::Path;

fn verify(dir: &Path, extra: &[&str]) -> std::process::Output {
    rlmerge()
        .arg("verify")
        .arg(dir)
        .args(extra)
        .output()
        .unwrap()
}

fn flip(path: &Path, at: usize) {
    let mut bytes = std::fs::read(path).unwrap();
    let i = at % bytes.len();
    bytes[i] ^= 0x10;
    std::fs::write(path, bytes).unwrap();
}

fn crc(path: &Path) -> String {
    let mut h = crc32fast::Hasher::new();
    h.update(&std::fs::read(path).unwrap());
    format!("{:08x}", h.finalize())
}

fn merged(f: &Fixture, name: &str, extra: &[&str]) -> std::path::PathBuf {
    let out = f.dir.path().join(name);
    merge_cmd(f, &out, extra).assert().success();
    out
}

#[test]
fn recorded_checksums_match_the_files_for_any_tiling() {
    let f = fixture(1, Dtype::BF16, &odd_shapes(), &DENSITIES[..3], 2);
    for (name, extra) in [
        ("a", vec!["--method", "ram+"]),
        ("b", vec!["--method", "ram+", "--tile-elems", "7"]),
        ("c", vec!["--method", "ram", "--shard-size", "1500"]),
        // Statistics scans read in order, then the merge pass in parallel tiles of another size.
        (
            "d",
            vec![
                "--method",
                "ties",
                "--param",
                "weight=1",
                "--param",
                "density=0.4",
                "--tile-elems",
                "5",
            ],
        ),
    ] {
        let out = merged(&f, name, &extra);
        let record: serde_json::Value = serde_json::from_str(
            &std::fs::read_to_string(out.join("rlmerge_record.json")).unwrap(),
        )
        .unwrap();
        let inputs = record["inputs"].as_array().unwrap();
        assert_eq!(inputs.len(), 4);
        for input in inputs {
            // Named relative to the merged folder (issue #45).
            let dir = out.join(input["path"].as_str().unwrap());
            for file in input["files"].as_array().unwrap() {
                let p = dir.join(file["file"].as_str().unwrap());
                assert_eq!(file["crc32"].as_str().unwrap(), crc(&p), "{}", p.display());
                assert_eq!(
                    file["size"].as_u64().unwrap(),
                    std::fs::metadata(&p).unwrap().len()
                );
            }
        }
        for file in record["outputs"].as_array().unwrap() {
            assert_eq!(
                file["crc32"].as_str().unwrap(),
                crc(&out.join(file["file"].as_str().unwrap()))
            );
        }
        let o = verify(&out, &["--against", "--device", "cpu"]);
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stdout));
    }
}

#[test]
fn a_flipped_byte_in_any_output_file_is_caught() {
    let f = fixture(2, Dtype::F16, &odd_shapes(), &DENSITIES[..2], 1);
    let out = merged(&f, "out", &["--shard-size", "1500"]);
    let files: Vec<String> = std::fs::read_dir(&out)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().to_string())
        .filter(|n| n != "rlmerge_record.json" && n != "README.md")
        .collect();
    assert!(files.len() >= 5, "{files:?}");
    for file in &files {
        for at in [3usize, 97, 1_000_003] {
            let copy = f.dir.path().join("copy");
            let _ = std::fs::remove_dir_all(&copy);
            std::process::Command::new("cp")
                .arg("-r")
                .arg(&out)
                .arg(&copy)
                .status()
                .unwrap();
            flip(&copy.join(file), at);
            let o = verify(&copy, &[]);
            let text = String::from_utf8_lossy(&o.stdout).to_string()
                + &String::from_utf8_lossy(&o.stderr);
            assert_eq!(o.status.code(), Some(1), "{file}@{at}: {text}");
            assert!(
                text.contains(&format!("FAIL  output {}", copy.join(file).display())),
                "{text}"
            );
        }
    }
}

#[test]
fn a_changed_input_is_caught_and_blocks_against() {
    let f = fixture(3, Dtype::BF16, &odd_shapes(), &DENSITIES[..2], 1);
    let out = merged(&f, "out", &[]);
    assert!(verify(&out, &[]).status.success());
    let victim = f.agents[1].join("model-00002-of-00002.safetensors");
    flip(&victim, 40);
    let o = verify(&out, &["--against", "--device", "cpu"]);
    let text = String::from_utf8_lossy(&o.stdout).to_string();
    assert_eq!(o.status.code(), Some(1), "{text}");
    assert!(
        text.contains("FAIL  input") && text.contains("model-00002-of-00002.safetensors"),
        "{text}"
    );
    assert!(text.contains("cannot be recomputed"), "{text}");
}

#[test]
fn missing_inputs_are_skipped_but_needed_for_against() {
    let f = fixture(4, Dtype::BF16, &odd_shapes(), &DENSITIES[..2], 1);
    let out = merged(&f, "out", &[]);
    std::fs::rename(&f.agents[0], f.dir.path().join("moved")).unwrap();
    let o = verify(&out, &[]);
    let text = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success(), "{text}");
    assert!(text.contains("skip  input"), "{text}");
    assert_eq!(
        verify(&out, &["--against", "--device", "cpu"])
            .status
            .code(),
        Some(1)
    );
}

#[test]
fn against_catches_a_consistent_but_wrong_output() {
    let f = fixture(5, Dtype::F32, &odd_shapes(), &DENSITIES[..3], 1);
    let out = merged(&f, "out", &[]);
    // Change a tensor byte and record the new checksum: the record check passes, recomputing does not.
    let shard = out.join("model.safetensors");
    let len = std::fs::metadata(&shard).unwrap().len() as usize;
    flip(&shard, len - 2);
    let record_path = out.join("rlmerge_record.json");
    let mut record: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&record_path).unwrap()).unwrap();
    for o in record["outputs"].as_array_mut().unwrap() {
        if o["file"] == "model.safetensors" {
            o["crc32"] = crc(&shard).into();
        }
    }
    std::fs::write(&record_path, serde_json::to_string(&record).unwrap()).unwrap();
    assert!(verify(&out, &[]).status.success());
    let mut devices = vec!["cpu"];
    if gpu_available("verify --against on the GPU") {
        devices.push("gpu");
    }
    for device in devices {
        let o = verify(&out, &["--against", "--device", device]);
        let text = String::from_utf8_lossy(&o.stdout);
        assert_eq!(o.status.code(), Some(1), "{text}");
        assert!(
            text.contains(&format!(
                "recomputed model.safetensors differs from the output at byte {}",
                len - 2
            )),
            "{text}"
        );
    }
    assert_eq!(
        std::fs::read_dir(f.dir.path())
            .unwrap()
            .filter(|e| e
                .as_ref()
                .unwrap()
                .file_name()
                .to_string_lossy()
                .contains("rlmerge-verify"))
            .count(),
        0
    );
}

#[test]
fn verify_of_a_folder_without_record_is_an_error() {
    let dir = tempfile::tempdir().unwrap();
    let o = verify(dir.path(), &[]);
    assert_eq!(o.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&o.stderr).contains("rlmerge_record.json"));
}

#[test]
fn against_recomputes_beside_the_output_or_in_the_temporary_folder_and_cleans_up() {
    let f = fixture(9, Dtype::BF16, &odd_shapes(), &DENSITIES[..2], 1);
    let out = merged(&f, "out", &[]);
    let tmp = tempfile::tempdir().unwrap();
    // What killed `verify --against` runs left, beside the output and in the temporary folder:
    // their scratch folders, their lock files free.
    for place in [f.dir.path(), tmp.path()] {
        std::fs::create_dir_all(place.join(".rlmerge-verify-1-dead/recomputed")).unwrap();
        std::fs::write(place.join(".rlmerge-verify-1-dead.lock"), b"").unwrap();
    }
    let verify = || {
        rlmerge()
            .env("TMPDIR", tmp.path())
            .args(["verify", "--against", "--device", "cpu"])
            .arg(&out)
            .output()
            .unwrap()
    };
    let entries = |p: &Path| -> Vec<String> {
        let mut v: Vec<String> = std::fs::read_dir(p)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        v.sort();
        v
    };
    let o = verify();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(
        String::from_utf8_lossy(&o.stdout).contains("recomputed model.safetensors is identical")
    );
    assert!(
        !entries(f.dir.path()).iter().any(|e| e.contains("rlmerge")),
        "{:?}",
        entries(f.dir.path())
    );
    // The killed run's folder in the temporary folder goes when a verify recomputes there: when
    // the output's folder is not writable (as root, permissions do not stop writes: a file in
    // the way of the lock file stands for it).
    assert_eq!(
        entries(tmp.path()).len(),
        2,
        "only swept where it recomputes"
    );
}

/// A folder written before the record had its own name (rlmerge_recipe.json) still verifies, and
/// --force may still replace it: it is rlmerge's, by its old record.
#[test]
fn a_record_under_its_old_name_is_still_read() {
    let f = fixture(1, Dtype::BF16, &odd_shapes(), &DENSITIES[..3], 2);
    let out = merged(&f, "old", &["--method", "ram"]);
    std::fs::rename(
        out.join("rlmerge_record.json"),
        out.join("rlmerge_recipe.json"),
    )
    .unwrap();
    let v = verify(&out, &[]);
    assert!(v.status.success(), "{}", String::from_utf8_lossy(&v.stderr));
    merge_cmd(&f, &out, &["--method", "ram", "--force"])
        .assert()
        .success();
    assert!(out.join("rlmerge_record.json").is_file());
    assert!(!out.join("rlmerge_recipe.json").exists());
}

/// Issue #50 item 4: verify checks what it claims. A spectral merge made on the GPU (whose GEMM
/// sums in another order, docs/gpu.md) recomputed on the CPU agrees within the backends'
/// tolerance and says so — not a failure; every other method's bytes are the same on both. A
/// record says which backend made it. An input's config.json changed since the merge (another
/// norm ε) fails verify, as a weight would; a record whose shard size was changed names it
/// instead of an internal path.
#[test]
fn verify_compares_across_backends_and_catches_changed_configs() {
    let f = matrices(50);
    let record = |out: &Path| -> serde_json::Value {
        serde_json::from_slice(&std::fs::read(out.join("rlmerge_record.json")).unwrap()).unwrap()
    };
    let cpu = merged(&f, "cpu", &["--method", "tsv", "--device", "cpu"]);
    assert_eq!(record(&cpu)["backend"], "cpu");
    if gpu_available("verify of a GPU-made spectral merge") {
        let gpu = merged(&f, "gpu", &["--method", "tsv", "--device", "gpu"]);
        assert_eq!(record(&gpu)["backend"], "gpu");
        let o = verify(&gpu, &["--against", "--device", "cpu"]);
        let said = String::from_utf8_lossy(&o.stdout).into_owned();
        assert!(o.status.success(), "{said}{}", err_of(&o));
        assert!(
            said.contains("identical") || said.contains("agrees within 1e-6"),
            "{said}"
        );
        if read_folder(&gpu) != read_folder(&cpu) {
            assert!(said.contains("made on gpu, recomputed on cpu"), "{said}");
        }
        // RAM gives the same bytes on both: verified byte for byte across them.
        let ram = merged(&f, "ram-gpu", &["--method", "ram", "--device", "gpu"]);
        let o = verify(&ram, &["--against", "--device", "cpu"]);
        let said = String::from_utf8_lossy(&o.stdout).into_owned();
        assert!(
            o.status.success() && said.contains("model.safetensors is identical"),
            "{said}"
        );
    }
    // A changed config of an input: the record holds its checksum.
    let out = merged(&f, "ties", &["--method", "ties", "--param", "weight=1"]);
    assert!(verify(&out, &[]).status.success());
    let config = f.agents[1].join("config.json");
    let before = std::fs::read(&config).unwrap();
    let mut edited: serde_json::Value = serde_json::from_slice(&before).unwrap();
    edited["rms_norm_eps"] = serde_json::json!(1e-5);
    std::fs::write(&config, edited.to_string()).unwrap();
    let o = verify(&out, &["--against"]);
    assert_eq!(o.status.code(), Some(1));
    let said = String::from_utf8_lossy(&o.stdout).into_owned();
    assert!(
        said.contains("FAIL  input") && said.contains("config.json"),
        "{said}"
    );
    std::fs::write(&config, before).unwrap();
    assert!(verify(&out, &["--against"]).status.success());
    // A record whose shard size says 1 byte: named, not an internal scratch path.
    let path = out.join("rlmerge_record.json");
    let mut tampered = record(&out);
    tampered["shard_size"] = serde_json::json!(1);
    std::fs::write(&path, tampered.to_string()).unwrap();
    let o = verify(&out, &["--against"]);
    let said = String::from_utf8_lossy(&o.stdout).into_owned();
    assert_eq!(o.status.code(), Some(1), "{said}");
    assert!(said.contains("shard_size is 1"), "{said}");
    assert!(!said.contains(".rlmerge-verify"), "{said}");
}

/// The cross-backend comparison itself, without a GPU: an output one bf16 step off the
/// recomputation in one element (what another GEMM's rounding can make) passes where the record
/// says the spectral merge was made on the GPU, and fails byte for byte where it says the CPU;
/// two steps off fails either way.
#[test]
fn a_gpu_made_spectral_merge_is_compared_within_one_step() {
    let f = fixture(
        52,
        Dtype::BF16,
        &[("model.layers.0.self_attn.q_proj.weight", vec![24, 16])],
        &[0.1, 0.15],
        1,
    );
    let out = merged(&f, "tsv", &["--method", "tsv", "--device", "cpu"]);
    let shard = out.join("model.safetensors");
    let original = std::fs::read(&shard).unwrap();
    let record_path = out.join("rlmerge_record.json");
    let original_record = std::fs::read_to_string(&record_path).unwrap();
    let tamper = |steps: u16, backend: &str| {
        let mut bytes = original.clone();
        let header = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
        let at = 8 + header + 2 * 5;
        let bits = u16::from_le_bytes([bytes[at], bytes[at + 1]]);
        bytes[at..at + 2].copy_from_slice(&(bits + steps).to_le_bytes());
        std::fs::write(&shard, &bytes).unwrap();
        let mut record: serde_json::Value = serde_json::from_str(&original_record).unwrap();
        record["backend"] = backend.into();
        for o in record["outputs"].as_array_mut().unwrap() {
            if o["file"] == "model.safetensors" {
                o["crc32"] = crc(&shard).into();
            }
        }
        std::fs::write(&record_path, record.to_string()).unwrap();
        let o = verify(&out, &["--against", "--device", "cpu"]);
        (
            o.status.success(),
            String::from_utf8_lossy(&o.stdout).into_owned(),
        )
    };
    let (ok, said) = tamper(1, "gpu");
    assert!(ok && said.contains("agrees within 1e-6"), "{said}");
    assert!(said.contains("made on gpu, recomputed on cpu"), "{said}");
    let (ok, said) = tamper(1, "cpu");
    assert!(
        !ok && said.contains("differs from the output at byte"),
        "{said}"
    );
    let (ok, said) = tamper(2, "gpu");
    assert!(
        !ok && said.contains("beyond the backends' rounding"),
        "{said}"
    );
}
