//! A recipe's tokenizer settings: mergekit's `tokenizer_source`, or its `tokenizer:` section
//! (`source`, `tokens`, `pad_to_multiple_of`), checked with the line of each mistake (SPEC §5b).

use super::{Folders, RawConfig, RecipeText};
use crate::error::usage;
use crate::vocabulary::{
    parse_source, EmbeddingSource, TokenSetting, TokenizerSettings, TokenizerSource,
};
use anyhow::{Context, Result};
use std::path::PathBuf;

/// The tokenizer settings (`tokenizer_source`, or the `tokenizer:` section: `source`, default
/// union as in mergekit, `tokens`, `pad_to_multiple_of`); `None` when the recipe sets neither.
pub(super) fn tokenizer_settings(
    raw: &RawConfig,
    text: RecipeText,
    folders: &Folders,
) -> Result<Option<TokenizerSettings>> {
    let folder = |name: &str| folders.folder(name);
    let source_of = |v: &serde_yaml::Value, key: &str| -> Result<TokenizerSource> {
        let line = text.at(key);
        let Some(s) = v.as_str() else {
            return Err(usage(format!(
                "tokenizer source must be base, union or model:NAME{line}"
            )));
        };
        parse_source(s, &folder).with_context(|| format!("tokenizer source{line}"))
    };
    match (&raw.tokenizer_source, &raw.tokenizer) {
        (Some(_), Some(_)) => Err(usage(
            "give either tokenizer_source or a tokenizer section, not both",
        )),
        (None, None) => Ok(None),
        (Some(s), None) => Ok(Some(TokenizerSettings {
            source: source_of(s, "tokenizer_source")?,
            tokens: Vec::new(),
            pad_to_multiple_of: None,
        })),
        (None, Some(section)) => {
            let line = text.at("tokenizer");
            let Some(map) = section.as_mapping() else {
                return Err(usage(format!(
                    "tokenizer{line} must be a mapping of source, tokens and \
                     pad_to_multiple_of"
                )));
            };
            let mut settings = TokenizerSettings {
                source: TokenizerSource::Union,
                tokens: Vec::new(),
                pad_to_multiple_of: None,
            };
            for (k, v) in map {
                match k.as_str().unwrap_or("?") {
                    "source" => settings.source = source_of(v, "source")?,
                    "pad_to_multiple_of" => {
                        settings.pad_to_multiple_of = match v.as_u64() {
                            Some(n) if (1..=MAX_PAD_MULTIPLE).contains(&n) => Some(n as usize),
                            _ if v.is_null() => None,
                            _ => {
                                return Err(usage(format!(
                                    "tokenizer.pad_to_multiple_of{} must be a whole \
                                     number above 0, at most {MAX_PAD_MULTIPLE}",
                                    text.at("pad_to_multiple_of")
                                )))
                            }
                        }
                    }
                    "tokens" => settings.tokens = token_settings(v, text, &folder)?,
                    other => {
                        return Err(usage(format!(
                            "tokenizer.{other}{} is not a tokenizer setting; mergekit's \
                             are source, tokens and pad_to_multiple_of",
                            text.at(other)
                        )))
                    }
                }
            }
            Ok(Some(settings))
        }
    }
}

/// The largest `pad_to_multiple_of`: padding adds fewer rows than this (mergekit's users pad to
/// 8–128); a larger multiple is a typo that would write that many rows.
const MAX_PAD_MULTIPLE: u64 = 65536;

/// `tokenizer.tokens`: each token's `source` (a model, `{kind: zero}`, or `{kind: model_token,
/// model, token | token_id}`) and `force`.
fn token_settings(
    v: &serde_yaml::Value,
    text: RecipeText,
    folder: &dyn Fn(&str) -> Result<PathBuf>,
) -> Result<Vec<TokenSetting>> {
    let line = text.at("tokens");
    let bad = |what: String| usage(format!("tokenizer.tokens{line}: {what}"));
    let Some(map) = v.as_mapping() else {
        return Err(bad("must map each token to its settings".into()));
    };
    let mut out = Vec::new();
    for (tok, cfg) in map {
        let Some(token) = tok.as_str().map(str::to_string) else {
            return Err(bad(format!("token {tok:?} is not text")));
        };
        if token.is_empty() {
            return Err(bad("a token is empty text".into()));
        }
        let mut setting = TokenSetting {
            token: token.clone(),
            source: None,
            force: false,
        };
        let entries = match cfg {
            serde_yaml::Value::Null => serde_yaml::Mapping::new(),
            serde_yaml::Value::Mapping(m) => m.clone(),
            _ => return Err(bad(format!("{token:?} must map to source and force"))),
        };
        for (k, v) in &entries {
            match k.as_str().unwrap_or("?") {
                "force" => {
                    setting.force = v
                        .as_bool()
                        .ok_or_else(|| bad(format!("{token:?}: force must be true or false")))?
                }
                "source" => setting.source = Some(embedding_source(v, &token, folder, &bad)?),
                other => {
                    return Err(bad(format!(
                        "{token:?}: unknown key '{other}' (source and force are)"
                    )))
                }
            }
        }
        out.push(setting);
    }
    Ok(out)
}

/// One token's `source`.
fn embedding_source(
    v: &serde_yaml::Value,
    token: &str,
    folder: &dyn Fn(&str) -> Result<PathBuf>,
    bad: &dyn Fn(String) -> anyhow::Error,
) -> Result<EmbeddingSource> {
    if let Some(model) = v.as_str() {
        return Ok(EmbeddingSource::Model(folder(model)?));
    }
    let Some(m) = v.as_mapping() else {
        return Err(bad(format!(
            "{token:?}: source must be a model, {{kind: zero}} or {{kind: model_token, ...}}"
        )));
    };
    let get = |k: &str| m.get(k);
    match get("kind").and_then(|k| k.as_str()) {
        Some("zero") => Ok(EmbeddingSource::Zero),
        Some("model_token") => {
            let model = get("model")
                .and_then(|m| m.as_str())
                .ok_or_else(|| bad(format!("{token:?}: model_token needs a model")))?;
            let text = get("token").map(|t| {
                t.as_str()
                    .map(str::to_string)
                    .ok_or_else(|| bad(format!("{token:?}: model_token's token must be text")))
            });
            let id = get("token_id").map(|t| {
                t.as_u64()
                    .map(|n| n as usize)
                    .ok_or_else(|| bad(format!("{token:?}: token_id must be a whole number")))
            });
            let (token_text, token_id) = (text.transpose()?, id.transpose()?);
            if token_text.is_some() == token_id.is_some() {
                return Err(bad(format!(
                    "{token:?}: model_token takes token or token_id, exactly one"
                )));
            }
            Ok(EmbeddingSource::ModelToken {
                model: folder(model)?,
                token: token_text,
                token_id,
            })
        }
        _ => Err(bad(format!(
            "{token:?}: source's kind must be zero or model_token"
        ))),
    }
}
