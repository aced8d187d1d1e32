//! The native CPU backend: the reference every other backend must match byte for byte, and the
//! fallback where no GPU adapter exists. Tiles are cut into chunks spread over a rayon pool; each
//! chunk is decoded to f32 agent by agent so the inner loops vectorize.

use super::{Backend, CombineParams, MergeParams, Tile, TileCounts};
use crate::checkpoint::dtype::{decode, encode};
use crate::method::SharedRule;
use crate::simd::multiversion;
use anyhow::{Context, Result};
use rayon::prelude::*;

mod combine;

use combine::{combine_chunk, CombineScratch};

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
            return Err(crate::error::usage(format!(
                "--threads {threads}: at most {max} (4 × the cores here, at least 64; 0 = one per core)"
            )));
        }
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .thread_name(|i| format!("rlmerge-cpu-{i}"))
            .build()
            .context("cannot start the CPU worker threads")?;
        Ok(CpuBackend { pool })
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
        self.pool.install(work)
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
                if count {
                    let mut counts = TileCounts::zeros(n);
                    count_masks(&s.masks[..len], &mut s.patterns, &mut counts);
                    Some(counts)
                } else {
                    None
                }
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

/// Per-worker buffers for one chunk of the probe.
struct ProbeScratch {
    base: Vec<f32>,
    agent: Vec<f32>,
    masks: Vec<u64>,
    patterns: Vec<u32>,
}

impl ProbeScratch {
    fn new() -> ProbeScratch {
        ProbeScratch {
            base: vec![0.0; CHUNK],
            agent: vec![0.0; CHUNK],
            masks: vec![0; CHUNK],
            patterns: vec![0; PATTERN_SLOTS],
        }
    }
}

/// Up to this many agents the probe counts mask patterns in a table of 2^n entries.
const PATTERN_TABLE_AGENTS: usize = 8;

/// Adds `hits` elements changed by exactly the agents in `mask` to the histogram.
fn add_mask(counts: &mut TileCounts, mask: u64, hits: u64) {
    let n = counts.agents;
    let others = mask.count_ones() as usize - 1;
    let mut bits = mask;
    while bits != 0 {
        counts.hist[bits.trailing_zeros() as usize * n + others] += hits;
        bits &= bits - 1;
    }
}

multiversion! {
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
        count_masks(masks, &mut s.patterns, &mut counts);
        counts
    }
}

/// Adds each element's agent mask (bit t: agent t changed it) to the histogram: few agents count
/// each mask pattern once (in four interleaved tables of 2^n entries — `patterns` holds
/// [`PATTERN_SLOTS`] — so the increments of a run of equal masks, mostly 0, do not wait for each
/// other), then spread the patterns; many agents add mask by mask.
fn count_masks<M: Copy + Into<u64>>(masks: &[M], patterns: &mut [u32], counts: &mut TileCounts) {
    let n = counts.agents;
    if n <= PATTERN_TABLE_AGENTS {
        let size = 1 << n;
        let patterns = &mut patterns[..4 * size];
        patterns.fill(0);
        let (t0, rest) = patterns.split_at_mut(size);
        let (t1, rest) = rest.split_at_mut(size);
        let (t2, t3) = rest.split_at_mut(size);
        let mut quads = masks.chunks_exact(4);
        for q in &mut quads {
            t0[q[0].into() as usize] += 1;
            t1[q[1].into() as usize] += 1;
            t2[q[2].into() as usize] += 1;
            t3[q[3].into() as usize] += 1;
        }
        for &m in quads.remainder() {
            t0[m.into() as usize] += 1;
        }
        for m in 1..size {
            let hits = t0[m] + t1[m] + t2[m] + t3[m];
            if hits != 0 {
                add_mask(counts, m as u64, hits as u64);
            }
        }
    } else {
        for m in masks.iter().map(|&m| m.into()).filter(|&m| m != 0) {
            add_mask(counts, m, 1);
        }
    }
}

/// Entries of a scratch's pattern tables: four of 2^[`PATTERN_TABLE_AGENTS`].
const PATTERN_SLOTS: usize = 4 << PATTERN_TABLE_AGENTS;

