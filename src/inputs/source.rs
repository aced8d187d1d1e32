//! Reading an input tensor: one room for every kind of input (SPEC §5, §5b). A
//! [`TensorSource`] says how one input's copy of a planned tensor becomes tile values — stored
//! bytes as they are, bytes widened to f32 (inputs of mixed dtypes) with a LoRA agent's update
//! added, or rows re-indexed for the output's vocabulary — and every kind passes the same gate as
//! it is read: its bytes hashed into the input's checksum, and, unless `--allow-nonfinite`, the
//! first NaN or ±Inf refused with the tensor, file and element named ([`refuse_nonfinite`], and
//! for a LoRA update [`refuse_nonfinite_update`]). A LoRA agent's θ₀ is the base's tile when that
//! holds the same bytes of the same file ([`BaseTile`]): those passed the gate as the base's. The
//! tile loop (`engine::tiles`) only asks each input's source to read; a new input kind (a DoRA
//! adapter, a GGUF agent) is a new variant here.

use super::gate::{refuse_nonfinite, refuse_nonfinite_update};
use super::tile_bytes::TileBytes;
use super::{Inputs, TensorPlan};
use crate::checkpoint::dtype::decode;
use crate::checkpoint::lora::LoraAdapter;
use crate::checkpoint::{DType, ModelFolder, ModelTensor};
use crate::slices::Source;
use crate::vocabulary::{RowFrom, VocabTensor};
use anyhow::{bail, Result};

/// What every source's read takes from the pass: the inputs, the plan of the tensor read, and
/// whether NaN/±Inf are refused.
#[derive(Clone, Copy)]
pub struct SourceRead<'a> {
    /// The opened inputs.
    pub inputs: &'a Inputs,
    /// The tensor being read.
    pub plan: &'a TensorPlan,
    /// Refuse NaN and ±Inf in what is read.
    pub finite_only: bool,
}

/// How one input's copy of a planned tensor is read into a tile.
pub enum TensorSource<'a> {
    /// Stored bytes as they are (the tile is in the stored dtype).
    Stored {
        /// The model holding the tensor.
        model: &'a ModelFolder,
        /// Its copy of the tensor.
        tensor: &'a ModelTensor,
    },
    /// Stored bytes decoded to f32 — the tile of inputs of mixed dtypes is f32, to which bf16 and
    /// f16 convert exactly — with a LoRA agent's update s·B·A added in f32.
    Widened {
        /// The model holding the tensor.
        model: &'a ModelFolder,
        /// Its copy of the tensor.
        tensor: &'a ModelTensor,
        /// A LoRA agent's adapter, whose update is added.
        lora: Option<&'a LoraAdapter>,
    },
    /// An agent's F32 weights over a 16-bit base, read as their rounding to the base's dtype
    /// (fp32 master weights; [`Inputs::agent_rounding`]): gated and hashed as stored, then
    /// rounded in place.
    Rounded {
        /// The model holding the tensor.
        model: &'a ModelFolder,
        /// Its copy of the tensor (F32).
        tensor: &'a ModelTensor,
        /// The base's dtype, rounded to.
        to: DType,
    },
    /// A token-indexed tensor's rows re-indexed for the output's vocabulary, as f32.
    Reindexed {
        /// Where each output row comes from.
        rows: &'a VocabTensor,
        /// The model whose rows these are.
        source: Source,
    },
}

impl TensorPlan {
    /// How the base (`agent` `None`) or agent `t` (which has the tensor) is read for this plan.
    pub fn source<'a>(&'a self, inputs: &'a Inputs, agent: Option<usize>) -> TensorSource<'a> {
        let (source, model, tensor) = match agent {
            None => (self.base_source(), self.base_folder(inputs), &self.base),
            Some(t) => (
                Source::Agent(t),
                &inputs.agents[t],
                self.agent(inputs, t)
                    .expect("present agents have the tensor"),
            ),
        };
        if let Some(v) = &self.vocab {
            return TensorSource::Reindexed {
                rows: &v.rows,
                source,
            };
        }
        let lora = model.lora_for(&tensor.entry.name);
        let rounding =
            agent.and_then(|_| inputs.agent_rounding(tensor.entry.dtype, self.base.entry.dtype));
        if let (Some(to), None) = (rounding, lora) {
            return TensorSource::Rounded { model, tensor, to };
        }
        if tensor.entry.dtype != self.tile_dtype(inputs) || lora.is_some() {
            TensorSource::Widened {
                model,
                tensor,
                lora,
            }
        } else {
            TensorSource::Stored { model, tensor }
        }
    }
}

