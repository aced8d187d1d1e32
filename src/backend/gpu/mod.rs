//! The GPU backend: WGSL compute shaders (`shaders/`) dispatched with wgpu on Vulkan, Metal or DX12
//! — or Mesa's lavapipe where no GPU exists. Byte-identical to the CPU backend.
//!
//! A long-lived [`GpuContext`] holds the device, queue and compiled pipelines; [`GpuBackend`] adds
//! a pool of reusable chunk buffers. A tile from the engine is cut into chunks that fit one storage
//! binding; each worker takes a set of three slots from the pool, so the upload, the dispatch and
//! the readback of consecutive chunks overlap, and the workers' sets run side by side.

mod buffers;
mod context;
mod gemm;
mod kernels;
mod layout;
mod subnormals;

use super::cpu::CpuBackend;
use super::{Backend, CombineParams, MergeParams, Tile, TileCounts};
use crate::checkpoint::DType;
use crate::method::SharedRule;
use anyhow::Result;
use buffers::Buffers;
pub use context::{list_adapters, AdapterChoice, AdapterSummary, GpuContext};
use kernels::Kernel;
use layout::wgsl;
use std::sync::{Mutex, OnceLock};
use std::time::Duration;

/// Most agents the shaders take: masks are one u32, the workgroup histogram 32².
pub const GPU_MAX_AGENTS: usize = layout::wgsl::MAX_AGENTS as usize;
/// Elements per chunk unless the binding limit asks for fewer: several chunks per engine tile keep
/// a worker's slots busy.
const DEFAULT_CHUNK_ELEMS: usize = 1 << 20;
/// Engine tiles of several chunks, so a worker's slots overlap within a tile.
const PREFERRED_TILE_ELEMS: usize = 4 * DEFAULT_CHUNK_ELEMS;

pub(super) const DTYPE_WGSL: &str = include_str!("../../../shaders/dtype.wgsl");
pub(super) const CHUNK_WGSL: &str = include_str!("../../../shaders/chunk.wgsl");
pub(super) const PROBE_WGSL: &str = include_str!("../../../shaders/probe.wgsl");
// The kernels with an output end with `store.wgsl`'s `store_pair`, put before them.
pub(super) const MERGE_WGSL: &str = concat!(
    include_str!("../../../shaders/store.wgsl"),
    include_str!("../../../shaders/merge.wgsl")
);
pub(super) const COMBINE_WGSL: &str = concat!(
    include_str!("../../../shaders/store.wgsl"),
    include_str!("../../../shaders/combine.wgsl")
);
pub(super) const UPDATE_WGSL: &str = concat!(
    include_str!("../../../shaders/store.wgsl"),
    include_str!("../../../shaders/update.wgsl")
);
/// The spectral methods' GEMM: a standalone kernel (f32 in and out).
pub(super) const GEMM_WGSL: &str = include_str!("../../../shaders/gemm.wgsl");

/// A kernel's whole WGSL source as every user of it builds it — the pipelines, the naga
/// validation and the layout tests: the codecs (`dtype.wgsl`), the chunk's uniforms and bindings
/// (`chunk.wgsl`), then the kernel file.
pub(super) fn shader_source(kernel: &str) -> String {
    format!("{DTYPE_WGSL}\n{CHUNK_WGSL}\n{kernel}")
}
/// Most agents a consensus merge with normalization takes here: one reciprocal per agreement mask.
pub(super) const GPU_MAX_TABLE_AGENTS: usize = 16;

/// Where a backend's time went, summed over chunks.
#[derive(Clone, Copy, Debug, Default)]
pub struct PhaseTimes {
    /// Chunks dispatched.
    pub chunks: u64,
    /// Copying inputs into the queue's staging memory.
    pub upload: Duration,
    /// Recording and submitting the dispatch and the copy to the readback buffer.
    pub submit: Duration,
    /// Waiting for the device: transfer, compute and the map of the readback buffer.
    pub wait: Duration,
    /// Copying mapped results out.
    pub readback: Duration,
    /// Tiles computed by the CPU kernels: tiny values on an adapter that flushes subnormals.
    pub cpu_tiles: u64,
    /// Bytes written to the device: the chunks' inputs.
    pub bytes_up: u64,
    /// Bytes read from the device: the chunks' results.
    pub bytes_down: u64,
    /// Most chunks submitted and not yet read back at one time, over every worker.
    pub max_in_flight: u64,
}

