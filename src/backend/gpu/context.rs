//! The adapter, device, queue and compiled pipelines, built once per process.

use super::{COMBINE_WGSL, GEMM_WGSL, MERGE_WGSL, PROBE_WGSL, UPDATE_WGSL};
use anyhow::{anyhow, bail, Context, Result};
use std::sync::{Arc, Mutex};

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
    /// The adapter's name, type, backend and driver.
    pub info: wgpu::AdapterInfo,
    /// What the adapter allows (binding and buffer sizes, workgroups).
    pub limits: wgpu::Limits,
    /// Whether a merge on it maps its storage buffers (see `mapped_buffers`).
    pub mapped: bool,
}

pub(super) fn backends_from_env() -> wgpu::Backends {
    wgpu::Backends::from_env()
        .unwrap_or(wgpu::Backends::VULKAN | wgpu::Backends::METAL | wgpu::Backends::DX12)
}

/// Held while an instance is made and its adapters listed or opened. On an H200 (NVIDIA 580,
/// Vulkan) a test process that opened devices from several threads at once crashed (SIGSEGV) or
/// hung, while every test passed alone; opening one at a time costs nothing a merge notices.
/// A precaution: it was not re-run there with this lock.
static OPENING: Mutex<()> = Mutex::new(());

pub(super) fn new_instance() -> wgpu::Instance {
    wgpu::Instance::new(wgpu::InstanceDescriptor {
        backends: backends_from_env(),
        ..wgpu::InstanceDescriptor::new_without_display_handle_from_env()
    })
}

impl AdapterSummary {
    /// Whether the adapter is a software renderer on the CPU (lavapipe, SwiftShader, WARP).
    pub fn is_software(&self) -> bool {
        self.info.device_type == wgpu::DeviceType::Cpu
    }
}

