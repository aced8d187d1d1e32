//! The native CPU backend: the reference every other backend must match byte for byte, and the
//! fallback where no GPU adapter exists. Tiles are cut into chunks spread over a rayon pool; each
//! chunk is decoded to f32 agent by agent so the inner loops vectorize.

use super::{Backend, CombineParams, MergeParams, Tile, TileCounts};
use crate::checkpoint::dtype::{decode, encode};
use crate::checkpoint::DType;
use anyhow::{Context, Result};
use rayon::prelude::*;

mod combine;
mod counts;
mod merge;

use combine::{combine_chunk, CombineScratch};
pub(crate) use counts::{changed_masks, changed_masks_wide};
use counts::{probe_chunk, ProbeScratch};
use merge::{merge_chunk, ChunkScratch};

/// Tiles of 64 Ki elements (128 KiB of bf16 per input): a worker's tile stays in its core's L2
/// from the read through the checks, the merge and the write. `ram` on base + 3 × 1.08 GB bf16,
/// 2 cores (before the AVX2 kernels): 1.6 s at 64 Ki, 1.8 s at 32 Ki, 2.0 s at 256 Ki.
const PREFERRED_TILE_ELEMS: usize = 1 << 16;

/// Elements a kernel handles at once: the f32 working rows of a chunk (base, agent, sums…)
/// stay in L1. `ram` on base + 3 × 1.08 GB, 2 cores: 1.25 s at 1 Ki and 512, 1.4 s at 2 Ki,
/// 1.5 s at 4 Ki.
const CHUNK: usize = 1024;

/// The native CPU backend: the reference kernels, on a pool of worker threads.
pub struct CpuBackend {
    pool: rayon::ThreadPool,
}

impl CpuBackend {
    /// `threads = 0` uses every core.
    /// `threads` workers, 0 = one per core. More than [`max_threads`] is a usage error: extra
    /// threads on the same cores only add waiting, and a huge count exhausts the process limit.
    pub fn new(threads: usize) -> Result<CpuBackend> {
        let max = max_threads();
        if threads > max {
            return Err(crate::error::usage(crate::message![
                crate::error::Arg::option_value("threads", &threads.to_string()),
                format!(": at most {max} (4 × the cores here, at least 64; 0 = one per core)"),
            ]));
        }
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .thread_name(|i| format!("rlmerge-cpu-{i}"))
            .build()
            .context("cannot start the CPU worker threads")?;
        Ok(CpuBackend { pool })
    }

    /// Runs `work` on this backend's worker threads (its rayon calls use them), as the calling
    /// thread's job: it takes that thread's cancellation token ([`crate::cancel::current`]).
    pub fn install<R: Send>(&self, work: impl FnOnce() -> R + Send) -> R {
        // The work is the calling thread's job: it stops when that job is asked to (the
        // cancellation token is per thread, and the pool's threads have their own).
        let token = crate::cancel::current();
        self.pool.install(move || {
            let before = crate::cancel::current();
            crate::cancel::set_current(token);
            let done = work();
            crate::cancel::set_current(before);
            done
        })
    }
}

/// The most CPU worker threads accepted: 4 × the available cores, at least 64.
pub fn max_threads() -> usize {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    (4 * cores).max(64)
}

/// The bytes of elements `start..start + len` of a tile buffer.
fn chunk_bytes(bytes: &[u8], start: usize, len: usize, size: usize) -> &[u8] {
    &bytes[start * size..(start + len) * size]
}

/// A value as a tile stores it that the kernels widen to f32 in a register as they read it,
/// instead of decoding a row first: bf16 bits (a shift) or f32 (as is) — exactly the values
/// [`decode`] gives.
trait Stored: bytemuck::Pod {
    /// The dtype whose values this type holds.
    const DTYPE: DType;

    fn widen(self) -> f32;

    /// The values of elements `start..start + len` of a tile buffer in place
    /// ([`crate::checkpoint::dtype::in_place`]); `None` where the tile holds another dtype.
    #[inline(always)]
    fn view(dtype: DType, bytes: &[u8], (start, len): (usize, usize)) -> Option<&[Self]> {
        let bytes = chunk_bytes(bytes, start, len, dtype.size());
        crate::checkpoint::dtype::in_place(dtype, Self::DTYPE, bytes)
    }
}