/// The GPU backend: a [`GpuContext`] with a pool of chunk buffers, a set per worker at work.
pub struct GpuBackend {
    ctx: GpuContext,
    chunk_elems_cap: usize,
    buffers: Mutex<Vec<Buffers>>,
    times: Mutex<PhaseTimes>,
    /// Chunks submitted and not yet read back, over every worker.
    in_flight: std::sync::atomic::AtomicUsize,
    /// The adapter flushes subnormal floats (`subnormals`): tiles with tiny values go to `cpu`.
    flushes_subnormals: bool,
    /// The CPU kernels, started on the first tile that needs them.
    cpu: OnceLock<CpuBackend>,
    /// The GEMM's buffers: its B, kept while the same one comes back, and A, C and the readback.
    gemm: Mutex<gemm::GemmState>,
}

impl GpuBackend {
    /// The backend on `ctx`, after asking the adapter whether it flushes subnormals (one probe of
    /// two elements).
    pub fn new(ctx: GpuContext) -> GpuBackend {
        let mut gpu = GpuBackend {
            ctx,
            chunk_elems_cap: DEFAULT_CHUNK_ELEMS,
            buffers: Mutex::new(Vec::new()),
            times: Mutex::new(PhaseTimes::default()),
            in_flight: Default::default(),
            flushes_subnormals: false,
            cpu: OnceLock::new(),
            gemm: Mutex::new(gemm::GemmState::default()),
        };
        gpu.flushes_subnormals = subnormals::adapter_flushes(&gpu);
        gpu
    }

    /// Treats the adapter as one that flushes subnormals, whatever it does: tests exercise the
    /// CPU route for tiny values on adapters (lavapipe) that keep them.
    pub fn assume_flushing_subnormals(mut self) -> GpuBackend {
        self.flushes_subnormals = true;
        self
    }

    /// The CPU kernels when this tile must not run on this adapter (tiny values where subnormals
    /// flush); `None` for the GPU.
    fn cpu_for(&self, tile: &Tile) -> Result<Option<&CpuBackend>> {
        self.cpu_when(|| subnormals::holds_tiny_values(tile))
    }

    /// The CPU kernels when the adapter flushes subnormals and `tiny()` says the work holds tiny
    /// values (made the first time they are needed); `None` for the GPU.
    fn cpu_when(&self, tiny: impl FnOnce() -> bool) -> Result<Option<&CpuBackend>> {
        if !self.flushes_subnormals || !tiny() {
            return Ok(None);
        }
        self.add_time(|t| t.cpu_tiles += 1);
        if let Some(cpu) = self.cpu.get() {
            return Ok(Some(cpu));
        }
        let cpu = CpuBackend::new(0)?;
        Ok(Some(self.cpu.get_or_init(|| cpu)))
    }

    /// Time spent per phase since the backend was made (benchmarks report it).
    pub fn phase_times(&self) -> PhaseTimes {
        *self.times.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn add_time(&self, f: impl FnOnce(&mut PhaseTimes)) {
        f(&mut self.times.lock().unwrap_or_else(|p| p.into_inner()));
    }

    /// Caps the elements per chunk (tests use it to cross binding boundaries on small tensors).
    pub fn with_chunk_elems(mut self, elems: usize) -> GpuBackend {
        self.chunk_elems_cap = elems.max(2);
        self
    }
}

impl Backend for GpuBackend {
    fn kind(&self) -> &'static str {
        "gpu"
    }

