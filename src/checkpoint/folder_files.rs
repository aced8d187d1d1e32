//! The non-weight files of a model folder that a merged checkpoint takes from its base.

use super::dtype::DType;
use anyhow::{Context, Result};
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

/// Copies [`COPIED_FROM_BASE`] from `base` into `out`; `config.json`'s `torch_dtype` is set to the
/// output dtype. Returns the names copied.
pub fn copy_base_files(base: &Path, out: &Path, out_dtype: DType) -> Result<Vec<String>> {
    let mut copied = Vec::new();
    for name in COPIED_FROM_BASE {
        let src = base.join(name);
        if !src.is_file() {
            continue;
        }
        let dst = out.join(name);
        if *name == "config.json" {
            let text = std::fs::read_to_string(&src)
                .with_context(|| format!("cannot read {}", src.display()))?;
            let mut config: serde_json::Value = serde_json::from_str(&text)
                .with_context(|| format!("{}: invalid JSON", src.display()))?;
            if let Some(obj) = config.as_object_mut() {
                obj.insert("torch_dtype".into(), out_dtype.torch_name().into());
            }
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
