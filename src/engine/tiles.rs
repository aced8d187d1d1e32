//! Tiles: how a pass reads a tensor (the base and the agents holding it) in runs of elements,
//! in order for statistics scans or on every worker at once for the probe and merge passes.

use crate::backend::Tile;
pub(super) use crate::inputs::resize_exact;
use crate::inputs::{Inputs, SourceRead, TensorPlan, TensorSource};
use anyhow::Result;
use indicatif::{ProgressBar, ProgressStyle};
use rayon::prelude::*;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Condvar, Mutex};

/// Reusable tile buffers: one for the base, one per agent.
pub(super) struct TileBuffers {
    pub(super) base: Vec<u8>,
    pub(super) agents: Vec<Vec<u8>>,
}

/// What a tile read takes from: the inputs, the tensor and the agents read with the base, and how
/// (refusing NaN/±Inf or not; spread over the cores or on the calling thread).
#[derive(Clone, Copy)]
pub(super) struct TileRead<'a> {
    pub(super) inputs: &'a Inputs,
    pub(super) plan: &'a TensorPlan,
    pub(super) present: &'a [usize],
    pub(super) finite_only: bool,
    pub(super) spread: bool,
}

impl TileBuffers {
    pub(super) fn new(agents: usize) -> TileBuffers {
        TileBuffers {
            base: Vec::new(),
            agents: vec![Vec::new(); agents],
        }
    }

    /// Reads elements `start..start + len` of `read.plan` for the base and the present agents
    /// (one input per core when `read.spread`, else on the calling thread), and inspects each
    /// while its bytes are in cache: feeds the input's running checksum and, when
    /// `read.finite_only`, fails on the first NaN or ±Inf, naming tensor, file and element.
    pub(super) fn load(&mut self, read: &TileRead, (start, len): (usize, usize)) -> Result<()> {
        let TileRead {
            inputs,
            plan,
            present,
            finite_only,
            spread,
        } = *read;
        let tile_dtype = plan.tile_dtype(inputs);
        let ctx = SourceRead {
            inputs,
            plan,
            finite_only,
        };
        let sources = std::iter::once(plan.source(inputs, None))
            .chain(present.iter().map(|&t| plan.source(inputs, Some(t))));
        let jobs: Vec<(TensorSource, &mut Vec<u8>)> = sources
            .zip(std::iter::once(&mut self.base).chain(self.agents.iter_mut()))
            .collect();
        let load_one = |(source, buf): (TensorSource, &mut Vec<u8>)| -> Result<()> {
            source.read(&ctx, (start, len), buf)
        };
        let bytes = len * tile_dtype.size();
        // Spreading a small tile over threads costs more than reading it; results keep input order.
        let results: Vec<Result<()>> = if spread && bytes >= 1 << 17 {
            jobs.into_par_iter().map(load_one).collect()
        } else {
            jobs.into_iter().map(load_one).collect()
        };
        results.into_iter().collect()
    }

    /// [`Self::load`]s elements `start..start + len` and hands them to `visit` as one [`Tile`].
    pub(super) fn visit<R>(
        &mut self,
        read: &TileRead,
        (start, len): (usize, usize),
        visit: impl FnOnce(&Tile) -> Result<R>,
    ) -> Result<R> {
        self.load(read, (start, len))?;
        let agents: Vec<&[u8]> = self.agents[..read.present.len()]
            .iter()
            .map(|v| v.as_slice())
            .collect();
        visit(&Tile {
            dtype: read.plan.tile_dtype(read.inputs),
            len,
            base: &self.base,
            agents: &agents,
        })
    }
}

/// One tensor's part in a tile loop ([`par_tiles`]): its plan, the agents read with the base,
/// and its tile size.
pub(super) struct TensorTiles<'a> {
    pub(super) plan: &'a TensorPlan,
    pub(super) present: &'a [usize],
    pub(super) tile_elems: usize,
}

impl TensorTiles<'_> {
    pub(super) fn count(&self) -> usize {
        tile_count(self.plan, self.tile_elems)
    }
}

/// Tiles of `tile_elems` elements (at least one) that `plan` is cut into.
pub(super) fn tile_count(plan: &TensorPlan, tile_elems: usize) -> usize {
    plan.numel().div_ceil(tile_elems.max(1))
}

/// Tiles a batch of tensors' tile loop should hold at least: the workers wait for each other
/// only at the end of a batch, so small tensors (norms, biases) go together.
pub(super) const BATCH_TILES: usize = 256;

