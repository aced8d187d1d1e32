//! The GPU backend: WGSL compute shaders (`shaders/`) dispatched with wgpu on Vulkan, Metal or DX12
//! — or Mesa's lavapipe where no GPU exists. Byte-identical to the CPU backend.
//!
//! A long-lived [`GpuContext`] holds the device, queue and compiled pipelines; [`GpuBackend`] adds
//! reusable chunk buffers. A tile from the engine is cut into chunks that fit one storage binding;
//! chunks alternate between two buffer sets so the upload and dispatch of one overlap the readback
//! of the other.

use super::{ranges, Backend, CombineParams, MergeParams, Tile, TileCounts};
use crate::checkpoint::DType;
use crate::method::combine::{Keep, Normalize};
use anyhow::{anyhow, bail, ensure, Context, Result};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Most agents the shaders take: masks are one u32, the workgroup histogram 32².
pub const GPU_MAX_AGENTS: usize = 32;
/// Elements per chunk unless the binding limit asks for fewer: several chunks per engine tile keep
/// the two buffer sets busy.
const DEFAULT_CHUNK_ELEMS: usize = 1 << 20;
/// Engine tiles of several chunks, so the two buffer sets overlap within a tile.
const PREFERRED_TILE_ELEMS: usize = 4 * DEFAULT_CHUNK_ELEMS;
const WORKGROUP: u32 = 256;
const MAX_GROUPS_PER_DIM: u32 = 65_535;

const DTYPE_WGSL: &str = include_str!("../../shaders/dtype.wgsl");
const CHUNK_WGSL: &str = include_str!("../../shaders/chunk.wgsl");
const PROBE_WGSL: &str = include_str!("../../shaders/probe.wgsl");
const MERGE_WGSL: &str = include_str!("../../shaders/merge.wgsl");
const COMBINE_WGSL: &str = include_str!("../../shaders/combine.wgsl");
/// Most agents a consensus merge with normalization takes here: one reciprocal per agreement mask.
const GPU_MAX_TABLE_AGENTS: usize = 16;

/// The uniform block both shaders read (`struct Params` in shaders/chunk.wgsl).
#[repr(C)]
#[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
struct Params {
    len: u32,
    pairs: u32,
    n: u32,
    in_dt: u32,
    out_dt: u32,
    stride: u32,
    eps: f32,
    zero: u32,
    groups_x: u32,
    _pad: [u32; 3],
}

/// The uniforms of a chunk of `len` elements of `tile`.
fn chunk_params(tile: &Tile, len: usize, out_dt: DType, eps: f32) -> Params {
    let pairs = len.div_ceil(2);
    let groups = (pairs as u32).div_ceil(WORKGROUP).max(1);
    // Words per agent segment, even, so an f32 pair never reads past its segment.
    let words = match tile.dtype {
        DType::F32 => len,
        _ => len.div_ceil(2),
    };
    Params {
        len: len as u32,
        pairs: pairs as u32,
        n: tile.agents.len() as u32,
        in_dt: dtype_code(tile.dtype),
        out_dt: dtype_code(out_dt),
        stride: (words.max(1).div_ceil(2) * 2) as u32,
        eps,
        zero: 0,
        groups_x: groups.min(MAX_GROUPS_PER_DIM),
        _pad: [0; 3],
    }
}

/// The uniform block of the combine kernel (`struct Comb` in shaders/combine.wgsl).
#[repr(C)]
#[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
struct Comb {
    start: u32,
    row_len: u32,
    first_row: u32,
    delta: u32,
    consensus: u32,
    norm_mode: u32,
    lambda: f32,
    fixed_recip: f32,
    nearswap: u32,
    nearswap_t: f32,
    element_keep: u32,
    element_value: u32,
    element_index: u32,
    inv_n: f32,
    sign_of_values: u32,
    _pad: u32,
}

/// An agent's keep rule as the 8 words `rules` holds.
fn rule_words(k: &Keep) -> [u32; 8] {
    match *k {
        Keep::All => [0; 8],
        Keep::Band { lo, hi } => [
            1,
            lo.value,
            lo.index,
            hi.value,
            hi.index,
            lo.high_first as u32 | (hi.high_first as u32) << 1,
            0,
            0,
        ],
        Keep::Random { threshold, key } => [2, 0, 0, 0, 0, threshold, key[0], key[1]],
        Keep::RowRank { p0, step, key } => {
            [3, p0.to_bits(), step.to_bits(), 0, 0, 0, key[0], key[1]]
        }
    }
}

fn dtype_code(d: DType) -> u32 {
    match d {
        DType::BF16 => 0,
        DType::F16 => 1,
        DType::F32 => 2,
    }
}

