//! Models of very many tensors (MoE checkpoints have 10^5): merged correctly, with per-tensor
//! state small enough that 60,000 tensors × 3 models stay far below what they took before
//! (282 MiB; now about 60 MiB). A guard against per-tensor state growing back, with a wide margin,
//! not a timing or benchmark assertion (benches/many_tensors.sh measures 600,000 tensors). Its own
//! test binary, so the peak RSS of its children is this merge's alone.

#![cfg(unix)]

mod common;
use common::*;
use std::path::Path;

const TENSORS: usize = 60_000;

/// A model of TENSORS tensors of 2 bf16 each; every `every`-th first element is moved by one ULP.
fn write_model(dir: &Path, every: usize) {
    std::fs::create_dir_all(dir).unwrap();
    let mut header = String::from("{");
    let mut data = Vec::with_capacity(TENSORS * 4);
    for i in 0..TENSORS {
        if i > 0 {
            header.push(',');
        }
        header.push_str(&format!(
            r#""model.layers.{}.mlp.experts.{}.w":{{"dtype":"BF16","shape":[2],"data_offsets":[{},{}]}}"#,
            i / 1000,
            i % 1000,
            4 * i,
            4 * i + 4
        ));
        let first: u16 = if every > 0 && i % every == 0 {
            0x3f81
        } else {
            0x3f80
        };
        data.extend_from_slice(&first.to_le_bytes());
        data.extend_from_slice(&0x3f80u16.to_le_bytes());
    }
    header.push('}');
    while header.len() % 8 != 0 {
        header.push(' ');
    }
    let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(header.as_bytes());
    bytes.extend_from_slice(&data);
    std::fs::write(dir.join("model.safetensors"), bytes).unwrap();
    std::fs::write(dir.join("config.json"), r#"{"model_type": "llama"}"#).unwrap();
}

#[test]
fn sixty_thousand_tensors_merge_correctly_in_little_memory() {
    let dir = tempfile::tempdir().unwrap();
    let (base, a, b, c) = (
        dir.path().join("base"),
        dir.path().join("a"),
        dir.path().join("b"),
        dir.path().join("c"),
    );
    write_model(&base, 0);
    write_model(&a, 3);
    write_model(&b, 5);
    write_model(&c, 7);
    let out = dir.path().join("out");
    let o = std::process::Command::new(env!("CARGO_BIN_EXE_rlmerge"))
        .args([
            "merge", "--quiet", "--device", "cpu", "--method", "ram", "--base",
        ])
        .arg(&base)
        .args(["--model"])
        .arg(&a)
        .arg("--model")
        .arg(&b)
        .arg("--model")
        .arg(&c)
        .arg("-o")
        .arg(&out)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let merged = read_folder(&out);
    assert_eq!(merged.len(), TENSORS);
    for i in [0usize, 3, 5, 7, 15, 21, 105, 59_999] {
        let name = format!("model.layers.{}.mlp.experts.{}.w", i / 1000, i % 1000);
        let first = u16::from_le_bytes([merged[&name].2[0], merged[&name].2[1]]);
        // Every agent that changed it moved it by the same ULP: the mean is that value.
        let changed = [3, 5, 7].iter().any(|e| i % e == 0);
        assert_eq!(first, if changed { 0x3f81 } else { 0x3f80 }, "{name}");
    }
    rlmerge().arg("verify").arg(&out).assert().success();
    // Peak RSS of this binary's children (the merge and the verify), in KiB on Linux.
    let mut usage = std::mem::MaybeUninit::<libc::rusage>::zeroed();
    // SAFETY: getrusage writes a rusage into the pointer it is given.
    let usage = unsafe {
        assert_eq!(
            libc::getrusage(libc::RUSAGE_CHILDREN, usage.as_mut_ptr()),
            0
        );
        usage.assume_init()
    };
    let peak_mib = usage.ru_maxrss as f64 / 1024.0;
    assert!(
        peak_mib < 150.0,
        "peak RSS {peak_mib:.0} MiB for {TENSORS} tensors × 4 models (about 60 expected)"
    );
}
