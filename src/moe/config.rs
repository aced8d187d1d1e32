//! mergekit-moe's YAML config (`base_model`, `experts` with `source_model` and prompts,
//! `gate_mode`, `dtype`, `experts_per_token`, `shared_experts`, `architecture`), read and checked
//! here once, whichever front end gave it: a file (the command line, Python's path) or a value
//! made in memory (Python's dict). Keys mergekit does not know are refused by name (mergekit
//! drops them unsaid), except rlmerge's own `seed`, which mergekit ignores.

use crate::checkpoint::DType;
use crate::error::usage;
use anyhow::{Context, Result};
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

/// How the routers are made (mergekit's `gate_mode`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum GateMode {
    /// Each expert's router row: the normalized sum of its positive prompts' token embeddings,
    /// less its negative prompts', normalized again; the same for every layer.
    CheapEmbed,
    /// Standard normal values, a row per expert and layer.
    Random,
    /// Uniform in ±1/√hidden (torch's default for a linear layer's weight).
    UniformRandom,
}

impl GateMode {
    /// mergekit's name.
    pub fn name(self) -> &'static str {
        match self {
            GateMode::CheapEmbed => "cheap_embed",
            GateMode::Random => "random",
            GateMode::UniformRandom => "uniform_random",
        }
    }

    /// Whether the routers come from prompts.
    pub fn uses_prompts(self) -> bool {
        self == GateMode::CheapEmbed
    }
}

/// One expert (or shared expert): the model whose MLPs it takes, and what it is for.
#[derive(Clone, Debug, Serialize)]
pub struct Expert {
    /// The reference as written (saved and shown).
    pub reference: String,
    /// The folder it names (`BASE+ADAPTER` for a LoRA expert on another base).
    #[serde(skip)]
    pub folder: PathBuf,
    /// Prompts routed to it.
    pub positive_prompts: Vec<String>,
    /// Prompts routed away from it.
    pub negative_prompts: Vec<String>,
    /// Standard deviation of the normal noise added to its MLP weights.
    pub noise_scale: Option<f32>,
    /// Factor on its `down_proj` (its residual contribution).
    pub residual_scale: Option<f32>,
}

