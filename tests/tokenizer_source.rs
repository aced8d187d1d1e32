//! Tokenizer sources (SPEC §5b): `model:NAME` with the base's vocabulary takes its files and
//! leaves the weights as they are; `union`, other vocabularies, `tokens` and padding re-index the
//! embedding and lm_head rows token by token, checked here row by row against the rules on the
//! fixture models (tools-tok and coder-tok added tokens and grew their embeddings); mistakes a
//! user can make are refused, naming what is wrong, with nothing written. (Equality with mergekit
//! itself: tests/mergekit_goldens.rs, recipes tokenizer_*.)

mod common;
use common::*;
use safetensors::tensor::Dtype;
use std::collections::HashMap;
use std::path::{Path, PathBuf};

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/mergekit/models")
}

/// The fixture models copied into `dir` (so recipes and outputs sit together); `coder` gets the
/// base's tokenizer with its own chat template.
fn models(dir: &Path) -> PathBuf {
    for m in ["base", "coder", "tools-tok", "coder-tok", "memory"] {
        let to = dir.join(m);
        std::fs::create_dir_all(&to).unwrap();
        for e in std::fs::read_dir(fixtures().join(m)).unwrap() {
            let e = e.unwrap();
            std::fs::copy(e.path(), to.join(e.file_name())).unwrap();
        }
    }
    std::fs::copy(
        fixtures().join("base/tokenizer.json"),
        dir.join("coder/tokenizer.json"),
    )
    .unwrap();
    let config = serde_json::json!({"chat_template": "coder template", "model_max_length": 128});
    std::fs::write(dir.join("coder/tokenizer_config.json"), config.to_string()).unwrap();
    dir.to_path_buf()
}

fn run_recipe(dir: &Path, recipe: &str, out: &str) -> std::process::Output {
    std::fs::write(dir.join(format!("{out}.yml")), recipe).unwrap();
    rlmerge()
        .current_dir(dir)
        .args([
            "run",
            &format!("{out}.yml"),
            "-q",
            "--device",
            "cpu",
            "-o",
            out,
        ])
        .output()
        .unwrap()
}

fn run(dir: &Path, tail: &str, out: &str) -> std::process::Output {
    let recipe = format!(
        "merge_method: task_arithmetic\nbase_model: base\nmodels:\n  - model: coder\n    parameters: {{weight: 1}}\n{tail}"
    );
    run_recipe(dir, &recipe, out)
}

/// `rlmerge ARGS`, run in `dir`.
fn cli(dir: &Path, args: &[&str]) -> std::process::Output {
    rlmerge().current_dir(dir).args(args).output().unwrap()
}

/// `rlmerge ARGS` in `dir` must fail with exit `code`, say `want`, and leave nothing at `out`.
fn refused(dir: &Path, args: &[&str], code: i32, want: &str, out: &str) {
    let o = cli(dir, args);
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(code), "{args:?}: {err}");
    assert!(err.contains(want), "{args:?}: {err}");
    assert!(!dir.join(out).exists(), "{args:?}");
}

fn ok(o: &std::process::Output, what: &str) {
    assert!(
        o.status.success(),
        "{what}: {}",
        String::from_utf8_lossy(&o.stderr)
    );
}

/// A model folder's tokenizer.json vocabulary by token.
fn vocab(dir: &Path) -> HashMap<String, usize> {
    tokenizer_vocab(&dir.join("tokenizer.json"))
}

/// Row `r` of a [rows, 16] bf16 tensor of a folder, as f32.
fn row(folder: &Path, tensor: &str, r: usize) -> Vec<f32> {
    let t = &read_folder(folder)[tensor];
    assert_eq!(t.0, Dtype::BF16);
    let h = t.1[1];
    from_bytes(t.0, &t.2[r * h * 2..(r + 1) * h * 2])
}

#[test]
fn the_output_takes_the_named_models_tokenizer() {
    let d = tempfile::tempdir().unwrap();
    let dir = models(d.path());
    ok(&run(&dir, "", "plain"), "plain");
    for (out, tail) in [
        ("model", "tokenizer_source: model:coder\n"),
        ("named", "tokenizer_source: coder\n"),
        ("section", "tokenizer:\n  source: model:coder\n"),
        ("from-base", "tokenizer_source: base\n"),
    ] {
        ok(&run(&dir, tail, out), out);
        let read = |p: PathBuf| std::fs::read_to_string(p).unwrap();
        let from = if out == "from-base" { "base" } else { "coder" };
        assert_eq!(
            read(dir.join(out).join("tokenizer_config.json")),
            read(dir.join(from).join("tokenizer_config.json")),
            "{out}"
        );
        // The same vocabulary: weights and config as without a tokenizer source.
        assert_eq!(
            read_folder(&dir.join(out)),
            read_folder(&dir.join("plain")),
            "{out}"
        );
        assert_eq!(
            read(dir.join(out).join("config.json")),
            read(dir.join("plain/config.json"))
        );
        rlmerge()
            .args(["verify", "--against"])
            .arg(dir.join(out))
            .assert()
            .success();
    }
}