/// How a tile loop ([`par_tiles`]) runs: over these inputs, refusing NaN/±Inf or not, on the
/// workers `run_workers` starts, counting progress on `progress`, every `stride`-th tile.
#[derive(Clone, Copy)]
pub(super) struct TileLoop<'a> {
    pub(super) inputs: &'a Inputs,
    pub(super) scan_nonfinite: bool,
    pub(super) run_workers: &'a dyn Fn(&(dyn Fn() + Sync)),
    pub(super) progress: &'a ProgressBar,
    pub(super) stride: usize,
    /// Drop each tensor's decoded LoRA pairs once its tiles are done: the pass is the tensor's
    /// last read (not a statistics scan, whose tensor is read again by the next scan).
    pub(super) last_read: bool,
}

/// The tile loop of the probe and merge passes: every tile of `tensors`, one tensor after the
/// other, read for the base and the tensor's agents and handed to `visit` with (index in
/// `tensors`, tile index, first element) on the workers `how.run_workers` starts (the backend's,
/// [`Backend::run_workers`], or the CPU's for statistics); with `how.stride` > 1 only tiles
/// 0, `stride`, 2·`stride`, … (a sample). Each worker has its own tile buffers and a `state` from
/// `init`, and takes tile after tile, so reading, computing and writing a tile happen on one
/// core while its bytes are in cache, and the cores wait for each other only at the end. Tiles
/// start in order and finish in any order. Returns the workers' states; on failure, the error of
/// the earliest failing tile (the tiles before it all ran, so the same input always reports the
/// same error).
pub(super) fn par_tiles<S: Send>(
    how: &TileLoop,
    tensors: &[TensorTiles],
    init: impl Fn() -> S + Sync,
    visit: impl Fn(&mut S, usize, usize, u64, &Tile) -> Result<()> + Sync,
) -> Result<Vec<S>> {
    let TileLoop {
        inputs,
        scan_nonfinite,
        run_workers,
        progress,
        stride,
        last_read,
    } = *how;
    let schedule = Schedule::new(inputs, tensors, stride);
    let count = schedule.count();
    let next = AtomicUsize::new(0);
    let failed = AtomicBool::new(false);
    let first_error: Mutex<Option<(usize, anyhow::Error)>> = Mutex::new(None);
    let states = Mutex::new(Vec::new());
    let worker = || {
        let mut buffers = TileBuffers::new(inputs.agents.len());
        let mut state = init();
        loop {
            let g = next.fetch_add(1, Ordering::Relaxed) * stride;
            if g >= count || failed.load(Ordering::Relaxed) {
                break;
            }
            let j = schedule.tensor_of(g);
            let TensorTiles {
                plan,
                present,
                tile_elems,
            } = tensors[j];
            schedule.wait_turn(j);
            let (i, step, numel) = (g - schedule.firsts[j], tile_elems.max(1), plan.numel());
            let (start, len) = (i * step, step.min(numel - i * step));
            let read = TileRead {
                inputs,
                plan,
                present,
                finite_only: scan_nonfinite,
                spread: false,
            };
            let done = inputs
                .cancel
                .check()
                .map_err(anyhow::Error::from)
                .and_then(|()| {
                    buffers.visit(&read, (start, len), |tile| {
                        visit(&mut state, j, i, start as u64, tile)
                    })
                });
            schedule.tile_done(j, || {
                if last_read {
                    inputs.forget_lora_tensor(plan);
                }
            });
            match done {
                Ok(()) => {
                    progress.inc((len * plan.base.entry.dtype.size() * (1 + present.len())) as u64)
                }
                Err(e) => {
                    failed.store(true, Ordering::Relaxed);
                    let mut first = first_error.lock().unwrap_or_else(|p| p.into_inner());
                    if first.as_ref().is_none_or(|(h, _)| g < *h) {
                        *first = Some((g, e));
                    }
                }
            }
        }
        states.lock().unwrap_or_else(|p| p.into_inner()).push(state);
    };
    run_workers(&worker);
    if let Some((_, e)) = first_error.into_inner().unwrap_or_else(|p| p.into_inner()) {
        return Err(e);
    }
    Ok(states.into_inner().unwrap_or_else(|p| p.into_inner()))
}

