//! A merge job: the one place a method name and its parameters — from command-line flags or from a
//! mergekit YAML recipe (`job/recipe_yaml/`) — become a validated [`Method`] with its input folders.
//! Both go through [`crate::method::build`], so a value accepted by one is accepted by the other.

mod from_record;
mod recipe_yaml;
/// A recipe's model reference as a folder (as written, beside the recipe, `BASE+ADAPTER`, a Hub
/// id): what `rlmerge moe`'s config names its models by too.
pub(crate) use recipe_yaml::local_folder as find_model;
pub mod saved_recipe;
pub mod stages;

use crate::checkpoint::DType;
use crate::error::usage;
use crate::method::build::MethodRequest;
use crate::method::settings::{Scalar, Setting, Settings};
use crate::method::{BoostScope, Kind, Merging, Method, SharedRule};
use anyhow::{Context, Result};
use std::path::{Path, PathBuf};

/// A merge to run: the folders, resolved, and the method, validated.
#[derive(Debug)]
pub struct Job {
    /// The base model's folder (a Hub id resolved to its cache snapshot).
    pub base: PathBuf,
    /// The agents' folders, in order (a LoRA agent as `BASE+ADAPTER` or its adapter folder).
    pub agents: Vec<PathBuf>,
    /// The method, validated for this many agents, and SVC's calibration where asked.
    pub merging: Merging,
    /// RAM's ε when the recipe sets it.
    pub epsilon: Option<f32>,
    /// The recipe's `out_dtype` (or mergekit's older `dtype`).
    pub out_dtype: Option<DType>,
    /// The largest output shard, where the recipe (`shard_size:`) or the command line sets it.
    pub shard_size: Option<u64>,
    /// NaN and ±Inf inputs merged by IEEE rules (`--allow-nonfinite`, a recipe's
    /// `allow_nonfinite:`).
    pub allow_nonfinite: bool,
    /// Tensors some models lack merged from those that have them (`--allow-missing-tensors`).
    pub allow_missing_tensors: bool,
    /// Agents' F32 weights read as stored, not as their rounding to a 16-bit base's dtype
    /// (`--raw-f32-agents`).
    pub raw_f32_agents: bool,
    /// The recipe as data — the one the job came from, or its flags written as one — which the
    /// merge saves as `mergekit_config.yml` ([`Job::saved_recipe`]).
    pub recipe: saved_recipe::Recipe,
    /// The recipe file it came from (an output must not overwrite it).
    pub recipe_path: Option<PathBuf>,
    /// mergekit's `slices`, when the recipe selects layers.
    pub slices: Option<crate::slices::Slices>,
    /// mergekit's `tokenizer_source` / `tokenizer:` section (`None`: the base's tokenizer, every
    /// model's embeddings of the base's shape).
    pub tokenizer: Option<crate::vocabulary::TokenizerSettings>,
    /// The agents' names, by agent, where the recipe's `name:` gives one (`--name` for flags).
    pub names: Vec<Option<String>>,
    /// Whose config.json the output takes, as the user named it (`--config-from`, a recipe's
    /// `config_from:`): `base`, an agent's folder as given, or its name.
    pub config_from: Option<String>,
    /// A multi-stage recipe's earlier stages, done (empty for one merge): the record and the
    /// saved recipe of this, the final stage, hold them too.
    pub stages: Vec<DoneStage>,
    /// mergekit's `chat_template`: what the output's tokenizer_config.json says it is.
    pub chat_template: Option<crate::vocabulary::chat_template::ChatTemplate>,
}

/// An earlier stage of a multi-stage recipe, merged: its name, its recipe and settings as the
/// final output saves them, the folder it was written to, and its record there.
#[derive(Clone, Debug)]
pub struct DoneStage {
    /// Its `name:`.
    pub name: String,
    /// Its recipe (references to stages before it kept as their names).
    pub recipe: saved_recipe::Recipe,
    /// The settings its saved recipe makes explicit.
    pub settings: saved_recipe::Settings,
    /// Where it was written.
    pub folder: PathBuf,
    /// Whether that folder is scratch, removed once the final merge is done.
    pub scratch: bool,
    /// Its merge's record, as written in `folder`.
    pub record: crate::record::MergeRecord,
}

