//! RAM+'s boost as the output dtype keeps it (issue #53 item 4). An RL agent's change to a weight
//! is often a bf16 step or two; boosting it by λ ≈ 1.02 moves the f32 sum θ₀ + λ·τ by less than
//! half a step, and rounding to bf16 gives back the agent's own value — the very value plain RAM
//! writes. The merge pass counts, for each agent, the unique elements (c = 1) whose boosted value
//! rounds to what λ = 1 would have written, from the tile's inputs and the bytes just written, so
//! the merge can say how much of its boost the output dtype kept.

use crate::backend::cpu::{changed_masks, changed_masks_wide};
use crate::backend::Tile;
use crate::checkpoint::dtype::{bf16_bits_to_f32, f32_to_bf16_bits, in_place};
use crate::checkpoint::DType;
use crate::simd::multiversion;

/// Elements masked at a time.
const CHUNK: usize = 1024;

/// Per agent (by its index among all agents): unique elements whose λ ≠ 1, and those of them the
/// output holds at the value λ = 1 gives.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(super) struct BoostRounding {
    pub(super) boosted: Vec<u64>,
    pub(super) unmoved: Vec<u64>,
}

/// A tile worker's buffers for [`BoostRounding::tally`].
#[derive(Default)]
pub(super) struct RoundingScratch {
    base: Vec<f32>,
    agent: Vec<f32>,
    masks: Vec<u32>,
    /// The masks of more than 32 agents.
    wide: Vec<u64>,
}

impl BoostRounding {
    pub(super) fn zeros(agents: usize) -> BoostRounding {
        BoostRounding {
            boosted: vec![0; agents],
            unmoved: vec![0; agents],
        }
    }

    pub(super) fn add(&mut self, other: &BoostRounding) {
        for (a, b) in self.boosted.iter_mut().zip(&other.boosted) {
            *a += b;
        }
        for (a, b) in self.unmoved.iter_mut().zip(&other.unmoved) {
            *a += b;
        }
    }

    /// Whether a tile merged with these λ into `out_dtype` is counted: some λ ≠ 1, and an output
    /// narrower than f32 (which keeps every boost).
    pub(super) fn applies(lambdas: &[f32], out_dtype: DType) -> bool {
        out_dtype != DType::F32 && lambdas.iter().any(|&l| l != 1.0)
    }

    /// Counts a tile RAM+ merged with `lambdas` (of the tile's agents, which are the agents
    /// `present` names) into `out` of `out_dtype`: each element exactly one agent changed
    /// (SPEC §1's mask, as the probe computes it) with λ ≠ 1 is boosted, and unmoved where the
    /// output holds θ₀ + τ rounded to `out_dtype`, the value λ = 1 writes (SPEC §2). The masks
    /// are vector work; only elements one agent changed are looked at one by one.
    pub(super) fn tally(
        &mut self,
        tile: &Tile,
        (lambdas, epsilon, present): (&[f32], f32, &[usize]),
        (out_dtype, out): (DType, &[u8]),
        s: &mut RoundingScratch,
    ) {
        let (size, out_size) = (tile.dtype.size(), out_dtype.size());
        let wide = tile.agents.len() > 32;
        for start in (0..tile.len).step_by(CHUNK) {
            let len = CHUNK.min(tile.len - start);
            s.base.resize(len, 0.0);
            s.agent.resize(len, 0.0);
            let (base, row) = (&mut s.base, &mut s.agent);
            match wide {
                false => {
                    s.masks.resize(len, 0);
                    changed_masks(tile, epsilon, start, base, row, &mut s.masks);
                }
                true => {
                    s.wide.resize(len, 0);
                    changed_masks_wide(tile, epsilon, start, base, row, &mut s.wide);
                }
            }
            let written = window(out, out_size, start, len);
            for (t, agent) in tile.agents.iter().enumerate() {
                if lambdas[t] == 1.0 {
                    continue;
                }
                let agent = window(agent, size, start, len);
                let bf16 = (
                    in_place::<u16>(tile.dtype, DType::BF16, agent),
                    in_place::<u16>(out_dtype, DType::BF16, written),
                );
                let any = ((tile.dtype, agent), (out_dtype, written));
                let (boosted, unmoved) = match (wide, bf16) {
                    (false, (Some(agent), Some(written))) => {
                        bf16_tally(&s.masks, 1 << t, &s.base, agent, written)
                    }
                    (false, _) => any_tally(&s.masks, 1 << t, &s.base, any),
                    (true, _) => any_tally(&s.wide, 1 << t, &s.base, any),
                };
                self.boosted[present[t]] += boosted;
                self.unmoved[present[t]] += unmoved;
            }
        }
    }