/// Each row of the union merge `out` (task arithmetic of the recipe in
/// [`union_merges_the_embeddings_token_by_token`], vocabulary `v`) is θ₀ + Σ w·(θ − θ₀) over the
/// re-indexed rows: a model's own row where it has the token, else the donor's, else the mean of
/// the ones that have it.
fn assert_union_rows(dir: &Path, out: &Path, v: &HashMap<String, usize>) {
    let models = ["base", "tools-tok", "coder-tok", "memory"];
    let vocabs: Vec<HashMap<String, usize>> = models.iter().map(|m| vocab(&dir.join(m))).collect();
    let w = [0.5f32, 0.25, 1.0];
    for tensor in ["model.embed_tokens.weight", "lm_head.weight"] {
        let rows_of = |m: usize, t: &str| {
            vocabs[m]
                .get(t)
                .map(|&r| row(&dir.join(models[m]), tensor, r))
        };
        for (t, &i) in v {
            let own: Vec<Option<Vec<f32>>> = (0..4).map(|m| rows_of(m, t)).collect();
            let have: Vec<&Vec<f32>> = own.iter().flatten().collect();
            let default = match have.len() {
                1 => have[0].clone(),
                _ if own[0].is_some() => own[0].clone().unwrap(),
                _ => {
                    // f32 sum in order, one division.
                    let mut s = [0.0f32; 16];
                    for r in &have {
                        s.iter_mut().zip(r.iter()).for_each(|(a, b)| *a += b);
                    }
                    s.iter().map(|x| x / have.len() as f32).collect()
                }
            };
            let rows: Vec<Vec<f32>> = own
                .into_iter()
                .map(|o| o.unwrap_or(default.clone()))
                .collect();
            let want: Vec<f32> = (0..16)
                .map(|c| {
                    let b = rows[0][c];
                    let mut delta = 0.0f32;
                    for k in 0..3 {
                        delta += (rows[k + 1][c] - b) * w[k];
                    }
                    round_to(Dtype::BF16, b + delta)
                })
                .collect();
            assert_eq!(row(out, tensor, i), want, "{tensor} row {i} ({t:?})");
        }
    }
}

/// `union` over agents that added tokens, by the rules: every token in the output vocabulary at
/// the ids the union gives (base's first, then each model's new ones in order), config.json's
/// vocab_size, and each row of task arithmetic θ₀ + Σ w·(θ − θ₀) over the re-indexed rows — a
/// model's own row where it has the token (at its own id: coder-tok's ids of the base's special
/// tokens are one higher), else the donor's, else the mean of the two that have it.
#[test]
fn union_merges_the_embeddings_token_by_token() {
    let d = tempfile::tempdir().unwrap();
    let dir = models(d.path());
    let recipe = "merge_method: task_arithmetic\nbase_model: base\nmodels:\n  - model: tools-tok\n    parameters: {weight: 0.5}\n  - model: coder-tok\n    parameters: {weight: 0.25}\n  - model: memory\n    parameters: {weight: 1.0}\ntokenizer_source: union\n";
    ok(&run_recipe(&dir, recipe, "union"), "union");
    let out = dir.join("union");
    let v = vocab(&out);
    let base = vocab(&dir.join("base"));
    assert_eq!(v.len(), 52);
    for (t, &i) in &base {
        assert_eq!(v[t], i, "{t}");
    }
    // Regular tokens first (coder's "ab"), then the added ones by model: tools', then coder's.
    for (t, i) in [
        ("ab", 48),
        ("<tool_call>", 49),
        ("</tool_call>", 50),
        ("<think>", 51),
    ] {
        assert_eq!(v[t], i, "{t}");
    }
    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("config.json")).unwrap()).unwrap();
    assert_eq!(config["vocab_size"], 52);
    let card = std::fs::read_to_string(out.join("README.md")).unwrap();
    assert!(
        card.contains("Vocabulary: the union of every model's tokenizer"),
        "{card}"
    );
    let tc: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("tokenizer_config.json")).unwrap())
            .unwrap();
    assert_eq!(tc["added_tokens_decoder"]["51"]["content"], "<think>");
    assert_eq!(tc["added_tokens_decoder"]["48"]["special"], false);
    assert_union_rows(&dir, &out, &v);
    rlmerge()
        .args(["verify", "--against"])
        .arg(&out)
        .assert()
        .success();
    // The same merge from flags.
    let flags = dir.join("flags");
    let o = cli(
        &dir,
        &[
            "merge",
            "--base",
            "base",
            "--model",
            "tools-tok",
            "--model",
            "coder-tok",
            "--method",
            "linear",
            "--param",
            "weight=1",
            "--tokenizer-source",
            "union",
            "-q",
            "-o",
            "flags",
        ],
    );
    ok(&o, "flags");
    assert_eq!(vocab(&flags), v);
    // analyze reads the same re-indexed rows (and what the merge kept of each agent).
    let o = cli(
        &dir,
        &[
            "analyze",
            "--base",
            "base",
            "--model",
            "tools-tok",
            "--model",
            "coder-tok",
            "--tokenizer-source",
            "union",
            "--json",
            "-q",
            "--merged",
            "flags",
        ],
    );
    ok(&o, "analyze");
    let report: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(report["agents"].as_array().unwrap().len(), 2, "{report}");
}

