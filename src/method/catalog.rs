//! Every method name rlmerge accepts (mergekit's names), with its parameters, defaults and
//! reference — the one list `rlmerge methods`, the recipe reader and the planner share.

use serde::{Deserialize, Serialize};

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
#[value(rename_all = "snake_case")]
pub enum Kind {
    #[value(name = "ram")]
    Ram,
    #[value(name = "ram+", alias = "ramplus", alias = "ram_plus")]
    #[serde(rename = "ram+")]
    RamPlus,
    RamplusTl,
    Linear,
    TaskArithmetic,
    Ties,
    DareLinear,
    DareTies,
    Breadcrumbs,
    BreadcrumbsTies,
    Della,
    DellaLinear,
    ModelStock,
    Slerp,
    Nuslerp,
    Multislerp,
    Karcher,
    Sce,
    Nearswap,
    Passthrough,
    Fisher,
}

/// Whether a parameter is set once or per model.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Scope {
    Shared,
    PerModel,
}

/// The values a parameter accepts; every value of a setting (a scalar, each point of a gradient,
/// each conditional value) must lie in it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Range {
    /// A finite number in [lo, hi] (an infinite bound: unbounded on that side).
    Number {
        lo: f64,
        hi: f64,
    },
    /// A whole number in [lo, hi].
    Integer {
        lo: f64,
        hi: f64,
    },
    Bool,
    /// One of these words.
    Choice(&'static [&'static str]),
    /// A local folder.
    Folder,
}

impl Range {
    /// What a value must be, as errors say it: "in [0, 1]", "≥ 0", "a finite number", "true or
    /// false", …
    pub fn requirement(self) -> String {
        match self {
            Range::Number { lo, hi } if !lo.is_finite() && !hi.is_finite() => {
                "a finite number".into()
            }
            Range::Number { lo, hi } if lo.is_finite() && hi.is_finite() => {
                format!("in {}", self.text())
            }
            Range::Number { .. } => self.text(),
            Range::Integer { .. } => {
                format!("a whole number in {}", &self.text()["whole ".len()..])
            }
            Range::Bool => "true or false".into(),
            Range::Choice(words) => format!("one of {}", words.join(", ")),
            Range::Folder => "a folder".into(),
        }
    }

    /// The range as `rlmerge methods` and errors write it.
    pub fn text(self) -> String {
        let num = |x: f64| -> String {
            if x.abs() >= 1e4 {
                format!("{x:e}")
            } else {
                format!("{x}")
            }
        };
        match self {
            Range::Number { lo, hi } | Range::Integer { lo, hi } => {
                let whole = if matches!(self, Range::Integer { .. }) {
                    "whole "
                } else {
                    ""
                };
                match (lo.is_finite(), hi.is_finite()) {
                    (true, true) => format!("{whole}[{}, {}]", num(lo), num(hi)),
                    (true, false) => format!("{whole}≥ {}", num(lo)),
                    (false, true) => format!("{whole}≤ {}", num(hi)),
                    (false, false) => "finite".to_string(),
                }
            }
            Range::Bool => "true/false".to_string(),
            Range::Choice(words) => words.join("/"),
            Range::Folder => "folder".to_string(),
        }
    }
}

pub struct Param {
    pub name: &'static str,
    pub scope: Scope,
    /// The default as text; "required" when there is none.
    pub default: &'static str,
    pub range: Range,
    pub about: &'static str,
}

const fn p(
    name: &'static str,
    scope: Scope,
    default: &'static str,
    range: Range,
    about: &'static str,
) -> Param {
    Param {
        name,
        scope,
        default,
        range,
        about,
    }
}

const fn num(lo: f64, hi: f64) -> Range {
    Range::Number { lo, hi }
}

const INF: f64 = f64::INFINITY;
/// Any finite number.
const FINITE: Range = num(-INF, INF);
/// A fraction.
const UNIT: Range = num(0.0, 1.0);
const BOOL: Range = Range::Bool;