impl TensorSource<'_> {
    /// The dtype of the tile values this source gives.
    pub fn dtype(&self) -> DType {
        match self {
            TensorSource::Stored { tensor, .. } => tensor.entry.dtype,
            _ => DType::F32,
        }
    }

    /// Elements `start..start + len` into `buf` (made exactly as long as they take), hashed and
    /// checked as they are read.
    pub fn read(
        &self,
        ctx: &SourceRead,
        (start, len): (usize, usize),
        buf: &mut TileBytes,
        base: Option<&BaseTile>,
    ) -> Result<()> {
        let (model, tensor, lora) = match *self {
            TensorSource::Reindexed { rows, source } => {
                return load_rows(ctx, rows, source, (start, len), buf)
            }
            TensorSource::Rounded { model, tensor, to } => {
                TensorSource::Stored { model, tensor }.read(ctx, (start, len), buf, None)?;
                return round_tile(ctx, tensor, to, start, buf);
            }
            TensorSource::Stored { model, tensor } => (model, tensor, None),
            TensorSource::Widened {
                model,
                tensor,
                lora,
            } => (model, tensor, Some(lora)),
        };
        // Checked and hashed as stored. A widened tile's raw bytes are read into its tail and
        // widened in place front to back, so the tile's bytes are all it holds.
        let dtype = tensor.entry.dtype;
        let widened = lora.is_some();
        let size = if widened { 4 } else { dtype.size() };
        // A LoRA agent's θ₀ is the merge's base: where the base's tile holds this very range of
        // this very file, already read, gated and widened, it is copied, not read again.
        let held = base.filter(|b| widened && b.holds(model, tensor));
        if let Some(b) = held {
            buf.resize_exact(len * 4);
            buf.copy_from_slice(b.bytes);
        } else {
            buf.resize_exact(len * size);
            let tail = len * (size - dtype.size());
            let offset = (start * dtype.size()) as u64;
            model.read(tensor, offset, &mut buf[tail..])?;
            model.record_read(tensor, offset, &buf[tail..]);
            if ctx.finite_only {
                refuse_nonfinite(ctx.plan, model, tensor, &buf[tail..], start)?;
            }
            if widened {
                widen_in_place(dtype, buf, len);
            }
        }
        // A LoRA agent's update over the whole tile at once: its terms are decoded once for all
        // the tile's rows.
        if let Some(Some(l)) = lora {
            let entry = &tensor.entry;
            let values = &mut buf[..len * 4];
            l.add_update_bytes(&entry.name, &entry.shape, start as u64, values)?;
            if ctx.finite_only {
                refuse_nonfinite_update(tensor, l, values, start)?;
            }
            dora_rows(ctx, model, tensor, l, start, values)?;
        }
        Ok(())
    }
}

/// The base's tile, already read, as a LoRA agent's read may take it: its bytes in the tile's
/// dtype and the file range they came from.
pub struct BaseTile<'a> {
    /// The base's tile bytes.
    pub bytes: &'a [u8],
    /// The base's stored tensor, or `None` when its bytes are not a stored range widened to f32
    /// (re-indexed rows, or a tile in a 16-bit dtype).
    pub stored: Option<(&'a ModelFolder, &'a ModelTensor)>,
}

impl BaseTile<'_> {
    /// Whether these bytes are `tensor` of `model` widened to f32: the same file, the same
    /// bytes of it.
    fn holds(&self, model: &ModelFolder, tensor: &ModelTensor) -> bool {
        self.stored.is_some_and(|(m, t)| {
            m.file_of(t) == model.file_of(tensor)
                && t.entry.offset == tensor.entry.offset
                && t.entry.numel == tensor.entry.numel
                && t.entry.dtype == tensor.entry.dtype
        })
    }
}

