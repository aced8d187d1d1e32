//! SVC, the spectral calibration modifier (SPEC §4e): a matrix the method has merged is not
//! written as it is; its merged update Δ_m (the method's f32 values minus θ₀) and each agent's
//! task vector are captured whole by one more tile loop over the tensor — the method's own tile
//! rule, its output kept in f32 in memory — then `spectral::svc_update` rescales Δ_m's singular
//! values and the tensor is merged as θ₀ plus that update (a [`TileRule::Update`]), by every
//! backend alike. Tensors that are not matrices, or larger than `spectral::MAX_ELEMS`, are
//! written as the method merged them.

use super::tiles::{self, par_tiles, TensorTiles, TileLoop};
use super::{MergeOptions, MergePass, TensorJob, TileRule, TileScratch};
use crate::backend::TileCounts;
use crate::checkpoint::dtype::{decode, DType};
use crate::method::Method;
use anyhow::{Context, Result};
use std::sync::Mutex;

/// SVC calibrates the merge's update against θ₀ (SPEC §4e): a method whose formula has no θ₀
/// (linear, passthrough…, even with a `--base` for the layout) has none to calibrate — a usage
/// error, before anything is written.
pub(super) fn refuse_without_base(options: &MergeOptions) -> Result<()> {
    let from_base = match &options.method {
        Method::Combine(c) => c.with_base && (c.kind.uses_base() || c.kind.base_optional()),
        _ => true,
    };
    if options.svc.is_some() && !from_base {
        return Err(crate::error::usage(format!(
            "svc calibrates a merge's update against its base model, and method {} merges \
             without one (use a method with a base, e.g. task_arithmetic)",
            options.method.name()
        )));
    }
    Ok(())
}

/// What the capture holds: the merged update Δ_m and each present agent's τ, row-major f32.
struct Captured {
    merged: Vec<f32>,
    taus: Vec<Vec<f32>>,
}

impl MergePass<'_> {
    /// SVC of `job`'s tensor when it is a matrix the modifier calibrates: its rule replaced by
    /// θ₀ + the calibrated update, with the counts plain RAM's kernels gave while it was
    /// captured (the report counts the tensor once, as merged by the method).
    pub(super) fn calibrate(&self, job: &mut TensorJob, alpha: f64) -> Result<()> {
        let Some(matrix) = super::spectral::matrix(job.plan.shape()) else {
            return Ok(());
        };
        if job.present.is_empty() || matches!(job.rule, TileRule::Base) {
            return Ok(());
        }
        let (captured, counts) = self.capture(job)?;
        let update = super::spectral::svc_update(&captured.merged, &captured.taus, matrix, alpha)
            .with_context(|| format!("svc of tensor '{}'", job.plan.name()))?;
        job.rule = TileRule::Update(update);
        job.captured_counts = counts;
        Ok(())
    }

    /// One tile loop over `job`'s tensor: each tile merged by its rule into f32, minus θ₀, and
    /// each agent's τ, gathered whole.
    fn capture(&self, job: &TensorJob) -> Result<(Captured, Option<TileCounts>)> {
        let numel = job.plan.numel();
        let captured = Mutex::new(Captured {
            merged: vec![0.0; numel],
            taus: vec![vec![0.0; numel]; job.present.len()],
        });
        let how = TileLoop {
            inputs: self.inputs,
            scan_nonfinite: self.pass.scan_nonfinite,
            run_workers: &|w| self.backend.run_workers(w),
            progress: &indicatif::ProgressBar::hidden(),
            stride: 1,
            // The merge pass reads the tensor again.
            last_read: false,
        };
        let tensors = [TensorTiles {
            plan: job.plan,
            present: &job.present,
            tile_elems: job.tile_elems,
        }];
        let counting = self.counted.is_some();
        let init = || {
            let counts = TileCounts::zeros(if counting { job.present.len() } else { 0 });
            (
                Vec::new(),
                Vec::new(),
                Vec::new(),
                counts,
                TileScratch::default(),
            )
        };
        let workers = par_tiles(
            &how,
            &tensors,
            init,
            |(out, base, x, counts, scratch), _, _, start, tile| {
                let len = tile.len;
                tiles::resize_exact(out, len * 4, 0);
                self.merge_tile(job, tile, start, (DType::F32, out), counts, scratch)?;
                tiles::resize_exact(base, len, 0.0);
                decode(tile.dtype, tile.base, base);
                // Δ_m first, then each τ, in this worker's buffers; copied under the lock.
                tiles::resize_exact(x, len * (1 + tile.agents.len()), 0.0);
                let (merged, taus) = x.split_at_mut(len);
                for ((m, b), o) in merged.iter_mut().zip(base.iter()).zip(out.chunks_exact(4)) {
                    *m = f32::from_le_bytes([o[0], o[1], o[2], o[3]]) - b;
                }
                for (tau, agent) in taus.chunks_exact_mut(len).zip(tile.agents) {
                    decode(tile.dtype, agent, tau);
                    tau.iter_mut().zip(base.iter()).for_each(|(t, b)| *t -= b);
                }
                let at = start as usize;
                let mut all = captured.lock().unwrap_or_else(|p| p.into_inner());
                all.merged[at..at + len].copy_from_slice(merged);
                for (whole, tau) in all.taus.iter_mut().zip(taus.chunks_exact(len)) {
                    whole[at..at + len].copy_from_slice(tau);
                }
                Ok(())
            },
        )?;
        let counts = counting.then(|| {
            let mut local = TileCounts::zeros(job.present.len());
            for (_, _, _, c, _) in &workers {
                local.add(c);
            }
            super::probe::to_global(&local, &job.present, self.inputs.agents.len())
        });
        let captured = captured.into_inner().unwrap_or_else(|p| p.into_inner());
        Ok((captured, counts))
    }
}
