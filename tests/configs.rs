//! What the agents' configs say against the base's. Architecture: an agent of another one is
//! refused naming the key, a number written as a float is the same number. Meaning (issue #50
//! items 1, 2 and 7): a key one side leaves out or sets to null is compared by what it means — an agent that adds YaRN to a base
//! that says nothing of rope scaling is refused until the user says whose config the output
//! takes, either way round, and beside another difference; a Hub config and the same config as
//! transformers 5 saves it are one meaning; a frankenmerge of a model whose layers' attention is
//! derived from their index writes each layer's attention; an agent without config.json, an
//! ambiguous `--config-from`, one name in two Unicode spellings and a bad progress interval are
//! said, not passed silently.

mod common;
use common::*;
use safetensors::tensor::Dtype;
use serde_json::{json, Value};
use std::path::Path;

fn models() -> Fixture {
    fixture(
        51,
        Dtype::BF16,
        &[
            ("model.layers.0.self_attn.q_proj.weight", vec![8, 8]),
            ("model.layers.1.self_attn.q_proj.weight", vec![8, 8]),
            ("model.layers.2.self_attn.q_proj.weight", vec![8, 8]),
            ("model.norm.weight", vec![8]),
        ],
        &[0.1, 0.2],
        1,
    )
}

fn write_config(dir: &Path, config: &Value) {
    std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
}

/// Qwen2.5-7B's config as published: no rope_scaling key at all.
fn hub_qwen() -> Value {
    json!({"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 8,
        "num_hidden_layers": 3, "max_position_embeddings": 32768, "rope_theta": 1000000.0,
        "sliding_window": 131072, "use_sliding_window": false, "max_window_layers": 28,
        "rms_norm_eps": 1e-6, "tie_word_embeddings": false, "torch_dtype": "bfloat16"})
}

fn with(config: &Value, key: &str, value: Value) -> Value {
    let mut c = config.clone();
    c[key] = value;
    c
}

