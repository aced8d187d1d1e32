//! A PEFT adapter's `adapter_config.json`: what it may hold, PEFT's defaults, and its
//! `rank_pattern` / `alpha_pattern` read as PEFT reads them.

use crate::checkpoint::files::{check_regular_file, WeightFormat, ADAPTER_CONFIG};
use anyhow::{ensure, Context, Result};
use std::path::{Path, PathBuf};

/// PEFT's default rank and alpha (`LoraConfig.r`, `LoraConfig.lora_alpha`): a config that omits
/// them means these.
const PEFT_DEFAULT_R: usize = 8;
const PEFT_DEFAULT_ALPHA: f64 = 8.0;

#[derive(serde::Deserialize)]
struct AdapterConfig {
    #[serde(default)]
    peft_type: Option<String>,
    #[serde(default = "default_r")]
    r: usize,
    #[serde(default = "default_alpha")]
    lora_alpha: f64,
    #[serde(default)]
    fan_in_fan_out: bool,
    #[serde(default)]
    use_rslora: bool,
    #[serde(default)]
    use_dora: bool,
    #[serde(default)]
    rank_pattern: Patterns<usize>,
    #[serde(default)]
    alpha_pattern: Patterns<f64>,
    /// lora_B carries a bias (`lora_B.bias`), added scaled to the base layer's bias.
    #[serde(default)]
    lora_bias: bool,
    /// PEFT features that change what the adapter computes; refused when set (JSON null reads as
    /// `None`).
    #[serde(default)]
    layer_replication: Option<serde_json::Value>,
    #[serde(default)]
    trainable_token_indices: Option<serde_json::Value>,
    #[serde(default)]
    target_parameters: Option<serde_json::Value>,
}

/// Whether `dir` is a PEFT adapter folder (an adapter config, and no full weights).
pub fn is_adapter(dir: &Path) -> bool {
    dir.join(ADAPTER_CONFIG).is_file()
        && WeightFormat::ALL
            .iter()
            .all(|f| !dir.join(f.single_file()).exists() && !dir.join(f.index_file()).exists())
}

/// The model adapter folder `dir` says it was trained on: its config's `base_model_name_or_path`
/// (a local path or a Hub id), when it names one.
pub fn trained_on(dir: &Path) -> Option<String> {
    let path = dir.join(ADAPTER_CONFIG);
    check_regular_file(&path).ok()?;
    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(path).ok()?).ok()?;
    config
        .get("base_model_name_or_path")?
        .as_str()
        .filter(|s| !s.is_empty())
        .map(str::to_string)
}

/// mergekit's `BASE+ADAPTER` reference split in two, when `reference` is not itself a path.
pub fn split_reference(reference: &str) -> Option<(&str, &str)> {
    if Path::new(reference).exists() {
        return None;
    }
    reference
        .rsplit_once('+')
        .filter(|(b, a)| !b.is_empty() && !a.is_empty())
}

fn default_r() -> usize {
    PEFT_DEFAULT_R
}

fn default_alpha() -> f64 {
    PEFT_DEFAULT_ALPHA
}

/// `rank_pattern` / `alpha_pattern`: keys in the file's order (PEFT takes the first that matches),
/// each a regular expression.
struct Patterns<T>(Vec<(String, T)>);

impl<T> Default for Patterns<T> {
    fn default() -> Self {
        Patterns(Vec::new())
    }
}

impl<'de, T: serde::Deserialize<'de>> serde::Deserialize<'de> for Patterns<T> {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct InOrder<T>(std::marker::PhantomData<T>);
        impl<'de, T: serde::Deserialize<'de>> serde::de::Visitor<'de> for InOrder<T> {
            type Value = Patterns<T>;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("an object of module patterns")
            }
            fn visit_unit<E>(self) -> Result<Self::Value, E> {
                Ok(Patterns(Vec::new()))
            }
            fn visit_map<M: serde::de::MapAccess<'de>>(
                self,
                mut map: M,
            ) -> Result<Self::Value, M::Error> {
                let mut keys = Vec::new();
                while let Some(entry) = map.next_entry::<String, T>()? {
                    keys.push(entry);
                }
                Ok(Patterns(keys))
            }
        }
        d.deserialize_any(InOrder(std::marker::PhantomData))
    }
}

impl<T> Patterns<T> {
    /// Compiles every key as PEFT uses it: the whole of `(.*\.)?(KEY)$` must match a module name
    /// (so `q_proj` matches `model.layers.0.self_attn.q_proj`, and `layers\.0\..*` a module of
    /// layer 0).
    fn compile(self, which: &str) -> Result<Vec<(regex::Regex, T)>> {
        self.0
            .into_iter()
            .map(|(key, v)| {
                let re = regex::Regex::new(&format!("^(?:.*\\.)?(?:{key})$")).map_err(|e| {
                    anyhow::anyhow!(
                        "{which} key {}: not a regular expression rlmerge can read: {e}",
                        crate::escape::terminal(&key)
                    )
                })?;
                Ok((re, v))
            })
            .collect()
    }
}

/// The value of the first pattern (in the config file's order) matching module `name`, as PEFT's
/// `get_pattern_key` picks it.
fn pattern_for<'a, T>(patterns: &'a [(regex::Regex, T)], name: &str) -> Option<&'a T> {
    patterns
        .iter()
        .find(|(re, _)| re.is_match(name))
        .map(|(_, v)| v)
}

