//! The non-weight files of a model folder that a merged checkpoint takes from its base.

use super::dtype::DType;
use anyhow::{bail, Context, Result};
use std::path::Path;

/// The model's own files copied from the base folder when present.
pub const MODEL_FILES: &[&str] = &["config.json", "generation_config.json"];

/// The tokenizer's files, copied from the base folder when present (or written by the tokenizer
/// source's vocabulary, `vocabulary::Vocabulary::write_files`).
pub const TOKENIZER_FILES: &[&str] = &[
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
];

/// Reads `dir/config.json` as a loader needs it: a regular file (not a folder or a FIFO, which
/// would hang the read) holding a JSON object.
pub fn read_config(dir: &Path) -> Result<serde_json::Value> {
    let path = dir.join("config.json");
    if path.symlink_metadata().is_err() {
        bail!("{} has no config.json ({})", dir.display(), path.display());
    }
    super::files::check_regular_file(&path)?;
    let text = std::fs::read_to_string(&path)
        .with_context(|| format!("cannot read {}", path.display()))?;
    let config: serde_json::Value =
        serde_json::from_str(&text).with_context(|| format!("{}: invalid JSON", path.display()))?;
    if !config.is_object() {
        bail!(
            "{}: a model config must be a JSON object, not {}",
            path.display(),
            match config {
                serde_json::Value::Array(_) => "an array",
                serde_json::Value::String(_) => "a string",
                serde_json::Value::Number(_) => "a number",
                serde_json::Value::Bool(_) => "a boolean",
                _ => "null",
            }
        );
    }
    Ok(config)
}

/// Checks the base's `config.json` ([`read_config`]): a merged folder without a usable one does
/// not load, so the merge stops before it starts.
pub fn check_base_config(base: &Path) -> Result<()> {
    read_config(base)
        .map(|_| ())
        .context("the base's config.json is needed: a merged model without one does not load")?;
    // The files copied into the output: one that is there but no regular file (a FIFO, a
    // device, a folder) is refused now, not dropped or blocked on at the end.
    for name in MODEL_FILES.iter().chain(TOKENIZER_FILES) {
        let path = base.join(name);
        if path.symlink_metadata().is_ok() {
            super::files::check_regular_file(&path)
                .with_context(|| format!("the base's {name} is copied into the merged model"))?;
        }
    }
    Ok(())
}

/// The `config.json` keys that fix a model's architecture: an agent whose value differs from the
/// base's was not fine-tuned from it. Compared at the top level and in a nested `text_config`,
/// in this order — the experts and routing first (issue #44: an agent with one more expert is
/// named by its expert count, not by a dimension that happens to equal it), then MLA's ranks,
/// MTP's layers, and the dense dimensions.
pub const ARCHITECTURE_KEYS: &[&str] = &[
    "model_type",
    "architectures",
    // Mixture of experts: how many, how many routed to, which layers are sparse.
    "num_experts",
    "num_local_experts",
    "n_routed_experts",
    "n_shared_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "shared_expert_intermediate_size",
    "first_k_dense_replace",
    "decoder_sparse_step",
    "moe_layer_freq",
    "n_group",
    "topk_group",
    // Multi-head latent attention's ranks.
    "kv_lora_rank",
    "q_lora_rank",
    "qk_rope_head_dim",
    "qk_nope_head_dim",
    "v_head_dim",
    // Multi-token prediction layers.
    "num_nextn_predict_layers",
    "num_hidden_layers",
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "vocab_size",
];

/// `config.json` keys that change how the weights are used — positions, context length, attention
/// windows, activation, norms' ε, tied embeddings, soft caps: an agent trained with another value
/// (a long-context agent's YaRN `rope_scaling`) runs differently under the base's. Where one
/// differs, a merge takes the config of the model the user names (`--config-from`).
pub const MEANING_KEYS: &[&str] = &[
    "rope_theta",
    "rope_scaling",
    "rope_parameters",
    "partial_rotary_factor",
    "max_position_embeddings",
    "original_max_position_embeddings",
    "sliding_window",
    "use_sliding_window",
    "max_window_layers",
    "layer_types",
    "sliding_window_pattern",
    "attention_chunk_size",
    "hidden_act",
    "hidden_activation",
    "rms_norm_eps",
    "layer_norm_eps",
    "layer_norm_epsilon",
    "norm_eps",
    "tie_word_embeddings",
    "attn_logit_softcapping",
    "final_logit_softcapping",
    "query_pre_attn_scalar",
    "attention_bias",
    "mlp_bias",
];

