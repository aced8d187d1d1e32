//! The generalized task-arithmetic core (SPEC §4): one per-element rule that every
//! mergekit-family method compiles to — sparsify × weight → optional sign consensus → optional
//! normalization → λ → add to (a multiple of) the base. Backends run exactly this arithmetic;
//! [`combine_element`] is its scalar reference.

use crate::checkpoint::dtype::bf16_bits_to_f32;
use crate::hash::element_hash;
pub use crate::select::{magnitude_key, RankCut};
use crate::simd::multiversion;
use serde::{Deserialize, Serialize};

/// Which elements of one agent's vector survive sparsification.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub enum Keep {
    /// Every element.
    All,
    /// Ranks (by |v| descending, ties by index) in `[lo, hi)`: inside `hi`, outside `lo`.
    Band {
        /// Ranks inside this cut are dropped.
        lo: RankCut,
        /// Ranks outside this cut are dropped.
        hi: RankCut,
    },
    /// Bernoulli: kept when the element's hash is below `threshold` (= density · 2³²).
    Random {
        /// ⌊density · 2³²⌋.
        threshold: u32,
        /// The mask's hash key (seed, tensor and agent).
        key: [u32; 2],
    },
    /// Kept where the host's word for the element (in the flags channel) is not 0: arcee_fusion's
    /// importance test ([`Fusion::flags`]), or DELLA's keep decisions by rank
    /// (`statistics::Decisions`, made with [`row_keep_mask`]).
    Flagged,
}

pub use crate::select::{rank_threshold, row_keep_mask, RankKeep};

/// The keep threshold of a Bernoulli(density) mask.
pub fn random_threshold(density: f64) -> u32 {
    (density.clamp(0.0, 1.0) * 4_294_967_296.0).min(u32::MAX as f64) as u32
}

impl Keep {
    /// `out[i]` = all ones where element `first + i` with value `v[i]` (and, for
    /// [`Keep::Flagged`], flag `flags[i]`) is kept, else 0: the vectorizable bulk form of
    /// [`Keep::keeps`].
    pub fn mask_into(&self, v: &[f32], first: u32, flags: &[u32], out: &mut [u32]) {
        keep_mask(*self, v, first, flags, out)
    }

    /// Whether the element with value `v`, tensor index `idx` and flag `flag` ([`Keep::Flagged`]
    /// only) is kept.
    #[inline]
    pub fn keeps(&self, v: f32, idx: u32, flag: u32) -> bool {
        match *self {
            Keep::All => true,
            Keep::Flagged => flag != 0,
            Keep::Band { lo, hi } => {
                let key = magnitude_key(v);
                hi.inside(key, idx) && !lo.inside(key, idx)
            }
            Keep::Random { threshold, key } => element_hash(key, idx) < threshold,
        }
    }
}

/// Calls `f(i, mask)` for i in `0..len`, the keep mask of element `first + i` (all ones or 0),
/// whose value is `v(i)` and flag `flags[i]` ([`Keep::Flagged`] only), in one branch-free loop per kind
/// of [`Keep`]: the bulk form of [`Keep::keeps`], inlined into loops that the compiler
/// vectorizes.
#[inline(always)]
fn keep_lanes(
    keep: Keep,
    len: usize,
    v: impl Fn(usize) -> f32,
    first: u32,
    flags: &[u32],
    mut f: impl FnMut(usize, u32),
) {
    let idx = |i: usize| first.wrapping_add(i as u32);
    let lane = |b: bool| (b as u32).wrapping_neg();
    // RankCut::inside as u32 lane masks: LLVM packs bools through 16-bit lanes.
    let inside = move |c: RankCut, key: u32, idx: u32| -> u32 {
        lane(key > c.value) | (lane(key == c.value) & (lane(idx < c.index) ^ lane(c.high_first)))
    };
    match keep {
        // A plain loop: `for_each`'s fold can be left out of line (then neither inlined nor
        // vectorized) when the kernel holding it grows.
        Keep::All => {
            for i in 0..len {
                f(i, u32::MAX);
            }
        }
        Keep::Flagged => {
            for (i, &flag) in flags[..len].iter().enumerate() {
                f(i, lane(flag != 0));
            }
        }
        // The top k (TIES): one cut.
        Keep::Band { lo, hi } if lo == RankCut::EMPTY => {
            for i in 0..len {
                f(i, inside(hi, magnitude_key(v(i)), idx(i)));
            }
        }
        Keep::Band { lo, hi } => {
            for i in 0..len {
                let key = magnitude_key(v(i));
                f(i, inside(hi, key, idx(i)) & !inside(lo, key, idx(i)));
            }
        }
        Keep::Random { threshold, key } => {
            for i in 0..len {
                f(i, lane(element_hash(key, idx(i)) < threshold));
            }
        }
    }
}

