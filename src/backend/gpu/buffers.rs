//! Chunk buffers: each worker takes a set of [`DEPTH`] slots from the backend's pool for a tile,
//! so the upload of one chunk, the dispatch of another and the readback of a third overlap — and
//! the workers' sets run side by side, no lock held across a tile — and the loop that runs a tile
//! through them chunk by chunk, draining only at the tile's end.

use super::kernels::{Kernel, KernelResult};
use super::layout::{
    chunk_params, Comb, Params, COMBINE_BINDINGS, MERGE_BINDINGS, PROBE_BINDINGS, UPDATE_BINDINGS,
    WORKGROUP,
};
use super::{GpuBackend, GPU_MAX_AGENTS, GPU_MAX_TABLE_AGENTS};
use crate::backend::{ranges, Tile};
use crate::checkpoint::DType;
use anyhow::{anyhow, ensure, Context, Result};
use std::sync::atomic::Ordering;
use std::time::Instant;

/// How long a map of buffers may take after its submission has finished before it is an error:
/// the callbacks run in whichever thread polls the device next.
const MAP_PATIENCE: std::time::Duration = std::time::Duration::from_secs(30);
/// How long one wait for a callback another thread runs lasts between polls.
const MAP_RETRY: std::time::Duration = std::time::Duration::from_millis(10);
/// Chunks one worker keeps in flight: a slot each, taken in turn.
pub(super) const DEPTH: usize = 3;

/// One slot of chunk buffers; [`DEPTH`] of them take turns.
pub(super) struct Slot {
    pub(super) params: wgpu::Buffer,
    pub(super) base: wgpu::Buffer,
    pub(super) agents: wgpu::Buffer,
    pub(super) lambdas: wgpu::Buffer,
    pub(super) out: wgpu::Buffer,
    pub(super) hist: wgpu::Buffer,
    pub(super) readback: wgpu::Buffer,
    pub(super) comb: wgpu::Buffer,
    pub(super) rules: wgpu::Buffer,
    pub(super) flags: wgpu::Buffer,
    pub(super) coefs: wgpu::Buffer,
    pub(super) table: wgpu::Buffer,
    /// A host-computed update's chunk, f32 (the update kernel's `delta`).
    pub(super) delta: wgpu::Buffer,
    pub(super) merge_group: wgpu::BindGroup,
    pub(super) probe_group: wgpu::BindGroup,
    pub(super) combine_group: wgpu::BindGroup,
    pub(super) update_group: wgpu::BindGroup,
}

/// One worker's buffers, sized for `chunk_elems` elements of up to `agents` agents.
pub(super) struct Buffers {
    pub(super) agents: usize,
    pub(super) chunk_elems: usize,
    pub(super) slots: Vec<Slot>,
    /// Each slot's last submission: a mapped upload waits for it alone.
    pub(super) last: Vec<Option<wgpu::SubmissionIndex>>,
}

