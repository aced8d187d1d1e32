//! A merge job: the one place a method name and its parameters — from command-line flags or from a
//! mergekit YAML recipe (`job/recipe_yaml/`) — become a validated [`Method`] with its input folders.
//! Both go through [`crate::method::build`], so a value accepted by one is accepted by the other.

mod recipe_yaml;

use crate::checkpoint::DType;
use crate::error::usage;
use crate::method::build::MethodRequest;
use crate::method::settings::{Scalar, Setting, Settings};
use crate::method::{BoostScope, Kind, Method, SharedRule};
use anyhow::{Context, Result};
use std::path::{Path, PathBuf};

/// The file rlmerge saves the recipe under in the output folder, as mergekit does.
pub const MERGEKIT_CONFIG_FILE: &str = "mergekit_config.yml";

/// A merge to run: the folders, resolved, and the method, validated.
#[derive(Debug)]
pub struct Job {
    /// The base model's folder (a Hub id resolved to its cache snapshot).
    pub base: PathBuf,
    /// The agents' folders, in order (a LoRA agent as `BASE+ADAPTER` or its adapter folder).
    pub agents: Vec<PathBuf>,
    /// The method, validated for this many agents.
    pub method: Method,
    /// RAM's ε when the recipe sets it.
    pub epsilon: Option<f32>,
    /// The recipe's `out_dtype` (or mergekit's older `dtype`).
    pub out_dtype: Option<DType>,
    /// The recipe's text, saved beside the merged weights as [`MERGEKIT_CONFIG_FILE`] (empty:
    /// the job came from flags).
    pub recipe_text: String,
    /// The recipe file it came from (an output must not overwrite it).
    pub recipe_path: Option<PathBuf>,
    /// mergekit's `slices`, when the recipe selects layers.
    pub slices: Option<crate::slices::Slices>,
    /// mergekit's `tokenizer_source` / `tokenizer:` section (`None`: the base's tokenizer, every
    /// model's embeddings of the base's shape).
    pub tokenizer: Option<crate::vocabulary::TokenizerSettings>,
    /// SVC's α, when the merge is spectrally calibrated (`--svc`, a recipe's `svc:`; SPEC §4e).
    pub svc: Option<f64>,
    /// The agents' names, by agent, where the recipe's `name:` gives one (`--name` for flags).
    pub names: Vec<Option<String>>,
    /// Whose config.json the output takes, as the user named it (`--config-from`, a recipe's
    /// `config_from:`): `base`, an agent's folder as given, or its name.
    pub config_from: Option<String>,
}

impl Job {
    /// [`Job::config_from`] as the merge takes it: `base`, or the agent it names among `agents`
    /// (folders as given, or their names); anything else is a usage error listing the choices.
    pub fn config_source(&self) -> Result<Option<crate::engine::ConfigFrom>> {
        use crate::engine::ConfigFrom;
        let Some(text) = self.config_from.as_deref() else {
            return Ok(None);
        };
        if text == "base" {
            return Ok(Some(ConfigFrom::Base));
        }
        let real = |p: &Path| std::fs::canonicalize(p).ok();
        let found = self.agents.iter().enumerate().position(|(t, a)| {
            a.as_os_str() == text
                || self.names.get(t).and_then(|n| n.as_deref()) == Some(text)
                || real(a).is_some() && real(a) == real(Path::new(text))
        });
        match found {
            Some(t) => Ok(Some(ConfigFrom::Agent(t))),
            None => Err(usage(format!(
                "config_from '{text}' is neither base nor one of the agents merged ({})",
                self.agents
                    .iter()
                    .map(|a| a.display().to_string())
                    .collect::<Vec<_>>()
                    .join(", ")
            ))),
        }
    }
}

/// The method as command-line flags give it: `--method`, `--param KEY=VALUE` (see
/// [`parse_param`]) and RAM+'s own flags, which are parameters under other names.
#[derive(Clone, Debug, Default)]
pub struct MethodFlags {
    /// `None`: RAM+, the default method.
    pub method: Option<Kind>,
    /// `--param KEY=VALUE`, for every model.
    pub params: Vec<(String, Setting)>,
    /// RAM+'s boost rule (`--rule`: paper or official).
    pub rule: Option<String>,
    /// RAM+'s scope of ρ (`--scope`).
    pub scope: Option<BoostScope>,
    /// RAM+ paper rule's r (`--r`).
    pub r: Option<f64>,
    /// RAM+ paper rule's cap α on ρ (`--alpha`).
    pub alpha: Option<f64>,
    /// RAM+ official rule's R (`--rescale-factor`).
    pub rescale_factor: Option<f64>,
    /// The RAM family's shared-region rule (`--shared`).
    pub shared: Option<SharedRule>,
    /// Seed of random masks (DARE, DELLA).
    pub seed: u64,
    /// `--svc ALPHA`: SVC's α, as given (checked by [`MethodFlags::svc_alpha`]).
    pub svc: Option<Scalar>,
    /// `--epsilon`, when it is not the default: only for the recipe the flags are saved as (the
    /// passes take ε from the compute options).
    pub epsilon: Option<f64>,
    /// `--tokenizer-source` as given: only for the recipe the flags are saved as.
    pub tokenizer_source: Option<String>,
    /// `--name`s, by agent in order.
    pub names: Vec<String>,
    /// `--config-from`: whose config.json the output takes.
    pub config_from: Option<String>,
}

