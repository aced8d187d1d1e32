//! The non-weight files of a model folder that a merged checkpoint takes from its base.

use super::dtype::DType;
use anyhow::{bail, Context, Result};
use std::collections::BTreeMap;
use std::path::Path;

/// Files copied from the base folder when present (config, generation config, tokenizer).
pub const COPIED_FROM_BASE: &[&str] = &[
    "config.json",
    "generation_config.json",
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

/// A model's vocabulary (token → id) from its `tokenizer.json`, as a fast tokenizer's
/// `get_vocab()` gives it: the model's vocabulary (a map, or Unigram's list of pieces) and the
/// added tokens. `None` when the folder has no tokenizer.json.
pub fn vocabulary(dir: &Path) -> Result<Option<BTreeMap<String, u64>>> {
    let path = dir.join("tokenizer.json");
    if !path.is_file() {
        return Ok(None);
    }
    let text = std::fs::read_to_string(&path)
        .with_context(|| format!("cannot read {}", path.display()))?;
    let json: serde_json::Value =
        serde_json::from_str(&text).with_context(|| format!("{}: invalid JSON", path.display()))?;
    let mut vocab = BTreeMap::new();
    match &json["model"]["vocab"] {
        serde_json::Value::Object(m) => {
            for (tok, id) in m {
                vocab.insert(tok.clone(), id.as_u64().unwrap_or(u64::MAX));
            }
        }
        serde_json::Value::Array(pieces) => {
            for (id, p) in pieces.iter().enumerate() {
                if let Some(tok) = p.get(0).and_then(|t| t.as_str()) {
                    vocab.insert(tok.to_string(), id as u64);
                }
            }
        }
        _ => bail!("{}: no model.vocab", path.display()),
    }
    for t in json["added_tokens"].as_array().into_iter().flatten() {
        if let (Some(tok), Some(id)) = (t["content"].as_str(), t["id"].as_u64()) {
            vocab.insert(tok.to_string(), id);
        }
    }
    Ok(Some(vocab))
}

/// Refuses `tokenizer_source: model:NAME` unless NAME's vocabulary is the base's, token for
/// token: the embeddings are then merged as they are and only the tokenizer files differ.
pub fn check_same_vocabulary(base: &Path, source: &Path) -> Result<()> {
    let (Some(b), Some(s)) = (vocabulary(base)?, vocabulary(source)?) else {
        bail!(
            "tokenizer_source {}: both it and the base {} need a tokenizer.json to compare their \
             vocabularies",
            source.display(),
            base.display()
        );
    };
    if let Some((tok, id)) = s
        .iter()
        .find(|(t, id)| b.get(*t) != Some(id))
        .or_else(|| b.iter().find(|(t, _)| !s.contains_key(*t)))
    {
        bail!(
            "tokenizer_source {}: its vocabulary differs from the base's ({} vs {} tokens; first \
             difference: {tok:?}, id {id}); re-indexing the embeddings for another vocabulary \
             (union, model:NAME with other tokens) is not supported yet",
            source.display(),
            s.len(),
            b.len()
        );
    }
    Ok(())
}

/// Reads `dir/config.json` as a loader needs it: a regular file (not a folder or a FIFO, which
/// would hang the read) holding a JSON object.
pub fn read_config(dir: &Path) -> Result<serde_json::Value> {
    let path = dir.join("config.json");
    if path.symlink_metadata().is_err() {
        bail!("{} has no config.json ({})", dir.display(), path.display());
    }
    super::model::check_regular_file(&path)?;
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
        .context("the base's config.json is needed: a merged model without one does not load")
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

/// Copies [`COPIED_FROM_BASE`] from `base` into `out` (regular files only) — the tokenizer's files
/// from `tokenizer` instead when given (`tokenizer_source: model:NAME`); `config.json`'s dtype
/// keys are set to the output dtype ([`set_config_dtype`]). Returns the names copied.
pub fn copy_base_files(
    base: &Path,
    tokenizer: Option<&Path>,
    out: &Path,
    out_dtype: DType,
) -> Result<Vec<String>> {
    let mut copied = Vec::new();
    for name in COPIED_FROM_BASE {
        let from_model = matches!(*name, "config.json" | "generation_config.json");
        let src = match tokenizer {
            Some(t) if !from_model => t.join(name),
            _ => base.join(name),
        };
        if !src.is_file() {
            continue;
        }
        let dst = out.join(name);
        if *name == "config.json" {
            let mut config = read_config(base)?;
            set_config_dtype(&mut config, out_dtype);
            std::fs::write(&dst, serde_json::to_string_pretty(&config)? + "\n")
                .with_context(|| format!("cannot write {}", dst.display()))?;
        } else {
            std::fs::copy(&src, &dst)
                .with_context(|| format!("cannot copy {} to {}", src.display(), dst.display()))?;
        }
        copied.push(name.to_string());
    }
    Ok(copied)
}

#[cfg(test)]
mod tests {
    use super::*;

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