/// Per-worker buffers for one chunk of the merge.
struct ChunkScratch {
    base: Vec<f32>,
    agent: Vec<f32>,
    sum: Vec<f32>,
    count: Vec<u32>,
    lambda: Vec<f32>,
    result: Vec<f32>,
    /// Agents agreeing with the sign of Σ, per element (`--shared consensus`).
    agree: Vec<u32>,
    /// `--shared consensus`: each agent's τ over the chunk (agent t at `t * CHUNK`), kept from
    /// the merge's pass for the consensus pass, which would otherwise decode every agent again.
    taus: Vec<f32>,
    /// A counted merge ([`Backend::merge_counted`]): each element's agent mask (u32, as the
    /// counts that build it: more agents than 32 count with a probe), and the table
    /// [`count_masks`] counts them in.
    masks: Vec<u32>,
    patterns: Vec<u32>,
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
            agree: vec![0; CHUNK],
            taus: Vec::new(),
            masks: vec![0; CHUNK],
            patterns: vec![0; PATTERN_SLOTS],
        }
    }
}

multiversion! {
    /// SPEC §2 over elements `start..start + len` of the tile (see [`merge_chunk_body`]); with
    /// `masks`, each element's agent mask (SPEC §1) is left in `s.masks`.
    fn merge_chunk(
        tile: &Tile,
        p: &MergeParams,
        start: usize,
        len: usize,
        s: &mut ChunkScratch,
        out: &mut [u8],
        masks: bool,
    ) {
        match (masks, p.shared == SharedRule::Consensus) {
            (true, true) => merge_chunk_body::<true, true>(tile, p, start, len, s, out),
            (true, false) => merge_chunk_body::<true, false>(tile, p, start, len, s, out),
            (false, true) => merge_chunk_body::<false, true>(tile, p, start, len, s, out),
            (false, false) => merge_chunk_body::<false, false>(tile, p, start, len, s, out),
        }
    }
}

/// SPEC §2 over elements `start..start + len` of the tile, in the spec's arithmetic order:
/// τ = a − b; Σ of active τ in agent order; c = 1 → b + λ·τ; c ≥ 2 → b + Σ/c (IEEE division:
/// the correctly rounded quotient); c = 0 → base bits. With `MASKS`, each element's agent mask
/// is left in `s.masks` too (bit t: agent t changed it), from the same comparisons. With
/// `CONSENSUS` (`--shared consensus`), each agent's τ is kept in `s.taus` for the consensus pass.
#[inline(always)]
fn merge_chunk_body<const MASKS: bool, const CONSENSUS: bool>(
    tile: &Tile,
    p: &MergeParams,
    start: usize,
    len: usize,
    s: &mut ChunkScratch,
    out: &mut [u8],
) {
    let in_size = tile.dtype.size();
    if CONSENSUS && s.taus.len() < tile.agents.len() * CHUNK {
        s.taus.resize(tile.agents.len() * CHUNK, 0.0);
    }
    let base = &mut s.base[..len];
    let sum = &mut s.sum[..len];
    let count = &mut s.count[..len];
    let lambda = &mut s.lambda[..len];
    let masks = &mut s.masks[..len];
    let base_bytes = chunk_bytes(tile.base, start, len, in_size);
    decode(tile.dtype, base_bytes, base);
    sum.fill(0.0);
    count.fill(0);
    lambda.fill(-0.0);
    // Each active agent adds `bit` to the element's count: 1, or with MASKS its own bit 1 << t,
    // so the count holds the agent mask until the popcount below makes it a count.
    for (t, bytes) in tile.agents.iter().enumerate() {
        // Under consensus, the agent's own row of `taus`, where its τ replaces its values.
        let agent = match CONSENSUS {
            true => &mut s.taus[t * CHUNK..t * CHUNK + len],
            false => &mut s.agent[..len],
        };
        decode(tile.dtype, chunk_bytes(bytes, start, len, in_size), agent);
        let lam_bits = p.lambdas[t].to_bits();
        let bit = if MASKS { 1u32 << t } else { 1 };
        for ((((a, &b), s), c), l) in agent
            .iter_mut()
            .zip(base.iter())
            .zip(sum.iter_mut())
            .zip(count.iter_mut())
            .zip(lambda.iter_mut())
        {
            let tau = *a - b;
            if CONSENSUS {
                *a = tau;
            }
            // All-ones where agent t is active: selects as bit masks so the loop vectorizes.
            let m = ((tau.abs() > p.epsilon) as u32).wrapping_neg();
            // Adding +0.0 leaves any sum of non-zero τ unchanged, so the masked add is exact.
            *s += f32::from_bits(tau.to_bits() & m);
            *c += m & bit;
            // Σ of the active agents' λ, inactive ones adding −0.0 (x + −0.0 = x for every x):
            // exactly λ_t where agent t alone is active, the only place it is used. An add, not
            // a select into memory, which AVX2 would turn into a slow masked store.
            *l += f32::from_bits((lam_bits & m) | (0x8000_0000 & !m));
        }
    }
    if MASKS {
        for (mask, c) in masks.iter_mut().zip(count.iter_mut()) {
            *mask = *c;
            *c = c.count_ones();
        }
    }
    if CONSENSUS {
        consensus_in_shared_region(tile.agents.len(), p, len, s);
    }
    merged_chunk(tile, p, base_bytes, len, s, out);
}

