//! Trust, round two (issue #24): agents of another architecture, multimodal stacks under slices,
//! and the smaller mistakes — each refused up front, naming the key, the layer or the fix.

mod common;
use common::*;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// Agents of another architecture are refused up front (exit 2) with the config key that
/// differs; without a config, a shape that differs says "different architecture" and names the
/// base's key of that size.
#[test]
fn agents_of_another_architecture_are_refused() {
    let d = tempfile::tempdir().unwrap();
    let config = |model_type: &str, layers: usize, inter: usize| {
        format!(
            r#"{{"model_type": "{model_type}", "num_hidden_layers": {layers}, "hidden_size": 4, "intermediate_size": {inter}}}"#
        )
    };
    let layer = |i: usize, inter: usize, v: f32| {
        vec![
            t(
                &format!("model.layers.{i}.mlp.up_proj.weight"),
                &[inter, 4],
                v,
            ),
            t(&format!("model.layers.{i}.input_layernorm.weight"), &[4], v),
        ]
    };
    let base_tensors: Vec<T> = (0..2).flat_map(|i| layer(i, 8, 0.0)).collect();
    let base = model_with(
        &d.path().join("base"),
        &base_tensors,
        &config("llama", 2, 8),
    );
    let good_tensors: Vec<T> = (0..2).flat_map(|i| layer(i, 8, 0.5)).collect();
    let good = model_with(
        &d.path().join("good"),
        &good_tensors,
        &config("llama", 2, 8),
    );
    let qwen = model_with(
        &d.path().join("qwen"),
        &good_tensors,
        &config("qwen2", 2, 8),
    );
    let deeper_tensors: Vec<T> = (0..3).flat_map(|i| layer(i, 8, 0.5)).collect();
    let deeper = model_with(
        &d.path().join("deeper"),
        &deeper_tensors,
        &config("llama", 3, 8),
    );
    let wider_tensors: Vec<T> = (0..2).flat_map(|i| layer(i, 16, 0.5)).collect();
    let wider = d.path().join("wider");
    write_folder(&wider, &wider_tensors, 1);
    std::fs::remove_file(wider.join("config.json")).unwrap();
    let run = |agent: &Path, extra: &[&str]| {
        let out = d.path().join("out");
        let o = rlmerge()
            .arg("merge")
            .arg("--base")
            .arg(&base)
            .arg("--model")
            .arg(&good)
            .arg("--model")
            .arg(agent)
            .args(["-q", "--method", "ram", "-o"])
            .arg(&out)
            .args(extra)
            .output()
            .unwrap();
        assert!(!out.exists() || o.status.success());
        let _ = std::fs::remove_dir_all(&out);
        o
    };
    let o = run(&qwen, &[]);
    assert_eq!(o.status.code(), Some(2), "{}", err_of(&o));
    assert!(err_of(&o).contains("different architecture") && err_of(&o).contains("'model_type'"));
    let o = run(&deeper, &[]);
    assert_eq!(o.status.code(), Some(2), "{}", err_of(&o));
    assert!(
        err_of(&o).contains("'num_hidden_layers' is 3"),
        "{}",
        err_of(&o)
    );
    // --allow-missing-tensors lets tensors through, never another architecture.
    let o = run(&deeper, &["--allow-missing-tensors"]);
    assert_eq!(o.status.code(), Some(2), "{}", err_of(&o));
    let o = run(&wider, &[]);
    assert_eq!(o.status.code(), Some(1), "{}", err_of(&o));
    assert!(
        err_of(&o).contains("different architecture")
            && err_of(&o).contains("'intermediate_size' is 8"),
        "{}",
        err_of(&o)
    );
    // Analyze applies the same rule.
    let o = rlmerge()
        .arg("analyze")
        .arg("--base")
        .arg(&base)
        .arg("--model")
        .arg(&qwen)
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(2), "{}", err_of(&o));
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
    // An adapter saved as a PyTorch pickle only.
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
        &["adapter_model.bin", "pickle", "safetensors"],
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