impl Job {
    /// [`Job::config_from`] as the merge takes it: `base`, or the agent it names among `agents`
    /// (folders as given, or their names); anything else is a usage error listing the choices,
    /// and a text that names two agents — one by its folder, another by its name — is refused as
    /// ambiguous rather than taken as either.
    pub fn config_source(&self) -> Result<Option<crate::slices::Source>> {
        use crate::slices::Source;
        let Some(text) = self.config_from.as_deref() else {
            return Ok(None);
        };
        if text == "base" {
            return Ok(Some(Source::Base));
        }
        let real = |p: &Path| std::fs::canonicalize(p).ok();
        let by_name = |t: usize| self.names.get(t).and_then(|n| n.as_deref()) == Some(text);
        let by_folder = |a: &PathBuf| {
            a.as_os_str() == text || real(a).is_some() && real(a) == real(Path::new(text))
        };
        let found: Vec<usize> = (0..self.agents.len())
            .filter(|&t| by_name(t) || by_folder(&self.agents[t]))
            .collect();
        if let [a, b, ..] = found[..] {
            let how = |t: usize| if by_name(t) { "its name" } else { "its folder" };
            return Err(usage(format!(
                "config_from '{text}' names two agents: {} (by {}) and {} (by {}); give the \
                 other's folder, or rename one with a name that is no folder",
                self.agents[a].display(),
                how(a),
                self.agents[b].display(),
                how(b)
            )));
        }
        match found.first() {
            Some(&t) => Ok(Some(Source::Agent(t))),
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
    /// `--param KEY=VALUE`: for every model, or one value per model (`KEY=0.7,0.3`).
    pub params: Vec<(String, ParamValue)>,
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
    /// `--svc ALPHA`: SVC's α, as given (checked with the method, `method::build::merging`).
    pub svc: Option<Scalar>,
    /// `--tokenizer-source` as given: only for the recipe the flags are saved as.
    pub tokenizer_source: Option<String>,
    /// `--name`s, by agent in order.
    pub names: Vec<String>,
    /// `--config-from`: whose config.json the output takes.
    pub config_from: Option<String>,
}

impl Job {
    /// A job from `--base`, `--model`s, the method flags and `--tokenizer-source` (`tokenizer`,
    /// its folder found). Methods without θ₀ (linear, passthrough, karcher) merge the models; the
    /// base then only gives the layout and the config files.
    pub fn from_flags(
        base: PathBuf,
        agents: Vec<PathBuf>,
        flags: &MethodFlags,
        tokenizer: Option<crate::vocabulary::TokenizerSettings>,
    ) -> Result<Job> {
        let merging =
            crate::method::build::merging(flags.method_for(agents.len())?, flags.svc.as_ref())?;
        // Every merge gets the recipe that makes it again, saved and shown in the model card as
        // mergekit's own merges are.
        let recipe = flags.recipe(&base, &agents, tokenizer.as_ref(), merging.svc)?;
        Ok(Job {
            base,
            agents,
            merging,
            epsilon: None,
            out_dtype: None,
            shard_size: None,
            allow_nonfinite: false,
            allow_missing_tensors: false,
            raw_f32_agents: false,
            recipe,
            recipe_path: None,
            slices: None,
            tokenizer,
            names: flags.names.iter().cloned().map(Some).collect(),
            config_from: flags.config_from.clone(),
            stages: Vec::new(),
            chat_template: None,
        })
    }

    /// A conversion (`rlmerge convert`): `source` as the one model of a passthrough, its own
    /// layout and config — or, given as BASE+ADAPTER, the adapter applied to its base. Its saved
    /// recipe is mergekit's passthrough of that model, which remakes the same folder.
    pub fn conversion(source: PathBuf) -> Result<Job> {
        let layout = match source
            .to_str()
            .and_then(crate::checkpoint::lora::split_reference)
        {
            Some((base, _)) => PathBuf::from(base),
            None => source.clone(),
        };
        let flags = MethodFlags {
            method: Some(Kind::Passthrough),
            ..Default::default()
        };
        Job::from_flags(layout, vec![source], &flags, None)
    }

    /// A job from a mergekit YAML recipe; its model names are local folders, as written or beside
    /// the recipe. `seed` (the command line's) overrides the recipe's `seed:`.
    pub fn from_recipe(path: &Path, seed: Option<u64>) -> Result<Job> {
        recipe_yaml::read(path, seed)
    }

    /// A job from a recipe made in memory, as a YAML value with a file's keys (the Python API's
    /// keywords): the same checks as [`Job::from_recipe`], messages naming keys but no lines.
    /// Model paths resolve against the working directory.
    pub fn from_recipe_value(value: serde_yaml::Value, seed: Option<u64>) -> Result<Job> {
        recipe_yaml::from_value(value, seed)
    }

    /// A merge given as a base and models — the Python API's `merge`, as the command line's
    /// `merge --base --model` — as a recipe value: its `base_model` is the base as `--base` means
    /// it (the key [`base_key`] says for the method), then read as [`Job::from_recipe_value`].
    pub fn from_base_and_models(mut value: serde_yaml::Value, seed: Option<u64>) -> Result<Job> {
        if let Some(map) = value.as_mapping_mut() {
            let kind = map
                .get("merge_method")
                .and_then(serde_yaml::Value::as_str)
                .and_then(Kind::from_name);
            if let Some(key) = kind.map(base_key).filter(|k| *k != "base_model") {
                if let Some(base) = map.remove("base_model") {
                    map.insert(key.into(), base);
                }
            }
        }
        recipe_yaml::from_value(value, seed)
    }

    /// What the command line (or the Python keywords) sets on top of the job: each given
    /// setting replaces the recipe's (and the saved recipe says so), the `allow_*` switches add
    /// to it. ε is checked here, once, whichever front end gave it.
    pub fn set_command_line(&mut self, given: &CommandLine) -> Result<()> {
        if let Some(e) = given.epsilon {
            let checked = crate::method::build::epsilon_value(e).map_err(|err| {
                usage(crate::message![
                    crate::error::Arg::named("--epsilon", "epsilon"),
                    format!(": {err:#}")
                ])
            })?;
            self.epsilon = Some(checked);
        }
        self.out_dtype = given.out_dtype.or(self.out_dtype);
        self.shard_size = given.shard_size.or(self.shard_size);
        self.allow_nonfinite |= given.allow_nonfinite;
        self.allow_missing_tensors |= given.allow_missing_tensors;
        self.raw_f32_agents |= given.raw_f32_agents;
        Ok(())
    }

    /// The recipe the merge saves into the output folder `out` (its final path): `rlmerge run`
    /// of it, from any folder, makes this merge again ([`saved_recipe`]).
    pub fn saved_recipe(&self, out: &Path) -> Result<String> {
        if self.stages.is_empty() {
            return self.recipe.text_for(out, &self.saved_settings());
        }
        let mut docs = self
            .stages
            .iter()
            .map(|s| s.recipe.value_for(out, &s.settings))
            .collect::<Result<Vec<_>>>()?;
        docs.push(self.recipe.value_for(out, &self.saved_settings())?);
        saved_recipe::staged_text(&docs)
    }

    /// The settings the merge's saved recipe makes explicit, as it runs with them.
    pub fn saved_settings(&self) -> saved_recipe::Settings {
        let ram = self.merging.kind().is_ram_family();
        saved_recipe::Settings {
            out_dtype: self.out_dtype,
            shard_size: self.shard_size,
            seed: self.merging.method.seed(),
            // ε as f32 keeps its shortest form (1e-5, not 9.99999974e-6).
            epsilon: self
                .epsilon
                .filter(|_| ram)
                .map(|e| e.to_string().parse().unwrap_or(f64::from(e))),
            allow_nonfinite: self.allow_nonfinite,
            allow_missing_tensors: self.allow_missing_tensors,
            raw_f32_agents: self.raw_f32_agents,
        }
    }
}

/// Settings of a merge that the command line gives beside a recipe or the method flags
/// ([`Job::set_command_line`]): `None` and `false` where not given.
#[derive(Clone, Debug, Default)]
pub struct CommandLine {
    /// `--epsilon`.
    pub epsilon: Option<f64>,
    /// `--out-dtype`.
    pub out_dtype: Option<DType>,
    /// `--shard-size`.
    pub shard_size: Option<u64>,
    /// `--allow-nonfinite`.
    pub allow_nonfinite: bool,
    /// `--allow-missing-tensors`.
    pub allow_missing_tensors: bool,
    /// `--raw-f32-agents`.
    pub raw_f32_agents: bool,
}

impl MethodFlags {
    /// These flags as a mergekit recipe over `base` and `agents` (and the tokenizer source's
    /// folder, SVC's checked α): `merge_method`, the parameters as method-wide `parameters` (mergekit applies them
    /// to every model), the models — with the folder each reference names. The base is
    /// `base_model`, or `layout_model` for karcher, which would average a `base_model` as one more
    /// point. A value that cannot be written as YAML fails the job rather than saving an empty
    /// recipe.
    pub fn recipe(
        &self,
        base: &Path,
        agents: &[PathBuf],
        tokenizer: Option<&crate::vocabulary::TokenizerSettings>,
        svc: Option<f64>,
    ) -> Result<saved_recipe::Recipe> {
        use serde_yaml::{Mapping, Value};
        let mut folders = Vec::new();
        let mut path = |p: &Path| {
            let text = p.to_string_lossy().into_owned();
            folders.push((text.clone(), p.to_path_buf()));
            Value::String(text)
        };
        let mut recipe = Mapping::new();
        let kind = self.method.unwrap_or(Kind::RamPlus);
        recipe.insert("merge_method".into(), kind.name().into());
        recipe.insert(base_key(kind).into(), path(base));
        let settings = self.method_wide()?;
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
            let model = tokenizer.and_then(|t| match &t.source {
                crate::vocabulary::TokenizerSource::Model(p) => Some(p.clone()),
                _ => None,
            });
            let value = match model {
                Some(folder) => path(&folder),
                None => source.as_str().into(),
            };
            recipe.insert("tokenizer_source".into(), value);
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
                let own: Mapping = (self.params.iter())
                    .filter_map(|(key, value)| match value {
                        ParamValue::PerModel(v) => Some((key, v.get(t)?)),
                        ParamValue::Every(_) => None,
                    })
                    .map(|(key, v)| Ok((key.as_str().into(), serde_yaml::to_value(v)?)))
                    .collect::<Result<_>>()?;
                if !own.is_empty() {
                    entry.insert("parameters".into(), Value::Mapping(own));
                }
                Ok(Value::Mapping(entry))
            })
            .collect::<Result<_>>()?;
        recipe.insert("models".into(), Value::Sequence(models));
        if let Some(alpha) = svc {
            let svc = Mapping::from_iter([("alpha".into(), alpha.into())]);
            recipe.insert("svc".into(), Value::Mapping(svc));
        }
        Ok(saved_recipe::Recipe {
            value: Value::Mapping(recipe),
            folders,
        })
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
        let mut seen = std::collections::HashSet::new();
        for (key, value) in &self.params {
            if !seen.insert(key) {
                return Err(usage(format!(
                    "--param {key} is given twice; give each parameter once"
                )));
            }
            if let ParamValue::Every(v) = value {
                method_wide.insert(key.clone(), v.clone());
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

    /// Each model's own parameters (`--param KEY=V1,V2,…`): one value per model, in order.
    fn per_model(&self, agents: usize) -> Result<Vec<Settings>> {
        let mut models = vec![Settings::new(); agents];
        for (key, value) in &self.params {
            let ParamValue::PerModel(values) = value else {
                continue;
            };
            if values.len() != agents {
                return Err(usage(format!(
                    "--param {key} gives {} values for {agents} model(s): one per --model, in \
                     order (a single value applies to every model)",
                    values.len()
                )));
            }
            for (model, v) in models.iter_mut().zip(values) {
                model.insert(key.clone(), Setting::Scalar(v.clone()));
            }
        }
        Ok(models)
    }

    /// The method these flags ask for `agents` merged models, validated as a recipe's is.
    pub fn method_for(&self, agents: usize) -> Result<Method> {
        let kind = self.method.unwrap_or(Kind::RamPlus);
        let method_wide = self.method_wide()?;
        let request = MethodRequest {
            kind,
            method_wide,
            models: self.per_model(agents)?,
            seed: self.seed,
            with_base: true,
            slices: Vec::new(),
        };
        crate::method::build::build(request, agents)
    }
}

/// A `--param` value: one for every model, or one per model in `--model` order.
#[derive(Clone, Debug)]
pub enum ParamValue {
    /// `KEY=VALUE`: every model's.
    Every(Setting),
    /// `KEY=V1,V2,…`: model t's is the t-th (a recipe's per-model `parameters:`; not a gradient,
    /// which a recipe's list is).
    PerModel(Vec<Scalar>),
}

/// A `KEY=VALUE` CLI parameter ([`parse_scalar`]'s value), or `KEY=V1,V2,…`, one per model.
pub fn parse_param(kv: &str) -> Result<(String, ParamValue), String> {
    let (k, v) = kv
        .split_once('=')
        .ok_or_else(|| format!("'{kv}': expected KEY=VALUE"))?;
    let value = match v.contains(',') {
        true => ParamValue::PerModel(v.split(',').map(parse_scalar).collect()),
        false => ParamValue::Every(Setting::Scalar(parse_scalar(v))),
    };
    Ok((k.trim().to_string(), value))
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

/// The recipe key that holds the base of a merge given as `--base` and `--model`s (the command
/// line's flags, the Python API's `merge`): `base_model`, but `layout_model` for karcher, whose
/// `base_model` mergekit averages as one more point while `--base` gives only the layout.
pub fn base_key(kind: Kind) -> &'static str {
    match kind {
        Kind::Karcher => "layout_model",
        _ => "base_model",
    }
}