/// A tile loop's numbering — each tensor's first tile, then the end — and its order of LoRA
/// tensors: one at a time, each waiting for the one before it (its pairs dropped) to finish, so
/// the pass holds one tensor's pairs, shared by its workers (`engine::tile_elems` leaves each
/// worker room for its share). The tiles before a waiting worker's were all handed out, to
/// workers that wait only for earlier tensors: the wait ends.
struct Schedule {
    firsts: Vec<usize>,
    /// Tiles of each tensor still to finish (those the stride visits).
    left: Vec<AtomicUsize>,
    /// For each LoRA tensor, the LoRA tensor before it in the loop.
    wait_for: Vec<Option<usize>>,
    finished: Vec<AtomicBool>,
    gate: (Mutex<()>, Condvar),
}

impl Schedule {
    fn new(inputs: &Inputs, tensors: &[TensorTiles], stride: usize) -> Schedule {
        let firsts: Vec<usize> = std::iter::once(0)
            .chain(tensors.iter().scan(0, |end, t| {
                *end += t.count();
                Some(*end)
            }))
            .collect();
        let left: Vec<AtomicUsize> = firsts
            .windows(2)
            .map(|w| AtomicUsize::new(w[1].div_ceil(stride) - w[0].div_ceil(stride)))
            .collect();
        let wait_for = tensors
            .iter()
            .enumerate()
            .scan(None, |last, (j, t)| {
                if t.plan.lora_bytes(inputs) == 0 {
                    return Some(None);
                }
                Some(last.replace(j))
            })
            .collect();
        // A tensor without tiles to visit (empty, or skipped by the stride) is finished already.
        let finished = left
            .iter()
            .map(|l| AtomicBool::new(l.load(Ordering::Relaxed) == 0))
            .collect();
        Schedule {
            firsts,
            left,
            wait_for,
            finished,
            gate: (Mutex::new(()), Condvar::new()),
        }
    }

    /// Tiles in the loop.
    fn count(&self) -> usize {
        *self.firsts.last().expect("one entry at least")
    }

    /// The tensor of tile `g`.
    fn tensor_of(&self, g: usize) -> usize {
        self.firsts.partition_point(|&f| f <= g) - 1
    }

    /// Waits for the LoRA tensor before tensor `j`, if any, to finish.
    fn wait_turn(&self, j: usize) {
        let Some(before) = self.wait_for[j] else {
            return;
        };
        if self.finished[before].load(Ordering::Acquire) {
            return;
        }
        let mut open = self.gate.0.lock().unwrap_or_else(|p| p.into_inner());
        while !self.finished[before].load(Ordering::Acquire) {
            open = self.gate.1.wait(open).unwrap_or_else(|p| p.into_inner());
        }
    }

    /// Counts a tile of tensor `j` done; after its last, `last` runs (its LoRA pairs go) and
    /// the tensor is finished.
    fn tile_done(&self, j: usize, last: impl FnOnce()) {
        if self.left[j].fetch_sub(1, Ordering::AcqRel) == 1 {
            last();
            let _open = self.gate.0.lock().unwrap_or_else(|p| p.into_inner());
            self.finished[j].store(true, Ordering::Release);
            self.gate.1.notify_all();
        }
    }
}

/// Consecutive runs of `plans` of [`BATCH_TILES`] tiles or more (the last may hold fewer).
pub(super) fn batches(plans: &[TensorPlan], tile_elems: usize) -> Vec<std::ops::Range<usize>> {
    let mut runs = Vec::new();
    let (mut from, mut tiles) = (0, 0);
    for (i, plan) in plans.iter().enumerate() {
        tiles += tile_count(plan, tile_elems);
        if tiles >= BATCH_TILES || i + 1 == plans.len() {
            runs.push(from..i + 1);
            (from, tiles) = (i + 1, 0);
        }
    }
    runs
}

pub(super) fn progress_bar(total: u64, show: bool, message: &str) -> ProgressBar {
    if !show {
        return ProgressBar::hidden();
    }
    let bar = ProgressBar::new(total);
    bar.set_style(
        ProgressStyle::with_template(
            "{msg:>8} [{bar:40}] {bytes}/{total_bytes} {binary_bytes_per_sec} eta {eta}",
        )
        .expect("valid template")
        .progress_chars("=> "),
    );
    bar.set_message(message.to_string());
    bar
}

/// `tile_elems` rounded down to whole rows of `row_len` (at least one row; 0: no rows).
pub(super) fn whole_rows(tile_elems: usize, row_len: u64) -> usize {
    match row_len as usize {
        0 => tile_elems,
        r => (tile_elems - tile_elems % r).max(r),
    }
}
