//! The merge methods rlmerge implements, their parameters, and the scalar reference math
//! (SPEC §1–3). Backends run this math over tiles; nothing else defines it.

pub mod build;
pub mod catalog;
pub mod closed_form;
pub mod combine;
pub mod cost;
pub mod listing;
pub mod merging;
pub mod param;
pub mod settings;
pub mod statistics;
pub mod tensor_params;

pub use catalog::Kind;
pub use merging::Merging;
use serde::{Deserialize, Serialize};
use std::fmt;
pub use tensor_params::MethodConfig;

/// The probe threshold: an element is "changed" by an agent when |τ| > ε (SPEC §1).
pub const DEFAULT_EPSILON: f32 = defaults::EPSILON as f32;

/// How RAM+ turns the overlap-unique ratio ρ into the unique boost λ (SPEC §3).
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "rule", rename_all = "lowercase")]
pub enum BoostRule {
    /// λ = 1 + r · min(ρ, α): the paper's formula.
    Paper {
        /// The boost per unit of ρ.
        r: f64,
        /// The cap on ρ.
        alpha: f64,
    },
    /// λ = 1 + (R − 1) · min(ρ, 1), R clamped ≥ 1: the authors' released script.
    Official {
        /// R, the largest λ.
        rescale_factor: f64,
    },
}

/// Over what ρ is counted (SPEC §3): the whole model (one λ per agent), each tensor, each layer
/// (tensors outside the layers grouped by module kind) or each module kind across the layers.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum BoostScope {
    /// One λ per agent for the whole model (the paper).
    Global,
    /// One λ per agent and tensor.
    Tensor,
    /// One λ per agent and decoder layer.
    Layer,
    /// One λ per agent and module kind (q_proj, mlp …).
    Module,
}

impl BoostScope {
    /// The name recipes and flags use.
    pub fn name(self) -> &'static str {
        match self {
            BoostScope::Global => "global",
            BoostScope::Tensor => "tensor",
            BoostScope::Layer => "layer",
            BoostScope::Module => "module",
        }
    }

    /// Every scope.
    pub const ALL: [BoostScope; 4] = [
        BoostScope::Global,
        BoostScope::Tensor,
        BoostScope::Layer,
        BoostScope::Module,
    ];

    /// The scope called `name`, if any.
    pub fn from_name(name: &str) -> Option<BoostScope> {
        BoostScope::ALL.into_iter().find(|s| s.name() == name)
    }

    /// Whether λ comes from counts over several tensors, so the whole model is probed before
    /// the first merged byte (two passes over the inputs).
    pub fn needs_global_probe(self) -> bool {
        self != BoostScope::Tensor
    }
}

/// How RAM merges the shared region (elements two or more agents changed; SPEC §2b).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum SharedRule {
    /// The mean of the agents that changed the element (the paper).
    #[default]
    Mean,
    /// TIES-style: the mean of those agents whose change has the sign of the changes' sum.
    Consensus,
}

impl SharedRule {
    /// The name recipes and flags use.
    pub fn name(self) -> &'static str {
        match self {
            SharedRule::Mean => "mean",
            SharedRule::Consensus => "consensus",
        }
    }

    /// The rule called `name`, if any.
    pub fn from_name(name: &str) -> Option<SharedRule> {
        [SharedRule::Mean, SharedRule::Consensus]
            .into_iter()
            .find(|s| s.name() == name)
    }
}

/// A merge method: the RAM family, or a mergekit-family method run by the generalized
/// task-arithmetic core ([`combine`]).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "method")]
pub enum Method {
    /// Reinforced Agent Merging: unique updates kept as they are (λ = 1).
    #[serde(rename = "ram")]
    Ram {
        /// Records written before the shared rule existed have none: the mean.
        #[serde(default)]
        shared: SharedRule,
    },
    /// RAM+: unique updates boosted by λ_t from the overlap-unique ratio.
    #[serde(rename = "ram+")]
    RamPlus {
        /// The λ formula.
        rule: BoostRule,
        /// What one λ covers: the model, a tensor, a layer or a module kind.
        scope: BoostScope,
        /// How the shared region merges (SPEC §2b).
        #[serde(default)]
        shared: SharedRule,
    },
    /// linear, task_arithmetic, ties, dare_*, breadcrumbs*, model_stock, slerp, passthrough.
    #[serde(rename = "combine")]
    Combine(MethodConfig),
}

