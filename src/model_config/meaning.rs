//! What two configs say of how the weights are used, compared by meaning rather than by text
//! (issue #50 item 1). A key one config leaves out (or sets to `null`) means what transformers
//! fills in for it, so each meaning key ([`is_meaning_key`]) is compared as its effective value:
//!
//! - **rope**: `rope_theta`, `rope_scaling`, `rope_parameters` (transformers 5's spelling, which
//!   folds the other two in, per layer type for Gemma-3), `rope_local_base_freq`,
//!   `partial_rotary_factor` and `original_max_position_embeddings` read as one set of rope
//!   parameters — an agent that added YaRN differs from a base that says nothing of scaling;
//!   a base from the Hub and the same config saved by transformers 5 do not;
//! - **windows**: `sliding_window` as it applies (none where `use_sliding_window` is false), and
//!   each layer's attention (`layer_types`, written or derived from `sliding_window_pattern`,
//!   `max_window_layers`… by [`super::layers`]), all full attention being what a config without
//!   them means;
//! - **the rest**: as written, a missing one taking transformers' default where every model
//!   family shares it (no biases, no soft caps, Gemma's tied embeddings and GeLU); a key one side
//!   sets and the other leaves to an unknown default is a difference.

use super::keys::{
    is_meaning_key, same_value, ARCHITECTURE_KEYS, HARMLESS_KEYS, PLAIN_MEANING_KEYS, ROPE_KEYS,
};
use super::layers::per_layer_list;
use serde_json::{Map, Value};
use std::collections::BTreeMap;

/// One key (with its path, e.g. `text_config.rope_scaling`) whose value differs between the
/// base's config and an agent's; for a meaning key, the effective values shown (`None`: unset
/// with no known default).
#[derive(Clone, Debug, PartialEq)]
pub struct ConfigDifference {
    /// The key as the configs spell it.
    pub key: String,
    /// Whether it changes how the weights are used ([`is_meaning_key`]).
    pub meaning: bool,
    /// The base's value, as shown to the user.
    pub base: String,
    /// The agent's value, as shown to the user.
    pub agent: String,
}

/// Every key whose value differs between the base's config and an agent's (nested `text_config`
/// keys with that prefix), but the architecture keys (compared before) and [`HARMLESS_KEYS`]:
/// meaning keys by their effective values (a key one side leaves out is a difference unless its
/// default says the same), other keys where both give a value and the values differ (tools
/// and versions write other defaults for them, and they do not change the weights' use).
pub fn config_differences(base: &Value, agent: &Value) -> Vec<ConfigDifference> {
    let mut found = Vec::new();
    let nests = [("", base, agent)].into_iter().chain(
        match (base.get("text_config"), agent.get("text_config")) {
            (Some(b), Some(a)) => Some(("text_config.", b, a)),
            _ => None,
        },
    );
    for (prefix, b, a) in nests {
        let (mb, ma) = (effective(b), effective(a));
        let mut keys: Vec<&String> = mb.keys().chain(ma.keys()).collect();
        keys.sort();
        keys.dedup();
        for key in keys {
            let (x, y) = (mb.get(key), ma.get(key));
            if x.zip(y)
                .is_some_and(|(x, y)| same_value(&x.value, &y.value))
            {
                continue;
            }
            let mut difference = ConfigDifference {
                key: format!("{prefix}{}", shown_key(key, b, a)),
                meaning: true,
                base: x.map_or_else(|| "absent".into(), Effective::shown),
                agent: y.map_or_else(|| "absent".into(), Effective::shown),
            };
            // Rope parameters that differ in θ alone are named by it, where the configs write it.
            if let (Some(x), Some(y)) = (x, y) {
                if let Some((bx, ay)) = only_theta(&x.value, &y.value) {
                    let top = [b, a]
                        .iter()
                        .any(|c| c.get("rope_theta").is_some_and(|v| !v.is_null()));
                    difference.key = match top {
                        true => format!("{prefix}rope_theta"),
                        false => format!("{prefix}{}.rope_theta", shown_key(key, b, a)),
                    };
                    (difference.base, difference.agent) = (bx.to_string(), ay.to_string());
                }
            }
            found.push(difference);
        }
        found.extend(other_differences(prefix, b, a));
    }
    found
}

