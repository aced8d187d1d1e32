//! Each kernel's host side: what it writes into a slot before its dispatch and where its results
//! go after; the combine rule's uniforms, keep rules and coefficient rows.

use super::layout::{rule_words, wgsl, Comb};
use super::{GpuBackend, GPU_MAX_TABLE_AGENTS};
use crate::backend::{CombineParams, Tile};
use crate::checkpoint::DType;
use crate::method::combine::{CombineSpec, Normalize};
use anyhow::{ensure, Result};

#[derive(Clone, Copy)]
pub(super) enum Kernel {
    Probe,
    Merge,
    /// The merge, then the probe over the same uploaded chunk.
    MergeCounted,
    Combine,
    /// A host-computed update added to the base.
    Update,
}

/// What a kernel leaves for the host to read back.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum KernelResult {
    /// The merged chunk in the output dtype.
    Out,
    /// The probe's histogram, n² u32.
    Hist,
}

impl Kernel {
    pub(super) fn name(self) -> &'static str {
        match self {
            Kernel::Probe => "probe",
            Kernel::Merge | Kernel::MergeCounted => "merge",
            Kernel::Combine => "combine",
            Kernel::Update => "update",
        }
    }

    /// Its results, in the order the host receives them.
    pub(super) fn results(self) -> &'static [KernelResult] {
        match self {
            Kernel::Probe => &[KernelResult::Hist],
            Kernel::Merge | Kernel::Combine | Kernel::Update => &[KernelResult::Out],
            Kernel::MergeCounted => &[KernelResult::Out, KernelResult::Hist],
        }
    }
}

impl GpuBackend {
    /// θ₀ + Δ on the device (shaders/update.wgsl): each chunk's Δ written beside its base.
    pub(super) fn update_tile(
        &self,
        tile: &Tile,
        update: &[f32],
        out_dtype: DType,
        out: &mut [u8],
    ) -> Result<()> {
        let q = &self.ctx.queue;
        let size = out_dtype.size();
        self.run_chunks(
            tile,
            out_dtype,
            (0.0, wgsl::SHARED_MEAN),
            |slot, start, len| {
                q.write_buffer(
                    &slot.delta,
                    0,
                    bytemuck::cast_slice(&update[start..start + len]),
                );
                Ok(())
            },
            Kernel::Update,
            |start, len, results| {
                out[start * size..(start + len) * size].copy_from_slice(&results[0][..len * size])
            },
        )
    }

