//! Prompts as token ids, encoded as transformers' fast tokenizer encodes them: the base's
//! `tokenizer.json` read by Hugging Face's own tokenizers library, each prompt prefixed with the
//! text of its `bos_token` and encoded without added special tokens — mergekit-moe's
//! `tokenize_prompts`, which `rlmerge moe`'s cheap_embed routers average the embeddings of.

use anyhow::{Context, Result};
use std::path::Path;

/// A model's tokenizer as prompts are encoded by it.
pub struct PromptTokenizer {
    tokenizer: tokenizers::Tokenizer,
    /// The text of its `bos_token`, put before each prompt.
    bos: String,
}

impl PromptTokenizer {
    /// The tokenizer of model folder `dir` (its `tokenizer.json`).
    pub fn open(dir: &Path) -> Result<PromptTokenizer> {
        let path = dir.join("tokenizer.json");
        if path.symlink_metadata().is_err() {
            anyhow::bail!(
                "{} has no tokenizer.json, which encodes the prompts of gate_mode cheap_embed (a \
                 slow tokenizer's vocab files alone are not read); use gate_mode random, or a base \
                 with a fast tokenizer",
                dir.display()
            );
        }
        crate::checkpoint::files::check_regular_file(&path)?;
        let tokenizer = tokenizers::Tokenizer::from_file(&path)
            .map_err(|e| anyhow::anyhow!("cannot read {}: {e}", path.display()))?;
        Ok(PromptTokenizer {
            tokenizer,
            bos: bos_token(dir)?,
        })
    }

    /// The token ids of `prompt`.
    pub fn encode(&self, prompt: &str) -> Result<Vec<u32>> {
        let text = format!("{}{prompt}", self.bos);
        let encoding = self
            .tokenizer
            .encode(text.as_str(), false)
            .map_err(|e| anyhow::anyhow!("cannot encode the prompt {prompt:?}: {e}"))?;
        Ok(encoding.get_ids().to_vec())
    }
}

/// The text of the tokenizer's `bos_token` (tokenizer_config.json's, else
/// special_tokens_map.json's), or nothing where it has none.
fn bos_token(dir: &Path) -> Result<String> {
    for name in ["tokenizer_config.json", "special_tokens_map.json"] {
        let path = dir.join(name);
        if path.symlink_metadata().is_err() {
            continue;
        }
        crate::checkpoint::files::check_regular_file(&path)?;
        let text = std::fs::read_to_string(&path)
            .with_context(|| format!("cannot read {}", path.display()))?;
        let json: serde_json::Value = serde_json::from_str(&text)
            .with_context(|| format!("{}: invalid JSON", path.display()))?;
        match &json["bos_token"] {
            serde_json::Value::String(s) => return Ok(s.clone()),
            serde_json::Value::Object(o) => {
                if let Some(s) = o.get("content").and_then(|c| c.as_str()) {
                    return Ok(s.to_string());
                }
            }
            _ => {}
        }
    }
    Ok(String::new())
}
