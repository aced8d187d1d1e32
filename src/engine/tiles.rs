//! Tiles: how a pass reads a tensor (the base and the agents holding it) in runs of elements,
//! in order for statistics scans or on every worker at once for the probe and merge passes.

use crate::backend::Tile;
use crate::checkpoint::CheckpointWriter;
pub(super) use crate::inputs::resize_exact;
use crate::inputs::{BaseTile, Inputs, SourceRead, TensorPlan, TensorSource, TileBytes};
use anyhow::Result;
use indicatif::ProgressBar;
use rayon::prelude::*;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Condvar, Mutex};

/// Reusable tile buffers: one for the base, one per agent.
pub(super) struct TileBuffers {
    pub(super) base: TileBytes,
    pub(super) agents: Vec<TileBytes>,
    /// What the buffers hold when a tile loop read a run of tiles at once ([`READ_RUN_BYTES`]):
    /// (the loop's tensor, first element, elements).
    window: Option<(usize, usize, usize)>,
}

/// Bytes of each input a tile loop's worker reads at once when its tiles are under half of it:
/// a run of consecutive tiles, each then handed out from the buffers (one `pread` per input per
/// run, not per tile; the tiles, and so the bytes, stay the same). Tiles of half or more read
/// alone: the CPU backend's 128 KiB tiles stay in L2 from the read to the write.
pub(super) const READ_RUN_BYTES: usize = 1 << 18;

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
            base: TileBytes::default(),
            agents: (0..agents).map(|_| TileBytes::default()).collect(),
            window: None,
        }
    }

    /// Reads elements `start..start + len` of `read.plan` for the base and the present agents
    /// (one input per core when `read.spread`, else on the calling thread), and inspects each
    /// while its bytes are in cache: feeds the input's running checksum and, when
    /// `read.finite_only`, fails on the first NaN or ±Inf, naming tensor, file and element.
    pub(super) fn load(&mut self, read: &TileRead, (start, len): (usize, usize)) -> Result<()> {
        self.window = None;
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
        let base_source = plan.source(inputs, None);
        // Spreading a small tile over threads costs more than reading it.
        let parallel = spread && len * tile_dtype.size() >= 1 << 17;
        if plan.vocab.is_none()
            && !present.is_empty()
            && present.iter().all(|&t| plan.agent_is_the_base(inputs, t))
        {
            return self.load_the_base_once(&ctx, base_source, (start, len));
        }
        let mut jobs: Vec<(TensorSource, &mut TileBytes)> = (present.iter())
            .map(|&t| plan.source(inputs, Some(t)))
            .zip(self.agents.iter_mut())
            .collect();
        if jobs.iter().any(|(source, _)| source.is_lora()) {
            // The base first: a LoRA agent's θ₀ is the base's tile, which its read copies instead
            // of reading the base's file again.
            base_source.read(&ctx, (start, len), &mut self.base, None)?;
            let base = base_source.as_base(&self.base);
            read_sources(&ctx, (start, len), jobs, Some(&base), parallel)
        } else {
            jobs.insert(0, (base_source, &mut self.base));
            read_sources(&ctx, (start, len), jobs, None, parallel)
        }
    }

    /// A conversion's tile (the one model is its own layout): read once, as the base, and copied
    /// as the agent (whose file's checksum reads from the file what its tiles did not feed it).
    fn load_the_base_once(
        &mut self,
        ctx: &SourceRead,
        source: TensorSource,
        range: (usize, usize),
    ) -> Result<()> {
        source.read(ctx, range, &mut self.base, None)?;
        for buf in self.agents.iter_mut() {
            buf.resize_exact(self.base.len());
            buf.copy_from_slice(&self.base);
        }
        Ok(())
    }

    /// [`Self::load`]s elements `start..start + len` and hands them to `visit` as one [`Tile`].
    pub(super) fn visit<R>(
        &mut self,
        read: &TileRead,
        (start, len): (usize, usize),
        visit: impl FnOnce(&Tile) -> Result<R>,
    ) -> Result<R> {
        self.load(read, (start, len))?;
        self.hand_out(read, (0, len), visit)
    }

    /// Hands `len` elements of the buffers, from element `at` of what they hold, to `visit` as
    /// one [`Tile`].
    fn hand_out<R>(
        &self,
        read: &TileRead,
        (at, len): (usize, usize),
        visit: impl FnOnce(&Tile) -> Result<R>,
    ) -> Result<R> {
        let dtype = read.plan.tile_dtype(read.inputs);
        let bytes = at * dtype.size()..(at + len) * dtype.size();
        let agents: Vec<&[u8]> = self.agents[..read.present.len()]
            .iter()
            .map(|v| &v[bytes.clone()])
            .collect();
        visit(&Tile {
            dtype,
            len,
            base: &self.base[bytes],
            agents: &agents,
        })
    }
}

