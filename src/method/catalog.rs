//! Every method name rlmerge accepts (mergekit's names), with its parameters, defaults and
//! reference — the one list `rlmerge methods`, the recipe reader and the planner share.

pub use super::cost::{Cost, Footprint};
use super::defaults;
pub use super::param::{Compute, Param, ParamDefault, ParamScope, Range};
use serde::{Deserialize, Serialize};

/// Every merge method rlmerge knows, by its recipe name — also in the record, which names a
/// method as recipes and the command line do ([`Kind::name`], one source).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(into = "&'static str", try_from = "String")]
pub enum Kind {
    /// RAM: keep unique updates, average shared ones (SPEC §2).
    Ram,
    /// RAM+: RAM with unique updates boosted by λ_t (SPEC §3).
    RamPlus,
    /// RAM+ in tensor scope (the authors' `ramplus_tl`).
    RamplusTl,
    /// Weighted average of the models.
    Linear,
    /// θ₀ + Σ weighted task vectors.
    TaskArithmetic,
    /// TIES: trim, elect sign, disjoint mean.
    Ties,
    /// DARE: random drop and rescale, then task arithmetic.
    DareLinear,
    /// DARE with TIES sign consensus.
    DareTies,
    /// Breadcrumbs: drop the largest and smallest magnitudes, then task arithmetic.
    Breadcrumbs,
    /// Breadcrumbs with TIES sign consensus.
    BreadcrumbsTies,
    /// DELLA: drop by magnitude rank, with TIES sign consensus.
    Della,
    /// DELLA without sign consensus.
    DellaLinear,
    /// Model Stock: interpolation toward the base by the task vectors' angle.
    ModelStock,
    /// Spherical interpolation of two models.
    Slerp,
    /// Slerp of task vectors (mergekit's nuslerp).
    Nuslerp,
    /// Spherical weighted mean of several models.
    Multislerp,
    /// Karcher mean of the models on the sphere.
    Karcher,
    /// SCE: select by variance, calculate weights, erase minority signs.
    Sce,
    /// NearSwap: take the model where it is close to the base.
    Nearswap,
    /// One model's tensors as they are (with slices: layer stacking).
    Passthrough,
    /// Arcee Fusion: keep the elements whose change matters by row KL.
    ArceeFusion,
    /// Fisher-weighted averaging.
    Fisher,
    /// Iso-C: each matrix's summed task vectors with their singular values made equal.
    IsoC,
    /// TSV-M: each agent's top singular directions of each matrix, decorrelated and summed.
    Tsv,
    /// ResMerge: a spherical consensus of the agents' SVD residuals plus a gated head correction.
    ResMerge,
}

