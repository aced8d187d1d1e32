//! The recipe a merged folder saves as `mergekit_config.yml` (issue #50 item 3):
//! `rlmerge run` of it, from any folder, makes the same merge byte for byte. It is the job's
//! recipe — the one it came from, or the command line's flags written as one — as YAML data, with
//! every model reference rewritten relative to the output folder (a Hub snapshot by
//! `org/name@commit`), and the settings that change the output's bytes made explicit: the output
//! dtype, the shard size, the seed of random masks, RAM's ε, the `allow_*` switches and how F32
//! agents are read.

use crate::checkpoint::DType;
use anyhow::{Context, Result};
use serde_yaml::{Mapping, Value};
use std::path::{Path, PathBuf};

/// A job's recipe as data: its YAML value with model references as written, and the folder each
/// of those references named when the job read it.
#[derive(Clone, Debug, Default)]
pub struct Recipe {
    /// The recipe, as written (a mapping).
    pub value: Value,
    /// Each model reference the recipe holds, with the folder it named.
    pub folders: Vec<(String, PathBuf)>,
}

/// The settings a saved recipe makes explicit, as the merge ran with them.
#[derive(Clone, Debug, Default)]
pub struct Settings {
    /// The output dtype (`None`: each tensor the base's).
    pub out_dtype: Option<DType>,
    /// The largest shard, where not the default.
    pub shard_size: Option<u64>,
    /// The seed of random masks, for methods that draw them.
    pub seed: Option<u64>,
    /// RAM's ε, for the RAM family, where not the default.
    pub epsilon: Option<f64>,
    /// NaN and ±Inf inputs merged by IEEE rules.
    pub allow_nonfinite: bool,
    /// Tensors some models lack merged from those that have them.
    pub allow_missing_tensors: bool,
    /// Agents' F32 weights read as stored.
    pub raw_f32_agents: bool,
}

impl Recipe {
    /// The text saved into the output folder `out` (its final path): the recipe with its model
    /// references relative to `out` and `settings` written in, under a comment that says so.
    pub fn text_for(&self, out: &Path, settings: &Settings) -> Result<String> {
        let yaml = serde_yaml::to_string(&self.value_for(out, settings)?)
            .context("cannot write the merge's recipe")?;
        Ok(format!("{}{yaml}", header()))
    }

    /// The recipe as saved into `out`, as data: [`Recipe::text_for`] without the comment.
    pub fn value_for(&self, out: &Path, settings: &Settings) -> Result<Value> {
        let mut value = self.value.clone();
        self.rewrite_references(&mut value, out);
        let map = value
            .as_mapping_mut()
            .context("internal: a recipe is a mapping")?;
        write_settings(map, settings);
        Ok(value)
    }

    /// Every model reference of `value` (see [`references_mut`]) that names a folder the job
    /// read, written as seen from `out`; `config_from`, where it names a model by reference,
    /// follows it.
    fn rewrite_references(&self, value: &mut Value, out: &Path) {
        let moved = |reference: &str| -> Option<String> {
            let (_, folder) = self.folders.iter().find(|(r, _)| r == reference)?;
            Some(reference_from(out, folder))
        };
        if let Some(map) = value.as_mapping_mut() {
            if let Some(Value::String(named)) = map.get_mut("config_from") {
                if let Some(new) = moved(named) {
                    *named = new;
                }
            }
        }
        for slot in references_mut(value) {
            // A tokenizer source may say `model:NAME`.
            let (prefix, reference) = match slot.strip_prefix("model:") {
                Some(rest) if moved(slot).is_none() => ("model:", rest.to_string()),
                _ => ("", slot.clone()),
            };
            if let Some(new) = moved(&reference) {
                *slot = format!("{prefix}{new}");
            }
        }
    }
}

/// The comment a saved recipe starts with.
fn header() -> String {
    format!(
        "# Written by rlmerge {}: `rlmerge run` of this file, from any folder, makes this merge \
         again, byte for byte.\n# Model paths are relative to this file's folder.\n",
        env!("CARGO_PKG_VERSION")
    )
}

/// A multi-stage recipe's saved text: its stages' recipes (as [`Recipe::value_for`] gives them)
/// as YAML documents in the order they ran, under the one comment.
pub fn staged_text(stages: &[Value]) -> Result<String> {
    let mut text = header();
    for value in stages {
        text.push_str("---\n");
        text.push_str(&serde_yaml::to_string(value).context("cannot write the merge's recipe")?);
    }
    Ok(text)
}

/// How a saved recipe names `folder` for a recipe saved in `out`: a Hub snapshot by
/// `org/name@commit`, a LoRA agent `BASE+ADAPTER` part by part, any other folder by its path
/// relative to `out` (as the record names inputs).
pub fn reference_from(out: &Path, folder: &Path) -> String {
    let text = folder.to_string_lossy();
    if let Some((base, adapter)) = crate::checkpoint::lora::split_reference(&text) {
        return format!(
            "{}+{}",
            reference_from(out, Path::new(base)),
            reference_from(out, Path::new(adapter))
        );
    }
    let recorded = crate::record::recorded_path(out, folder);
    let recorded = recorded.to_string_lossy();
    match recorded.strip_prefix(crate::record::HUB_PREFIX) {
        Some(id) => id.to_string(),
        None => recorded.into_owned(),
    }
}