/// `config.json` keys that say nothing of how the weights are used: names, paths, versions,
/// dtypes, the transformers runtime's switches. A difference in them goes unsaid.
pub const HARMLESS_KEYS: &[&str] = &[
    "_name_or_path",
    "_commit_hash",
    "_attn_implementation",
    "_attn_implementation_autoset",
    "torch_dtype",
    "dtype",
    "transformers_version",
    "use_cache",
    "auto_map",
    "output_attentions",
    "output_hidden_states",
    "return_dict",
    "initializer_range",
    "id2label",
    "label2id",
    "problem_type",
    "finetuning_task",
    "task_specific_params",
    "tokenizer_class",
];

/// Every key (`text_config.` nested ones with that prefix) whose value differs between the base's
/// config and an agent's, but the architecture keys (compared before) and [`HARMLESS_KEYS`];
/// each with whether it is a [`MEANING_KEYS`] key. A key one of them lacks is not compared (tools
/// and versions write defaults or leave them out), as [`architecture_difference`] does.
pub fn config_differences(
    base: &serde_json::Value,
    agent: &serde_json::Value,
) -> Vec<(String, bool)> {
    fn keys(v: &serde_json::Value) -> impl Iterator<Item = &String> {
        v.as_object().into_iter().flat_map(|o| o.keys())
    }
    let mut found = Vec::new();
    let nests = [("", base, agent)].into_iter().chain(
        match (base.get("text_config"), agent.get("text_config")) {
            (Some(b), Some(a)) => Some(("text_config.", b, a)),
            _ => None,
        },
    );
    for (prefix, b, a) in nests {
        let mut all: Vec<&String> = keys(b).chain(keys(a)).collect();
        all.sort();
        all.dedup();
        for key in all {
            let k = key.as_str();
            let nested = prefix.is_empty() && k == "text_config";
            if nested || ARCHITECTURE_KEYS.contains(&k) || HARMLESS_KEYS.contains(&k) {
                continue;
            }
            let same = match (b.get(k), a.get(k)) {
                (Some(x), Some(y)) => same_value(x, y) || x.is_null() || y.is_null(),
                _ => true,
            };
            if !same {
                found.push((format!("{prefix}{k}"), MEANING_KEYS.contains(&k)));
            }
        }
    }
    found
}

/// Names one config key goes by: transformers 5 writes Qwen3-MoE's `num_experts` as
/// `num_local_experts`, which the published checkpoints do not, and DeepSeek's routed experts are
/// `n_routed_experts` — a base from the Hub and an agent saved by a trainer may each use another.
const KEY_ALIASES: &[&[&str]] = &[&["num_experts", "num_local_experts", "n_routed_experts"]];

/// `key`'s value in `config` with the name `config` spells it by: `key`, or, where `config` lacks
/// it, one of its [`KEY_ALIASES`].
fn get_aliased<'a>(
    config: &'a serde_json::Value,
    key: &'a str,
) -> Option<(&'a str, &'a serde_json::Value)> {
    let names = KEY_ALIASES
        .iter()
        .find(|group| group.contains(&key))
        .map_or(&[][..], |group| &group[..]);
    std::iter::once(key)
        .chain(names.iter().copied())
        .find_map(|k| config.get(k).map(|v| (k, v)))
}

/// The first [`ARCHITECTURE_KEYS`] key (with its path, e.g. `text_config.hidden_size`) whose value
/// differs between configs `base` and `agent`, with both values; keys in `skip` and keys one of the
/// two configs lacks (under every name it goes by, [`KEY_ALIASES`]) are not compared; a key is named
/// as the base's config spells it.
pub fn architecture_difference(
    base: &serde_json::Value,
    agent: &serde_json::Value,
    skip: &[&str],
) -> Option<(String, serde_json::Value, serde_json::Value)> {
    let nests = [("", base, agent)].into_iter().chain(
        match (base.get("text_config"), agent.get("text_config")) {
            (Some(b), Some(a)) => Some(("text_config.", b, a)),
            _ => None,
        },
    );
    for (prefix, b, a) in nests {
        for key in ARCHITECTURE_KEYS.iter().filter(|k| !skip.contains(k)) {
            if let (Some((name, bv)), Some((_, av))) = (get_aliased(b, key), get_aliased(a, key)) {
                if !(same_value(bv, av) || bv.is_null() || av.is_null()) {
                    // Named as the base's config spells it.
                    return Some((format!("{prefix}{name}"), bv.clone(), av.clone()));
                }
            }
        }
    }
    None
}