impl Method {
    /// The method's recipe name.
    pub fn name(&self) -> &'static str {
        self.kind().name()
    }

    /// The catalog entry of the method (RAM+ in tensor scope is `ram+` here, as [`Self::name`]).
    pub fn kind(&self) -> Kind {
        match self {
            Method::Ram { .. } => Kind::Ram,
            Method::RamPlus { .. } => Kind::RamPlus,
            Method::Combine(c) => c.kind,
        }
    }

    /// The seed of the method's random masks, for a method that draws them ([`Kind::is_seeded`]).
    pub fn seed(&self) -> Option<u64> {
        match self {
            Method::Combine(c) if c.kind.is_seeded() => Some(c.seed),
            _ => None,
        }
    }

    /// Whether θ₀ enters the merge (task vectors against it), so it must not be an agent too:
    /// a method with a base in its formula, or one where it is optional and given (linear,
    /// passthrough, karcher… merge the models, the base giving only the layout).
    pub fn uses_base(&self) -> bool {
        match self {
            Method::Combine(c) => c.with_base && (c.kind.uses_base() || c.kind.base_optional()),
            _ => true,
        }
    }

    /// True when λ needs the probe of the whole model before the first merged byte (two passes).
    pub fn needs_global_probe(&self) -> bool {
        matches!(self, Method::RamPlus { scope, .. } if scope.needs_global_probe())
    }

    /// RAM+'s scope, if the method boosts.
    pub fn scope(&self) -> Option<BoostScope> {
        match self {
            Method::RamPlus { scope, .. } => Some(*scope),
            _ => None,
        }
    }

    /// RAM+ as the command line runs it by default: the paper rule with its default r and α, one
    /// λ per agent (global scope).
    pub fn default_ram_plus() -> Method {
        Method::RamPlus {
            rule: BoostRule::Paper {
                r: defaults::R,
                alpha: defaults::ALPHA_GLOBAL,
            },
            scope: BoostScope::Global,
            shared: SharedRule::Mean,
        }
    }

    /// The RAM family's rule for the shared region (the mean for the other methods' purposes).
    pub fn shared(&self) -> SharedRule {
        match self {
            Method::Ram { shared } | Method::RamPlus { shared, .. } => *shared,
            Method::Combine(_) => SharedRule::Mean,
        }
    }

    /// The boost rule, if the method boosts.
    pub fn boost(&self) -> Option<BoostRule> {
        match self {
            Method::RamPlus { rule, .. } => Some(*rule),
            _ => None,
        }
    }

    /// λ_t for an agent with these counts (1 for `ram`).
    pub fn lambda(&self, counts: AgentCounts) -> f64 {
        self.boost().map_or(1.0, |rule| rule.lambda(counts))
    }
}

impl fmt::Display for Method {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // The default shared rule goes unsaid, so a mean merge reads as it always has.
        let shared = match self.shared() {
            SharedRule::Mean => "",
            SharedRule::Consensus => ", shared consensus",
        };
        match self {
            Method::Ram {
                shared: SharedRule::Mean,
            } => f.write_str("ram"),
            Method::Ram { .. } => f.write_str("ram (shared consensus)"),
            Method::Combine(c) => f.write_str(c.kind.name()),
            Method::RamPlus { rule, scope, .. } => {
                let scope = scope.name();
                match rule {
                    BoostRule::Paper { r, alpha } => write!(
                        f,
                        "ram+ (rule paper, r = {r}, α = {alpha}, scope {scope}{shared})"
                    ),
                    BoostRule::Official { rescale_factor } => write!(
                        f,
                        "ram+ (rule official, R = {rescale_factor}, scope {scope}{shared})"
                    ),
                }
            }
        }
    }
}

