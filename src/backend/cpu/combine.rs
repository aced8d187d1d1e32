//! The combine rule (SPEC.md §4) over one chunk of a tile, in phases: each agent's term d_t, the
//! sign consensus, the normalization and the base term — each an `#[inline(always)]` step, so the
//! kernel, compiled once per instruction set by `multiversion!`, stays one loop nest per phase.
//! The order of every addition is that of [`crate::method::combine::combine_element`], the
//! scalar reference the tests hold this to, bit for bit.

use super::{chunk_bytes, Stored, CHUNK};
use crate::backend::{CombineParams, Tile};
use crate::checkpoint::dtype::{decode, encode};
use crate::method::combine::{
    keep_scale_add, nearswap, sum_reciprocal, variance_key, AgentValues, CombineSpec, Normalize,
};
use crate::simd::multiversion;

/// Per-worker buffers for one chunk of the combine rule.
pub(super) struct CombineScratch {
    base: Vec<f32>,
    agent: Vec<f32>,
    /// d_t for every agent, agent-major.
    d: Vec<f32>,
    sum: Vec<f32>,
    delta: Vec<f32>,
    /// Σ w of the agreeing agents per element.
    wsum: Vec<f32>,
    keep: Vec<u32>,
    element: Vec<u32>,
    sum_v: Vec<f32>,
}

impl CombineScratch {
    pub(super) fn new(agents: usize) -> CombineScratch {
        CombineScratch {
            base: vec![0.0; CHUNK],
            agent: vec![0.0; CHUNK],
            d: vec![0.0; CHUNK * agents],
            sum: vec![0.0; CHUNK],
            delta: vec![0.0; CHUNK],
            wsum: vec![0.0; CHUNK],
            keep: vec![0; CHUNK],
            element: vec![0; CHUNK],
            sum_v: vec![0.0; CHUNK],
        }
    }
}

/// Where a chunk lies and what it reads: the tile, the params, its first element in the tile and
/// in the tensor, and its length.
struct Chunk<'a> {
    tile: &'a Tile<'a>,
    p: &'a CombineParams<'a>,
    start: usize,
    first: u64,
    len: usize,
}

impl Chunk<'_> {
    fn spec(&self) -> &CombineSpec {
        self.p.spec
    }

    /// Decodes agent `t`'s values (`None`: the base's) into `out`.
    #[inline(always)]
    fn decode(&self, t: Option<usize>, out: &mut [f32]) {
        let bytes = t.map_or(self.tile.base, |t| self.tile.agents[t]);
        let size = self.tile.dtype.size();
        decode(
            self.tile.dtype,
            chunk_bytes(bytes, self.start, self.len, size),
            out,
        );
    }

    /// Agent `t`'s values over the chunk as stored, when the tile is bf16 or f32 ([`Stored`]):
    /// read in place, widened as the term reads them; `None`: decode them.
    #[inline(always)]
    fn stored(&self, t: usize) -> Option<AgentValues<'_>> {
        let (dtype, bytes, at) = (self.tile.dtype, self.tile.agents[t], (self.start, self.len));
        u16::view(dtype, bytes, at)
            .map(AgentValues::Bf16)
            .or_else(|| f32::view(dtype, bytes, at).map(AgentValues::F32))
    }

    /// Agent `t`'s flags over the chunk (empty when the rule needs none).
    fn flags(&self, t: usize) -> &[u32] {
        self.p
            .flags
            .get(t)
            .map_or(&[][..], |r| &r[self.start..self.start + self.len])
    }

    /// Coefficient `t` (0: the base's) of element `i` of the chunk.
    #[inline(always)]
    fn coef(&self, i: usize, t: usize) -> f32 {
        let spec = self.spec();
        if spec.tile_coefs {
            self.p.coefs[(self.start + i) * (self.tile.agents.len() + 1) + t]
        } else {
            spec.row(self.first + i as u64)[t]
        }
    }

    /// The one coefficient row of the whole tensor, when there is one (else a lookup per element).
    fn fixed_row(&self) -> Option<&[f32]> {
        let spec = self.spec();
        (spec.row_len == 0 && !spec.tile_coefs).then(|| spec.row(0))
    }
}