/// Whether two config values mean the same: numbers by value (`2` and `2.0` are one layer count,
/// whichever tool wrote the file), lists and objects element by element, the rest as written.
fn same_value(a: &serde_json::Value, b: &serde_json::Value) -> bool {
    use serde_json::Value;
    match (a, b) {
        (Value::Number(x), Value::Number(y)) => x.as_f64() == y.as_f64(),
        (Value::Array(x), Value::Array(y)) => {
            x.len() == y.len() && x.iter().zip(y).all(|(x, y)| same_value(x, y))
        }
        (Value::Object(x), Value::Object(y)) => {
            x.len() == y.len()
                && x.iter()
                    .all(|(k, v)| y.get(k).is_some_and(|w| same_value(v, w)))
        }
        _ => a == b,
    }
}

/// Sets every dtype key of a model config to `dtype`: the top level's `torch_dtype` (always) and
/// `dtype` (current transformers reads it first), and those keys wherever a nested config (e.g.
/// `text_config`) has them.
pub fn set_config_dtype(config: &mut serde_json::Value, dtype: DType) {
    fn nested(v: &mut serde_json::Value, name: &str) {
        if let Some(obj) = v.as_object_mut() {
            for (key, value) in obj.iter_mut() {
                if (key == "torch_dtype" || key == "dtype") && value.is_string() {
                    *value = name.into();
                } else if value.is_object() {
                    nested(value, name);
                }
            }
        }
    }
    nested(config, dtype.torch_name());
    if let Some(obj) = config.as_object_mut() {
        obj.insert("torch_dtype".into(), dtype.torch_name().into());
    }
}

/// Copies [`MODEL_FILES`] from `base` into `out` (regular files only), `config.json` with its
/// dtype keys set to the output dtype ([`set_config_dtype`]) and then `edit_config` applied (a
/// tokenizer source sets `vocab_size`), and with `tokenizer` the base's [`TOKENIZER_FILES`] too
/// (without it the caller writes the output's tokenizer). Returns the names written.
pub fn copy_base_files(
    base: &Path,
    config_dir: &Path,
    out: &Path,
    out_dtype: DType,
    edit_config: &dyn Fn(&mut serde_json::Value),
    tokenizer: bool,
) -> Result<Vec<String>> {
    let mut copied = Vec::new();
    for name in MODEL_FILES {
        let from = if *name == "config.json" {
            config_dir
        } else {
            base
        };
        let src = from.join(name);
        if !src.is_file() {
            continue;
        }
        let dst = out.join(name);
        if *name == "config.json" {
            let mut config = read_config(config_dir)?;
            set_config_dtype(&mut config, out_dtype);
            edit_config(&mut config);
            std::fs::write(&dst, serde_json::to_string_pretty(&config)? + "\n")
                .with_context(|| format!("cannot write {}", dst.display()))?;
        } else {
            copy_if_present(base, name, out)?;
        }
        copied.push(name.to_string());
    }
    if tokenizer {
        for name in TOKENIZER_FILES {
            if copy_if_present(base, name, out)? {
                copied.push(name.to_string());
            }
        }
    }
    Ok(copied)
}

