//! The statistics scans of one tensor ([`crate::scans::Scans`]) over the input files, and the
//! combine rule they build.

use super::tile_elems;
use super::tiles::{par_tiles, resize_exact, TensorTiles};
use super::tiles::{whole_rows, TileBuffers, TileLoop, TileRead};
use super::PassOptions;
use crate::backend::{ranges, Tile};
use crate::checkpoint::dtype::{decode, decode_minus};
use crate::inputs::{Inputs, TensorPlan};
use crate::method::combine::CombineSpec;
use crate::method::settings::TensorPlace;
use crate::method::statistics::{self, Decisions};
use crate::method::MethodConfig;
use crate::scans::SCAN_CHUNK;
use crate::scans::{AgentChunk, AgentVisit, AnyOrderVisit, ChunkVisit, Scans, Values, Visit};
use anyhow::{ensure, Context, Result};
use indicatif::ProgressBar;
use rayon::prelude::*;
use std::ops::ControlFlow;
use std::sync::atomic::{AtomicUsize, Ordering};

/// Elements per tile of a statistics scan, at least.
pub(super) const SCAN_TILE_ELEMS: usize = 1 << 20;

/// One tensor's combine rule: its settings resolved, then the statistics it needs gathered by
/// scans over its tiles (on the CPU, in element order, so every backend merges with the same rule).
pub(super) fn combine_spec(
    inputs: &Inputs,
    plan: &TensorPlan,
    config: &MethodConfig,
    at: TensorPlace,
    present: &[usize],
    pass: &PassOptions,
    buffers: &mut ScanBuffers,
) -> Result<(CombineSpec, Option<Decisions>)> {
    let numel = plan.numel() as u64;
    let params = config
        .tensor_params(at, numel, present)
        .with_context(|| format!("tensor '{}'", plan.name()))?;
    ensure!(
        numel <= u32::MAX as u64,
        "tensor '{}' has {numel} elements; {} indexes elements with 32 bits",
        plan.name(),
        config.kind.name()
    );
    let whole = statistics::scan_rows(&params, numel, plan.shape())
        .with_context(|| format!("tensor '{}'", plan.name()))?;
    let mut scans = TensorScans::new((inputs, plan, present), pass, whole, buffers);
    let spec = statistics::build_spec(
        &params,
        numel,
        plan.shape(),
        config.seed,
        plan.name(),
        present,
        &mut scans,
    )
    .with_context(|| format!("statistics of tensor '{}'", plan.name()));
    // The merge pass reads the tensor again, LoRA pairs included.
    inputs.forget_lora_tensor(plan);
    spec
}

/// Every agent's τ of a tensor of `elems` elements, whole, from the scan of its tiles.
pub(super) fn gather_taus(scan: &mut dyn Scans, elems: usize) -> Result<Vec<Vec<f32>>> {
    let mut taus: Vec<Vec<f32>> = Vec::new();
    scan.tiles(&mut |tile| {
        if taus.is_empty() {
            taus = vec![vec![0.0f32; elems]; tile.tau.len()];
        }
        let start = tile.start as usize;
        for (all, tau) in taus.iter_mut().zip(tile.tau) {
            all[start..start + tau.len()].copy_from_slice(tau);
        }
        Ok(ControlFlow::Continue(()))
    })?;
    Ok(taus)
}

/// The statistics scans of one tensor, over the same tile reads as the merge pass.
pub(super) struct TensorScans<'a> {
    pub(super) inputs: &'a Inputs,
    pub(super) plan: &'a TensorPlan,
    pub(super) present: &'a [usize],
    pub(super) pass: PassOptions,
    pub(super) buffers: &'a mut ScanBuffers,
}

impl<'a> TensorScans<'a> {
    /// The scans of `plan`'s tensor held by the `present` agents: tiles of whole rows of `whole`
    /// elements (0: any length), larger than the merge's — fewer parallel steps — and not scanned
    /// for NaN/Inf (the merge pass does that).
    pub(super) fn new(
        (inputs, plan, present): (&'a Inputs, &'a TensorPlan, &'a [usize]),
        pass: &PassOptions,
        whole: u64,
        buffers: &'a mut ScanBuffers,
    ) -> TensorScans<'a> {
        let elems = tile_elems(plan, inputs, pass.tile_elems.max(SCAN_TILE_ELEMS));
        TensorScans {
            inputs,
            plan,
            present,
            pass: PassOptions {
                scan_nonfinite: false,
                tile_elems: whole_rows(elems, whole),
                ..pass.clone()
            },
            buffers,
        }
    }

