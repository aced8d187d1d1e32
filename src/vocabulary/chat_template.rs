//! A recipe's `chat_template` (mergekit's key): a template by name, a Jinja template as written, or
//! `auto` — the template most of the input models have — written into the output's
//! tokenizer_config.json (and its chat_template.jinja, where the base ships one). The named
//! templates are rlmerge's own Jinja for the formats mergekit names (chatml, llama3, alpaca,
//! exaone).

use crate::error::usage;
use anyhow::{Context, Result};
use std::path::Path;

/// The templates known by name, with their Jinja text.
const NAMED: [(&str, &str); 4] = [
    ("alpaca", include_str!("chat_templates/alpaca.jinja")),
    ("chatml", include_str!("chat_templates/chatml.jinja")),
    ("exaone", include_str!("chat_templates/exaone.jinja")),
    ("llama3", include_str!("chat_templates/llama3.jinja")),
];

/// The file beside tokenizer_config.json that newer transformers save a template in (and read
/// before the config's key).
const JINJA_FILE: &str = "chat_template.jinja";

/// What a recipe's `chat_template` asks for.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ChatTemplate {
    /// This Jinja text: a named template's, or one written in the recipe.
    Jinja(String),
    /// The template most of the input models carry (the first of equals, base first).
    Auto,
}

impl ChatTemplate {
    /// Reads a recipe's value as mergekit does: `auto`, a known name, else a Jinja template (with
    /// a `{` and at least 20 characters); anything else is a usage error naming the choices.
    pub fn parse(text: &str) -> Result<ChatTemplate> {
        if text == "auto" {
            return Ok(ChatTemplate::Auto);
        }
        if let Some((_, jinja)) = NAMED.iter().find(|(name, _)| *name == text) {
            return Ok(ChatTemplate::Jinja(jinja.trim_end().to_string()));
        }
        if text.chars().count() >= 20 && text.contains('{') {
            return Ok(ChatTemplate::Jinja(text.to_string()));
        }
        let names: Vec<&str> = NAMED.iter().map(|(n, _)| *n).collect();
        Err(usage(format!(
            "chat_template '{}' is not a template: give a name ({}), auto (the inputs' most \
             common template), or a Jinja template",
            crate::escape::terminal(text),
            names.join(", ")
        )))
    }

    /// The Jinja text to write for a merge of the models in `folders` (base first); `None` where
    /// `auto` finds no template among them.
    pub fn resolve(&self, folders: &[&Path]) -> Result<Option<String>> {
        match self {
            ChatTemplate::Jinja(t) => Ok(Some(t.clone())),
            ChatTemplate::Auto => {
                let mut seen: Vec<(String, usize)> = Vec::new();
                for folder in folders {
                    if let Some(t) = template_of(folder)? {
                        match seen.iter_mut().find(|(s, _)| *s == t) {
                            Some((_, n)) => *n += 1,
                            None => seen.push((t, 1)),
                        }
                    }
                }
                let most = seen.iter().map(|(_, n)| *n).max();
                Ok(seen
                    .into_iter()
                    .find(|(_, n)| Some(*n) == most)
                    .map(|(t, _)| t))
            }
        }
    }
}

/// The chat template of the model in `folder`: its chat_template.jinja, else tokenizer_config.json's
/// `chat_template` (a string, or the `default` of a list of named ones), trimmed; `None` where it
/// has none.
fn template_of(folder: &Path) -> Result<Option<String>> {
    let jinja = folder.join(JINJA_FILE);
    if jinja.is_file() {
        let text = std::fs::read_to_string(&jinja)
            .with_context(|| format!("cannot read {}", jinja.display()))?;
        return Ok(Some(text.trim().to_string()));
    }
    let config = folder.join("tokenizer_config.json");
    if !config.is_file() {
        return Ok(None);
    }
    let text = std::fs::read_to_string(&config)
        .with_context(|| format!("cannot read {}", config.display()))?;
    let json: serde_json::Value = serde_json::from_str(&text)
        .with_context(|| format!("{}: invalid JSON", config.display()))?;
    let template = match &json["chat_template"] {
        serde_json::Value::String(s) => Some(s.clone()),
        serde_json::Value::Array(named) => named
            .iter()
            .find(|t| t["name"] == "default")
            .and_then(|t| t["template"].as_str())
            .map(str::to_string),
        _ => None,
    };
    Ok(template
        .map(|t| t.trim().to_string())
        .filter(|t| !t.is_empty()))
}

/// Writes `template` into the tokenizer files of the output folder `out`: tokenizer_config.json's
/// `chat_template`, and chat_template.jinja where the output has one (transformers reads it
/// first). A warning where the output has no tokenizer_config.json to hold it.
pub fn write_into(out: &Path, template: &str) -> Result<Option<String>> {
    let config = out.join("tokenizer_config.json");
    if !config.is_file() {
        return Ok(Some(
            "chat_template: the output has no tokenizer_config.json (the base ships no \
             tokenizer), so the template is not written"
                .into(),
        ));
    }
    let text = std::fs::read_to_string(&config)
        .with_context(|| format!("cannot read {}", config.display()))?;
    let mut json: serde_json::Value = serde_json::from_str(&text)
        .with_context(|| format!("{}: invalid JSON", config.display()))?;
    let map = json
        .as_object_mut()
        .with_context(|| format!("{}: not a JSON object", config.display()))?;
    map.insert("chat_template".into(), template.into());
    std::fs::write(&config, serde_json::to_string_pretty(&json)? + "\n")
        .with_context(|| format!("cannot write {}", config.display()))?;
    let jinja = out.join(JINJA_FILE);
    if jinja.is_file() {
        std::fs::write(&jinja, template)
            .with_context(|| format!("cannot write {}", jinja.display()))?;
    }
    Ok(None)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_jinja_and_auto_are_read_as_mergekit_reads_them() {
        let chatml = ChatTemplate::parse("chatml").unwrap();
        assert!(matches!(&chatml, ChatTemplate::Jinja(t) if t.contains("<|im_start|>")));
        assert_eq!(ChatTemplate::parse("auto").unwrap(), ChatTemplate::Auto);
        let own = "{{ messages[0]['content'] }} and more";
        assert_eq!(
            ChatTemplate::parse(own).unwrap(),
            ChatTemplate::Jinja(own.into())
        );
        for bad in ["chatm", "{x}", "vicuna"] {
            let e = ChatTemplate::parse(bad).unwrap_err().to_string();
            assert!(
                e.contains("chatml, exaone, llama3") || e.contains("alpaca"),
                "{e}"
            );
        }
    }

    #[test]
    fn auto_takes_the_most_common_template_base_first() {
        let dir = tempfile::tempdir().unwrap();
        let model = |name: &str, template: Option<&str>| {
            let d = dir.path().join(name);
            std::fs::create_dir(&d).unwrap();
            let json = match template {
                Some(t) => serde_json::json!({"chat_template": t}),
                None => serde_json::json!({}),
            };
            std::fs::write(d.join("tokenizer_config.json"), json.to_string()).unwrap();
            d
        };
        let (a, b, c, n) = (
            model("a", Some("A {x}")),
            model("b", Some("B {y}\n")),
            model("c", Some("B {y}")),
            model("n", None),
        );
        let auto = ChatTemplate::Auto;
        let got = auto.resolve(&[&a, &b, &c, &n]).unwrap();
        assert_eq!(got.as_deref(), Some("B {y}"));
        assert_eq!(auto.resolve(&[&a, &n]).unwrap().as_deref(), Some("A {x}"));
        assert_eq!(auto.resolve(&[&n]).unwrap(), None);
    }
}
