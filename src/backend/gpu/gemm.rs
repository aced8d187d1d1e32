//! The GPU's GEMM (`shaders/gemm.wgsl`): C = A·B in f32, the spectral methods' row maps applied
//! on the device (SPEC §4g). B — a tensor's map, the same for each of its tiles — is uploaded once
//! and kept while the caller names the same B; B wider than one storage binding is cut into
//! column panels, each written into its columns of C. The buffers of A, C and the readback are
//! the backend's, kept from call to call and grown when a block needs more, not made per call.

use super::layout::{Dims, GEMM_BINDINGS, GEMM_TILE};
use super::GpuBackend;
use anyhow::{anyhow, ensure, Context, Result};
use wgpu::util::DeviceExt;

/// What the GEMM keeps on the device between calls: B's panels (with one uniform each) and the
/// A, C and readback buffers.
#[derive(Default)]
pub(super) struct GemmState {
    b: Option<KeptB>,
    a: Option<Sized>,
    c: Option<Sized>,
    readback: Option<Sized>,
}

/// B on the device: the caller's key for it, and its column panels (first column, width, buffer,
/// the panel's uniform).
struct KeptB {
    key: u64,
    panels: Vec<(usize, usize, wgpu::Buffer, wgpu::Buffer)>,
}

/// A buffer and its size in bytes.
struct Sized(wgpu::Buffer, u64);

impl GpuBackend {
    /// C (`out`, rows × cols) = A (rows × k) · B (k × cols), row-major f32; `b_key` names B.
    pub(super) fn gemm(
        &self,
        a: &[f32],
        (b, b_key): (&[f32], u64),
        (rows, k, cols): (usize, usize, usize),
        out: &mut [f32],
    ) -> Result<()> {
        if rows == 0 || cols == 0 {
            return Ok(());
        }
        if k == 0 {
            out.fill(0.0);
            return Ok(());
        }
        let ctx = &self.ctx;
        let max_binding = ctx.limits.max_storage_buffer_binding_size as usize;
        ensure!(
            rows * k * 4 <= max_binding && rows * cols * 4 <= max_binding,
            "a block of {rows} rows of {k} and {cols} columns is larger than the GPU's storage \
             binding ({max_binding} bytes)"
        );
        let mut guard = self.gemm.lock().unwrap_or_else(|p| p.into_inner());
        // The fields borrowed apart, through the guard.
        let state = &mut *guard;
        if state.b.as_ref().is_none_or(|kb| kb.key != b_key) {
            state.b = Some(self.upload_panels(b, (k, cols), b_key, max_binding));
        }
        let c_bytes = (rows * cols * 4) as u64;
        let storage = wgpu::BufferUsages::STORAGE;
        let a_buffer = self.kept(
            &mut state.a,
            "gemm a",
            (a.len() * 4) as u64,
            storage | wgpu::BufferUsages::COPY_DST,
        );
        ctx.queue.write_buffer(a_buffer, 0, bytemuck::cast_slice(a));
        let c_buffer = self.kept(
            &mut state.c,
            "gemm c",
            c_bytes,
            storage | wgpu::BufferUsages::COPY_SRC,
        );
        let read_usage = wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST;
        let readback = self.kept(&mut state.readback, "gemm readback", c_bytes, read_usage);
        let panels = &state.b.as_ref().expect("uploaded above").panels;
        let mut encoder = ctx.device.create_command_encoder(&Default::default());
        for (first, width, b_buffer, uniform) in panels {
            let dims = Dims {
                rows: rows as u32,
                k: k as u32,
                cols: *width as u32,
                c_stride: cols as u32,
                c_offset: *first as u32,
                pad: [0; 3],
            };
            ctx.queue
                .write_buffer(uniform, 0, bytemuck::bytes_of(&dims));
            let buffers = [
                (uniform, None),
                (a_buffer, Some((a.len() * 4) as u64)),
                (b_buffer, None),
                (c_buffer, Some(c_bytes)),
            ];
            let group = self.gemm_group(&buffers);
            let mut pass = encoder.begin_compute_pass(&Default::default());
            pass.set_pipeline(&ctx.gemm_pipeline);
            pass.set_bind_group(0, &group, &[]);
            pass.dispatch_workgroups(
                width.div_ceil(GEMM_TILE) as u32,
                rows.div_ceil(GEMM_TILE) as u32,
                1,
            );
        }
        encoder.copy_buffer_to_buffer(c_buffer, 0, readback, 0, c_bytes);
        let index = ctx.queue.submit([encoder.finish()]);
        let slice = readback.slice(..c_bytes);
        self.map_wait(&[slice], wgpu::MapMode::Read, Some(index), "a GEMM")
            .context("the GPU's GEMM")?;
        {
            let view = slice
                .get_mapped_range()
                .map_err(|e| anyhow!("reading the GPU's GEMM result failed: {e}"))?;
            for (o, bytes) in out.iter_mut().zip(view.chunks_exact(4)) {
                *o = f32::from_le_bytes([bytes[0], bytes[1], bytes[2], bytes[3]]);
            }
        }
        readback.unmap();
        Ok(())
    }