    /// The any-order scans: about one tile in `every`, each read by one of the workers and
    /// visited in runs of [`SCAN_CHUNK`] elements — agent by agent, or every agent at once — or
    /// with `slab` > 0 of as many whole slabs as fit in it (at least one), the tiles then cut at
    /// whole slabs too.
    fn runs_any_order(&mut self, every: usize, slab: u64, visit: RunVisit) -> Result<()> {
        let workers = self.workers();
        let ids = AtomicUsize::new(0);
        let tensor = TensorTiles {
            plan: self.plan,
            present: self.present,
            tile_elems: whole_rows(
                tile_elems(self.plan, self.inputs, ANY_ORDER_TILE_ELEMS),
                slab,
            ),
        };
        let run = whole_rows(SCAN_CHUNK, slab);
        let how = TileLoop {
            inputs: self.inputs,
            scan_nonfinite: self.pass.scan_nonfinite,
            run_workers: &|w| {
                rayon::broadcast(|_| w());
            },
            progress: &ProgressBar::hidden(),
            stride: every.max(1),
            last_read: false,
        };
        par_tiles(
            &how,
            &[tensor],
            || {
                let id = ids.fetch_add(1, Ordering::Relaxed);
                debug_assert!(id < workers);
                (id, ScanRows::new(run), TileValues::default())
            },
            |(id, rows, all), _, _, start, tile| {
                for chunk in ranges(tile.len, run) {
                    let at = start + chunk.0 as u64;
                    match visit {
                        RunVisit::Agents { delta, visit } => {
                            if delta {
                                rows.load_base(tile, chunk);
                            }
                            for t in 0..tile.agents.len() {
                                visit(*id, t, at, rows.values(tile, t, chunk, delta));
                            }
                        }
                        RunVisit::Chunks(visit) => {
                            all.load(tile, chunk, false);
                            visit(*id, &all.values(at));
                        }
                    }
                }
                Ok(())
            },
        )?;
        Ok(())
    }

    /// The tensor's tiles in order, from the tile holding element `from`, read as the merge pass
    /// reads them (no progress shown), each handed to `visit` with its index and first element:
    /// the statistics scans that need element order.
    pub(super) fn each_tile(
        &mut self,
        from: u64,
        mut visit: impl FnMut(usize, u64, &Tile) -> Result<ControlFlow<()>>,
    ) -> Result<()> {
        // A scan from within the tensor looks for something near `from`: chunk-sized tiles.
        let pass = PassOptions {
            tile_elems: if from > 0 {
                SCAN_CHUNK
            } else {
                self.pass.tile_elems
            },
            ..self.pass.clone()
        };
        let read = TileRead {
            inputs: self.inputs,
            plan: self.plan,
            present: self.present,
            finite_only: pass.scan_nonfinite,
            spread: true,
        };
        let tiles = ranges(self.plan.numel(), pass.tile_elems).enumerate();
        // From the tile holding element `from`: tiles keep their places whatever `from` is.
        for (i, (start, len)) in tiles.skip_while(|(_, (s, l))| (s + l) as u64 <= from) {
            self.inputs.cancel.check()?;
            let flow = self
                .buffers
                .tiles
                .visit(&read, (start, len), |tile| visit(i, start as u64, tile))?;
            if flow.is_break() {
                break;
            }
        }
        Ok(())
    }
}

/// What the statistics scans read into, kept from tensor to tensor (fresh buffers per tensor
/// would fault in every page of them again, for each of a model's hundreds of tensors): the
/// tiles' bytes, and for whole-tile scans the base, each agent's values and task vectors in f32.
pub(super) struct ScanBuffers {
    tiles: TileBuffers,
    values: TileValues,
}

/// Every agent's values over a run of a tile's elements, in f32: the base, θ and τ = θ − θ₀.
#[derive(Default)]
struct TileValues {
    base: Vec<f32>,
    x: Vec<Vec<f32>>,
    tau: Vec<Vec<f32>>,
}

impl TileValues {
    /// Decodes elements `cs..cs + cl` of the tile, the agents in parallel with `parallel`.
    fn load(&mut self, tile: &Tile, (cs, cl): (usize, usize), parallel: bool) {
        let size = tile.dtype.size();
        let n = tile.agents.len();
        self.x.resize_with(n, Vec::new);
        self.tau.resize_with(n, Vec::new);
        resize_exact(&mut self.base, cl, 0.0);
        decode(
            tile.dtype,
            &tile.base[cs * size..(cs + cl) * size],
            &mut self.base,
        );
        let base = &*self.base;
        let agent = |((x, tau), bytes): ((&mut Vec<f32>, &mut Vec<f32>), &&[u8])| {
            resize_exact(x, cl, 0.0);
            decode(tile.dtype, &bytes[cs * size..(cs + cl) * size], x);
            tau.clear();
            tau.extend(x.iter().zip(base).map(|(a, b)| a - b));
        };
        let (x, tau) = (&mut self.x, &mut self.tau);
        if parallel {
            x.par_iter_mut()
                .zip(tau.par_iter_mut())
                .zip(tile.agents.par_iter())
                .for_each(agent);
        } else {
            x.iter_mut()
                .zip(tau.iter_mut())
                .zip(tile.agents.iter())
                .for_each(agent);
        }
    }

    /// The values [`Self::load`] decoded, whose first element is element `start` of the tensor.
    fn values(&self, start: u64) -> Values<'_> {
        Values {
            start,
            base: &self.base,
            x: &self.x,
            tau: &self.tau,
        }
    }
}