multiversion! {
    /// [`Keep::mask_into`], compiled for the baseline, AVX2 and AVX-512 (`multiversion!`).
    fn keep_mask(keep: Keep, v: &[f32], first: u32, flags: &[u32], out: &mut [u32]) {
        keep_lanes(keep, out.len(), |i| v[i], first, flags, |i, m| out[i] = m);
    }
}

multiversion! {
    /// One agent's term of the sum, in one pass: d = v·c where kept, else +0.0, with
    /// v = `x[i] − base[i]` (`x[i]` without a base) for `values` = (x, base) — x f32 (decoded or
    /// read in place), or bf16 bits widened as read ([`AgentValues`]) —, element i being
    /// `first + i` of flag `flags[i]` for `at` = (first, flags); `sum[i]` += d (from +0.0
    /// when `first_term`, so no row needs clearing before), and `terms[i]` = d when a consensus
    /// needs the terms again. The same IEEE operations as [`Keep::mask_into`] then scaling and
    /// adding row by row.
    pub fn keep_scale_add(
        keep: Keep,
        values: (AgentValues, Option<&[f32]>),
        at: (u32, &[u32]),
        c: f32,
        sum: &mut [f32],
        terms: Option<&mut [f32]>,
        first_term: bool,
    ) {
        #[inline(always)]
        fn term(
            keep: Keep,
            v: impl Fn(usize) -> f32,
            (first, flags): (u32, &[u32]),
            c: f32,
            sum: &mut [f32],
            terms: Option<&mut [f32]>,
            first_term: bool,
        ) {
            let n = sum.len();
            let scaled = |i: usize, m: u32| f32::from_bits((v(i) * c).to_bits() & m);
            // One loop per case, so none tests the case per element.
            match (terms, first_term) {
                (Some(d), true) => keep_lanes(keep, n, &v, first, flags, |i, m| {
                    d[i] = scaled(i, m);
                    sum[i] = 0.0 + d[i];
                }),
                (Some(d), false) => keep_lanes(keep, n, &v, first, flags, |i, m| {
                    d[i] = scaled(i, m);
                    sum[i] += d[i];
                }),
                (None, true) => keep_lanes(keep, n, &v, first, flags, |i, m| {
                    sum[i] = 0.0 + scaled(i, m);
                }),
                (None, false) => keep_lanes(keep, n, &v, first, flags, |i, m| {
                    sum[i] += scaled(i, m);
                }),
            }
        }
        let n = sum.len();
        match values {
            (AgentValues::F32(x), Some(b)) => {
                let (x, b) = (&x[..n], &b[..n]);
                term(keep, |i| x[i] - b[i], at, c, sum, terms, first_term)
            }
            (AgentValues::F32(x), None) => {
                let x = &x[..n];
                term(keep, |i| x[i], at, c, sum, terms, first_term)
            }
            (AgentValues::Bf16(x), Some(b)) => {
                let (x, b) = (&x[..n], &b[..n]);
                term(keep, |i| bf16_bits_to_f32(x[i]) - b[i], at, c, sum, terms, first_term)
            }
            (AgentValues::Bf16(x), None) => {
                let x = &x[..n];
                term(keep, |i| bf16_bits_to_f32(x[i]), at, c, sum, terms, first_term)
            }
        }
    }
}