impl TensorSource<'_> {
    /// Whether this is a LoRA agent's read (θ₀ + s·B·A).
    pub fn is_lora(&self) -> bool {
        matches!(self, TensorSource::Widened { lora: Some(_), .. })
    }

    /// What the base's tile read by this source holds ([`BaseTile::stored`]).
    pub fn as_base<'b>(&'b self, bytes: &'b [u8]) -> BaseTile<'b> {
        let stored = match *self {
            TensorSource::Stored { model, tensor } if tensor.entry.dtype == DType::F32 => {
                Some((model, tensor))
            }
            TensorSource::Widened {
                model,
                tensor,
                lora: None,
            } => Some((model, tensor)),
            _ => None,
        };
        BaseTile { bytes, stored }
    }
}

/// Makes a buffer kept from tile to tile `len` long, for a tile that overwrites all of it (its
/// contents are not kept). Grown to exactly `len`, the old allocation freed first: `Vec::resize`
/// would double it and copy it, so a tile larger than the one before (a tensor's f32 tiles after
/// a smaller tensor's) would leave up to twice the planned bytes, and the allocator a hole.
pub fn resize_exact<T: Clone>(buf: &mut Vec<T>, len: usize, fill: T) {
    if len > buf.capacity() {
        *buf = Vec::new();
        buf.reserve_exact(len);
    }
    buf.resize(len, fill);
}

/// An F32 tile of agent `tensor` (from element `start`) rounded to the base's dtype `to` in
/// place; a finite value that rounds to ±Inf (beyond the dtype's range) is refused by name
/// unless NaN/±Inf are let through.
fn round_tile(
    ctx: &SourceRead,
    tensor: &ModelTensor,
    to: DType,
    start: usize,
    buf: &mut TileBytes,
) -> Result<()> {
    let mut run = [0.0f32; RUN];
    let len = buf.len() / 4;
    for i0 in (0..len).step_by(RUN) {
        let n = RUN.min(len - i0);
        decode(DType::F32, &buf[i0 * 4..(i0 + n) * 4], &mut run[..n]);
        let stored = run;
        crate::checkpoint::dtype::round_through(to, &mut run[..n]);
        if ctx.finite_only {
            if let Some(k) = (0..n).find(|&k| !run[k].is_finite() && stored[k].is_finite()) {
                return Err(crate::error::data(crate::message![
                    format!(
                        "tensor '{}': element {} is {} in F32, beyond {to}'s range, so its \
                         rounding to the base's dtype is infinite (",
                        crate::escape::terminal(&tensor.entry.name),
                        start + i0 + k,
                        stored[k]
                    ),
                    crate::error::Arg::switch("raw-f32-agents"),
                    " reads F32 agents as stored)",
                ]));
            }
        }
        put_f32(buf, i0, &run[..n]);
    }
    Ok(())
}

/// Elements widened to f32 at a time.
const RUN: usize = 1024;

/// Widens the `len` elements of `dtype` stored at the end of `buf` (from byte `len · (4 − size)`)
/// to the f32 bytes `buf[..4 · len]`, front to back. A run whose f32 bytes end before its own raw
/// bytes start (all but the last runs) is decoded straight into place; the rest go through a run
/// on the stack. f32 bytes are already in place.
fn widen_in_place(dtype: DType, buf: &mut [u8], len: usize) {
    let size = dtype.size();
    if size == 4 {
        return;
    }
    let tail = len * (4 - size);
    let mut run = [0.0f32; RUN];
    for i0 in (0..len).step_by(RUN) {
        let n = RUN.min(len - i0);
        let from = tail + i0 * size;
        let (head, rest) = buf.split_at_mut(from);
        let raw = &rest[..n * size];
        // Run i0's f32 bytes end at 4·(i0 + n); before `from` they are clear of its raw bytes.
        let place = head
            .get_mut(i0 * 4..(i0 + n) * 4)
            .and_then(|b| bytemuck::try_cast_slice_mut::<u8, f32>(b).ok())
            .filter(|_| cfg!(target_endian = "little"));
        match place {
            Some(place) => decode(dtype, raw, place),
            None => {
                decode(dtype, raw, &mut run[..n]);
                put_f32(buf, i0, &run[..n]);
            }
        }
    }
}

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