use Scope::{PerModel, Shared};

const WEIGHT: Param = p(
    "weight",
    PerModel,
    "required",
    FINITE,
    "scale of the model's task vector",
);
const DENSITY: Param = p(
    "density",
    PerModel,
    "1.0",
    UNIT,
    "fraction of elements kept",
);
const LAMBDA: Param = p(
    "lambda",
    Shared,
    "1.0",
    FINITE,
    "scale of the merged task vector",
);
const INT8_MASK: Param = p(
    "int8_mask",
    Shared,
    "false",
    BOOL,
    "accepted; memory-only in mergekit",
);
const EPSILON: Param = p(
    "epsilon",
    Shared,
    "1e-5",
    num(0.0, INF),
    "|τ| > ε counts as changed",
);
/// RAM+'s paper rule slope r: λ ≤ 1 + r·α.
const R: Param = p("r", Shared, "0.1", num(0.0, 100.0), "paper rule slope");

impl Kind {
    pub const ALL: [Kind; 21] = [
        Kind::Ram,
        Kind::RamPlus,
        Kind::RamplusTl,
        Kind::Linear,
        Kind::TaskArithmetic,
        Kind::Ties,
        Kind::DareLinear,
        Kind::DareTies,
        Kind::Breadcrumbs,
        Kind::BreadcrumbsTies,
        Kind::Della,
        Kind::DellaLinear,
        Kind::ModelStock,
        Kind::Slerp,
        Kind::Nuslerp,
        Kind::Multislerp,
        Kind::Karcher,
        Kind::Sce,
        Kind::Nearswap,
        Kind::Passthrough,
        Kind::Fisher,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Kind::Ram => "ram",
            Kind::RamPlus => "ram+",
            Kind::RamplusTl => "ramplus_tl",
            Kind::Linear => "linear",
            Kind::TaskArithmetic => "task_arithmetic",
            Kind::Ties => "ties",
            Kind::DareLinear => "dare_linear",
            Kind::DareTies => "dare_ties",
            Kind::Breadcrumbs => "breadcrumbs",
            Kind::BreadcrumbsTies => "breadcrumbs_ties",
            Kind::Della => "della",
            Kind::DellaLinear => "della_linear",
            Kind::ModelStock => "model_stock",
            Kind::Slerp => "slerp",
            Kind::Nuslerp => "nuslerp",
            Kind::Multislerp => "multislerp",
            Kind::Karcher => "karcher",
            Kind::Sce => "sce",
            Kind::Nearswap => "nearswap",
            Kind::Passthrough => "passthrough",
            Kind::Fisher => "fisher",
        }
    }

    pub fn from_name(name: &str) -> Option<Kind> {
        match name {
            "ramplus" | "ram_plus" => Some(Kind::RamPlus),
            _ => Kind::ALL.into_iter().find(|k| k.name() == name),
        }
    }

    /// Whether the base model's tensors enter the formula as θ₀ (else it only gives names,
    /// shapes and the config files, and every listed model is merged).
    pub fn uses_base(self) -> bool {
        !matches!(
            self,
            Kind::Linear
                | Kind::Passthrough
                | Kind::Karcher
                | Kind::Nuslerp
                | Kind::Multislerp
                | Kind::Fisher
        )
    }

    /// Methods where θ₀ enters only when the recipe names a base_model.
    pub fn base_optional(self) -> bool {
        matches!(self, Kind::Nuslerp | Kind::Multislerp)
    }

    pub fn about(self) -> &'static str {
        match self {
            Kind::Ram => "Reinforced Agent Merging: shared changes averaged over the agents that made them, unique ones kept",
            Kind::RamPlus => "RAM+: unique changes boosted by λ_t from the overlap-unique ratio (rlmerge CLI flags)",
            Kind::RamplusTl => "mergekit's name for RAM+ with the paper rule in tensor scope",
            Kind::Linear => "weighted average of the models",
            Kind::TaskArithmetic => "base + λ Σ w_t τ_t",
            Kind::Ties => "magnitude top-k of each τ, sign consensus, mean over agreeing models",
            Kind::DareLinear => "random drop (Bernoulli keep = density) with L1 rescale, then task arithmetic",
            Kind::DareTies => "DARE drop and rescale, then TIES sign consensus",
            Kind::Breadcrumbs => "drop the largest γ and the smallest, keep density, then task arithmetic",
            Kind::BreadcrumbsTies => "breadcrumbs sparsification with TIES sign consensus",
            Kind::Della => "per-row rank-based drop probabilities with TIES consensus",
            Kind::DellaLinear => "DELLA drop without consensus",
            Kind::ModelStock => "interpolates the base toward the mean by the task vectors' mean cosine",
            Kind::Slerp => "spherical interpolation of base and one model, per output row",
            Kind::Nuslerp => "normalized slerp of two models or task vectors",
            Kind::Multislerp => "spherical weighted mean of several models",
            Kind::Karcher => "Riemannian (Karcher) mean on the sphere",
            Kind::Sce => "select by variance, calculate weights, erase minority signs",
            Kind::Nearswap => "take the model's value where it is near the base",
            Kind::Passthrough => "copies one model's tensors, optionally scaled",
            Kind::Fisher => "Σ λ_i F_i θ_i / Σ λ_i F_i with diagonal Fisher files",
        }
    }

    pub fn reference(self) -> &'static str {
        match self {
            Kind::Ram | Kind::RamPlus | Kind::RamplusTl => "arXiv:2601.13572",
            Kind::Linear => "arXiv:2203.05482",
            Kind::TaskArithmetic => "arXiv:2212.04089",
            Kind::Ties => "arXiv:2306.01708",
            Kind::DareLinear | Kind::DareTies => "arXiv:2311.03099",
            Kind::Breadcrumbs | Kind::BreadcrumbsTies => "arXiv:2312.06795",
            Kind::Della | Kind::DellaLinear => "arXiv:2406.11617",
            Kind::ModelStock => "arXiv:2403.19522",
            Kind::Slerp | Kind::Nuslerp | Kind::Multislerp => "Shoemake 1985 (slerp)",
            Kind::Karcher => "Karcher 1977",
            Kind::Sce => "arXiv:2408.07990",
            Kind::Nearswap => "mergekit (alchemonaut)",
            Kind::Passthrough => "mergekit",
            Kind::Fisher => "arXiv:2111.09832",
        }
    }

    pub fn params(self) -> Vec<Param> {
        let gta = |extra: &[Param], normalize: &'static str, rescale: &'static str| {
            let mut v = vec![
                WEIGHT,
                DENSITY,
                p(
                    "normalize",
                    Shared,
                    normalize,
                    BOOL,
                    "divide by the (agreeing) weights' sum",
                ),
                p(
                    "rescale",
                    Shared,
                    rescale,
                    BOOL,
                    "L1-rescale each sparsified τ",
                ),
                LAMBDA,
                INT8_MASK,
            ];
            v.extend(
                extra
                    .iter()
                    .map(|q| p(q.name, q.scope, q.default, q.range, q.about)),
            );
            v
        };
        const GAMMA: Param = p(
            "gamma",
            PerModel,
            "0.01",
            UNIT,
            "fraction of largest |τ| dropped",
        );
        const DELLA_EPS: Param = p(
            "epsilon",
            PerModel,
            "0.15",
            num(0.0, 1.0),
            "keep-probability spread (density ± ε within (0, 1))",
        );
        match self {
            Kind::Ram => vec![EPSILON],
            Kind::RamPlus => vec![
                EPSILON,
                p(
                    "rule",
                    Shared,
                    "paper",
                    Range::Choice(&["paper", "official"]),
                    "paper (1 + r·min(ρ, α)) or official (1 + (R − 1)·min(ρ, 1))",
                ),
                p(
                    "scope",
                    Shared,
                    "global",
                    Range::Choice(&["global", "tensor"]),
                    "one λ per agent, or per agent and tensor",
                ),
                R,
                p(
                    "alpha",
                    Shared,
                    "2.0 (0.2 tensor)",
                    num(0.0, 1e6),
                    "paper rule cap on ρ",
                ),
                p(
                    "rescale_factor",
                    Shared,
                    "1.2",
                    num(1.0, 100.0),
                    "official rule R",
                ),
            ],
            Kind::RamplusTl => vec![
                EPSILON,
                R,
                p("alpha", Shared, "0.2", num(0.0, 1e6), "cap on ρ"),
            ],
            Kind::Linear => vec![
                p("weight", PerModel, "required", FINITE, "the model's weight"),
                p("normalize", Shared, "true", BOOL, "divide by Σ weight"),
            ],
            Kind::TaskArithmetic => gta(&[], "false", "false"),
            Kind::Ties => gta(&[], "true", "false"),
            Kind::DareLinear => gta(&[], "false", "true"),
            Kind::DareTies => gta(&[], "false", "true"),
            Kind::Breadcrumbs => gta(&[GAMMA], "false", "false"),
            Kind::BreadcrumbsTies => gta(&[GAMMA], "false", "false"),
            Kind::Della => gta(&[DELLA_EPS], "true", "true"),
            Kind::DellaLinear => gta(&[DELLA_EPS], "false", "true"),
            Kind::ModelStock => vec![p(
                "filter_wise",
                Shared,
                "false",
                BOOL,
                "one angle per row (true: not yet)",
            )],
            Kind::Slerp => vec![p(
                "t",
                Shared,
                "required",
                UNIT,
                "0 = base, 1 = the other model",
            )],
            Kind::Nuslerp => vec![
                WEIGHT,
                p(
                    "nuslerp_flatten",
                    Shared,
                    "true",
                    BOOL,
                    "one angle per tensor (false: not yet)",
                ),
                p(
                    "nuslerp_row_wise",
                    Shared,
                    "false",
                    BOOL,
                    "angles per column (not yet)",
                ),
            ],
            Kind::Multislerp => vec![
                WEIGHT,
                p(
                    "normalize_weights",
                    Shared,
                    "true",
                    BOOL,
                    "weights sum to 1 (their sum must not be 0)",
                ),
                p(
                    "eps",
                    Shared,
                    "1e-8",
                    num(0.0, INF),
                    "accepted; rlmerge uses 1e-8",
                ),
            ],
            Kind::Karcher => vec![
                p(
                    "max_iter",
                    Shared,
                    "10",
                    Range::Integer {
                        lo: 0.0,
                        hi: 10000.0,
                    },
                    "Karcher iterations",
                ),
                p(
                    "tol",
                    Shared,
                    "1e-5",
                    num(0.0, INF),
                    "convergence tolerance",
                ),
            ],
            Kind::Sce => vec![
                p(
                    "select_topk",
                    Shared,
                    "1.0",
                    UNIT,
                    "fraction kept by variance",
                ),
                INT8_MASK,
            ],
            Kind::Nearswap => vec![p(
                "t",
                Shared,
                "required",
                num(0.0, INF),
                "similarity threshold",
            )],
            Kind::Passthrough => vec![p(
                "scale",
                PerModel,
                "none",
                FINITE,
                "multiplies the tensor",
            )],
            Kind::Fisher => vec![
                p(
                    "weight",
                    PerModel,
                    "1.0",
                    num(0.0, INF),
                    "λ, the model's weight",
                ),
                p(
                    "fisher",
                    PerModel,
                    "required",
                    Range::Folder,
                    "folder of the model's diagonal Fisher (safetensors)",
                ),
            ],
        }
    }
}