multiversion! {
    /// SPEC §4 over elements `start..start + len` of the tile, in the order of
    /// [`crate::method::combine::combine_element`].
    pub(super) fn combine_chunk(
        tile: &Tile,
        p: &CombineParams,
        start: usize,
        len: usize,
        s: &mut CombineScratch,
        out: &mut [u8],
    ) {
        let c = Chunk { tile, p, start, first: p.start + start as u64, len };
        c.decode(None, &mut s.base[..len]);
        if let Some(t) = p.spec.nearswap {
            nearswap_chunk(&c, t, s, out);
            return;
        }
        let spec = p.spec;
        // Each agent's term in one pass over its row where nothing else looks at the masks.
        let one_pass = !spec.sign_of_values && spec.element_keep.is_none() && !tile.agents.is_empty();
        match c.fixed_row() {
            Some(row) if one_pass => terms_in_one_pass(&c, row, s),
            _ => terms(&c, s),
        }
        consensus(&c, s);
        normalize(spec, &mut s.delta[..len], &s.wsum[..len]);
        add_base(&c, s);
        encode(p.out_dtype, &s.sum[..len], out);
    }
}

/// NearSwap instead of everything else: out = w·θ₁ + (1 − w)·θ₀ per element.
#[inline(always)]
fn nearswap_chunk(c: &Chunk, t: f32, s: &mut CombineScratch, out: &mut [u8]) {
    let (base, agent, sum) = (&s.base[..c.len], &mut s.agent[..c.len], &mut s.sum[..c.len]);
    c.decode(Some(0), agent);
    for ((r, &b), &x) in sum.iter_mut().zip(base.iter()).zip(agent.iter()) {
        *r = nearswap(t, b, x);
    }
    encode(c.p.out_dtype, sum, out);
}

/// Σ_t d_t into `sum` with d_t = keep(v_t)·c_t, one pass per agent (the terms kept in `d` when
/// the consensus reads them again).
#[inline(always)]
fn terms_in_one_pass(c: &Chunk, row: &[f32], s: &mut CombineScratch) {
    let spec = c.spec();
    let len = c.len;
    let (base, agent, sum) = (&s.base[..len], &mut s.agent[..len], &mut s.sum[..len]);
    for t in 0..c.tile.agents.len() {
        // bf16 and f32 agents are read in place (bf16 widened as the term reads them), not
        // decoded into a row first.
        let values = match c.stored(t) {
            Some(values) => values,
            None => {
                c.decode(Some(t), agent);
                AgentValues::F32(agent)
            }
        };
        keep_scale_add(
            spec.keep[t],
            (values, spec.delta.then_some(base)),
            (c.first as u32, c.flags(t)),
            row[1 + t],
            sum,
            spec.consensus.then(|| &mut s.d[t * CHUNK..t * CHUNK + len]),
            t == 0,
        );
    }
}

