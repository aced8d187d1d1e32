//! The native CPU backend: the reference every other backend must match byte for byte, and the
//! fallback where no GPU adapter exists. Tiles are cut into chunks spread over a rayon pool; each
//! chunk is decoded to f32 agent by agent so the inner loops vectorize.

use super::{Backend, MergeParams, Tile, TileCounts};
use crate::checkpoint::dtype::{decode, encode};
use anyhow::{Context, Result};
use rayon::prelude::*;

/// Elements a worker handles at once: small enough to stay in L1/L2 with a few agents.
const CHUNK: usize = 4096;

pub struct CpuBackend {
    pool: rayon::ThreadPool,
}

impl CpuBackend {
    /// `threads = 0` uses every core.
    pub fn new(threads: usize) -> Result<CpuBackend> {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .thread_name(|i| format!("rlmerge-cpu-{i}"))
            .build()
            .context("cannot start the CPU worker threads")?;
        Ok(CpuBackend { pool })
    }
}

/// The bytes of elements `start..start + len` of a tile buffer.
fn chunk_bytes(bytes: &[u8], start: usize, len: usize, size: usize) -> &[u8] {
    &bytes[start * size..(start + len) * size]
}

impl Backend for CpuBackend {
    fn describe(&self) -> String {
        format!("cpu ({} threads)", self.pool.current_num_threads())
    }

    fn probe(&self, tile: &Tile, epsilon: f32) -> Result<TileCounts> {
        let n = tile.agents.len();
        let chunks = tile.len.div_ceil(CHUNK);
        Ok(self.pool.install(|| {
            (0..chunks)
                .into_par_iter()
                .map_init(ProbeScratch::new, |s, c| {
                    let start = c * CHUNK;
                    probe_chunk(tile, epsilon, start, CHUNK.min(tile.len - start), s)
                })
                .reduce(
                    || TileCounts::zeros(n),
                    |mut a, b| {
                        a.add(&b);
                        a
                    },
                )
        }))
    }

    fn merge(&self, tile: &Tile, params: &MergeParams, out: &mut [u8]) -> Result<()> {
        let out_size = params.out_dtype.size();
        debug_assert_eq!(out.len(), tile.len * out_size);
        self.pool.install(|| {
            out.par_chunks_mut(CHUNK * out_size)
                .enumerate()
                .for_each_init(ChunkScratch::new, |s, (c, out)| {
                    let start = c * CHUNK;
                    let len = out.len() / out_size;
                    merge_chunk(tile, params, start, len, s, out);
                });
        });
        Ok(())
    }
}

/// Per-worker buffers for one chunk of the probe.
struct ProbeScratch {
    base: Vec<f32>,
    agent: Vec<f32>,
    masks: Vec<u64>,
}

impl ProbeScratch {
    fn new() -> ProbeScratch {
        ProbeScratch {
            base: vec![0.0; CHUNK],
            agent: vec![0.0; CHUNK],
            masks: vec![0; CHUNK],
        }
    }
}

/// SPEC §1 over elements `start..start + len`: one agent bit per element, then the histogram.
fn probe_chunk(
    tile: &Tile,
    epsilon: f32,
    start: usize,
    len: usize,
    s: &mut ProbeScratch,
) -> TileCounts {
    let n = tile.agents.len();
    let size = tile.dtype.size();
    let (base, agent, masks) = (&mut s.base[..len], &mut s.agent[..len], &mut s.masks[..len]);
    decode(tile.dtype, chunk_bytes(tile.base, start, len, size), base);
    masks.fill(0);
    for (t, bytes) in tile.agents.iter().enumerate() {
        decode(tile.dtype, chunk_bytes(bytes, start, len, size), agent);
        for ((m, &a), &b) in masks.iter_mut().zip(agent.iter()).zip(base.iter()) {
            *m |= (((a - b).abs() > epsilon) as u64) << t;
        }
    }
    let mut counts = TileCounts::zeros(n);
    for &m in masks.iter().filter(|&&m| m != 0) {
        let others = m.count_ones() as usize - 1;
        let mut bits = m;
        while bits != 0 {
            counts.hist[bits.trailing_zeros() as usize * n + others] += 1;
            bits &= bits - 1;
        }
    }
    counts
}

/// Per-worker buffers for one chunk of the merge.
struct ChunkScratch {
    base: Vec<f32>,
    agent: Vec<f32>,
    sum: Vec<f32>,
    count: Vec<u32>,
    lambda: Vec<f32>,
    result: Vec<f32>,
}

impl ChunkScratch {
    fn new() -> ChunkScratch {
        ChunkScratch {
            base: vec![0.0; CHUNK],
            agent: vec![0.0; CHUNK],
            sum: vec![0.0; CHUNK],
            count: vec![0; CHUNK],
            lambda: vec![0.0; CHUNK],
            result: vec![0.0; CHUNK],
        }
    }
}

/// SPEC §2 over elements `start..start + len` of the tile, in the spec's arithmetic order:
/// τ = a − b; Σ of active τ in agent order; c = 1 → b + λ·τ; c ≥ 2 → b + Σ·f32(1/c); c = 0 → base bits.
fn merge_chunk(
    tile: &Tile,
    p: &MergeParams,
    start: usize,
    len: usize,
    s: &mut ChunkScratch,
    out: &mut [u8],
) {
    let in_size = tile.dtype.size();
    let base = &mut s.base[..len];
    let agent = &mut s.agent[..len];
    let sum = &mut s.sum[..len];
    let count = &mut s.count[..len];
    let lambda = &mut s.lambda[..len];
    let result = &mut s.result[..len];
    let base_bytes = chunk_bytes(tile.base, start, len, in_size);
    decode(tile.dtype, base_bytes, base);
    sum.fill(0.0);
    count.fill(0);
    for (t, bytes) in tile.agents.iter().enumerate() {
        decode(tile.dtype, chunk_bytes(bytes, start, len, in_size), agent);
        let lam_t = p.lambdas[t];
        for i in 0..len {
            let tau = agent[i] - base[i];
            let active = tau.abs() > p.epsilon;
            // Adding +0.0 leaves any sum of non-zero τ unchanged, so the branch-free form is exact.
            sum[i] += if active { tau } else { 0.0 };
            count[i] += active as u32;
            lambda[i] = if active { lam_t } else { lambda[i] };
        }
    }
    for i in 0..len {
        let b = base[i];
        result[i] = match count[i] {
            0 => b,
            1 => b + lambda[i] * sum[i],
            c => b + sum[i] * p.reciprocals[c as usize],
        };
    }
    encode(p.out_dtype, result, out);
    if p.out_dtype == tile.dtype {
        // c = 0: the base's bits pass through untouched (NaN payloads included).
        for i in 0..len {
            if count[i] == 0 {
                out[i * in_size..(i + 1) * in_size]
                    .copy_from_slice(&base_bytes[i * in_size..(i + 1) * in_size]);
            }
        }
    }
}