/// Every adapter wgpu sees (honouring `WGPU_BACKEND`).
pub fn list_adapters() -> Vec<AdapterSummary> {
    let _one_at_a_time = OPENING.lock().unwrap_or_else(|p| p.into_inner());
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
pub(super) fn rank(info: &wgpu::AdapterInfo, low_power: bool) -> u32 {
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
    /// The opened device.
    pub device: wgpu::Device,
    /// Its queue, which every upload and dispatch goes through.
    pub queue: wgpu::Queue,
    /// The adapter's name, type, backend and driver.
    pub info: wgpu::AdapterInfo,
    /// The limits the device was opened with (the adapter's own).
    pub limits: wgpu::Limits,
    pub(super) probe_pipeline: wgpu::ComputePipeline,
    pub(super) merge_pipeline: wgpu::ComputePipeline,
    pub(super) combine_pipeline: wgpu::ComputePipeline,
    pub(super) update_pipeline: wgpu::ComputePipeline,
    pub(super) gemm_pipeline: wgpu::ComputePipeline,
    /// The first asynchronous device error (validation, out of memory, device lost), if any.
    pub(super) error: Arc<Mutex<Option<String>>>,
    /// Chunk inputs and results live in mapped storage buffers (see `mapped_buffers`).
    pub mapped: bool,
}

/// Whether to map the storage buffers themselves instead of staging through copies: where the
/// adapter offers `MAPPABLE_PRIMARY_BUFFERS` and its memory is the host's (CPU and integrated
/// adapters: lavapipe, Apple silicon), which saves a copy each way. `RLMERGE_GPU_MAPPED=0` turns it
/// off (the tests run both paths).
pub(super) fn mapped_buffers(adapter: &wgpu::Adapter) -> bool {
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
        let _one_at_a_time = OPENING.lock().unwrap_or_else(|p| p.into_inner());
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

    pub(super) fn from_adapter(adapter: wgpu::Adapter) -> Result<GpuContext> {
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
        let update_pipeline = compute_pipeline(&device, "update", UPDATE_WGSL);
        let gemm_pipeline = standalone_pipeline(&device, "gemm", GEMM_WGSL);
        let ctx = GpuContext {
            device,
            queue,
            info,
            limits,
            probe_pipeline,
            merge_pipeline,
            combine_pipeline,
            update_pipeline,
            gemm_pipeline,
            error,
            mapped,
        };
        ctx.check().context("compiling the shaders failed")?;
        Ok(ctx)
    }

    /// Returns the first recorded device error, if any.
    pub(super) fn check(&self) -> Result<()> {
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

    /// Whether the adapter is a software renderer on the CPU (lavapipe, SwiftShader, WARP):
    /// merges on it run many times slower than the CPU backend.
    pub fn is_software(&self) -> bool {
        self.info.device_type == wgpu::DeviceType::Cpu
    }

    /// The host→device and device→host copy rates in bytes per second, best of `runs` copies of
    /// `bytes` (capped at the adapter's largest buffer) each way: an upload through the queue,
    /// and a download through a mappable buffer copied out to host memory, as merges move their
    /// chunks. What the bus and wgpu's copy path allow: an elementwise merge on this adapter
    /// cannot go faster end to end.
    pub fn copy_rates(&self, bytes: u64, runs: usize) -> Result<(f64, f64)> {
        let bytes = bytes.min(self.limits.max_buffer_size) & !3;
        anyhow::ensure!(bytes > 0, "no bytes to copy");
        let buffer = |usage| {
            self.device.create_buffer(&wgpu::BufferDescriptor {
                label: Some("copy rate"),
                size: bytes,
                usage,
                mapped_at_creation: false,
            })
        };
        use wgpu::BufferUsages as U;
        let on_device = buffer(U::STORAGE | U::COPY_DST | U::COPY_SRC);
        let readback = buffer(U::MAP_READ | U::COPY_DST);
        let host = vec![1u8; bytes as usize];
        let mut back = vec![0u8; bytes as usize];
        let wait = |what: &str| -> Result<()> {
            self.device
                .poll(wgpu::PollType::wait_indefinitely())
                .map_err(|e| anyhow!("GPU wait for {what} failed: {e}"))?;
            self.check()
        };
        let (mut up, mut down) = (f64::INFINITY, f64::INFINITY);
        for _ in 0..runs.max(1) {
            let start = std::time::Instant::now();
            self.queue.write_buffer(&on_device, 0, &host);
            self.queue.submit(None);
            wait("the upload")?;
            up = up.min(start.elapsed().as_secs_f64());
            let start = std::time::Instant::now();
            let mut encoder = self.device.create_command_encoder(&Default::default());
            encoder.copy_buffer_to_buffer(&on_device, 0, &readback, 0, bytes);
            self.queue.submit(Some(encoder.finish()));
            let (sender, mapped) = std::sync::mpsc::channel();
            readback.slice(..).map_async(wgpu::MapMode::Read, move |r| {
                let _ = sender.send(r);
            });
            wait("the download")?;
            mapped
                .recv()
                .map_err(|e| anyhow!("the download's map never completed: {e}"))?
                .map_err(|e| anyhow!("mapping the download failed: {e}"))?;
            {
                let view = readback
                    .slice(..)
                    .get_mapped_range()
                    .map_err(|e| anyhow!("reading the download failed: {e}"))?;
                back.copy_from_slice(&view);
            }
            readback.unmap();
            down = down.min(start.elapsed().as_secs_f64());
        }
        anyhow::ensure!(back == host, "the bytes copied back differ from those sent");
        Ok((bytes as f64 / up, bytes as f64 / down))
    }

    /// The adapter as stderr names it: name, API, type, and whether buffers are mapped.
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
pub(super) fn one_line(text: &str) -> String {
    text.lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .collect::<Vec<_>>()
        .join(" ")
}

/// A compute pipeline from `dtype.wgsl` + `chunk.wgsl` + a kernel file; its layout comes from the shader.
pub(super) fn compute_pipeline(
    device: &wgpu::Device,
    entry: &str,
    kernel: &str,
) -> wgpu::ComputePipeline {
    standalone_pipeline(device, entry, &super::shader_source(kernel))
}

/// A compute pipeline from one whole WGSL source (the GEMM's, which needs no codecs).
fn standalone_pipeline(device: &wgpu::Device, entry: &str, source: &str) -> wgpu::ComputePipeline {
    let module = device.create_shader_module(wgpu::ShaderModuleDescriptor {
        label: Some(entry),
        source: wgpu::ShaderSource::Wgsl(source.to_owned().into()),
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
