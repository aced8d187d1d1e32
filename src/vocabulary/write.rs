//! The output's tokenizer files and its config.json's vocabulary size, written when the merge
//! is done.

use super::*;

/// The output tokenizer's files: taken as they are from a folder, or that folder's with
/// tokenizer.json and tokenizer_config.json rewritten (written when the merge is done, from the
/// source's files, so no JSON tree is held during the merge).
#[derive(Debug)]
pub(super) enum TokenizerFiles {
    CopyFrom(PathBuf),
    Rewrite {
        from: PathBuf,
        /// Tokens at or past this id are dropped (the base's vocab_size, when it strips any).
        strip_from: Option<u32>,
        /// Added tokens appended to tokenizer.json's, in order.
        appended: Vec<AddedToken>,
        /// Every added token of the output (tokenizer_config.json's `added_tokens_decoder`).
        added: Vec<AddedToken>,
    },
}

impl Vocabulary {
    /// Writes the output tokenizer's files into `out` (those [`crate::checkpoint::folder_files`]
    /// copies from a model) and returns their names.
    pub fn write_files(&self, out: &Path) -> Result<Vec<String>> {
        let (from, rewrite) = match &self.files {
            TokenizerFiles::CopyFrom(d) => (d, None),
            TokenizerFiles::Rewrite {
                from,
                strip_from,
                appended,
                added,
            } => (from, Some((strip_from, appended, added))),
        };
        let mut written = Vec::new();
        for name in crate::checkpoint::folder_files::TOKENIZER_FILES {
            let src = from.join(name);
            let dst = out.join(name);
            match (rewrite, *name) {
                (Some((strip, appended, _)), "tokenizer.json") => {
                    write_tokenizer_json(&src, &dst, *strip, appended)?
                }
                (Some((_, _, added)), "tokenizer_config.json") if src.is_file() => {
                    let text = std::fs::read_to_string(&src)
                        .with_context(|| format!("cannot read {}", src.display()))?;
                    let mut config: Value = serde_json::from_str(&text)
                        .with_context(|| format!("{}: invalid JSON", src.display()))?;
                    if let Some(obj) = config.as_object_mut() {
                        let decoder: Map<String, Value> = added
                            .iter()
                            .map(|a| (a.id.to_string(), added_entry(a, false)))
                            .collect();
                        obj.insert("added_tokens_decoder".into(), Value::Object(decoder));
                    }
                    std::fs::write(&dst, serde_json::to_string_pretty(&config)? + "\n")
                        .with_context(|| format!("cannot write {}", dst.display()))?;
                }
                // Files that list the vocabulary themselves would contradict the new one.
                (
                    Some(_),
                    "vocab.json" | "merges.txt" | "added_tokens.json" | "tokenizer.model",
                ) => continue,
                _ => {
                    if !crate::checkpoint::folder_files::copy_if_present(from, name, out)? {
                        continue;
                    }
                }
            }
            written.push(name.to_string());
        }
        Ok(written)
    }

    /// Sets the vocabulary size of an output config.json to the output's rows.
    pub fn set_config_vocab_size(&self, config: &mut Value) {
        let rows = Value::from(self.rows as u64);
        let nested = config.get("vocab_size").is_none()
            && config
                .get("text_config")
                .is_some_and(|c| c.get("vocab_size").is_some());
        if nested {
            config["text_config"]["vocab_size"] = rows;
        } else if let Some(obj) = config.as_object_mut() {
            obj.insert("vocab_size".into(), rows);
        }
    }
}
