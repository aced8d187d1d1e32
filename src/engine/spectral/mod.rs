//! The methods that decompose whole matrices: Iso-C (SPEC §4c), TSV-M (§4d), the SVC modifier
//! (§4e) and ResMerge (§4f). Iso-C, TSV-M and SVC decompose every matrix of the model, whatever
//! its size, through the short side's Gram matrices (`crate::linalg`): a tall matrix (rows ≥
//! columns) is streamed from the input files block by block — summed into n × n matrices, then
//! merged tile by tile in the merge pass by a small map of its rows ([`RowMap`], a
//! [`super::TileRule::RowMap`]) — so memory grows with its short side, not with the matrix; a
//! wide one's task vectors are gathered and read transposed, its update made whole (a
//! [`super::TileRule::Update`]). ResMerge (`super::resmerge`) needs each agent's top K triplets
//! and takes matrices up to [`RESMERGE_MAX_ELEMS`]; its paper merges embeddings, the LM head and
//! norms by the models' mean, and the merge says so.

mod methods;
mod resmerge;
mod row_map;
mod rows;

use crate::backend::{Backend, Tile};
use crate::checkpoint::dtype::{decode, decode_minus};
use crate::engine::scans::{gather_taus, ScanBuffers, TensorScans};
use crate::engine::PassOptions;
use crate::inputs::Inputs;
use crate::inputs::TensorPlan;
use crate::method::settings::TensorPlace;
use crate::method::MethodConfig;
use crate::method::{Kind, Merging, Method};
use crate::names::Module;
use anyhow::Context as _;
use anyhow::Result;
pub(super) use methods::MatrixWork;
pub(crate) use row_map::{Block, RowMap};
pub(super) use rows::{refuse_nonfinite, FileRows, RowBlocks, Transposed};

/// The largest matrix ResMerge decomposes: 2^30 elements (Llama-3-405B's 53248 × 16384 MLP
/// projections are 0.81 · 2^30). Past 1 GiB of task vectors it holds one agent's τ and the update
/// in f32, 8 bytes an element (1.9 GB for a 70B model's 28672 × 8192 projections), and (m + n)
/// f64 per Lanczos step.
const RESMERGE_MAX_ELEMS: usize = 1 << 30;

/// Whether `kind`'s matrices are merged here (or by `resmerge`, on the same footing): the
/// methods of the spectral cost class, the one list of them (`Kind::cost`).
pub(super) fn decomposes(kind: Kind) -> bool {
    kind.cost() == crate::method::cost::Cost::Spectral
}

/// The matrix `kind` decomposes for tensor `name` of `shape` — every 2-D tensor of at least 2 × 2
/// (ResMerge: of at most [`RESMERGE_MAX_ELEMS`]) — unless the method leaves that kind of tensor
/// to its elementwise rule ([`left_by_name`]).
pub(super) fn decomposed(kind: Kind, name: &str, shape: &[usize]) -> Option<(usize, usize)> {
    if left_by_name(kind, name) {
        return None;
    }
    let (m, n) = matrix(shape)?;
    (kind != Kind::ResMerge || m * n <= RESMERGE_MAX_ELEMS).then_some((m, n))
}

/// Whether `kind` leaves tensor `name` to its elementwise rule whatever its shape: ResMerge's
/// embeddings, LM head and norms (SPEC §4f).
fn left_by_name(kind: Kind, name: &str) -> bool {
    use crate::names::Module;
    kind == Kind::ResMerge
        && matches!(
            Module::of(name),
            Module::Embed | Module::LmHead | Module::Norm
        )
}

/// (rows, columns) of a 2-D tensor of at least 2 × 2: a matrix the spectral methods decompose.
pub(super) fn matrix(shape: &[usize]) -> Option<(usize, usize)> {
    match *shape {
        [m, n] if m >= 2 && n >= 2 => Some((m, n)),
        _ => None,
    }
}

/// Whether `merging` decomposes `plan`'s tensor: a matrix a decomposing method takes, or, with
/// SVC, any matrix some model holds.
pub(super) fn is_decomposed(merging: &Merging, plan: &TensorPlan) -> bool {
    let by_method = match &merging.method {
        Method::Combine(c) if decomposes(c.kind) => {
            decomposed(c.kind, plan.name(), plan.shape()).is_some()
        }
        _ => false,
    };
    let by_svc = merging.svc.is_some() && matrix(plan.shape()).is_some();
    !plan.present().is_empty() && (by_method || by_svc)
}