/// Σ_t d_t into `sum`, every v_t decoded first (SCE's element selection looks at all of them),
/// and Σ kept v_t into `sum_v` when the consensus sign is that of the values.
#[inline(always)]
fn terms(c: &Chunk, s: &mut CombineScratch) {
    let spec = c.spec();
    let (n, len) = (c.tile.agents.len(), c.len);
    s.sum[..len].fill(0.0);
    for t in 0..n {
        let agent = &mut s.agent[..len];
        c.decode(Some(t), agent);
        let d = &mut s.d[t * CHUNK..t * CHUNK + len];
        if spec.delta {
            for ((d, &x), &b) in d.iter_mut().zip(agent.iter()).zip(s.base.iter()) {
                *d = x - b;
            }
        } else {
            d.copy_from_slice(agent);
        }
    }
    let element = &mut s.element[..len];
    if let Some((cut, inv_n)) = spec.element_keep {
        let mut v = vec![0.0f32; n];
        for (i, m) in element.iter_mut().enumerate() {
            for (t, v) in v.iter_mut().enumerate() {
                *v = s.d[t * CHUNK + i];
            }
            let key = variance_key(&v, inv_n);
            *m = (cut.inside(key, (c.first + i as u64) as u32) as u32).wrapping_neg();
        }
    }
    let sum_v = &mut s.sum_v[..len];
    if spec.sign_of_values {
        sum_v.fill(0.0);
    }
    let fixed_row = c.fixed_row();
    for t in 0..n {
        let d = &mut s.d[t * CHUNK..t * CHUNK + len];
        // The keep mask, then d_t = v·c where kept (a select on bits, not a branch).
        let keep = &mut s.keep[..len];
        spec.keep[t].mask_into(d, c.first as u32, c.flags(t), keep);
        if spec.element_keep.is_some() {
            for (k, &e) in keep.iter_mut().zip(element.iter()) {
                *k &= e;
            }
        }
        if spec.sign_of_values {
            for ((s, &v), &m) in sum_v.iter_mut().zip(d.iter()).zip(keep.iter()) {
                *s += f32::from_bits(v.to_bits() & m);
            }
        }
        match fixed_row {
            Some(row) => {
                let coef = row[1 + t];
                for (d, &m) in d.iter_mut().zip(keep.iter()) {
                    *d = f32::from_bits((*d * coef).to_bits() & m);
                }
            }
            None => {
                for (i, (d, &m)) in d.iter_mut().zip(keep.iter()).enumerate() {
                    *d = f32::from_bits((*d * c.coef(i, 1 + t)).to_bits() & m);
                }
            }
        }
        for (s, &d) in s.sum[..len].iter_mut().zip(d.iter()) {
            *s += d;
        }
    }
    if spec.sign_of_values {
        s.sum[..len].copy_from_slice(sum_v);
    }
}

/// Δ into `delta`: the sum of the d_t that agree with the consensus sign (and the weights of
/// those agents into `wsum`), or, without consensus, the sum itself.
#[inline(always)]
fn consensus(c: &Chunk, s: &mut CombineScratch) {
    let spec = c.spec();
    let (n, len) = (c.tile.agents.len(), c.len);
    // Without consensus every d_t counts: Δ is the sum just taken, in the same order — the
    // buffers trade places instead of copying it.
    if !spec.consensus {
        std::mem::swap(&mut s.sum, &mut s.delta);
    }
    let sum = &s.sum[..len];
    let delta = &mut s.delta[..len];
    // Σ w of the agreeing agents, in agent order as `masked_reciprocal` adds them (adding
    // +0.0 for the others is exact: the sum is never −0.0), when Δ is normalized per element.
    let weights = match &spec.normalize {
        Normalize::PerElement(w, _) if spec.consensus => Some(w),
        _ => None,
    };
    let wsum = &mut s.wsum[..len];
    // Sums start at +0.0: the first agent's term sets them (0.0 + x, as adding to a cleared
    // row would).
    if matches!(spec.normalize, Normalize::PerElement(..)) && (n == 0 || weights.is_none()) {
        wsum.fill(0.0);
    }
    if !spec.consensus {
        return;
    }
    if n == 0 {
        delta.fill(0.0);
    }
    // The agents a group at a time, each element's Δ and Σ w in registers across the group.
    let rows = |t: usize| &s.d[t * CHUNK..t * CHUNK + len];
    let w = |t: usize| weights.map_or(0, |w| w[t].to_bits());
    for first in (0..n).step_by(AGREE_GROUP) {
        let group = Agreeing {
            first,
            sum,
            weighted: weights.is_some(),
        };
        match (n - first).min(AGREE_GROUP) {
            1 => group.add::<1>(&rows, &w, delta, wsum),
            2 => group.add::<2>(&rows, &w, delta, wsum),
            3 => group.add::<3>(&rows, &w, delta, wsum),
            _ => group.add::<AGREE_GROUP>(&rows, &w, delta, wsum),
        }
    }
}

/// Agents whose agreeing terms [`consensus`] adds at once.
const AGREE_GROUP: usize = 4;