/// A checked MoE config.
#[derive(Clone, Debug)]
pub struct MoeConfig {
    /// The model the attention, embeddings and norms come from, and the prompts' tokenizer.
    pub base: PathBuf,
    /// `base_model` as written.
    pub base_reference: String,
    /// The routed experts, in order.
    pub experts: Vec<Expert>,
    /// Experts every token goes through (Qwen2-MoE's one shared expert).
    pub shared_experts: Vec<Expert>,
    /// How the routers are made.
    pub gate_mode: GateMode,
    /// The output dtype (`None`: the base's).
    pub dtype: Option<DType>,
    /// Experts each token goes through.
    pub experts_per_token: usize,
    /// `architecture` as written (`None`: the first that fits, Mixtral before the others).
    pub architecture: Option<String>,
    /// The seed of random routers and noise.
    pub seed: u64,
    /// All experts may be one model (mergekit's `--i-understand-this-is-not-useful-without-training`).
    pub allow_all_same: bool,
    /// The earlier stages of a multi-stage recipe it names (name, folder): saved by name.
    pub stages: Vec<(String, PathBuf)>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawConfig {
    base_model: String,
    experts: Vec<RawExpert>,
    #[serde(default)]
    gate_mode: Option<String>,
    #[serde(default)]
    dtype: Option<String>,
    #[serde(default)]
    experts_per_token: Option<i64>,
    #[serde(default)]
    shared_experts: Option<Vec<RawExpert>>,
    #[serde(default)]
    architecture: Option<String>,
    #[serde(default)]
    seed: Option<u64>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawExpert {
    source_model: String,
    #[serde(default)]
    positive_prompts: Option<Vec<String>>,
    #[serde(default)]
    negative_prompts: Option<Vec<String>>,
    #[serde(default)]
    noise_scale: Option<f64>,
    #[serde(default)]
    residual_scale: Option<f64>,
}

/// The gate modes that run the model on the prompts (mergekit's `hidden` and its variants).
const FORWARD_MODES: [&str; 3] = ["hidden", "hidden_avg", "hidden_last"];

/// Reads the config file at `path` (one YAML document); model references resolve against the
/// working directory, then the file's folder. `seed` (the command line's) overrides the file's.
pub fn read(path: &Path, seed: Option<u64>, allow_all_same: bool) -> Result<MoeConfig> {
    crate::checkpoint::files::check_regular_file(path)
        .with_context(|| format!("cannot read MoE config {}", path.display()))?;
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("cannot read MoE config {}", path.display()))?;
    let text = text.strip_prefix('\u{feff}').unwrap_or(&text);
    let value: serde_yaml::Value = serde_yaml::from_str(text)
        .map_err(|e| usage(format!("MoE config {}: {e}", path.display())))?;
    let dir = path.parent().unwrap_or(Path::new("."));
    from_value(value, dir, (seed, allow_all_same), &[])
        .with_context(|| format!("MoE config {}", path.display()))
}

/// A config as a YAML value (Python's dict, a file's text parsed, a multi-stage recipe's final
/// document); references resolve to the earlier stages `made` (name, folder) by name, else
/// against the working directory, then `dir`.
pub fn from_value(
    value: serde_yaml::Value,
    dir: &Path,
    (seed, allow_all_same): (Option<u64>, bool),
    made: &[(String, PathBuf)],
) -> Result<MoeConfig> {
    let raw: RawConfig = serde_yaml::from_value(value).map_err(|e| usage(e.to_string()))?;
    let gate_mode = gate_mode(raw.gate_mode.as_deref())?;
    let dtype = match &raw.dtype {
        None => None,
        Some(d) => Some(DType::parse_user(d).ok_or_else(|| {
            usage(format!(
                "dtype: unknown dtype '{d}' (use bfloat16, float16 or float32)"
            ))
        })?),
    };
    let experts_per_token = match raw.experts_per_token {
        None => 2,
        Some(k) if k >= 1 => k as usize,
        Some(k) => return Err(usage(format!("experts_per_token must be ≥ 1, got {k}"))),
    };
    // A stage's name wins over a folder of that name, as in a multi-stage merge recipe.
    let resolve = |reference: &str| -> Result<PathBuf> {
        match made.iter().find(|(name, _)| name == reference) {
            Some((_, folder)) => Ok(folder.clone()),
            None => crate::job::find_model(reference, dir),
        }
    };
    let expert = |i: usize, e: RawExpert, list: &str| -> Result<Expert> {
        let what = format!("{list}[{i}] ({})", e.source_model);
        let scale = |key: &str, v: Option<f64>, least: f64| -> Result<Option<f32>> {
            match v {
                Some(x) if !(x.is_finite() && x >= least && x.abs() < 1e30) => Err(usage(format!(
                    "{what}: {key} must be a finite number ≥ {least}, got {x}"
                ))),
                v => Ok(v.map(|x| x as f32)),
            }
        };
        Ok(Expert {
            folder: resolve(&e.source_model)
                .with_context(|| format!("{list}[{i}]: source_model"))?,
            noise_scale: scale("noise_scale", e.noise_scale, 0.0)?,
            residual_scale: scale("residual_scale", e.residual_scale, f64::MIN)?,
            reference: e.source_model,
            positive_prompts: e.positive_prompts.unwrap_or_default(),
            negative_prompts: e.negative_prompts.unwrap_or_default(),
        })
    };
    let experts = raw
        .experts
        .into_iter()
        .enumerate()
        .map(|(i, e)| expert(i, e, "experts"))
        .collect::<Result<Vec<_>>>()?;
    let shared_experts = raw
        .shared_experts
        .unwrap_or_default()
        .into_iter()
        .enumerate()
        .map(|(i, e)| expert(i, e, "shared_experts"))
        .collect::<Result<Vec<_>>>()?;
    let config = MoeConfig {
        base: resolve(&raw.base_model).context("base_model")?,
        base_reference: raw.base_model,
        experts,
        shared_experts,
        gate_mode,
        dtype,
        experts_per_token,
        architecture: raw.architecture,
        seed: seed.or(raw.seed).unwrap_or(0),
        allow_all_same,
        stages: made.to_vec(),
    };
    config.check()?;
    Ok(config)
}

/// `gate_mode` (mergekit's default, `hidden`, where none is given).
fn gate_mode(name: Option<&str>) -> Result<GateMode> {
    match name.unwrap_or("hidden") {
        "cheap_embed" => Ok(GateMode::CheapEmbed),
        "random" => Ok(GateMode::Random),
        "uniform_random" => Ok(GateMode::UniformRandom),
        m if FORWARD_MODES.contains(&m) => Err(usage(format!(
            "gate_mode '{m}'{} runs the base model on the prompts to take its hidden states — \
             a forward pass, which rlmerge does not do: write `gate_mode: cheap_embed` (the \
             prompts' average token embedding, the same for every layer) or `random`, or build \
             this config with mergekit-moe",
            if name.is_none() {
                " (mergekit's default: the config names none)"
            } else {
                ""
            }
        ))),
        m => Err(usage(format!(
            "unknown gate_mode '{m}' (cheap_embed, random, uniform_random; hidden needs \
             mergekit-moe){}",
            crate::error::did_you_mean(m, ["cheap_embed", "random", "uniform_random"])
        ))),
    }
}

impl MoeConfig {
    /// What no type says: experts to route to, prompts where the routers need them — not the
    /// same for every expert — and experts that are not all one model.
    fn check(&self) -> Result<()> {
        if self.experts.is_empty() {
            return Err(usage("experts: a MoE needs at least one expert"));
        }
        if self.experts.len() < self.experts_per_token {
            return Err(usage(format!(
                "experts_per_token is {}, but there are {} experts: each token needs that many",
                self.experts_per_token,
                self.experts.len()
            )));
        }
        if self.gate_mode.uses_prompts() {
            self.check_prompts()?;
        }
        let first = &self.experts[0].folder;
        let all_same = self.experts.iter().all(|e| same_model(&e.folder, first));
        if !self.allow_all_same && self.experts.len() > 1 && all_same {
            return Err(usage(
                "every expert is the same model: the MoE would compute what that one model \
                 computes at several times the cost; to train it further, pass \
                 --allow-all-same (mergekit's --i-understand-this-is-not-useful-without-training)",
            ));
        }
        Ok(())
    }