fn yarn() -> Value {
    json!({"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768})
}

#[test]
fn an_agents_meaning_is_not_dropped_when_the_base_is_silent() {
    let f = models();
    let out = f.dir.path().join("out");
    let merge = |base: &Value, agent: &Value, extra: &[&str]| {
        write_config(&f.base, base);
        write_config(&f.agents[0], agent);
        write_config(&f.agents[1], base);
        let _ = std::fs::remove_dir_all(&out);
        merge_cmd(&f, &out, extra).output().unwrap()
    };
    let hub = hub_qwen();
    let null = with(&hub, "rope_scaling", Value::Null);
    let yarn_agent = with(&hub, "rope_scaling", yarn());
    // Absent or null on the base's side, YaRN on the agent's; and the other way round.
    for (base, agent) in [
        (&hub, &yarn_agent),
        (&null, &yarn_agent),
        (&yarn_agent, &hub),
        (&yarn_agent, &null),
    ] {
        let o = merge(base, agent, &[]);
        assert_eq!(o.status.code(), Some(2), "{}", err_of(&o));
        let err = err_of(&o);
        assert!(
            err.contains("rope_scaling") && err.contains("yarn"),
            "{err}"
        );
        assert!(err.contains("--config-from"), "{err}");
        assert!(!out.exists());
    }
    // Beside another difference, both are named.
    let both = with(&yarn_agent, "rms_norm_eps", json!(1e-5));
    let err = err_of(&merge(&hub, &both, &[]));
    assert!(
        err.contains("rms_norm_eps") && err.contains("rope_scaling"),
        "{err}"
    );
    // Absent and null say the same; the agent's YaRN is kept when chosen.
    assert!(merge(&hub, &null, &[]).status.success());
    let agent = f.agents[0].display().to_string();
    let o = merge(&hub, &yarn_agent, &["--config-from", &agent]);
    assert!(o.status.success(), "{}", err_of(&o));
    let merged: Value =
        serde_json::from_slice(&std::fs::read(out.join("config.json")).unwrap()).unwrap();
    assert_eq!(merged["rope_scaling"]["type"], "yarn");
    // transformers 5's spelling of the same YaRN (rope_parameters) is the same choice to make.
    let saved = with(
        &with(
            &hub,
            "rope_parameters",
            json!({"rope_type": "yarn", "type": "yarn", "factor": 4.0,
            "original_max_position_embeddings": 32768, "rope_theta": 1000000.0}),
        ),
        "rope_theta",
        Value::Null,
    );
    let err = err_of(&merge(&hub, &saved, &[]));
    assert!(
        err.contains("rope_parameters") && err.contains("yarn"),
        "{err}"
    );
}

/// The published config and the same config saved by transformers 5.25 (its `save_pretrained`
/// writes rope_parameters, a null window, every layer's type and its defaults) mean the same:
/// an agent saved by a trainer merges into a Hub base without a word.
#[test]
fn a_config_saved_by_transformers_is_the_hub_config() {
    let f = models();
    let hub = hub_qwen();
    let saved = json!({"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2",
        "hidden_size": 8, "num_hidden_layers": 3, "attention_dropout": 0.0, "bos_token_id": null,
        "dtype": "bfloat16", "hidden_act": "silu", "max_position_embeddings": 32768,
        "layer_types": ["full_attention", "full_attention", "full_attention"],
        "max_window_layers": 28, "rms_norm_eps": 1e-06, "sliding_window": null,
        "rope_parameters": {"rope_theta": 1000000.0, "rope_type": "default"},
        "tie_word_embeddings": false, "transformers_version": "5.25.0", "use_cache": true,
        "use_sliding_window": false});
    write_config(&f.base, &hub);
    write_config(&f.agents[0], &saved);
    write_config(&f.agents[1], &saved);
    let out = f.dir.path().join("out");
    let o = merge_cmd(&f, &out, &[]).output().unwrap();
    assert!(o.status.success(), "{}", err_of(&o));
    assert!(
        !err_of(&o).contains("config.json differs"),
        "{}",
        err_of(&o)
    );
}

/// A frankenmerge of a Gemma-3 model whose config derives each layer's attention from its
/// index (`sliding_window_pattern`, no `layer_types`): the output lists each layer's own.
#[test]
fn a_frankenmerge_writes_the_attention_each_layer_had() {
    let f = models();
    let gemma = json!({"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text",
        "hidden_size": 8, "num_hidden_layers": 3, "sliding_window": 4, "sliding_window_pattern": 3,
        "torch_dtype": "bfloat16"});
    for dir in std::iter::once(&f.base).chain(&f.agents) {
        write_config(dir, &gemma);
    }
    let root = f.dir.path();
    std::fs::write(
        root.join("franken.yml"),
        "merge_method: passthrough\nslices:\n  - sources:\n      - model: agent0\n        \
         layer_range: [1, 3]\n  - sources:\n      - model: agent1\n        layer_range: [0, 1]\n",
    )
    .unwrap();
    let o = rlmerge()
        .current_dir(root)
        .args(["run", "franken.yml", "-q", "-o", "out"])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", err_of(&o));
    let merged: Value =
        serde_json::from_slice(&std::fs::read(root.join("out/config.json")).unwrap()).unwrap();
    // Source layers 1, 2 of agent 0 (sliding, full: every third is full) and layer 0 (sliding).
    assert_eq!(
        merged["layer_types"],
        json!(["sliding_attention", "full_attention", "sliding_attention"])
    );
    // A model type whose index rule rlmerge does not know is refused where layers move.
    let exaone = with(&gemma, "model_type", json!("exaone4"));
    for dir in std::iter::once(&f.base).chain(&f.agents) {
        write_config(dir, &exaone);
    }
    let o = rlmerge()
        .current_dir(root)
        .args(["run", "franken.yml", "-q", "-o", "out2"])
        .output()
        .unwrap();
    assert_ne!(o.status.code(), Some(0));
    assert!(
        err_of(&o).contains("'sliding_window_pattern'"),
        "{}",
        err_of(&o)
    );
    assert!(!root.join("out2").exists());
}

/// Item 7: an agent folder without config.json is merged with a warning that its config was not
/// compared; a `--config-from` that is one agent's name and another's folder is ambiguous; one
/// name in two Unicode spellings names one agent twice; a progress interval that is no number is
/// said.
#[test]
fn unchecked_configs_and_ambiguous_names_are_said() {
    let f = models();
    let out = f.dir.path().join("out");
    std::fs::remove_file(f.agents[1].join("config.json")).unwrap();
    let o = merge_cmd(&f, &out, &[]).output().unwrap();
    assert!(o.status.success(), "{}", err_of(&o));
    assert!(err_of(&o).contains("has no config.json"), "{}", err_of(&o));
    let card = std::fs::read_to_string(out.join("README.md")).unwrap();
    assert!(card.contains("has no config"), "{card}");

    // Agent 1 is named as agent 0's folder is given.
    let folder0 = f.agents[0].display().to_string();
    let o = merge_cmd(
        &f,
        &f.dir.path().join("x"),
        &[
            "--name",
            "coder",
            "--name",
            &folder0,
            "--config-from",
            &folder0,
        ],
    )
    .output()
    .unwrap();
    assert_eq!(o.status.code(), Some(2), "{}", err_of(&o));
    assert!(err_of(&o).contains("names two agents"), "{}", err_of(&o));

    let (nfc, nfd) = ("caf\u{e9}", "cafe\u{301}");
    let o = merge_cmd(&f, &f.dir.path().join("y"), &["--name", nfc, "--name", nfd])
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(2), "{}", err_of(&o));
    assert!(err_of(&o).contains("given twice"), "{}", err_of(&o));

    // Progress lines (stderr is no terminal here) at an interval that is no number.
    let o = rlmerge()
        .args(["merge", "--base"])
        .arg(&f.base)
        .arg("--model")
        .arg(&f.agents[0])
        .arg("-o")
        .arg(f.dir.path().join("w"))
        .env("RLMERGE_PROGRESS_SECONDS", "abc")
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", err_of(&o));
    assert!(
        err_of(&o).contains("RLMERGE_PROGRESS_SECONDS=\"abc\""),
        "{}",
        err_of(&o)
    );
}

/// `num_hidden_layers: 2.0` (a tool that writes every number as a float) is the base's 2 layers:
/// the same architecture, merged and sliced.
#[test]
fn a_config_number_written_as_a_float_is_the_same_number() {
    let f = fixture(
        5,
        Dtype::BF16,
        &[
            ("model.layers.0.mlp.up_proj.weight", vec![4, 6]),
            ("model.layers.1.mlp.up_proj.weight", vec![4, 6]),
        ],
        &DENSITIES[..2],
        1,
    );
    let config = |layers: serde_json::Value| {
        serde_json::json!({"model_type": "llama", "num_hidden_layers": layers, "hidden_size": 6})
            .to_string()
    };
    std::fs::write(f.base.join("config.json"), config(2.into())).unwrap();
    for a in &f.agents {
        std::fs::write(a.join("config.json"), config(2.0.into())).unwrap();
    }
    let out = f.dir.path().join("out");
    let o = merge_cmd(&f, &out, &["--method", "ram"]).output().unwrap();
    assert!(o.status.success(), "{}", err_of(&o));
    // Slices read the layer count from a float too.
    std::fs::write(f.base.join("config.json"), config(2.0.into())).unwrap();
    let recipe = f.dir.path().join("slices.yml");
    std::fs::write(
        &recipe,
        format!(
            "merge_method: passthrough\nslices:\n  - sources:\n      - model: {}\n        \
             layer_range: [1, 2]\n",
            f.agents[0].display()
        ),
    )
    .unwrap();
    let sliced = rlmerge()
        .args(["run", "--quiet"])
        .arg(&recipe)
        .arg("-o")
        .arg(f.dir.path().join("sliced"))
        .output()
        .unwrap();
    assert!(sliced.status.success(), "{}", err_of(&sliced));
}

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
