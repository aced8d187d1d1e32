//! The keys of a config.json by what they say: the architecture (an agent with another value was
//! not fine-tuned from the base), how the weights are used (an agent trained with another value
//! runs differently under the base's), and nothing of either (names, versions, runtime switches).

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
/// differs, a merge takes the config of the model the user names (`--config-from`). They are
/// compared by what they mean ([`super::meaning`]) in three groups: the rope keys as one set
/// ([`ROPE_KEYS`]), the window keys through the windows and per-layer types they make
/// ([`WINDOW_KEYS`]), the rest as written ([`PLAIN_MEANING_KEYS`]).
pub fn is_meaning_key(key: &str) -> bool {
    [&ROPE_KEYS[..], &WINDOW_KEYS[..], &PLAIN_MEANING_KEYS[..]]
        .iter()
        .any(|group| group.contains(&key))
}

/// The keys that say a model's rope parameters (transformers 5 folds the others into
/// `rope_parameters`), in the order a difference is named by the one a config writes.
pub const ROPE_KEYS: [&str; 6] = [
    "rope_scaling",
    "rope_parameters",
    "rope_theta",
    "rope_local_base_freq",
    "partial_rotary_factor",
    "original_max_position_embeddings",
];

/// The keys that say which layers attend through a sliding window, and how far.
pub const WINDOW_KEYS: [&str; 6] = [
    "sliding_window",
    "use_sliding_window",
    "max_window_layers",
    "layer_types",
    "sliding_window_pattern",
    "_sliding_window_pattern",
];

/// The other keys that change how the weights are used, compared as written.
pub const PLAIN_MEANING_KEYS: [&str; 14] = [
    "max_position_embeddings",
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
pub fn same_value(a: &serde_json::Value, b: &serde_json::Value) -> bool {
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
}
