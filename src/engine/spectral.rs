//! Iso-C's matrices (SPEC §4c): a matrix's task vectors summed whole by a statistics scan, a thin
//! SVD Σ τ_t = U S Vᵀ (faer, f64), and the update α·mean(S)·U Vᵀ — every direction of the sum
//! kept, each with the same weight. The update is computed once per matrix on the host and added
//! to the base tile by tile, so every backend writes the same bytes. Tensors that are not
//! matrices, or larger than [`MAX_ELEMS`], take Iso-C's elementwise rule through the combine
//! kernels instead (`method::tensor_params`).

use crate::inputs::Inputs;
use crate::method::{Kind, Method};
use crate::scans::Scans;
use anyhow::{anyhow, Result};
use std::ops::ControlFlow;

/// The largest matrix Iso-C decomposes: 2^25 elements (a 4096 × 8192 projection). Its SVD holds
/// the sum and U Vᵀ in f64 plus faer's factors, about 1 GiB at this size; larger matrices (a big
/// vocabulary's embeddings) take the elementwise rule, and the merge says so.
pub(super) const MAX_ELEMS: usize = 1 << 25;

/// The matrix Iso-C decomposes for a tensor of `shape` — (rows, columns) of a 2-D tensor of at
/// least 2 × 2 and at most [`MAX_ELEMS`] elements — or `None`.
pub(super) fn matrix(shape: &[usize]) -> Option<(usize, usize)> {
    match *shape {
        [m, n] if m >= 2 && n >= 2 && m * n <= MAX_ELEMS => Some((m, n)),
        _ => None,
    }
}

/// The merge's warnings about Iso-C: each matrix too large to decompose, merged by the
/// elementwise rule instead.
pub(super) fn warnings(inputs: &Inputs, method: &Method) -> Vec<String> {
    if !matches!(method, Method::Combine(c) if c.kind == Kind::IsoC) {
        return Vec::new();
    }
    inputs
        .tensors
        .iter()
        .filter_map(|plan| match plan.shape()[..] {
            [m, n] if m >= 2 && n >= 2 && matrix(&[m, n]).is_none() => Some(format!(
                "iso_c: tensor '{}' ({m} × {n}) is larger than the {MAX_ELEMS} elements Iso-C \
                 decomposes; it was merged by the elementwise rule (α · mean τ, SPEC §4c)",
                plan.name()
            )),
            _ => None,
        })
        .collect()
}

/// Iso-C's update of an m × n matrix, row-major: α·mean(S)·U Vᵀ for Σ_t τ_t = U S Vᵀ, the sum
/// taken in f64 in agent order over the scan's tiles (whose task vectors are f32).
pub(super) fn iso_c_update(
    scan: &mut dyn Scans,
    (m, n): (usize, usize),
    alpha: f64,
) -> Result<Vec<f32>> {
    let mut sum = vec![0.0f64; m * n];
    scan.tiles(&mut |tile| {
        let start = tile.start as usize;
        for tau in tile.tau {
            for (s, &t) in sum[start..start + tau.len()].iter_mut().zip(tau.iter()) {
                *s += f64::from(t);
            }
        }
        Ok(ControlFlow::Continue(()))
    })?;
    let a = faer::MatRef::from_row_major_slice(&sum, m, n);
    let svd = a
        .thin_svd()
        .map_err(|e| anyhow!("the SVD of the summed task vectors did not converge ({e:?})"))?;
    let s = svd.S().column_vector();
    let r = m.min(n);
    let mean = (0..r).map(|i| s[i]).sum::<f64>() / r as f64;
    drop(sum);
    let uvt = svd.U() * svd.V().transpose();
    let scale = alpha * mean;
    let mut update = vec![0.0f32; m * n];
    for (i, row) in update.chunks_exact_mut(n).enumerate() {
        for (j, u) in row.iter_mut().enumerate() {
            *u = (scale * uvt[(i, j)]) as f32;
        }
    }
    Ok(update)
}
