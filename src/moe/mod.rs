//! Mixture-of-experts assembly (`rlmerge moe`, issue #54 item 2; mergekit's `mergekit-moe`):
//! several fine-tunes of one dense base as the experts of one MoE — the attention, embeddings
//! and norms from the base, each expert's MLPs from one agent, kept whole (no merge dilutes
//! them), and a router per layer from prompts that say what each expert is for. The alternative
//! to merging when merging loses skills.
//!
//! The config is mergekit-moe's YAML ([`config`]); the output layout (Mixtral, Qwen2-MoE with its
//! shared expert, Qwen3-MoE) is chosen by mergekit's rules ([`crate::model_config::moe`]); the
//! routers are made without a forward pass ([`router`]: `cheap_embed`, `random`); the tensors are
//! planned ([`plan`]) and streamed a chunk at a time ([`write`]) into an output folder that
//! appears whole or not at all, with a record `verify` checks, a card, and the config saved.

pub mod config;
mod plan;
mod router;
mod write;

use crate::checkpoint::files::SINGLE_FILE;
use crate::checkpoint::weight_file::{FileChecksum, Interner};
use crate::checkpoint::{DType, ModelFolder, OutputFolder};
use crate::error::usage;
use crate::job::DoneStage;
use crate::model_config::moe::{moe_config, MoeLayout};
use anyhow::{Context, Result};
pub use config::MoeConfig;
use std::path::Path;

/// The saved config's file name (mergekit-moe's).
pub const CONFIG_FILE: &str = "mergekit_moe_config.yml";

/// How a MoE is written, beside its config.
#[derive(Clone, Copy, Debug)]
pub struct Options {
    /// The largest shard in bytes.
    pub shard_bytes: u64,
    /// NaN/±Inf in the inputs copied, not refused.
    pub allow_nonfinite: bool,
    /// Progress on stderr (a bar on a terminal, a line every few seconds elsewhere).
    pub show_progress: bool,
}

/// What was built.
#[derive(Clone, Debug)]
pub struct Built {
    /// The architecture written.
    pub layout: MoeLayout,
    /// Decoder layers.
    pub layers: usize,
    /// Tensors written.
    pub tensors: usize,
    /// Their bytes.
    pub bytes: u64,
    /// Layers whose routers are nearly dependent (the prompts are too alike).
    pub degenerate: Vec<usize>,
    /// q/k/v biases written as zeros (Qwen2-MoE from a base without them).
    pub zero_biases: Vec<String>,
    /// The output dtype.
    pub dtype: DType,
    /// What the user should know (experts trained with other settings than the base's).
    pub warnings: Vec<String>,
}

/// The inputs opened: the base first, then each other model once; which one each expert is.
struct Opened {
    models: Vec<ModelFolder>,
    /// By expert (routed first, then shared): its index in `models`.
    of_expert: Vec<usize>,
}

/// Opens the base and the experts' models (a LoRA expert as its base with the adapter applied:
/// a bare adapter folder on the MoE's base, `BASE+ADAPTER` on that base).
fn open(config: &MoeConfig) -> Result<Opened> {
    let mut interner = Interner::default();
    if crate::checkpoint::lora::is_adapter(&config.base)
        || crate::checkpoint::lora::split_reference(&config.base.to_string_lossy()).is_some()
    {
        return Err(usage(format!(
            "base_model {} is a LoRA adapter: the MoE's base is a model folder (its attention, \
             embeddings and tokenizer are the MoE's); convert it first (rlmerge convert)",
            config.base_reference
        )));
    }
    let base = ModelFolder::open_interned(&config.base, &mut interner)
        .with_context(|| format!("cannot open the base {}", config.base.display()))?;
    let mut opened = Opened {
        models: vec![base],
        of_expert: Vec::new(),
    };
    let mut folders = vec![config.base.clone()];
    for e in config.experts.iter().chain(&config.shared_experts) {
        if let Some(i) = folders
            .iter()
            .position(|f| config::same_model(f, &e.folder))
        {
            opened.of_expert.push(i);
            continue;
        }
        let text = e.folder.to_string_lossy();
        let model = match crate::checkpoint::lora::split_reference(&text) {
            Some((b, a)) => ModelFolder::open_lora(Path::new(b), Path::new(a), &mut interner),
            None if crate::checkpoint::lora::is_adapter(&e.folder) => {
                ModelFolder::open_lora(&config.base, &e.folder, &mut interner)
            }
            None => ModelFolder::open_interned(&e.folder, &mut interner),
        }
        .with_context(|| format!("cannot open the expert {}", e.reference))?;
        opened.of_expert.push(opened.models.len());
        opened.models.push(model);
        folders.push(e.folder.clone());
    }
    Ok(opened)
}

