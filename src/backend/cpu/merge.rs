//! SPEC §2 and §2b on the CPU: the RAM merge of one chunk, summed a group of agents at a time with
//! each element's Σ, c and λ in registers; bf16 and f32 agents are read in place and widened as
//! the sums read them, f16 agents (and every agent under consensus) decoded into a row each first.

use super::counts::{count_masks, PATTERN_SLOTS};
use super::{chunk_bytes, Stored, CHUNK};
use crate::backend::{MergeParams, Tile, TileCounts};
use crate::checkpoint::dtype::{decode, decode_minus, encode};
use crate::method::SharedRule;
use crate::simd::multiversion;

/// Per-worker buffers for one chunk of the merge.
pub(super) struct ChunkScratch {
    base: Vec<f32>,
    sum: Vec<f32>,
    count: Vec<u32>,
    lambda: Vec<f32>,
    result: Vec<f32>,
    /// Agents agreeing with the sign of Σ, per element (`--shared consensus`).
    agree: Vec<u32>,
    /// Each agent's values over the chunk, decoded (agent t at `t * CHUNK`); under `--shared
    /// consensus` the merge's pass leaves its τ there for the consensus pass.
    values: Vec<f32>,
    /// A counted merge ([`Backend::merge_counted`]): each element's agent mask (u32, as the
    /// counts that build it: more agents than 32 count with a probe), and the table
    /// [`count_masks`] counts them in.
    masks: Vec<u32>,
    patterns: Vec<u32>,
}

impl ChunkScratch {
    pub(super) fn new() -> ChunkScratch {
        ChunkScratch {
            base: vec![0.0; CHUNK],
            sum: vec![0.0; CHUNK],
            count: vec![0; CHUNK],
            lambda: vec![0.0; CHUNK],
            result: vec![0.0; CHUNK],
            agree: vec![0; CHUNK],
            values: Vec::new(),
            masks: vec![0; CHUNK],
            patterns: vec![0; PATTERN_SLOTS],
        }
    }

    /// SPEC §1's counts of the chunk's first `len` elements, from the agent masks a counted
    /// merge left (`n` agents).
    pub(super) fn counts(&mut self, n: usize, len: usize) -> TileCounts {
        let mut counts = TileCounts::zeros(n);
        count_masks(&self.masks[..len], &mut self.patterns, &mut counts);
        counts
    }
}

multiversion! {
    /// SPEC §2 over elements `start..start + len` of the tile (see [`merge_chunk_body`]); with
    /// `masks`, each element's agent mask (SPEC §1) is left in `s.masks`.
    pub(super) fn merge_chunk(
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
/// `CONSENSUS` (`--shared consensus`), each agent's τ is kept in `s.values` for the consensus pass.
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
    let n = tile.agents.len();
    if s.values.len() < n * CHUNK {
        s.values.resize(n * CHUNK, 0.0);
    }
    let base_bytes = chunk_bytes(tile.base, start, len, in_size);
    decode(tile.dtype, base_bytes, &mut s.base[..len]);
    // bf16 and f32 agents are read in place and widened in the sums' registers as they are added
    // (a shift for bf16), not first decoded into rows (not under consensus, which keeps each
    // agent's τ in its row).
    if !CONSENSUS
        && (add_stored::<MASKS, u16>(tile, p, (start, len), s)
            || add_stored::<MASKS, f32>(tile, p, (start, len), s))
    {
        return finish_chunk::<MASKS, CONSENSUS>(tile, p, base_bytes, (n, len), s, out);
    }
    // Every agent decoded first, into its own row: the sums then take the agents a group at a
    // time, each element's Σ, c and λ in registers across the group. Under consensus each row is
    // its τ (decoded minus the base in one pass), kept for the consensus pass; the sums then take
    // τ − 0 = τ (x − +0.0 is x for every x).
    for (bytes, row) in tile.agents.iter().zip(s.values.chunks_mut(CHUNK)) {
        let bytes = chunk_bytes(bytes, start, len, in_size);
        if CONSENSUS {
            decode_minus(tile.dtype, bytes, &s.base[..len], &mut row[..len]);
        } else {
            decode(tile.dtype, bytes, &mut row[..len]);
        }
    }
    let base = if CONSENSUS {
        &ZEROS[..len]
    } else {
        &s.base[..len]
    };
    let mut acc = Sums {
        base,
        sum: &mut s.sum[..len],
        count: &mut s.count[..len],
        lambda: &mut s.lambda[..len],
    };
    let groups = (s.values[..n * CHUNK].chunks(GROUP * CHUNK)).map(|rows| F32Rows { rows, len });
    add_agents::<MASKS, _>(groups, p, &mut acc);
    finish_chunk::<MASKS, CONSENSUS>(tile, p, base_bytes, (n, len), s, out);
}

/// The end of a merge chunk, after its sums: the base's bits where no agent has the tensor, the
/// agent masks turned into counts, the consensus rule, then the merged values encoded.
#[inline(always)]
fn finish_chunk<const MASKS: bool, const CONSENSUS: bool>(
    tile: &Tile,
    p: &MergeParams,
    base_bytes: &[u8],
    (n, len): (usize, usize),
    s: &mut ChunkScratch,
    out: &mut [u8],
) {
    // No agent (a tensor none of the merged agents has): no sums, the base's bits.
    if n == 0 {
        s.sum[..len].fill(0.0);
        s.count[..len].fill(0);
        s.lambda[..len].fill(-0.0);
    }
    if MASKS {
        let (masks, counts) = (&mut s.masks[..len], &mut s.count[..len]);
        if n <= 3 {
            // The counts of the eight masks of up to three agents, as the nibbles of one word: a
            // shift per lane, where a vector popcount without AVX-512 VPOPCNTDQ is a dozen
            // instructions.
            const COUNTS: u32 = 0x3221_2110;
            for (mask, c) in masks.iter_mut().zip(counts.iter_mut()) {
                *mask = *c;
                *c = (COUNTS >> ((*c & 7) * 4)) & 0xf;
            }
        } else {
            for (mask, c) in masks.iter_mut().zip(counts.iter_mut()) {
                *mask = *c;
                *c = c.count_ones();
            }
        }
    }
    if CONSENSUS {
        consensus_in_shared_region(n, p, len, s);
    }
    merged_chunk(tile, p, base_bytes, len, s, out);
}

/// Agents a merge chunk sums at once, each element's Σ, c and λ held in registers across them.
const GROUP: usize = 4;

/// The base a consensus merge's sums see: its rows already hold τ.
static ZEROS: [f32; CHUNK] = [0.0; CHUNK];

/// A merge chunk's base and its running Σ, c (or agent masks) and λ sums, element by element.
struct Sums<'a> {
    base: &'a [f32],
    sum: &'a mut [f32],
    count: &'a mut [u32],
    lambda: &'a mut [f32],
}