/// What an adapter's config sets for its updates, checked.
pub(super) struct Settings {
    config_path: PathBuf,
    r: usize,
    lora_alpha: f64,
    use_rslora: bool,
    pub fan_in_fan_out: bool,
    /// `use_dora`: every module's update comes with a magnitude vector.
    use_dora: bool,
    /// `lora_bias`: each lora_B carries a bias, added (scaled) to the base's bias.
    pub lora_bias: bool,
    rank_pattern: Vec<(regex::Regex, usize)>,
    alpha_pattern: Vec<(regex::Regex, f64)>,
}

impl Settings {
    /// Reads and checks `dir`'s adapter config: a LoRA adapter of the features rlmerge merges.
    pub fn read(dir: &Path) -> Result<Settings> {
        let config_path = dir.join(ADAPTER_CONFIG);
        check_regular_file(&config_path)?;
        let text = std::fs::read_to_string(&config_path)
            .with_context(|| format!("cannot read {}", config_path.display()))?;
        let config: AdapterConfig = serde_json::from_str(&text)
            .with_context(|| format!("{}: not a LoRA adapter config", config_path.display()))?;
        let fail = |msg: String| anyhow::anyhow!("{}: {msg}", config_path.display());
        if let Some(t) = config.peft_type.as_deref().filter(|t| *t != "LORA") {
            return Err(fail(format!(
                "peft_type {t}: only LORA adapters are supported"
            )));
        }
        if config.use_dora && config.fan_in_fan_out {
            return Err(fail(
                "DoRA adapters with fan_in_fan_out (GPT-2's Conv1D layers) are not supported yet"
                    .into(),
            ));
        }
        for (key, set) in [
            ("layer_replication", config.layer_replication.is_some()),
            (
                "trainable_token_indices",
                config.trainable_token_indices.is_some(),
            ),
            ("target_parameters", config.target_parameters.is_some()),
        ] {
            if set {
                return Err(fail(format!("adapters with {key} are not supported yet")));
            }
        }
        ensure!(config.r > 0, fail("r must be at least 1".into()));
        ensure!(
            config.lora_alpha.is_finite(),
            fail(format!(
                "lora_alpha must be finite, got {}",
                config.lora_alpha
            ))
        );
        let rank_pattern = config
            .rank_pattern
            .compile("rank_pattern")
            .map_err(|e| fail(e.to_string()))?;
        let alpha_pattern = config
            .alpha_pattern
            .compile("alpha_pattern")
            .map_err(|e| fail(e.to_string()))?;
        Ok(Settings {
            r: config.r,
            lora_alpha: config.lora_alpha,
            use_rslora: config.use_rslora,
            fan_in_fan_out: config.fan_in_fan_out,
            use_dora: config.use_dora,
            lora_bias: config.lora_bias,
            rank_pattern,
            alpha_pattern,
            config_path,
        })
    }

    /// DoRA's magnitude vector of `module` in adapter file `file`, checked against the config: a
    /// DoRA adapter has one for each module, on linear layers only (PEFT's DoRA on an embedding
    /// normalizes another axis, not supported yet); a plain LoRA adapter has none.
    pub fn check_dora(
        &self,
        module: &str,
        tensors: &super::ModuleTensors,
        file: &Path,
    ) -> Result<Option<super::TensorEntry>> {
        let file = file.display();
        match (&tensors.magnitude, self.use_dora) {
            (None, false) => Ok(None),
            (Some(m), false) => anyhow::bail!(
                "{file}: tensor '{}' is a DoRA magnitude vector, but {} does not set use_dora",
                crate::escape::terminal(&m.name),
                self.config_path.display()
            ),
            (None, true) => anyhow::bail!(
                "{file}: module '{}' has no lora_magnitude_vector, which a DoRA adapter \
                 (use_dora) has for every module",
                crate::escape::terminal(module)
            ),
            (Some(_), true) if tensors.embedding => anyhow::bail!(
                "{file}: module '{}': DoRA on embedding layers is not supported yet",
                crate::escape::terminal(module)
            ),
            (Some(m), true) => Ok(Some(m.clone())),
        }
    }

    /// Module `module`'s rank and scale s = alpha / r (rsLoRA: alpha / √r), each from the first
    /// pattern matching it or else the config's `r` / `lora_alpha`.
    pub fn rank_and_scale(&self, module: &str) -> Result<(usize, f32)> {
        let rank = *pattern_for(&self.rank_pattern, module).unwrap_or(&self.r);
        ensure!(
            rank >= 1,
            "{}: module '{module}' has rank 0; a LoRA rank is at least 1",
            self.config_path.display()
        );
        let alpha = *pattern_for(&self.alpha_pattern, module).unwrap_or(&self.lora_alpha);
        let scale = if self.use_rslora {
            alpha / (rank as f64).sqrt()
        } else {
            alpha / rank as f64
        };
        // The scale is a parameter of the merge: one that is not a finite f32 would turn every
        // element the update touches into ±Inf or NaN.
        ensure!(
            (scale as f32).is_finite(),
            "{}: module '{module}': the scale lora_alpha / r = {alpha} / {rank} is not a finite \
             32-bit number",
            self.config_path.display()
        );
        Ok((rank, scale as f32))
    }
}