/// The model type of an opened model, from its config.json (a LoRA expert's: its base's).
fn model_type<'a>(m: &'a ModelFolder, who: &str) -> Result<&'a str> {
    m.config()
        .and_then(|c| c.json()["model_type"].as_str())
        .with_context(|| {
            format!(
                "{who} ({}) has no config.json with a model_type: the MoE layout follows it",
                m.config_dir().display()
            )
        })
}

/// Refuses an expert whose config says its MLP computes something else than the base's (another
/// width, another activation, MLP biases); says where it was trained with other settings the
/// MoE runs it under the base's (positions, windows, norms' ε).
fn check_expert_config(base: &ModelFolder, m: &ModelFolder, who: &str) -> Result<Vec<String>> {
    let (Some(b), Some(c)) = (base.config(), m.config()) else {
        return Ok(Vec::new());
    };
    let refuse = |key: &str, bv: &dyn std::fmt::Display, av: &dyn std::fmt::Display| {
        usage(format!(
            "{who} ({}) is not a fine-tune of the base that a MoE can hold: its config.json says \
             {key} = {av}, the base's {bv}",
            m.config_dir().display()
        ))
    };
    if let Some((key, bv, av)) =
        crate::model_config::architecture_difference(b.json(), c.json(), &["num_hidden_layers"])
    {
        return Err(refuse(&key, &bv, &av));
    }
    let mut said = Vec::new();
    for d in crate::model_config::config_differences(b.json(), c.json()) {
        match d.key.as_str() {
            "hidden_act" | "hidden_activation" | "mlp_bias" => {
                return Err(refuse(&d.key, &d.base, &d.agent))
            }
            _ if d.meaning => said.push(format!(
                "{who} was trained with {} = {} (the base's: {}); the MoE runs its MLPs under the \
                 base's settings",
                d.key, d.agent, d.base
            )),
            _ => {}
        }
    }
    Ok(said)
}

/// The output dtype: the config's, else the base config's `torch_dtype` (or `dtype`), else the
/// base's weights'.
fn out_dtype(config: &MoeConfig, base: &ModelFolder) -> DType {
    config
        .dtype
        .or(base.config().and_then(|c| c.dtype()))
        .or(base.main_dtype())
        .unwrap_or(DType::BF16)
}