/// Reads each source's elements `start..start + len` into its buffer, on the pool's threads at
/// once when `parallel`; the first failure in input order is returned.
fn read_sources(
    ctx: &SourceRead,
    range: (usize, usize),
    jobs: Vec<(TensorSource, &mut TileBytes)>,
    base: Option<&BaseTile>,
    parallel: bool,
) -> Result<()> {
    let load_one =
        |(source, buf): (TensorSource, &mut TileBytes)| source.read(ctx, range, buf, base);
    let results: Vec<Result<()>> = if parallel {
        jobs.into_par_iter().map(load_one).collect()
    } else {
        jobs.into_iter().map(load_one).collect()
    };
    results.into_iter().collect()
}

impl TileBuffers {
    /// Hands tile `(start, len)` of the loop's tensor `j` to `visit`, from the buffers when the
    /// run read last holds it, else after reading elements `start..run_end` (the tile and the
    /// rest of its run) — inspected and checksummed as [`Self::load`] does, once.
    fn visit_in_run<R>(
        &mut self,
        read: &TileRead,
        (j, start, len, run_end): (usize, usize, usize, usize),
        visit: impl FnOnce(&Tile) -> Result<R>,
    ) -> Result<R> {
        let held = |&(wj, ws, wl): &(usize, usize, usize)| {
            wj == j && ws <= start && start + len <= ws + wl
        };
        let first = match self.window {
            Some(w) if held(&w) => w.1,
            _ => {
                self.load(read, (start, run_end - start))?;
                self.window = Some((j, start, run_end - start));
                start
            }
        };
        self.hand_out(read, (start - first, len), visit)
    }
}

/// Bytes of each input a tile loop reads at once ([`READ_RUN_BYTES`]), or 0 (tile by tile): in a
/// sample (`stride` > 1), whose tiles are not consecutive.
pub(super) fn run_bytes(stride: usize) -> usize {
    if stride > 1 {
        0
    } else {
        READ_RUN_BYTES
    }
}

/// A worker's output bytes of consecutive small tiles of one tensor, written at once: one
/// `pwrite` per run of tiles, as they were read ([`run_bytes`]). Tiles of half a run or more
/// are written alone, while in cache. A run whose file another worker is writing to is kept
/// ([`PENDING_BYTES`] at most) and written by the next write that finds the file free, so the
/// worker merges on instead of spinning on the file's lock.
pub(super) struct WriteRun {
    /// (tensor in the writer's plan, byte of the tensor the bytes start at).
    at: (usize, u64),
    /// The run is `bytes[..held]`; the bytes after it were zeroed when the buffer first grew
    /// over them and are overwritten before they are read, so a run's room is not zeroed again
    /// every tile (a memset of every output byte, 1.3 % of a `ram` merge).
    bytes: Vec<u8>,
    held: usize,
    /// The loop's [`run_bytes`].
    limit: usize,
    /// Runs kept while their file was busy: (tensor, first byte, bytes).
    pending: Vec<(usize, u64, Vec<u8>)>,
    /// Buffers of runs written since, for the next runs ([`SPARE_BUFFERS`] at most).
    spare: Vec<Vec<u8>>,
}

/// Output bytes a worker keeps at most while the file is busy ([`WriteRun`]): four of the CPU
/// backend's default tiles.
const PENDING_BYTES: usize = 1 << 19;