/// Differences in keys that are neither architecture, meaning nor harmless: only where both
/// configs give a value.
fn other_differences(prefix: &str, b: &Value, a: &Value) -> Vec<ConfigDifference> {
    let keys = |v: &Value| -> Vec<String> {
        v.as_object()
            .into_iter()
            .flat_map(|o| o.keys().cloned())
            .collect()
    };
    let mut all = keys(b);
    all.extend(keys(a));
    all.sort();
    all.dedup();
    let mut found = Vec::new();
    for k in all {
        let nested = prefix.is_empty() && k == "text_config";
        let listed = [ARCHITECTURE_KEYS, HARMLESS_KEYS]
            .iter()
            .any(|keys| keys.contains(&k.as_str()))
            || is_meaning_key(&k);
        if nested || listed {
            continue;
        }
        if let (Some(x), Some(y)) = (b.get(&k), a.get(&k)) {
            if !(same_value(x, y) || x.is_null() || y.is_null()) {
                found.push(ConfigDifference {
                    key: format!("{prefix}{k}"),
                    meaning: false,
                    base: x.to_string(),
                    agent: y.to_string(),
                });
            }
        }
    }
    found
}

/// A meaning key's effective value, and whether the config wrote it or a default filled it in.
#[derive(Clone, Debug)]
struct Effective {
    value: Value,
    written: bool,
}

impl Effective {
    fn written(value: Value) -> Effective {
        Effective {
            value,
            written: true,
        }
    }

    fn shown(&self) -> String {
        match self.written {
            true => self.value.to_string(),
            false => format!("unset (transformers' default {})", self.value),
        }
    }
}

/// The default of plain meaning key `key` for a model of type `model_type`, where known.
fn default_of(key: &str, model_type: &str) -> Option<Value> {
    let gemma = model_type.starts_with("gemma");
    match key {
        "attention_bias" | "mlp_bias" => Some(false.into()),
        "tie_word_embeddings" => Some(gemma.into()),
        "hidden_act" => Some(if gemma { "gelu_pytorch_tanh" } else { "silu" }.into()),
        "hidden_activation" if gemma => Some("gelu_pytorch_tanh".into()),
        "attn_logit_softcapping" if model_type == "gemma2" => Some(50.0.into()),
        "final_logit_softcapping" if model_type == "gemma2" => Some(30.0.into()),
        "query_pre_attn_scalar" if matches!(model_type, "gemma2" | "gemma3" | "gemma3_text") => {
            Some(256.into())
        }
        // Unset soft caps, windows and chunking are none.
        "attn_logit_softcapping" | "final_logit_softcapping" | "attention_chunk_size" => {
            Some(Value::Null)
        }
        "sliding_window" => Some(Value::Null),
        _ => None,
    }
}

/// The effective value of every meaning key of one (nested) config, by the name it is compared
/// under: `rope`, `sliding_window`, `layer_types` (or the window keys as written, where the
/// model type's rule is unknown) and the [`PLAIN_MEANING_KEYS`], each unset one taking its
/// default where known ([`default_of`]). A key unset with no known default is left out.
fn effective(config: &Value) -> BTreeMap<String, Effective> {
    let mut m = BTreeMap::new();
    let model_type = config
        .get("model_type")
        .and_then(Value::as_str)
        .unwrap_or("");
    let set = |k: &str| config.get(k).filter(|v| !v.is_null());
    m.insert("rope".into(), Effective::written(rope(config)));
    for key in PLAIN_MEANING_KEYS.into_iter().chain(["sliding_window"]) {
        let value = match key {
            "sliding_window" => window(config).map(Effective::written),
            _ => set(key).cloned().map(Effective::written),
        };
        let value = value.or_else(|| {
            default_of(key, model_type).map(|value| Effective {
                value,
                written: false,
            })
        });
        if let Some(v) = value {
            m.insert(key.into(), v);
        }
    }
    match per_layer_list(config, "layer_types") {
        Some(types) if types.iter().all(|t| t == "full_attention") => {}
        Some(types) => {
            m.insert("layer_types".into(), Effective::written(types.into()));
        }
        // The rule is unknown: the keys it would read, as written.
        None => {
            for key in [
                "sliding_window_pattern",
                "max_window_layers",
                "use_sliding_window",
            ] {
                if let Some(v) = set(key) {
                    m.insert(key.into(), Effective::written(v.clone()));
                }
            }
        }
    }
    m
}

/// `sliding_window` as it applies: none where `use_sliding_window` is false (transformers then
/// sets it to null, Qwen2-MoE to 0), or where it is 0 or null.
fn window(config: &Value) -> Option<Value> {
    if config.get("use_sliding_window").and_then(Value::as_bool) == Some(false) {
        return Some(Value::Null);
    }
    match config.get("sliding_window") {
        Some(w) if w.is_null() || w.as_f64() == Some(0.0) => Some(Value::Null),
        other => other.cloned(),
    }
}