impl Job {
    /// A job from `--base`, `--model`s and the method flags. Methods without θ₀ (linear,
    /// passthrough) merge the models; the base then only gives the layout and the config files.
    pub fn from_flags(base: PathBuf, agents: Vec<PathBuf>, flags: &MethodFlags) -> Result<Job> {
        let method = flags.method_for(agents.len())?;
        // Every merge gets the recipe that makes it again, saved and shown in the model card as
        // mergekit's own merges are.
        let recipe_text = flags.recipe(&base, &agents)?;
        Ok(Job {
            base,
            agents,
            method,
            epsilon: None,
            out_dtype: None,
            recipe_text,
            recipe_path: None,
            slices: None,
            tokenizer: None,
            svc: flags.svc_alpha()?,
            names: flags.names.iter().cloned().map(Some).collect(),
            config_from: flags.config_from.clone(),
        })
    }

    /// A job from a mergekit YAML recipe; its model names are local folders, as written or beside
    /// the recipe.
    pub fn from_recipe(path: &Path, seed: u64) -> Result<Job> {
        recipe_yaml::read(path, seed)
    }

    /// A job from a recipe made in memory, as a YAML value with a file's keys (the Python API's
    /// keywords): the same checks as [`Job::from_recipe`], messages naming keys but no lines, and
    /// serde_yaml's text of it saved with the merge. Model paths resolve against the working
    /// directory.
    pub fn from_recipe_value(value: serde_yaml::Value, seed: u64) -> Result<Job> {
        recipe_yaml::from_value(value, seed)
    }
}

impl MethodFlags {
    /// The method with its parameters for `agents` merged models: the flags and `--param`s turned
    /// into one request for [`crate::method::build`], which validates it as it does recipes.
    /// These flags as a mergekit recipe over `base` and `agents`: `merge_method`, the
    /// parameters as method-wide `parameters` (mergekit applies them to every model), the models.
    /// `rlmerge run` of it (with the same `--seed`) makes the same merge.
    /// A value that cannot be written as YAML fails the job rather than saving an empty recipe.
    pub fn recipe(&self, base: &Path, agents: &[PathBuf]) -> Result<String> {
        use serde_yaml::{Mapping, Value};
        let path = |p: &Path| Value::String(p.to_string_lossy().into_owned());
        let mut recipe = Mapping::new();
        let kind = self.method.unwrap_or(Kind::RamPlus);
        recipe.insert("merge_method".into(), kind.name().into());
        recipe.insert("base_model".into(), path(base));
        let mut settings = self.method_wide()?;
        let ram_family = kind.is_ram_family();
        if let Some(e) = self.epsilon.filter(|_| ram_family) {
            settings.insert("epsilon".into(), Setting::Scalar(Scalar::Number(e)));
        }
        if !settings.is_empty() {
            let mut parameters = Mapping::new();
            for (key, value) in &settings {
                let value = serde_yaml::to_value(value).with_context(|| {
                    format!("cannot write parameter '{key}' into the merge's recipe")
                })?;
                parameters.insert(key.as_str().into(), value);
            }
            recipe.insert("parameters".into(), Value::Mapping(parameters));
        }
        if let Some(source) = &self.tokenizer_source {
            recipe.insert("tokenizer_source".into(), source.as_str().into());
        }
        if let Some(source) = &self.config_from {
            recipe.insert("config_from".into(), source.as_str().into());
        }
        let models = agents
            .iter()
            .enumerate()
            .map(|(t, a)| {
                let mut entry = Mapping::from_iter([("model".into(), path(a))]);
                if let Some(name) = self.names.get(t) {
                    entry.insert("name".into(), name.as_str().into());
                }
                Value::Mapping(entry)
            })
            .collect();
        recipe.insert("models".into(), Value::Sequence(models));
        if let Some(alpha) = self.svc_alpha().ok().flatten() {
            let svc = Mapping::from_iter([("alpha".into(), alpha.into())]);
            recipe.insert("svc".into(), Value::Mapping(svc));
        }
        let yaml =
            serde_yaml::to_string(&recipe).context("cannot write the merge's recipe as YAML")?;
        // Random masks (DARE, DELLA) depend on the seed.
        let seeded = matches!(
            kind,
            Kind::DareLinear | Kind::DareTies | Kind::Della | Kind::DellaLinear
        );
        let seed = if seeded {
            format!(" --seed {}", self.seed)
        } else {
            String::new()
        };
        Ok(format!(
            "# Written by rlmerge from its command line: `rlmerge run` of this file{seed} makes \
             the same merge.\n{yaml}"
        ))
    }