const fn p(
    name: &'static str,
    scope: ParamScope,
    default: ParamDefault,
    range: Range,
    about: &'static str,
) -> Param {
    Param {
        name,
        scope,
        default,
        range,
        about,
        compute: Compute::F32,
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

use ParamDefault::{Bool, Number, Required, Word};
use ParamScope::{MethodWide, PerModel};

const fn flag(name: &'static str, default: bool, about: &'static str) -> Param {
    p(name, MethodWide, Bool(default), BOOL, about)
}

const WEIGHT: Param = p(
    "weight",
    PerModel,
    Required,
    FINITE,
    "scale of the model's task vector",
);
const DENSITY: Param = p(
    "density",
    PerModel,
    Number(1.0),
    UNIT,
    "fraction of elements kept",
);
const LAMBDA: Param = p(
    "lambda",
    MethodWide,
    Number(1.0),
    FINITE,
    "scale of the merged task vector",
);
const INT8_MASK: Param = flag("int8_mask", false, "accepted; memory-only in mergekit");
/// RAM's ε (also `--epsilon` and `analyze`'s threshold, checked by `build::epsilon_value`).
pub const EPSILON: Param = p(
    "epsilon",
    MethodWide,
    Number(defaults::EPSILON),
    num(0.0, INF),
    "|τ| > ε counts as changed",
);
/// RAM+'s paper rule slope r: λ ≤ 1 + r·α.
const R: Param = p(
    "r",
    MethodWide,
    Number(defaults::R),
    num(0.0, 100.0),
    "paper rule slope",
);
const GAMMA: Param = p(
    "gamma",
    PerModel,
    Number(0.01),
    UNIT,
    "fraction of largest |τ| dropped",
);
const DELLA_EPS: Param = p(
    "epsilon",
    PerModel,
    Number(0.15),
    num(0.0, 1.0),
    "keep-probability spread (density ± ε within (0, 1))",
);

/// The parameters of the generalized task-arithmetic family, with the method's `normalize` and
/// `rescale` defaults.
const fn gta(normalize: bool, rescale: bool) -> [Param; 6] {
    [
        WEIGHT,
        DENSITY,
        flag(
            "normalize",
            normalize,
            "divide by the (agreeing) weights' sum",
        ),
        flag("rescale", rescale, "L1-rescale each sparsified τ"),
        LAMBDA,
        INT8_MASK,
    ]
}

/// [`gta`]'s parameters and one more.
const fn and(p: [Param; 6], extra: Param) -> [Param; 7] {
    [p[0], p[1], p[2], p[3], p[4], p[5], extra]
}

const TASK_ARITHMETIC: [Param; 6] = gta(false, false);
const TIES: [Param; 6] = gta(true, false);
const DARE: [Param; 6] = gta(false, true);
const BREADCRUMBS: [Param; 7] = and(gta(false, false), GAMMA);
const DELLA: [Param; 7] = and(gta(true, true), DELLA_EPS);
const DELLA_LINEAR: [Param; 7] = and(gta(false, true), DELLA_EPS);

/// RAM's rule for the shared region (SPEC §2b).
const SHARED: Param = p(
    "shared",
    MethodWide,
    Word("mean"),
    Range::Choice(&["mean", "consensus"]),
    "shared region: mean of the agents that changed it, or of those agreeing with Σ's sign",
);
const RAM: [Param; 2] = [EPSILON, SHARED];
const RAM_PLUS: [Param; 7] = [
    EPSILON,
    SHARED,
    p(
        "rule",
        MethodWide,
        Word("paper"),
        Range::Choice(&["paper", "official"]),
        "paper (1 + r·min(ρ, α)) or official (1 + (R − 1)·min(ρ, 1))",
    ),
    p(
        "scope",
        MethodWide,
        Word("global"),
        Range::Choice(&["global", "tensor", "layer", "module"]),
        "one λ per agent, or per agent and tensor / layer / module kind",
    ),
    R,
    p(
        "alpha",
        MethodWide,
        ParamDefault::ByScope {
            global: defaults::ALPHA_GLOBAL,
            tensor: defaults::ALPHA_TENSOR,
        },
        num(0.0, 1e6),
        "paper rule cap on ρ",
    ),
    p(
        "rescale_factor",
        MethodWide,
        Number(defaults::RESCALE_FACTOR),
        num(1.0, 100.0),
        "official rule R",
    ),
];
const RAMPLUS_TL: [Param; 4] = [
    EPSILON,
    SHARED,
    R,
    p(
        "alpha",
        MethodWide,
        Number(defaults::ALPHA_TENSOR),
        num(0.0, 1e6),
        "cap on ρ",
    ),
];
const LINEAR: [Param; 2] = [
    p("weight", PerModel, Required, FINITE, "the model's weight"),
    flag("normalize", true, "divide by Σ weight"),
];
const MODEL_STOCK: [Param; 1] = [flag(
    "filter_wise",
    false,
    "one t per row (along the last dimension) instead of per tensor",
)];
const SLERP: [Param; 1] = [p(
    "t",
    MethodWide,
    Required,
    UNIT,
    "0 = base, 1 = the other model",
)];
const NUSLERP: [Param; 3] = [
    WEIGHT,
    flag(
        "nuslerp_flatten",
        true,
        "one angle per tensor (false: per row, or per column with nuslerp_row_wise)",
    ),
    flag(
        "nuslerp_row_wise",
        false,
        "without flatten: one angle per column (dim 0) instead of per row",
    ),
];
const MULTISLERP: [Param; 3] = [
    WEIGHT,
    flag(
        "normalize_weights",
        true,
        "weights sum to 1 (their sum must not be 0)",
    ),
    p(
        "eps",
        MethodWide,
        Number(1e-8),
        num(0.0, INF),
        "accepted; rlmerge uses 1e-8",
    )
    .in_f64(),
];
const KARCHER: [Param; 2] = [
    p(
        "max_iter",
        MethodWide,
        Number(10.0),
        Range::Integer {
            lo: 0.0,
            hi: 10000.0,
        },
        "Karcher iterations",
    ),
    p(
        "tol",
        MethodWide,
        Number(1e-5),
        num(0.0, INF),
        "convergence tolerance",
    )
    .in_f64(),
];
const SCE: [Param; 2] = [
    p(
        "select_topk",
        MethodWide,
        Number(1.0),
        UNIT,
        "fraction kept by variance",
    ),
    INT8_MASK,
];
const NEARSWAP: [Param; 1] = [p(
    "t",
    MethodWide,
    Required,
    num(0.0, INF),
    "similarity threshold",
)];
const PASSTHROUGH: [Param; 1] = [p(
    "scale",
    PerModel,
    Number(1.0),
    FINITE,
    "multiplies the tensor",
)];
/// SVC's α when `--svc` or `svc:` gives none (the FusionBench default).
pub const SVC_DEFAULT: f64 = 0.1;

/// SVC (arXiv:2602.05536), the modifier every method takes (`--svc`, a recipe's `svc:`): its α.
/// A lower bound above 0 keeps every γ_r = T / Σ max(α, s) finite.
pub const SVC: Param = p(
    "svc",
    MethodWide,
    Number(SVC_DEFAULT),
    num(1e-6, INF),
    "SVC's α: each merged matrix's singular values times γ_r = T / Σ_t max(α, s_r^t) (SPEC §4e)",
)
.in_f64();
const RESMERGE: [Param; 4] = [
    p(
        "rank_topk",
        MethodWide,
        Number(1.0),
        Range::Integer {
            lo: 1.0,
            hi: 65536.0,
        },
        "K, the singular directions of each agent's head",
    ),
    p(
        "beta_min",
        MethodWide,
        Number(0.7),
        num(0.0, INF),
        "β where the residuals agree fully (c^β scales their norm)",
    )
    .in_f64(),
    p(
        "beta_max",
        MethodWide,
        Number(1.0),
        num(0.0, INF),
        "β where they do not (≥ beta_min)",
    )
    .in_f64(),
    p(
        "head_ratio_budget",
        MethodWide,
        Number(0.2),
        num(0.0, INF),
        "ρ: the head correction's norm, a share of the residual backbone's",
    )
    .in_f64(),
];
const ISO_C: [Param; 1] = [p(
    "scaling_factor",
    MethodWide,
    Number(1.0),
    num(0.0, INF),
    "α, multiplies the merged update",
)];
const FISHER: [Param; 2] = [
    p(
        "weight",
        PerModel,
        Number(1.0),
        num(0.0, INF),
        "λ, the model's weight",
    ),
    p(
        "fisher",
        PerModel,
        Required,
        Range::Folder,
        "folder of the model's diagonal Fisher (safetensors)",
    ),
];

impl From<Kind> for &'static str {
    fn from(kind: Kind) -> &'static str {
        kind.name()
    }
}

