//! mergekit's other tools through the service: LoRA extraction and MoE assembly, each on the
//! CPU workers, saying what the user should know of what they wrote.

use super::Said;
use crate::backend::cpu::CpuBackend;
use crate::job::DoneStage;
use anyhow::Result;
use std::path::Path;

/// Extracts a LoRA adapter (`rlmerge extract-lora`): `req` into the folder `out` on `threads` CPU
/// workers (0: one per core), saying where its rank keeps little of the model's update.
pub fn extract_lora(
    req: &crate::extract_lora::Request,
    (out, force): (&Path, bool),
    threads: usize,
    say: &mut dyn FnMut(Said),
) -> Result<crate::extract_lora::Extraction> {
    let workers = CpuBackend::new(threads)?;
    let done = workers.install(|| crate::extract_lora::extract(req, out, force))?;
    let biases: Vec<&String> = done
        .skipped
        .iter()
        .filter(|s| s.ends_with(".bias"))
        .collect();
    if let Some(first) = biases.first() {
        say(Said::Warning(format!(
            "{} changed biases left out ('{first}' first): a PEFT adapter holds a bias change \
             only as lora_B's bias, which it gives every target module, and some factored \
             modules have no bias",
            biases.len()
        )));
    }
    let kept = done.kept();
    if kept < 0.5 {
        say(Said::Warning(format!(
            "rank {} keeps {:.1} % of the update's energy (‖Δ_r‖/‖Δ‖ over the {} factored \
             modules): the model's update is spread over many directions, as an RL agent's sparse \
             update is — the adapter loses most of it; raise --rank, or merge the full model",
            req.rank,
            100.0 * kept,
            done.modules.len()
        )));
    }
    Ok(done)
}

/// Builds a mixture of experts (`rlmerge moe`): `config` into the folder `out` on `threads` CPU
/// workers (0: one per core), after the merge stages `stages` it takes (a multi-stage recipe's),
/// saying what the user should know of its routers and layout.
pub fn moe(
    config: &crate::moe::MoeConfig,
    (out, force): (&Path, bool),
    (options, threads): (crate::moe::Options, usize),
    stages: &[DoneStage],
    say: &mut dyn FnMut(Said),
) -> Result<crate::moe::Built> {
    let workers = CpuBackend::new(threads)?;
    let built = workers.install(|| crate::moe::build(config, (out, force), options, stages))?;
    for w in &built.warnings {
        say(Said::Warning(w.clone()));
    }
    if !built.degenerate.is_empty() {
        say(Said::Warning(format!(
            "the routers of {} of {} layers are nearly linearly dependent (condition number \
             above 5): the experts' prompts are too alike, and some experts will rarely be \
             chosen; give each expert prompts of what only it does",
            built.degenerate.len(),
            built.layers
        )));
    }
    if !config.experts.len().is_power_of_two() {
        say(Said::Note(format!(
            "{} experts is not a power of two: llama.cpp does not load such a MoE",
            config.experts.len()
        )));
    }
    if let Some(first) = built.zero_biases.first() {
        say(Said::Note(format!(
            "the base has no q/k/v biases; Qwen2-MoE's {} are written as zeros ('{first}' \
             first), which compute what the base computes",
            built.zero_biases.len()
        )));
    }
    Ok(built)
}