/// The merged chunk from its Σ, c and λ (SPEC §2), encoded into `out`: step = λ·Σ for the single
/// agent (c = 1), else the correctly rounded quotient Σ / c (IEEE division, as the paper's script;
/// the GPU computes the same quotient with integers, `method::div_by_count`); c = 0 keeps the
/// base's bits.
#[inline(always)]
fn merged_chunk(
    tile: &Tile,
    p: &MergeParams,
    base_bytes: &[u8],
    len: usize,
    s: &mut ChunkScratch,
    out: &mut [u8],
) {
    let (base, sum, count, lambda, result) = (
        &s.base[..len],
        &s.sum[..len],
        &s.count[..len],
        &s.lambda[..len],
        &mut s.result[..len],
    );
    for (((r, &b), &s), (&c, &l)) in result
        .iter_mut()
        .zip(base.iter())
        .zip(sum.iter())
        .zip(count.iter().zip(lambda.iter()))
    {
        let single = ((c == 1) as u32).wrapping_neg();
        let step =
            f32::from_bits(((s * l).to_bits() & single) | ((s / c as f32).to_bits() & !single));
        let merged = (b + step).to_bits();
        let keep_base = ((c == 0) as u32).wrapping_neg();
        *r = f32::from_bits((b.to_bits() & keep_base) | (merged & !keep_base));
    }
    encode(p.out_dtype, result, out);
    // c = 0: the base's bits pass through untouched. decode→encode already returns them for every
    // value but a signalling NaN of a 16-bit type (the encoder quiets it), so only NaN chunks need this.
    let has_nan = base.iter().fold(false, |acc, b| acc | b.is_nan());
    if p.out_dtype == tile.dtype && tile.dtype.size() == 2 && has_nan {
        for ((o, bb), &c) in out
            .chunks_exact_mut(2)
            .zip(base_bytes.chunks_exact(2))
            .zip(count.iter())
        {
            if c == 0 {
                o.copy_from_slice(bb);
            }
        }
    }
}