/// Buffers of written runs a worker keeps for its next runs; the rest are freed. A buffer keeps
/// the capacity of the largest run it held, so an unbounded list — after many small kept runs,
/// each buffer later grown by a full run — could hold far more than [`PENDING_BYTES`].
const SPARE_BUFFERS: usize = 4;

impl WriteRun {
    /// Output runs of at most `limit` bytes (0: tile by tile).
    pub(super) fn new(limit: usize) -> WriteRun {
        WriteRun {
            at: (0, 0),
            bytes: Vec::new(),
            held: 0,
            limit,
            pending: Vec::new(),
            spare: Vec::new(),
        }
    }

    /// Room for `len` output bytes of tensor `index` from byte `start`: after the bytes held when
    /// they follow them and the run has room, else after passing those on ([`Self::ship`]).
    pub(super) fn room(
        &mut self,
        writer: &CheckpointWriter,
        (index, start): (usize, u64),
        len: usize,
    ) -> Result<&mut [u8]> {
        let follows = self.at.0 == index && self.at.1 + self.held as u64 == start;
        if !(follows && self.held + len <= self.limit) {
            self.ship(writer)?;
            self.at = (index, start);
        }
        let held = self.held;
        if held == 0 && len > self.bytes.capacity() {
            // A tile alone (or a run's first) gets exactly its bytes, as every tile buffer.
            resize_exact(&mut self.bytes, len, 0);
        } else if self.bytes.len() < held + len {
            self.bytes.resize(held + len, 0);
        }
        self.held = held + len;
        Ok(&mut self.bytes[held..held + len])
    }

    /// After a tile's `len` bytes are in [`Self::room`]: a tile of half a run or more is passed
    /// on now, while in cache; smaller ones wait for the run to fill.
    pub(super) fn tile_done(&mut self, writer: &CheckpointWriter, len: usize) -> Result<()> {
        if 2 * len >= self.limit {
            self.ship(writer)?;
        }
        Ok(())
    }

    /// Writes the run held, and the runs kept before it, where their files are free; keeps the
    /// run where its file is busy, unless that would keep more than [`PENDING_BYTES`]: then
    /// waits for the files and writes everything.
    fn ship(&mut self, writer: &CheckpointWriter) -> Result<()> {
        if self.held == 0 {
            return Ok(());
        }
        let mut kept = 0;
        for (index, start, bytes) in std::mem::take(&mut self.pending) {
            if writer.try_write_at(index, start, &bytes)? {
                self.recycle(bytes);
            } else {
                kept += bytes.len();
                self.pending.push((index, start, bytes));
            }
        }
        if writer.try_write_at(self.at.0, self.at.1, &self.bytes[..self.held])? {
            self.held = 0;
        } else if kept + self.held <= PENDING_BYTES {
            let next = self.spare.pop().unwrap_or_default();
            let mut bytes = std::mem::replace(&mut self.bytes, next);
            bytes.truncate(self.held);
            self.pending.push((self.at.0, self.at.1, bytes));
            self.held = 0;
        } else {
            self.flush(writer)?;
        }
        Ok(())
    }

    /// Keeps a written run's buffer for a next run, while fewer than [`SPARE_BUFFERS`] are kept.
    fn recycle(&mut self, bytes: Vec<u8>) {
        if self.spare.len() < SPARE_BUFFERS {
            self.spare.push(bytes);
        }
    }

