//! How one tensor's tiles are merged: its [`TileRule`], and a tile merged by it through the
//! backend (the merge pass's, and SVC's capture of a method's merged tile).

use super::output::pass_base;
use super::{spectral, tiles, MergePass, TensorJob};
use crate::backend::{CombineParams, MergeParams, Tile, TileCounts};
use crate::checkpoint::dtype::decode;
use crate::checkpoint::DType;
use crate::method::combine::CombineSpec;
use crate::method::statistics::Decisions;
use anyhow::Result;
use rayon::prelude::*;

/// How one tensor's tiles are merged.
pub(super) enum TileRule {
    /// RAM / RAM+ with these λ of the present agents.
    Ram(Vec<f32>),
    /// A mergekit-family method, with DELLA's keep decisions when its statistics kept them.
    Combine(CombineSpec, Option<Decisions>),
    /// The base plus this update of the whole tensor, computed on the host (the matrices of Iso-C,
    /// TSV-M and SVC wider than tall, and ResMerge's), added by the backend's update kernel.
    Update(Vec<f32>),
    /// The base plus an update made tile by tile from the tile's rows (a tall matrix of Iso-C,
    /// TSV-M or SVC: tiles of whole row blocks): the agents' task vectors — or, with `inner`
    /// (SVC), the update the method's own rule merges — times the row map, added by the
    /// backend's update kernel.
    RowMap {
        map: spectral::RowMap,
        inner: Option<Box<TileRule>>,
    },
    /// No merged model has the tensor: the base's values.
    Base,
}

/// A tile worker's f32 buffers, kept from tile to tile (fresh ones per tile fault in their pages
/// again): for [`tile_flags`] the base and each agent decoded and each agent's words.
#[derive(Default)]
pub(super) struct TileScratch {
    pub(super) base: Vec<f32>,
    pub(super) values: Vec<Vec<f32>>,
    pub(super) words: Vec<Vec<u32>>,
    /// A row map's update, and (SVC) the method's merged tile in f32 bytes and minus θ₀.
    pub(super) update: Vec<f32>,
    pub(super) merged_bytes: Vec<u8>,
    pub(super) merged: Vec<f32>,
}

/// Each present agent's words for the tile's elements, in the flags channel
/// ([`crate::method::combine::Keep::Flagged`]): DELLA's keep decisions (kept by its statistics,
/// else made here from the tile's rows), or arcee_fusion's keep flags; empty when the rule
/// needs none.
fn tile_flags<'b>(
    tile: &Tile,
    start: u64,
    (spec, decisions): (&CombineSpec, Option<&Decisions>),
    b: &'b mut TileScratch,
) -> &'b [Vec<u32>] {
    if decisions.is_none() && spec.fusion.is_none() {
        return &[];
    }
    let n = tile.agents.len();
    b.words.resize_with(n, Vec::new);
    if let Some(Decisions::Kept(kept)) = decisions {
        for (t, words) in b.words[..n].iter_mut().enumerate() {
            kept.words(t, start, tile.len, words);
        }
        return &b.words[..n];
    }
    b.values.resize_with(n, Vec::new);
    tiles::resize_exact(&mut b.base, tile.len, 0.0);
    decode(tile.dtype, tile.base, &mut b.base);
    let base = &b.base;
    tile.agents
        .par_iter()
        .zip(b.values.par_iter_mut())
        .zip(b.words.par_iter_mut())
        .enumerate()
        .for_each(|(t, ((bytes, v), words))| {
            tiles::resize_exact(v, tile.len, 0.0);
            decode(tile.dtype, bytes, v);
            if spec.delta {
                v.iter_mut().zip(base).for_each(|(x, b)| *x -= b);
            }
            match (&spec.fusion, decisions) {
                (Some(f), _) => f.flags(start, v, words),
                (None, Some(d)) => d.words(t, start, v, words),
                (None, None) => unreachable!("returned above: no flags to make"),
            }
        });
    &b.words[..n]
}

impl MergePass<'_> {
    /// One tile of `job` (first element `start`) merged into `out` (of `out_dtype`); plain RAM
    /// adds the tile's counts to `counts`; `scratch` is the worker's buffers.
    pub(super) fn merge_tile(
        &self,
        job: &TensorJob,
        tile: &Tile,
        start: u64,
        (out_dtype, out): (DType, &mut [u8]),
        counts: &mut TileCounts,
        scratch: &mut TileScratch,
    ) -> Result<()> {
        self.merge_by(
            &job.rule,
            job,
            tile,
            start,
            (out_dtype, out),
            counts,
            scratch,
        )
    }

    /// [`Self::merge_tile`] by `rule` (the job's, or a row map's inner rule).
    #[allow(clippy::too_many_arguments)]
    fn merge_by(
        &self,
        rule: &TileRule,
        job: &TensorJob,
        tile: &Tile,
        start: u64,
        (out_dtype, out): (DType, &mut [u8]),
        counts: &mut TileCounts,
        scratch: &mut TileScratch,
    ) -> Result<()> {
        match rule {
            TileRule::Base => {
                pass_base(tile, out_dtype, out);
                Ok(())
            }
            TileRule::Update(update) => {
                // θ₀ + Δ in f32, as the combine kernels add (SPEC §4c), encoded once.
                let start = start as usize;
                let update = &update[start..start + tile.len];
                self.backend.add_update(tile, update, out_dtype, out)
            }
            TileRule::RowMap { map, inner } => {
                if let Some(inner) = inner {
                    let mut bytes = std::mem::take(&mut scratch.merged_bytes);
                    tiles::resize_exact(&mut bytes, tile.len * 4, 0);
                    let done = self.merge_by(
                        inner,
                        job,
                        tile,
                        start,
                        (DType::F32, &mut bytes),
                        counts,
                        scratch,
                    );
                    scratch.merged_bytes = bytes;
                    done?;
                }
                let map = (map, self.backend);
                spectral::tile_update(
                    map,
                    inner.is_some(),
                    job.plan.shape(),
                    tile,
                    start,
                    scratch,
                )?;
                self.backend
                    .add_update(tile, &scratch.update, out_dtype, out)
            }
            TileRule::Ram(lambdas) => {
                let params = MergeParams {
                    epsilon: self.options.pass.epsilon,
                    lambdas,
                    out_dtype,
                    shared: self.options.merging.method.shared(),
                };
                if self.counted.is_some() {
                    counts.add(&self.backend.merge_counted(tile, &params, out)?);
                    Ok(())
                } else {
                    self.backend.merge(tile, &params, out)
                }
            }
            TileRule::Combine(spec, kept) => {
                let flags = tile_flags(tile, start, (spec, kept.as_ref()), scratch);
                let mut coefs = Vec::new();
                if let Some(f) = self.fisher {
                    f.tile_coefs(job.plan, &job.present, spec, (start, tile.len), &mut coefs)?;
                }
                let params = CombineParams {
                    spec,
                    start,
                    out_dtype,
                    flags,
                    coefs: &coefs,
                };
                self.backend.combine(tile, &params, out)
            }
        }
    }
}