/// Which adapter the user asked for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AdapterChoice {
    /// A hardware GPU (discrete, integrated or virtual); `None` when there is only a CPU adapter.
    HardwareOnly,
    /// Any adapter, software ones (lavapipe, WARP) included.
    Any,
}

/// One adapter as `rlmerge devices` lists it.
pub struct AdapterSummary {
    pub info: wgpu::AdapterInfo,
    pub limits: wgpu::Limits,
    /// Whether a merge on it maps its storage buffers (see `mapped_buffers`).
    pub mapped: bool,
}

fn backends_from_env() -> wgpu::Backends {
    wgpu::Backends::from_env()
        .unwrap_or(wgpu::Backends::VULKAN | wgpu::Backends::METAL | wgpu::Backends::DX12)
}

fn new_instance() -> wgpu::Instance {
    wgpu::Instance::new(wgpu::InstanceDescriptor {
        backends: backends_from_env(),
        ..wgpu::InstanceDescriptor::new_without_display_handle_from_env()
    })
}

/// Every adapter wgpu sees (honouring `WGPU_BACKEND`).
pub fn list_adapters() -> Vec<AdapterSummary> {
    let instance = new_instance();
    pollster::block_on(instance.enumerate_adapters(backends_from_env()))
        .into_iter()
        .map(|a| AdapterSummary {
            info: a.get_info(),
            limits: a.limits(),
            mapped: mapped_buffers(&a),
        })
        .collect()
}

/// Ranks adapters: discrete > integrated > virtual > CPU (integrated first with `WGPU_POWER_PREF=low`).
fn rank(info: &wgpu::AdapterInfo, low_power: bool) -> u32 {
    match info.device_type {
        wgpu::DeviceType::DiscreteGpu if low_power => 3,
        wgpu::DeviceType::IntegratedGpu if low_power => 4,
        wgpu::DeviceType::DiscreteGpu => 4,
        wgpu::DeviceType::IntegratedGpu => 3,
        wgpu::DeviceType::VirtualGpu => 2,
        wgpu::DeviceType::Cpu => 1,
        wgpu::DeviceType::Other => 0,
    }
}

/// The device, queue and compiled pipelines, built once.
pub struct GpuContext {
    pub device: wgpu::Device,
    pub queue: wgpu::Queue,
    pub info: wgpu::AdapterInfo,
    pub limits: wgpu::Limits,
    probe_pipeline: wgpu::ComputePipeline,
    merge_pipeline: wgpu::ComputePipeline,
    combine_pipeline: wgpu::ComputePipeline,
    /// The first asynchronous device error (validation, out of memory, device lost), if any.
    error: Arc<Mutex<Option<String>>>,
    /// Chunk inputs and results live in mapped storage buffers (see [`mapped_buffers`]).
    pub mapped: bool,
}

/// Whether to map the storage buffers themselves instead of staging through copies: where the
/// adapter offers `MAPPABLE_PRIMARY_BUFFERS` and its memory is the host's (CPU and integrated
/// adapters: lavapipe, Apple silicon), which saves a copy each way. `RLMERGE_GPU_MAPPED=0` turns it
/// off (the tests run both paths).
fn mapped_buffers(adapter: &wgpu::Adapter) -> bool {
    let info = adapter.get_info();
    let host_memory = matches!(
        info.device_type,
        wgpu::DeviceType::Cpu | wgpu::DeviceType::IntegratedGpu
    );
    host_memory
        && adapter
            .features()
            .contains(wgpu::Features::MAPPABLE_PRIMARY_BUFFERS)
        && std::env::var("RLMERGE_GPU_MAPPED").map_or(true, |v| v != "0")
}

impl GpuContext {
    /// Opens the best adapter for `choice` (honouring `WGPU_BACKEND`, `WGPU_ADAPTER_NAME`,
    /// `WGPU_POWER_PREF`); `Ok(None)` when none fits.
    pub fn open(choice: AdapterChoice) -> Result<Option<GpuContext>> {
        let instance = new_instance();
        let adapters = pollster::block_on(instance.enumerate_adapters(backends_from_env()));
        let wanted_name = std::env::var("WGPU_ADAPTER_NAME")
            .ok()
            .map(|s| s.to_lowercase());
        let low_power = wgpu::PowerPreference::from_env() == Some(wgpu::PowerPreference::LowPower);
        let names: Vec<String> = adapters.iter().map(|a| a.get_info().name).collect();
        let best = adapters
            .into_iter()
            .filter(|a| {
                let info = a.get_info();
                let name_ok = wanted_name
                    .as_ref()
                    .is_none_or(|w| info.name.to_lowercase().contains(w));
                let kind_ok =
                    choice == AdapterChoice::Any || info.device_type != wgpu::DeviceType::Cpu;
                name_ok && kind_ok
            })
            .max_by_key(|a| rank(&a.get_info(), low_power));
        let Some(adapter) = best else {
            if let Some(w) = wanted_name {
                bail!(
                    "WGPU_ADAPTER_NAME={w} matches no adapter (found: {})",
                    names.join(", ")
                );
            }
            return Ok(None);
        };
        Self::from_adapter(adapter).map(Some)
    }