impl TryFrom<String> for Kind {
    type Error = String;

    fn try_from(name: String) -> Result<Kind, String> {
        Kind::from_record(&name).ok_or_else(|| format!("unknown method '{name}'"))
    }
}

impl Kind {
    /// Every method, in the order `rlmerge methods` lists them.
    pub const ALL: [Kind; 25] = [
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
        Kind::ArceeFusion,
        Kind::Fisher,
        Kind::IsoC,
        Kind::Tsv,
        Kind::ResMerge,
    ];

    /// The method's recipe name.
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
            Kind::ArceeFusion => "arcee_fusion",
            Kind::Fisher => "fisher",
            Kind::IsoC => "iso_c",
            Kind::Tsv => "tsv",
            Kind::ResMerge => "resmerge",
        }
    }

    /// The method of recipe name `name`, if any.
    pub fn from_name(name: &str) -> Option<Kind> {
        match name {
            "ramplus" | "ram_plus" => Some(Kind::RamPlus),
            _ => Kind::ALL.into_iter().find(|k| k.name() == name),
        }
    }

    /// What to add to "unknown method NAME": the name meant, or, for `svc` (a modifier, not a
    /// method), how to ask for it — `svc_how`, in the words of each front end.
    pub fn unknown_hint(name: &str, svc_how: crate::error::Arg) -> crate::error::Message {
        if name.trim().eq_ignore_ascii_case(SVC.name) {
            return crate::message![
                ": svc calibrates the result of any method rather than merging by itself — keep \
                 the method and add ",
                svc_how
            ];
        }
        crate::message![format!(
            "{}; `rlmerge methods` lists them",
            crate::error::did_you_mean(name, Kind::ALL.iter().map(|k| k.name()))
        )]
    }

    /// The method a record names: its name, or `res_merge`, which records of rlmerge 0.1 wrote
    /// for ResMerge.
    fn from_record(name: &str) -> Option<Kind> {
        match name {
            "res_merge" => Some(Kind::ResMerge),
            _ => Kind::from_name(name),
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

    /// What the method does, in a line.
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
            Kind::Slerp => "spherical interpolation of base and one model, per tensor",
            Kind::Nuslerp => "normalized slerp of two models or task vectors",
            Kind::Multislerp => "spherical weighted mean of several models",
            Kind::Karcher => "Riemannian (Karcher) mean on the sphere",
            Kind::Sce => "select by variance, calculate weights, erase minority signs",
            Kind::Nearswap => "take the model's value where it is near the base",
            Kind::Passthrough => "copies one model's tensors, optionally scaled",
            Kind::ArceeFusion => "keeps the model's changes whose importance |τ|·KL(softmax rows) clears the Tukey fence Q2 + 1.5·IQR",
            Kind::Fisher => "Σ λ_i F_i θ_i / Σ λ_i F_i with diagonal Fisher files",
            Kind::IsoC => "per matrix, Σ τ_t = U S Vᵀ becomes α·mean(S)·U Vᵀ (an isotropic spectrum); other tensors α·mean τ",
            Kind::ResMerge => "per attention/MLP matrix, τ = rank-K head + residual: the residuals' reliability-weighted direction on the sphere, plus the mean head scaled by the heads' agreement; other tensors the mean τ",
            Kind::Tsv => "per matrix, each agent's top 1/T singular directions, their U and V made orthogonal (polar factors), summed with their singular values; other tensors α·mean τ",
        }
    }

    /// Whether the method draws random masks (DARE, DELLA): its output depends on the seed.
    pub fn is_seeded(self) -> bool {
        matches!(
            self,
            Kind::DareLinear | Kind::DareTies | Kind::Della | Kind::DellaLinear
        )
    }

    /// Whether the method is Reinforced Agent Merging (`ram`, `ram+`, `ramplus_tl`): ε and the
    /// shared-region rule are its parameters.
    pub fn is_ram_family(self) -> bool {
        matches!(self, Kind::Ram | Kind::RamPlus | Kind::RamplusTl)
    }

    /// Whether mergekit has the method under this name (its recipes and `mergekit-yaml` take it).
    pub fn in_mergekit(self) -> bool {
        !matches!(
            self,
            Kind::RamPlus | Kind::Fisher | Kind::IsoC | Kind::Tsv | Kind::ResMerge
        )
    }

    /// What the method does, in a few words: the `rlmerge methods` table's line.
    pub fn summary(self) -> &'static str {
        match self {
            Kind::Ram => "unique changes kept whole, shared ones averaged",
            Kind::RamPlus => "RAM, each agent's unique changes boosted by λ_t",
            Kind::RamplusTl => "RAM+ with λ per tensor (mergekit's name)",
            Kind::Linear => "weighted average of the models",
            Kind::TaskArithmetic => "base + λ·Σ w·τ: the task vectors summed",
            Kind::Ties => "top-k of each τ, sign election, disjoint mean",
            Kind::DareLinear => "random drop and rescale, then task arithmetic",
            Kind::DareTies => "DARE drop and rescale, then TIES sign election",
            Kind::Breadcrumbs => "largest and smallest |τ| dropped, then summed",
            Kind::BreadcrumbsTies => "breadcrumbs with TIES sign election",
            Kind::Della => "drop by magnitude rank, TIES sign election",
            Kind::DellaLinear => "DELLA's drop without sign election",
            Kind::ModelStock => "base moved toward the mean by τ's angles",
            Kind::Slerp => "spherical interpolation of base and one model",
            Kind::Nuslerp => "slerp of two models or of their task vectors",
            Kind::Multislerp => "spherical weighted mean of several models",
            Kind::Karcher => "Karcher mean of the models on the sphere",
            Kind::Sce => "select by variance, weigh, erase minority signs",
            Kind::Nearswap => "the model's value where it is near the base",
            Kind::Passthrough => "one model's tensors as they are (layer stacks)",
            Kind::ArceeFusion => "keeps changes whose row-KL importance stands out",
            Kind::Fisher => "Fisher-weighted average (Fisher files given)",
            Kind::IsoC => "Σ τ of each matrix with a flat spectrum",
            Kind::Tsv => "agents' top singular directions, decorrelated",
            Kind::ResMerge => "SVD heads and residuals merged on the sphere",
        }
    }

    /// How much work the method does per byte it reads (what sets its time).
    pub fn cost(self) -> Cost {
        match self {
            Kind::Ram
            | Kind::Linear
            | Kind::TaskArithmetic
            | Kind::Nearswap
            | Kind::Passthrough
            | Kind::Fisher => Cost::Stream,
            Kind::IsoC | Kind::Tsv | Kind::ResMerge => Cost::Spectral,
            _ => Cost::Scan,
        }
    }

    /// What the method holds in memory besides the files' pages.
    pub fn footprint(self) -> Footprint {
        match self.cost() {
            Cost::Spectral => Footprint::Matrices,
            Cost::Stream | Cost::Scan => Footprint::Tiles,
        }
    }

    /// Where the method was published.
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
            Kind::ArceeFusion => "mergekit (Arcee AI)",
            Kind::Fisher => "arXiv:2111.09832",
            Kind::IsoC => "arXiv:2502.04959",
            Kind::Tsv => "arXiv:2412.00081",
            Kind::ResMerge => "arXiv:2606.02252",
        }
    }

    /// The method's parameters, in the order `rlmerge methods` lists them.
    pub fn params(self) -> &'static [Param] {
        match self {
            Kind::Ram => &RAM,
            Kind::RamPlus => &RAM_PLUS,
            Kind::RamplusTl => &RAMPLUS_TL,
            Kind::Linear => &LINEAR,
            Kind::TaskArithmetic => &TASK_ARITHMETIC,
            Kind::Ties => &TIES,
            Kind::DareLinear | Kind::DareTies => &DARE,
            Kind::Breadcrumbs | Kind::BreadcrumbsTies => &BREADCRUMBS,
            Kind::Della => &DELLA,
            Kind::DellaLinear => &DELLA_LINEAR,
            Kind::ModelStock => &MODEL_STOCK,
            Kind::Slerp => &SLERP,
            Kind::Nuslerp => &NUSLERP,
            Kind::Multislerp => &MULTISLERP,
            Kind::Karcher => &KARCHER,
            Kind::Sce => &SCE,
            Kind::Nearswap => &NEARSWAP,
            Kind::Passthrough => &PASSTHROUGH,
            Kind::ArceeFusion => &[],
            Kind::Fisher => &FISHER,
            Kind::IsoC | Kind::Tsv => &ISO_C,
            Kind::ResMerge => &RESMERGE,
        }
    }

    /// Parameter `name` of the method.
    pub fn param(self, name: &str) -> Option<&'static Param> {
        self.params().iter().find(|p| p.name == name)
    }
}