/// One group of agents (from agent `first`) of [`consensus`]: Σ the signs are taken from, and
/// whether the agreeing agents' weights are summed too.
struct Agreeing<'a> {
    first: usize,
    sum: &'a [f32],
    weighted: bool,
}

impl Agreeing<'_> {
    /// Adds `G` agents' agreeing d_t (rows `rows(t)`) to `delta` and, weighted, their weights
    /// (`w(t)`, f32 bits) to `wsum`, in agent order; the first group starts both at +0.0.
    /// Adding +0.0 for a disagreeing d is exact: Δ is never −0.0 (it starts at +0.0 and only
    /// non-zero d are added). γ = + where Σ ≥ 0, else − — a NaN Σ (+Inf + −Inf) counts as −, as
    /// in `combine_element`, the shader and mergekit's `(Σ >= 0) * 2 - 1`.
    #[inline(always)]
    fn add<'r, const G: usize>(
        &self,
        rows: &impl Fn(usize) -> &'r [f32],
        w: &impl Fn(usize) -> u32,
        delta: &mut [f32],
        wsum: &mut [f32],
    ) {
        let d: [&[f32]; G] = std::array::from_fn(|j| rows(self.first + j));
        let w: [u32; G] = std::array::from_fn(|j| w(self.first + j));
        let len = self.sum.len();
        let whole = len / 16 * 16;
        for i in (0..whole).step_by(16) {
            self.lanes::<16, G>(i, (&d, w), delta, wsum);
        }
        for i in whole..len {
            self.lanes::<1, G>(i, (&d, w), delta, wsum);
        }
    }

    /// [`Self::add`] over elements `i..i + W`, as arrays the compiler vectorizes.
    #[inline(always)]
    fn lanes<const W: usize, const G: usize>(
        &self,
        i: usize,
        (d, w): (&[&[f32]; G], [u32; G]),
        delta: &mut [f32],
        wsum: &mut [f32],
    ) {
        let lanes = i..i + W;
        let sum: &[f32; W] = self.sum[lanes.clone()].try_into().expect("W lanes");
        let delta: &mut [f32; W] = (&mut delta[lanes.clone()]).try_into().expect("W lanes");
        let (mut acc, mut ws) = match self.first {
            0 => ([0.0f32; W], [0.0f32; W]),
            _ => {
                let ws = match self.weighted {
                    true => *<&[f32; W]>::try_from(&wsum[lanes.clone()]).expect("W lanes"),
                    false => [0.0; W],
                };
                (*delta, ws)
            }
        };
        for j in 0..G {
            let dj: &[f32; W] = d[j][lanes.clone()].try_into().expect("W lanes");
            for k in 0..W {
                let positive = sum[k] >= 0.0;
                let agree = ((positive && dj[k] > 0.0) | (!positive && dj[k] < 0.0)) as u32;
                let bits = agree.wrapping_neg();
                acc[k] += f32::from_bits(dj[k].to_bits() & bits);
                ws[k] += f32::from_bits(w[j] & bits);
            }
        }
        *delta = acc;
        if self.weighted {
            wsum[lanes].copy_from_slice(&ws);
        }
    }
}

/// Δ divided as the rule says (per element: by the agreeing weights' sum, [`sum_reciprocal`]),
/// then scaled by λ.
#[inline(always)]
fn normalize(spec: &CombineSpec, delta: &mut [f32], wsum: &[f32]) {
    match &spec.normalize {
        Normalize::None => {}
        Normalize::Fixed(r) => delta.iter_mut().for_each(|x| *x *= r),
        Normalize::PerElement(_, floor) => {
            for (x, &s) in delta.iter_mut().zip(wsum.iter()) {
                *x *= sum_reciprocal(s, *floor);
            }
        }
    }
    if spec.lambda != 1.0 {
        delta.iter_mut().for_each(|x| *x *= spec.lambda);
    }
}