/// What a user can get wrong with tokenizer settings: each exits ≠ 0 with a message naming the
/// problem, and writes nothing.
#[test]
fn bad_tokenizer_settings_are_refused() {
    let d = tempfile::tempdir().unwrap();
    let dir = models(d.path());
    let tok = |body: &str| format!("tokenizer:\n{body}");
    for (i, (tail, want, code)) in [
        (
            "tokenizer_source: base\ntokenizer:\n  source: base\n".to_string(),
            "either tokenizer_source or a tokenizer section",
            2,
        ),
        (
            "tokenizer_source: model:nowhere\n".into(),
            "model 'nowhere' is not a local folder",
            1,
        ),
        (
            "tokenizer_source: model:base/config.json\n".into(),
            "is base/config.json, which is not a folder",
            1,
        ),
        (
            "tokenizer_source: 5\n".into(),
            "tokenizer source must be base, union or model:NAME (line 6)",
            2,
        ),
        (
            tok("  source: union\n  pad_to_multiple_of: 0\n"),
            "pad_to_multiple_of (line 8) must be a whole number above 0",
            2,
        ),
        (
            tok("  source: union\n  pad_to_multiple_of: 1000000000\n"),
            "pad_to_multiple_of (line 8) must be a whole number above 0, at most 65536",
            2,
        ),
        (
            tok("  tokens:\n    \"\":\n      source: {kind: zero}\n"),
            "a token is empty text",
            2,
        ),
        (
            tok("  tokens:\n    \"<x>\":\n      source: {kind: model_token, model: coder, token_id: -1}\n"),
            "token_id must be a whole number",
            2,
        ),
        (
            tok("  source: union\n  pad_to: 8\n"),
            "tokenizer.pad_to (line 8) is not a tokenizer setting",
            2,
        ),
        (
            tok("  tokens:\n    \"<x>\":\n      source: {kind: one}\n"),
            "source's kind must be zero or model_token",
            2,
        ),
        (
            tok("  tokens:\n    \"<x>\":\n      source: {kind: model_token, model: coder}\n"),
            "model_token takes token or token_id, exactly one",
            2,
        ),
        (
            tok("  tokens:\n    \"<x>\":\n      force: yes please\n"),
            "force must be true or false",
            2,
        ),
        (
            tok("  tokens:\n    \"<x>\":\n      source: memory\n"),
            "names ",
            1,
        ),
        (
            tok("  tokens:\n    \"<x>\":\n      source: {kind: model_token, model: coder, token: \"<nope>\"}\n"),
            "token \"<nope>\" is not in",
            1,
        ),
        (
            tok("  tokens:\n    \"<x>\":\n      source: {kind: model_token, model: coder, token_id: 4096}\n"),
            "takes row 4096 of '",
            1,
        ),
        (
            tok("  tokens:\n    \"<x>\":\n      force: true\n"),
            "some merged models lack it; give it a source",
            1,
        ),
    ]
    .into_iter()
    .enumerate()
    {
        let out = format!("bad{i}");
        let o = run(&dir, &tail, &out);
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(code), "case {i}: {err}");
        assert!(err.contains(want), "case {i}: {err}");
        assert!(!dir.join(&out).exists(), "case {i}");
    }
}

