//! SVC, the spectral calibration modifier (SPEC §4e): a matrix the method has merged is not
//! written as it is; its merged update Δ_m (the method's f32 values minus θ₀, by the method's own
//! tile rule) is calibrated against each agent's task vector. A tall matrix is read once more
//! tile by tile, its Gram matrix and cross products summed as the tiles pass, and merged in the
//! merge pass as θ₀ + Δ_m·W (a [`TileRule::RowMap`] around the method's rule); a wide one's Δ_m
//! and task vectors are captured whole by a tile loop and its calibrated update made whole (a
//! [`TileRule::Update`]). Tensors that are not matrices are written as the method merged them.

use super::scans::{ScanBuffers, TensorScans};
use super::spectral::{self, FileRows, MatrixWork, Transposed};
use super::tiles::{self, par_tiles, TensorTiles, TileLoop};
use super::{MergePass, TensorJob, TileRule, TileScratch};
use crate::backend::{Tile, TileCounts};
use crate::checkpoint::dtype::{decode, DType};
use anyhow::{Context, Result};
use std::sync::Mutex;

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
        let Some((m, n)) = spectral::matrix(job.plan.shape()) else {
            return Ok(());
        };
        if job.present.is_empty() || matches!(job.rule, TileRule::Base) {
            return Ok(());
        }
        let what = format!("tensor '{}'", job.plan.name());
        let named = || format!("svc of tensor '{}'", job.plan.name());
        if m >= n {
            let mut found = None;
            self.backend.run_cpu_work(&mut || {
                let cx = MatrixWork {
                    threads: rayon::current_num_threads(),
                    what: &what,
                    backend: self.backend,
                };
                found = Some(self.calibrate_rows(job, (m, n), alpha, &cx));
            });
            let (map, counts) = found.expect("the scan ran").with_context(named)?;
            let inner = std::mem::replace(&mut job.rule, TileRule::Base);
            job.rule = TileRule::RowMap {
                map,
                inner: Some(Box::new(inner)),
            };
            job.tile_elems = spectral::row_block_elems(job.plan.shape());
            job.captured_counts = counts;
            return Ok(());
        }
        let (captured, counts) = self.capture(job)?;
        for (t, tau) in captured.taus.iter().enumerate() {
            spectral::refuse_nonfinite("svc", t, (0, n), tau).with_context(named)?;
        }
        let mut rows = Some(Transposed {
            taus: captured.taus,
            merged: Some(captured.merged),
            stored: (m, n),
        });
        let mut update = None;
        self.backend.run_cpu_work(&mut || {
            let cx = MatrixWork {
                threads: rayon::current_num_threads(),
                what: &what,
                backend: self.backend,
            };
            let rows = rows.take().expect("run once");
            update = Some(spectral::calibrate_whole(rows, alpha, &cx));
        });
        job.rule = TileRule::Update(update.expect("the work ran").with_context(named)?);
        job.captured_counts = counts;
        Ok(())
    }

    /// SVC's map of a tall matrix from one more read of its tiles, each merged by the job's rule
    /// (plain RAM's counts kept, as `capture`'s).
    fn calibrate_rows(
        &self,
        job: &TensorJob,
        shape: (usize, usize),
        alpha: f64,
        cx: &MatrixWork,
    ) -> Result<(spectral::RowMap, Option<TileCounts>)> {
        let counting = self.counted.is_some();
        let mut counts = TileCounts::zeros(if counting { job.present.len() } else { 0 });
        let (mut scratch, mut out, mut base) = (TileScratch::default(), Vec::new(), Vec::new());
        let mut merged_of = |tile: &Tile, start: u64, merged: &mut Vec<f32>| -> Result<()> {
            tiles::resize_exact(&mut out, tile.len * 4, 0);
            let f32_out = (DType::F32, &mut out[..]);
            self.merge_tile(job, tile, start, f32_out, &mut counts, &mut scratch)?;
            tiles::resize_exact(&mut base, tile.len, 0.0);
            decode(tile.dtype, tile.base, &mut base);
            tiles::resize_exact(merged, tile.len, 0.0);
            decode(DType::F32, &out, merged);
            merged.iter_mut().zip(&base).for_each(|(m, b)| *m -= b);
            Ok(())
        };
        let mut buffers = ScanBuffers::new(self.inputs.agents.len());
        let (inputs, plan) = (self.inputs, job.plan);
        let mut scans = TensorScans::new((inputs, plan, &job.present), &self.pass, 0, &mut buffers);
        scans.pass.scan_nonfinite = self.pass.scan_nonfinite;
        let mut rows = FileRows {
            scans: &mut scans,
            shape,
            method: "svc",
            merged: Some(&mut merged_of),
        };
        let map = spectral::calibrate_rows(&mut rows, alpha, cx)?;
        let counts = counting
            .then(|| super::probe::to_global(&counts, &job.present, self.inputs.agents.len()));
        Ok((map, counts))
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
