//! RAM's probe pass (SPEC.md §1): per tensor, how many agents changed each element.

use super::progress::progress_bar;
use super::tile_elems;
use super::tiles::{batches, par_tiles, TensorTiles, TileLoop};
use super::PassOptions;
use crate::backend::{Backend, TileCounts};
use crate::inputs::{Inputs, TensorPlan};
use crate::report::{ProbeReport, TensorStats};
use anyhow::{Context, Result};
use indicatif::ProgressBar;

/// Probes `plans` over all their tiles in one tile loop; each one's counts are indexed by
/// global agent.
pub(super) fn probe_tensors(
    inputs: &Inputs,
    plans: &[&TensorPlan],
    backend: &dyn Backend,
    pass: &PassOptions,
    progress: &ProgressBar,
) -> Result<Vec<TileCounts>> {
    let n = inputs.agents.len();
    let presents: Vec<Vec<usize>> = plans.iter().map(|p| p.present()).collect();
    let tensors: Vec<TensorTiles> = plans
        .iter()
        .zip(&presents)
        .map(|(&plan, present)| TensorTiles {
            plan,
            present,
            tile_elems: tile_elems(plan, inputs, pass.tile_elems),
        })
        .collect();
    let zeros = || -> Vec<TileCounts> {
        presents
            .iter()
            .map(|p| TileCounts::zeros(p.len()))
            .collect()
    };
    let how = TileLoop {
        inputs,
        scan_nonfinite: pass.scan_nonfinite,
        run_workers: &|w| backend.run_workers(w),
        progress,
        stride: 1,
        last_read: true,
    };
    let workers = par_tiles(&how, &tensors, zeros, |sums, j, i, _, tile| {
        let counts = backend
            .probe(tile, pass.epsilon)
            .with_context(|| format!("probe of tensor '{}' failed at tile {i}", plans[j].name()))?;
        sums[j].add(&counts);
        Ok(())
    })?;
    let mut local = zeros();
    for sums in &workers {
        for (l, s) in local.iter_mut().zip(sums) {
            l.add(s);
        }
    }
    Ok(local
        .iter()
        .zip(&presents)
        .map(|(local, present)| to_global(local, present, n))
        .collect())
}

/// A tensor's counts over its present agents spread into the N-wide global layout.
pub(super) fn to_global(local: &TileCounts, present: &[usize], n: usize) -> TileCounts {
    let mut global = TileCounts::zeros(n);
    for (slot, &t) in present.iter().enumerate() {
        global.hist[t * n..t * n + present.len()].copy_from_slice(local.row(slot));
    }
    global
}

/// The whole-model probe (SPEC §1): counts per tensor, from which every report and λ derives.
pub fn probe_all(
    inputs: &Inputs,
    backend: &dyn Backend,
    pass: &PassOptions,
    show_progress: bool,
) -> Result<ProbeReport> {
    inputs.refuse_base_as_agent()?;
    let bar = progress_bar(inputs.pass_bytes(), show_progress, "probe");
    let mut tensors = Vec::with_capacity(inputs.tensors.len());
    for run in batches(&inputs.tensors, pass.tile_elems) {
        let plans: Vec<&TensorPlan> = inputs.tensors[run].iter().collect();
        let counts = probe_tensors(inputs, &plans, backend, pass, &bar)?;
        inputs.forget_lora_matrices();
        for (plan, counts) in plans.into_iter().zip(counts) {
            tensors.push(tensor_stats(inputs, plan, counts));
        }
    }
    bar.finish_and_clear();
    inputs.check_unchanged()?;
    Ok(ProbeReport {
        agents: inputs.agent_labels(),
        epsilon: pass.epsilon,
        tensor_count: tensors.len(),
        tensors,
    })
}

/// The probe counts of `plan`'s tensor as the report keeps them.
pub(super) fn tensor_stats(
    inputs: &Inputs,
    plan: &TensorPlan,
    counts: crate::backend::TileCounts,
) -> TensorStats {
    let present = plan
        .agents
        .iter()
        .enumerate()
        .fold(0, |m, (t, a)| m | (a.is_some() as u64) << t);
    let name = plan.out_name();
    let part = inputs.structure.part(&name);
    TensorStats::new(name, part, plan.numel() as u64, present, counts)
}
