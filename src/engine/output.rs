//! What the merge pass writes: tiles of the base passed through, the output value policy, and the
//! record that completes the output folder.

use super::{BoostReport, MergeOptions, MergeSummary};
use crate::backend::Tile;
use crate::checkpoint::dtype::{decode, decode_one, encode, first_nonfinite};
use crate::checkpoint::folder_files::{set_config_dtype, write_model_files};
use crate::checkpoint::output_folder::MERGEKIT_CONFIG_FILE;
use crate::checkpoint::weight_file::crc32_of_file;
use crate::checkpoint::weight_file::FileChecksum;
use crate::checkpoint::{DType, OutputFolder};
use crate::inputs::{identical_inputs, Inputs};
use crate::record::OVERLAP_FIGURE;
use crate::record::{self, AgentSummary, InputChecksums, MergeRecord};
use crate::slices::Source;
use anyhow::{bail, Context, Result};
use std::path::Path;

/// The base's values in the output dtype (a tensor no merged model has); same dtype: its bits.
pub(super) fn pass_base(tile: &Tile, out_dtype: DType, out: &mut [u8]) {
    if out_dtype == tile.dtype {
        out.copy_from_slice(tile.base);
    } else {
        let mut values = vec![0.0f32; tile.len];
        decode(tile.dtype, tile.base, &mut values);
        encode(out_dtype, &values, out);
    }
}

/// The output policy (README "Values"): a merged value that is NaN or ±Inf where every input of
/// that element is finite is an error naming the tensor and element — an overflow of the method's
/// arithmetic or of the output dtype, never silently written. Where an input is not finite itself
/// (`--allow-nonfinite`), IEEE rules decide and the value is kept.
pub(super) fn check_finite_output(
    tile: &Tile,
    out_dtype: DType,
    out: &[u8],
    name: &str,
    start: u64,
    allow_nonfinite: bool,
) -> Result<()> {
    let size = out_dtype.size();
    let mut from = 0;
    while let Some(k) = first_nonfinite(out_dtype, &out[from * size..]) {
        let e = from + k;
        let inputs_finite = std::iter::once(tile.base)
            .chain(tile.agents.iter().copied())
            .all(|bytes| decode_one(tile.dtype, bytes, e).is_finite());
        if inputs_finite {
            let max = match out_dtype {
                DType::BF16 => "3.39e38",
                DType::F16 => "65504",
                DType::F32 => "3.40e38",
            };
            bail!(
                "merged tensor '{}' has a non-finite value ({}) at element {}, where every input is \
                 finite: the method's parameters overflow, or the result exceeds the output dtype \
                 {out_dtype} (largest finite value {max}){}",
                crate::escape::terminal(name),
                decode_one(out_dtype, out, e),
                start + e as u64,
                if allow_nonfinite {
                    ", or a NaN/Inf elsewhere in the tensor entered a statistic of the method \
                     (norms, angles)"
                } else {
                    ""
                }
            );
        }
        from = e + 1;
    }
    Ok(())
}