/// Bad tokenizer sources on the command line and around the models: an agent that grew its
/// embeddings without one, a source at nothing or a file, the output at the source, a base
/// without tokenizer.json, a tokenizer that numbers past the rows — each named, nothing written.
#[test]
fn bad_tokenizer_sources_are_refused() {
    let d = tempfile::tempdir().unwrap();
    let dir = models(d.path());
    // An agent whose embeddings grew, without a tokenizer source: the shape error says what to set.
    let grown = [
        "merge",
        "--base",
        "base",
        "--model",
        "tools-tok",
        "-q",
        "-o",
        "grown",
    ];
    // Its config says so first: another vocab_size is another architecture unless re-indexed.
    refused(
        &dir,
        &grown,
        2,
        "config.json key 'vocab_size' is 50",
        "grown",
    );
    refused(&dir, &grown, 2, "set tokenizer_source", "grown");
    // --tokenizer-source at nothing, a file, a device, empty text; beside a recipe.
    for (source, want) in [
        ("nowhere", "'nowhere' does not exist"),
        ("base/config.json", "'base/config.json' is not a folder"),
        ("/dev/null", "'/dev/null' is not a folder"),
        ("", "'' is empty"),
    ] {
        let args = [
            "merge",
            "--base",
            "base",
            "--model",
            "tools-tok",
            "--tokenizer-source",
        ];
        refused(
            &dir,
            &[&args[..], &[source, "-q", "-o", "flag"]].concat(),
            2,
            want,
            "flag",
        );
    }
    refused(
        &dir,
        &[
            "merge",
            "--config",
            "x.yml",
            "--tokenizer-source",
            "union",
            "-o",
            "flag",
        ],
        2,
        "cannot be used with",
        "flag",
    );
}

/// The output at a tokenizer source is refused (even with --force, and the source stays); a base
/// without tokenizer.json, or a tokenizer that numbers past the model's rows, is named.
#[test]
fn tokenizer_sources_around_the_output_and_vocabularies_are_checked() {
    let d = tempfile::tempdir().unwrap();
    let dir = models(d.path());
    // The output at the tokenizer source (no agent): refused even with --force, and it stays.
    let before = std::fs::read(dir.join("coder/tokenizer_config.json")).unwrap();
    let args = [
        "merge",
        "--base",
        "base",
        "--model",
        "tools-tok",
        "--method",
        "linear",
    ];
    refused(
        &dir,
        &[
            &args[..],
            &[
                "--param",
                "weight=1",
                "--tokenizer-source",
                "coder",
                "--force",
                "-q",
                "-o",
                "coder",
            ],
        ]
        .concat(),
        2,
        "is the input folder coder",
        "coder/model.safetensors.index.json",
    );
    assert_eq!(
        std::fs::read(dir.join("coder/tokenizer_config.json")).unwrap(),
        before
    );
    // A base without tokenizer.json cannot give a vocabulary.
    std::fs::remove_file(dir.join("memory/tokenizer.json")).unwrap();
    let args = [
        "merge",
        "--base",
        "memory",
        "--model",
        "tools-tok",
        "--tokenizer-source",
    ];
    refused(
        &dir,
        &[&args[..], &["union", "-q", "-o", "nobase"]].concat(),
        1,
        "needs the base's tokenizer.json",
        "nobase",
    );
    // A tokenizer that numbers past the model's rows.
    let mut json: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(dir.join("coder-tok/tokenizer.json")).unwrap(),
    )
    .unwrap();
    json["added_tokens"][4]["id"] = 60.into();
    std::fs::write(dir.join("coder-tok/tokenizer.json"), json.to_string()).unwrap();
    let config = dir.join("coder-tok/config.json");
    let mut c: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&config).unwrap()).unwrap();
    c["vocab_size"] = 61.into();
    std::fs::write(&config, c.to_string()).unwrap();
    let args = [
        "merge",
        "--base",
        "base",
        "--model",
        "coder-tok",
        "--tokenizer-source",
    ];
    refused(
        &dir,
        &[&args[..], &["union", "-q", "-o", "past"]].concat(),
        1,
        "has 51 rows, but its tokenizer puts token",
        "past",
    );
}