    /// A warning for each agent whose boost the output dtype `out_dtype` rounded away from at
    /// least a hundredth of its boosted elements, with its λ (`None`: per tensor or group).
    pub(super) fn warnings(
        &self,
        names: &[String],
        lambdas: &[Option<f64>],
        out_dtype: DType,
    ) -> Vec<String> {
        let mut said = Vec::new();
        for (t, name) in names.iter().enumerate() {
            let (boosted, unmoved) = (self.boosted[t], self.unmoved[t]);
            let Some(share) = self.unmoved_share(t).filter(|s| *s >= 0.01) else {
                continue;
            };
            let lambda = match lambdas.get(t).copied().flatten() {
                Some(l) => format!("λ = {l:.4}"),
                None => "λ per tensor or group".to_string(),
            };
            said.push(format!(
                "ram+ boost rounded away: of the {boosted} elements agent {name} alone changed \
                 ({lambda}), {unmoved} ({:.1}%) hold in {out_dtype} the very value plain ram \
                 writes — λ·τ and τ round to the same {out_dtype} number where τ is a step or two \
                 of {out_dtype}; --out-dtype float32 keeps the boost",
                share * 100.0
            ));
        }
        said
    }

    /// Agent `t`'s share of boosted elements the output holds unmoved (`None`: none boosted).
    pub(super) fn unmoved_share(&self, t: usize) -> Option<f64> {
        (self.boosted[t] > 0).then(|| self.unmoved[t] as f64 / self.boosted[t] as f64)
    }
}

multiversion! {
    /// Of the elements whose mask is `bit` alone (one agent changed them), how many, and how many
    /// `written` holds at θ₀ + τ rounded to bf16 — bf16 agent values and output, branch-free so it
    /// runs as vector code.
    fn bf16_tally(masks: &[u32], bit: u32, base: &[f32], agent: &[u16], written: &[u16]) -> (u64, u64) {
        let (mut boosted, mut unmoved) = (0u32, 0u32);
        for (((&m, &b), &a), &w) in masks.iter().zip(base).zip(agent).zip(written) {
            let alone = u32::from(m == bit);
            let a = bf16_bits_to_f32(a);
            let plain = f32_to_bf16_bits(b + (a - b));
            boosted += alone;
            unmoved += alone & u32::from(plain == w);
        }
        (u64::from(boosted), u64::from(unmoved))
    }
}

/// [`bf16_tally`] of any agent and output dtypes and any number of agents, element by element.
fn any_tally<M: Copy + PartialEq>(
    masks: &[M],
    bit: M,
    base: &[f32],
    ((dtype, agent), (out_dtype, written)): (Stored, Stored),
) -> (u64, u64) {
    let (size, out_size) = (dtype.size(), out_dtype.size());
    let (mut boosted, mut unmoved) = (0, 0);
    for (i, (&m, &b)) in masks.iter().zip(base).enumerate() {
        if m == bit {
            let a = value(dtype, &agent[i * size..(i + 1) * size]);
            boosted += 1;
            unmoved += u64::from(holds(
                out_dtype,
                b + (a - b),
                &written[i * out_size..(i + 1) * out_size],
            ));
        }
    }
    (boosted, unmoved)
}

/// Elements of a dtype, as stored.
type Stored<'a> = (DType, &'a [u8]);

/// Elements `start..start + len` of `bytes`, of `size` bytes each.
fn window(bytes: &[u8], size: usize, start: usize, len: usize) -> &[u8] {
    &bytes[start * size..(start + len) * size]
}