/// Completes the output folder: the base's config and tokenizer files, the extra files (the
/// mergekit recipe), the record with every checksum; then, the inputs unchanged, the commit.
pub(super) fn finish(
    inputs: &Inputs,
    options: &MergeOptions,
    boost: BoostReport,
    shards: Vec<FileChecksum>,
    folder: OutputFolder,
    (config_warnings, backend): (Vec<String>, &'static str),
) -> Result<MergeSummary> {
    let out = folder.final_path().to_path_buf();
    let kept = kept_shares(inputs, options, folder.path())?;
    let mut agents = agent_summaries(inputs, &boost, &out, kept.as_deref());
    let out_dtype = options
        .out_dtype
        .or_else(|| inputs.base.main_dtype())
        .unwrap_or(DType::F32);
    let mut outputs = shards;
    let config = output_config(inputs, options, out_dtype)?;
    let (written, template_warning) = model_files(inputs, options, config.as_ref(), folder.path())?;
    for name in written {
        outputs.push(crc32_of_file(&folder.path().join(name))?);
    }
    // Where a probe ran (RAM+), the paper's Figure 1 for these agents, shown by the model card.
    let figure = boost
        .report
        .as_ref()
        .map(|r| (OVERLAP_FIGURE.to_string(), crate::figures::overlap(r)));
    for (name, text) in options.extra_files.iter().chain(&figure) {
        let path = folder.path().join(name);
        std::fs::write(&path, text).with_context(|| format!("cannot write {}", path.display()))?;
        outputs.push(crc32_of_file(&path)?);
    }
    let rounding_warnings = boost_rounded_away(inputs, &boost, &mut agents, out_dtype);
    let input_sums = input_checksums(inputs, &out)?;
    let record = MergeRecord {
        tool: "rlmerge".into(),
        version: env!("CARGO_PKG_VERSION").into(),
        merging: options.merging.clone(),
        epsilon: options.pass.epsilon,
        allow_nonfinite: !options.pass.scan_nonfinite,
        allow_missing_tensors: inputs.allow_missing_tensors,
        raw_f32_agents: inputs.raw_f32_agents,
        config_from: options.config_from.map(|c| match c {
            Source::Base => "base".to_string(),
            Source::Agent(t) => record::recorded_path(&out, &inputs.agents[t].dir)
                .display()
                .to_string(),
        }),
        backend: Some(backend.to_string()),
        base: record::recorded_path(&out, &inputs.base.dir)
            .display()
            .to_string(),
        agents,
        tensor_lambdas: boost.tensor_lambdas.unwrap_or_default(),
        group_lambdas: boost.group_lambdas.unwrap_or_default(),
        out_dtype: options.out_dtype.map(|d| d.to_string()),
        main_dtype: Some(out_dtype.torch_name().to_string()),
        slices: inputs.slices.clone(),
        tokenizer: inputs
            .vocabulary
            .as_deref()
            .map(|v| v.settings.with_folders(|p| record::recorded_path(&out, p))),
        shard_size: options.shard_size,
        warnings: inputs
            .warnings
            .iter()
            .chain(&options.warnings)
            .chain(&config_warnings)
            .cloned()
            .chain(identical_inputs(
                &input_sums,
                options.merging.method.uses_base(),
            ))
            .chain(super::spectral::warnings(inputs, &options.merging.method))
            .chain(kept_warnings(inputs, kept.as_deref()))
            .chain(rounding_warnings)
            .chain(template_warning)
            .collect(),
        inputs: input_sums,
        outputs,
        stages: options.stages.clone(),
    };
    // Earlier stages made in scratch are named `stage:NAME`: their folders go with the merge.
    let record = record.rebased(&out, &out, &options.scratch_stages);
    let recipe = options
        .extra_files
        .iter()
        .find(|(name, _)| name == MERGEKIT_CONFIG_FILE)
        .map(|(_, text)| text.as_str());
    record::write(folder.path(), &record, recipe, config.as_ref())?;
    inputs.check_unchanged()?;
    folder.commit()?;
    Ok(MergeSummary {
        shards: record.shards().map(|f| f.file.clone()).collect(),
        record,
        report: boost.report,
        notes: Vec::new(),
    })
}

/// RAM+'s boost the output dtype rounded away: each agent's share in its summary, and the
/// warnings of those that lost much of it.
fn boost_rounded_away(
    inputs: &Inputs,
    boost: &BoostReport,
    agents: &mut [AgentSummary],
    out_dtype: DType,
) -> Vec<String> {
    let Some(rounding) = boost.rounding.as_ref() else {
        return Vec::new();
    };
    for (t, agent) in agents.iter_mut().enumerate() {
        agent.boost_rounded_away = rounding.unmoved_share(t);
    }
    let lambdas: Vec<Option<f64>> = agents.iter().map(|a| a.lambda).collect();
    rounding.warnings(&inputs.agent_labels(), &lambdas, out_dtype)
}

/// Writes the output's config and tokenizer files — its config ([`output_config`]), the base's
/// generation config, and the base's tokenizer or the vocabulary's, with a recipe's chat template
/// — and returns their names, and a warning where the template had no file to go in.
fn model_files(
    inputs: &Inputs,
    options: &MergeOptions,
    config: Option<&serde_json::Value>,
    out: &Path,
) -> Result<(Vec<String>, Option<String>)> {
    let vocabulary = inputs.vocabulary.as_deref();
    let mut written =
        write_model_files(inputs.base.config_dir(), config, out, vocabulary.is_none())?;
    if let Some(v) = vocabulary {
        written.extend(v.write_files(out)?);
    }
    let template_warning = match &options.chat_template {
        Some(t) => crate::vocabulary::chat_template::write_into(out, t)?,
        None => None,
    };
    Ok((written, template_warning))
}

/// The output's config.json, built in memory and written once: the config of the model
/// `--config-from` names (else the base's), every dtype key set to the output's, the
/// vocabulary's size where a tokenizer source set it, and a sliced output's layer count and
/// per-layer lists. `None` where that model has no config.
fn output_config(
    inputs: &Inputs,
    options: &MergeOptions,
    out_dtype: DType,
) -> Result<Option<serde_json::Value>> {
    let from = match options.config_from {
        Some(Source::Agent(t)) => &inputs.agents[t],
        _ => &inputs.base,
    };
    let Some(config) = from.config() else {
        return Ok(None);
    };
    let mut config = config.json().clone();
    set_config_dtype(&mut config, out_dtype);
    // No output is quantized: an FP8 base's matrices are written dequantized.
    if let Some(c) = config.as_object_mut() {
        c.remove(crate::checkpoint::fp8::QUANTIZATION_KEY);
    }
    if let Some(v) = inputs.vocabulary.as_deref() {
        v.set_config_vocab_size(&mut config);
    }
    if let Some(slices) = &inputs.slices {
        let config_of = |m: Source| {
            let folder = match m {
                Source::Base => &inputs.base,
                Source::Agent(t) => &inputs.agents[t],
            };
            folder
                .config()
                .map(|c| c.json().clone())
                .unwrap_or_default()
        };
        slices.rewrite_config(&mut config, &config_of)?;
    }
    Ok(Some(config))
}

/// Each agent's line of the record: its path, its λ (global scope), its changed counts, what a
/// ResMerge `kept` of it.
fn agent_summaries(
    inputs: &Inputs,
    boost: &BoostReport,
    out: &Path,
    kept: Option<&[f64]>,
) -> Vec<AgentSummary> {
    let agent_counts = boost.report.as_ref().map(|r| r.total_agent_counts());
    inputs
        .agents
        .iter()
        .enumerate()
        .map(|(t, a)| AgentSummary {
            path: record::recorded_path(out, &a.dir).display().to_string(),
            name: inputs.names.get(t).cloned().flatten(),
            // Tensor, layer and module scope: λ per tensor or group, in the record.
            lambda: match (&boost.tensor_lambdas, &boost.group_lambdas) {
                (None, None) => Some(boost.global_lambdas[t]),
                _ => None,
            },
            counts: agent_counts.as_ref().map(|c| c[t]),
            kept: kept.map(|k| k[t]),
            boost_rounded_away: None,
        })
        .collect()
}

/// What a ResMerge kept of each agent's update (issue #50 item 5): its retention over every
/// element it changed, r = Σ (θ_out − θ₀)·τ_t / Σ τ_t² (`analyze --merged`'s "all"), read back
/// from the written shards in one more pass. ResMerge's backbone merges what each agent's top
/// singular directions leave, so an agent whose update those directions hold whole (a low-rank,
/// LoRA agent) can come out as the base. `None` for other methods, and for outputs whose tensors
/// are not the base's (slices, a tokenizer source).
fn kept_shares(inputs: &Inputs, options: &MergeOptions, dir: &Path) -> Result<Option<Vec<f64>>> {
    let resmerge = options.merging.method.kind() == crate::method::Kind::ResMerge;
    if !resmerge || inputs.slices.is_some() || inputs.vocabulary.is_some() {
        return Ok(None);
    }
    let merged = crate::checkpoint::ModelFolder::open(dir)?;
    let r = super::retention(inputs, &merged, &options.pass, false)?;
    Ok(Some(
        r.regions
            .iter()
            .map(|regions| regions[2].retention())
            .collect(),
    ))
}

/// A warning for each agent a merge kept less than a tenth of a mean's share of (1/T).
fn kept_warnings(inputs: &Inputs, kept: Option<&[f64]>) -> Vec<String> {
    let Some(kept) = kept else {
        return Vec::new();
    };
    let floor = 0.1 / inputs.agents.len() as f64;
    kept.iter()
        .zip(&inputs.agents)
        .filter(|(share, _)| **share < floor)
        .map(|(share, agent)| {
            format!(
                "resmerge kept {share:.2e} of agent {}'s update (Σ Δ·τ / Σ τ² over the elements \
                 it changed; the models' mean keeps 1/{}): its top rank_topk singular directions \
                 hold nearly all of it, and ResMerge merges only what they leave (a low-rank \
                 agent, such as a LoRA one) — lower rank_topk, or merge it with another method",
                agent.dir.display(),
                inputs.agents.len()
            )
        })
        .collect()
}

/// Every input's file checksums for the record. Tensors were hashed as they were read; only what
/// the merge never read is read now. A conversion's one model is also its base (the same folder,
/// read once by the tile loop): its files' checksums are the base's, not read again.
fn input_checksums(inputs: &Inputs, out: &Path) -> Result<Vec<InputChecksums>> {
    let base_files = inputs.base.checksums()?;
    std::iter::once(&inputs.base)
        .chain(&inputs.agents)
        .map(|m| {
            let path = std::fs::canonicalize(&m.dir).unwrap_or_else(|_| m.dir.clone());
            let same_as_base = m.dir == inputs.base.dir && m.lora.is_none();
            Ok(InputChecksums {
                hub_id: crate::hub::id_of_snapshot(&path),
                path: record::recorded_path(out, &path),
                files: match same_as_base {
                    true => base_files.clone(),
                    false => m.checksums()?,
                },
                format: m.other_format(),
            })
        })
        .collect()
}