    fn from_adapter(adapter: wgpu::Adapter) -> Result<GpuContext> {
        let info = adapter.get_info();
        // The adapter's own limits: lavapipe binds 128 MiB, a discrete GPU far more.
        let limits = adapter.limits();
        let mapped = mapped_buffers(&adapter);
        let features = if mapped {
            wgpu::Features::MAPPABLE_PRIMARY_BUFFERS
        } else {
            wgpu::Features::empty()
        };
        let (device, queue) = pollster::block_on(adapter.request_device(&wgpu::DeviceDescriptor {
            label: Some("rlmerge"),
            required_features: features,
            required_limits: limits.clone(),
            experimental_features: wgpu::ExperimentalFeatures::disabled(),
            memory_hints: wgpu::MemoryHints::Performance,
            trace: wgpu::Trace::Off,
        }))
        .with_context(|| {
            format!(
                "cannot open a device on adapter '{}' ({:?})",
                info.name, info.backend
            )
        })?;
        let error = Arc::new(Mutex::new(None::<String>));
        let slot = error.clone();
        device.on_uncaptured_error(Arc::new(move |e: wgpu::Error| {
            let mut s = slot.lock().unwrap_or_else(|p| p.into_inner());
            s.get_or_insert_with(|| one_line(&format!("{e}")));
        }));
        let slot = error.clone();
        device.set_device_lost_callback(move |reason, msg| {
            let mut s = slot.lock().unwrap_or_else(|p| p.into_inner());
            s.get_or_insert_with(|| one_line(&format!("device lost ({reason:?}): {msg}")));
        });
        let probe_pipeline = compute_pipeline(&device, "probe", PROBE_WGSL);
        let merge_pipeline = compute_pipeline(&device, "merge", MERGE_WGSL);
        let combine_pipeline = compute_pipeline(&device, "combine", COMBINE_WGSL);
        let ctx = GpuContext {
            device,
            queue,
            info,
            limits,
            probe_pipeline,
            merge_pipeline,
            combine_pipeline,
            error,
            mapped,
        };
        ctx.check().context("compiling the shaders failed")?;
        Ok(ctx)
    }

    /// Returns the first recorded device error, if any.
    fn check(&self) -> Result<()> {
        match self
            .error
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .as_ref()
        {
            Some(e) => Err(anyhow!("GPU error on '{}': {e}", self.info.name)),
            None => Ok(()),
        }
    }

    pub fn describe(&self) -> String {
        format!(
            "gpu: {} ({:?}, {:?}{})",
            self.info.name,
            self.info.backend,
            self.info.device_type,
            if self.mapped { ", mapped buffers" } else { "" }
        )
    }
}

/// wgpu's multi-line error reports folded into one line, as every rlmerge error is.
fn one_line(text: &str) -> String {
    text.lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .collect::<Vec<_>>()
        .join(" ")
}

/// A compute pipeline from `dtype.wgsl` + `chunk.wgsl` + a kernel file; its layout comes from the shader.
fn compute_pipeline(device: &wgpu::Device, entry: &str, kernel: &str) -> wgpu::ComputePipeline {
    let source = format!("{DTYPE_WGSL}\n{CHUNK_WGSL}\n{kernel}");
    let module = device.create_shader_module(wgpu::ShaderModuleDescriptor {
        label: Some(entry),
        source: wgpu::ShaderSource::Wgsl(source.into()),
    });
    device.create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
        label: Some(entry),
        layout: None,
        module: &module,
        entry_point: Some(entry),
        compilation_options: Default::default(),
        cache: None,
    })
}

/// One set of chunk buffers; two alternate.
struct Slot {
    params: wgpu::Buffer,
    base: wgpu::Buffer,
    agents: wgpu::Buffer,
    lambdas: wgpu::Buffer,
    out: wgpu::Buffer,
    hist: wgpu::Buffer,
    readback: wgpu::Buffer,
    comb: wgpu::Buffer,
    rules: wgpu::Buffer,
    ranks: wgpu::Buffer,
    coefs: wgpu::Buffer,
    table: wgpu::Buffer,
    merge_group: wgpu::BindGroup,
    probe_group: wgpu::BindGroup,
    combine_group: wgpu::BindGroup,
}

