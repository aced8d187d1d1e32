//! Tiles: how a pass reads a tensor (the base and the agents holding it) in runs of elements,
//! in order for statistics scans or on every worker at once for the probe and merge passes.

use crate::backend::Tile;
use crate::checkpoint::dtype::{decode, decode_one, first_nonfinite};
use crate::checkpoint::{ModelFolder, ModelTensor};
use crate::inputs::{Inputs, TensorPlan};
use crate::slices::Source;
use crate::vocabulary::{RowFrom, VocabTensor};
use anyhow::{bail, Result};
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
        let sources = std::iter::once((plan.base_source(), plan.base_folder(inputs), &plan.base))
            .chain(present.iter().map(|&t| {
                let at = plan
                    .agent(inputs, t)
                    .expect("present agents have the tensor");
                (Source::Agent(t), &inputs.agents[t], at)
            }));
        let jobs: Vec<(Source, &ModelFolder, &ModelTensor, &mut Vec<u8>)> = sources
            .zip(std::iter::once(&mut self.base).chain(self.agents.iter_mut()))
            .map(|((source, model, tensor), buf)| (source, model, tensor, buf))
            .collect();
        let load_one = |(source, model, tensor, buf): (
            Source,
            &ModelFolder,
            &ModelTensor,
            &mut Vec<u8>,
        )|
         -> Result<()> {
            if let Some(v) = &plan.vocab {
                return load_rows(read, &v.rows, source, (start, len), buf);
            }
            // Each input in its own dtype; checked and hashed as stored. Mixed dtypes: the tile
            // is f32, to which bf16 and f16 convert exactly; a LoRA agent's tensor is θ₀ plus its
            // update, added in f32. Such a tile's raw bytes are read into its tail and widened in
            // place front to back, so the tile's bytes are all it holds.
            let dtype = tensor.entry.dtype;
            let lora = model.lora_for(&tensor.entry.name);
            let widened = dtype != tile_dtype || lora.is_some();
            let size = if widened { 4 } else { dtype.size() };
            resize_exact(buf, len * size, 0);
            let tail = len * (size - dtype.size());
            let offset = (start * dtype.size()) as u64;
            model.read(tensor, offset, &mut buf[tail..])?;
            model.record_read(tensor, offset, &buf[tail..]);
            if finite_only {
                refuse_nonfinite(plan, model, tensor, &buf[tail..], start)?;
            }
            if widened {
                let mut raw = [0u8; RUN * 4];
                let mut run = [0.0f32; RUN];
                for i0 in (0..len).step_by(RUN) {
                    let n = RUN.min(len - i0);
                    // Run i0's f32 bytes end at 4·(i0 + n), before the next run's raw bytes.
                    let from = tail + i0 * dtype.size();
                    let raw = &mut raw[..n * dtype.size()];
                    raw.copy_from_slice(&buf[from..from + raw.len()]);
                    decode(dtype, raw, &mut run[..n]);
                    put_f32(buf, i0, &run[..n]);
                }
                // A LoRA agent's update over the whole tile at once: its terms are decoded once
                // for all the tile's rows.
                if let Some(l) = lora {
                    let entry = &tensor.entry;
                    let values = &mut buf[..len * 4];
                    l.add_update_bytes(&entry.name, &entry.shape, start as u64, values)?;
                    if finite_only {
                        refuse_nonfinite_update(tensor, l, values, start)?;
                    }
                }
            }
            Ok(())
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

/// Makes a buffer kept from tile to tile `len` long, for a tile that overwrites all of it (its
/// contents are not kept). Grown to exactly `len`, the old allocation freed first: `Vec::resize`
/// would double it and copy it, so a tile larger than the one before (a tensor's f32 tiles after
/// a smaller tensor's) would leave up to twice the planned bytes, and the allocator a hole.
pub(super) fn resize_exact<T: Clone>(buf: &mut Vec<T>, len: usize, fill: T) {
    if len > buf.capacity() {
        *buf = Vec::new();
        buf.reserve_exact(len);
    }
    buf.resize(len, fill);
}

/// Elements widened to f32 at a time.
const RUN: usize = 1024;

/// Writes `values` into an f32 tile's bytes from element `at`.
fn put_f32(buf: &mut [u8], at: usize, values: &[f32]) {
    for (b, v) in buf[at * 4..(at + values.len()) * 4]
        .chunks_exact_mut(4)
        .zip(values)
    {
        b.copy_from_slice(&v.to_le_bytes());
    }
}

/// Decodes `raw` (elements of `tensor` from element `at`) into `values`, adding a LoRA agent's
/// update.
fn widen(
    model: &ModelFolder,
    tensor: &ModelTensor,
    raw: &[u8],
    at: u64,
    values: &mut [f32],
) -> Result<()> {
    decode(tensor.entry.dtype, raw, values);
    if let Some(l) = model.lora_for(&tensor.entry.name) {
        l.add_update(&tensor.entry.name, &tensor.entry.shape, at, values)?;
    }
    Ok(())
}

/// Fails on the first NaN or ±Inf of `raw` (elements of `tensor` from `start`), naming tensor,
/// file and element.
fn refuse_nonfinite(
    plan: &TensorPlan,
    model: &ModelFolder,
    tensor: &ModelTensor,
    raw: &[u8],
    start: usize,
) -> Result<()> {
    let dtype = tensor.entry.dtype;
    if let Some(i) = first_nonfinite(dtype, raw) {
        bail!(
            "tensor '{}' in {} has a non-finite value ({}) at element {}; rlmerge refuses NaN \
             and infinity unless --allow-nonfinite",
            plan.name(),
            model.file_of(tensor).display(),
            decode_one(dtype, raw, i),
            start + i
        );
    }
    Ok(())
}

/// The finiteness gate's second half for a LoRA agent: its stored base values passed
/// [`refuse_nonfinite`]; its values with the update added (`values`, f32 bytes of elements from
/// `start`) must be finite too — a NaN or ±Inf in A or B, or an update that overflows, is named.
fn refuse_nonfinite_update(
    tensor: &ModelTensor,
    lora: &crate::checkpoint::lora::LoraAdapter,
    values: &[u8],
    start: usize,
) -> Result<()> {
    let f32 = crate::checkpoint::DType::F32;
    match first_nonfinite(f32, values) {
        Some(i) => Err(lora.nonfinite_error(
            &tensor.entry.name,
            (start + i) as u64,
            decode_one(f32, values, i),
        )),
        None => Ok(()),
    }
}

/// Reads `out.len()` elements of input `source`'s copy of a re-indexed tensor from its element
/// `at`, as f32.
fn read_f32(read: &TileRead, source: Source, at: usize, out: &mut [f32]) -> Result<()> {
    let plan = read.plan;
    let (model, tensor) = if source == plan.base_source() {
        (plan.base_folder(read.inputs), &plan.base)
    } else {
        match source {
            Source::Agent(t) => match plan.agent(read.inputs, t) {
                Some(at) => (&read.inputs.agents[t], at),
                None => bail!(
                    "tensor '{}': its rows come from {}, which does not have it",
                    plan.name(),
                    read.inputs.agents[t].dir.display()
                ),
            },
            Source::Base => bail!(
                "tensor '{}': its rows come from the base, which does not enter its merge",
                plan.name()
            ),
        }
    };
    let size = tensor.entry.dtype.size();
    let mut raw = [0u8; RUN * 4];
    for (k, values) in out.chunks_mut(RUN).enumerate() {
        let from = at + k * RUN;
        let raw = &mut raw[..values.len() * size];
        model.read(tensor, (from * size) as u64, raw)?;
        if read.finite_only {
            refuse_nonfinite(plan, model, tensor, raw, from)?;
        }
        widen(model, tensor, raw, from as u64, values)?;
        if read.finite_only {
            if let Some(l) = model.lora_for(&tensor.entry.name) {
                refuse_nonfinite_update(tensor, l, bytemuck::cast_slice(values), from)?;
            }
        }
    }
    Ok(())
}

/// Elements `start..start + len` of input `source`'s copy of a re-indexed tensor (see
/// [`VocabTensor::row_from`]) into `buf` as f32: own rows read in runs, default rows from the
/// model named, means summed in f32 in order then divided once, padding rows the input's mean row.
/// Gathered a run at a time, so the tile's bytes are all it holds.
fn load_rows(
    read: &TileRead,
    rows: &VocabTensor,
    source: Source,
    (start, len): (usize, usize),
    buf: &mut Vec<u8>,
) -> Result<()> {
    resize_exact(buf, len * 4, 0);
    let mut run = [0.0f32; RUN];
    for i0 in (0..len).step_by(RUN) {
        let values = &mut run[..RUN.min(len - i0)];
        gather_rows(read, rows, source, start + i0, values)?;
        put_f32(buf, i0, values);
    }
    Ok(())
}

/// [`load_rows`] into `out`, from element `start`.
fn gather_rows(
    read: &TileRead,
    rows: &VocabTensor,
    source: Source,
    start: usize,
    out: &mut [f32],
) -> Result<()> {
    let h = rows.row_len;
    let end = start + out.len();
    let mut at = start;
    let mut scratch = Vec::new();
    while at < end {
        let (r, c0) = (at / h, at % h);
        let n = (h - c0).min(end - at);
        let from = rows.row_from(source, r);
        // Whole rows that continue a run of the same model's rows are read at once.
        let mut span = n;
        if let RowFrom::Row(s, row) = from {
            if c0 == 0 {
                let mut k = 1;
                while at + span + h <= end
                    && rows.row_from(source, r + k) == RowFrom::Row(s, row + k as u32)
                {
                    span += h;
                    k += 1;
                }
            }
        }
        let dst = &mut out[at - start..at - start + span];
        match from {
            RowFrom::Row(s, row) => read_f32(read, s, row as usize * h + c0, dst)?,
            RowFrom::Zero => dst.fill(0.0),
            RowFrom::Mean(list) => {
                dst.fill(0.0);
                scratch.resize(span, 0.0);
                for &(s, row) in list {
                    read_f32(read, s, row as usize * h + c0, &mut scratch)?;
                    dst.iter_mut().zip(&scratch).for_each(|(d, x)| *d += x);
                }
                let count = list.len() as f32;
                dst.iter_mut().for_each(|d| *d /= count);
            }
            RowFrom::Pad => {
                let mean = rows.pad_mean(source, || pad_mean(read, rows, source))?;
                dst.copy_from_slice(&mean[c0..c0 + span]);
            }
        }
        at += span;
    }
    Ok(())
}

/// Input `source`'s mean row over its re-indexed token rows (the padding rows' value, as
/// mergekit pads): summed in f64 a block of rows at a time, rounded once.
fn pad_mean(read: &TileRead, rows: &VocabTensor, source: Source) -> Result<Vec<f32>> {
    let h = rows.row_len;
    let tokens = rows.token_rows();
    let mut sum = vec![0.0f64; h];
    let block = (RUN * 64 / h.max(1)).max(1);
    let mut values = Vec::new();
    let mut r = 0;
    while r < tokens {
        let n = block.min(tokens - r);
        values.resize(n * h, 0.0);
        gather_rows(read, rows, source, r * h, &mut values)?;
        for row in values.chunks(h) {
            sum.iter_mut().zip(row).for_each(|(s, &x)| *s += x as f64);
        }
        r += n;
    }
    Ok(sum
        .iter()
        .map(|&s| (s / tokens.max(1) as f64) as f32)
        .collect())
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
    // The first tile of each tensor in the loop's numbering, then the end.
    let firsts: Vec<usize> = std::iter::once(0)
        .chain(tensors.iter().scan(0, |end, t| {
            *end += t.count();
            Some(*end)
        }))
        .collect();
    let count = *firsts.last().expect("one entry at least");
    // Tiles of each tensor still to finish (those the stride visits): at 0 its LoRA pairs go.
    let left: Vec<AtomicUsize> = firsts
        .windows(2)
        .map(|w| AtomicUsize::new(w[1].div_ceil(stride) - w[0].div_ceil(stride)))
        .collect();
    // One LoRA tensor at a time: each waits for the one before it (its pairs dropped) to finish,
    // so the pass holds one tensor's pairs, shared by its workers (`TensorPlan::tile_elems`
    // leaves each worker room for its share). The tiles before a waiting worker's were all
    // handed out, to workers that wait only for earlier tensors: the wait ends.
    // For each LoRA tensor, the LoRA tensor before it in the loop.
    let wait_for: Vec<Option<usize>> = tensors
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
    let finished: Vec<AtomicBool> = left
        .iter()
        .map(|l| AtomicBool::new(l.load(Ordering::Relaxed) == 0))
        .collect();
    let gate = (Mutex::new(()), Condvar::new());
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
            let j = firsts.partition_point(|&f| f <= g) - 1;
            let TensorTiles {
                plan,
                present,
                tile_elems,
            } = tensors[j];
            if let Some(before) = wait_for[j].filter(|&b| !finished[b].load(Ordering::Acquire)) {
                let mut open = gate.0.lock().unwrap_or_else(|p| p.into_inner());
                while !finished[before].load(Ordering::Acquire) {
                    open = gate.1.wait(open).unwrap_or_else(|p| p.into_inner());
                }
            }
            let (i, step, numel) = (g - firsts[j], tile_elems.max(1), plan.numel());
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
            if left[j].fetch_sub(1, Ordering::AcqRel) == 1 {
                if last_read {
                    inputs.forget_lora_tensor(plan);
                }
                let _open = gate.0.lock().unwrap_or_else(|p| p.into_inner());
                finished[j].store(true, Ordering::Release);
                gate.1.notify_all();
            }
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
