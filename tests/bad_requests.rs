//! Bad requests: what the user asks for is wrong even when every file is well formed — useless
//! merges, ambiguous or repeated folders, out-of-range parameters, FIFOs, absurd thread counts,
//! control characters in names. Each is refused with a clear error (exit 1, or 2 for usage) and
//! nothing at the output path.

mod common;
use common::bad_case::*;
use common::*;
use safetensors::tensor::Dtype;
use std::path::Path;

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
    for dir in [&c.base, &c.good, &c.bad] {
        std::fs::write(
            dir.join("config.json"),
            r#"{"model_type": "llava", "torch_dtype": "bfloat16", "dtype": "bfloat16",
                "text_config": {"dtype": "bfloat16"}}"#,
        )
        .unwrap();
    }
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

/// Which weights a folder's files mean, as transformers decides: safetensors before torch.save
/// files (a `pytorch_model.bin` beside `model.safetensors` is not read, whatever it holds); a
/// `pytorch_model.bin` with its own index is ambiguous as safetensors' pair is; a `.bin` that is
/// not torch's is named.
#[test]
fn safetensors_come_before_torch_files_and_each_pair_is_ambiguous() {
    let c = case();
    good_model(&c.bad, 1.0);
    std::fs::write(c.bad.join("pytorch_model.bin"), b"never read").unwrap();
    let (o, out) = merge_out(&c, &[&c.good, &c.bad], &[]);
    assert!(o.status.success(), "{}", err_of(&o));
    let record = std::fs::read_to_string(out.join("rlmerge_record.json")).unwrap();
    assert!(!record.contains("pytorch_model.bin") && !record.contains("\"format\""));
    std::fs::remove_dir_all(&out).unwrap();
    std::fs::remove_file(c.bad.join("model.safetensors")).unwrap();
    std::fs::write(c.bad.join("pytorch_model.bin.index.json"), "{}").unwrap();
    expect_failure(&c, &["pytorch_model.bin.index.json", "ambiguous"]);
    std::fs::remove_file(c.bad.join("pytorch_model.bin.index.json")).unwrap();
    expect_failure(&c, &["pytorch_model.bin", "not a torch checkpoint"]);
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
    // Refused by default (a tensor the base lacks), and named escaped in the refusal too.
    let (o, _) = merge_out(&c, &[&c.good, &c.bad], &[]);
    assert_eq!(o.status.code(), Some(2), "{}", err_of(&o));
    assert!(!err_of(&o).contains('\u{1b}') && err_of(&o).lines().count() == 1);
    let (o, _) = merge_out(&c, &[&c.good, &c.bad], &["--allow-missing-tensors"]);
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
        // Issue #42: ε is compared in f32, where 1e39 is +∞ (every element unchanged).
        (vec!["--epsilon", "1e39"], "infinite as an f32"),
    ];
    for (args, needle) in cli {
        let (o, out) = merge_out(&c, &[&c.good, &c.bad], &args);
        assert_eq!(o.status.code(), Some(2), "{args:?}: {}", err_of(&o));
        assert!(err_of(&o).contains(needle), "{args:?}: {}", err_of(&o));
        assert!(!err_of(&o).contains("tensor"), "{args:?}: {}", err_of(&o));
        assert!(!out.exists());
    }
}

