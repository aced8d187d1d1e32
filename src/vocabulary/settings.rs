//! What a recipe asks of the output's tokenizer (`tokenizer_source`, the `tokenizer:` section),
//! as settings the record keeps.

use super::*;

/// What a recipe asks of the output's tokenizer.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TokenizerSettings {
    /// Which tokenizer the output takes: the base's, the union of all, or a model's.
    pub source: TokenizerSource,
    /// `tokenizer.tokens`: tokens the output must have, and where their rows come from.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tokens: Vec<TokenSetting>,
    /// `tokenizer.pad_to_multiple_of`: rows added after the last token, each the mean row.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pad_to_multiple_of: Option<usize>,
}

/// Whose tokenizer the output takes.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TokenizerSource {
    /// The base's tokenizer.
    Base,
    /// Every model's tokens: the base's, then each model's others in order.
    Union,
    /// That model's tokenizer, as it is.
    Model(PathBuf),
}

/// One entry of `tokenizer.tokens`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TokenSetting {
    /// The token's text.
    pub token: String,
    /// Where its embedding row comes from (`None`: mergekit's default for the token).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub source: Option<EmbeddingSource>,
    /// The source's row even for models that have the token.
    #[serde(default)]
    pub force: bool,
}

/// Where a token's row comes from.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum EmbeddingSource {
    /// This model's row for the same token.
    Model(PathBuf),
    /// The row of another token of a model: by its text or by its id in that model.
    ModelToken {
        /// The model whose row is taken.
        model: PathBuf,
        /// The token whose row is taken, by text.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        token: Option<String>,
        /// The token whose row is taken, by id in that model.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        token_id: Option<usize>,
    },
    /// A row of zeros.
    Zero,
}

impl TokenizerSettings {
    /// The settings with every model folder `p` replaced by `f(p)` (the record names folders
    /// relative to the output; `verify` resolves them back).
    pub fn with_folders(&self, f: impl Fn(&std::path::Path) -> PathBuf) -> TokenizerSettings {
        let abs = |p: &PathBuf| f(p);
        let mut s = self.clone();
        if let TokenizerSource::Model(p) = &mut s.source {
            *p = abs(p);
        }
        for t in &mut s.tokens {
            match &mut t.source {
                Some(EmbeddingSource::Model(p)) => *p = abs(p),
                Some(EmbeddingSource::ModelToken { model, .. }) => *model = abs(model),
                _ => {}
            }
        }
        s
    }

    /// Every folder the settings name (an output must not overwrite them).
    pub fn folders(&self) -> Vec<PathBuf> {
        let mut v = Vec::new();
        if let TokenizerSource::Model(p) = &self.source {
            v.push(p.clone());
        }
        for t in &self.tokens {
            match &t.source {
                Some(EmbeddingSource::Model(p)) => v.push(p.clone()),
                Some(EmbeddingSource::ModelToken { model, .. }) => v.push(model.clone()),
                _ => {}
            }
        }
        v
    }
}

impl TokenizerSettings {
    /// The settings `--tokenizer-source` (Python's `tokenizer_source=`) gives: `base`, `union`, or
    /// a model — a folder, or a Hub id from the cache or downloaded into it — that must be a
    /// folder; no token settings.
    pub fn of_source(text: &str) -> Result<TokenizerSettings> {
        let locate = |name: &str| -> Result<PathBuf> {
            let bad = |what: &str| {
                crate::error::usage(crate::message![
                    crate::error::Arg::option("tokenizer-source"),
                    format!(
                        " '{name}' {what}; give base, union or a model folder (or Hub id) with a \
                         tokenizer.json"
                    ),
                ])
            };
            if name.trim().is_empty() {
                return Err(bad("is empty"));
            }
            let progress = std::io::IsTerminal::is_terminal(&std::io::stderr());
            let p =
                crate::hub::locate(std::path::Path::new(name), progress).with_context(|| {
                    format!("--tokenizer-source {name}: use base, union or a model")
                })?;
            match std::fs::metadata(&p) {
                Ok(m) if m.is_dir() => Ok(p),
                Ok(_) => Err(bad("is not a folder")),
                Err(_) => Err(bad("does not exist")),
            }
        };
        Ok(TokenizerSettings {
            source: parse_source(text, &locate)?,
            tokens: Vec::new(),
            pad_to_multiple_of: None,
        })
    }
}

/// Reads a `tokenizer_source` value or the `tokenizer:` section's `source` as a user writes it:
/// `base`, `union`, or a model (`model:NAME` or NAME), found by `folder`.
pub fn parse_source(
    text: &str,
    folder: &dyn Fn(&str) -> Result<PathBuf>,
) -> Result<TokenizerSource> {
    Ok(match text {
        "base" => TokenizerSource::Base,
        "union" => TokenizerSource::Union,
        name => TokenizerSource::Model(folder(name.strip_prefix("model:").unwrap_or(name))?),
    })
}
