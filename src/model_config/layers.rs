//! Per-layer lists a config.json says, or implies by a rule over the layer's index: each layer's
//! attention (`layer_types`) and whether it has rope (`no_rope_layers`). transformers builds them
//! from the index where a config has no explicit list — Gemma-3's `sliding_window_pattern`,
//! Gemma-2's odd/even alternation, Qwen2's `max_window_layers` — so a layer moved to another
//! index (a slice) changes kind unless the output's config lists them (issue #50 item 2). The
//! rules are transformers 5's, by `model_type`; a model type not listed here derives nothing.

use crate::structure::{top_layer_count, whole_number};
use serde_json::Value;

/// The per-layer lists a slice rebuilds from the layers each output layer comes from.
pub const PER_LAYER_LISTS: [&str; 4] = [
    "layer_types",
    "mlp_layer_types",
    "no_rope_layers",
    "block_types",
];

/// Keys that make a layer's behaviour a rule over its index; a model type whose rule rlmerge does
/// not know cannot have its layers moved ([`index_rule_key`]).
const INDEX_RULE_KEYS: [&str; 3] = [
    "sliding_window_pattern",
    "_sliding_window_pattern",
    "no_rope_layer_interval",
];

/// The list `key` of (decoder) config `config`, one entry per layer: as written where the config
/// lists it for every layer, else as transformers derives it from the layer index
/// ([`derived`]); `None` where it does neither.
pub fn per_layer_list(config: &Value, key: &str) -> Option<Vec<Value>> {
    let n = top_layer_count(config)?;
    match config.get(key).and_then(Value::as_array) {
        Some(list) if list.len() == n => Some(list.clone()),
        Some(_) => None,
        None => derived(config, key, n),
    }
}

/// The list `key` transformers derives for `n` layers of a config without one.
pub fn derived(config: &Value, key: &str, n: usize) -> Option<Vec<Value>> {
    let model_type = config.get("model_type").and_then(Value::as_str)?;
    let number = |k: &str, default: u64| config.get(k).and_then(whole_number).unwrap_or(default);
    let flag = |k: &str| config.get(k).and_then(Value::as_bool).unwrap_or(false);
    let window = config.get("sliding_window").is_some_and(|w| !w.is_null());
    let pattern = |default: u64| {
        ["sliding_window_pattern", "_sliding_window_pattern"]
            .iter()
            .find_map(|k| config.get(*k).and_then(whole_number))
            .unwrap_or(default)
    };
    let kinds = |sliding: &dyn Fn(u64) -> bool, other: &str| -> Option<Vec<Value>> {
        Some(
            (0..n as u64)
                .map(|i| match sliding(i) {
                    true => "sliding_attention".into(),
                    false => other.into(),
                })
                .collect(),
        )
    };
    // Each layer whose index (from 1) is not a multiple of `p` slides; a pattern of 0 none.
    let every = |p: u64| move |i: u64| p != 0 && !(i + 1).is_multiple_of(p);
    match (key, model_type) {
        ("layer_types", "gemma2" | "gpt_oss") => kinds(&every(2), "full_attention"),
        ("layer_types", "gemma3" | "gemma3_text") => kinds(&every(pattern(6)), "full_attention"),
        ("layer_types", "cohere2") => kinds(&every(pattern(4)), "full_attention"),
        ("layer_types", "olmo3") => kinds(&every(4), "full_attention"),
        ("layer_types", "qwen2" | "qwen3") => {
            let from = number("max_window_layers", 28);
            let on = flag("use_sliding_window") && window;
            kinds(&|i| on && i >= from, "full_attention")
        }
        ("layer_types", "qwen2_moe") => {
            let below = number("max_window_layers", 28);
            let on = flag("use_sliding_window");
            kinds(&|i| on && every(2)(i) && i < below, "full_attention")
        }
        ("layer_types", "minimax") => Some(
            (0..n as u64)
                .map(|i| match every(2)(i) {
                    true => "full_attention".into(),
                    false => "linear_attention".into(),
                })
                .collect(),
        ),
        ("no_rope_layers", "llama4" | "llama4_text" | "smollm3") => {
            let interval = number("no_rope_layer_interval", 4);
            Some(
                (0..n as u64)
                    .map(|i| u64::from(every(interval)(i)).into())
                    .collect(),
            )
        }
        _ => None,
    }
}

