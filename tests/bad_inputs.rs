//! Bad input: a one-line error naming the file and tensor, exit code ≠ 0, and no output folder.

mod common;
use common::*;
use safetensors::tensor::Dtype;
use std::path::{Path, PathBuf};

fn tensor(name: &str, dtype: Dtype, shape: &[usize], seed: f32) -> T {
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

fn good_model(dir: &Path, seed: f32) {
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
struct Case {
    dir: tempfile::TempDir,
    base: PathBuf,
    good: PathBuf,
    bad: PathBuf,
}

fn case() -> Case {
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
fn write_raw(path: &Path, header: &str, data: &[u8]) {
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(header.as_bytes());
    bytes.extend_from_slice(data);
    std::fs::write(path, bytes).unwrap();
}

/// Runs the merge, expects failure with an error line containing every `needles`, and checks
/// that neither the output nor a temporary folder is left.
fn expect_failure(c: &Case, needles: &[&str]) -> String {
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
fn header_fails(header: &str, data_len: usize, needles: &[&str]) {
    let c = case();
    write_raw(&c.bad.join("model.safetensors"), header, &vec![0; data_len]);
    let file = bad_path(&c, "model.safetensors");
    expect_failure(&c, &[&[file.as_str()], needles].concat());
}

fn bad_path(c: &Case, file: &str) -> String {
    c.bad.join(file).display().to_string()
}

#[test]
fn missing_folder() {
    let c = case();
    expect_failure(&c, &[&c.bad.display().to_string(), "does not exist"]);
}

#[test]
fn folder_without_safetensors() {
    let c = case();
    std::fs::create_dir_all(&c.bad).unwrap();
    std::fs::write(c.bad.join("pytorch_model.bin"), b"not ours").unwrap();
    expect_failure(&c, &[&c.bad.display().to_string(), "model.safetensors"]);
}

#[test]
fn index_names_a_missing_shard() {
    let c = case();
    good_model(&c.bad, 1.0);
    std::fs::rename(
        c.bad.join("model.safetensors"),
        c.bad.join("model-00001-of-00002.safetensors"),
    )
    .unwrap();
    std::fs::write(
        c.bad.join("model.safetensors.index.json"),
        r#"{"metadata": {}, "weight_map": {"a.weight": "model-00001-of-00002.safetensors", "b.weight": "model-00002-of-00002.safetensors"}}"#,
    )
    .unwrap();
    expect_failure(
        &c,
        &["model-00002-of-00002.safetensors", "missing", "index.json"],
    );
}

#[test]
fn truncated_file() {
    let c = case();
    good_model(&c.bad, 1.0);
    let p = c.bad.join("model.safetensors");
    let bytes = std::fs::read(&p).unwrap();
    std::fs::write(&p, &bytes[..bytes.len() - 3]).unwrap();
    expect_failure(
        &c,
        &[&bad_path(&c, "model.safetensors"), "b.weight", "truncated"],
    );
    // Cut inside the header too.
    std::fs::write(&p, &bytes[..20]).unwrap();
    expect_failure(&c, &[&bad_path(&c, "model.safetensors"), "truncated"]);
}

#[test]
fn corrupt_header_json() {
    header_fails(
        r#"{"a.weight": {"dtype": "BF16", "shape": [4, 5], "#,
        54,
        &["corrupt header JSON"],
    );
}

#[test]
fn data_offsets_out_of_range() {
    header_fails(
        r#"{"a.weight":{"dtype":"BF16","shape":[4,5],"data_offsets":[0,40]},"b.weight":{"dtype":"BF16","shape":[7],"data_offsets":[40,5400]}}"#,
        54,
        &["b.weight", "out of range"],
    );
}

#[test]
fn data_offsets_not_matching_shape() {
    header_fails(
        r#"{"a.weight":{"dtype":"BF16","shape":[4,5],"data_offsets":[0,38]},"b.weight":{"dtype":"BF16","shape":[7],"data_offsets":[38,52]}}"#,
        54,
        &["a.weight", "needs 40"],
    );
}

#[test]
fn unsupported_dtype() {
    header_fails(
        r#"{"a.weight":{"dtype":"I64","shape":[4,5],"data_offsets":[0,160]}}"#,
        160,
        &["a.weight", "unsupported dtype I64"],
    );
}

#[test]
fn shape_differs_from_base() {
    let c = case();
    write_folder(
        &c.bad,
        &[
            tensor("a.weight", Dtype::BF16, &[5, 4], 1.0),
            tensor("b.weight", Dtype::BF16, &[7], 1.0),
        ],
        1,
    );
    expect_failure(
        &c,
        &[
            &bad_path(&c, "model.safetensors"),
            "a.weight",
            "[5, 4]",
            "[4, 5]",
        ],
    );
}

#[test]
fn dtype_differs_from_base() {
    let c = case();
    write_folder(
        &c.bad,
        &[
            tensor("a.weight", Dtype::BF16, &[4, 5], 1.0),
            tensor("b.weight", Dtype::F32, &[7], 1.0),
        ],
        1,
    );
    expect_failure(
        &c,
        &[
            &bad_path(&c, "model.safetensors"),
            "b.weight",
            "f32",
            "bf16",
        ],
    );
}

#[test]
fn tensor_missing_in_an_agent_is_merged_from_the_others_with_a_warning() {
    let c = case();
    let a = tensor("a.weight", Dtype::BF16, &[4, 5], 1.0);
    write_folder(&c.bad, std::slice::from_ref(&a), 1);
    let out = c.dir.path().join("out");
    let mut cmd = rlmerge();
    cmd.args(["merge", "--quiet", "--method", "ram"])
        .arg("--base")
        .arg(&c.base);
    cmd.arg("--model")
        .arg(&c.good)
        .arg("--model")
        .arg(&c.bad)
        .arg("-o")
        .arg(&out);
    let output = cmd.assert().success().get_output().clone();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains("warning: tensor 'b.weight' is missing in")
            && stderr.contains(&c.bad.display().to_string()),
        "{stderr}"
    );
    // b.weight comes from the good agent alone (unique → kept), a.weight from both.
    let merged = read_folder(&out);
    let base_b = tensor("b.weight", Dtype::BF16, &[7], 0.0);
    let good_b = tensor("b.weight", Dtype::BF16, &[7], 0.5);
    let want = reference_merge(&base_b, &[&good_b], 1e-5, &[1.0], Dtype::BF16);
    assert_eq!(merged["b.weight"].2, want);
    let base_a = tensor("a.weight", Dtype::BF16, &[4, 5], 0.0);
    let good_a = tensor("a.weight", Dtype::BF16, &[4, 5], 0.5);
    let want = reference_merge(&base_a, &[&good_a, &a], 1e-5, &[1.0, 1.0], Dtype::BF16);
    assert_eq!(merged["a.weight"].2, want);
    let record = std::fs::read_to_string(out.join("rlmerge_record.json")).unwrap();
    assert!(record.contains("missing in"));
}

#[test]
fn output_folder_exists_is_refused_unless_forced() {
    let c = case();
    good_model(&c.bad, 1.0);
    let out = c.dir.path().join("out");
    std::fs::create_dir_all(&out).unwrap();
    let run = |force: bool| {
        let mut cmd = rlmerge();
        cmd.args(["merge", "--quiet"]).arg("--base").arg(&c.base);
        cmd.arg("--model")
            .arg(&c.good)
            .arg("--model")
            .arg(&c.bad)
            .arg("-o")
            .arg(&out);
        if force {
            cmd.arg("--force");
        }
        cmd.output().unwrap()
    };
    // Even an empty folder is not replaced without --force.
    let refused = run(false);
    assert_eq!(refused.status.code(), Some(2));
    let err = String::from_utf8_lossy(&refused.stderr);
    assert!(
        err.contains("already exists") && err.contains("--force"),
        "{err}"
    );
    // An empty folder, and then a folder rlmerge wrote, are replaced with it.
    assert!(run(true).status.success());
    assert!(out.join("model.safetensors").exists());
    assert!(run(true).status.success());
    assert!(out.join("model.safetensors").exists());
}

#[test]
fn a_failed_forced_merge_keeps_the_old_output() {
    let c = case();
    good_model(&c.bad, 1.0);
    let out = c.dir.path().join("out");
    let merge = |agent: &Path| {
        let mut cmd = rlmerge();
        cmd.args(["merge", "--quiet", "--force"])
            .arg("--base")
            .arg(&c.base);
        cmd.arg("--model").arg(agent).arg("-o").arg(&out);
        cmd.output().unwrap()
    };
    assert!(merge(&c.good).status.success());
    let before = digest(&out);
    std::fs::write(c.bad.join("model.safetensors"), b"broken").unwrap();
    assert_eq!(merge(&c.bad).status.code(), Some(1));
    assert_eq!(digest(&out), before);
}

#[test]
fn fewer_than_one_agent_is_a_usage_error() {
    let c = case();
    let out = c.dir.path().join("out");
    let output = rlmerge()
        .args(["merge"])
        .arg("--base")
        .arg(&c.base)
        .arg("-o")
        .arg(&out)
        .output()
        .unwrap();
    assert_eq!(output.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&output.stderr).contains("--model"));
    assert!(!out.exists());
}

#[test]
fn parameters_of_another_rule_are_usage_errors() {
    let c = case();
    let out = c.dir.path().join("out");
    for args in [
        vec!["--method", "ram", "--alpha", "1"],
        vec!["--method", "ram+", "--rule", "official", "--r", "0.2"],
        vec!["--method", "ram+", "--rescale-factor", "1.5"],
    ] {
        let mut cmd = rlmerge();
        cmd.arg("merge")
            .args(&args)
            .arg("--base")
            .arg(&c.base)
            .arg("--model")
            .arg(&c.good)
            .arg("-o")
            .arg(&out);
        let output = cmd.output().unwrap();
        assert_eq!(output.status.code(), Some(2), "{args:?}");
        assert!(!out.exists());
    }
}

#[test]
fn huge_header_length() {
    let c = case();
    std::fs::create_dir_all(&c.bad).unwrap();
    let mut bytes = u64::MAX.to_le_bytes().to_vec();
    bytes.extend_from_slice(b"{}");
    std::fs::write(c.bad.join("model.safetensors"), bytes).unwrap();
    expect_failure(&c, &[&bad_path(&c, "model.safetensors"), "header length"]);
    // Within the limit but past the end of the file: no allocation of that size, an error.
    let mut bytes = 90_000_000u64.to_le_bytes().to_vec();
    bytes.extend_from_slice(b"{}");
    std::fs::write(c.bad.join("model.safetensors"), bytes).unwrap();
    expect_failure(&c, &[&bad_path(&c, "model.safetensors"), "truncated"]);
}

#[test]
fn overlapping_data_offsets() {
    let c = case();
    write_raw(
        &c.bad.join("model.safetensors"),
        r#"{"a.weight":{"dtype":"BF16","shape":[4,5],"data_offsets":[0,40]},"b.weight":{"dtype":"BF16","shape":[7],"data_offsets":[30,44]}}"#,
        &[0; 54],
    );
    expect_failure(&c, &[&bad_path(&c, "model.safetensors"), "overlapping"]);
}

#[test]
fn out_of_order_offsets_are_fine() {
    let c = case();
    // b's data comes first in the file: legal, and read correctly.
    let a: Vec<u8> = to_bytes(
        Dtype::BF16,
        &tensor("a.weight", Dtype::BF16, &[4, 5], 1.0).values,
    );
    let b: Vec<u8> = to_bytes(
        Dtype::BF16,
        &tensor("b.weight", Dtype::BF16, &[7], 1.0).values,
    );
    let mut data = b.clone();
    data.extend_from_slice(&a);
    write_raw(
        &c.bad.join("model.safetensors"),
        r#"{"a.weight":{"dtype":"BF16","shape":[4,5],"data_offsets":[14,54]},"b.weight":{"dtype":"BF16","shape":[7],"data_offsets":[0,14]}}"#,
        &data,
    );
    let out = c.dir.path().join("out");
    let mut cmd = rlmerge();
    cmd.args(["merge", "--quiet", "--method", "ram"])
        .arg("--base")
        .arg(&c.base);
    cmd.arg("--model")
        .arg(&c.bad)
        .arg("-o")
        .arg(&out)
        .assert()
        .success();
    let base_a = tensor("a.weight", Dtype::BF16, &[4, 5], 0.0);
    let bad_a = tensor("a.weight", Dtype::BF16, &[4, 5], 1.0);
    assert_eq!(
        read_folder(&out)["a.weight"].2,
        reference_merge(&base_a, &[&bad_a], 1e-5, &[1.0], Dtype::BF16)
    );
}

#[test]
fn shape_whose_element_count_overflows() {
    header_fails(
        r#"{"a.weight":{"dtype":"BF16","shape":[4294967296,4294967296,16],"data_offsets":[0,40]}}"#,
        40,
        &["a.weight", "overflows"],
    );
}

#[test]
fn duplicate_tensor_names() {
    header_fails(
        r#"{"a.weight":{"dtype":"BF16","shape":[4,5],"data_offsets":[0,40]},"a.weight":{"dtype":"BF16","shape":[7],"data_offsets":[40,54]}}"#,
        54,
        &["a.weight", "appears twice"],
    );
}

#[test]
fn non_utf8_tensor_name() {
    let c = case();
    let mut header =
        br#"{"a.weight":{"dtype":"BF16","shape":[4,5],"data_offsets":[0,40]},"b"#.to_vec();
    header.extend_from_slice(&[0xff, 0xfe]);
    header.extend_from_slice(br#"":{"dtype":"BF16","shape":[7],"data_offsets":[40,54]}}"#);
    let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(&header);
    bytes.extend_from_slice(&[0; 54]);
    std::fs::create_dir_all(&c.bad).unwrap();
    std::fs::write(c.bad.join("model.safetensors"), bytes).unwrap();
    expect_failure(&c, &[&bad_path(&c, "model.safetensors"), "UTF-8"]);
}

#[test]
fn index_pointing_outside_the_model_folder() {
    let c = case();
    good_model(&c.bad, 1.0);
    std::fs::rename(
        c.bad.join("model.safetensors"),
        c.bad.join("shard.safetensors"),
    )
    .unwrap();
    std::fs::write(
        c.bad.join("model.safetensors.index.json"),
        r#"{"metadata": {}, "weight_map": {"a.weight": "../good/model.safetensors", "b.weight": "shard.safetensors"}}"#,
    )
    .unwrap();
    expect_failure(
        &c,
        &[
            "index.json",
            "../good/model.safetensors",
            "inside the model folder",
        ],
    );
}

#[test]
fn symlink_loops() {
    let c = case();
    std::fs::create_dir_all(&c.bad).unwrap();
    std::os::unix::fs::symlink("model.safetensors", c.bad.join("model.safetensors")).unwrap();
    expect_failure(&c, &[&bad_path(&c, "model.safetensors")]);
    // A folder that is a link to itself.
    std::fs::remove_dir_all(&c.bad).unwrap();
    std::os::unix::fs::symlink(&c.bad, &c.bad).unwrap();
    expect_failure(&c, &[&c.bad.display().to_string()]);
}

// ---- Issue #12: useless merges, ambiguous folders, repeated inputs, hangs, messages ----

fn merge_out(c: &Case, agents: &[&Path], extra: &[&str]) -> (std::process::Output, PathBuf) {
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

fn err_of(o: &std::process::Output) -> String {
    String::from_utf8_lossy(&o.stderr).to_string()
}

#[test]
fn a_base_without_tensors_is_refused() {
    let c = case();
    good_model(&c.bad, 1.0);
    std::fs::remove_file(c.base.join("model.safetensors")).unwrap();
    write_raw(&c.base.join("model.safetensors"), "{}", &[]);
    let (o, out) = merge_out(&c, &[&c.good, &c.bad], &[]);
    assert_eq!(o.status.code(), Some(1), "{}", err_of(&o));
    assert!(err_of(&o).contains("no tensors"), "{}", err_of(&o));
    assert!(!out.exists());
}

#[test]
fn agents_sharing_no_tensor_name_with_the_base_are_refused() {
    let c = case();
    write_folder(
        &c.bad,
        &[
            tensor("transformer.a.weight", Dtype::BF16, &[4, 5], 1.0),
            tensor("transformer.b.weight", Dtype::BF16, &[7], 1.0),
        ],
        1,
    );
    expect_failure(
        &c,
        &["none of the base's tensor names", "transformer.a.weight"],
    );
}

#[test]
fn a_base_without_a_usable_config_is_refused() {
    for kind in ["missing", "folder", "fifo", "array"] {
        let c = case();
        good_model(&c.bad, 1.0);
        let config = c.base.join("config.json");
        std::fs::remove_file(&config).unwrap();
        match kind {
            "missing" => {}
            "folder" => std::fs::create_dir(&config).unwrap(),
            "fifo" => assert!(std::process::Command::new("mkfifo")
                .arg(&config)
                .status()
                .unwrap()
                .success()),
            _ => std::fs::write(&config, "[1,2]").unwrap(),
        }
        let (o, out) = merge_out(&c, &[&c.good, &c.bad], &[]);
        assert_eq!(o.status.code(), Some(1), "{kind}: {}", err_of(&o));
        assert!(err_of(&o).contains("config.json"), "{kind}: {}", err_of(&o));
        assert!(!out.exists());
    }
}

#[test]
fn every_dtype_key_of_the_config_is_set_to_the_output_dtype() {
    let c = case();
    good_model(&c.bad, 1.0);
    std::fs::write(
        c.base.join("config.json"),
        r#"{"model_type": "llava", "torch_dtype": "bfloat16", "dtype": "bfloat16",
            "text_config": {"dtype": "bfloat16"}}"#,
    )
    .unwrap();
    let (o, out) = merge_out(&c, &[&c.good, &c.bad], &["--out-dtype", "f32"]);
    assert!(o.status.success(), "{}", err_of(&o));
    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("config.json")).unwrap()).unwrap();
    assert_eq!(config["torch_dtype"], "float32");
    assert_eq!(config["dtype"], "float32");
    assert_eq!(config["text_config"]["dtype"], "float32");
}

#[test]
fn a_folder_with_both_a_single_file_and_an_index_is_ambiguous() {
    let c = case();
    good_model(&c.bad, 1.0);
    write_folder(
        &c.dir.path().join("sharded"),
        &[
            tensor("a.weight", Dtype::BF16, &[4, 5], 2.0),
            tensor("b.weight", Dtype::BF16, &[7], 2.0),
        ],
        2,
    );
    for f in std::fs::read_dir(c.dir.path().join("sharded")).unwrap() {
        let f = f.unwrap();
        if f.file_name().to_string_lossy().starts_with("model-")
            || f.file_name() == "model.safetensors.index.json"
        {
            std::fs::copy(f.path(), c.bad.join(f.file_name())).unwrap();
        }
    }
    expect_failure(&c, &["model.safetensors.index.json", "ambiguous"]);
}

#[test]
fn verify_fails_on_weight_files_the_record_does_not_list() {
    let c = case();
    good_model(&c.bad, 1.0);
    let (o, out) = merge_out(&c, &[&c.good, &c.bad], &[]);
    assert!(o.status.success());
    let verify = || rlmerge().arg("verify").arg(&out).output().unwrap();
    assert!(verify().status.success());
    for stray in ["pytorch_model.bin", "model-00002-of-00002.safetensors"] {
        std::fs::write(out.join(stray), b"stray").unwrap();
        let v = verify();
        assert_eq!(v.status.code(), Some(1), "{stray}");
        assert!(String::from_utf8_lossy(&v.stdout).contains(stray));
        std::fs::remove_file(out.join(stray)).unwrap();
    }
    // A model with no tensors does not verify, even with matching checksums.
    write_raw(&out.join("model.safetensors"), "{}", &[]);
    let bytes = std::fs::read(out.join("model.safetensors")).unwrap();
    let record_path = out.join("rlmerge_record.json");
    let mut record: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&record_path).unwrap()).unwrap();
    for f in record["outputs"].as_array_mut().unwrap() {
        if f["file"] == "model.safetensors" {
            f["size"] = bytes.len().into();
            f["crc32"] = format!("{:08x}", crc32fast::hash(&bytes)).into();
        }
    }
    std::fs::write(&record_path, record.to_string()).unwrap();
    let v = verify();
    assert_eq!(v.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&v.stdout).contains("no tensors"));
}