/// The defaults of SPEC §3.
/// RAM and RAM+ defaults (the catalog prints them; `build` applies them).
pub mod defaults {
    /// RAM's ε: an element is changed when |τ| > ε.
    pub const EPSILON: f64 = 1e-5;
    /// The paper rule's r.
    pub const R: f64 = 0.1;
    /// The paper rule's cap α on ρ in global scope.
    pub const ALPHA_GLOBAL: f64 = 2.0;
    /// The paper rule's cap α on ρ in tensor scope.
    pub const ALPHA_TENSOR: f64 = 0.2;
    /// The official rule's R.
    pub const RESCALE_FACTOR: f64 = 1.2;
}

/// One agent's unique and shared element counts, over whatever scope they were summed.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct AgentCounts {
    /// |U_t|: changed by this agent alone.
    pub unique: u64,
    /// |S_t|: changed by this agent and at least one other.
    pub shared: u64,
}

impl AgentCounts {
    /// ρ_t = |S_t| / |U_t|: 0 for an agent that changed nothing, +∞ when every change is shared.
    pub fn overlap_ratio(&self) -> f64 {
        match (self.shared, self.unique) {
            (0, _) => 0.0,
            (_, 0) => f64::INFINITY,
            (s, u) => s as f64 / u as f64,
        }
    }
}

impl BoostRule {
    /// λ_t from the agent's counts. `min(∞, cap)` is the cap, so "all shared" is well defined.
    pub fn lambda(&self, counts: AgentCounts) -> f64 {
        let rho = counts.overlap_ratio();
        match *self {
            BoostRule::Paper { r, alpha } => 1.0 + r * rho.min(alpha),
            BoostRule::Official { rescale_factor } => {
                1.0 + (rescale_factor.max(1.0) - 1.0) * rho.min(1.0)
            }
        }
    }
}

/// The correctly rounded f32 quotient `sum / c` (round to nearest even, subnormal results
/// included; ±0, ±Inf and NaN pass through) for a count 1 ≤ c ≤ 64, from integer arithmetic
/// alone: SPEC §2's shared mean. The CPU backend divides in hardware (IEEE division is correctly
/// rounded); `shaders/merge.wgsl` runs this algorithm step for step, since WGSL's `/` is not
/// correctly rounded. Tests check it against IEEE division.
pub fn div_by_count(sum: f32, c: u32) -> f32 {
    debug_assert!((1..=64).contains(&c));
    let bits = sum.to_bits();
    let (sign, abs) = (bits & 0x8000_0000, bits & 0x7fff_ffff);
    if abs >= 0x7f80_0000 || abs == 0 || c == 1 {
        return sum;
    }
    // |sum| = ma · 2^(ea − 150), ma with its leading bit at 23 (subnormals normalized).
    let (mut ea, mut ma) = ((abs >> 23) as i32, abs & 0x7f_ffff);
    if ea == 0 {
        let shift = 23 - (31 - ma.leading_zeros()) as i32;
        ma <<= shift;
        ea = 1 - shift;
    } else {
        ma |= 0x80_0000;
    }
    // n / c with n = ma · 2^8 < 2^32: q ≥ 2^25, so at least two bits below the 24 kept.
    let n = ma << 8;
    let (q, r) = (n / c, n % c);
    let len = 32 - q.leading_zeros() as i32;
    let mut shift = len - 24;
    let mut biased = ea - 32 + len;
    if biased < 1 {
        // Subnormal: fewer bits are kept, the exponent field is 0.
        shift += 1 - biased;
        biased = 1;
    }
    if shift >= 32 {
        return f32::from_bits(sign);
    }
    let m = q >> shift;
    let guard = (q >> (shift - 1)) & 1;
    let sticky = (q & ((1u32 << (shift - 1)) - 1)) != 0 || r != 0;
    let m = m + (guard == 1 && (sticky || m & 1 == 1)) as u32;
    // (biased − 1) · 2^23 + m: a carry out of the mantissa moves into the exponent by itself.
    f32::from_bits(sign | ((((biased - 1) as u32) << 23) + m))
}

/// Most agents one merge takes (masks are u64 bit sets).
pub const MAX_AGENTS: usize = 64;

