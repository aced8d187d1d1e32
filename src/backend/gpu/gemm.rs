//! The GPU's GEMM (`shaders/gemm.wgsl`): C = A·B in f32, the spectral methods' row maps applied
//! on the device (SPEC §4g). B — a tensor's map, the same for each of its tiles — is uploaded once
//! and kept while the caller names the same B; B wider than one storage binding is cut into
//! column panels, each written into its columns of C.

use super::GpuBackend;
use anyhow::{anyhow, ensure, Context, Result};
use wgpu::util::DeviceExt;

/// B on the device: the caller's key for it, and its column panels (first column, width, buffer).
pub(super) struct KeptB {
    key: u64,
    panels: Vec<(usize, usize, wgpu::Buffer)>,
}

/// The kernel's uniform (`Dims` in gemm.wgsl).
#[repr(C)]
#[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
struct Dims {
    rows: u32,
    k: u32,
    cols: u32,
    c_stride: u32,
    c_offset: u32,
    pad: [u32; 3],
}

/// Rows and columns of C each workgroup computes.
const TILE: usize = 16;

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
        let mut kept = self.kept_b.lock().unwrap_or_else(|p| p.into_inner());
        if kept.as_ref().is_none_or(|kb| kb.key != b_key) {
            *kept = Some(self.upload_panels(b, (k, cols), b_key, max_binding));
        }
        let panels = &kept.as_ref().expect("uploaded above").panels;
        let device = &ctx.device;
        let usage = wgpu::BufferUsages::STORAGE;
        let a_buffer = device.create_buffer_init(&wgpu::util::BufferInitDescriptor {
            label: Some("gemm a"),
            contents: bytemuck::cast_slice(a),
            usage,
        });
        let c_bytes = (rows * cols * 4) as u64;
        let c_buffer = device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("gemm c"),
            size: c_bytes.max(4),
            usage: usage | wgpu::BufferUsages::COPY_SRC,
            mapped_at_creation: false,
        });
        let readback = device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("gemm readback"),
            size: c_bytes.max(4),
            usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        });
        let mut encoder = device.create_command_encoder(&Default::default());
        for (first, width, b_buffer) in panels {
            let dims = Dims {
                rows: rows as u32,
                k: k as u32,
                cols: *width as u32,
                c_stride: cols as u32,
                c_offset: *first as u32,
                pad: [0; 3],
            };
            let uniform = device.create_buffer_init(&wgpu::util::BufferInitDescriptor {
                label: Some("gemm dims"),
                contents: bytemuck::bytes_of(&dims),
                usage: wgpu::BufferUsages::UNIFORM,
            });
            let group = device.create_bind_group(&wgpu::BindGroupDescriptor {
                label: Some("gemm"),
                layout: &ctx.gemm_pipeline.get_bind_group_layout(0),
                entries: &[
                    entry(0, &uniform),
                    entry(1, &a_buffer),
                    entry(2, b_buffer),
                    entry(3, &c_buffer),
                ],
            });
            let mut pass = encoder.begin_compute_pass(&Default::default());
            pass.set_pipeline(&ctx.gemm_pipeline);
            pass.set_bind_group(0, &group, &[]);
            pass.dispatch_workgroups(width.div_ceil(TILE) as u32, rows.div_ceil(TILE) as u32, 1);
        }
        encoder.copy_buffer_to_buffer(&c_buffer, 0, &readback, 0, c_bytes.max(4));
        let index = ctx.queue.submit([encoder.finish()]);
        drop(kept);
        let slice = readback.slice(..);
        self.map_wait(&[slice], wgpu::MapMode::Read, Some(index), "a GEMM")
            .context("the GPU's GEMM")?;
        let view = slice
            .get_mapped_range()
            .map_err(|e| anyhow!("reading the GPU's GEMM result failed: {e}"))?;
        for (o, bytes) in out.iter_mut().zip(view.chunks_exact(4)) {
            *o = f32::from_le_bytes([bytes[0], bytes[1], bytes[2], bytes[3]]);
        }
        Ok(())
    }

    /// B (k × cols) on the device, in column panels each within one storage binding.
    fn upload_panels(&self, b: &[f32], (k, cols): (usize, usize), key: u64, max: usize) -> KeptB {
        let width = (max / (4 * k.max(1))).clamp(1, cols.max(1));
        let panels = (0..cols)
            .step_by(width)
            .map(|first| {
                let w = width.min(cols - first);
                let panel: Vec<f32> = (0..k)
                    .flat_map(|r| b[r * cols + first..r * cols + first + w].iter().copied())
                    .collect();
                let buffer =
                    self.ctx
                        .device
                        .create_buffer_init(&wgpu::util::BufferInitDescriptor {
                            label: Some("gemm b"),
                            contents: bytemuck::cast_slice(&panel),
                            usage: wgpu::BufferUsages::STORAGE,
                        });
                (first, w, buffer)
            })
            .collect();
        KeptB { key, panels }
    }
}

fn entry(binding: u32, buffer: &wgpu::Buffer) -> wgpu::BindGroupEntry<'_> {
    wgpu::BindGroupEntry {
        binding,
        resource: buffer.as_entire_binding(),
    }
}