/// The rope parameters a config means, one set per layer type where they differ by type: from
/// `rope_parameters`, else `rope_scaling`, with `rope_theta`, `partial_rotary_factor` and
/// `original_max_position_embeddings` from the top level where the set lacks them, `type` read
/// as `rope_type`, and transformers' defaults where unset (`rope_type` default, θ = 10000,
/// rotary factor 1). Gemma-3's `rope_local_base_freq` is its sliding layers' θ.
fn rope(config: &Value) -> Value {
    let params = config.get("rope_parameters").and_then(Value::as_object);
    let per_type = params.is_some_and(|p| !p.is_empty() && p.values().all(Value::is_object));
    let canonical = if per_type {
        let sets = params.expect("checked").iter().map(|(kind, p)| {
            let p = p.as_object().expect("checked");
            (kind.clone(), Value::Object(rope_set(p, None)))
        });
        Value::Object(sets.collect())
    } else {
        let given = params.or_else(|| config.get("rope_scaling").and_then(Value::as_object));
        let empty = Map::new();
        let full = Value::Object(rope_set(given.unwrap_or(&empty), Some(config)));
        match config.get("rope_local_base_freq").filter(|v| !v.is_null()) {
            Some(local) => {
                let sliding = Map::from_iter([("rope_theta".to_string(), local.clone())]);
                let sliding = Value::Object(rope_set(&sliding, None));
                serde_json::json!({"full_attention": full, "sliding_attention": sliding})
            }
            None => full,
        }
    };
    // One set for every layer type reads as that set.
    match canonical.as_object() {
        Some(sets) if per_type_sets(sets) => {
            let first = sets.values().next().expect("non-empty").clone();
            match sets.values().all(|s| same_value(s, &first)) {
                true => first,
                false => canonical,
            }
        }
        _ => canonical,
    }
}

/// Whether a canonical rope value is a map of per-layer-type sets.
fn per_type_sets(sets: &Map<String, Value>) -> bool {
    !sets.is_empty() && sets.values().all(Value::is_object)
}

/// One set of rope parameters, canonical (see [`rope`]); `top`: the config whose top-level keys
/// fill what the set lacks.
fn rope_set(given: &Map<String, Value>, top: Option<&Value>) -> Map<String, Value> {
    let mut p: Map<String, Value> = given
        .iter()
        .filter(|(_, v)| !v.is_null())
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    if let Some(kind) = p.remove("type") {
        p.entry("rope_type").or_insert(kind);
    }
    if let Some(top) = top {
        for key in [
            "rope_theta",
            "partial_rotary_factor",
            "original_max_position_embeddings",
        ] {
            if let Some(v) = top.get(key).filter(|v| !v.is_null()) {
                p.entry(key).or_insert(v.clone());
            }
        }
    }
    p.entry("rope_type").or_insert("default".into());
    p.entry("rope_theta").or_insert(10000.0.into());
    if p.get("partial_rotary_factor")
        .and_then(Value::as_f64)
        .is_some_and(|f| f == 1.0)
    {
        p.remove("partial_rotary_factor");
    }
    p
}

/// Two one-set canonical ropes that differ in `rope_theta` alone: their θs.
fn only_theta<'v>(x: &'v Value, y: &'v Value) -> Option<(&'v Value, &'v Value)> {
    let (x, y) = (x.as_object()?, y.as_object()?);
    let (tx, ty) = (x.get("rope_theta")?, y.get("rope_theta")?);
    let others = |m: &Map<String, Value>| -> Value {
        Value::Object(
            m.iter()
                .filter(|(k, _)| *k != "rope_theta")
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect(),
        )
    };
    (!tx.is_object() && same_value(&others(x), &others(y))).then_some((tx, ty))
}

