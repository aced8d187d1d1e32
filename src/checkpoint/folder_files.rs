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