    /// Writes the runs kept and the bytes held, waiting for their files (at the end of the loop,
    /// or when too much is kept).
    pub(super) fn flush(&mut self, writer: &CheckpointWriter) -> Result<()> {
        for (index, start, bytes) in std::mem::take(&mut self.pending) {
            writer.write_at(index, start, &bytes)?;
            self.recycle(bytes);
        }
        if self.held > 0 {
            writer.write_at(self.at.0, self.at.1, &self.bytes[..self.held])?;
            self.held = 0;
        }
        Ok(())
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
    // Tiles a worker takes at once: a run of about run_bytes per input, read at once.
    let bytes = |t: &TensorTiles| t.tile_elems.max(1) * t.plan.tile_dtype(inputs).size();
    let run = match (run_bytes(stride), tensors.iter().map(bytes).max()) {
        (r, Some(b)) if 2 * b < r => r / b,
        _ => 1,
    };
    let next = AtomicUsize::new(0);
    let failed = AtomicBool::new(false);
    let first_error: Mutex<Option<(usize, anyhow::Error)>> = Mutex::new(None);
    let states = Mutex::new(Vec::new());
    let worker = || {
        let mut buffers = TileBuffers::new(inputs.agents.len());
        let mut state = init();
        // Every tile of a run taken runs (until one fails), so the tiles before a failing one
        // all ran and the earliest failure is reported, whatever the timing.
        loop {
            let first = next.fetch_add(1, Ordering::Relaxed) * run;
            if first * stride >= count || failed.load(Ordering::Relaxed) {
                break;
            }
            let run_tiles = (first..first + run).map(|r| r * stride);
            let mut run_failed = false;
            for g in run_tiles.take_while(|&g| g < count) {
                let j = schedule.tensor_of(g);
                let TensorTiles { plan, present, .. } = tensors[j];
                let at = schedule.tile_at(tensors, g, (first + run) * stride, stride);
                // After a failure the run's later tiles are only counted done (a LoRA tensor
                // after them may be waiting for them).
                let done = if run_failed {
                    Ok(())
                } else {
                    schedule.wait_turn(j);
                    let read = TileRead {
                        inputs,
                        plan,
                        present,
                        finite_only: scan_nonfinite,
                        spread: false,
                    };
                    inputs
                        .cancel
                        .check()
                        .map_err(anyhow::Error::from)
                        .and_then(|()| {
                            buffers.visit_in_run(&read, (j, at.start, at.len, at.run_end), |tile| {
                                visit(&mut state, j, at.index, at.start as u64, tile)
                            })
                        })
                };
                schedule.tile_done(j, || {
                    if last_read {
                        inputs.forget_lora_tensor(plan);
                    }
                });
                match done {
                    Ok(()) if run_failed => {}
                    Ok(()) => progress
                        .inc((at.len * plan.base.entry.dtype.size() * (1 + present.len())) as u64),
                    Err(e) => {
                        run_failed = true;
                        failed.store(true, Ordering::Relaxed);
                        let mut first = first_error.lock().unwrap_or_else(|p| p.into_inner());
                        if first.as_ref().is_none_or(|(h, _)| g < *h) {
                            *first = Some((g, e));
                        }
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

/// A tile of a tile loop: its index in its tensor, its elements, and the end of the elements its
/// worker's run reads with it.
struct TileAt {
    index: usize,
    start: usize,
    len: usize,
    run_end: usize,
}

/// A tile loop's numbering — each tensor's first tile, then the end — and its order of LoRA
/// tensors: one at a time, each waiting for the one before it (its pairs dropped) to finish, so
/// the pass holds one tensor's pairs, shared by its workers. The tiles before a waiting worker's
/// were all handed out, to workers that wait only for earlier tensors: the wait ends.
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

    /// Where tile `g` of the loop lies in its tensor, in a run taken by a worker that ends
    /// before loop tile `run_end` (visiting every `stride`-th tile).
    fn tile_at(&self, tensors: &[TensorTiles], g: usize, run_end: usize, stride: usize) -> TileAt {
        let j = self.tensor_of(g);
        let (numel, step) = (tensors[j].plan.numel(), tensors[j].tile_elems.max(1));
        let index = g - self.firsts[j];
        let start = index * step;
        // The run's tiles of this tensor: from g to the run's end or the tensor's, at least g.
        let tiles = (run_end.min(self.firsts[j + 1]) - g).div_ceil(stride);
        TileAt {
            index,
            start,
            len: step.min(numel - start),
            run_end: (start + tiles * step).min(numel),
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

/// `tile_elems` rounded down to whole rows of `row_len` (at least one row; 0: no rows).
pub(super) fn whole_rows(tile_elems: usize, row_len: u64) -> usize {
    match row_len as usize {
        0 => tile_elems,
        r => (tile_elems - tile_elems % r).max(r),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checkpoint::{DType, OutputTensor};

    /// Runs ready while another worker writes to the file are kept and written later, each at
    /// its place: the file ends with every byte, whatever was busy when.
    #[test]
    fn runs_kept_while_the_file_is_busy_are_all_written() {
        let dir = tempfile::tempdir().unwrap();
        let elems = 16 * 1024;
        let tensors = vec![OutputTensor {
            name: "t".into(),
            dtype: DType::F32,
            shape: vec![elems].into(),
        }];
        let writer = CheckpointWriter::new(dir.path(), tensors, u64::MAX).unwrap();
        let want: Vec<u8> = (0..elems * 4).map(|i| (i * 7 % 251) as u8).collect();
        // Tiles of 1 KiB in runs of 4 KiB: the first half while the file is busy.
        let mut run = WriteRun::new(4096);
        let tile = 1024;
        let put = |run: &mut WriteRun, k: usize, bytes: &[u8]| {
            let out = run.room(&writer, (0, (k * tile) as u64), tile).unwrap();
            out.copy_from_slice(bytes);
            run.tile_done(&writer, tile).unwrap();
        };
        let half = want.len() / tile / 2;
        {
            let _busy = writer.hold_file(0);
            for (k, bytes) in want.chunks(tile).enumerate().take(half) {
                put(&mut run, k, bytes);
            }
            assert!(!run.pending.is_empty(), "runs kept while the file is busy");
            let kept: usize = run.pending.iter().map(|p| p.2.len()).sum();
            assert!(kept <= PENDING_BYTES);
        }
        // The file is free again: the next run's write takes the kept ones first.
        for (k, bytes) in want.chunks(tile).enumerate().skip(half) {
            put(&mut run, k, bytes);
        }
        run.flush(&writer).unwrap();
        assert!(run.pending.is_empty());
        assert!(run.spare.len() <= SPARE_BUFFERS);
        writer.finish().unwrap();
        let file = std::fs::read(dir.path().join("model.safetensors")).unwrap();
        assert_eq!(&file[file.len() - want.len()..], &want[..]);
    }

    /// Runs of tiles of every size — a tensor's short last tile, a tile alone larger than the
    /// buffer, runs that end and start in the middle of another's room — write exactly their
    /// bytes at their places: no byte of an earlier, longer run is written again.
    #[test]
    fn runs_of_uneven_tiles_write_exactly_their_bytes() {
        let dir = tempfile::tempdir().unwrap();
        // Two f32 tensors of 1000 and 3000 elements (4000 and 12000 bytes).
        let sizes = [1000usize, 3000];
        let tensors = sizes
            .iter()
            .enumerate()
            .map(|(i, &n)| OutputTensor {
                name: format!("t{i}").into(),
                dtype: DType::F32,
                shape: vec![n].into(),
            })
            .collect();
        let writer = CheckpointWriter::new(dir.path(), tensors, u64::MAX).unwrap();
        let mut run = WriteRun::new(4096);
        let bytes = |index: usize| -> Vec<u8> {
            (0..sizes[index] * 4)
                .map(|i| ((i + 31 * index) % 253) as u8)
                .collect()
        };
        // The second tensor first, so bytes written past the first one's end would stay.
        for (index, tile) in [(1, 700usize), (0, 700), (1, 5000), (0, 1000)] {
            for (k, part) in bytes(index).chunks(tile).enumerate() {
                let out = run
                    .room(&writer, (index, (k * tile) as u64), part.len())
                    .unwrap();
                assert_eq!(out.len(), part.len());
                out.copy_from_slice(part);
                run.tile_done(&writer, part.len()).unwrap();
            }
        }
        run.flush(&writer).unwrap();
        let want = [bytes(0), bytes(1)].concat();
        writer.finish().unwrap();
        let file = std::fs::read(dir.path().join("model.safetensors")).unwrap();
        assert_eq!(&file[file.len() - want.len()..], &want[..]);
    }
}
