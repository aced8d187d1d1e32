//! The non-weight files of a model folder that a merged checkpoint takes from its base.

use super::dtype::DType;
use anyhow::{Context, Result};
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

/// Checks the base's `config.json` (`ModelConfig::read`): a merged folder without a usable one
/// does not load, so the merge stops before it starts.
pub fn check_base_config(base: &Path) -> Result<()> {
    crate::model_config::ModelConfig::read(base)
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

/// Writes the output's `config` (built in memory: `engine::output`) into `out`, copies the
/// base's other [`MODEL_FILES`] (regular files only), and with `tokenizer` the base's
/// [`TOKENIZER_FILES`] too (without it the caller writes the output's tokenizer). Returns the
/// names written.
pub fn write_model_files(
    base: &Path,
    config: Option<&serde_json::Value>,
    out: &Path,
    tokenizer: bool,
) -> Result<Vec<String>> {
    let mut copied = Vec::new();
    if let Some(config) = config {
        let dst = out.join(crate::model_config::CONFIG_FILE);
        std::fs::write(&dst, serde_json::to_string_pretty(config)? + "\n")
            .with_context(|| format!("cannot write {}", dst.display()))?;
        copied.push(crate::model_config::CONFIG_FILE.to_string());
    }
    for name in MODEL_FILES
        .iter()
        .filter(|n| **n != crate::model_config::CONFIG_FILE)
    {
        if copy_if_present(base, name, out)? {
            copied.push(name.to_string());
        }
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