#[test]
fn an_agent_given_twice_or_the_base_as_an_agent_is_a_usage_error() {
    let c = case();
    let alias = c.dir.path().join("alias");
    std::os::unix::fs::symlink(&c.good, &alias).unwrap();
    for (agents, needle) in [
        (vec![&c.good, &c.good], "given twice"),
        (vec![&c.good, &alias], "given twice"),
        (vec![&c.good, &c.base], "is the base model"),
    ] {
        let agents: Vec<&Path> = agents.iter().map(|p| p.as_path()).collect();
        let (o, out) = merge_out(&c, &agents, &[]);
        assert_eq!(o.status.code(), Some(2), "{}", err_of(&o));
        assert!(err_of(&o).contains(needle), "{}", err_of(&o));
        assert!(!out.exists());
        // analyze refuses them too.
        let mut cmd = rlmerge();
        cmd.args(["analyze", "--base"]).arg(&c.base);
        for a in &agents {
            cmd.arg("--model").arg(a);
        }
        assert_eq!(cmd.output().unwrap().status.code(), Some(2));
    }
}

#[test]
fn absurd_thread_counts_are_refused_at_once() {
    let c = case();
    good_model(&c.bad, 1.0);
    let t = std::time::Instant::now();
    for n in ["1000000", "10000"] {
        let (o, _) = merge_out(&c, &[&c.good, &c.bad], &["--device", "cpu", "--threads", n]);
        assert_eq!(o.status.code(), Some(2), "{}", err_of(&o));
        assert!(err_of(&o).contains("--threads"));
    }
    // Not a timing assertion: a hang would never get here (the harness would time out).
    let _ = t.elapsed();
}

