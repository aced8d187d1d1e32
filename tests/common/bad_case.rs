//! The bad-input cases' fixture: a base, one good agent and a `bad` agent folder each case fills
//! in, and the checks every refusal must pass (one error line naming the file, exit code, nothing
//! left at the output path).

use super::*;
use safetensors::tensor::Dtype;
use std::path::{Path, PathBuf};

pub fn tensor(name: &str, dtype: Dtype, shape: &[usize], seed: f32) -> T {
    let n: usize = shape.iter().product();
    T {
        name: name.into(),
        dtype,
        shape: shape.to_vec(),
        values: (0..n)
            .map(|i| round_to(dtype, seed + i as f32 / 128.0))
            .collect(),
    }
}

pub fn good_model(dir: &Path, seed: f32) {
    write_folder(
        dir,
        &[
            tensor("a.weight", Dtype::BF16, &[4, 5], seed),
            tensor("b.weight", Dtype::BF16, &[7], seed),
        ],
        1,
    );
}

/// A base, one good agent, and a second agent folder `bad` the case fills in.
pub struct Case {
    pub dir: tempfile::TempDir,
    pub base: PathBuf,
    pub good: PathBuf,
    pub bad: PathBuf,
}

pub fn case() -> Case {
    let dir = tempfile::tempdir().unwrap();
    let base = dir.path().join("base");
    let good = dir.path().join("good");
    let bad = dir.path().join("bad");
    good_model(&base, 0.0);
    good_model(&good, 0.5);
    Case {
        dir,
        base,
        good,
        bad,
    }
}

/// A safetensors file from a raw header and data.
pub fn write_raw(path: &Path, header: &str, data: &[u8]) {
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(header.as_bytes());
    bytes.extend_from_slice(data);
    std::fs::write(path, bytes).unwrap();
}

/// Runs the merge, expects failure with an error line containing every `needles`, and checks
/// that neither the output nor a temporary folder is left.
pub fn expect_failure(c: &Case, needles: &[&str]) -> String {
    let out = c.dir.path().join("out");
    let mut cmd = rlmerge();
    cmd.args(["merge", "--quiet"]).arg("--base").arg(&c.base);
    cmd.arg("--model")
        .arg(&c.good)
        .arg("--model")
        .arg(&c.bad)
        .arg("-o")
        .arg(&out);
    let output = cmd.output().unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr).to_string();
    assert_eq!(output.status.code(), Some(1), "stderr: {stderr}");
    let errors: Vec<&str> = stderr.lines().filter(|l| l.starts_with("error:")).collect();
    assert_eq!(errors.len(), 1, "one error line expected: {stderr}");
    assert_eq!(
        stderr
            .lines()
            .filter(|l| !l.starts_with("warning:"))
            .count(),
        1,
        "{stderr}"
    );
    for n in needles {
        assert!(errors[0].contains(n), "'{n}' not in: {}", errors[0]);
    }
    assert!(!out.exists(), "output folder left behind");
    let leftovers: Vec<_> = std::fs::read_dir(c.dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().to_string())
        .filter(|n| n.contains("rlmerge-tmp"))
        .collect();
    assert!(leftovers.is_empty(), "{leftovers:?}");
    errors[0].to_string()
}

/// An agent whose only file is a raw safetensors `header` followed by `data_len` zero bytes must fail
/// with an error naming the file and each of `needles`.
pub fn header_fails(header: &str, data_len: usize, needles: &[&str]) {
    let c = case();
    write_raw(&c.bad.join("model.safetensors"), header, &vec![0; data_len]);
    let file = bad_path(&c, "model.safetensors");
    expect_failure(&c, &[&[file.as_str()], needles].concat());
}

pub fn bad_path(c: &Case, file: &str) -> String {
    c.bad.join(file).display().to_string()
}

pub fn merge_out(c: &Case, agents: &[&Path], extra: &[&str]) -> (std::process::Output, PathBuf) {
    let out = c.dir.path().join("out");
    let mut cmd = rlmerge();
    cmd.args(["merge", "--quiet"])
        .args(extra)
        .arg("--base")
        .arg(&c.base);
    for a in agents {
        cmd.arg("--model").arg(a);
    }
    cmd.arg("-o").arg(&out);
    (cmd.output().unwrap(), out)
}

pub fn err_of(o: &std::process::Output) -> String {
    String::from_utf8_lossy(&o.stderr).to_string()
}