    fn traffic(&self) -> Option<String> {
        let t = self.phase_times();
        let mb = |b: u64| b as f64 / 1e6;
        Some(format!(
            "{} chunks, {:.1} MB up and {:.1} MB down; {:.2} s uploading, {:.2} s waiting for the \
             device, {:.2} s reading back; up to {} chunks in flight",
            t.chunks,
            mb(t.bytes_up),
            mb(t.bytes_down),
            t.upload.as_secs_f64(),
            t.wait.as_secs_f64(),
            t.readback.as_secs_f64(),
            t.max_in_flight
        ))
    }

    fn describe(&self) -> String {
        let d = self.ctx.describe();
        match self.flushes_subnormals {
            true => format!(
                "{d}; it flushes subnormals, so tiles with values below 2^-60 run on the CPU"
            ),
            false => d,
        }
    }

    fn preferred_tile_elems(&self) -> usize {
        PREFERRED_TILE_ELEMS
    }

    /// Two workers: while one waits for the device with its tile, the other reads the next.
    fn run_workers(&self, worker: &(dyn Fn() + Sync)) {
        std::thread::scope(|s| {
            for _ in 0..self.workers() {
                s.spawn(worker);
            }
        });
    }

    fn workers(&self) -> usize {
        2
    }

    fn probe(&self, tile: &Tile, epsilon: f32) -> Result<TileCounts> {
        match self.cpu_for(tile)? {
            Some(cpu) => cpu.probe(tile, epsilon),
            None => self.probe_on_device(tile, epsilon),
        }
    }

    fn combine(&self, tile: &Tile, params: &CombineParams, out: &mut [u8]) -> Result<()> {
        match self.cpu_for(tile)? {
            Some(cpu) => cpu.combine(tile, params, out),
            None => self.combine_tile(tile, params, out),
        }
    }

    fn merge(&self, tile: &Tile, params: &MergeParams, out: &mut [u8]) -> Result<()> {
        if let Some(cpu) = self.cpu_for(tile)? {
            return cpu.merge(tile, params, out);
        }
        let mut unused = TileCounts::zeros(0);
        self.merge_tile(tile, params, out, Kernel::Merge, &mut unused)
    }

    fn merge_counted(
        &self,
        tile: &Tile,
        params: &MergeParams,
        out: &mut [u8],
    ) -> Result<TileCounts> {
        if let Some(cpu) = self.cpu_for(tile)? {
            return cpu.merge_counted(tile, params, out);
        }
        let mut counts = TileCounts::zeros(tile.agents.len());
        self.merge_tile(tile, params, out, Kernel::MergeCounted, &mut counts)?;
        Ok(counts)
    }

    fn matmul(
        &self,
        a: &[f32],
        b: (&[f32], u64),
        dims: (usize, usize, usize),
        out: &mut [f32],
    ) -> Result<()> {
        self.gemm(a, b, dims, out)
    }

    fn add_update(
        &self,
        tile: &Tile,
        update: &[f32],
        out_dtype: DType,
        out: &mut [u8],
    ) -> Result<()> {
        let update = &update[..tile.len];
        let tiny = || subnormals::holds_tiny_values(tile) || subnormals::holds_tiny_f32(update);
        match self.cpu_when(tiny)? {
            Some(cpu) => cpu.add_update(tile, update, out_dtype, out),
            None => self.update_tile(tile, update, out_dtype, out),
        }
    }
}

impl GpuBackend {
    /// The probe pass on the device, whatever the tile holds.
    fn probe_on_device(&self, tile: &Tile, epsilon: f32) -> Result<TileCounts> {
        let mut counts = TileCounts::zeros(tile.agents.len());
        self.run_chunks(
            tile,
            tile.dtype,
            (epsilon, wgsl::SHARED_MEAN),
            |_, _, _| Ok(()),
            Kernel::Probe,
            |_, _, results| add_hist(&mut counts, results[0]),
        )?;
        Ok(counts)
    }
}

/// Adds a chunk's probe histogram (n² u32) to the tile's counts.
fn add_hist(counts: &mut TileCounts, bytes: &[u8]) {
    for (h, w) in counts
        .hist
        .iter_mut()
        .zip(bytemuck::cast_slice::<u8, u32>(bytes))
    {
        *h += *w as u64;
    }
}