/// Buffers sized for `chunk_elems` elements of up to `agents` agents.
struct Buffers {
    agents: usize,
    chunk_elems: usize,
    slots: [Slot; 2],
    /// Each slot's last submission: a mapped upload waits for it alone.
    last: [Option<wgpu::SubmissionIndex>; 2],
}

/// Where a backend's time went, summed over chunks.
#[derive(Clone, Copy, Debug, Default)]
pub struct PhaseTimes {
    pub chunks: u64,
    /// Copying inputs into the queue's staging memory.
    pub upload: Duration,
    /// Recording and submitting the dispatch and the copy to the readback buffer.
    pub submit: Duration,
    /// Waiting for the device: transfer, compute and the map of the readback buffer.
    pub wait: Duration,
    /// Copying mapped results out.
    pub readback: Duration,
}

pub struct GpuBackend {
    ctx: GpuContext,
    chunk_elems_cap: usize,
    buffers: Mutex<Option<Buffers>>,
    times: Mutex<PhaseTimes>,
}

impl GpuBackend {
    pub fn new(ctx: GpuContext) -> GpuBackend {
        GpuBackend {
            ctx,
            chunk_elems_cap: DEFAULT_CHUNK_ELEMS,
            buffers: Mutex::new(None),
            times: Mutex::new(PhaseTimes::default()),
        }
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

    /// Elements per chunk for `n` agents: every binding (the agents' or the coefficients' is the
    /// largest) within the adapter's limits, and even, so 16-bit chunks start on a word.
    fn chunk_elems(&self, n: usize) -> usize {
        // Fault injection for tests: exceed the binding limit to provoke a device validation error.
        if std::env::var_os("RLMERGE_TEST_GPU_IGNORE_LIMITS").is_some() {
            return self.chunk_elems_cap & !1;
        }
        let l = &self.ctx.limits;
        let bind = l.max_storage_buffer_binding_size.min(l.max_buffer_size);
        // Per element: 4 bytes per agent, or a coefficient row of 4 bytes per agent plus one
        // (at least two: row-wise slerp; one per element: Fisher). Less two: the coefficient
        // buffer has a row to spare.
        let by_limit = ((bind / (4 * (n as u64 + 1)).max(8)) as usize).saturating_sub(2);
        (by_limit.min(self.chunk_elems_cap) & !1).max(2)
    }

    fn ensure_buffers(&self, guard: &mut Option<Buffers>, n: usize) -> Result<()> {
        let chunk = self.chunk_elems(n);
        if let Some(b) = guard.as_ref() {
            if b.agents >= n && b.chunk_elems >= chunk {
                return Ok(());
            }
        }
        *guard = None;
        let d = &self.ctx.device;
        let words = chunk as u64; // f32 worst case: one word per element
        let storage = |label: &str, bytes: u64, extra: wgpu::BufferUsages| {
            d.create_buffer(&wgpu::BufferDescriptor {
                label: Some(label),
                size: bytes.max(16),
                usage: wgpu::BufferUsages::STORAGE | extra,
                mapped_at_creation: false,
            })
        };
        let dst = wgpu::BufferUsages::COPY_DST;
        let make_slot = || {
            let params = d.create_buffer(&wgpu::BufferDescriptor {
                label: Some("params"),
                size: std::mem::size_of::<Params>() as u64,
                usage: wgpu::BufferUsages::UNIFORM | dst,
                mapped_at_creation: false,
            });
            // Mapped: inputs are written through a map, results read through one, no copies.
            let (input, result) = if self.ctx.mapped {
                (wgpu::BufferUsages::MAP_WRITE, wgpu::BufferUsages::MAP_READ)
            } else {
                (dst, wgpu::BufferUsages::COPY_SRC)
            };
            let base = storage("base", words * 4, input);
            let agents = storage("agents", words * 4 * n as u64, input);
            let lambdas = storage("lambdas", 4 * GPU_MAX_AGENTS as u64, dst);
            let out = storage("out", words * 4, result);
            let hist = storage("hist", 4 * (n * n) as u64, dst | result);
            let readback = d.create_buffer(&wgpu::BufferDescriptor {
                label: Some("readback"),
                // Holds a chunk's merged output or the probe histogram, whichever is larger.
                size: (words * 4).max(4 * (n * n) as u64),
                usage: wgpu::BufferUsages::MAP_READ | dst,
                mapped_at_creation: false,
            });
            fn entries<'a>(bufs: &[&'a wgpu::Buffer]) -> Vec<wgpu::BindGroupEntry<'a>> {
                bufs.iter()
                    .enumerate()
                    .map(|(i, b)| wgpu::BindGroupEntry {
                        binding: i as u32,
                        resource: b.as_entire_binding(),
                    })
                    .collect()
            }
            let merge_group = d.create_bind_group(&wgpu::BindGroupDescriptor {
                label: Some("merge"),
                layout: &self.ctx.merge_pipeline.get_bind_group_layout(0),
                entries: &entries(&[&params, &base, &agents, &lambdas, &out]),
            });
            let probe_group = d.create_bind_group(&wgpu::BindGroupDescriptor {
                label: Some("probe"),
                layout: &self.ctx.probe_pipeline.get_bind_group_layout(0),
                entries: &entries(&[&params, &base, &agents, &hist]),
            });
            let comb = d.create_buffer(&wgpu::BufferDescriptor {
                label: Some("comb"),
                size: std::mem::size_of::<Comb>() as u64,
                usage: wgpu::BufferUsages::UNIFORM | dst,
                mapped_at_creation: false,
            });
            let rules = storage("rules", 32 * GPU_MAX_AGENTS as u64, dst);
            // DELLA's row ranks: one u32 per element and agent, laid out like `agents` in f32.
            let ranks = storage("ranks", words * 4 * n as u64, dst);
            let coefs = storage("coefs", coef_floats(chunk, n) as u64 * 4, dst);
            let table = storage("reciprocal table", 4 << GPU_MAX_TABLE_AGENTS, dst);
            let combine_group = d.create_bind_group(&wgpu::BindGroupDescriptor {
                label: Some("combine"),
                layout: &self.ctx.combine_pipeline.get_bind_group_layout(0),
                entries: &entries(&[
                    &params, &base, &agents, &comb, &rules, &coefs, &table, &out, &ranks,
                ]),
            });
            Slot {
                params,
                base,
                agents,
                lambdas,
                out,
                hist,
                readback,
                comb,
                rules,
                ranks,
                coefs,
                table,
                merge_group,
                probe_group,
                combine_group,
            }
        };
        let slots = [make_slot(), make_slot()];
        self.ctx.check().with_context(|| {
            format!("cannot allocate GPU buffers for {chunk} elements × {n} agents")
        })?;
        *guard = Some(Buffers {
            agents: n,
            chunk_elems: chunk,
            slots,
            last: [None, None],
        });
        Ok(())
    }

    /// Uploads the chunk `params` describes, starting at element `start` of the tile, into `slot`;
    /// `last` is the slot's previous submission (mapped buffers wait for it to be idle).
    fn upload(
        &self,
        slot: &Slot,
        tile: &Tile,
        start: usize,
        params: &Params,
        last: Option<wgpu::SubmissionIndex>,
    ) -> Result<()> {
        let size = tile.dtype.size();
        let stride_words = params.stride as usize;
        let len = params.len as usize;
        let q = &self.ctx.queue;
        q.write_buffer(&slot.params, 0, bytemuck::bytes_of(params));
        let bytes = len * size;
        // Pad to whole words (a 16-bit chunk of odd length shares its last word with padding).
        let padded = (stride_words * 4) as u64;
        if self.ctx.mapped {
            let n = tile.agents.len() as u64;
            let (base, agents) = (slot.base.slice(..padded), slot.agents.slice(..padded * n));
            self.map_wait(&[base, agents], wgpu::MapMode::Write, last, "upload")?;
            let p = padded as usize;
            let write = |view: &mut wgpu::BufferViewMut, at: usize, src: &[u8]| {
                view.slice(at..at + src.len()).copy_from_slice(src);
                let rest = p - src.len();
                view.slice(at + src.len()..at + p)
                    .copy_from_slice(&[0u8; 8][..rest]);
            };
            let range = start * size..start * size + len * size;
            let mapped = |slice: wgpu::BufferSlice| {
                slice
                    .get_mapped_range_mut()
                    .map_err(|e| anyhow!("writing the GPU upload failed: {e}"))
            };
            let mut view = mapped(base)?;
            write(&mut view, 0, &tile.base[range.clone()]);
            drop(view);
            let mut view = mapped(agents)?;
            for (t, agent) in tile.agents.iter().enumerate() {
                write(&mut view, t * p, &agent[range.clone()]);
            }
            drop(view);
            slot.base.unmap();
            slot.agents.unmap();
            return Ok(());
        }
        let put = |buffer: &wgpu::Buffer, offset: u64, src: &[u8]| -> Result<()> {
            let size = wgpu::BufferSize::new(padded).expect("chunks are never empty");
            let mut view = q.write_buffer_with(buffer, offset, size).ok_or_else(|| {
                anyhow!("GPU upload of {padded} bytes at offset {offset} was refused")
            })?;
            view.slice(..src.len()).copy_from_slice(src);
            // At most 7 bytes: the rest of the last word, and a word that keeps the stride even.
            let rest = padded as usize - src.len();
            view.slice(src.len()..).copy_from_slice(&[0u8; 8][..rest]);
            Ok(())
        };
        put(
            &slot.base,
            0,
            &tile.base[start * size..start * size + bytes],
        )?;
        for (t, agent) in tile.agents.iter().enumerate() {
            put(
                &slot.agents,
                t as u64 * padded,
                &agent[start * size..start * size + bytes],
            )?;
        }
        Ok(())
    }

    fn dispatch(
        &self,
        encoder: &mut wgpu::CommandEncoder,
        pipeline: &wgpu::ComputePipeline,
        group: &wgpu::BindGroup,
        params: &Params,
    ) {
        let groups = params.pairs.div_ceil(WORKGROUP).max(1);
        let mut pass = encoder.begin_compute_pass(&wgpu::ComputePassDescriptor {
            label: None,
            timestamp_writes: None,
        });
        pass.set_pipeline(pipeline);
        pass.set_bind_group(0, group, &[]);
        pass.dispatch_workgroups(params.groups_x, groups.div_ceil(params.groups_x), 1);
    }

    /// Maps `slices` for `mode`, waiting for submission `after` (their buffers' last use; `None`:
    /// every submission) — a map of an idle buffer completes in that wait.
    fn map_wait(
        &self,
        slices: &[wgpu::BufferSlice],
        mode: wgpu::MapMode,
        after: Option<wgpu::SubmissionIndex>,
        what: &str,
    ) -> Result<()> {
        let (sender, mapped) = std::sync::mpsc::channel();
        for slice in slices {
            let sender = sender.clone();
            slice.map_async(mode, move |r| {
                let _ = sender.send(r);
            });
        }
        let mut done = 0;
        let mut wait = wgpu::PollType::Wait {
            submission_index: after,
            timeout: None,
        };
        for round in 0..2 {
            self.ctx
                .device
                .poll(wait)
                .map_err(|e| anyhow!("GPU wait for {what} failed: {e}"))?;
            self.ctx
                .check()
                .with_context(|| format!("GPU {what} failed"))?;
            while let Ok(r) = mapped.try_recv() {
                r.map_err(|e| anyhow!("mapping the GPU buffers for {what} failed: {e}"))?;
                done += 1;
            }
            if done == slices.len() {
                return Ok(());
            }
            ensure!(
                round == 0,
                "mapping the GPU buffers for {what} did not complete"
            );
            wait = wgpu::PollType::wait_indefinitely();
        }
        unreachable!("the loop returns or fails in its second round")
    }

    /// Waits for submission `index` (a chunk) and hands the first `bytes` bytes of its result,
    /// in `buffer`, to `take`.
    fn read_back(
        &self,
        buffer: &wgpu::Buffer,
        bytes: u64,
        index: wgpu::SubmissionIndex,
        what: &str,
        take: impl FnOnce(&[u8]),
    ) -> Result<()> {
        let slice = buffer.slice(..bytes);
        let waited = Instant::now();
        self.map_wait(&[slice], wgpu::MapMode::Read, Some(index), what)?;
        let copied = Instant::now();
        let view = slice
            .get_mapped_range()
            .map_err(|e| anyhow!("reading the GPU {what} result failed: {e}"))?;
        take(&view);
        drop(view);
        buffer.unmap();
        self.add_time(|t| {
            t.wait += copied - waited;
            t.readback += copied.elapsed();
        });
        Ok(())
    }

    /// Runs `kernel` over the tile chunk by chunk, two chunks in flight; `finish(chunk_start,
    /// chunk_len, bytes)` receives each chunk's readback.
    fn run_chunks(
        &self,
        tile: &Tile,
        out_dt: DType,
        eps: f32,
        prepare: impl Fn(&Slot, usize, usize) -> Result<()>,
        kernel: Kernel,
        mut finish: impl FnMut(usize, usize, &[u8]),
    ) -> Result<()> {
        let n = tile.agents.len();
        ensure!(n >= 1, "no agents in the tile");
        ensure!(
            n <= GPU_MAX_AGENTS,
            "the GPU backend merges at most {GPU_MAX_AGENTS} agents at once, got {n} (use --device cpu)"
        );
        let mut guard = self.buffers.lock().unwrap_or_else(|p| p.into_inner());
        self.ensure_buffers(&mut guard, n)?;
        let buffers = guard.as_mut().expect("buffers were just ensured");
        let mut last = std::mem::take(&mut buffers.last);
        let buffers = &*buffers;
        let readback_bytes = |len: usize| -> u64 {
            match kernel {
                Kernel::Probe => (4 * n * n) as u64,
                Kernel::Merge | Kernel::Combine => (len * out_dt.size()).div_ceil(4) as u64 * 4,
            }
        };
        // Where a slot's result is read: the result buffer itself when mapped, else its copy.
        fn result_of(slot: &Slot, kernel: Kernel, mapped: bool) -> (&wgpu::Buffer, &wgpu::Buffer) {
            let result = match kernel {
                Kernel::Probe => &slot.hist,
                Kernel::Merge | Kernel::Combine => &slot.out,
            };
            (result, if mapped { result } else { &slot.readback })
        }
        // Waits for a submitted chunk's results and hands them on.
        let mut drain =
            |(slot, start, len, index): (usize, usize, usize, wgpu::SubmissionIndex)| {
                let what = format!("{} of chunk at element {start}", kernel.name());
                let (_, read) = result_of(&buffers.slots[slot], kernel, self.ctx.mapped);
                self.read_back(read, readback_bytes(len), index, &what, |b| {
                    finish(start, len, b)
                })
            };
        // (slot, start, len, submission) submitted but not yet read back
        let mut pending = None;
        for (i, (start, len)) in ranges(tile.len, self.chunk_elems(n)).enumerate() {
            let slot = &buffers.slots[i % 2];
            prepare(slot, start, len)?;
            let params = chunk_params(tile, len, out_dt, eps);
            let uploaded = Instant::now();
            self.upload(slot, tile, start, &params, last[i % 2].take())
                .with_context(|| format!("chunk at element {start}"))?;
            let submitted = Instant::now();
            let (pipeline, group) = match kernel {
                Kernel::Probe => (&self.ctx.probe_pipeline, &slot.probe_group),
                Kernel::Merge => (&self.ctx.merge_pipeline, &slot.merge_group),
                Kernel::Combine => (&self.ctx.combine_pipeline, &slot.combine_group),
            };
            let mut encoder = self.ctx.device.create_command_encoder(&Default::default());
            if let Kernel::Probe = kernel {
                encoder.clear_buffer(&slot.hist, 0, None);
            }
            self.dispatch(&mut encoder, pipeline, group, &params);
            let (result, read) = result_of(slot, kernel, self.ctx.mapped);
            if !self.ctx.mapped {
                encoder.copy_buffer_to_buffer(result, 0, read, 0, readback_bytes(len));
            }
            let index = self.ctx.queue.submit(Some(encoder.finish()));
            last[i % 2] = Some(index.clone());
            self.add_time(|t| {
                t.chunks += 1;
                t.upload += submitted - uploaded;
                t.submit += submitted.elapsed();
            });
            // The other slot's chunk reads back while this one runs.
            if let Some(previous) = pending.replace((i % 2, start, len, index)) {
                drain(previous)?;
            }
        }
        if let Some(last) = pending {
            drain(last)?;
        }
        guard.as_mut().expect("buffers were just ensured").last = last;
        Ok(())
    }
}