    /// The GEMM's bind group over `buffers` — dims, a, b, c, each bound whole or to its first
    /// bytes — in the order of the kernel's table (checked against the WGSL by a test).
    fn gemm_group(&self, buffers: &[(&wgpu::Buffer, Option<u64>); 4]) -> wgpu::BindGroup {
        let entries: Vec<wgpu::BindGroupEntry> = GEMM_BINDINGS
            .iter()
            .zip(buffers)
            .enumerate()
            .map(|(i, (_, (buffer, bytes)))| entry(i as u32, buffer, *bytes))
            .collect();
        self.ctx
            .device
            .create_bind_group(&wgpu::BindGroupDescriptor {
                label: Some("gemm"),
                layout: &self.ctx.gemm_pipeline.get_bind_group_layout(0),
                entries: &entries,
            })
    }

    /// The kept buffer in `slot`, made (again) with `usage` where it holds fewer than `bytes`.
    fn kept<'s>(
        &self,
        slot: &'s mut Option<Sized>,
        label: &str,
        bytes: u64,
        usage: wgpu::BufferUsages,
    ) -> &'s wgpu::Buffer {
        if slot.as_ref().is_none_or(|s| s.1 < bytes) {
            let buffer = self.ctx.device.create_buffer(&wgpu::BufferDescriptor {
                label: Some(label),
                size: bytes.max(4),
                usage,
                mapped_at_creation: false,
            });
            *slot = Some(Sized(buffer, bytes.max(4)));
        }
        &slot.as_ref().expect("made above").0
    }

    /// B (k × cols) on the device, in column panels each within one storage binding, each with
    /// the uniform its dispatches read.
    fn upload_panels(&self, b: &[f32], (k, cols): (usize, usize), key: u64, max: usize) -> KeptB {
        let device = &self.ctx.device;
        let width = (max / (4 * k.max(1))).clamp(1, cols.max(1));
        let panels = (0..cols)
            .step_by(width)
            .map(|first| {
                let w = width.min(cols - first);
                let panel: Vec<f32> = (0..k)
                    .flat_map(|r| b[r * cols + first..r * cols + first + w].iter().copied())
                    .collect();
                let buffer = device.create_buffer_init(&wgpu::util::BufferInitDescriptor {
                    label: Some("gemm b"),
                    contents: bytemuck::cast_slice(&panel),
                    usage: wgpu::BufferUsages::STORAGE,
                });
                let uniform = device.create_buffer(&wgpu::BufferDescriptor {
                    label: Some("gemm dims"),
                    size: std::mem::size_of::<Dims>() as u64,
                    usage: wgpu::BufferUsages::UNIFORM | wgpu::BufferUsages::COPY_DST,
                    mapped_at_creation: false,
                });
                (first, w, buffer, uniform)
            })
            .collect();
        KeptB { key, panels }
    }
}

/// Binding `binding` to `buffer`, or to its first `bytes` (a kept buffer may be larger).
fn entry(binding: u32, buffer: &wgpu::Buffer, bytes: Option<u64>) -> wgpu::BindGroupEntry<'_> {
    wgpu::BindGroupEntry {
        binding,
        resource: wgpu::BindingResource::Buffer(wgpu::BufferBinding {
            buffer,
            offset: 0,
            size: bytes.and_then(std::num::NonZeroU64::new),
        }),
    }
}