/// How a difference in the canonical key `key` is named: a rope difference by the rope key the
/// configs write (rope_scaling first, the one a user adds), the rest as they are.
fn shown_key(key: &str, b: &Value, a: &Value) -> String {
    if key != "rope" {
        return key.to_string();
    }

    let written = |k: &&&str| {
        [b, a]
            .iter()
            .any(|c| c.get(**k).is_some_and(|v| !v.is_null()))
    };
    ROPE_KEYS
        .iter()
        .find(written)
        .unwrap_or(&"rope_parameters")
        .to_string()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn keys(b: Value, a: Value) -> Vec<String> {
        config_differences(&b, &a)
            .into_iter()
            .filter(|d| d.meaning)
            .map(|d| d.key)
            .collect()
    }

    /// A Hub config and the same config as transformers 5.25 saves it (read off its
    /// `save_pretrained`): the same meaning, though half the meaning keys are spelled otherwise.
    #[test]
    fn a_config_saved_by_transformers_means_what_the_hub_one_does() {
        let hub = json!({"model_type": "qwen2", "num_hidden_layers": 4, "rope_theta": 1000000.0,
            "sliding_window": 131072, "use_sliding_window": false, "max_window_layers": 28,
            "rms_norm_eps": 1e-6, "tie_word_embeddings": false, "max_position_embeddings": 32768});
        let saved = json!({"model_type": "qwen2", "num_hidden_layers": 4, "hidden_act": "silu",
            "layer_types": ["full_attention", "full_attention", "full_attention", "full_attention"],
            "max_position_embeddings": 32768, "max_window_layers": 28, "rms_norm_eps": 1e-06,
            "rope_parameters": {"rope_theta": 1000000.0, "rope_type": "default"},
            "sliding_window": null, "tie_word_embeddings": false, "use_sliding_window": false,
            "attention_dropout": 0.0, "bos_token_id": null});
        assert_eq!(keys(hub.clone(), saved.clone()), Vec::<String>::new());
        assert_eq!(keys(saved, hub), Vec::<String>::new());
        let g3_hub = json!({"model_type": "gemma3_text", "num_hidden_layers": 8,
            "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0,
            "rope_scaling": {"rope_type": "linear", "factor": 8.0}, "sliding_window": 512,
            "sliding_window_pattern": 6, "query_pre_attn_scalar": 256});
        let g3_saved = json!({"model_type": "gemma3_text", "num_hidden_layers": 8,
            "_sliding_window_pattern": 6, "attention_bias": false,
            "hidden_activation": "gelu_pytorch_tanh", "tie_word_embeddings": true,
            "layer_types": ["sliding_attention", "sliding_attention", "sliding_attention",
                "sliding_attention", "sliding_attention", "full_attention", "sliding_attention",
                "sliding_attention"],
            "rope_parameters": {
                "full_attention": {"factor": 8.0, "rope_theta": 1000000.0, "rope_type": "linear"},
                "sliding_attention": {"rope_theta": 10000.0, "rope_type": "default"}},
            "sliding_window": 512, "query_pre_attn_scalar": 256});
        assert_eq!(keys(g3_hub, g3_saved), Vec::<String>::new());
    }

    /// Issue #50 item 1: a base that says nothing of rope scaling, an agent that adds YaRN
    /// (written either way), or a key present on one side only, differ — either way round.
    #[test]
    fn a_key_one_side_leaves_out_is_a_difference() {
        let base = json!({"model_type": "qwen2", "num_hidden_layers": 2, "rope_theta": 1e6});
        for yarn in [
            json!({"rope_scaling": {"type": "yarn", "factor": 4.0,
                "original_max_position_embeddings": 32768}}),
            json!({"rope_parameters": {"rope_type": "yarn", "type": "yarn", "factor": 4.0,
                "original_max_position_embeddings": 32768, "rope_theta": 1e6}}),
        ] {
            let mut agent = base.clone();
            agent
                .as_object_mut()
                .unwrap()
                .extend(yarn.as_object().unwrap().clone());
            let shown = config_differences(&base, &agent);
            assert_eq!(shown.len(), 1, "{shown:?}");
            assert!(shown[0].agent.contains("yarn") && shown[0].base.contains("default"));
            assert_eq!(keys(agent, base.clone()).len(), 1);
        }
        let null = json!({"model_type": "qwen2", "num_hidden_layers": 2, "rope_theta": 1e6,
            "rope_scaling": null});
        assert_eq!(keys(base.clone(), null), Vec::<String>::new());
        for (key, value) in [
            ("rms_norm_eps", json!(1e-5)),
            ("attention_bias", json!(true)),
            ("final_logit_softcapping", json!(30.0)),
            ("sliding_window", json!(4096)),
        ] {
            let mut agent = base.clone();
            agent[key] = value;
            assert_eq!(keys(base.clone(), agent.clone()), [key]);
            assert_eq!(keys(agent, base.clone()), [key]);
        }
        // A window Qwen2 does not use is none.
        let unused = json!({"model_type": "qwen2", "num_hidden_layers": 2, "rope_theta": 1e6,
            "sliding_window": 4096, "use_sliding_window": false});
        assert_eq!(keys(base.clone(), unused), Vec::<String>::new());
        // Turned on, it changes the layers' attention and the window.
        let used = json!({"model_type": "qwen2", "num_hidden_layers": 2, "rope_theta": 1e6,
            "sliding_window": 4096, "use_sliding_window": true, "max_window_layers": 1});
        assert_eq!(keys(base, used), ["layer_types", "sliding_window"]);
    }

    #[test]
    fn nested_configs_and_other_keys() {
        let base = json!({"text_config": {"model_type": "gemma3_text", "num_hidden_layers": 2,
            "rope_theta": 1e6}, "image_token_index": 5});
        let agent = json!({"text_config": {"model_type": "gemma3_text", "num_hidden_layers": 2,
            "rope_theta": 1e6, "rope_scaling": {"rope_type": "linear", "factor": 2.0}},
            "image_token_index": 6, "extra": 1});
        let found = config_differences(&base, &agent);
        let named: Vec<(&str, bool)> = found.iter().map(|d| (d.key.as_str(), d.meaning)).collect();
        assert_eq!(
            named,
            [
                ("image_token_index", false),
                ("text_config.rope_scaling", true)
            ]
        );
    }
}