    /// Every expert and shared expert has positive prompts (none empty), and the
    /// experts' prompts are not all the same.
    fn check_prompts(&self) -> Result<()> {
        for (list, experts) in [
            ("experts", &self.experts),
            ("shared_experts", &self.shared_experts),
        ] {
            for (i, e) in experts.iter().enumerate() {
                if e.positive_prompts.is_empty() {
                    return Err(usage(format!(
                        "{list}[{i}] ({}) has no positive_prompts: gate_mode {} makes its router \
                         from them",
                        e.reference,
                        self.gate_mode.name()
                    )));
                }
                if let Some(p) = e
                    .positive_prompts
                    .iter()
                    .chain(&e.negative_prompts)
                    .find(|p| p.trim().is_empty())
                {
                    return Err(usage(format!(
                        "{list}[{i}] ({}) has an empty prompt ({p:?}): it has no tokens to route by",
                        e.reference
                    )));
                }
            }
        }
        let prompts = |e: &Expert| (e.positive_prompts.clone(), e.negative_prompts.clone());
        let first = prompts(&self.experts[0]);
        if self.experts.len() > 1 && self.experts.iter().all(|e| prompts(e) == first) {
            return Err(usage(
                "every expert has the same prompts: their routers would be the same and route \
                 every token alike; give each expert prompts of what it is for",
            ));
        }
        Ok(())
    }
}

/// Whether two references name the same model (the same folders, resolved).
pub fn same_model(a: &Path, b: &Path) -> bool {
    let parts = |p: &Path| -> Vec<PathBuf> {
        let text = p.to_string_lossy();
        match crate::checkpoint::lora::split_reference(&text) {
            Some((b, a)) => vec![PathBuf::from(b), PathBuf::from(a)],
            None => vec![p.to_path_buf()],
        }
        .into_iter()
        .map(|p| std::fs::canonicalize(&p).unwrap_or(p))
        .collect()
    };
    parts(a) == parts(b)
}