/// An agent's values over a chunk as [`keep_scale_add`] takes them: f32 (decoded, or an f32 tile
/// read in place), or bf16 bits as stored, widened as they are read (a shift: exactly what
/// decoding gives).
#[derive(Clone, Copy)]
pub enum AgentValues<'a> {
    /// f32 values.
    F32(&'a [f32]),
    /// bf16 bits.
    Bf16(&'a [u16]),
}

/// SCE's element selection: the rank cut over [`variance_key`], and the 1/n that key uses.
pub type VarianceCut = (RankCut, f32);

/// How Δ is normalized.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum Normalize {
    /// No normalization.
    None,
    /// Multiply by this f32(1/Σ w) (no consensus: one divisor per tensor).
    Fixed(f32),
    /// Multiply by f32(1 / Σ_{t agrees} w_t), the sum in agent order in f32: 1 where the sum is
    /// 0 (floor 0, TIES), or 1 / max(Σ, floor) (SCE's clamp).
    PerElement(Vec<f32>, f32),
}

/// One tensor's combine rule over its present agents.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct CombineSpec {
    /// v_t = θ_t − θ₀ (task vectors) when true, θ_t itself when false.
    pub delta: bool,
    /// Each agent's keep rule.
    pub keep: Vec<Keep>,
    /// TIES sign consensus ("sum"): only d_t with the sign of Σ d_t count (zeros never do).
    pub consensus: bool,
    /// How Δ is divided (by the weights' sum, or not).
    pub normalize: Normalize,
    /// Multiplies Δ when ≠ 1.
    pub lambda: f32,
    /// Elements per coefficient row (0: one row for the whole tensor).
    pub row_len: u64,
    /// With `row_len`, element idx takes row (idx / row_len) mod `row_period` when this is not
    /// 0: the rows repeat (one per column of a matrix: `row_len` 1, period = columns). See
    /// [`coef_row`].
    #[serde(default)]
    pub row_period: u64,
    /// Per row: `[base coefficient, c_0 … c_{n−1}]`; out = bc·θ₀ + Δ (bc = 1: θ₀ + Δ exactly,
    /// bc = 0: Δ alone), d_t = v_t · c_t.
    pub coefs: Vec<f32>,
    /// NearSwap instead of the rule above (one model): w = clamp(t / max(|τ|, 1e-6), 0, 1),
    /// out = w·θ₁ + (1 − w)·θ₀.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub nearswap: Option<f32>,
    /// SCE: elements outside this cut of [`variance_key`] (over the agents' v) are dropped for
    /// every agent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub element_keep: Option<VarianceCut>,
    /// The consensus sign is that of Σ kept v_t (SCE) rather than of Σ d_t (TIES).
    #[serde(default)]
    pub sign_of_values: bool,
    /// Slab length of DELLA's rank groups (0: no keep rule ranks). Tiles then hold whole slabs,
    /// so a tile's keep decisions can be made from its own rows ([`row_keep_mask`]).
    #[serde(default)]
    pub rank_rows: u64,
    /// arcee_fusion: each row's KL divergence and the importance fence; the host flags each
    /// tile's kept elements from them ([`Keep::Flagged`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fusion: Option<Fusion>,
    /// Fisher: every element has its own coefficient row, computed by the host per tile and
    /// passed with it (`CombineParams::coefs`) instead of `coefs` (`row_len` is 1).
    #[serde(default)]
    pub tile_coefs: bool,
}