/// The value of one element's little-endian `bytes` of `dtype`.
#[inline(always)]
fn value(dtype: DType, bytes: &[u8]) -> f32 {
    match dtype {
        DType::BF16 => bf16_bits_to_f32(u16::from_le_bytes([bytes[0], bytes[1]])),
        DType::F16 => half::f16::from_bits(u16::from_le_bytes([bytes[0], bytes[1]])).to_f32(),
        DType::F32 => f32::from_le_bytes([bytes[0], bytes[1], bytes[2], bytes[3]]),
    }
}

/// Whether `written` (one element of `dtype`) is `v` rounded to `dtype` (to nearest even, as the
/// writer rounds).
#[inline(always)]
fn holds(dtype: DType, v: f32, written: &[u8]) -> bool {
    match dtype {
        DType::BF16 => f32_to_bf16_bits(v).to_le_bytes() == written,
        DType::F16 => half::f16::from_f32(v).to_bits().to_le_bytes() == written,
        DType::F32 => v.to_le_bytes() == written,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checkpoint::dtype::encode;

    fn bf16(values: &[f32]) -> Vec<u8> {
        let mut out = vec![0; values.len() * 2];
        encode(DType::BF16, values, &mut out);
        out
    }

    #[test]
    fn a_bf16_step_boosted_by_a_few_percent_rounds_back() {
        // Base 1.0; agent 0 moves element 0 by one bf16 step (2⁻⁷) and element 1 by 32 steps;
        // agent 1 changes element 2 only; element 3 is shared.
        let base = bf16(&[1.0, 1.0, 1.0, 1.0]);
        let a0 = bf16(&[1.0 + 1.0 / 128.0, 1.25, 1.0, 1.0 + 1.0 / 128.0]);
        let a1 = bf16(&[1.0, 1.0, 1.0 + 1.0 / 128.0, 1.0 + 1.0 / 64.0]);
        let lambdas = [1.03f32, 1.0];
        // What RAM+ writes: θ₀ + λτ for unique elements, the mean for the shared one.
        let merged = [
            1.0 + 1.03 * (1.0 / 128.0),
            1.0 + 1.03 * 0.25,
            1.0 + 1.0 / 128.0,
            1.0 + (1.0 / 128.0 + 1.0 / 64.0) / 2.0,
        ];
        let out = bf16(&merged);
        let tile = Tile {
            dtype: DType::BF16,
            len: 4,
            base: &base,
            agents: &[&a0, &a1],
        };
        let mut tally = BoostRounding::zeros(3);
        tally.tally(
            &tile,
            (&lambdas, 1e-5, &[0, 2]),
            (DType::BF16, &out),
            &mut RoundingScratch::default(),
        );
        // Agent 0's two unique elements are boosted: the one-step change rounds back, the
        // 32-step one moves (1.2575 rounds to 1.2578125, not 1.25). Agent 1 (λ = 1) is not counted.
        assert_eq!(tally.boosted, [2, 0, 0]);
        assert_eq!(tally.unmoved, [1, 0, 0]);
        assert_eq!(tally.unmoved_share(0), Some(0.5));
        let warned = tally.warnings(
            &["a".into(), "b".into(), "c".into()],
            &[Some(1.03), None, None],
            DType::BF16,
        );
        assert_eq!(warned.len(), 1);
        assert!(warned[0].contains("1 (50.0%)") && warned[0].contains("float32"));
        // The same merge written as f16 (the element-by-element path) rounds alike.
        let mut f16_out = vec![0; 8];
        encode(DType::F16, &merged, &mut f16_out);
        let mut f16 = BoostRounding::zeros(3);
        let how = (&lambdas[..], 1e-5, &[0, 2][..]);
        f16.tally(
            &tile,
            how,
            (DType::F16, &f16_out),
            &mut RoundingScratch::default(),
        );
        assert_eq!(f16, tally);
        assert!(BoostRounding::applies(&lambdas, DType::BF16));
        assert!(!BoostRounding::applies(&lambdas, DType::F32));
        assert!(!BoostRounding::applies(&[1.0, 1.0], DType::BF16));
    }
}