#[derive(Clone, Copy)]
enum Kernel {
    Probe,
    Merge,
    Combine,
}

impl Kernel {
    fn name(self) -> &'static str {
        match self {
            Kernel::Probe => "probe",
            Kernel::Merge => "merge",
            Kernel::Combine => "combine",
        }
    }
}

impl Backend for GpuBackend {
    fn describe(&self) -> String {
        self.ctx.describe()
    }

    fn preferred_tile_elems(&self) -> usize {
        PREFERRED_TILE_ELEMS
    }

    /// Two workers: while one waits for the device with its tile, the other reads the next.
    fn run_workers(&self, worker: &(dyn Fn() + Sync)) {
        std::thread::scope(|s| {
            for _ in 0..2 {
                s.spawn(worker);
            }
        });
    }

    fn probe(&self, tile: &Tile, epsilon: f32) -> Result<TileCounts> {
        let n = tile.agents.len();
        let mut counts = TileCounts::zeros(n);
        self.run_chunks(
            tile,
            tile.dtype,
            epsilon,
            |_, _, _| Ok(()),
            Kernel::Probe,
            |_, _, bytes| {
                for (h, w) in counts
                    .hist
                    .iter_mut()
                    .zip(bytemuck::cast_slice::<u8, u32>(bytes))
                {
                    *h += *w as u64;
                }
            },
        )?;
        Ok(counts)
    }