impl Stored for u16 {
    const DTYPE: DType = DType::BF16;

    #[inline(always)]
    fn widen(self) -> f32 {
        crate::checkpoint::dtype::bf16_bits_to_f32(self)
    }
}

impl Stored for f32 {
    const DTYPE: DType = DType::F32;

    #[inline(always)]
    fn widen(self) -> f32 {
        self
    }
}

impl Backend for CpuBackend {
    fn describe(&self) -> String {
        format!("cpu ({} threads)", self.pool.current_num_threads())
    }

    fn preferred_tile_elems(&self) -> usize {
        PREFERRED_TILE_ELEMS
    }

    fn run_workers(&self, worker: &(dyn Fn() + Sync)) {
        self.pool.broadcast(|_| worker());
    }

    fn workers(&self) -> usize {
        self.pool.current_num_threads()
    }

    fn run_cpu_work(&self, work: &mut (dyn FnMut() + Send)) {
        // The work runs on a pool thread: it answers the caller's job's stop requests.
        let token = crate::cancel::current();
        self.pool.install(|| {
            crate::cancel::set_current(token);
            work()
        })
    }

    fn probe(&self, tile: &Tile, epsilon: f32) -> Result<TileCounts> {
        let n = tile.agents.len();
        let chunk = |s: &mut ProbeScratch, c: usize| {
            let start = c * CHUNK;
            probe_chunk(tile, epsilon, start, CHUNK.min(tile.len - start), s)
        };
        let sum = |mut a: TileCounts, b: TileCounts| {
            a.add(&b);
            a
        };
        let chunks = 0..tile.len.div_ceil(CHUNK);
        Ok(if self.on_worker() {
            with_scratch(n, ProbeScratch::new, |s| {
                chunks.map(|c| chunk(s, c)).fold(TileCounts::zeros(n), sum)
            })
        } else {
            self.pool.install(|| {
                chunks
                    .into_par_iter()
                    .map_init(ProbeScratch::new, chunk)
                    .reduce(|| TileCounts::zeros(n), sum)
            })
        })
    }

    fn merge(&self, tile: &Tile, params: &MergeParams, out: &mut [u8]) -> Result<()> {
        self.merge_tile(tile, params, out, false);
        Ok(())
    }

    /// The update kernel's CPU twin (shaders/update.wgsl): θ₀ + Δ in f32, a run at a time.
    fn add_update(
        &self,
        tile: &Tile,
        update: &[f32],
        out_dtype: crate::checkpoint::DType,
        out: &mut [u8],
    ) -> Result<()> {
        const RUN: usize = 1024;
        let (size, out_size) = (tile.dtype.size(), out_dtype.size());
        let mut values = [0.0f32; RUN];
        for (k, delta) in update[..tile.len].chunks(RUN).enumerate() {
            let (at, v) = (k * RUN, &mut values[..delta.len()]);
            decode(tile.dtype, &tile.base[at * size..(at + v.len()) * size], v);
            v.iter_mut().zip(delta).for_each(|(x, d)| *x += d);
            encode(
                out_dtype,
                v,
                &mut out[at * out_size..(at + v.len()) * out_size],
            );
        }
        Ok(())
    }

    fn merge_counted(
        &self,
        tile: &Tile,
        params: &MergeParams,
        out: &mut [u8],
    ) -> Result<TileCounts> {
        let n = tile.agents.len();
        if n > 32 {
            // Masks of more agents do not fit the merge's u32 lanes: merge, then probe.
            self.merge_tile(tile, params, out, false);
            return self.probe(tile, params.epsilon);
        }
        Ok(self
            .merge_tile(tile, params, out, true)
            .unwrap_or_else(|| TileCounts::zeros(n)))
    }

    fn combine(&self, tile: &Tile, params: &CombineParams, out: &mut [u8]) -> Result<()> {
        let out_size = params.out_dtype.size();
        debug_assert_eq!(out.len(), tile.len * out_size);
        let n = tile.agents.len();
        self.each_chunk(
            n,
            out,
            out_size,
            || CombineScratch::new(n),
            |s, start, out| combine_chunk(tile, params, start, out.len() / out_size, s, out),
            |(), ()| (),
        );
        Ok(())
    }
}