/// What the workers of an any-order scan hand each run of elements to.
#[derive(Clone, Copy)]
enum RunVisit<'a, 'v> {
    /// One agent at a time: τ with `delta`, else θ.
    Agents {
        delta: bool,
        visit: &'a AnyOrderVisit<'v>,
    },
    /// Every agent at once.
    Chunks(&'a ChunkVisit<'v>),
}

impl ScanBuffers {
    pub(super) fn new(agents: usize) -> ScanBuffers {
        ScanBuffers {
            tiles: TileBuffers::new(agents),
            values: TileValues::default(),
        }
    }
}

/// The f32 rows of one scan chunk: the base's, then one agent's values and task vector.
pub(super) struct ScanRows {
    pub(super) base: Vec<f32>,
    pub(super) x: Vec<f32>,
    pub(super) tau: Vec<f32>,
}

impl ScanRows {
    /// Rows of chunks up to `len` elements.
    pub(super) fn new(len: usize) -> ScanRows {
        ScanRows {
            base: vec![0.0; len],
            x: vec![0.0; len],
            tau: vec![0.0; len],
        }
    }

    /// Decodes the base's elements `cs..cs + cl` of the tile.
    pub(super) fn load_base(&mut self, tile: &Tile, (cs, cl): (usize, usize)) {
        let size = tile.dtype.size();
        decode(
            tile.dtype,
            &tile.base[cs * size..(cs + cl) * size],
            &mut self.base[..cl],
        );
    }

    /// Agent `t`'s values over the same elements: τ (after [`Self::load_base`]) with `delta`,
    /// else θ.
    pub(super) fn values(
        &mut self,
        tile: &Tile,
        t: usize,
        (cs, cl): (usize, usize),
        delta: bool,
    ) -> &[f32] {
        let size = tile.dtype.size();
        let bytes = &tile.agents[t][cs * size..(cs + cl) * size];
        if delta {
            decode_minus(tile.dtype, bytes, &self.base[..cl], &mut self.tau[..cl]);
            &self.tau[..cl]
        } else {
            decode(tile.dtype, bytes, &mut self.x[..cl]);
            &self.x[..cl]
        }
    }

    /// Agent `t`'s chunk over the same elements (after [`Self::load_base`]); the tile starts at
    /// element `start` of the tensor.
    pub(super) fn agent(
        &mut self,
        tile: &Tile,
        t: usize,
        start: u64,
        (cs, cl): (usize, usize),
    ) -> AgentChunk<'_> {
        let size = tile.dtype.size();
        let bytes = &tile.agents[t][cs * size..(cs + cl) * size];
        decode(tile.dtype, bytes, &mut self.x[..cl]);
        decode_minus(tile.dtype, bytes, &self.base[..cl], &mut self.tau[..cl]);
        AgentChunk {
            start: start + cs as u64,
            base: &self.base[..cl],
            x: &self.x[..cl],
            tau: &self.tau[..cl],
        }
    }
}

/// Elements per tile of an any-order statistics scan: a multiple of [`SCAN_CHUNK`], small enough
/// that a worker's tile stays in its core's cache from the read to the last agent's chunk.
pub(super) const ANY_ORDER_TILE_ELEMS: usize = 1 << 16;

impl Scans for TensorScans<'_> {
    fn workers(&self) -> usize {
        rayon::current_num_threads()
    }

    fn any_order(&mut self, every: usize, delta: bool, visit: &AnyOrderVisit) -> Result<()> {
        self.runs_any_order(every, 0, RunVisit::Agents { delta, visit })
    }

    fn slabs_any_order(&mut self, slab: u64, delta: bool, visit: &AnyOrderVisit) -> Result<()> {
        self.runs_any_order(1, slab.max(1), RunVisit::Agents { delta, visit })
    }

    fn chunks_any_order(&mut self, visit: &ChunkVisit) -> Result<()> {
        self.runs_any_order(1, 0, RunVisit::Chunks(visit))
    }

    fn tiles(&mut self, visit: &mut Visit) -> Result<()> {
        let mut values = std::mem::take(&mut self.buffers.values);
        let result = self.each_tile(0, |_, start, tile| {
            values.load(tile, (0, tile.len), true);
            visit(&values.values(start))
        });
        self.buffers.values = values;
        result
    }

    fn per_agent(&mut self, from: u64, visit: &AgentVisit) -> Result<()> {
        let mut done = vec![false; self.present.len()];
        self.each_tile(from, |_, start, tile| {
            let flows: Vec<bool> = (0..done.len())
                .into_par_iter()
                .map(|t| {
                    if done[t] {
                        return true;
                    }
                    let mut rows = ScanRows::new(SCAN_CHUNK);
                    let chunks = ranges(tile.len, SCAN_CHUNK);
                    for chunk in chunks.skip_while(|(cs, cl)| start + ((cs + cl) as u64) <= from) {
                        rows.load_base(tile, chunk);
                        if visit(t, &rows.agent(tile, t, start, chunk)).is_break() {
                            return true;
                        }
                    }
                    false
                })
                .collect();
            for (d, f) in done.iter_mut().zip(flows) {
                *d |= f;
            }
            Ok(if done.iter().all(|&d| d) {
                ControlFlow::Break(())
            } else {
                ControlFlow::Continue(())
            })
        })
    }
}
