//! mergekit's `slices` beyond the goldens (tests/mergekit_goldens.rs checks the merged values
//! against mergekit's): the output config's layer count and per-layer lists, the record that
//! `verify --against` reruns, every method family, the recipes a user can get wrong, and slices
//! that cut the decoder's layers only (a multimodal model's towers whole).

mod common;
use common::*;
use std::path::{Path, PathBuf};

/// The small Llama-shaped models of tests/fixtures/mergekit, copied under `dir` with per-layer
/// `layer_types` in their configs ("coder-0" … for layer 0 … of coder).
fn models(dir: &Path) -> PathBuf {
    let from = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/mergekit/models");
    for m in ["base", "coder", "tools", "memory"] {
        let to = dir.join(m);
        std::fs::create_dir_all(&to).unwrap();
        std::fs::copy(
            from.join(m).join("model.safetensors"),
            to.join("model.safetensors"),
        )
        .unwrap();
        let mut config: serde_json::Value = serde_json::from_str(
            &std::fs::read_to_string(from.join(m).join("config.json")).unwrap(),
        )
        .unwrap();
        let types: Vec<String> = (0..4).map(|l| format!("{m}-{l}")).collect();
        config["layer_types"] = types.into();
        std::fs::write(to.join("config.json"), config.to_string()).unwrap();
    }
    dir.to_path_buf()
}

fn run(dir: &Path, recipe: &str, out: &str) -> std::process::Output {
    std::fs::write(dir.join("recipe.yml"), recipe).unwrap();
    rlmerge()
        .current_dir(dir)
        .args(["run", "recipe.yml", "-q", "-o", out])
        .output()
        .unwrap()
}

const FRANKEN: &str = "slices:
  - sources:
    - model: coder
      layer_range: [0, 3]
  - sources:
    - model: memory
      layer_range: [1, 4]
merge_method: passthrough
";

#[test]
fn passthrough_slices_renumber_layers_and_config() {
    let d = tempfile::tempdir().unwrap();
    let dir = models(d.path());
    let o = run(&dir, FRANKEN, "out");
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let out = read_folder(&dir.join("out"));
    let coder = read_folder(&dir.join("coder"));
    let memory = read_folder(&dir.join("memory"));
    // Layers 0–2 are coder's 0–2, layers 3–5 memory's 1–3; embeddings from the first slice's
    // model, final norm and lm_head from the last one's.
    for (layer, (from, src)) in [
        (0, (&coder, 0)),
        (2, (&coder, 2)),
        (3, (&memory, 1)),
        (5, (&memory, 3)),
    ] {
        let name = |l: usize| format!("model.layers.{l}.mlp.up_proj.weight");
        assert_eq!(out[&name(layer)], from[&name(src)], "layer {layer}");
    }
    assert!(!out.contains_key("model.layers.6.mlp.up_proj.weight"));
    assert_eq!(
        out["model.embed_tokens.weight"],
        coder["model.embed_tokens.weight"]
    );
    assert_eq!(out["lm_head.weight"], memory["lm_head.weight"]);
    assert_eq!(out["model.norm.weight"], memory["model.norm.weight"]);
    assert_eq!(out.len(), 2 + 6 * 9 + 1);
    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("out/config.json")).unwrap())
            .unwrap();
    assert_eq!(config["num_hidden_layers"], 6);
    assert_eq!(
        config["layer_types"],
        serde_json::json!(["coder-0", "coder-1", "coder-2", "memory-1", "memory-2", "memory-3"])
    );
    // The record holds the slices: verify --against reruns the same merge.
    rlmerge()
        .args(["verify", "--against"])
        .arg(dir.join("out"))
        .assert()
        .success();
}

