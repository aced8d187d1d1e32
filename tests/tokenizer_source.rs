//! `tokenizer_source: model:NAME` (and the `tokenizer:` section's `source`): the output takes that
//! model's tokenizer files when its vocabulary is the base's, token for token; other vocabularies,
//! `union` and per-token sources are refused, naming what differs, with nothing written.

mod common;
use common::*;
use std::path::{Path, PathBuf};

fn tokenizer_json(extra: &[(&str, u64)]) -> String {
    let mut added = vec![serde_json::json!({"id": 4, "content": "<|im_end|>", "special": true})];
    for (t, id) in extra {
        added.push(serde_json::json!({"id": id, "content": t, "special": true}));
    }
    serde_json::json!({
        "version": "1.0",
        "model": {"type": "BPE", "vocab": {"a": 0, "b": 1, "ab": 2, "<unk>": 3}, "merges": ["a b"]},
        "added_tokens": added,
    })
    .to_string()
}

/// base and coder (the fixture models) with tokenizers: coder's has its own chat template;
/// `tool` adds a token.
fn models(dir: &Path) -> PathBuf {
    let from = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/mergekit/models");
    for (m, src, template, extra) in [
        ("base", "base", "base template", &[][..]),
        ("coder", "coder", "coder template", &[]),
        ("tool", "tools", "tool template", &[("<tool_call>", 5)]),
    ] {
        let to = dir.join(m);
        std::fs::create_dir_all(&to).unwrap();
        for f in ["model.safetensors", "config.json"] {
            std::fs::copy(from.join(src).join(f), to.join(f)).unwrap();
        }
        std::fs::write(to.join("tokenizer.json"), tokenizer_json(extra)).unwrap();
        let config = serde_json::json!({"chat_template": template, "model_max_length": 128});
        std::fs::write(to.join("tokenizer_config.json"), config.to_string()).unwrap();
    }
    dir.to_path_buf()
}

fn run(dir: &Path, tail: &str, out: &str) -> std::process::Output {
    let recipe = format!(
        "merge_method: task_arithmetic\nbase_model: base\nmodels:\n  - model: coder\n    parameters: {{weight: 1}}\n{tail}"
    );
    std::fs::write(dir.join(format!("{out}.yml")), recipe).unwrap();
    rlmerge()
        .current_dir(dir)
        .args(["run", &format!("{out}.yml"), "-q", "-o", out])
        .output()
        .unwrap()
}

#[test]
fn the_output_takes_the_named_models_tokenizer() {
    let d = tempfile::tempdir().unwrap();
    let dir = models(d.path());
    let plain = run(&dir, "", "plain");
    assert!(
        plain.status.success(),
        "{}",
        String::from_utf8_lossy(&plain.stderr)
    );
    for (out, tail) in [
        ("model", "tokenizer_source: model:coder\n"),
        ("named", "tokenizer_source: coder\n"),
        ("section", "tokenizer:\n  source: model:coder\n"),
    ] {
        let o = run(&dir, tail, out);
        assert!(
            o.status.success(),
            "{out}: {}",
            String::from_utf8_lossy(&o.stderr)
        );
        let read = |p: PathBuf| std::fs::read_to_string(p).unwrap();
        assert_eq!(
            read(dir.join(out).join("tokenizer_config.json")),
            read(dir.join("coder/tokenizer_config.json")),
            "{out}"
        );
        // Weights and config as without it.
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
    assert_eq!(
        std::fs::read_to_string(dir.join("plain/tokenizer_config.json")).unwrap(),
        std::fs::read_to_string(dir.join("base/tokenizer_config.json")).unwrap()
    );
}

#[test]
fn other_vocabularies_and_unsupported_sources_are_refused() {
    let d = tempfile::tempdir().unwrap();
    let dir = models(d.path());
    for (i, (tail, want, code)) in [
        (
            "tokenizer_source: model:tool\n",
            "its vocabulary differs from the base's",
            1,
        ),
        (
            "tokenizer_source: union\n",
            "'union' is not supported yet (line 6)",
            2,
        ),
        (
            "tokenizer:\n  source: base\n  tokens:\n    <x>:\n      source: base\n",
            "tokenizer.tokens is not supported yet",
            2,
        ),
        (
            "tokenizer_source: base\ntokenizer:\n  source: base\n",
            "either tokenizer_source or a tokenizer section",
            2,
        ),
        (
            "tokenizer_source: model:nowhere\n",
            "model 'nowhere' is not a local folder",
            1,
        ),
        // A file, not a model folder.
        (
            "tokenizer_source: model:base/config.json\n",
            "is base/config.json, which is not a folder",
            1,
        ),
        (
            "tokenizer_source: 5\n",
            "tokenizer source must be base, union or model:NAME (line 6)",
            2,
        ),
    ]
    .into_iter()
    .enumerate()
    {
        let out = format!("bad{i}");
        let o = run(&dir, tail, &out);
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(code), "case {i}: {err}");
        assert!(err.contains(want), "case {i}: {err}");
        assert!(!dir.join(&out).exists(), "case {i}");
    }
}