/// arcee_fusion's statistics of one tensor (mergekit semantics): element i of row r is kept where
/// importance = |θ₁ − θ₀|·kl[r] (one f32 product) ≥ `threshold`, where kl[r] is the KL divergence
/// of softmax(θ₁'s row) from softmax(θ₀'s row), each probability plus 1e-8, and `threshold` =
/// Q2 + 1.5·(Q3 − Q1) of the tensor's importances.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Fusion {
    /// Elements per row (the last dimension; a vector is one row).
    pub row_len: u64,
    /// Each row's KL divergence of softmax(θ₁'s row) from softmax(θ₀'s row).
    pub kl: Vec<f32>,
    /// The importance fence: elements at or above it are kept.
    pub threshold: f32,
}

impl Fusion {
    /// The importance of tensor element `idx` with task-vector value `tau`.
    #[inline]
    pub fn importance(&self, idx: u64, tau: f32) -> f32 {
        tau.abs() * self.kl[(idx / self.row_len.max(1)) as usize]
    }

    /// `out[i]` = 1 where element `first + i`, task vector `tau[i]`, is kept, else 0.
    pub fn flags(&self, first: u64, tau: &[f32], out: &mut Vec<u32>) {
        out.clear();
        out.extend(
            tau.iter()
                .enumerate()
                .map(|(i, &t)| (self.importance(first + i as u64, t) >= self.threshold) as u32),
        );
    }
}

/// The coefficient row of tensor element `idx` for rows of `row_len` elements (0: one row) that
/// repeat every `period` rows (0: never) — the one definition statistics and backends share
/// (shaders/combine.wgsl `row_of` computes the same).
#[inline]
pub fn coef_row(idx: u64, row_len: u64, period: u64) -> u64 {
    let r = idx.checked_div(row_len).unwrap_or(0);
    r.checked_rem(period).unwrap_or(r)
}

/// Fisher merging's coefficient rows for a run of elements: for element i,
/// `[0, c_0 … c_{n−1}]` with c_t = λ_t F_t / Σ_s λ_s F_s (f64, rounded once), or λ_t / Σ λ where
/// every F is 0 — so Σ_t c_t θ_t is the Fisher-weighted mean.
pub fn fisher_coefs(lambdas: &[f64], fisher: &[Vec<f32>], len: usize, out: &mut Vec<f32>) {
    let n = lambdas.len();
    out.clear();
    out.reserve(len * (n + 1));
    let plain: f64 = lambdas.iter().sum();
    let weighted = |t: usize, i: usize| lambdas[t] * fisher[t][i] as f64;
    (0..len).for_each(|i| {
        let total: f64 = (0..n).map(|t| weighted(t, i)).sum();
        out.push(0.0);
        out.extend((0..n).map(|t| {
            if total != 0.0 {
                (weighted(t, i) / total) as f32
            } else if plain != 0.0 {
                (lambdas[t] / plain) as f32
            } else {
                0.0
            }
        }));
    });
}

impl CombineSpec {
    /// A rule on task vectors (τ = x − base) with these keeps, sign consensus or not,
    /// normalization and coefficient row (base first), and nothing else: the tests' TIES-style rule.
    #[cfg(test)]
    pub(crate) fn of_task_vectors(
        keep: Vec<Keep>,
        consensus: bool,
        normalize: Normalize,
        coefs: Vec<f32>,
    ) -> CombineSpec {
        CombineSpec {
            delta: true,
            keep,
            consensus,
            normalize,
            lambda: 1.0,
            row_len: 0,
            row_period: 0,
            coefs,
            nearswap: None,
            element_keep: None,
            sign_of_values: false,
            rank_rows: 0,
            fusion: None,
            tile_coefs: false,
        }
    }

    /// Agents the rule merges.
    pub fn agents(&self) -> usize {
        self.keep.len()
    }

    /// The coefficient row number of tensor element `idx`.
    pub fn row_index(&self, idx: u64) -> u64 {
        coef_row(idx, self.row_len, self.row_period)
    }