/// Re-indexed rows on the GPU backend (lavapipe in CI): the same bytes as the CPU's for methods
/// with rank cuts, random masks, per-row statistics and RAM's probe.
#[test]
fn union_merges_alike_on_the_gpu() {
    let d = tempfile::tempdir().unwrap();
    let dir = models(d.path());
    for (i, method) in [
        &["ties", "--param", "weight=1", "--param", "density=0.5"][..],
        &[
            "della",
            "--param",
            "weight=1",
            "--param",
            "density=0.5",
            "--param",
            "epsilon=0.1",
        ],
        &["model_stock"],
        &["ram+"],
    ]
    .into_iter()
    .enumerate()
    {
        let run = |device: &str| {
            let out = format!("{device}{i}");
            let mut args = vec!["merge", "--base", "base", "--model", "tools-tok"];
            args.extend(["--model", "coder-tok", "--model", "memory", "--method"]);
            args.extend(method);
            args.extend([
                "--tokenizer-source",
                "union",
                "-q",
                "--device",
                device,
                "-o",
            ]);
            args.push(&out);
            (cli(&dir, &args), dir.join(&out))
        };
        let (cpu, cpu_out) = run("cpu");
        ok(&cpu, method[0]);
        let (gpu, gpu_out) = run("gpu");
        if !gpu.status.success() {
            // No adapter here (see tests/gpu_parity.rs): nothing to compare.
            assert!(String::from_utf8_lossy(&gpu.stderr).contains("adapter"));
            return;
        }
        assert_eq!(
            read_folder(&gpu_out),
            read_folder(&cpu_out),
            "{}",
            method[0]
        );
    }
}

/// DeepSeek-V3's MTP layer, stored after the decoder's layers (`num_nextn_predict_layers`): its
/// `shared_head.head` and `embed_tokens` are indexed by token and follow a union as the model's
/// own head and embeddings do, in a whole merge and in slices, where the layer comes whole from
/// the last slice's model, renumbered after the output's last layer (SPEC §3, stacks).
#[test]
fn mtp_layers_after_the_decoder_follow_the_vocabulary_and_the_slices() {
    let d = tempfile::tempdir().unwrap();
    let dir = models(d.path());
    for m in ["base", "tools-tok", "coder-tok"] {
        let folder = dir.join(m);
        let mut t = read_folder(&folder);
        for (mtp, of) in [
            ("shared_head.head", "lm_head"),
            ("embed_tokens", "model.embed_tokens"),
            ("enorm", "model.norm"),
        ] {
            let copy = t[&format!("{of}.weight")].clone();
            t.insert(format!("model.layers.4.{mtp}.weight"), copy);
        }
        write_file(&folder.join("model.safetensors"), &t);
        let path = folder.join("config.json");
        let mut config: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        config["num_nextn_predict_layers"] = 1.into();
        std::fs::write(&path, config.to_string()).unwrap();
    }
    let recipe = "merge_method: task_arithmetic\nbase_model: base\nmodels:\n  - model: tools-tok\n    parameters: {weight: 0.5}\n  - model: coder-tok\n    parameters: {weight: 0.25}\ntokenizer_source: union\n";
    ok(&run_recipe(&dir, recipe, "union"), "union");
    let out = read_folder(&dir.join("union"));
    let mtp = |out: &std::collections::BTreeMap<String, Read>, layer: usize, what: &str| {
        out[&format!("model.layers.{layer}.{what}.weight")].clone()
    };
    assert_eq!(mtp(&out, 4, "shared_head.head"), out["lm_head.weight"]);
    assert_eq!(
        mtp(&out, 4, "embed_tokens"),
        out["model.embed_tokens.weight"]
    );
    let recipe = "merge_method: passthrough\nslices:\n  - sources:\n    - model: tools-tok\n      layer_range: [0, 2]\n  - sources:\n    - model: coder-tok\n      layer_range: [1, 4]\ntokenizer_source: union\n";
    ok(&run_recipe(&dir, recipe, "sliced"), "sliced");
    let out = read_folder(&dir.join("sliced"));
    // Five decoder layers, then the MTP layer as layer 5, from coder-tok as its lm_head is.
    assert!(out.contains_key("model.layers.4.mlp.up_proj.weight"));
    assert!(!out.contains_key("model.layers.4.enorm.weight"));
    assert_eq!(mtp(&out, 5, "shared_head.head"), out["lm_head.weight"]);
    assert_eq!(mtp(&out, 5, "enorm"), out["model.norm.weight"]);
    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("sliced/config.json")).unwrap())
            .unwrap();
    assert_eq!(config["num_hidden_layers"], 5);
    assert_eq!(config["num_nextn_predict_layers"], 1);
}