/// The merge's warnings about a decomposing method: the matrices it leaves to the elementwise
/// rule (ResMerge: by its paper, embeddings, the LM head and norms; and matrices above its bound).
pub(super) fn warnings(inputs: &Inputs, method: &Method) -> Vec<String> {
    let Method::Combine(c) = method else {
        return Vec::new();
    };
    if c.kind != Kind::ResMerge {
        return Vec::new();
    }
    let matrices = inputs
        .tensors
        .iter()
        .filter(|p| matrix(p.shape()).is_some());
    let (mut by_name, mut too_large) = (Vec::new(), Vec::new());
    for plan in matrices {
        if left_by_name(c.kind, plan.name()) {
            by_name.push(plan.name());
        } else if decomposed(c.kind, plan.name(), plan.shape()).is_none() {
            too_large.push(plan.name());
        }
    }
    let mut said = Vec::new();
    if let Some(first) = by_name.first() {
        said.push(format!(
            "resmerge: {} matrices (embeddings, the LM head, norms; '{first}' first) are merged \
             by the models' mean, as ResMerge's paper merges them (SPEC §4f)",
            by_name.len()
        ));
    }
    for name in too_large {
        said.push(format!(
            "resmerge: tensor '{name}' is larger than the {RESMERGE_MAX_ELEMS} elements ResMerge \
             decomposes; it was merged by the models' mean (SPEC §4f)"
        ));
    }
    said
}

/// What a decomposing method merges a matrix with.
pub(super) enum Decomposed {
    /// A tall matrix: its update made from each tile's rows in the merge pass.
    Rows(RowMap),
    /// A wide matrix (or ResMerge's): its update, whole, row-major.
    Whole(Vec<f32>),
}

/// Iso-C's or TSV-M's merge of the m × n matrix `scans` reads (its `present` agents'), with
/// scaling factor `alpha` (SPEC §4c, §4d).
pub(super) fn decompose(
    kind: Kind,
    scans: &mut TensorScans,
    (m, n): (usize, usize),
    alpha: f64,
    cx: &MatrixWork,
) -> Result<Decomposed> {
    let run = |rows: &mut dyn RowBlocks| match kind {
        Kind::Tsv => methods::tsv(rows, alpha, cx),
        _ => methods::iso_c(rows, alpha, cx),
    };
    if m >= n {
        let mut rows = FileRows {
            scans,
            shape: (m, n),
            method: kind.name(),
            merged: None,
        };
        return Ok(Decomposed::Rows(run(&mut rows)?));
    }
    let taus = gather_taus(scans, m * n)?;
    for (t, tau) in taus.iter().enumerate() {
        refuse_nonfinite(kind.name(), t, (0, n), tau)?;
    }
    let mut rows = Transposed {
        taus,
        merged: None,
        stored: (m, n),
    };
    let map = run(&mut rows)?;
    Ok(Decomposed::Whole(whole_update(
        &map, &mut rows, cx.backend,
    )?))
}

/// SVC's merge of a wide matrix whose merged update and task vectors were gathered whole.
pub(super) fn calibrate_whole(
    mut rows: Transposed,
    alpha: f64,
    cx: &MatrixWork,
) -> Result<Vec<f32>> {
    let map = methods::svc(&mut rows, alpha, cx)?;
    whole_update(&map, &mut rows, cx.backend)
}

/// SVC's map of a tall matrix read block by block (its merged update made by `rows`).
pub(super) fn calibrate_rows(rows: &mut FileRows, alpha: f64, cx: &MatrixWork) -> Result<RowMap> {
    methods::svc(rows, alpha, cx)
}

/// The update of the wide matrix `rows` reads transposed, made by `map` block by block: each
/// block of the transpose's rows is a block of the matrix's columns.
fn whole_update(map: &RowMap, rows: &mut Transposed, backend: &dyn Backend) -> Result<Vec<f32>> {
    let (m, n) = rows.stored;
    let mut update = vec![0.0f32; m * n];
    let mut out = Vec::new();
    rows.pass(&mut |b: &Block| {
        map.apply(b, m, (backend, faer::Par::rayon(0)), &mut out)?;
        for (r, row) in out.chunks_exact(m).enumerate() {
            for (i, &x) in row.iter().enumerate() {
                update[i * n + b.row0 + r] = x;
            }
        }
        Ok(())
    })?;
    Ok(update)
}

/// Elements per merge-pass tile of a tall matrix merged by a row map: its blocks of rows
/// ([`crate::linalg::rows_per_block`]), so each tile's update is made as the scans made the map's
/// sums — the same blocks whatever `--tile-elems` says.
pub(super) fn row_block_elems(shape: &[usize]) -> usize {
    let n = shape.get(1).copied().unwrap_or(1);
    crate::linalg::rows_per_block(n) * n
}