/// A DoRA agent's rows of `values` (elements of `tensor` from `start`, θ₀ + s·B·A) rescaled to
/// its magnitudes ([`super::dora`]), then checked again; nothing for a plain LoRA update.
fn dora_rows<V: super::dora::Values + ?Sized>(
    ctx: &SourceRead,
    model: &ModelFolder,
    tensor: &ModelTensor,
    lora: &LoraAdapter,
    start: usize,
    values: &mut V,
) -> Result<()> {
    if !lora.is_dora(&tensor.entry.name) {
        return Ok(());
    }
    let read = super::dora::DoraRead {
        plan: ctx.plan,
        model,
        tensor,
        lora,
        finite_only: ctx.finite_only,
    };
    super::dora::rescale(&read, start, values)?;
    if ctx.finite_only {
        refuse_nonfinite_update(tensor, lora, values.bytes(), start)?;
    }
    Ok(())
}

/// Reads `out.len()` elements of input `source`'s copy of a re-indexed tensor from its element
/// `at`, as f32.
fn read_f32(read: &SourceRead, source: Source, at: usize, out: &mut [f32]) -> Result<()> {
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
        if source != plan.base_source() {
            if let Some(to) = read
                .inputs
                .agent_rounding(tensor.entry.dtype, plan.base.entry.dtype)
            {
                crate::checkpoint::dtype::round_through(to, values);
            }
        }
        if let Some(l) = model.lora_for(&tensor.entry.name) {
            if read.finite_only {
                refuse_nonfinite_update(tensor, l, bytemuck::cast_slice(values), from)?;
            }
            dora_rows(read, model, tensor, l, from, values)?;
        }
    }
    Ok(())
}

/// Elements `start..start + len` of input `source`'s copy of a re-indexed tensor (see
/// [`VocabTensor::row_from`]) into `buf` as f32: own rows read in runs, default rows from the
/// model named, means summed in f32 in order then divided once, padding rows the input's mean row.
/// Gathered a run at a time, so the tile's bytes are all it holds.
fn load_rows(
    read: &SourceRead,
    rows: &VocabTensor,
    source: Source,
    (start, len): (usize, usize),
    buf: &mut TileBytes,
) -> Result<()> {
    buf.resize_exact(len * 4);
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
    read: &SourceRead,
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
fn pad_mean(read: &SourceRead, rows: &VocabTensor, source: Source) -> Result<Vec<f32>> {
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checkpoint::dtype::encode;

    /// Widening in place gives the values a plain decode gives, for tiles shorter than a run,
    /// of several runs (decoded in place, then on the stack where the last ones overlap their raw
    /// bytes), and in buffers not aligned to four bytes (every run on the stack).
    #[test]
    fn widening_in_place_matches_a_plain_decode() {
        for dtype in [DType::BF16, DType::F16, DType::F32] {
            for len in [
                0,
                1,
                7,
                RUN - 1,
                RUN,
                RUN + 1,
                2 * RUN + 3,
                5 * RUN,
                7 * RUN + 511,
            ] {
                let values: Vec<f32> = (0..len)
                    .map(|i| ((i * 2_654_435_761) % 100_003) as f32 * 0.013 - 650.0)
                    .collect();
                let mut raw = vec![0u8; len * dtype.size()];
                encode(dtype, &values, &mut raw);
                let mut want = vec![0.0f32; len];
                decode(dtype, &raw, &mut want);
                for skew in 0..4 {
                    // Stale bytes before the raw ones, as a reused tile buffer holds.
                    let mut buf = vec![0xA5u8; skew + len * 4];
                    let tail = skew + len * (4 - dtype.size());
                    buf[tail..].copy_from_slice(&raw);
                    widen_in_place(dtype, &mut buf[skew..], len);
                    let got: Vec<f32> = buf[skew..]
                        .chunks_exact(4)
                        .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
                        .collect();
                    assert!(
                        got.iter()
                            .zip(&want)
                            .all(|(g, w)| g.to_bits() == w.to_bits()),
                        "{dtype:?}, {len} elements, skew {skew}"
                    );
                }
            }
        }
    }
}