    pub(super) fn combine_tile(
        &self,
        tile: &Tile,
        params: &CombineParams,
        out: &mut [u8],
    ) -> Result<()> {
        let spec = params.spec;
        let n = tile.agents.len();
        ensure!(
            spec.agents() == n,
            "internal: combine rule for {} agents, tile has {n}",
            spec.agents()
        );
        let end = params.start + tile.len as u64;
        if end > u32::MAX as u64 {
            return Err(crate::error::data(crate::message![
                format!(
                    "the GPU backend indexes tensors with 32 bits; this one has more than {} \
                     elements (use ",
                    u32::MAX
                ),
                crate::error::Arg::option_value("device", "cpu"),
                ")",
            ]));
        }
        let (norm_mode, fixed_recip, table) = normalization(spec, n)?;
        let rules: Vec<u32> = spec.keep.iter().flat_map(rule_words).collect();
        let q = &self.ctx.queue;
        let size = params.out_dtype.size();
        let row_floats = n + 1;
        self.run_chunks(
            tile,
            params.out_dtype,
            (0.0, wgsl::SHARED_MEAN),
            |slot, start, len| {
                let first = params.start + start as u64;
                let first_row = spec.row_index(first);
                // Rows in the chunk: consecutive, wrapping around when they repeat (columns).
                let unwrapped = |i: u64| i.checked_div(spec.row_len).unwrap_or(0);
                let mut rows = unwrapped(first + len as u64 - 1) - unwrapped(first) + 1;
                if spec.row_period > 0 {
                    rows = rows.min(spec.row_period);
                }
                let floats = rows as usize * row_floats;
                ensure!(
                    floats <= slot.coefs.size() as usize / 4,
                    "internal: {floats} coefficients do not fit the GPU buffer"
                );
                // Fisher's rows come with the tile; the others' with the tensor, from the
                // chunk's first row on (row_of in the shader wraps repeating rows the same way).
                let wrapped: Vec<f32>;
                let (source, from) = if spec.tile_coefs {
                    (params.coefs, start * row_floats)
                } else if spec.row_period > 0 {
                    wrapped = (0..rows)
                        .flat_map(|j| {
                            let r = ((first_row + j) % spec.row_period) as usize;
                            spec.coefs[r * row_floats..(r + 1) * row_floats]
                                .iter()
                                .copied()
                        })
                        .collect();
                    (&wrapped[..], 0)
                } else {
                    (&spec.coefs[..], first_row as usize * row_floats)
                };
                let comb = uniform(spec, first, first_row, (norm_mode, fixed_recip));
                q.write_buffer(&slot.comb, 0, bytemuck::bytes_of(&comb));
                q.write_buffer(&slot.rules, 0, bytemuck::cast_slice(&rules));
                q.write_buffer(
                    &slot.coefs,
                    0,
                    bytemuck::cast_slice(&source[from..from + floats]),
                );
                if !table.is_empty() {
                    q.write_buffer(&slot.table, 0, bytemuck::cast_slice(&table));
                }
                // Each agent's flags at its f32-sized segment (words per agent: the chunk's
                // f32 stride, even).
                let stride = len.div_ceil(2) * 2;
                for (t, r) in params.flags.iter().enumerate() {
                    q.write_buffer(
                        &slot.flags,
                        (t * stride * 4) as u64,
                        bytemuck::cast_slice(&r[start..start + len]),
                    );
                }
                Ok(())
            },
            Kernel::Combine,
            |start, len, results| {
                let bytes = results[0];
                out[start * size..(start + len) * size].copy_from_slice(&bytes[..len * size])
            },
        )
    }
}

/// The combine kernel's normalization: its mode, the fixed reciprocal, and the per-element table
/// of reciprocals (consensus merges).
fn normalization(spec: &CombineSpec, n: usize) -> Result<(u32, f32, Vec<f32>)> {
    Ok(match &spec.normalize {
        Normalize::None => (wgsl::NORM_NONE, 1.0, Vec::new()),
        Normalize::Fixed(r) => (wgsl::NORM_FIXED, *r, Vec::new()),
        Normalize::PerElement(w, floor) => {
            if n > GPU_MAX_TABLE_AGENTS {
                return Err(crate::error::data(crate::message![
                    format!(
                        "the GPU backend normalizes a consensus merge of at most \
                         {GPU_MAX_TABLE_AGENTS} models, got {n} (use "
                    ),
                    crate::error::Arg::option_value("device", "cpu"),
                    ")",
                ]));
            }
            (
                wgsl::NORM_TABLE,
                1.0,
                crate::method::combine::reciprocal_table(w, *floor),
            )
        }
    })
}

/// The combine kernel's uniform for a chunk from element `first` (row `first_row`).
fn uniform(
    spec: &CombineSpec,
    first: u64,
    first_row: u64,
    (norm_mode, fixed_recip): (u32, f32),
) -> Comb {
    Comb {
        start: first as u32,
        row_len: spec.row_len.min(u32::MAX as u64) as u32,
        first_row: first_row as u32,
        delta: spec.delta as u32,
        consensus: spec.consensus as u32,
        norm_mode,
        lambda: spec.lambda,
        fixed_recip,
        nearswap: spec.nearswap.is_some() as u32,
        nearswap_t: spec.nearswap.unwrap_or(0.0),
        element_keep: spec.element_keep.is_some() as u32,
        element_value: spec.element_keep.map_or(0, |(c, _)| c.value),
        element_index: spec.element_keep.map_or(0, |(c, _)| c.index),
        inv_n: spec.element_keep.map_or(0.0, |(_, i)| i),
        sign_of_values: spec.sign_of_values as u32,
        row_period: spec.row_period.min(u32::MAX as u64) as u32,
    }
}