impl CpuBackend {
    /// Whether the caller is one of this backend's tile workers ([`Backend::run_workers`]): the
    /// other workers are busy with tiles of their own, so a tile runs on its worker alone.
    fn on_worker(&self) -> bool {
        self.pool.current_thread_index().is_some()
    }

    /// Runs `f(scratch, first element, out chunk)` over `out` in chunks of [`CHUNK`] elements of
    /// `out_size` bytes — on the calling worker (with its kept buffers for `agents` agents), or
    /// spread over the pool for a caller outside it — and folds the chunks' results with `add`.
    fn each_chunk<S: 'static, R: Send + Default>(
        &self,
        agents: usize,
        out: &mut [u8],
        out_size: usize,
        init: impl Fn() -> S + Send + Sync,
        f: impl Fn(&mut S, usize, &mut [u8]) -> R + Send + Sync,
        add: impl Fn(R, R) -> R + Send + Sync,
    ) -> R {
        if self.on_worker() {
            with_scratch(agents, &init, |s| {
                out.chunks_mut(CHUNK * out_size)
                    .enumerate()
                    .fold(R::default(), |acc, (c, out)| add(acc, f(s, c * CHUNK, out)))
            })
        } else {
            self.pool.install(|| {
                out.par_chunks_mut(CHUNK * out_size)
                    .enumerate()
                    .map_init(&init, |s, (c, out)| f(s, c * CHUNK, out))
                    .reduce(R::default, &add)
            })
        }
    }

    /// SPEC §2 over the tile into `out`; with `count`, also SPEC §1's counts of the same elements.
    fn merge_tile(
        &self,
        tile: &Tile,
        params: &MergeParams,
        out: &mut [u8],
        count: bool,
    ) -> Option<TileCounts> {
        let out_size = params.out_dtype.size();
        debug_assert_eq!(out.len(), tile.len * out_size);
        let n = tile.agents.len();
        self.each_chunk(
            n,
            out,
            out_size,
            ChunkScratch::new,
            |s, start, out| {
                let len = out.len() / out_size;
                merge_chunk(tile, params, start, len, s, out, count);
                count.then(|| s.counts(n, len))
            },
            |a: Option<TileCounts>, b| match (a, b) {
                (Some(mut a), Some(b)) => {
                    a.add(&b);
                    Some(a)
                }
                (a, b) => a.or(b),
            },
        )
    }
}

thread_local! {
    /// A tile worker's chunk buffers and the agent count they were made for, kept between tiles.
    static SCRATCH: std::cell::RefCell<Option<(usize, Box<dyn std::any::Any>)>> =
        const { std::cell::RefCell::new(None) };
}