/// A row map's update of one merge-pass tile of a tall matrix of `shape` (whole rows; first
/// element `start`) into `scratch.update`: made from the tile's task vectors, decoded here, or
/// with `merged` from the method's merged tile (`scratch.merged_bytes`, f32) minus θ₀.
pub(super) fn tile_update(
    (map, backend): (&RowMap, &dyn Backend),
    merged: bool,
    shape: &[usize],
    tile: &Tile,
    start: u64,
    scratch: &mut super::TileScratch,
) -> Result<()> {
    let n = shape[1];
    let s = scratch;
    super::tiles::resize_exact(&mut s.base, tile.len, 0.0);
    decode(tile.dtype, tile.base, &mut s.base);
    s.values.resize_with(tile.agents.len(), Vec::new);
    s.values.truncate(tile.agents.len());
    for (tau, bytes) in s.values.iter_mut().zip(tile.agents) {
        super::tiles::resize_exact(tau, tile.len, 0.0);
        decode_minus(tile.dtype, bytes, &s.base, tau);
    }
    if merged {
        super::tiles::resize_exact(&mut s.merged, tile.len, 0.0);
        decode(
            crate::checkpoint::DType::F32,
            &s.merged_bytes,
            &mut s.merged,
        );
        s.merged.iter_mut().zip(&s.base).for_each(|(m, b)| *m -= b);
    }
    let block = Block {
        row0: start as usize / n,
        rows: tile.len / n,
        taus: &s.values,
        merged: merged.then_some(&s.merged[..]),
    };
    // On this worker alone: the tile workers keep every core busy.
    map.apply(&block, n, (backend, faer::Par::Seq), &mut s.update)
}

/// A decomposing method's merge of one tensor (Iso-C, TSV-M, ResMerge) when it is a matrix it
/// decomposes (`spectral::decomposed`): its task vectors read by scans of its tiles, then the
/// decompositions; `None` for any other tensor, which takes the method's elementwise rule.
pub(in crate::engine) fn spectral_update(
    inputs: &Inputs,
    plan: &TensorPlan,
    config: &MethodConfig,
    (at, present): (TensorPlace, &[usize]),
    (pass, backend): (&PassOptions, &dyn Backend),
    buffers: &mut ScanBuffers,
) -> Result<Option<Decomposed>> {
    let Some(matrix) = super::spectral::decomposed(config.kind, plan.name(), plan.shape()) else {
        return Ok(None);
    };
    let numel = plan.numel() as u64;
    let named = |e: anyhow::Error| e.context(format!("tensor '{}'", plan.name()));
    let resmerge = match config.kind {
        Kind::ResMerge => {
            let number = |key| config.method_number(at, key).map_err(named);
            Some(resmerge::ResMergeParams {
                rank: number("rank_topk")? as usize,
                beta_min: number("beta_min")?,
                beta_max: number("beta_max")?,
                head_ratio: number("head_ratio_budget")?,
                family: matches!(Module::of(plan.name()), Module::Attn | Module::Mlp),
            })
        }
        _ => None,
    };
    let mut scans = TensorScans::new((inputs, plan, present), pass, 0, buffers);
    // The decompositions consume this scan's values before the merge pass reads the tensor, so
    // the scan applies the finiteness gate itself: a NaN or ±Inf is refused by name, not fed to
    // them (and with --allow-nonfinite, refused by the method: `spectral::refuse_nonfinite`).
    scans.pass.scan_nonfinite = pass.scan_nonfinite;
    let what = format!("tensor '{}'", plan.name());
    let cx = MatrixWork {
        threads: rayon::current_num_threads(),
        what: &what,
        backend,
    };
    let update = match resmerge {
        Some(params) => {
            resmerge::update(&mut scans, matrix, present.len(), &params).map(Decomposed::Whole)
        }
        None => {
            let alpha = config
                .tensor_params(at, numel, present)
                .map_err(named)?
                .lambda;
            decompose(config.kind, &mut scans, matrix, alpha, &cx)
        }
    }
    .with_context(|| format!("{} of tensor '{}'", config.kind.name(), plan.name()))?;
    inputs.forget_lora_tensor(plan);
    Ok(Some(update))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_matrix_is_decomposed_and_resmerge_keeps_its_rules() {
        // A 7B model's MLP projection: every decomposing method takes it.
        let (mlp, shape) = ("model.layers.0.mlp.up_proj.weight", [11008, 4096]);
        for kind in [Kind::IsoC, Kind::Tsv, Kind::ResMerge] {
            assert_eq!(decomposed(kind, mlp, &shape), Some((11008, 4096)));
            assert_eq!(decomposed(kind, mlp, &[4096]), None);
            assert_eq!(decomposed(kind, mlp, &[1, 4096]), None);
        }
        // A 152k-token vocabulary's embeddings: Iso-C and TSV-M decompose them; ResMerge's paper
        // merges embeddings by the mean, and matrices past its bound too.
        let embed = "model.embed_tokens.weight";
        assert_eq!(
            decomposed(Kind::IsoC, embed, &[152064, 3584]),
            Some((152064, 3584))
        );
        assert_eq!(decomposed(Kind::ResMerge, embed, &[32000, 1024]), None);
        assert_eq!(decomposed(Kind::ResMerge, mlp, &[1 << 16, 1 << 15]), None);
        assert_eq!(
            decomposed(Kind::IsoC, mlp, &[1 << 16, 1 << 15]),
            Some((1 << 16, 1 << 15))
        );
    }
}