/// Builds the MoE of `config` into the folder `out` (replaced only with `force`, and only once
/// the new one is complete).
/// `stages` are the merges of a multi-stage recipe it takes (saved with its config).
pub fn build(
    config: &MoeConfig,
    (out, force): (&Path, bool),
    options: Options,
    stages: &[DoneStage],
) -> Result<Built> {
    let opened = open(config)?;
    let base = &opened.models[0];
    let mut types = vec![model_type(base, "the base")?];
    let mut warnings = Vec::new();
    for (k, &m) in opened.of_expert.iter().enumerate() {
        let who = format!("expert {}", plan::expert_of(config, k).reference);
        types.push(model_type(&opened.models[m], &who)?);
        warnings.extend(check_expert_config(base, &opened.models[m], &who)?);
    }
    let layout = MoeLayout::choose(
        config.architecture.as_deref(),
        &types,
        config.shared_experts.len(),
    )?;
    let base_config = base.config().expect("model_type read it").json();
    let layers = base
        .config()
        .and_then(|c| c.layer_count())
        .context("the base's config.json has no num_hidden_layers")?;
    let dims = plan::dims(base, layers)?;
    for (k, &m) in opened.of_expert.iter().enumerate() {
        let who = format!("expert {}", plan::expert_of(config, k).reference);
        plan::check_mlps(&opened.models[m], dims, &who)?;
    }
    let dtype = out_dtype(config, base);
    let routers = router::routers(config, base, (layers, dims.hidden))?;
    let (planned, zero_biases) = plan::plan(
        (config, layout, dims),
        (base, &opened.of_expert),
        &routers,
        dtype,
    )?;
    let inputs: Vec<_> = opened.models.iter().flat_map(|m| m.paths()).collect();
    let folder = OutputFolder::create(out, force, &inputs)?;
    let dir = folder.path();
    let mut outputs = write::write(&planned, &opened.models, config, dir, options)?;
    let json = moe_config(
        base_config,
        layout,
        (config.experts.len(), config.experts_per_token),
        dtype,
    );
    crate::checkpoint::folder_files::write_model_files(&base.dir, Some(&json), dir, true)?;
    outputs.push(crate::checkpoint::weight_file::crc32_of_file(
        &dir.join(crate::model_config::CONFIG_FILE),
    )?);
    let built = Built {
        layout,
        layers,
        tensors: planned.len(),
        bytes: planned.iter().map(|p| p.out.byte_len()).sum(),
        degenerate: routers.degenerate,
        zero_biases,
        dtype,
        warnings,
    };
    let saved = saved_config(config, folder.final_path(), stages)?;
    std::fs::write(dir.join(CONFIG_FILE), &saved)
        .with_context(|| format!("cannot write {}", dir.join(CONFIG_FILE).display()))?;
    std::fs::write(
        dir.join(crate::record::CARD_FILE),
        card(config, &built, &saved),
    )
    .with_context(|| format!("cannot write the card into {}", dir.display()))?;
    write_record(
        (config, options, stages),
        (&opened, &built),
        (folder.final_path(), dir),
        outputs,
    )?;
    for m in &opened.models {
        m.check_unchanged()?;
    }
    folder.commit()?;
    Ok(built)
}

/// The config as saved beside the weights: mergekit-moe's keys, every model named by its path
/// from the output folder (so the saved file, run from anywhere, names the same models), and the
/// seed where randomness is used.
fn saved_config(config: &MoeConfig, out: &Path, stages: &[DoneStage]) -> Result<String> {
    use serde_yaml::{Mapping, Value};
    // A multi-stage recipe's stage by its name; a folder by its path from the output.
    let path = |reference: &str, p: &Path| -> Value {
        match config.stages.iter().any(|(name, _)| name == reference) {
            true => Value::String(reference.to_string()),
            false => Value::String(crate::job::saved_recipe::reference_from(out, p)),
        }
    };
    let expert = |e: &config::Expert| -> Value {
        let mut m = Mapping::new();
        m.insert("source_model".into(), path(&e.reference, &e.folder));
        for (key, prompts) in [
            ("positive_prompts", &e.positive_prompts),
            ("negative_prompts", &e.negative_prompts),
        ] {
            if !prompts.is_empty() {
                let list = prompts.iter().map(|p| Value::String(p.clone())).collect();
                m.insert(key.into(), Value::Sequence(list));
            }
        }
        for (key, v) in [
            ("noise_scale", e.noise_scale),
            ("residual_scale", e.residual_scale),
        ] {
            if let Some(v) = v {
                // The f32 written in its shortest form (0.01, not 0.009999999776482582).
                let shortest = v.to_string().parse().unwrap_or(f64::from(v));
                m.insert(key.into(), Value::from(shortest));
            }
        }
        Value::Mapping(m)
    };
    let mut m = Mapping::new();
    m.insert(
        "base_model".into(),
        path(&config.base_reference, &config.base),
    );
    if let Some(a) = &config.architecture {
        m.insert("architecture".into(), a.as_str().into());
    }
    m.insert("gate_mode".into(), config.gate_mode.name().into());
    if let Some(d) = config.dtype {
        m.insert("dtype".into(), d.torch_name().into());
    }
    m.insert(
        "experts_per_token".into(),
        (config.experts_per_token as u64).into(),
    );
    m.insert(
        "experts".into(),
        Value::Sequence(config.experts.iter().map(expert).collect()),
    );
    if !config.shared_experts.is_empty() {
        let shared = config.shared_experts.iter().map(expert).collect();
        m.insert("shared_experts".into(), Value::Sequence(shared));
    }
    let random = !config.gate_mode.uses_prompts()
        || config
            .experts
            .iter()
            .chain(&config.shared_experts)
            .any(|e| e.noise_scale.is_some());
    if random {
        m.insert("seed".into(), config.seed.into());
    }
    let mut text = format!(
        "# Written by rlmerge {} (rlmerge moe): remakes this MoE byte for byte with\n#   rlmerge moe \
         {CONFIG_FILE} OUT\n",
        env!("CARGO_PKG_VERSION")
    );
    // A multi-stage recipe: its merges, then the MoE, each a document.
    for s in stages {
        let value = s.recipe.value_for(out, &s.settings)?;
        text += &format!("---\n{}", serde_yaml::to_string(&value)?);
    }
    if !stages.is_empty() {
        text += "---\n";
    }
    Ok(text + &serde_yaml::to_string(&Value::Mapping(m))?)
}

