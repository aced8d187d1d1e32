//! Retention: how much of each agent's change survived a merge — the paper's "signal dilution"
//! made measurable, for any merged folder (rlmerge's, mergekit's, any tool's). Per agent t and
//! region (its unique elements U_t, its shared elements S_t, all it changed):
//! r = Σ (θ_out − θ₀)·τ_t / Σ τ_t², and the share of its changed elements whose sign survived
//! (θ_out − θ₀ has the sign of τ_t). RAM keeps r = λ_t on U_t; task arithmetic with weight w
//! shows w there.

use super::progress::progress_bar;
use super::tile_elems;
use super::tiles::{par_tiles, TensorTiles, TileLoop};
use super::PassOptions;
use crate::checkpoint::dtype::decode;
use crate::checkpoint::ModelFolder;
use crate::inputs::Inputs;
pub use crate::report::retention::{RegionSums, Retention, REGIONS};
use anyhow::{Context, Result};

/// Reads the base, the agents and `merged` tile by tile and sums each agent's retention. `merged`
/// must hold every base tensor with the base's shape (any dtype).
pub fn retention(
    inputs: &Inputs,
    merged: &ModelFolder,
    pass: &PassOptions,
    show_progress: bool,
) -> Result<Retention> {
    let n = inputs.agents.len();
    for plan in &inputs.tensors {
        plan.in_companion(merged, "merged folder")?;
    }
    let presents: Vec<Vec<usize>> = inputs.tensors.iter().map(|p| p.present()).collect();
    let tensors: Vec<TensorTiles> = inputs
        .tensors
        .iter()
        .zip(&presents)
        .map(|(plan, present)| TensorTiles {
            plan,
            present,
            tile_elems: tile_elems(plan, inputs, pass.tile_elems),
        })
        .collect();
    let bar = progress_bar(inputs.pass_bytes(), show_progress, "retention");
    let how = TileLoop {
        inputs,
        scan_nonfinite: pass.scan_nonfinite,
        run_workers: &|w| {
            rayon::broadcast(|_| w());
        },
        progress: &bar,
        stride: 1,
        last_read: true,
    };
    let init = || vec![[RegionSums::default(); 3]; n];
    let workers = par_tiles(&how, &tensors, init, |sums, j, _, start, tile| {
        let plan = tensors[j].plan;
        let m = merged.get(plan.name()).expect("checked above");
        let size = m.entry.dtype.size();
        let mut bytes = vec![0u8; tile.len * size];
        merged
            .read(m, start * size as u64, &mut bytes)
            .with_context(|| format!("merged tensor '{}'", plan.name()))?;
        let mut out = vec![0.0f32; tile.len];
        decode(m.entry.dtype, &bytes, &mut out);
        let mut base = vec![0.0f32; tile.len];
        decode(tile.dtype, tile.base, &mut base);
        let present = &presents[j];
        let mut agents = vec![vec![0.0f32; tile.len]; present.len()];
        for (a, bytes) in agents.iter_mut().zip(tile.agents) {
            decode(tile.dtype, bytes, a);
        }
        for i in 0..tile.len {
            let b = base[i];
            let changed = |a: &Vec<f32>| (a[i] - b).abs() > pass.epsilon;
            let c = agents.iter().filter(|a| changed(a)).count();
            let d = (out[i] - b) as f64;
            for (slot, a) in agents.iter().enumerate() {
                if !changed(a) {
                    continue;
                }
                let tau = (a[i] - b) as f64;
                let one = RegionSums {
                    dot: d * tau,
                    norm2: tau * tau,
                    changed: 1,
                    sign_kept: (d * tau > 0.0) as u64,
                };
                let r = &mut sums[present[slot]];
                r[if c == 1 { 0 } else { 1 }].add(&one);
                r[2].add(&one);
            }
        }
        Ok(())
    })?;
    bar.finish_and_clear();
    let mut regions = vec![[RegionSums::default(); 3]; n];
    for w in &workers {
        for (total, part) in regions.iter_mut().zip(w) {
            for (t, p) in total.iter_mut().zip(part) {
                t.add(p);
            }
        }
    }
    Ok(Retention {
        merged: merged.dir.display().to_string(),
        agents: inputs.agent_labels(),
        regions,
        lambdas: recorded_lambdas(inputs, merged),
    })
}

/// The λ per agent the merged folder's record gives, when it is an rlmerge merge of these agents
/// (the same folders, in any order); empty otherwise.
fn recorded_lambdas(inputs: &Inputs, merged: &ModelFolder) -> Vec<Option<f64>> {
    let Ok(record) = crate::record::MergeRecord::read(&merged.dir) else {
        return Vec::new();
    };
    let real = |p: &std::path::Path| std::fs::canonicalize(p).unwrap_or_else(|_| p.to_path_buf());
    inputs
        .agents
        .iter()
        .map(|a| {
            let dir = real(&a.dir);
            // The record's inputs: the base, then the agents in order, each named relative to
            // the merged folder (see `record::resolved_path`).
            record
                .inputs
                .iter()
                .skip(1)
                .zip(&record.agents)
                .find(|(input, _)| {
                    real(&crate::record::resolved_path(&merged.dir, &input.path)) == dir
                })
                .and_then(|(_, agent)| agent.lambda)
        })
        .collect()
}