#[cfg(test)]
mod tests {
    use super::*;

    fn counts(unique: u64, shared: u64) -> AgentCounts {
        AgentCounts { unique, shared }
    }

    /// The record names every method as recipes and the command line do, and reads it back
    /// (issue #42: serde's own spelling made ResMerge `res_merge`, which records of 0.1 hold).
    #[test]
    fn records_name_methods_by_their_recipe_names() {
        for kind in Kind::ALL {
            let json = serde_json::to_value(kind).unwrap();
            assert_eq!(json, kind.name(), "{kind:?}");
            assert_eq!(serde_json::from_value::<Kind>(json).unwrap(), kind);
        }
        let old: Kind = serde_json::from_value("res_merge".into()).unwrap();
        assert_eq!(old, Kind::ResMerge);
        assert!(serde_json::from_value::<Kind>("no_such".into()).is_err());
    }

    #[test]
    fn div_by_count_is_ieee_division() {
        let mut rng = crate::hash::SplitMix64::new(21);
        let mut values: Vec<f32> = vec![
            0.0,
            -0.0,
            f32::MIN_POSITIVE,
            f32::from_bits(1),
            f32::from_bits(3),
            f32::from_bits(0x007f_ffff),
            f32::MAX,
            -f32::MAX,
            1.0,
            3.0,
            0.03,
        ];
        for _ in 0..20_000 {
            let b = rng.next_u64() as u32;
            // Every exponent, subnormals and tiny normals weighted in.
            values.push(f32::from_bits(b & 0xbfff_ffff));
            values.push(f32::from_bits(b & 0x81ff_ffff));
            values.push(f32::from_bits(b));
        }
        for &v in values.iter().filter(|v| v.is_finite()) {
            for c in 1..=64u32 {
                let want = v / c as f32;
                assert_eq!(
                    div_by_count(v, c).to_bits(),
                    want.to_bits(),
                    "{v:e} ({:#x}) / {c}",
                    v.to_bits()
                );
            }
        }
        assert_eq!(div_by_count(f32::INFINITY, 3), f32::INFINITY);
        assert!(div_by_count(f32::NAN, 3).is_nan());
    }

    #[test]
    fn paper_rule_matches_hand_values() {
        let rule = BoostRule::Paper { r: 0.1, alpha: 2.0 };
        // ρ = 50/100 = 0.5 → λ = 1.05
        assert!((rule.lambda(counts(100, 50)) - 1.05).abs() < 1e-12);
        // ρ = 300/100 = 3 → capped at α = 2 → 1.2
        assert!((rule.lambda(counts(100, 300)) - 1.2).abs() < 1e-12);
    }

    #[test]
    fn official_rule_caps_rho_at_one_and_clamps_r() {
        let rule = BoostRule::Official {
            rescale_factor: 1.2,
        };
        assert!((rule.lambda(counts(100, 50)) - 1.1).abs() < 1e-12);
        assert!((rule.lambda(counts(100, 500)) - 1.2).abs() < 1e-12);
        let low = BoostRule::Official {
            rescale_factor: 0.5,
        };
        assert_eq!(low.lambda(counts(100, 500)), 1.0);
    }

    #[test]
    fn edge_cases_of_spec_section_3() {
        let paper = BoostRule::Paper { r: 0.1, alpha: 2.0 };
        let official = BoostRule::Official {
            rescale_factor: 1.2,
        };
        // No changed element: ρ = 0, λ = 1.
        assert_eq!(counts(0, 0).overlap_ratio(), 0.0);
        assert_eq!(paper.lambda(counts(0, 0)), 1.0);
        assert_eq!(official.lambda(counts(0, 0)), 1.0);
        // All shared: ρ = ∞, λ takes the cap.
        assert_eq!(counts(0, 7).overlap_ratio(), f64::INFINITY);
        assert!((paper.lambda(counts(0, 7)) - 1.2).abs() < 1e-12);
        assert!((official.lambda(counts(0, 7)) - 1.2).abs() < 1e-12);
        // Only unique: ρ = 0.
        assert_eq!(paper.lambda(counts(9, 0)), 1.0);
    }
}