/// The key of `config` that derives a layer's behaviour from its index by a rule rlmerge does not
/// know (a model type [`derived`] does not list), where the config lists no `layer_types`.
pub fn index_rule_key(config: &Value) -> Option<&'static str> {
    let n = top_layer_count(config)?;
    if per_layer_list(config, "layer_types").is_some()
        || derived(config, "layer_types", n).is_some()
    {
        return None;
    }
    INDEX_RULE_KEYS
        .into_iter()
        .find(|k| config.get(*k).is_some_and(|v| !v.is_null()))
        .or_else(|| {
            let sliding = config.get("use_sliding_window").and_then(Value::as_bool);
            (sliding == Some(true) && config.get("max_window_layers").is_some())
                .then_some("max_window_layers")
        })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn types(config: Value) -> Vec<String> {
        per_layer_list(&config, "layer_types")
            .unwrap()
            .iter()
            .map(|v| v.as_str().unwrap().chars().next().unwrap().to_string())
            .collect()
    }

    /// The rules, checked against what transformers 5.25's configs give for the same keys.
    #[test]
    fn derived_layer_types_follow_transformers() {
        let g3 = json!({"model_type": "gemma3_text", "num_hidden_layers": 8});
        assert_eq!(types(g3).concat(), "sssssfss");
        let g3 = json!({"model_type": "gemma3_text", "num_hidden_layers": 4, "sliding_window_pattern": 2});
        assert_eq!(types(g3).concat(), "sfsf");
        let g2 = json!({"model_type": "gemma2", "num_hidden_layers": 4});
        assert_eq!(types(g2).concat(), "sfsf");
        let q = json!({"model_type": "qwen2", "num_hidden_layers": 6, "use_sliding_window": true,
            "max_window_layers": 2, "sliding_window": 16});
        assert_eq!(types(q).concat(), "ffssss");
        let off = json!({"model_type": "qwen2", "num_hidden_layers": 3, "max_window_layers": 1,
            "sliding_window": 16});
        assert_eq!(types(off).concat(), "fff");
        let moe = json!({"model_type": "qwen2_moe", "num_hidden_layers": 5, "use_sliding_window": true,
            "max_window_layers": 3});
        assert_eq!(types(moe).concat(), "sfsff");
        let listed = json!({"model_type": "gemma2", "num_hidden_layers": 2,
            "layer_types": ["full_attention", "full_attention"]});
        assert_eq!(types(listed).concat(), "ff");
        let nope = json!({"model_type": "smollm3", "num_hidden_layers": 5});
        assert_eq!(
            per_layer_list(&nope, "no_rope_layers").unwrap(),
            [1, 1, 1, 0, 1].map(Value::from)
        );
        assert!(per_layer_list(
            &json!({"model_type": "llama", "num_hidden_layers": 2}),
            "layer_types"
        )
        .is_none());
        // A pattern of zero is no rule to divide by.
        let zero = json!({"model_type": "gemma3_text", "num_hidden_layers": 2, "sliding_window_pattern": 0});
        assert_eq!(types(zero).concat(), "ff");
    }

    #[test]
    fn unknown_index_rules_are_named() {
        let exaone = json!({"model_type": "exaone4", "num_hidden_layers": 4, "sliding_window_pattern": "LLLG"});
        assert_eq!(index_rule_key(&exaone), Some("sliding_window_pattern"));
        let known = json!({"model_type": "gemma3_text", "num_hidden_layers": 4, "sliding_window_pattern": 2});
        assert_eq!(index_rule_key(&known), None);
        let listed = json!({"model_type": "exaone4", "num_hidden_layers": 1, "sliding_window_pattern": 4,
            "layer_types": ["full_attention"]});
        assert_eq!(index_rule_key(&listed), None);
        let qwen_like = json!({"model_type": "other", "num_hidden_layers": 2, "use_sliding_window": true,
            "max_window_layers": 1});
        assert_eq!(index_rule_key(&qwen_like), Some("max_window_layers"));
    }
}