    /// SVC's α from `--svc`, checked (`None`: no calibration).
    pub fn svc_alpha(&self) -> Result<Option<f64>> {
        self.svc
            .as_ref()
            .map(crate::method::build::svc_alpha)
            .transpose()
    }

    /// The method-wide parameters the flags set: every `--param`, and RAM+'s own flags under
    /// their parameter names; each given once.
    fn method_wide(&self) -> Result<Settings> {
        let kind = self.method.unwrap_or(Kind::RamPlus);
        let boost_flags = [
            ("--rule", "rule", self.rule.clone().map(Scalar::Text)),
            (
                "--scope",
                "scope",
                self.scope.map(|s| Scalar::Text(s.name().into())),
            ),
            ("--r", "r", self.r.map(Scalar::Number)),
            ("--alpha", "alpha", self.alpha.map(Scalar::Number)),
            (
                "--rescale-factor",
                "rescale_factor",
                self.rescale_factor.map(Scalar::Number),
            ),
        ];
        let set_flag = boost_flags.iter().find(|(_, _, v)| v.is_some());
        if let Some((flag, _, _)) = set_flag {
            if kind != Kind::RamPlus {
                return Err(usage(format!(
                    "{flag} applies to --method ram+ only{}",
                    if kind == Kind::RamplusTl {
                        " (ramplus_tl is the paper rule in tensor scope; use --method ram+ to choose)"
                    } else {
                        ""
                    }
                )));
            }
        }
        let ram_family = kind.is_ram_family();
        if self.shared.is_some() && !ram_family {
            return Err(usage(
                "--shared applies to the RAM family only (--method ram, ram+ or ramplus_tl)",
            ));
        }
        let shared_flag = (
            "--shared",
            "shared",
            self.shared.map(|s| Scalar::Text(s.name().into())),
        );
        let mut method_wide = Settings::new();
        for (key, value) in &self.params {
            if method_wide.insert(key.clone(), value.clone()).is_some() {
                return Err(usage(format!(
                    "--param {key} is given twice; give each parameter once"
                )));
            }
        }
        for (flag, key, value) in boost_flags.into_iter().chain([shared_flag]) {
            if let Some(v) = value {
                if method_wide.insert(key.into(), Setting::Scalar(v)).is_some() {
                    return Err(usage(format!(
                        "{flag} and --param {key} both set {key}; give it once"
                    )));
                }
            }
        }
        Ok(method_wide)
    }

    /// The method these flags ask for `agents` merged models, validated as a recipe's is.
    pub fn method_for(&self, agents: usize) -> Result<Method> {
        let kind = self.method.unwrap_or(Kind::RamPlus);
        let method_wide = self.method_wide()?;
        let request = MethodRequest {
            kind,
            method_wide,
            models: vec![Default::default(); agents],
            seed: self.seed,
            with_base: true,
            slices: Vec::new(),
        };
        crate::method::build::build(request, agents)
    }
}

/// A `KEY=VALUE` CLI parameter as a setting ([`parse_scalar`]'s value).
pub fn parse_param(kv: &str) -> Result<(String, Setting), String> {
    let (k, v) = kv
        .split_once('=')
        .ok_or_else(|| format!("'{kv}': expected KEY=VALUE"))?;
    Ok((k.trim().to_string(), Setting::Scalar(parse_scalar(v))))
}

/// A value given on the command line: a number, true/false, else text (checked later against
/// the parameter's range).
pub fn parse_scalar(v: &str) -> Scalar {
    let v = v.trim();
    match v {
        "true" => Scalar::Bool(true),
        "false" => Scalar::Bool(false),
        _ => match v.parse::<f64>() {
            Ok(x) => Scalar::Number(x),
            Err(_) => Scalar::Text(v.to_string()),
        },
    }
}

/// An output dtype as a user writes it (bf16, bfloat16, f16, float16, half, f32, float32, float).
pub fn parse_dtype(s: &str) -> Result<DType, String> {
    DType::parse_user(s).ok_or_else(|| format!("unknown dtype '{s}' (use bf16, f16 or f32)"))
}
