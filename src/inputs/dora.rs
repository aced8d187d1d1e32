//! DoRA agents' rows (SPEC §5): a DoRA adapter's agent is each row i of θ₀ + s·B·A times
//! m_i / ‖row i‖. A tile's values are θ₀ + s·B·A already (`source.rs`); [`rescale`] scales its
//! rows. A row the tile holds only part of is read whole again for its norm — not hashed again
//! (its bytes are hashed by the tiles that hold them), but checked for NaN/±Inf like every read.
//!
//! The norm: the squares of the row's f32 values summed in f64, column 0 first, its square root
//! rounded once to f32; the factor m_i / norm in f32; each value times the factor in f32. Every
//! tiling gives the same values (tested through `--tile-elems`).

use super::gate::refuse_nonfinite;
use super::TensorPlan;
use crate::checkpoint::dtype::decode;
use crate::checkpoint::lora::LoraAdapter;
use crate::checkpoint::{ModelFolder, ModelTensor};
use anyhow::Result;

/// f32 values held as themselves or as little-endian bytes (a widened tile).
pub(super) trait Values {
    /// How many values.
    fn count(&self) -> usize;
    /// Value `i`.
    fn get(&self, i: usize) -> f32;
    /// Multiplies values `range` by `factor`.
    fn scale(&mut self, range: std::ops::Range<usize>, factor: f32);
    /// The values' little-endian bytes.
    fn bytes(&self) -> &[u8];
}

impl Values for [f32] {
    fn count(&self) -> usize {
        self.len()
    }
    fn get(&self, i: usize) -> f32 {
        self[i]
    }
    fn scale(&mut self, range: std::ops::Range<usize>, factor: f32) {
        self[range].iter_mut().for_each(|v| *v *= factor);
    }
    fn bytes(&self) -> &[u8] {
        bytemuck::cast_slice(self)
    }
}

impl Values for [u8] {
    fn count(&self) -> usize {
        self.len() / 4
    }
    fn get(&self, i: usize) -> f32 {
        f32::from_le_bytes(self[i * 4..i * 4 + 4].try_into().expect("4 bytes"))
    }
    fn scale(&mut self, range: std::ops::Range<usize>, factor: f32) {
        for b in self[range.start * 4..range.end * 4].chunks_exact_mut(4) {
            let v = f32::from_le_bytes([b[0], b[1], b[2], b[3]]) * factor;
            b.copy_from_slice(&v.to_le_bytes());
        }
    }
    fn bytes(&self) -> &[u8] {
        self
    }
}

/// The DoRA agent's copy of a tensor being read: where to read a whole row again.
pub(super) struct DoraRead<'a> {
    /// The tensor read.
    pub plan: &'a TensorPlan,
    /// The agent's model (the base, for an adapter).
    pub model: &'a ModelFolder,
    /// Its stored copy of the tensor.
    pub tensor: &'a ModelTensor,
    /// The DoRA adapter.
    pub lora: &'a LoraAdapter,
    /// Refuse NaN and ±Inf.
    pub finite_only: bool,
}

/// Rescales `values` — elements `start..` of the tensor, θ₀ + s·B·A in f32 — row by row to the
/// adapter's magnitudes. A factor that is not finite (m NaN, a row of norm 0) is named unless
/// NaN/±Inf are allowed.
pub(super) fn rescale<V: Values + ?Sized>(
    read: &DoraRead,
    start: usize,
    values: &mut V,
) -> Result<()> {
    let entry = &read.tensor.entry;
    let len = values.count();
    if len == 0 {
        return Ok(());
    }
    let n = entry.shape[1].max(1);
    let end = start + len;
    let (first, last) = (start / n, (end - 1) / n);
    let mut magnitudes = Vec::new();
    read.lora
        .magnitudes(&entry.name, first..last + 1, &mut magnitudes)?;
    let mut row = Vec::new();
    for (i, &m) in (first..=last).zip(&magnitudes) {
        let (lo, hi) = ((i * n).max(start), ((i + 1) * n).min(end));
        let norm = if hi - lo == n {
            norm((lo - start..hi - start).map(|k| values.get(k)))
        } else {
            whole_row(read, i, n, &mut row)?;
            norm(row.iter().copied())
        };
        let factor = m / norm;
        if read.finite_only && !factor.is_finite() {
            if m.is_finite() && norm.is_finite() {
                return Err(crate::error::data(crate::message![
                    format!(
                        "tensor '{}': DoRA's scale m / ‖row {i}‖ = {m} / {norm} of the adapter \
                         {} is not finite; rlmerge refuses NaN and infinity unless ",
                        entry.name,
                        read.lora.dir.display()
                    ),
                    crate::error::Arg::switch("allow-nonfinite"),
                ]));
            }
            return Err(read.lora.nonfinite_error(&entry.name, lo as u64, factor));
        }
        values.scale(lo - start..hi - start, factor);
    }
    Ok(())
}

/// ‖x‖: squares summed in f64 in order, the square root rounded once to f32.
fn norm(x: impl Iterator<Item = f32>) -> f32 {
    x.map(|v| (v as f64) * (v as f64)).sum::<f64>().sqrt() as f32
}

/// Row `i` (of `n` columns) of θ₀ + s·B·A into `row`, read from the stored tensor and checked.
fn whole_row(read: &DoraRead, i: usize, n: usize, row: &mut Vec<f32>) -> Result<()> {
    let (tensor, entry) = (read.tensor, &read.tensor.entry);
    let size = entry.dtype.size();
    let mut raw = vec![0u8; n * size];
    read.model.read(tensor, (i * n * size) as u64, &mut raw)?;
    if read.finite_only {
        refuse_nonfinite(read.plan, read.model, tensor, &raw, i * n)?;
    }
    row.clear();
    row.resize(n, 0.0);
    decode(entry.dtype, &raw, row);
    read.lora
        .add_update(&entry.name, &entry.shape, (i * n) as u64, row)
}