/// Adds `G` agents (agents `first..first + G`, their values read through `row`) to the sums, in
/// agent order: an active agent (|τ| > ε) adds τ to Σ, its bit to c (1, or with `MASKS` 1 << t,
/// so c holds the agent mask until a popcount makes it a count) and λ_t to λ; an inactive one
/// adds +0.0, 0 and −0.0, which change nothing. The first group (`first` = 0) starts the sums at
/// +0.0, 0 and −0.0 instead of reading them. Selects on bit masks so the loop vectorizes.
#[inline(always)]
fn add_group<const G: usize, const MASKS: bool, R: AgentRows>(
    row: R,
    first: usize,
    lambdas: &[f32],
    epsilon: f32,
    acc: &mut Sums,
) {
    let len = acc.base.len();
    let bits: [u32; G] = std::array::from_fn(|j| if MASKS { 1 << (first + j) } else { 1 });
    let lam: [u32; G] = std::array::from_fn(|j| lambdas[j].to_bits());
    // Blocks of 16 lanes (one AVX-512 register, two AVX2 ones), then the rest lane by lane.
    let whole = len / 16 * 16;
    for i in (0..whole).step_by(16) {
        add_lanes::<16, G, MASKS, R>(i, (&row, bits, lam), (first, epsilon), acc);
    }
    for i in whole..len {
        add_lanes::<1, G, MASKS, R>(i, (&row, bits, lam), (first, epsilon), acc);
    }
}

/// A group of at most [`GROUP`] agents' values over a chunk.
trait AgentRows {
    /// Agents in the group.
    fn agents(&self) -> usize;
    /// `W` values of agent `j` of the group from the chunk's element `i`.
    fn lanes<const W: usize>(&self, j: usize, i: usize) -> [f32; W];
}

/// Agents decoded into the CHUNK-long rows of `rows`, `len` elements each.
struct F32Rows<'a> {
    rows: &'a [f32],
    len: usize,
}

impl AgentRows for F32Rows<'_> {
    fn agents(&self) -> usize {
        self.rows.len() / CHUNK
    }

    #[inline(always)]
    fn lanes<const W: usize>(&self, j: usize, i: usize) -> [f32; W] {
        debug_assert!(i + W <= self.len);
        let at = j * CHUNK + i;
        self.rows[at..at + W].try_into().expect("W lanes")
    }
}

/// Agents' values as stored ([`Stored`]: bf16 bits or f32), read in place and widened lane by
/// lane: exactly what [`decode`] gives.
struct StoredRows<'a, T> {
    rows: [&'a [T]; GROUP],
    agents: usize,
}