/// Issue #12 item 11, recipes: the same validation as the flags' (in the type each parameter is
/// computed in), and every numeric parameter's range shown by `rlmerge methods`.
#[test]
fn recipe_parameters_are_validated_as_flags_are() {
    let c = case();
    good_model(&c.bad, 1.0);
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
        // Issue #42: a recipe's value is checked in the type it is computed in, as the flag's is.
        (
            "merge_method: ram\nparameters: {epsilon: 1.0e39}",
            "'epsilon' must be ≥ 0, got 1e39, which is infinite as an f32",
        ),
        (
            "merge_method: task_arithmetic\nparameters: {lambda: -1.0e39}",
            "infinite as an f32",
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
    // Every parameter shows its range on its method's page, `rlmerge methods NAME`.
    let listed = rlmerge()
        .args(["methods", "--json"])
        .output()
        .unwrap()
        .stdout;
    let listed: serde_json::Value = serde_json::from_slice(&listed).unwrap();
    for m in listed.as_array().unwrap() {
        let name = m["name"].as_str().unwrap();
        let page = rlmerge().args(["methods", name]).output().unwrap().stdout;
        let page = String::from_utf8(page).unwrap();
        // A parameter's head line: two spaces, its name, its scope.
        let heads = page.lines().filter(|l| {
            l.starts_with("  ") && !l.starts_with("   ") && l.contains("method-wide")
                || l.contains("per model")
        });
        for line in heads {
            assert!(
                ["[", "≥", "≤", "finite", "true/false", "/", "folder"]
                    .iter()
                    .any(|r| line.contains(r)),
                "{name}: no range: {line}"
            );
        }
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

/// `analyze --merged` and `--plot` pointed at the wrong thing: a missing folder or a file for
/// --merged is refused before anything is read (exit 1); figures are never written into an input
/// or the merged folder (exit 2, nothing written there), nor over a file; beside the models (a
/// folder that contains them) they are fine. The base itself as "merged" keeps nothing: r = 0.
#[test]
fn analyze_merged_and_plot_paths_are_checked() {
    let c = case();
    let analyze = |extra: &[&std::ffi::OsStr]| {
        let mut cmd = rlmerge();
        cmd.args(["analyze", "-q", "--json", "--base"])
            .arg(&c.base)
            .arg("--model")
            .arg(&c.good)
            .args(extra);
        cmd.output().unwrap()
    };
    let os = |p: &Path| p.as_os_str().to_owned();
    let missing = c.dir.path().join("nowhere");
    let file = c.dir.path().join("notes.txt");
    std::fs::write(&file, "keep me").unwrap();
    for merged in [&missing, &file] {
        let o = analyze(&["--merged".as_ref(), &os(merged)]);
        // A missing folder is a usage error (issue #45); a file where a folder belongs, bad input.
        let code = if merged == &missing { 2 } else { 1 };
        assert_eq!(o.status.code(), Some(code), "{}", err_of(&o));
        assert!(
            err_of(&o).contains("cannot open the merged folder"),
            "{}",
            err_of(&o)
        );
    }
    let merged = c.dir.path().join("merged");
    good_model(&merged, 0.25);
    for into in [&c.base, &c.good, &merged, &c.base.join("figs")] {
        let o = analyze(&[
            "--merged".as_ref(),
            &os(&merged),
            "--plot".as_ref(),
            &os(into),
        ]);
        assert_eq!(o.status.code(), Some(2), "{into:?}: {}", err_of(&o));
        assert!(!into.join("overlap.svg").exists(), "{into:?}");
    }
    let o = analyze(&["--plot".as_ref(), &os(&file)]);
    assert_eq!(o.status.code(), Some(2), "{}", err_of(&o));
    assert_eq!(std::fs::read_to_string(&file).unwrap(), "keep me");
    let o = analyze(&["--plot".as_ref(), &os(c.dir.path())]);
    assert!(o.status.success(), "{}", err_of(&o));
    assert!(c.dir.path().join("overlap.svg").is_file());
    // An input given as the merged folder is a mistake: named, exit 2.
    for input in [&c.base, &c.good] {
        let o = analyze(&["--merged".as_ref(), &os(input)]);
        assert_eq!(o.status.code(), Some(2), "{}", err_of(&o));
        assert!(
            err_of(&o).contains("is an input of this analysis"),
            "{}",
            err_of(&o)
        );
    }
    // A copy of the base, merged as nothing: it retains nothing.
    let copy = c.dir.path().join("base-copy");
    std::fs::create_dir(&copy).unwrap();
    for f in ["model.safetensors", "config.json"] {
        std::fs::copy(c.base.join(f), copy.join(f)).unwrap();
    }
    let o = analyze(&["--merged".as_ref(), &os(&copy)]);
    assert!(o.status.success(), "{}", err_of(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["retention"]["agents"][0]["all"]["retention"], 0.0);
}

/// Unknown RAM+ scopes and shared rules are usage errors, from flags and from --param alike.
#[test]
fn unknown_scopes_and_shared_rules_are_usage_errors() {
    let c = case();
    for args in [
        vec!["--method", "ram+", "--scope", "row"],
        vec!["--method", "ram+", "--param", "scope=row"],
        vec!["--method", "ram", "--param", "shared=median"],
        vec![
            "--method",
            "ram+",
            "--scope",
            "layer",
            "--param",
            "scope=module",
        ],
    ] {
        let (o, out) = merge_out(&c, &[&c.good], &args);
        assert_eq!(o.status.code(), Some(2), "{args:?}: {}", err_of(&o));
        assert!(!out.exists());
    }
}

/// `-o` in folders that do not exist yet creates them, as mergekit does (the atomic rename still
/// happens inside the final parent); a parent that is a file is an error naming it, nothing made.
#[test]
fn missing_output_parents_are_created_and_a_file_parent_is_refused() {
    let f = fixture(71, Dtype::BF16, &odd_shapes(), &DENSITIES[..2], 1);
    let out = f.dir.path().join("runs").join("2026-12-03").join("merged");
    merge_cmd(&f, &out, &["--method", "ram"]).assert().success();
    rlmerge().arg("verify").arg(&out).assert().success();
    let entries: Vec<_> = std::fs::read_dir(out.parent().unwrap())
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(
        entries,
        vec![std::ffi::OsString::from("merged")],
        "no scratch left"
    );
    let file = f.dir.path().join("a-file");
    std::fs::write(&file, "x").unwrap();
    let o = merge_cmd(&f, &file.join("sub").join("merged"), &["--method", "ram"])
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(1), "{}", err_of(&o));
    assert!(err_of(&o).contains("a-file"), "{}", err_of(&o));
    assert_eq!(std::fs::read(&file).unwrap(), b"x");
}
