//! What a model's config.json says — the one module that reads it. A [`ModelConfig`] is read
//! once, when its folder opens (`checkpoint::ModelFolder`), and asked everything since: the
//! decoder's config (`text_config` for a multimodal model), its layer and MTP counts, which keys
//! fix the architecture and which change how the weights are used and what they mean when left
//! out ([`meaning`]), and the per-layer lists it writes or implies by its layers' index
//! ([`layers`]).

pub mod keys;
pub mod layers;
pub mod meaning;
pub mod moe;

pub use keys::{architecture_difference, is_meaning_key, ARCHITECTURE_KEYS, HARMLESS_KEYS};
pub use meaning::{config_differences, ConfigDifference};

use anyhow::{bail, Context, Result};
use serde_json::Value;
use std::path::Path;

/// The file name.
pub const CONFIG_FILE: &str = "config.json";

/// A model's config.json, read and checked: a JSON object.
#[derive(Clone, Debug, PartialEq)]
pub struct ModelConfig(Value);

impl ModelConfig {
    /// Reads `dir/config.json` as a loader needs it: a regular file (not a folder or a FIFO,
    /// which would hang the read) holding a JSON object.
    pub fn read(dir: &Path) -> Result<ModelConfig> {
        let path = dir.join(CONFIG_FILE);
        if path.symlink_metadata().is_err() {
            bail!("{} has no config.json ({})", dir.display(), path.display());
        }
        crate::checkpoint::files::check_regular_file(&path)?;
        let text = std::fs::read_to_string(&path)
            .with_context(|| format!("cannot read {}", path.display()))?;
        let config: Value = serde_json::from_str(&text)
            .with_context(|| format!("{}: invalid JSON", path.display()))?;
        if !config.is_object() {
            bail!(
                "{}: a model config must be a JSON object, not {}",
                path.display(),
                match config {
                    Value::Array(_) => "an array",
                    Value::String(_) => "a string",
                    Value::Number(_) => "a number",
                    Value::Bool(_) => "a boolean",
                    _ => "null",
                }
            );
        }
        Ok(ModelConfig(config))
    }

    /// [`Self::read`] where `dir` has a config.json (as a file, a link or anything else, which
    /// `read` then refuses), else `None`.
    pub fn read_if_present(dir: &Path) -> Result<Option<ModelConfig>> {
        match dir.join(CONFIG_FILE).symlink_metadata() {
            Ok(_) => Self::read(dir).map(Some),
            Err(_) => Ok(None),
        }
    }

    /// The whole config.
    pub fn json(&self) -> &Value {
        &self.0
    }

    /// The config that describes the decoder: a multimodal model's `text_config` when the top
    /// level has no layer count, else the top level.
    pub fn decoder(&self) -> &Value {
        crate::structure::decoder_config(&self.0)
    }

    /// The decoder's layer count.
    pub fn layer_count(&self) -> Option<usize> {
        crate::structure::layer_count(&self.0)
    }

    /// The dtype the weights are saved in, as `torch_dtype` (or current transformers' `dtype`)
    /// says; `None` where it says none rlmerge writes.
    pub fn dtype(&self) -> Option<crate::checkpoint::DType> {
        self.0["torch_dtype"]
            .as_str()
            .or(self.0["dtype"].as_str())
            .and_then(crate::checkpoint::DType::parse_user)
    }
}