/// What a MoE's folder records (`rlmerge_record.json`): the layout, its experts, the routers'
/// quality, and the checksums of every file read and written.
#[derive(serde::Serialize)]
struct MoeRecord<'a> {
    tool: &'static str,
    version: &'static str,
    kind: &'static str,
    architecture: &'static str,
    gate_mode: &'static str,
    dtype: &'static str,
    experts_per_token: usize,
    seed: u64,
    /// The merge stages of a multi-stage recipe it took, by name.
    stages: Vec<&'a str>,
    /// The largest shard (`verify --against` builds the MoE again with it).
    shard_bytes: u64,
    allow_nonfinite: bool,
    experts: &'a [config::Expert],
    shared_experts: &'a [config::Expert],
    degenerate_layers: &'a [usize],
    zero_biases: &'a [String],
    inputs: Vec<crate::record::InputChecksums>,
    outputs: Vec<FileChecksum>,
}

/// Writes the record into `dir`, the scratch of the folder that will be `out`.
fn write_record(
    (config, options, stages): (&MoeConfig, Options, &[DoneStage]),
    (opened, built): (&Opened, &Built),
    (out, dir): (&Path, &Path),
    mut outputs: Vec<FileChecksum>,
) -> Result<()> {
    if outputs.iter().all(|f| f.file != SINGLE_FILE) {
        outputs.sort_by(|a, b| a.file.cmp(&b.file));
    }
    let mut inputs = opened
        .models
        .iter()
        .map(|m| crate::record::tool::input(out, m))
        .collect::<Result<Vec<_>>>()?;
    // A merge stage written to scratch (removed when the run ends) is named as the stage.
    for (input, m) in inputs.iter_mut().zip(&opened.models) {
        if let Some(s) = stages
            .iter()
            .find(|s| s.scratch && config::same_model(&s.folder, &m.dir))
        {
            input.path = format!("{}{}", crate::record::STAGE_PREFIX, s.name).into();
        }
    }
    // A LoRA expert's base, where it is not the MoE's: its weights were read too.
    let mut bases: Vec<&Path> = Vec::new();
    for m in opened.models.iter().filter(|m| m.lora.is_some()) {
        let base = m.config_dir();
        let read = opened
            .models
            .iter()
            .any(|o| o.lora.is_none() && config::same_model(&o.dir, base));
        if !read && !bases.iter().any(|b| config::same_model(b, base)) {
            inputs.push(crate::record::tool::input(out, &ModelFolder::open(base)?)?);
            bases.push(base);
        }
    }
    let record = MoeRecord {
        tool: "rlmerge",
        version: env!("CARGO_PKG_VERSION"),
        kind: "moe",
        architecture: built.layout.class(),
        gate_mode: config.gate_mode.name(),
        dtype: built.dtype.torch_name(),
        experts_per_token: config.experts_per_token,
        seed: config.seed,
        stages: stages.iter().map(|s| s.name.as_str()).collect(),
        shard_bytes: options.shard_bytes,
        allow_nonfinite: options.allow_nonfinite,
        experts: &config.experts,
        shared_experts: &config.shared_experts,
        degenerate_layers: &built.degenerate,
        zero_biases: &built.zero_biases,
        inputs,
        outputs,
    };
    crate::record::tool::write(dir, &record)
}