/// Every family merges per slice: RAM (the base in every slice), TIES with gradients per slice,
/// DELLA and linear; each slice's layers come from its own sources.
#[test]
fn every_family_merges_per_slice() {
    let d = tempfile::tempdir().unwrap();
    let dir = models(d.path());
    let sources = |a: &str, b: &str, params: &str| {
        format!(
            "slices:
  - sources:
    - model: base
      layer_range: [0, 2]
    - model: {a}
      layer_range: [0, 2]
{params}  - sources:
    - model: base
      layer_range: [1, 4]
    - model: {b}
      layer_range: [1, 4]
"
        )
    };
    for (i, (method, params)) in [
        ("ram", ""),
        (
            "ties",
            "    parameters:\n      density: [0.2, 0.8]\n      weight: 1\n",
        ),
        (
            "della",
            "    parameters:\n      density: 0.5\n      epsilon: 0.1\n      weight: 1\n",
        ),
        ("linear", "    parameters:\n      weight: 1\n"),
    ]
    .into_iter()
    .enumerate()
    {
        let mut recipe = sources("coder", "tools", params);
        recipe += &format!("merge_method: {method}\nbase_model: base\n");
        if method != "ram" && method != "linear" {
            // Slice 2's parameters from the method-wide ones.
            recipe += "parameters:\n  density: 0.5\n  weight: 1\n";
        }
        if method == "linear" {
            recipe = recipe.replace("base_model: base\n", "parameters:\n  weight: 1\n");
        }
        let out = format!("out{i}");
        let o = run(&dir, &recipe, &out);
        assert!(
            o.status.success(),
            "{method}: {}",
            String::from_utf8_lossy(&o.stderr)
        );
        let merged = read_folder(&dir.join(&out));
        assert!(
            merged.contains_key("model.layers.4.mlp.up_proj.weight"),
            "{method}"
        );
        assert!(
            !merged.contains_key("model.layers.5.mlp.up_proj.weight"),
            "{method}"
        );
        let config: serde_json::Value = serde_json::from_str(
            &std::fs::read_to_string(dir.join(&out).join("config.json")).unwrap(),
        )
        .unwrap();
        assert_eq!(config["num_hidden_layers"], 5, "{method}");
        // RAM: where only the base and coder take part (slice 1), tools' changes are absent.
        if method == "ram" {
            let base = read_folder(&dir.join("base"));
            let tools = read_folder(&dir.join("tools"));
            let coder = read_folder(&dir.join("coder"));
            let name = "model.layers.0.self_attn.q_proj.weight";
            assert_ne!(merged[name], tools[name]);
            let (b, c, m) = (
                from_bytes(base[name].0, &base[name].2),
                from_bytes(coder[name].0, &coder[name].2),
                from_bytes(merged[name].0, &merged[name].2),
            );
            // One agent: RAM keeps its changes (|τ| > ε) and the base elsewhere.
            for i in 0..b.len() {
                let want = if (c[i] - b[i]).abs() > 1e-5 {
                    c[i]
                } else {
                    b[i]
                };
                assert_eq!(m[i], want, "element {i}");
            }
        }
    }
}

/// Recipes a user can get wrong: each a usage error naming the slice, nothing written.
#[test]
fn bad_slices_are_refused_before_anything_is_written() {
    let d = tempfile::tempdir().unwrap();
    let dir = models(d.path());
    let cases = [
        (
            FRANKEN.replace("[1, 4]", "[1, 5]"),
            "layer_range [1, 5] of 'memory', which has 4 layers",
        ),
        (FRANKEN.replace("[1, 4]", "[3, 3]"), "layer_range [3, 3]"),
        (
            "slices:\n  - sources:\n    - model: base\n      layer_range: [0, 2]\n    - model: coder\n      layer_range: [0, 3]\nmerge_method: slerp\nbase_model: base\nparameters:\n  t: 0.5\n".into(),
            "every source must take as many layers",
        ),
        (
            "slices:\n  - sources:\n    - model: coder\n      layer_range: [0, 2]\n  - sources:\n    - model: base\n      layer_range: [0, 2]\n    - model: coder\n      layer_range: [2, 4]\nmerge_method: slerp\nbase_model: base\nparameters:\n  t: 0.5\n".into(),
            "slice 1 has no source from the base_model 'base'",
        ),
        (
            "slices:\n  - sources:\n    - model: coder\n      layer_range: [0, 2]\n    - model: coder\n      layer_range: [2, 4]\nmerge_method: linear\nparameters:\n  weight: 1\n".into(),
            "slice 1 lists model 'coder' twice",
        ),
        (
            "slices:\n  - sources:\n    - model: coder\n      layer_range: [0, 2]\n    - model: tools\n      layer_range: [0, 2]\nmerge_method: passthrough\n".into(),
            "slice 1: passthrough needs exactly one model",
        ),
        (
            "slices:\n  - sources:\n    - model: base\n      layer_range: [0, 2]\n    - model: coder\n      layer_range: [0, 2]\n    parameters:\n      epsilon: 0.001\nmerge_method: ram\nbase_model: base\n".into(),
            "not in a slice",
        ),
        (
            "slices:\n  - sources:\n    - model: base\n      layer_range: [0, 2]\n    - model: coder\n      layer_range: [0, 2]\n    parameters:\n      densty: 0.5\nmerge_method: ties\nbase_model: base\n".into(),
            "unknown parameter 'densty'",
        ),
        ("slices: []\nmerge_method: linear\n".into(), "'slices' is empty"),
    ];
    for (i, (recipe, want)) in cases.iter().enumerate() {
        let out = format!("bad{i}");
        let o = run(&dir, recipe, &out);
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(2), "case {i}: {err}");
        assert!(err.contains(want), "case {i}: {err}");
        assert!(!dir.join(&out).exists(), "case {i}");
    }
}