    /// The coefficient row of tensor element `idx`.
    pub fn row(&self, idx: u64) -> &[f32] {
        let n1 = self.agents() + 1;
        let r = self.row_index(idx) as usize;
        &self.coefs[r * n1..(r + 1) * n1]
    }
}

/// The smallest |τ| NearSwap divides by.
pub const NEARSWAP_FLOOR: f32 = 1e-6;

/// NearSwap for one element: w = clamp(t / max(|x − b|, 1e-6), 0, 1), w·x + (1 − w)·b, with the
/// quotient from [`div_rn`] so every backend rounds it the same way.
#[inline]
pub fn nearswap(t: f32, b: f32, x: f32) -> f32 {
    let d = (x - b).abs().max(NEARSWAP_FLOOR);
    let w = if t <= 0.0 {
        0.0
    } else if t >= d {
        1.0
    } else {
        div_rn(t, d)
    };
    w * x + (1.0 - w) * b
}

/// a / b rounded to nearest even, for 0 < a < b, both normal, from integer arithmetic alone (the
/// shaders compute the same; GPU division is not correctly rounded). A subnormal quotient is 0.
#[inline]
pub fn div_rn(a: f32, b: f32) -> f32 {
    let (xa, xb) = (a.to_bits(), b.to_bits());
    let mut ma = (xa & 0x7f_ffff) | 0x80_0000;
    let mb = (xb & 0x7f_ffff) | 0x80_0000;
    let mut e = ((xa >> 23) & 0xff) as i32 - ((xb >> 23) & 0xff) as i32;
    if ma < mb {
        ma <<= 1;
        e -= 1;
    }
    // Restoring division: 25 quotient bits of ma / mb ∈ [1, 2), the last one a guard bit.
    let (mut q, mut r) = (0u32, ma);
    for _ in 0..25 {
        q <<= 1;
        if r >= mb {
            r -= mb;
            q |= 1;
        }
        r <<= 1;
    }
    let (guard, sticky) = (q & 1, r != 0);
    let mut m = q >> 1;
    if guard == 1 && (sticky || m & 1 == 1) {
        m += 1;
        if m == 1 << 24 {
            m >>= 1;
            e += 1;
        }
    }
    let biased = e + 127;
    if biased <= 0 {
        return 0.0;
    }
    f32::from_bits(((biased as u32) << 23) | (m & 0x7f_ffff))
}

/// f32(1/Σ w) over the agents in `mask`, summed in agent order in f32; 1 when the sum is 0.
pub fn masked_reciprocal(weights: &[f32], floor: f32, mask: u64) -> f32 {
    let mut s = 0.0f32;
    for (t, &w) in weights.iter().enumerate() {
        if mask >> t & 1 == 1 {
            s += w;
        }
    }
    sum_reciprocal(s, floor)
}

/// f32(1/s) of a weight sum `s`: 1/max(s, floor) with a floor (SCE), else 1/s, or 1 where s = 0
/// (TIES). The one place the per-element normalization is written.
#[inline(always)]
pub fn sum_reciprocal(s: f32, floor: f32) -> f32 {
    if floor > 0.0 {
        1.0 / s.max(floor)
    } else if s == 0.0 {
        1.0
    } else {
        1.0 / s
    }
}

/// [`masked_reciprocal`] for every agreement mask of `weights.len()` agents, indexed by mask:
/// what a backend looks up instead of summing per element.
pub fn reciprocal_table(weights: &[f32], floor: f32) -> Vec<f32> {
    (0..1u64 << weights.len())
        .map(|m| masked_reciprocal(weights, floor, m))
        .collect()
}