impl GpuBackend {
    /// SPEC §2 over the tile into `out` with `kernel` (`Merge`, or `MergeCounted`, whose
    /// histograms are added to `counts`).
    fn merge_tile(
        &self,
        tile: &Tile,
        params: &MergeParams,
        out: &mut [u8],
        kernel: Kernel,
        counts: &mut TileCounts,
    ) -> Result<()> {
        let lambdas = bytemuck::cast_slice::<f32, u8>(params.lambdas).to_vec();
        let q = &self.ctx.queue;
        let size = params.out_dtype.size();
        self.run_chunks(
            tile,
            params.out_dtype,
            (
                params.epsilon,
                match params.shared {
                    SharedRule::Mean => wgsl::SHARED_MEAN,
                    SharedRule::Consensus => wgsl::SHARED_CONSENSUS,
                },
            ),
            |slot, _, _| {
                q.write_buffer(&slot.lambdas, 0, &lambdas);
                Ok(())
            },
            kernel,
            |start, len, results| {
                out[start * size..(start + len) * size].copy_from_slice(&results[0][..len * size]);
                if let Some(hist) = results.get(1) {
                    add_hist(counts, hist);
                }
            },
        )
    }
}

#[cfg(test)]
mod tests {
    use super::context::one_line;
    use super::*;

    /// The shaders parse and validate without any adapter, so a shader error fails every CI run.
    #[test]
    fn shaders_validate_with_naga() {
        for (name, kernel) in [
            ("probe", PROBE_WGSL),
            ("merge", MERGE_WGSL),
            ("combine", COMBINE_WGSL),
            ("update", UPDATE_WGSL),
            ("gemm", GEMM_WGSL),
        ] {
            let source = match name {
                "gemm" => kernel.to_string(),
                _ => shader_source(kernel),
            };
            let module = naga::front::wgsl::parse_str(&source)
                .unwrap_or_else(|e| panic!("{name}: {}", e.emit_to_string(&source)));
            naga::valid::Validator::new(
                naga::valid::ValidationFlags::all(),
                naga::valid::Capabilities::empty(),
            )
            .validate(&module)
            .unwrap_or_else(|e| panic!("{name}: {e:?}"));
        }
    }

    #[test]
    fn errors_fold_to_one_line() {
        assert_eq!(
            one_line("Validation Error\n\nCaused by:\n  In X\n    limit"),
            "Validation Error Caused by: In X limit"
        );
    }
}

#[cfg(test)]
mod citation_tests {
    /// Every Rust item a shader comment cites as "src/….rs `item`" (or `Type::item`) is defined in
    /// that file: the GPU twins stay pointed at their CPU originals when code moves.
    #[test]
    fn every_rust_item_a_shader_cites_exists() {
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
        let cite = regex::Regex::new(r"(src/[\w/]+\.rs)[\s/]*`([\w:]+)`").unwrap();
        let mut checked = 0;
        for entry in std::fs::read_dir(root.join("shaders")).unwrap() {
            let path = entry.unwrap().path();
            let text = std::fs::read_to_string(&path).unwrap();
            // Comments only, joined so a citation may wrap onto the next comment line.
            let comments: String = text
                .lines()
                .filter_map(|l| l.trim_start().strip_prefix("//"))
                .collect::<Vec<_>>()
                .join(" ");
            for c in cite.captures_iter(&comments) {
                let file = root.join(&c[1]);
                let source = std::fs::read_to_string(&file).unwrap_or_else(|_| {
                    panic!("{} cites {}, which does not exist", path.display(), &c[1])
                });
                let item = c[2].rsplit("::").next().unwrap();
                let defined = ["fn ", "struct ", "enum ", "const ", "type "]
                    .iter()
                    .any(|k| source.contains(&format!("{k}{item}")));
                assert!(
                    defined,
                    "{} cites {} `{}`, which that file does not define",
                    path.display(),
                    &c[1],
                    &c[2]
                );
                checked += 1;
            }
        }
        assert!(checked >= 5, "only {checked} citations found");
    }
}