/// Copies file `name` of folder `from` into `out` when `from` has it (a regular file); whether
/// it did.
pub fn copy_if_present(from: &Path, name: &str, out: &Path) -> Result<bool> {
    let (src, dst) = (from.join(name), out.join(name));
    if !src.is_file() {
        return Ok(false);
    }
    std::fs::copy(&src, &dst)
        .with_context(|| format!("cannot copy {} to {}", src.display(), dst.display()))?;
    Ok(true)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Issue #44 item 5: an agent with one more expert, or another number of experts per token,
    /// is named by that key — not by a dimension equal to it.
    #[test]
    fn expert_counts_and_routing_are_architecture() {
        let base = serde_json::json!({"model_type": "mixtral", "num_local_experts": 4,
            "num_attention_heads": 4, "num_experts_per_tok": 2});
        let more = serde_json::json!({"model_type": "mixtral", "num_local_experts": 5,
            "num_attention_heads": 4, "num_experts_per_tok": 2});
        assert_eq!(
            architecture_difference(&base, &more, &[]).unwrap().0,
            "num_local_experts"
        );
        let routed = serde_json::json!({"model_type": "mixtral", "num_local_experts": 4,
            "num_attention_heads": 4, "num_experts_per_tok": 1});
        assert_eq!(
            architecture_difference(&base, &routed, &[]).unwrap().0,
            "num_experts_per_tok"
        );
        // The published Qwen3-MoE says num_experts, transformers 5 writes num_local_experts.
        let hub = serde_json::json!({"model_type": "qwen3_moe", "num_experts": 128});
        let saved = serde_json::json!({"model_type": "qwen3_moe", "num_local_experts": 64});
        let (key, b, a) = architecture_difference(&hub, &saved, &[]).unwrap();
        assert_eq!((key.as_str(), b, a), ("num_experts", 128.into(), 64.into()));
        let same = serde_json::json!({"model_type": "qwen3_moe", "num_local_experts": 128});
        assert!(architecture_difference(&hub, &same, &[]).is_none());
        let dsv3 = serde_json::json!({"n_routed_experts": 8, "first_k_dense_replace": 1});
        let moe_first = serde_json::json!({"n_routed_experts": 8, "first_k_dense_replace": 0});
        assert_eq!(
            architecture_difference(&dsv3, &moe_first, &[]).unwrap().0,
            "first_k_dense_replace"
        );
    }

    #[test]
    fn architecture_differences_name_the_first_key() {
        let base = serde_json::json!({"model_type": "qwen2", "num_hidden_layers": 2,
            "text_config": {"hidden_size": 8}});
        let same = serde_json::json!({"model_type": "qwen2", "num_hidden_layers": 2,
            "torch_dtype": "float32"});
        assert_eq!(architecture_difference(&base, &same, &[]), None);
        // Issue #42: a float that equals the integer is the same value.
        let float = serde_json::json!({"model_type": "qwen2", "num_hidden_layers": 2.0});
        assert_eq!(architecture_difference(&base, &float, &[]), None);
        let deeper = serde_json::json!({"model_type": "qwen2", "num_hidden_layers": 3});
        let d = architecture_difference(&base, &deeper, &[]).unwrap();
        assert_eq!(
            (d.0.as_str(), d.1, d.2),
            ("num_hidden_layers", 2.into(), 3.into())
        );
        assert_eq!(
            architecture_difference(&base, &deeper, &["num_hidden_layers"]),
            None
        );
        let llama = serde_json::json!({"model_type": "llama"});
        assert_eq!(
            architecture_difference(&base, &llama, &[]).unwrap().0,
            "model_type"
        );
        let nested = serde_json::json!({"text_config": {"hidden_size": 16}});
        assert_eq!(
            architecture_difference(&base, &nested, &[]).unwrap().0,
            "text_config.hidden_size"
        );
    }

    #[test]
    fn every_dtype_key_follows_the_output() {
        let mut c = serde_json::json!({
            "torch_dtype": "bfloat16", "dtype": "bfloat16",
            "text_config": {"dtype": "bfloat16", "hidden_size": 8},
            "quantization": {"bits": 4}
        });
        set_config_dtype(&mut c, DType::F32);
        assert_eq!(c["torch_dtype"], "float32");
        assert_eq!(c["dtype"], "float32");
        assert_eq!(c["text_config"]["dtype"], "float32");
        assert_eq!(c["text_config"]["hidden_size"], 8);
        let mut bare = serde_json::json!({"model_type": "llama"});
        set_config_dtype(&mut bare, DType::F16);
        assert_eq!(
            bare,
            serde_json::json!({"model_type": "llama", "torch_dtype": "float16"})
        );
    }
}