/// The result into `sum`: bc·θ₀ + Δ, with bc = 0 (Δ alone) and bc = 1 (θ₀ + Δ) exact.
#[inline(always)]
fn add_base(c: &Chunk, s: &mut CombineScratch) {
    let len = c.len;
    let (base, delta, result) = (&s.base[..len], &s.delta[..len], &mut s.sum[..len]);
    let base_term = |r: &mut f32, b: f32, d: f32, bc: f32| {
        *r = if bc == 0.0 {
            d
        } else if bc == 1.0 {
            b + d
        } else {
            bc * b + d
        };
    };
    match c.fixed_row().map(|row| row[0]) {
        Some(0.0) => result.copy_from_slice(delta),
        Some(1.0) => {
            for ((r, &b), &d) in result.iter_mut().zip(base.iter()).zip(delta.iter()) {
                *r = b + d;
            }
        }
        _ => {
            for (i, ((r, &b), &d)) in result
                .iter_mut()
                .zip(base.iter())
                .zip(delta.iter())
                .enumerate()
            {
                base_term(r, b, d, c.coef(i, 0));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::tests::with_tile;
    use super::super::CpuBackend;
    use super::*;
    use crate::backend::Backend;
    use crate::checkpoint::DType;
    use crate::hash::SplitMix64;
    use crate::method::combine::{combine_element, magnitude_key, random_threshold, Keep, RankCut};

    /// The combine kernels on a bf16 tile (agents widened as each term reads them) against the
    /// same values as an f32 tile (decoded into a row first) and against the scalar reference
    /// `combine_element`, bit for bit: TIES-style consensus with every kind of keep that reads
    /// values (all, a rank band, a random mask), with and without the base subtracted.
    #[test]
    fn bf16_tiles_combine_as_their_f32_values_and_the_reference() {
        let len = 2 * CHUNK + 37;
        let mut rng = SplitMix64::new(11);
        let bf16 =
            |v: f32| crate::checkpoint::dtype::bf16_bits_to_f32(half::bf16::from_f32(v).to_bits());
        let base: Vec<f32> = (0..len)
            .map(|_| bf16(rng.next_f64() as f32 - 0.5))
            .collect();
        let agents: Vec<Vec<f32>> = (0..3)
            .map(|_| {
                base.iter()
                    .map(|&b| match rng.next_u64() % 3 {
                        0 => b,
                        _ => bf16(b + (rng.next_f64() as f32 - 0.5) * 0.1),
                    })
                    .collect()
            })
            .collect();
        let cut = |k: f32, index| RankCut {
            value: magnitude_key(k),
            index,
            high_first: false,
        };
        let keep = vec![
            Keep::All,
            Keep::Band {
                lo: cut(0.04, 100),
                hi: cut(0.001, 7),
            },
            Keep::Random {
                threshold: random_threshold(0.6),
                key: [3, 5],
            },
        ];
        for delta in [true, false] {
            let spec = CombineSpec {
                delta,
                ..CombineSpec::of_task_vectors(
                    keep.clone(),
                    true,
                    Normalize::PerElement(vec![1.0, 0.5, 2.0], 0.0),
                    vec![1.0, 1.0, 0.5, 2.0],
                )
            };
            let params = CombineParams {
                spec: &spec,
                start: 1000,
                out_dtype: DType::F32,
                flags: &[],
                coefs: &[],
            };
            let merged = |dtype: DType| -> Vec<u8> {
                with_tile(dtype, (&base, &agents), |tile| {
                    let mut out = vec![0u8; len * 4];
                    let backend = CpuBackend::new(2).unwrap();
                    backend.combine(tile, &params, &mut out).unwrap();
                    out
                })
            };
            let from_bf16 = merged(DType::BF16);
            assert_eq!(from_bf16, merged(DType::F32), "delta {delta}");
            for i in 0..len {
                let x: Vec<f32> = agents.iter().map(|a| a[i]).collect();
                let want = combine_element(&spec, base[i], &x, 1000 + i as u64, &[]);
                let got = f32::from_le_bytes(from_bf16[4 * i..4 * i + 4].try_into().unwrap());
                assert_eq!(got.to_bits(), want.to_bits(), "delta {delta}, element {i}");
            }
        }
    }
}