/// A FIFO where a weight file or index should be: refused without reading it (a read blocks
/// until a writer comes, i.e. forever).
#[test]
fn fifos_are_refused_without_blocking() {
    for name in ["model.safetensors", "model.safetensors.index.json"] {
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

#[test]
fn control_characters_in_tensor_names_are_escaped() {
    let c = case();
    let forged = "x\nmerged 9 model(s) into /etc\u{1b}]0;pwned\u{7}";
    write_folder(
        &c.bad,
        &[
            tensor("a.weight", Dtype::BF16, &[4, 5], 1.0),
            tensor("b.weight", Dtype::BF16, &[7], 1.0),
            tensor(forged, Dtype::BF16, &[2], 1.0),
        ],
        1,
    );
    let (o, _) = merge_out(&c, &[&c.good, &c.bad], &[]);
    assert!(o.status.success(), "{}", err_of(&o));
    let err = err_of(&o);
    assert!(!err.contains('\u{1b}') && !err.contains('\u{7}'), "{err:?}");
    assert!(
        err.lines()
            .all(|l| l.starts_with("warning:") || l.starts_with("backend:")),
        "{err:?}"
    );
    assert!(err.contains("x\\nmerged 9"), "{err:?}");
    // An error naming the tensor: the same name with a bad shape in a second agent.
    let other = c.dir.path().join("other");
    write_folder(
        &other,
        &[
            tensor("a.weight", Dtype::BF16, &[4, 5], 1.0),
            tensor("b.weight", Dtype::BF16, &[7], 1.0),
        ],
        1,
    );
    std::fs::remove_dir_all(&c.base).unwrap();
    write_folder(
        &c.base,
        &[
            tensor("a.weight", Dtype::BF16, &[4, 5], 0.0),
            tensor(forged, Dtype::BF16, &[3], 0.0),
        ],
        1,
    );
    let out = c.dir.path().join("out2");
    let o = rlmerge()
        .args(["merge", "--quiet", "--force", "--base"])
        .arg(&c.base)
        .arg("--model")
        .arg(&c.bad)
        .arg("-o")
        .arg(&out)
        .output()
        .unwrap();
    let err = err_of(&o);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert_eq!(err.lines().count(), 1, "{err:?}");
    assert!(!err.contains('\u{1b}'), "{err:?}");
}

#[test]
fn index_shard_names_get_clear_messages() {
    let c = case();
    good_model(&c.bad, 1.0);
    std::fs::rename(
        c.bad.join("model.safetensors"),
        c.bad.join("shard.safetensors"),
    )
    .unwrap();
    let index = |map: &str| {
        std::fs::write(
            c.bad.join("model.safetensors.index.json"),
            format!(r#"{{"metadata": {{}}, "weight_map": {map}}}"#),
        )
        .unwrap()
    };
    index(r#"{"a.weight": "", "b.weight": "shard.safetensors"}"#);
    expect_failure(&c, &["shard name ''", "is empty"]);
    // `./x` is the same file as `x`, and accepted like `sub/x`.
    index(r#"{"a.weight": "./shard.safetensors", "b.weight": "./shard.safetensors"}"#);
    let (o, _) = merge_out(&c, &[&c.good, &c.bad], &[]);
    assert!(o.status.success(), "{}", err_of(&o));
}

#[test]
fn a_shape_of_a_thousand_dimensions_is_not_printed_in_full() {
    let shape = vec!["1"; 1000].join(",");
    let c = case();
    write_raw(
        &c.bad.join("model.safetensors"),
        &format!(r#"{{"a.weight":{{"dtype":"BF16","shape":[{shape}],"data_offsets":[0,4]}}}}"#),
        &[0; 4],
    );
    let e = expect_failure(&c, &["1000 dimensions"]);
    assert!(e.len() < 600, "{e}");
}

#[test]
fn recipes_with_a_bom_an_empty_model_or_merge_keys() {
    let c = case();
    good_model(&c.bad, 1.0);
    let recipe = c.dir.path().join("r.yml");
    let run = |text: String| {
        std::fs::write(&recipe, text).unwrap();
        let out = c.dir.path().join("rout");
        let _ = std::fs::remove_dir_all(&out);
        rlmerge()
            .args(["run", "--quiet"])
            .arg(&recipe)
            .arg("-o")
            .arg(&out)
            .output()
            .unwrap()
    };
    let body = format!(
        "merge_method: task_arithmetic\nbase_model: {}\nmodels:\n  - model: {}\n    parameters: {{weight: 1}}\n",
        c.base.display(),
        c.good.display()
    );
    let o = run(format!("\u{feff}{body}"));
    assert!(o.status.success(), "BOM: {}", err_of(&o));
    let o = run(format!("{body}  - model:\n    parameters: {{weight: 1}}\n"));
    assert_ne!(o.status.code(), Some(0));
    assert!(err_of(&o).contains("empty"), "{}", err_of(&o));
    let o = run(format!(
        "merge_method: task_arithmetic\nbase_model: {}\nw: &w {{weight: 1}}\nmodels:\n  - model: {}\n    parameters:\n      <<: *w\n",
        c.base.display(),
        c.good.display()
    ));
    assert_ne!(o.status.code(), Some(0));
    assert!(err_of(&o).contains("merge keys"), "{}", err_of(&o));
}

#[test]
fn too_many_agents_for_analyze_say_so_without_merged() {
    let c = case();
    let mut cmd = rlmerge();
    cmd.args(["analyze", "--base"]).arg(&c.base);
    for _ in 0..65 {
        cmd.arg("--model").arg(&c.good);
    }
    let o = cmd.output().unwrap();
    assert_eq!(o.status.code(), Some(2));
    assert!(!err_of(&o).contains("merged"), "{}", err_of(&o));
    assert!(err_of(&o).contains("at most 64"), "{}", err_of(&o));
}

/// Issue #12 item 11: one validation for flags, `--param` and recipes — out-of-range values,
/// duplicates and wrong types are usage errors (exit 2) naming the parameter and its range.
#[test]
fn parameters_are_validated_alike_on_the_command_line_and_in_recipes() {
    let c = case();
    good_model(&c.bad, 1.0);
    let cli: Vec<(Vec<&str>, &str)> = vec![
        (
            vec!["--method", "ties", "--param", "density=1.5"],
            "'density' must be in [0, 1]",
        ),
        (
            vec!["--method", "ties", "--param", "density=-0.5"],
            "'density' must be in [0, 1]",
        ),
        (
            vec![
                "--method",
                "breadcrumbs",
                "--param",
                "weight=1",
                "--param",
                "gamma=2",
            ],
            "'gamma'",
        ),
        (
            vec!["--method", "sce", "--param", "select_topk=1.5"],
            "'select_topk'",
        ),
        (
            vec![
                "--method",
                "della",
                "--param",
                "weight=1",
                "--param",
                "epsilon=-0.1",
            ],
            "'epsilon'",
        ),
        (
            vec!["--method", "ram+", "--r", "1e308"],
            "'r' must be in [0, 100]",
        ),
        (vec!["--method", "ram+", "--alpha=-1"], "'alpha'"),
        (
            vec![
                "--method",
                "ram+",
                "--rule",
                "official",
                "--rescale-factor=-1",
            ],
            "'rescale_factor' must be in [1, 100]",
        ),
        (
            vec!["--method", "ties", "--param", "normalize=maybe"],
            "true or false, got 'maybe'",
        ),
        (
            vec![
                "--method",
                "ties",
                "--param",
                "density=0.5",
                "--param",
                "density=0.6",
            ],
            "given twice",
        ),
        (
            vec!["--method", "ram+", "--r", "0.2", "--param", "r=0.3"],
            "give it once",
        ),
        (
            vec!["--method", "multislerp", "--param", "weight=0"],
            "sum to 0",
        ),
        (vec!["--shard-size", "99999999999999999999"], "16 EiB"),
        (vec!["--epsilon", "NaN"], "--epsilon"),
    ];
    for (args, needle) in cli {
        let (o, out) = merge_out(&c, &[&c.good, &c.bad], &args);
        assert_eq!(o.status.code(), Some(2), "{args:?}: {}", err_of(&o));
        assert!(err_of(&o).contains(needle), "{args:?}: {}", err_of(&o));
        assert!(!err_of(&o).contains("tensor"), "{args:?}: {}", err_of(&o));
        assert!(!out.exists());
    }
    let recipe = c.dir.path().join("r.yml");
    let recipes: Vec<(&str, &str)> = vec![
        (
            "merge_method: ram\nparameters: {epsilon: .nan}",
            "'epsilon' must be ≥ 0",
        ),
        (
            "merge_method: ram\nparameters: {epsilon: -1.0e-5}",
            "'epsilon' must be ≥ 0",
        ),
        (
            "merge_method: ram+\nparameters: {r: 1.0e308}",
            "'r' must be in [0, 100]",
        ),
        ("merge_method: ram+\nparameters: {alpha: -3}", "'alpha'"),
        (
            "merge_method: ties\nparameters: {density: [0.2, 1.7]}",
            "'density'",
        ),
    ];
    for (head, needle) in recipes {
        let text = format!(
            "{head}\nbase_model: {}\nmodels:\n  - model: {}\n    parameters: {{weight: 1}}\n  - model: {}\n    parameters: {{weight: 1}}\n",
            c.base.display(),
            c.good.display(),
            c.bad.display()
        );
        let text = if head.starts_with("merge_method: ram") {
            text.replace("    parameters: {weight: 1}\n", "")
        } else {
            text
        };
        std::fs::write(&recipe, text).unwrap();
        let out = c.dir.path().join("rout");
        let o = rlmerge()
            .args(["run", "--quiet"])
            .arg(&recipe)
            .arg("-o")
            .arg(&out)
            .output()
            .unwrap();
        assert_eq!(o.status.code(), Some(2), "{head}: {}", err_of(&o));
        assert!(err_of(&o).contains(needle), "{head}: {}", err_of(&o));
        assert!(!out.exists());
    }
    // Every numeric parameter shows its range in `rlmerge methods`.
    let methods = String::from_utf8(rlmerge().arg("methods").output().unwrap().stdout).unwrap();
    for line in methods.lines().filter(|l| l.starts_with("    ")) {
        assert!(
            ["[", "≥", "≤", "finite", "true/false", "/", "folder"]
                .iter()
                .any(|r| line.contains(r)),
            "no range: {line}"
        );
    }
}

/// Issue #12 item 12: a copy of an agent, or of the base, in another folder is merged, with a
/// warning on stderr and in the recipe.
#[test]
fn identical_content_in_other_folders_is_warned_about() {
    let c = case();
    good_model(&c.bad, 1.0);
    let copy = c.dir.path().join("copy");
    good_model(&copy, 0.5); // the same weights as `good`
    let base_copy = c.dir.path().join("base_copy");
    good_model(&base_copy, 0.0); // the same weights as the base
    let (o, out) = merge_out(&c, &[&c.good, &copy, &base_copy], &["--method", "ram"]);
    assert!(o.status.success(), "{}", err_of(&o));
    let err = err_of(&o);
    assert!(
        err.contains("hold the same weights") && err.contains("copy"),
        "{err}"
    );
    assert!(err.contains("same weights as the base"), "{err}");
    let recipe = std::fs::read_to_string(out.join("rlmerge_record.json")).unwrap();
    assert!(recipe.contains("hold the same weights"));
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