/// A multimodal-shaped model: a decoder of `layers` layers (`model.language_model.layers.N`),
/// a vision tower of 3 (`model.vision_tower.layers.N`), embeddings and lm_head; values `v`.
fn multimodal(dir: &Path, layers: usize, config_layers: usize, v: f32) -> PathBuf {
    let mut tensors = vec![t("model.language_model.embed_tokens.weight", &[8, 4], v)];
    for i in 0..3 {
        tensors.push(t(
            &format!("model.vision_tower.layers.{i}.attn.weight"),
            &[4, 4],
            v + i as f32,
        ));
    }
    for i in 0..layers {
        tensors.push(t(
            &format!("model.language_model.layers.{i}.mlp.weight"),
            &[4, 4],
            v + 10.0 * i as f32,
        ));
    }
    tensors.push(t("lm_head.weight", &[8, 4], v));
    let config = serde_json::json!({
        "model_type": "llava", "architectures": ["LlavaForConditionalGeneration"],
        "eos_token_id": [1, 2], "image_token_index": 5,
        "text_config": {"model_type": "llama", "num_hidden_layers": config_layers, "hidden_size": 4,
                        "layer_types": (0..config_layers).map(|i| format!("t{i}")).collect::<Vec<_>>()},
        "vision_config": {"num_hidden_layers": 3, "hidden_size": 4}
    });
    model_with(dir, &tensors, &config.to_string())
}

/// Slices cut the decoder's stack alone: a vision tower's layers stay whole (from the first
/// slice, with the embeddings), only per-layer config lists are rebuilt (not `eos_token_id` or
/// `architectures`, even when they are as long as the layer count), the count is set where the
/// config keeps it (`text_config`), and a config counting layers the files lack is refused.
#[test]
fn slices_cut_only_the_decoder_layers() {
    let d = tempfile::tempdir().unwrap();
    let a = multimodal(&d.path().join("a"), 2, 2, 0.0);
    let b = multimodal(&d.path().join("b"), 2, 2, 100.0);
    let recipe = d.path().join("r.yml");
    std::fs::write(
        &recipe,
        "slices:\n  - sources:\n    - model: a\n      layer_range: [0, 2]\n  - sources:\n    - model: b\n      layer_range: [1, 2]\nmerge_method: passthrough\n",
    )
    .unwrap();
    let run = |out: &str| {
        rlmerge()
            .current_dir(d.path())
            .arg("run")
            .arg(&recipe)
            .args(["-q", "-o", out])
            .output()
            .unwrap()
    };
    let o = run("out");
    assert!(o.status.success(), "{}", err_of(&o));
    let out = read_folder(&d.path().join("out"));
    let names: Vec<&str> = out.keys().map(String::as_str).collect();
    for i in 0..3 {
        assert!(
            names.contains(&format!("model.language_model.layers.{i}.mlp.weight").as_str()),
            "{names:?}"
        );
        assert!(
            names.contains(&format!("model.vision_tower.layers.{i}.attn.weight").as_str()),
            "{names:?}"
        );
    }
    assert_eq!(names.len(), 3 + 3 + 2, "{names:?}");
    // Output layer 2 is b's layer 1; the vision tower is a's.
    let b_layer1 = &read_folder(&b)["model.language_model.layers.1.mlp.weight"];
    assert_eq!(&out["model.language_model.layers.2.mlp.weight"], b_layer1);
    let a_vision = &read_folder(&a)["model.vision_tower.layers.2.attn.weight"];
    assert_eq!(&out["model.vision_tower.layers.2.attn.weight"], a_vision);
    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(d.path().join("out/config.json")).unwrap())
            .unwrap();
    assert_eq!(config["text_config"]["num_hidden_layers"], 3);
    assert_eq!(
        config["text_config"]["layer_types"],
        serde_json::json!(["t0", "t1", "t1"])
    );
    assert_eq!(config["vision_config"]["num_hidden_layers"], 3);
    assert_eq!(config["eos_token_id"], serde_json::json!([1, 2]));
    assert_eq!(
        config["architectures"],
        serde_json::json!(["LlavaForConditionalGeneration"])
    );
    // A config that claims 3 decoder layers where the files hold 2.
    multimodal(&d.path().join("a"), 2, 3, 0.0);
    std::fs::write(
        &recipe,
        "slices:\n  - sources:\n    - model: a\n      layer_range: [0, 1]\n  - sources:\n    - model: a\n      layer_range: [1, 3]\nmerge_method: passthrough\n",
    )
    .unwrap();
    let o = run("bad");
    assert_eq!(o.status.code(), Some(1), "{}", err_of(&o));
    assert!(
        err_of(&o).contains("counts 3 decoder layers"),
        "{}",
        err_of(&o)
    );
    assert!(!d.path().join("bad").exists());
}