multiversion! {
    /// SPEC §2b, the shared region under `--shared consensus`: where c ≥ 2, Σ and c become those
    /// of the active agents whose τ has the sign γ of Σ (γ = + where Σ ≥ 0, else −, a NaN Σ
    /// counting as −, as TIES does), added in agent order from +0.0; λ becomes 1, so a lone
    /// agreeing agent is the mean of one, never boosted. c ≤ 1 is untouched. A second pass over
    /// the `agents` agents' τ the merge pass kept in `s.taus`, so the default mean merge pays
    /// nothing for it; selects on bit masks, as in `merge_chunk`, so the loops vectorize.
    fn consensus_in_shared_region(agents: usize, p: &MergeParams, len: usize, s: &mut ChunkScratch) {
        let (sum, agreed, agree) = (&mut s.sum[..len], &mut s.result[..len], &mut s.agree[..len]);
        agreed.fill(0.0);
        agree.fill(0);
        for t in 0..agents {
            let taus = &s.taus[t * CHUNK..t * CHUNK + len];
            for (((&tau, &total), acc), k) in taus
                .iter()
                .zip(sum.iter())
                .zip(agreed.iter_mut())
                .zip(agree.iter_mut())
            {
                let positive = total >= 0.0;
                let same_sign = (positive & (tau > 0.0)) | (!positive & (tau < 0.0));
                let m = (((tau.abs() > p.epsilon) & same_sign) as u32).wrapping_neg();
                *acc += f32::from_bits(tau.to_bits() & m);
                *k += m & 1;
            }
        }
        let one = 1.0f32.to_bits();
        for ((((total, c), l), &kept), &k) in sum
            .iter_mut()
            .zip(s.count[..len].iter_mut())
            .zip(s.lambda[..len].iter_mut())
            .zip(agreed.iter())
            .zip(agree.iter())
        {
            let shared = ((*c >= 2) as u32).wrapping_neg();
            *total = f32::from_bits((kept.to_bits() & shared) | (total.to_bits() & !shared));
            *c = (k & shared) | (*c & !shared);
            *l = f32::from_bits((one & shared) | (l.to_bits() & !shared));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checkpoint::DType;
    use crate::hash::SplitMix64;

    /// Both probe paths (pattern table for few agents, per-bit loop for many) against a naive count.
    #[test]
    fn probe_counts_match_a_naive_count_for_few_and_many_agents() {
        for n in [1usize, 3, 8, 9, 13] {
            let len = CHUNK * 2 + 77;
            let mut rng = SplitMix64::new(n as u64);
            let base: Vec<f32> = (0..len).map(|i| i as f32 * 0.001).collect();
            let agents: Vec<Vec<f32>> = (0..n)
                .map(|t| {
                    base.iter()
                        .map(|&b| {
                            if rng.next_f64() < 0.1 + 0.05 * t as f64 {
                                b + 0.5
                            } else {
                                b
                            }
                        })
                        .collect()
                })
                .collect();
            let bytes = |v: &[f32]| -> Vec<u8> { v.iter().flat_map(|x| x.to_le_bytes()).collect() };
            let agent_bytes: Vec<Vec<u8>> = agents.iter().map(|a| bytes(a)).collect();
            let slices: Vec<&[u8]> = agent_bytes.iter().map(|a| a.as_slice()).collect();
            let base_bytes = bytes(&base);
            let tile = Tile {
                dtype: DType::F32,
                len,
                base: &base_bytes,
                agents: &slices,
            };
            let got = CpuBackend::new(2).unwrap().probe(&tile, 1e-5).unwrap();
            let mut want = TileCounts::zeros(n);
            for i in 0..len {
                let active: Vec<usize> = (0..n)
                    .filter(|&t| (agents[t][i] - base[i]).abs() > 1e-5)
                    .collect();
                for &t in &active {
                    want.hist[t * n + active.len() - 1] += 1;
                }
            }
            assert_eq!(got, want, "n = {n}");
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
            backend.merge(&tile, &params, &mut plain).unwrap();
            let mut counted = vec![0u8; len * 4];
            let counts = backend.merge_counted(&tile, &params, &mut counted).unwrap();
            assert_eq!((counts, &counted), (want.clone(), &plain), "n = {n}");
            let on_worker = std::sync::Mutex::new(None);
            backend.run_workers(&|| {
                let mut out = vec![0u8; len * 4];
                let counts = backend.merge_counted(&tile, &params, &mut out).unwrap();
                *on_worker.lock().unwrap() = Some((counts, out));
            });
            assert_eq!(
                on_worker.into_inner().unwrap(),
                Some((want, plain)),
                "n = {n}"
            );
        }
    }
}