/// The MoE's model card: its layout, its experts and what routes to each, and the config.
fn card(config: &MoeConfig, built: &Built, saved: &str) -> String {
    let code = |s: &str| crate::escape::markdown_code(s);
    // `base_model`: the models that are Hub ids (a local folder's path is none), each once.
    let mut ids: Vec<String> = Vec::new();
    let folders = std::iter::once(&config.base).chain(
        config
            .experts
            .iter()
            .chain(&config.shared_experts)
            .map(|e| &e.folder),
    );
    for f in folders {
        let id =
            crate::hub::id_of_snapshot(f).map(|id| id.split('@').next().unwrap_or(&id).to_string());
        if let Some(id) = id.filter(|id| !ids.contains(id)) {
            ids.push(id);
        }
    }
    let base_model = match ids.is_empty() {
        true => String::new(),
        false => {
            ids.iter()
                .map(|id| format!("\n- {}", serde_json::to_string(id).unwrap_or_default()))
                .fold("base_model:".to_string(), |a, b| a + &b)
                + "\n"
        }
    };
    let mut text = format!(
        "---\n{base_model}library_name: transformers\ntags:\n- rlmerge\n- moe\n- merge\n---\n\n# A mixture of \
         experts built with rlmerge\n\nA {} ({}) of {} experts ({} per token) built with `rlmerge moe` \
         (rlmerge {}): attention, embeddings and norms from {}, each expert's MLPs from one \
         model, routers by `{}`.\n\n| expert | model | routed by |\n|---|---|---|\n",
        built.layout.name(),
        built.layout.class(),
        config.experts.len(),
        config.experts_per_token,
        env!("CARGO_PKG_VERSION"),
        code(&config.base_reference),
        config.gate_mode.name(),
    );
    let experts = config.experts.iter().map(|e| ("routed", e));
    let shared = config.shared_experts.iter().map(|e| ("shared", e));
    for (i, (kind, e)) in experts.chain(shared).enumerate() {
        let prompts = e
            .positive_prompts
            .iter()
            .map(|p| code(p))
            .chain(
                e.negative_prompts
                    .iter()
                    .map(|p| format!("not {}", code(p))),
            )
            .collect::<Vec<_>>()
            .join(", ");
        let prompts = if prompts.is_empty() {
            "—".into()
        } else {
            prompts
        };
        text += &format!("| {i} ({kind}) | {} | {prompts} |\n", code(&e.reference));
    }
    if !built.degenerate.is_empty() {
        text += &format!(
            "\n**Note:** the routers of layers {:?} are nearly linearly dependent (condition \
             number above 5): the prompts are too alike, and some experts will be chosen rarely.\n",
            built.degenerate
        );
    }
    if !built.zero_biases.is_empty() {
        text += &format!(
            "\n**Note:** the base has no q/k/v biases; Qwen2-MoE's are written as zeros ({} \
             tensors), which compute what the base computes.\n",
            built.zero_biases.len()
        );
    }
    text + "\n## Configuration\n\n" + &crate::escape::markdown_block("yaml", saved)
}