/// Runs `f` with this thread's buffers of type `S` for `agents` agents, made by `init` when the
/// thread has none such (its first tile, or a tensor of another kind).
fn with_scratch<S: 'static, R>(
    agents: usize,
    init: impl Fn() -> S,
    f: impl FnOnce(&mut S) -> R,
) -> R {
    SCRATCH.with(|cell| {
        let mut slot = cell.borrow_mut();
        let keep = slot
            .as_ref()
            .is_some_and(|(n, b)| *n == agents && b.is::<S>());
        if !keep {
            *slot = Some((agents, Box::new(init())));
        }
        let s = slot
            .as_mut()
            .and_then(|(_, b)| b.downcast_mut::<S>())
            .expect("just stored");
        f(s)
    })
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;
    use crate::checkpoint::DType;
    use crate::hash::SplitMix64;
    use crate::method::SharedRule;

    /// `visit` of the tile of `base` and `agents` encoded in `dtype`.
    pub(super) fn with_tile<R>(
        dtype: DType,
        (base, agents): (&[f32], &[Vec<f32>]),
        visit: impl FnOnce(&Tile) -> R,
    ) -> R {
        let bytes = |v: &[f32]| -> Vec<u8> {
            let mut b = vec![0u8; v.len() * dtype.size()];
            crate::checkpoint::dtype::encode(dtype, v, &mut b);
            b
        };
        let agent_bytes: Vec<Vec<u8>> = agents.iter().map(|a| bytes(a)).collect();
        let slices: Vec<&[u8]> = agent_bytes.iter().map(|a| a.as_slice()).collect();
        let base_bytes = bytes(base);
        visit(&Tile {
            dtype,
            len: base.len(),
            base: &base_bytes,
            agents: &slices,
        })
    }

    /// The merge of `base` and `agents` as an f32 tile.
    fn merge_as_f32(
        backend: &CpuBackend,
        (base, agents): (&[f32], &[Vec<f32>]),
        params: &MergeParams,
    ) -> Vec<u8> {
        with_tile(DType::F32, (base, agents), |tile| {
            let mut out = vec![0u8; base.len() * params.out_dtype.size()];
            backend.merge(tile, params, &mut out).unwrap();
            out
        })
    }

    /// Every probe path (vector compares for up to 4 agents, pattern table up to 8, per-bit loop
    /// for more; 32-bit masks up to 32 agents, 64-bit beyond) against a naive count, on f32 tiles
    /// and on bf16 ones (whose agents the kernels widen as they compare and add).
    #[test]
    fn probe_counts_match_a_naive_count_for_few_and_many_agents() {
        for (n, dtype) in [1usize, 2, 3, 4, 5, 8, 9, 13, 40]
            .into_iter()
            .flat_map(|n| [(n, DType::F32), (n, DType::BF16)])
        {
            let len = CHUNK * 2 + 77;
            let mut rng = SplitMix64::new(n as u64);
            // Values the tile's dtype holds exactly, so the naive count sees what the kernels do.
            let exact = |v: f32| {
                let mut b = vec![0u8; dtype.size()];
                crate::checkpoint::dtype::encode(dtype, &[v], &mut b);
                crate::checkpoint::dtype::decode_one(dtype, &b, 0)
            };
            let base: Vec<f32> = (0..len).map(|i| exact(i as f32 * 0.001)).collect();
            let agents: Vec<Vec<f32>> = (0..n)
                .map(|t| {
                    base.iter()
                        .map(|&b| {
                            if rng.next_f64() < 0.1 + 0.01 * t as f64 {
                                exact(b + 0.5)
                            } else {
                                b
                            }
                        })
                        .collect()
                })
                .collect();
            with_tile(dtype, (&base, &agents), |tile| {
                let got = CpuBackend::new(2).unwrap().probe(tile, 1e-5).unwrap();
                let mut want = TileCounts::zeros(n);
                for i in 0..len {
                    let active: Vec<usize> = (0..n)
                        .filter(|&t| (agents[t][i] - base[i]).abs() > 1e-5)
                        .collect();
                    for &t in &active {
                        want.hist[t * n + active.len() - 1] += 1;
                    }
                }
                assert_eq!(got, want, "n = {n}, {dtype:?}");
                // A counted merge: the same counts, and the bytes of the plain merge — on a tile
                // worker (its chunks in turn) and from outside the pool (chunks spread).
                let lambdas: Vec<f32> = (0..n).map(|t| 1.0 + t as f32 / 8.0).collect();
                let params = MergeParams {
                    epsilon: 1e-5,
                    lambdas: &lambdas,
                    out_dtype: DType::F32,
                    shared: SharedRule::Mean,
                };
                let backend = CpuBackend::new(2).unwrap();
                let mut plain = vec![0u8; len * 4];
                backend.merge(tile, &params, &mut plain).unwrap();
                let mut counted = vec![0u8; len * 4];
                let counts = backend.merge_counted(tile, &params, &mut counted).unwrap();
                assert_eq!(
                    (counts, &counted),
                    (want.clone(), &plain),
                    "n = {n}, {dtype:?}"
                );
                // The bf16 kernels (agents widened as added) against the same values as f32 (agents
                // decoded into rows first): the same bytes.
                if dtype == DType::BF16 {
                    let from_f32 = merge_as_f32(&backend, (&base, &agents), &params);
                    assert_eq!(
                        from_f32, plain,
                        "n = {n}: bf16 and f32 tiles of the same values"
                    );
                }
                let on_worker = std::sync::Mutex::new(None);
                backend.run_workers(&|| {
                    let mut out = vec![0u8; len * 4];
                    let counts = backend.merge_counted(tile, &params, &mut out).unwrap();
                    *on_worker.lock().unwrap() = Some((counts, out));
                });
                assert_eq!(
                    on_worker.into_inner().unwrap(),
                    Some((want, plain)),
                    "n = {n}"
                );
            });
        }
    }
}