impl GpuBackend {
    /// Elements per chunk for `n` agents: every binding (the agents' or the coefficients' is the
    /// largest) within the adapter's limits, and even, so 16-bit chunks start on a word.
    pub(super) fn chunk_elems(&self, n: usize) -> usize {
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

    /// A set of buffers for chunks of `n` agents from the pool, made when none there fits (sets
    /// too small for `n` are dropped then); [`Self::give_back_buffers`] returns it.
    pub(super) fn take_buffers(&self, n: usize) -> Result<Buffers> {
        let chunk = self.chunk_elems(n);
        let fits = |b: &Buffers| b.agents >= n && b.chunk_elems >= chunk;
        {
            let mut pool = self.buffers.lock().unwrap_or_else(|p| p.into_inner());
            if let Some(i) = pool.iter().position(fits) {
                return Ok(pool.swap_remove(i));
            }
            pool.clear();
        }
        let slots = (0..DEPTH).map(|_| self.make_slot(n, chunk)).collect();
        self.ctx.check().with_context(|| {
            format!("cannot allocate GPU buffers for {chunk} elements × {n} agents")
        })?;
        Ok(Buffers {
            agents: n,
            chunk_elems: chunk,
            slots,
            last: vec![None; DEPTH],
        })
    }

    /// Returns a set [`Self::take_buffers`] gave, its chunks all read back.
    pub(super) fn give_back_buffers(&self, buffers: Buffers) {
        let mut pool = self.buffers.lock().unwrap_or_else(|p| p.into_inner());
        pool.push(buffers);
    }

    /// One chunk slot: every buffer a kernel binds, for chunks of `chunk` elements of
    /// `n` agents, and each kernel's bind group.
    fn make_slot(&self, n: usize, chunk: usize) -> Slot {
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
        let uniform = |label: &str, bytes: usize| {
            d.create_buffer(&wgpu::BufferDescriptor {
                label: Some(label),
                size: bytes as u64,
                usage: wgpu::BufferUsages::UNIFORM | dst,
                mapped_at_creation: false,
            })
        };
        let params = uniform("params", std::mem::size_of::<Params>());
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
            // Holds a chunk's merged output and the probe histogram, one after the other.
            size: words * 4 + 4 * (n * n) as u64,
            usage: wgpu::BufferUsages::MAP_READ | dst,
            mapped_at_creation: false,
        });
        let comb = uniform("comb", std::mem::size_of::<Comb>());
        let rules = storage("rules", 32 * GPU_MAX_AGENTS as u64, dst);
        // Keep flags (DELLA's decisions, arcee_fusion's test): one u32 per element and agent,
        // laid out like `agents` in f32.
        let flags = storage("flags", words * 4 * n as u64, dst);
        let coefs = storage("coefs", coef_floats(chunk, n) as u64 * 4, dst);
        let table = storage("reciprocal table", 4 << GPU_MAX_TABLE_AGENTS, dst);
        let delta = storage("delta", words * 4, dst);
        // Each kernel's bind group from its table of bindings (`layout.rs`), by WGSL name.
        let named = [
            ("p", &params),
            ("base", &base),
            ("agents", &agents),
            ("lambdas", &lambdas),
            ("out", &out),
            ("hist", &hist),
            ("c", &comb),
            ("rules", &rules),
            ("coefs", &coefs),
            ("recips", &table),
            ("flags", &flags),
            ("delta", &delta),
        ];
        let group = |label: &str, pipeline: &wgpu::ComputePipeline, names: &[&str]| {
            bind_group(d, (label, pipeline), names, &named)
        };
        let ctx = &self.ctx;
        let merge_group = group("merge", &ctx.merge_pipeline, &MERGE_BINDINGS);
        let probe_group = group("probe", &ctx.probe_pipeline, &PROBE_BINDINGS);
        let combine_group = group("combine", &ctx.combine_pipeline, &COMBINE_BINDINGS);
        let update_group = group("update", &ctx.update_pipeline, &UPDATE_BINDINGS);
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
            flags,
            coefs,
            table,
            delta,
            merge_group,
            probe_group,
            combine_group,
            update_group,
        }
    }

    /// Uploads the chunk `params` describes, starting at element `start` of the tile, into `slot`;
    /// `last` is the slot's previous submission (mapped buffers wait for it to be idle).
    pub(super) fn upload(
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
        self.add_time(|t| t.bytes_up += padded * (1 + tile.agents.len() as u64));
        if self.ctx.mapped {
            let n = tile.agents.len() as u64;
            let (base, agents) = (
                slot.base.slice(..padded),
                slot.agents.slice(..padded * n.max(1)),
            );
            // An update's tile has no agents: only the base is mapped.
            let slices = if n == 0 {
                &[base][..]
            } else {
                &[base, agents][..]
            };
            self.map_wait(slices, wgpu::MapMode::Write, last, "upload")?;
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
            slot.base.unmap();
            if n > 0 {
                let mut view = mapped(agents)?;
                for (t, agent) in tile.agents.iter().enumerate() {
                    write(&mut view, t * p, &agent[range.clone()]);
                }
                drop(view);
                slot.agents.unmap();
            }
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

    pub(super) fn dispatch(
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
    pub(super) fn map_wait(
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
        // Another worker's poll may be the one that runs these callbacks, and may still be
        // running them when this poll returns: wait for them a while before giving up.
        let deadline = std::time::Instant::now() + MAP_PATIENCE;
        loop {
            self.ctx
                .device
                .poll(wait)
                .map_err(|e| anyhow!("GPU wait for {what} failed: {e}"))?;
            self.ctx
                .check()
                .with_context(|| format!("GPU {what} failed"))?;
            let mut next = mapped.try_recv().ok();
            if next.is_none() && done < slices.len() {
                next = mapped.recv_timeout(MAP_RETRY).ok();
            }
            while let Some(r) = next {
                r.map_err(|e| anyhow!("mapping the GPU buffers for {what} failed: {e}"))?;
                done += 1;
                next = mapped.try_recv().ok();
            }
            if done == slices.len() {
                return Ok(());
            }
            ensure!(
                std::time::Instant::now() < deadline,
                "mapping the GPU buffers for {what} did not complete"
            );
            wait = wgpu::PollType::wait_indefinitely();
        }
    }

    /// Waits for submission `index` (a chunk) and hands its results to `take`: per part, `bytes`
    /// bytes from `offset` of `buffer` — parts of one buffer (the readback copy) or each in its
    /// own (mapped results).
    pub(super) fn read_back(
        &self,
        parts: &[(&wgpu::Buffer, u64, u64)],
        index: wgpu::SubmissionIndex,
        what: &str,
        take: impl FnOnce(&[&[u8]]),
    ) -> Result<()> {
        let one_buffer = parts.iter().all(|(b, _, _)| std::ptr::eq(*b, parts[0].0));
        // The slices mapped: the span of every part where they share a buffer, else each part.
        let maps: Vec<(&wgpu::Buffer, u64, u64)> = if one_buffer {
            let end = parts.iter().map(|(_, o, n)| o + n).max().unwrap_or(0);
            vec![(parts[0].0, 0, end)]
        } else {
            parts.to_vec()
        };
        let slices: Vec<wgpu::BufferSlice> =
            maps.iter().map(|(b, o, n)| b.slice(*o..o + n)).collect();
        let waited = Instant::now();
        self.map_wait(&slices, wgpu::MapMode::Read, Some(index), what)?;
        let copied = Instant::now();
        let views = slices
            .iter()
            .map(|s| s.get_mapped_range())
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| anyhow!("reading the GPU {what} result failed: {e}"))?;
        let bytes: Vec<&[u8]> = parts
            .iter()
            .enumerate()
            .map(|(i, (_, offset, n))| {
                if one_buffer {
                    &views[0][*offset as usize..(offset + n) as usize]
                } else {
                    &views[i][..]
                }
            })
            .collect();
        take(&bytes);
        let down: u64 = parts.iter().map(|(_, _, n)| n).sum();
        drop(bytes);
        drop(views);
        for (b, _, _) in &maps {
            b.unmap();
        }
        self.add_time(|t| {
            t.wait += copied - waited;
            t.readback += copied.elapsed();
            t.bytes_down += down;
        });
        Ok(())
    }

    /// Runs `kernel` over the tile chunk by chunk, [`DEPTH`] chunks in flight; `finish(chunk_start,
    /// chunk_len, results)` receives each chunk's readback, one slice per [`Kernel::results`].
    /// `(eps, shared)` go into the uniforms (`Params::eps`, `Params::shared_rule`).
    pub(super) fn run_chunks(
        &self,
        tile: &Tile,
        out_dt: DType,
        (eps, shared): (f32, u32),
        prepare: impl Fn(&Slot, usize, usize) -> Result<()>,
        kernel: Kernel,
        mut finish: impl FnMut(usize, usize, &[&[u8]]),
    ) -> Result<()> {
        let n = tile.agents.len();
        ensure!(
            n >= 1 || matches!(kernel, Kernel::Update),
            "no agents in the tile"
        );
        if n > GPU_MAX_AGENTS {
            return Err(crate::error::data(crate::message![
                format!(
                    "the GPU backend merges at most {GPU_MAX_AGENTS} agents at once, got {n} (use "
                ),
                crate::error::Arg::option_value("device", "cpu"),
                ")",
            ]));
        }
        // Buffers for at least one agent: an update's tiles (none) reuse any merge's buffers.
        let sized = n.max(1);
        let mut buffers = self.take_buffers(sized)?;
        let mut last = std::mem::take(&mut buffers.last);
        let result = self.run_chunks_on(
            &buffers,
            &mut last,
            tile,
            out_dt,
            (eps, shared),
            prepare,
            kernel,
            &mut finish,
        );
        // A set whose chunks failed may hold a submission never read back: it is dropped.
        if result.is_ok() {
            buffers.last = last;
            self.give_back_buffers(buffers);
        }
        result
    }

    /// [`Self::run_chunks`] on one worker's `buffers`, whose slots' last submissions are `last`.
    #[allow(clippy::too_many_arguments)]
    fn run_chunks_on(
        &self,
        buffers: &Buffers,
        last: &mut [Option<wgpu::SubmissionIndex>],
        tile: &Tile,
        out_dt: DType,
        (eps, shared): (f32, u32),
        prepare: impl Fn(&Slot, usize, usize) -> Result<()>,
        kernel: Kernel,
        finish: &mut impl FnMut(usize, usize, &[&[u8]]),
    ) -> Result<()> {
        let (n, sized) = (tile.agents.len(), tile.agents.len().max(1));
        let mapped = self.ctx.mapped;
        let parts = |slot, len| result_parts(slot, kernel, n, len * out_dt.size());
        let read_from = |slot, len| read_parts(slot, &parts(slot, len), mapped);
        // Waits for a submitted chunk's results and hands them on.
        let mut drain =
            |(slot, start, len, index): (usize, usize, usize, wgpu::SubmissionIndex)| {
                let what = format!("{} of chunk at element {start}", kernel.name());
                let read = read_from(&buffers.slots[slot], len);
                let done = self.read_back(&read, index, &what, |b| finish(start, len, b));
                self.in_flight.fetch_sub(1, Ordering::Relaxed);
                done
            };
        // (slot, start, len, submission) submitted but not yet read back, oldest first
        let mut pending = std::collections::VecDeque::with_capacity(DEPTH);
        let depth = buffers.slots.len();
        let mut run = || -> Result<()> {
            for (i, (start, len)) in ranges(tile.len, self.chunk_elems(sized)).enumerate() {
                let slot = &buffers.slots[i % depth];
                prepare(slot, start, len)?;
                let params = chunk_params(tile, len, out_dt, (eps, shared));
                let uploaded = Instant::now();
                self.upload(slot, tile, start, &params, last[i % depth].take())
                    .with_context(|| format!("chunk at element {start}"))?;
                let submitted = Instant::now();
                let mut encoder = self.ctx.device.create_command_encoder(&Default::default());
                if kernel.results().contains(&KernelResult::Hist) {
                    encoder.clear_buffer(&slot.hist, 0, None);
                }
                for (pipeline, group) in match kernel {
                    Kernel::Probe => vec![(&self.ctx.probe_pipeline, &slot.probe_group)],
                    Kernel::Merge => vec![(&self.ctx.merge_pipeline, &slot.merge_group)],
                    // The probe reads the chunk the merge read, from the same buffers.
                    Kernel::MergeCounted => vec![
                        (&self.ctx.merge_pipeline, &slot.merge_group),
                        (&self.ctx.probe_pipeline, &slot.probe_group),
                    ],
                    Kernel::Combine => vec![(&self.ctx.combine_pipeline, &slot.combine_group)],
                    Kernel::Update => vec![(&self.ctx.update_pipeline, &slot.update_group)],
                } {
                    self.dispatch(&mut encoder, pipeline, group, &params);
                }
                if !mapped {
                    for ((result, bytes), (read, offset, _)) in
                        parts(slot, len).into_iter().zip(read_from(slot, len))
                    {
                        encoder.copy_buffer_to_buffer(result, 0, read, offset, bytes);
                    }
                }
                let index = self.ctx.queue.submit(Some(encoder.finish()));
                last[i % depth] = Some(index.clone());
                let in_flight = self.in_flight.fetch_add(1, Ordering::Relaxed) as u64 + 1;
                self.add_time(|t| {
                    t.chunks += 1;
                    t.upload += submitted - uploaded;
                    t.submit += submitted.elapsed();
                    t.max_in_flight = t.max_in_flight.max(in_flight);
                });
                pending.push_back((i % depth, start, len, index));
                // The oldest chunk reads back while the newer ones run; its slot is the next one's.
                if pending.len() == depth {
                    let oldest = pending.pop_front().expect("a full queue");
                    drain(oldest)?;
                }
            }
            while let Some(chunk) = pending.pop_front() {
                drain(chunk)?;
            }
            Ok(())
        };
        let result = run();
        // Chunks a failure left unread are in flight no more.
        self.in_flight.fetch_sub(pending.len(), Ordering::Relaxed);
        result
    }
}

/// A kernel's bind group: the buffers `buffer` names for its table of bindings (`layout.rs`), in
/// `@binding` order.
fn bind_group(
    d: &wgpu::Device,
    (label, pipeline): (&str, &wgpu::ComputePipeline),
    names: &[&str],
    buffers: &[(&str, &wgpu::Buffer)],
) -> wgpu::BindGroup {
    let buffer = |name: &str| match buffers.iter().find(|(n, _)| *n == name) {
        Some((_, b)) => *b,
        None => unreachable!("no GPU buffer is bound as {name}"),
    };
    let entries: Vec<wgpu::BindGroupEntry> = names
        .iter()
        .enumerate()
        .map(|(i, name)| wgpu::BindGroupEntry {
            binding: i as u32,
            resource: buffer(name).as_entire_binding(),
        })
        .collect();
    d.create_bind_group(&wgpu::BindGroupDescriptor {
        label: Some(label),
        layout: &pipeline.get_bind_group_layout(0),
        entries: &entries,
    })
}

/// Where each of `kernel`'s results is in `slot`, and its bytes (`out_bytes` of merged output,
/// padded to a word; the histogram of `n` agents).
fn result_parts(
    slot: &Slot,
    kernel: Kernel,
    n: usize,
    out_bytes: usize,
) -> Vec<(&wgpu::Buffer, u64)> {
    kernel
        .results()
        .iter()
        .map(|r| match r {
            KernelResult::Hist => (&slot.hist, (4 * n * n) as u64),
            KernelResult::Out => (&slot.out, out_bytes.div_ceil(4) as u64 * 4),
        })
        .collect()
}

/// Where the host reads each result: in place where buffers are mapped, else from the slot's
/// readback copy, one after another.
fn read_parts<'a>(
    slot: &'a Slot,
    parts: &[(&'a wgpu::Buffer, u64)],
    mapped: bool,
) -> Vec<(&'a wgpu::Buffer, u64, u64)> {
    let mut offset = 0;
    parts
        .iter()
        .map(|&(result, bytes)| {
            if mapped {
                (result, 0, bytes)
            } else {
                offset += bytes;
                (&slot.readback, offset - bytes, bytes)
            }
        })
        .collect()
}

/// Floats the coefficient buffer holds: a row per element of a chunk (+1 for a row straddling its
/// start) — two floats for row-wise slerp, `agents + 1` for Fisher — or one row of every agent.
pub(super) fn coef_floats(chunk: usize, agents: usize) -> usize {
    ((chunk + 1) * (agents + 1).max(2)).max(GPU_MAX_AGENTS + 1)
}