/// SCE's selection key of one element: the bits of the population variance of its values over
/// the agents, μ = (Σ v)·(1/n), var = Σ (v − μ)² · (1/n), in agent order in f32.
#[inline]
pub fn variance_key(v: &[f32], inv_n: f32) -> u32 {
    let mut sum = 0.0f32;
    for &x in v {
        sum += x;
    }
    let mean = sum * inv_n;
    let mut sq = 0.0f32;
    for &x in v {
        let e = x - mean;
        sq += e * e;
    }
    magnitude_key(sq * inv_n)
}

/// SPEC §4 for one element: base value `b`, agent values `x`, index `idx` in the tensor, and each
/// agent's flag ([`Keep::Flagged`]: DELLA's decisions, arcee_fusion's test; empty otherwise).
pub fn combine_element(spec: &CombineSpec, b: f32, x: &[f32], idx: u64, flags: &[u32]) -> f32 {
    if let Some(t) = spec.nearswap {
        return nearswap(t, b, x[0]);
    }
    let row = spec.row(idx);
    let v: Vec<f32> = x
        .iter()
        .map(|&xt| if spec.delta { xt - b } else { xt })
        .collect();
    let element_kept = spec
        .element_keep
        .is_none_or(|(cut, inv_n)| cut.inside(variance_key(&v, inv_n), idx as u32));
    let mut d = vec![0.0f32; x.len()];
    let (mut sum, mut sum_v) = (0.0f32, 0.0f32);
    for (t, &vt) in v.iter().enumerate() {
        let flag = flags.get(t).copied().unwrap_or(0);
        if element_kept && spec.keep[t].keeps(vt, idx as u32, flag) {
            d[t] = vt * row[1 + t];
            sum_v += vt;
        }
        sum += d[t];
    }
    if spec.sign_of_values {
        sum = sum_v;
    }
    let mut delta = 0.0f32;
    let mut mask = 0u64;
    for (t, &dt) in d.iter().enumerate() {
        let agrees = !spec.consensus || if sum >= 0.0 { dt > 0.0 } else { dt < 0.0 };
        if agrees {
            delta += dt;
            mask |= 1 << t;
        }
    }
    match &spec.normalize {
        Normalize::None => {}
        Normalize::Fixed(r) => delta *= r,
        Normalize::PerElement(w, floor) => delta *= masked_reciprocal(w, *floor, mask),
    }
    if spec.lambda != 1.0 {
        delta *= spec.lambda;
    }
    let bc = row[0];
    if bc == 0.0 {
        delta
    } else if bc == 1.0 {
        b + delta
    } else {
        bc * b + delta
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(
        keep: Vec<Keep>,
        consensus: bool,
        normalize: Normalize,
        coefs: Vec<f32>,
    ) -> CombineSpec {
        CombineSpec::of_task_vectors(keep, consensus, normalize, coefs)
    }

    /// TIES by hand: τ = (+2, −1, +0.5) with weights 1: Σ = 1.5 > 0, so the agreeing set is
    /// {0, 2}: Δ = 2.5, divided by w₀ + w₂ = 2 → 1.25.
    #[test]
    fn ties_consensus_by_hand() {
        let s = spec(
            vec![Keep::All; 3],
            true,
            Normalize::PerElement(vec![1.0; 3], 0.0),
            vec![1.0, 1.0, 1.0, 1.0],
        );
        assert_eq!(combine_element(&s, 10.0, &[12.0, 9.0, 10.5], 0, &[]), 11.25);
        // Σ d < 0: only the negative one counts: Δ = −3 / 1.
        assert_eq!(combine_element(&s, 0.0, &[1.0, -3.0, 0.0], 0, &[]), -3.0);
        // All zero: Σ = 0 counts as +, nobody agrees, divisor 0 → 1, result = base.
        assert_eq!(combine_element(&s, 4.0, &[4.0, 4.0, 4.0], 0, &[]), 4.0);
    }

    /// Task arithmetic: θ₀ + λ Σ w_t τ_t, no normalization.
    #[test]
    fn task_arithmetic_by_hand() {
        let mut s = spec(
            vec![Keep::All; 2],
            false,
            Normalize::None,
            vec![1.0, 0.5, 2.0],
        );
        s.lambda = 0.5;
        // τ = (2, −1): Δ = 0.5·2 + 2·(−1) = −1; λ → −0.5; θ = 1 − 0.5.
        assert_eq!(combine_element(&s, 1.0, &[3.0, 0.0], 0, &[]), 0.5);
    }

    /// Linear: Σ w θ / Σ w, no base term.
    #[test]
    fn linear_by_hand() {
        let s = CombineSpec {
            delta: false,
            ..spec(
                vec![Keep::All; 2],
                false,
                Normalize::Fixed(0.25),
                vec![0.0, 1.0, 3.0],
            )
        };
        // (1·2 + 3·6) / 4 = 5.
        assert_eq!(combine_element(&s, 100.0, &[2.0, 6.0], 0, &[]), 5.0);
    }

    /// Band keep: the two largest of |v| = (3, 1, 3, 2) with the tie at 3 broken by index.
    #[test]
    fn rank_cuts_break_ties_by_index() {
        let k = magnitude_key(3.0);
        let top1 = Keep::Band {
            lo: RankCut::EMPTY,
            hi: RankCut {
                value: k,
                index: 1,
                high_first: false,
            },
        };
        assert!(top1.keeps(3.0, 0, 1));
        assert!(!top1.keeps(-3.0, 2, 1));
        assert!(!top1.keeps(2.0, 3, 1));
        // Ranks [1, 3): drop the top one (index 0), keep index 2's 3.0 and index 3's 2.0.
        let band = Keep::Band {
            lo: RankCut {
                value: k,
                index: 1,
                high_first: false,
            },
            hi: RankCut {
                value: magnitude_key(2.0),
                index: u32::MAX,
                high_first: false,
            },
        };
        let kept: Vec<bool> = [3.0f32, 1.0, -3.0, 2.0]
            .iter()
            .enumerate()
            .map(|(i, &v)| band.keeps(v, i as u32, 1))
            .collect();
        assert_eq!(kept, [false, false, true, true]);
    }

    /// The integer division equals IEEE division (correctly rounded) wherever it is used.
    #[test]
    fn div_rn_is_correctly_rounded() {
        let mut rng = crate::hash::SplitMix64::new(12345);
        let mut next = || (rng.next_u64() >> 32) as u32;
        for _ in 0..1_000_000 {
            let a = f32::from_bits(0x0080_0000 + next() % 0x7e00_0000);
            let b = f32::from_bits(0x0080_0000 + next() % 0x7e00_0000);
            let (a, b) = if a < b { (a, b) } else { (b, a) };
            if a == b || (a / b) < f32::MIN_POSITIVE {
                continue;
            }
            assert_eq!(div_rn(a, b).to_bits(), (a / b).to_bits(), "{a} / {b}");
        }
        assert_eq!(div_rn(1.0, 3.0), 1.0 / 3.0);
        assert_eq!(nearswap(0.5, 0.0, 2.0), 0.25 * 2.0);
        assert_eq!(nearswap(3.0, 0.0, 2.0), 2.0);
    }

    /// Rank groups: a row whole (stride 1), or elements `stride` apart within each slab.
    #[test]
    fn random_masks_depend_on_tensor_agent_and_index_only() {
        use crate::hash::hash_key;
        let a = hash_key(7, "w", 0);
        assert_eq!(a, hash_key(7, "w", 0));
        assert_ne!(a, hash_key(7, "w", 1));
        assert_ne!(a, hash_key(7, "v", 0));
        assert_ne!(a, hash_key(8, "w", 0));
        let keep = Keep::Random {
            threshold: random_threshold(0.3),
            key: a,
        };
        let kept = (0..100_000u32).filter(|&i| keep.keeps(1.0, i, 1)).count();
        assert!((29_000..31_000).contains(&kept), "{kept}");
    }
}
