//! Bad input: a one-line error naming the file and tensor, exit code ≠ 0, and no output folder;
//! the smaller mistakes say what is wrong and the fix.

mod common;
use common::bad_case::*;
use common::*;
use safetensors::tensor::Dtype;
use std::path::Path;
use std::time::Duration;

/// A missing folder is a usage error (issue #45: exit 2, the call was wrong), naming it and,
/// for a typo, the folder meant.
#[test]
fn missing_folder() {
    let c = case();
    let (o, out) = merge_out(&c, &[&c.good, &c.bad], &[]);
    assert_eq!(o.status.code(), Some(2), "{}", err_of(&o));
    let err = err_of(&o);
    assert!(
        err.contains(&c.bad.display().to_string()) && err.contains("does not exist"),
        "{err}"
    );
    assert!(!out.exists());
    let typo = c.good.with_file_name("god");
    let (o, _) = merge_out(&c, &[&c.good, &typo], &[]);
    assert_eq!(o.status.code(), Some(2));
    assert!(
        err_of(&o).contains(&format!("did you mean '{}'", c.good.display())),
        "{}",
        err_of(&o)
    );
}

/// A folder of no weights says which files it looked for; a `pytorch_model.bin` that is not a
/// torch zip file is named as such.
#[test]
fn folder_without_weights_or_with_a_bin_that_is_not_torchs() {
    let c = case();
    std::fs::create_dir_all(&c.bad).unwrap();
    expect_failure(
        &c,
        &[
            &c.bad.display().to_string(),
            "model.safetensors",
            "pytorch_model.bin",
        ],
    );
    std::fs::write(c.bad.join("pytorch_model.bin"), b"not ours").unwrap();
    expect_failure(&c, &["pytorch_model.bin", "not a torch checkpoint"]);
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

/// An agent saved in another dtype than the base (an f32 RL actor beside a bf16 base) is no
/// longer refused: it merges in f32 (tests/mixed_dtypes.rs checks the bytes), and the output keeps
/// the base's dtype. A different shape still is refused.
#[test]
fn dtype_differs_from_base_merges_and_shape_differs_is_refused() {
    let c = case();
    write_folder(
        &c.bad,
        &[
            tensor("a.weight", Dtype::BF16, &[4, 5], 1.0),
            tensor("b.weight", Dtype::F32, &[7], 1.0),
        ],
        1,
    );
    let (o, out) = merge_out(&c, &[&c.good, &c.bad], &[]);
    assert!(o.status.success(), "{}", err_of(&o));
    let merged = read_folder(&out);
    assert_eq!(merged["b.weight"].0, Dtype::BF16);
    std::fs::remove_dir_all(&out).unwrap();
    write_folder(
        &c.bad,
        &[
            tensor("a.weight", Dtype::BF16, &[4, 5], 1.0),
            tensor("b.weight", Dtype::F32, &[8], 1.0),
        ],
        1,
    );
    expect_failure(
        &c,
        &[&bad_path(&c, "model.safetensors"), "b.weight", "[8]", "[7]"],
    );
}

#[test]
fn tensor_missing_in_an_agent_is_refused_or_merged_from_the_others_with_allow_missing_tensors() {
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
    // Refused unless the user opts in: an agent of the base's architecture has all its tensors.
    let refused = cmd.output().unwrap();
    assert_eq!(refused.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert!(
        stderr.contains("'b.weight'") && stderr.contains("--allow-missing-tensors"),
        "{stderr}"
    );
    assert!(!out.exists());
    cmd.arg("--allow-missing-tensors");
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
        // The shared-region rule belongs to the RAM family, takes two words, once.
        vec![
            "--method",
            "ties",
            "--param",
            "weight=1",
            "--shared",
            "consensus",
        ],
        vec!["--method", "ram", "--shared", "median"],
        vec![
            "--method",
            "ram",
            "--shared",
            "consensus",
            "--param",
            "shared=mean",
        ],
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

/// `o` failed with exit `code`, one error line holding each of `wants`, nothing at `out`.
fn refused(o: std::process::Output, code: i32, wants: &[&str], out: &Path) {
    let err = err_of(&o);
    assert_eq!(o.status.code(), Some(code), "{wants:?}: {err}");
    for w in wants {
        assert!(err.contains(w), "want {w:?} in: {err}");
    }
    // One error line; warnings about the inputs (a dense agent) may come before it.
    let lines = err.lines().filter(|l| !l.starts_with("warning: ")).count();
    assert!(lines == 1, "{err}");
    assert!(!out.exists());
}

/// The smaller mistakes of issue #24 each get an error that names the problem and the fix, at
/// once, with nothing written.
#[test]
fn smaller_mistakes_say_what_is_wrong_and_the_fix() {
    let d = tempfile::tempdir().unwrap();
    let memory = models().join("memory");
    // A tokenizer file that is a FIFO: refused before the merge, never opened.
    let base = d.path().join("base");
    std::fs::create_dir(&base).unwrap();
    for f in ["config.json", "model.safetensors"] {
        std::fs::copy(models().join("base").join(f), base.join(f)).unwrap();
    }
    assert!(std::process::Command::new("mkfifo")
        .arg(base.join("tokenizer.json"))
        .status()
        .unwrap()
        .success());
    let out = d.path().join("o1");
    let o = rlmerge()
        .arg("merge")
        .arg("--base")
        .arg(&base)
        .arg("--model")
        .arg(&memory)
        .args(["-q", "--method", "ram", "-o"])
        .arg(&out)
        .timeout(Duration::from_secs(60))
        .output()
        .unwrap();
    refused(o, 1, &["tokenizer.json", "not a regular file"], &out);
    // An adapter saved by torch.save only, whose file is not one.
    let bin = d.path().join("bin-adapter");
    std::fs::create_dir(&bin).unwrap();
    std::fs::copy(
        models().join("coder-lora/adapter_config.json"),
        bin.join("adapter_config.json"),
    )
    .unwrap();
    std::fs::write(bin.join("adapter_model.bin"), b"not read").unwrap();
    let out = d.path().join("o2");
    refused(
        merge_with(&[&bin], &out, &["--method", "ram"]),
        1,
        &["adapter_model.bin", "not a torch checkpoint"],
        &out,
    );
    // An adapter given as the base.
    let out = d.path().join("o3");
    let o = rlmerge()
        .arg("merge")
        .arg("--base")
        .arg(models().join("coder-lora"))
        .arg("--model")
        .arg(&memory)
        .args(["-q", "--method", "ram", "-o"])
        .arg(&out)
        .output()
        .unwrap();
    refused(
        o,
        1,
        &["is a LoRA adapter, not a full model", "--model"],
        &out,
    );
}

/// The smaller mistakes of issue #24 in parameters and configs: a missing parameter, a huge value,
/// a config's vocab_size that is not its embeddings' rows — each named with its fix, at once.
#[test]
fn smaller_mistakes_of_parameters_and_configs_name_the_fix() {
    let d = tempfile::tempdir().unwrap();
    let memory = models().join("memory");
    // A method without a parameter it needs: before any tensor is read, exit 2, with the fix.
    let out = d.path().join("o4");
    refused(
        merge_with(&[&memory], &out, &["--method", "ties"]),
        2,
        &["needs parameter 'weight'", "--param weight="],
        &out,
    );
    // A huge value is shown short.
    let out = d.path().join("o5");
    let o = merge_with(
        &[&memory],
        &out,
        &[
            "--method",
            "ties",
            "--param",
            "weight=1",
            "--param",
            "density=1e300",
        ],
    );
    assert!(
        err_of(&o).contains("got 1e300") && err_of(&o).len() < 200,
        "{}",
        err_of(&o)
    );
    refused(o, 2, &["density"], &out);
    // A tokenizer source where the base's config vocab_size is not its embedding rows.
    let vbase = d.path().join("vbase");
    std::fs::create_dir(&vbase).unwrap();
    for f in [
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ] {
        std::fs::copy(models().join("base").join(f), vbase.join(f)).unwrap();
    }
    let mut c: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(models().join("base/config.json")).unwrap())
            .unwrap();
    c["vocab_size"] = 64.into();
    std::fs::write(vbase.join("config.json"), c.to_string()).unwrap();
    let out = d.path().join("o6");
    let o = rlmerge()
        .arg("merge")
        .arg("--base")
        .arg(&vbase)
        .arg("--model")
        .arg(models().join("tools-tok"))
        .args([
            "-q",
            "--method",
            "task_arithmetic",
            "--param",
            "weight=1",
            "--tokenizer-source",
            "union",
            "-o",
        ])
        .arg(&out)
        .output()
        .unwrap();
    refused(o, 1, &["config.json vocab_size", "says 64"], &out);
}