impl<T: Stored> AgentRows for StoredRows<'_, T> {
    fn agents(&self) -> usize {
        self.agents
    }

    #[inline(always)]
    fn lanes<const W: usize>(&self, j: usize, i: usize) -> [f32; W] {
        let v = &self.rows[j][i..i + W];
        std::array::from_fn(|k| v[k].widen())
    }
}

/// Adds every agent to the chunk's sums from its values read in place as `T`, when every
/// agent's can be (the tile holds `T`); returns whether it did.
#[inline(always)]
fn add_stored<const MASKS: bool, T: Stored>(
    tile: &Tile,
    p: &MergeParams,
    (start, len): (usize, usize),
    s: &mut ChunkScratch,
) -> bool {
    let view = |b| T::view(tile.dtype, b, (start, len));
    if !tile.agents.iter().all(|b| view(b).is_some()) {
        return false;
    }
    let mut acc = Sums {
        base: &s.base[..len],
        sum: &mut s.sum[..len],
        count: &mut s.count[..len],
        lambda: &mut s.lambda[..len],
    };
    let groups = tile.agents.chunks(GROUP).map(|group| StoredRows {
        rows: std::array::from_fn(|j| group.get(j).and_then(|b| view(b)).unwrap_or_default()),
        agents: group.len(),
    });
    add_agents::<MASKS, _>(groups, p, &mut acc);
    true
}

/// Adds every agent to the sums, a group at a time, in agent order.
#[inline(always)]
fn add_agents<const MASKS: bool, R: AgentRows>(
    groups: impl Iterator<Item = R>,
    p: &MergeParams,
    acc: &mut Sums,
) {
    for (g, rows) in groups.enumerate() {
        let first = g * GROUP;
        let lambdas = &p.lambdas[first..];
        match rows.agents() {
            1 => add_group::<1, MASKS, R>(rows, first, lambdas, p.epsilon, acc),
            2 => add_group::<2, MASKS, R>(rows, first, lambdas, p.epsilon, acc),
            3 => add_group::<3, MASKS, R>(rows, first, lambdas, p.epsilon, acc),
            _ => add_group::<GROUP, MASKS, R>(rows, first, lambdas, p.epsilon, acc),
        }
    }
}

/// [`add_group`] over elements `i..i + W`, as arrays of `W` lanes that the compiler vectorizes.
#[inline(always)]
fn add_lanes<const W: usize, const G: usize, const MASKS: bool, R: AgentRows>(
    i: usize,
    (row, bits, lam): (&R, [u32; G], [u32; G]),
    (first, epsilon): (usize, f32),
    acc: &mut Sums,
) {
    let lanes = i..i + W;
    let b: &[f32; W] = acc.base[lanes.clone()].try_into().expect("W lanes");
    let sum: &mut [f32; W] = (&mut acc.sum[lanes.clone()]).try_into().expect("W lanes");
    let count: &mut [u32; W] = (&mut acc.count[lanes.clone()]).try_into().expect("W lanes");
    let lambda: &mut [f32; W] = (&mut acc.lambda[lanes.clone()])
        .try_into()
        .expect("W lanes");
    let (mut s, mut c, mut l) = match first {
        0 => ([0.0; W], [0; W], [-0.0; W]),
        _ => (*sum, *count, *lambda),
    };
    for j in 0..G {
        let a: [f32; W] = row.lanes(j, i);
        for k in 0..W {
            let tau = a[k] - b[k];
            // All ones where agent t is active. Adding +0.0 leaves any sum of nonzero τ
            // unchanged, so the masked add is exact; x + −0.0 = x for every x, so λ ends as
            // exactly λ_t where agent t alone is active, the only place it is used.
            let m = ((tau.abs() > epsilon) as u32).wrapping_neg();
            s[k] += f32::from_bits(tau.to_bits() & m);
            c[k] += m & bits[j];
            l[k] += f32::from_bits((lam[j] & m) | (0x8000_0000 & !m));
        }
    }
    (*sum, *count, *lambda) = (s, c, l);
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
    /// the `agents` agents' τ the merge pass kept in `s.values`, so the default mean merge pays
    /// nothing for it; selects on bit masks, as in `merge_chunk`, so the loops vectorize.
    fn consensus_in_shared_region(agents: usize, p: &MergeParams, len: usize, s: &mut ChunkScratch) {
        let (sum, agreed, agree) = (&mut s.sum[..len], &mut s.result[..len], &mut s.agree[..len]);
        agreed.fill(0.0);
        agree.fill(0);
        for t in 0..agents {
            let taus = &s.values[t * CHUNK..t * CHUNK + len];
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