    fn combine(&self, tile: &Tile, params: &CombineParams, out: &mut [u8]) -> Result<()> {
        self.combine_tile(tile, params, out)
    }

    fn merge(&self, tile: &Tile, params: &MergeParams, out: &mut [u8]) -> Result<()> {
        let lambdas = bytemuck::cast_slice::<f32, u8>(params.lambdas).to_vec();
        let q = &self.ctx.queue;
        let size = params.out_dtype.size();
        self.run_chunks(
            tile,
            params.out_dtype,
            params.epsilon,
            |slot, _, _| {
                q.write_buffer(&slot.lambdas, 0, &lambdas);
                Ok(())
            },
            Kernel::Merge,
            |start, len, bytes| {
                out[start * size..(start + len) * size].copy_from_slice(&bytes[..len * size])
            },
        )
    }
}

/// Floats the coefficient buffer holds: a row per element of a chunk (+1 for a row straddling its
/// start) — two floats for row-wise slerp, `agents + 1` for Fisher — or one row of every agent.
fn coef_floats(chunk: usize, agents: usize) -> usize {
    ((chunk + 1) * (agents + 1).max(2)).max(GPU_MAX_AGENTS + 1)
}

impl GpuBackend {
    fn combine_tile(&self, tile: &Tile, params: &CombineParams, out: &mut [u8]) -> Result<()> {
        let spec = params.spec;
        let n = tile.agents.len();
        ensure!(
            spec.agents() == n,
            "internal: combine rule for {} agents, tile has {n}",
            spec.agents()
        );
        let end = params.start + tile.len as u64;
        ensure!(
            end <= u32::MAX as u64,
            "the GPU backend indexes tensors with 32 bits; this one has more than {} elements (use --device cpu)",
            u32::MAX
        );
        let (norm_mode, fixed_recip, table) = match &spec.normalize {
            Normalize::None => (0, 1.0, Vec::new()),
            Normalize::Fixed(r) => (1, *r, Vec::new()),
            Normalize::PerElement(w, floor) => {
                ensure!(
                    n <= GPU_MAX_TABLE_AGENTS,
                    "the GPU backend normalizes a consensus merge of at most {GPU_MAX_TABLE_AGENTS} models, got {n} (use --device cpu)"
                );
                (2, 1.0, crate::method::combine::reciprocal_table(w, *floor))
            }
        };
        let rules: Vec<u32> = spec.keep.iter().flat_map(rule_words).collect();
        let q = &self.ctx.queue;
        let size = params.out_dtype.size();
        let row_floats = n + 1;
        self.run_chunks(
            tile,
            params.out_dtype,
            0.0,
            |slot, start, len| {
                let first = params.start + start as u64;
                let first_row = spec.row_index(first);
                let rows = spec.row_index(first + len as u64 - 1) - first_row + 1;
                let floats = rows as usize * row_floats;
                ensure!(
                    floats <= slot.coefs.size() as usize / 4,
                    "internal: {floats} coefficients do not fit the GPU buffer"
                );
                // Fisher's rows come with the tile; the others' with the tensor.
                let (source, from) = if spec.tile_coefs {
                    (params.coefs, start * row_floats)
                } else {
                    (&spec.coefs[..], first_row as usize * row_floats)
                };
                let comb = Comb {
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
                    _pad: 0,
                };
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
                // Each agent's ranks at its f32-sized segment (words per agent: the chunk's
                // f32 stride, even).
                let stride = len.div_ceil(2) * 2;
                for (t, r) in params.ranks.iter().enumerate() {
                    q.write_buffer(
                        &slot.ranks,
                        (t * stride * 4) as u64,
                        bytemuck::cast_slice(&r[start..start + len]),
                    );
                }
                Ok(())
            },
            Kernel::Combine,
            |start, len, bytes| {
                out[start * size..(start + len) * size].copy_from_slice(&bytes[..len * size])
            },
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The shaders parse and validate without any adapter, so a shader error fails every CI run.
    #[test]
    fn shaders_validate_with_naga() {
        for (name, kernel) in [
            ("probe", PROBE_WGSL),
            ("merge", MERGE_WGSL),
            ("combine", COMBINE_WGSL),
        ] {
            let source = format!("{DTYPE_WGSL}\n{CHUNK_WGSL}\n{kernel}");
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
    fn params_match_the_wgsl_struct_size() {
        // 9 u32/f32 fields, padded to 16 bytes for the uniform's layout.
        assert_eq!(std::mem::size_of::<Params>(), 48);
    }

    #[test]
    fn errors_fold_to_one_line() {
        assert_eq!(
            one_line("Validation Error\n\nCaused by:\n  In X\n    limit"),
            "Validation Error Caused by: In X limit"
        );
    }
}
