//! Compute backends: the probe and selective-merge passes over one tile of raw tensor bytes.
//!
//! A backend knows nothing about files or tensors' names; the engine knows nothing about how a
//! backend computes. Every backend gives the same bytes as [`cpu::CpuBackend`], the reference.

pub mod cpu;
pub mod gpu;

use crate::checkpoint::DType;
use crate::method::combine::CombineSpec;
use crate::method::SharedRule;
use anyhow::Result;

/// Consecutive `(start, len)` ranges of at most `step` (≥ 1) covering `0..total`: the engine's tiles
/// and a backend's chunks of a tile.
pub fn ranges(total: usize, step: usize) -> impl Iterator<Item = (usize, usize)> {
    let step = step.max(1);
    (0..total.div_ceil(step)).map(move |i| (i * step, step.min(total - i * step)))
}

/// One tile: the same element range of the base and of each agent that has the tensor, raw bytes.
pub struct Tile<'a> {
    /// dtype of the base and every agent (validated equal by the engine).
    pub dtype: DType,
    /// Elements in the tile.
    pub len: usize,
    /// The base's bytes of the tile, in `dtype`.
    pub base: &'a [u8],
    /// Each agent's bytes of the tile, in `dtype`.
    pub agents: &'a [&'a [u8]],
}

/// Probe counts of a tile: `hist[t * n + k]` = elements agent t changed and k other agents changed too.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TileCounts {
    /// Agents in the tile (n).
    pub agents: usize,
    /// n × n counts, row t: elements agent t changed, by how many others changed them too.
    pub hist: Vec<u64>,
}

impl TileCounts {
    /// No counts, for `agents` agents.
    pub fn zeros(agents: usize) -> TileCounts {
        TileCounts {
            agents,
            hist: vec![0; agents * agents],
        }
    }

    /// Adds `other` (same agent count) into `self`.
    pub fn add(&mut self, other: &TileCounts) {
        debug_assert_eq!(self.agents, other.agents);
        for (a, b) in self.hist.iter_mut().zip(&other.hist) {
            *a += b;
        }
    }

    /// Agent t's row: k = 0..n−1.
    pub fn row(&self, t: usize) -> &[u64] {
        &self.hist[t * self.agents..(t + 1) * self.agents]
    }
}

/// Parameters of the selective merge of one tile (SPEC §2).
pub struct MergeParams<'a> {
    /// RAM's ε (SPEC §1).
    pub epsilon: f32,
    /// λ_t for each agent of the tile, as f32.
    pub lambdas: &'a [f32],
    /// The dtype the merged tile is written in.
    pub out_dtype: DType,
    /// The rule for elements two or more agents changed (SPEC §2b).
    pub shared: SharedRule,
}

/// Parameters of the generalized task-arithmetic merge of one tile (SPEC §4).
pub struct CombineParams<'a> {
    /// The tensor's combine rule.
    pub spec: &'a CombineSpec,
    /// Index in the tensor of the tile's first element (random masks and coefficient rows).
    pub start: u64,
    /// The dtype the merged tile is written in.
    pub out_dtype: DType,
    /// [`crate::method::combine::Keep::Flagged`] agents (DELLA's keep decisions, arcee_fusion's
    /// test): each agent's flags over the tile; empty otherwise.
    pub flags: &'a [Vec<u32>],
    /// Fisher: one coefficient row per tile element (`CombineSpec::tile_coefs`); empty otherwise.
    pub coefs: &'a [f32],
}

/// A compute backend.
pub trait Backend: Send + Sync {
    /// What runs the work, for the user ("cpu (2 threads)", "gpu: llvmpipe (Vulkan)").
    fn describe(&self) -> String;

    /// Which backend this is, as the record names it: `cpu` or `gpu`. Every merge writes the
    /// same bytes on both but the spectral methods, whose GEMMs sum in another order.
    fn kind(&self) -> &'static str {
        "cpu"
    }

    /// Where a device backend's time and bytes went since it was made (bytes up and down, time
    /// uploading, waiting for the device, reading back, most chunks in flight), in one line;
    /// `None` for the CPU backend, which moves nothing.
    fn traffic(&self) -> Option<String> {
        None
    }

    /// Elements per engine tile this backend runs best with (results never depend on it).
    fn preferred_tile_elems(&self) -> usize;

    /// Runs `worker` once on each of the backend's tile workers, all at once, and returns when
    /// every one has returned. The engine's tile loop runs inside: each worker reads a tile, runs
    /// it through this backend and writes it, then takes the next. Calls from a worker may run
    /// on that worker alone (the engine spreads tiles, not a tile's chunks).
    fn run_workers(&self, worker: &(dyn Fn() + Sync));

    /// How many workers [`Self::run_workers`] runs.
    fn workers(&self) -> usize;

    /// Runs `work` — a tensor's statistics scans, CPU work spread with rayon — on the CPU
    /// threads this backend merges with: the CPU backend's workers (so `--threads` bounds the
    /// scans too, and the tile buffers of a merge live on as many threads as it has workers);
    /// rayon's global pool, every core, for a backend whose workers feed a device.
    fn run_cpu_work(&self, work: &mut (dyn FnMut() + Send)) {
        work()
    }

    /// SPEC §1 over the tile: per agent, elements changed and shared with k others.
    fn probe(&self, tile: &Tile, epsilon: f32) -> Result<TileCounts>;

    /// SPEC §2 over the tile into `out` (`tile.len × out_dtype.size()` bytes).
    fn merge(&self, tile: &Tile, params: &MergeParams, out: &mut [u8]) -> Result<()>;

    /// [`Backend::merge`], returning also SPEC §1's counts of the same tile ([`Backend::probe`]'s
    /// result) from the one read of its bytes: plain RAM reports what each agent changed without
    /// a probe pass.
    fn merge_counted(
        &self,
        tile: &Tile,
        params: &MergeParams,
        out: &mut [u8],
    ) -> Result<TileCounts>;

    /// SPEC §4's generalized task-arithmetic rule over the tile into `out`.
    fn combine(&self, tile: &Tile, params: &CombineParams, out: &mut [u8]) -> Result<()>;

    /// C = A·B in f32, row-major: A rows × k, B k × cols, into `out` (rows × cols). `b.1` names
    /// B: the same key, the same values — a backend may keep B between calls (a tensor's row
    /// map is the same for each of its tiles). The GEMM of the spectral methods' row maps (SPEC
    /// §4g): the CPU backend's is faer's, the GPU's `shaders/gemm.wgsl`.
    fn matmul(
        &self,
        a: &[f32],
        b: (&[f32], u64),
        (rows, k, cols): (usize, usize, usize),
        out: &mut [f32],
    ) -> Result<()> {
        let a = faer::MatRef::from_row_major_slice(a, rows, k);
        let b = faer::MatRef::from_row_major_slice(b.0, k, cols);
        let c = faer::MatMut::from_row_major_slice_mut(out, rows, cols);
        faer::linalg::matmul::matmul(c, faer::Accum::Replace, a, b, 1.0, faer::Par::rayon(0));
        Ok(())
    }

    /// A host-computed update (Iso-C, TSV-M, ResMerge, SVC: SPEC §4c–§4f) added to the tile's
    /// base into `out` in `out_dtype`: each element θ₀ + Δ in f32, encoded once. The tile's
    /// agents are not read (it has none).
    fn add_update(
        &self,
        tile: &Tile,
        update: &[f32],
        out_dtype: DType,
        out: &mut [u8],
    ) -> Result<()>;
}