/// `settings` written into the recipe `map`: rlmerge's own keys (`seed`, `shard_size`,
/// `allow_nonfinite`, `allow_missing_tensors`, `raw_f32_agents`), mergekit's `out_dtype`, and ε among the
/// method-wide parameters.
fn write_settings(map: &mut Mapping, settings: &Settings) {
    // mergekit's `out_dtype`, or its older `dtype` where there is none, as the recipe reads it.
    let said = map
        .get("out_dtype")
        .or_else(|| map.get("dtype"))
        .and_then(Value::as_str)
        .and_then(DType::parse_user);
    if let Some(dtype) = settings.out_dtype.filter(|d| said != Some(*d)) {
        map.insert("out_dtype".into(), dtype.torch_name().into());
    }
    if let Some(size) = settings.shard_size {
        map.insert("shard_size".into(), size.into());
    }
    if let Some(seed) = settings.seed {
        map.insert("seed".into(), seed.into());
    }
    if let Some(epsilon) = settings.epsilon {
        let parameters = map
            .entry("parameters".into())
            .or_insert_with(|| Value::Mapping(Mapping::new()));
        if let Some(p) = parameters.as_mapping_mut() {
            p.insert("epsilon".into(), epsilon.into());
        }
    }
    for (key, on) in [
        ("allow_nonfinite", settings.allow_nonfinite),
        ("allow_missing_tensors", settings.allow_missing_tensors),
        ("raw_f32_agents", settings.raw_f32_agents),
    ] {
        if on {
            map.insert(key.into(), true.into());
        } else {
            map.remove(key);
        }
    }
}

/// Every string of a recipe that names a model: `base_model`, `layout_model`, each model's
/// `model` and `fisher` folder, each slice's `base_model` and sources' `model`, a tokenizer source
/// that is a model, and the models of token sources.
pub fn references_mut(value: &mut Value) -> Vec<&mut String> {
    let mut found = Vec::new();
    let Some(map) = value.as_mapping_mut() else {
        return found;
    };
    for (key, v) in map.iter_mut() {
        match (key.as_str().unwrap_or(""), v) {
            ("base_model" | "layout_model", Value::String(s)) => found.push(s),
            ("models", Value::Sequence(models)) => {
                for m in models {
                    found.extend(model_entry(m));
                }
            }
            ("slices", Value::Sequence(slices)) => {
                for slice in slices.iter_mut().filter_map(Value::as_mapping_mut) {
                    for (k, v) in slice.iter_mut() {
                        match (k.as_str().unwrap_or(""), v) {
                            ("base_model", Value::String(s)) => found.push(s),
                            ("sources", Value::Sequence(sources)) => {
                                for source in sources {
                                    found.extend(model_entry(source));
                                }
                            }
                            _ => {}
                        }
                    }
                }
            }
            // A mergekit-moe config's experts (a multi-stage recipe's final stage).
            ("experts" | "shared_experts", Value::Sequence(experts)) => {
                for e in experts.iter_mut().filter_map(Value::as_mapping_mut) {
                    if let Some(Value::String(s)) = e.get_mut("source_model") {
                        found.push(s);
                    }
                }
            }
            ("tokenizer_source", v) => found.extend(tokenizer_model(v)),
            ("tokenizer", Value::Mapping(t)) => {
                for (k, v) in t.iter_mut() {
                    match (k.as_str().unwrap_or(""), v) {
                        ("source", v) => found.extend(tokenizer_model(v)),
                        ("tokens", Value::Mapping(tokens)) => {
                            for token in tokens.values_mut().filter_map(Value::as_mapping_mut) {
                                if let Some(source) = token.get_mut("source") {
                                    found.extend(token_model(source));
                                }
                            }
                        }
                        _ => {}
                    }
                }
            }
            _ => {}
        }
    }
    found
}

/// A `models` entry's or slice source's `model`, and its `fisher` folder.
fn model_entry(entry: &mut Value) -> Vec<&mut String> {
    let mut found = Vec::new();
    let Some(map) = entry.as_mapping_mut() else {
        return found;
    };
    for (k, v) in map.iter_mut() {
        match (k.as_str().unwrap_or(""), v) {
            ("model", Value::String(s)) => found.push(s),
            ("parameters", Value::Mapping(p)) => {
                if let Some(Value::String(s)) = p.get_mut("fisher") {
                    found.push(s);
                }
            }
            _ => {}
        }
    }
    found
}

/// A tokenizer source that names a model: a string but `base` and `union` (`model:NAME` or
/// `NAME`).
fn tokenizer_model(v: &mut Value) -> Option<&mut String> {
    match v {
        Value::String(s) if s != "base" && s != "union" => Some(s),
        _ => None,
    }
}

/// A token's source that names a model: a model string, or `{kind: model_token, model: …}`.
fn token_model(v: &mut Value) -> Option<&mut String> {
    match v {
        Value::String(s) => Some(s),
        Value::Mapping(m) => match m.get_mut("model") {
            Some(Value::String(s)) => Some(s),
            _ => None,
        },
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_model_reference_is_found() {
        let mut v: Value = serde_yaml::from_str(
            "merge_method: ties\nbase_model: b\nlayout_model: l\nmodels:\n  - model: m1\n    \
             parameters: {fisher: f1, weight: 1}\n  - model: m2\ntokenizer_source: union\n\
             tokenizer:\n  source: model:t\n  tokens:\n    x: {source: {kind: model_token, \
             model: k}}\n    y: {source: {kind: zero}}\n    z: {source: w}\nslices:\n  - base_model: sb\n    sources:\n      \
             - model: s1\n        layer_range: [0, 1]\n",
        )
        .unwrap();
        let found: Vec<String> = references_mut(&mut v)
            .into_iter()
            .map(|s| s.clone())
            .collect();
        assert_eq!(
            found,
            ["b", "l", "m1", "f1", "m2", "model:t", "k", "w", "sb", "s1"]
        );
    }
}
