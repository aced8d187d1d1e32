//! From a mergekit-family method and its settings to one tensor's parameters: what each agent's
//! sparsifier keeps, the weights, consensus and normalization, and which statistics the scans
//! must gather before [`super::combine::CombineSpec`] can be built.

use super::catalog::{Kind, ParamDefault};
use super::settings::{Scalar, Settings, TensorPlace};
use anyhow::{bail, Result};
use serde::{Deserialize, Serialize};

/// A mergekit-family method with its settings as the recipe gave them.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct MethodConfig {
    /// The method.
    pub kind: Kind,
    /// Method-wide `parameters:`.
    #[serde(default)]
    pub parameters: Settings,
    /// Each merged model's own `parameters:`, in agent order.
    #[serde(default)]
    pub models: Vec<Settings>,
    /// Seed of the random masks (DARE).
    pub seed: u64,
    /// Whether θ₀ enters the formula (methods where the base is optional: nuslerp, multislerp).
    #[serde(default = "yes")]
    pub with_base: bool,
    /// Each slice's own parameters, when a recipe's `slices` set them.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub slices: Vec<SliceSettings>,
}

/// One slice's parameters (mergekit: a slice source's own first, then the slice's, then the
/// method-wide ones).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct SliceSettings {
    /// Each model's `parameters:`, in order.
    #[serde(default)]
    pub parameters: Settings,
    /// Per agent, as its source in the slice sets them (empty: none, or not a source).
    #[serde(default)]
    pub models: Vec<Settings>,
}

fn yes() -> bool {
    true
}

/// What one agent's sparsifier keeps, in ranks by |τ| descending (ties by lower index).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Sparsify {
    /// Keep every element.
    All,
    /// Ranks in `[lo, hi)`; ties at a cut go to the lower index first, or to the higher with
    /// `high_first`.
    Ranks {
        /// Dropped below this rank (0: none).
        lo: u64,
        /// Kept below this rank.
        hi: u64,
        /// Ties at a cut: the higher index first.
        high_first: bool,
    },
    /// Keep each element with probability `density` (DARE).
    Random {
        /// The probability of keeping an element.
        density: f64,
    },
    /// DELLA's magnitude-ranked drop: keep probability from density − ε (smallest |τ| of its
    /// row) to density + ε (largest).
    RowRank {
        /// The mean probability of keeping an element.
        density: f64,
        /// Spread of the probabilities over the ranks.
        epsilon: f64,
    },
    /// arcee_fusion: keep where |τ|·KL(row) reaches the Tukey fence of those importances.
    Fusion,
}

/// Which vectors of a tensor a per-vector statistic (a cosine, a norm) runs over — mergekit's
/// `dim` choices.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Vectors {
    /// The whole tensor, flattened: one vector.
    Whole,
    /// Along the last dimension: consecutive rows of `shape[-1]` elements (a 1-D tensor is one).
    Rows,
    /// Along the first dimension: element i belongs to vector i mod (numel / shape[0]) — a
    /// matrix's columns (a 1-D tensor is one).
    Columns,
}

/// How the base enters the result.
#[derive(Clone, Debug, PartialEq)]
pub enum BaseTerm {
    /// θ₀ + Δ (task vectors).
    Add,
    /// Δ alone (θ_t absolute, e.g. linear).
    None,
    /// Model Stock: t from the task vectors' mean pairwise cosine, over the whole tensor or per
    /// row (`filter_wise`).
    ModelStock {
        /// Whole tensor or per row.
        vectors: Vectors,
    },
    /// Slerp of the whole tensor from θ₀ toward the one agent by `t`.
    Slerp {
        /// The interpolation factor, 0 (θ₀) to 1 (the agent).
        t: f64,
    },
    /// Slerp between the two models' vectors (task vectors with a base): whole tensors
    /// (`nuslerp_flatten`, the default), rows, or columns (`nuslerp_row_wise`).
    Nuslerp {
        /// The interpolation factor between the two.
        t: f64,
        /// Whole tensors, rows or columns.
        vectors: Vectors,
    },
    /// Spherical weighted mean of the vectors, scaled by their weighted mean norm.
    Multislerp {
        /// Each vector's weight.
        weights: Vec<f64>,
    },
    /// Karcher mean of the unit vectors on the sphere, scaled by the mean norm.
    Karcher {
        /// Most iterations.
        max_iter: usize,
        /// Stop once a step moves less than this.
        tol: f64,
    },
    /// NearSwap toward the one model where it is within about `t` of the base.
    Nearswap {
        /// The closeness scale.
        t: f64,
    },
    /// SCE: θ₀ + the consensus mean of the task vectors on the `density` highest-variance
    /// elements, weighted by each vector's mean square there.
    Sce {
        /// Fraction of elements kept by variance.
        density: f64,
    },
    /// Fisher merging: Σ λ_t F_t θ_t / Σ λ_t F_t, coefficients per element from the Fisher files.
    Fisher,
}

impl BaseTerm {
    /// The Gram matrix these coefficients need: of the task vectors (`Some(true)`), of the
    /// models (`Some(false)`), or none — one per vector of [`Self::vectors`].
    pub fn gram_of(&self, delta: bool) -> Option<bool> {
        match self {
            BaseTerm::ModelStock { .. } => Some(true),
            BaseTerm::Nuslerp { .. } | BaseTerm::Multislerp { .. } | BaseTerm::Karcher { .. } => {
                Some(delta)
            }
            _ => None,
        }
    }

    /// The vectors the Gram matrices run over.
    pub fn vectors(&self) -> Vectors {
        match *self {
            BaseTerm::ModelStock { vectors } | BaseTerm::Nuslerp { vectors, .. } => vectors,
            _ => Vectors::Whole,
        }
    }
}

/// One tensor's method parameters, resolved, before statistics.
#[derive(Clone, Debug, PartialEq)]
pub struct TensorParams {
    /// v_t = θ_t − θ₀ (and out = θ₀ + …) when true; v_t = θ_t when false.
    pub delta: bool,
    /// Each agent's weight.
    pub weights: Vec<f64>,
    /// Each agent's sparsifier.
    pub sparsify: Vec<Sparsify>,
    /// L1-rescale each sparsified vector.
    pub rescale: bool,
    /// TIES sign consensus.
    pub consensus: bool,
    /// Divide by the (agreeing) weights' sum.
    pub normalize: bool,
    /// Multiplies Δ.
    pub lambda: f64,
    /// What Δ is added to, and how.
    pub base: BaseTerm,
}

impl TensorParams {
    /// Every model whole with weight 1; the base term's statistics set the coefficients.
    fn interpolation(models: usize, delta: bool, base: BaseTerm) -> TensorParams {
        TensorParams {
            delta,
            weights: vec![1.0; models],
            sparsify: vec![Sparsify::All; models],
            rescale: false,
            consensus: false,
            normalize: false,
            lambda: 1.0,
            base,
        }
    }
}

/// The tensor-wise settings lookup: the model's setting (in the tensor's slice, then the
/// recipe's models), then the slice's, then method-wide, then the catalog's default
/// ([`super::catalog::ParamDefault`], the one source of defaults).
struct Lookup<'a> {
    config: &'a MethodConfig,
    at: TensorPlace<'a>,
}

impl Lookup<'_> {
    fn find(&self, name: &str, model: Option<usize>) -> Option<Scalar> {
        let slice = self.at.slice.and_then(|s| self.config.slices.get(s));
        let in_settings = |s: Option<&Settings>| s?.get(name)?.resolve(self.at);
        model
            .and_then(|m| in_settings(slice.and_then(|s| s.models.get(m))))
            .or_else(|| model.and_then(|m| in_settings(self.config.models.get(m))))
            .or_else(|| in_settings(slice.map(|s| &s.parameters)))
            .or_else(|| in_settings(Some(&self.config.parameters)))
    }

    fn default(&self, name: &str) -> ParamDefault {
        self.config
            .kind
            .param(name)
            .map_or(ParamDefault::Required, |p| p.default)
    }

    /// A number for `model` (`None`: a shared parameter).
    fn number(&self, name: &str, model: Option<usize>) -> Result<f64> {
        let value = match (self.find(name, model), self.default(name)) {
            (Some(v), _) => v.as_f64(name)?,
            (None, ParamDefault::Number(d)) => d,
            (None, _) => match model {
                // The caller names the tensor.
                Some(m) => bail!(
                    "method {} needs parameter '{name}' for model {}",
                    self.config.kind.name(),
                    m + 1
                ),
                None => bail!(
                    "method {} needs parameter '{name}'",
                    self.config.kind.name()
                ),
            },
        };
        if !value.is_finite() {
            bail!("parameter '{name}' must be finite, got {value}");
        }
        Ok(value)
    }

    /// A number for each of the `present` models.
    fn per_model(&self, name: &str, present: &[usize]) -> Result<Vec<f64>> {
        present
            .iter()
            .map(|&m| self.number(name, Some(m)))
            .collect()
    }

    fn flag(&self, name: &str) -> Result<bool> {
        match (self.find(name, None), self.default(name)) {
            (Some(v), _) => v.as_bool(name),
            (None, ParamDefault::Bool(b)) => Ok(b),
            (None, d) => bail!("internal: parameter '{name}' has no true/false default ({d:?})"),
        }
    }
}

/// Ranks of `magnitude` (TIES): the top k = max(1, ⌊density·n⌋).
fn top_k(density: f64, n: u64) -> Sparsify {
    if density >= 1.0 {
        Sparsify::All
    } else if density <= 0.0 || n == 0 {
        Sparsify::Ranks {
            lo: 0,
            hi: 0,
            high_first: false,
        }
    } else {
        let k = ((density * n as f64) as u64).max(1);
        Sparsify::Ranks {
            lo: 0,
            hi: k,
            high_first: false,
        }
    }
}

/// Ranks of `magnitude_outliers` (breadcrumbs): drop ⌊γ·n⌋ largest, keep ⌊density·n⌋ below them;
/// when too few remain below, the outlier drop shrinks. mergekit ranks these by an ascending sort,
/// so among equal magnitudes the higher index ranks higher (as a stable sort would order them).
fn breadcrumbs(density: f64, gamma: f64, n: u64) -> Sparsify {
    if density >= 1.0 {
        return Sparsify::All;
    }
    let target = (density.max(0.0) * n as f64) as u64;
    let top = (gamma.max(0.0) * n as f64) as u64;
    let bottom = n.saturating_sub(target + top);
    let lo = n - bottom - target.min(n - bottom);
    Sparsify::Ranks {
        lo,
        hi: lo + target.min(n - bottom),
        high_first: true,
    }
}

/// θ₀ + λ Σ w_t · sparsify(τ_t): the task-arithmetic core the sparsifying methods share, with
/// the method's `normalize` and `rescale` (the catalog's defaults) and sign consensus or not.
fn task_arithmetic(
    l: &Lookup,
    present: &[usize],
    sparsify: Vec<Sparsify>,
    consensus: bool,
) -> Result<TensorParams> {
    Ok(TensorParams {
        delta: true,
        weights: l.per_model("weight", present)?,
        sparsify,
        rescale: l.flag("rescale")?,
        consensus,
        normalize: l.flag("normalize")?,
        lambda: l.number("lambda", None)?,
        base: BaseTerm::Add,
    })
}

/// task_arithmetic (keep all), ties (top-k by magnitude) and breadcrumbs (a band of ranks).
fn magnitude_family(l: &Lookup, numel: u64, present: &[usize]) -> Result<TensorParams> {
    let kind = l.config.kind;
    let d = l.per_model("density", present)?;
    let sparsify: Vec<Sparsify> = match kind {
        Kind::TaskArithmetic => vec![Sparsify::All; present.len()],
        Kind::Ties => d.iter().map(|&d| top_k(d, numel)).collect(),
        _ => {
            let g = l.per_model("gamma", present)?;
            d.iter()
                .zip(&g)
                .map(|(&d, &g)| breadcrumbs(d, g, numel))
                .collect()
        }
    };
    let consensus = matches!(kind, Kind::Ties | Kind::BreadcrumbsTies);
    task_arithmetic(l, present, sparsify, consensus)
}

/// DELLA: keep probabilities from density − ε to density + ε by magnitude rank in each row.
fn della(l: &Lookup, present: &[usize]) -> Result<TensorParams> {
    let eps = l.per_model("epsilon", present)?;
    let sparsify = l
        .per_model("density", present)?
        .into_iter()
        .zip(eps)
        .map(|(density, epsilon)| {
            if density >= 1.0 {
                Ok(Sparsify::All)
            } else if density <= 0.0 {
                Ok(Sparsify::Ranks {
                    lo: 0,
                    hi: 0,
                    high_first: false,
                })
            } else if density + epsilon >= 1.0 || density - epsilon <= 0.0 {
                bail!("della: epsilon must keep density ± epsilon within (0, 1), got density {density}, epsilon {epsilon}")
            } else {
                Ok(Sparsify::RowRank { density, epsilon })
            }
        })
        .collect::<Result<Vec<_>>>()?;
    task_arithmetic(l, present, sparsify, l.config.kind == Kind::Della)
}

/// nuslerp (two models, t from their weights) and multislerp (weights, normalized by default),
/// of the task vectors when a base is named.
fn spherical(l: &Lookup, present: &[usize], with_base: bool) -> Result<TensorParams> {
    let mut weights = l.per_model("weight", present)?;
    if l.config.kind == Kind::Multislerp {
        if l.flag("normalize_weights")? {
            let sum: f64 = weights.iter().sum();
            weights.iter_mut().for_each(|w| *w /= sum);
        }
        let base = BaseTerm::Multislerp { weights };
        return Ok(TensorParams::interpolation(present.len(), with_base, base));
    }
    // mergekit: flatten wins; else dim 0 (row_wise: the vectors run down the first dimension,
    // so there is one per column) or dim −1 (one per row).
    let vectors = match (l.flag("nuslerp_flatten")?, l.flag("nuslerp_row_wise")?) {
        (true, _) => Vectors::Whole,
        (false, true) => Vectors::Columns,
        (false, false) => Vectors::Rows,
    };
    if present.len() != 2 {
        bail!("nuslerp takes exactly two models, got {}", present.len());
    }
    let total = weights[0] + weights[1];
    let t = if total.abs() < 1e-6 {
        0.5
    } else {
        weights[1] / total
    };
    Ok(TensorParams::interpolation(
        2,
        with_base,
        BaseTerm::Nuslerp { t, vectors },
    ))
}

/// θ₀ + λ·(1/T)·Σ τ_t over the `n` present agents.
fn mean_tau(n: usize, lambda: f64) -> TensorParams {
    TensorParams {
        weights: vec![1.0 / n as f64; n],
        lambda,
        ..TensorParams::interpolation(n, true, BaseTerm::Add)
    }
}

impl MethodConfig {
    /// Method-wide parameter `name` as a number where tensor `at` is (its default when not set;
    /// a gradient resolved at the tensor's layer).
    pub fn method_number(&self, at: TensorPlace, name: &str) -> Result<f64> {
        Lookup { config: self, at }.number(name, None)
    }

    /// The parameters of tensor `at` with `numel` elements merged from the `present` agents.
    pub fn tensor_params(
        &self,
        at: TensorPlace,
        numel: u64,
        present: &[usize],
    ) -> Result<TensorParams> {
        let l = Lookup { config: self, at };
        let n = present.len();
        Ok(match self.kind {
            Kind::TaskArithmetic | Kind::Ties | Kind::Breadcrumbs | Kind::BreadcrumbsTies => {
                magnitude_family(&l, numel, present)?
            }
            Kind::DareLinear | Kind::DareTies => {
                let sparsify = l
                    .per_model("density", present)?
                    .into_iter()
                    .map(|density| match density >= 1.0 {
                        true => Sparsify::All,
                        false => Sparsify::Random { density },
                    })
                    .collect();
                task_arithmetic(&l, present, sparsify, self.kind == Kind::DareTies)?
            }
            Kind::Della | Kind::DellaLinear => della(&l, present)?,
            Kind::Linear => TensorParams {
                delta: false,
                weights: l.per_model("weight", present)?,
                normalize: l.flag("normalize")?,
                ..TensorParams::interpolation(n, false, BaseTerm::None)
            },
            Kind::Passthrough => {
                if n != 1 {
                    bail!("passthrough takes exactly one model, got {n}");
                }
                TensorParams {
                    weights: l.per_model("scale", present)?,
                    ..TensorParams::interpolation(1, false, BaseTerm::None)
                }
            }
            Kind::ModelStock => {
                let vectors = match l.flag("filter_wise")? {
                    true => Vectors::Rows,
                    false => Vectors::Whole,
                };
                TensorParams::interpolation(n, false, BaseTerm::ModelStock { vectors })
            }
            Kind::Slerp => {
                let t = l.number("t", None)?;
                TensorParams::interpolation(n, false, BaseTerm::Slerp { t })
            }
            // A single model is returned as it is (mergekit's multislerp and karcher).
            Kind::Multislerp | Kind::Karcher if n == 1 => {
                TensorParams::interpolation(1, false, BaseTerm::None)
            }
            Kind::Nuslerp | Kind::Multislerp => spherical(&l, present, self.with_base)?,
            Kind::Sce => TensorParams {
                consensus: true,
                normalize: true,
                ..TensorParams::interpolation(
                    n,
                    true,
                    BaseTerm::Sce {
                        density: l.number("select_topk", None)?,
                    },
                )
            },
            Kind::Fisher => TensorParams {
                weights: l.per_model("weight", present)?,
                ..TensorParams::interpolation(n, false, BaseTerm::Fisher)
            },
            // The SVD methods' rule for the tensors they do not decompose (SPEC §4c, §4d, §4f):
            // θ₀ + α·(1/T)·Σ τ_t (ResMerge: α = 1). Their matrices are merged by
            // `engine::spectral` and `engine::resmerge`.
            Kind::ResMerge => mean_tau(n, 1.0),
            Kind::IsoC | Kind::Tsv => mean_tau(n, l.number("scaling_factor", None)?),
            // θ₀ + τ·mask (mergekit's tensors[0] + (tensors[1] − tensors[0])·fusion_mask).
            Kind::ArceeFusion => TensorParams {
                sparsify: vec![Sparsify::Fusion; n],
                ..TensorParams::interpolation(n, true, BaseTerm::Add)
            },
            Kind::Nearswap => {
                let t = l.number("t", None)?;
                TensorParams::interpolation(n, true, BaseTerm::Nearswap { t })
            }
            Kind::Karcher => TensorParams::interpolation(
                n,
                false,
                BaseTerm::Karcher {
                    max_iter: l.number("max_iter", None)?.max(0.0) as usize,
                    tol: l.number("tol", None)?,
                },
            ),
            Kind::Ram | Kind::RamPlus | Kind::RamplusTl => {
                bail!("internal: {} is not a combine method", self.kind.name())
            }
        })
    }

    /// Fisher merging: each merged model's `fisher` folder, in agent order.
    pub fn fisher_folders(&self, agents: usize) -> Result<Vec<std::path::PathBuf>> {
        (0..agents)
            .map(|m| match self.models.get(m).and_then(|s| s.get("fisher")) {
                Some(super::settings::Setting::Scalar(Scalar::Text(p))) => Ok(p.into()),
                _ => bail!(
                    "fisher needs parameter 'fisher' (a folder of diagonal Fisher safetensors with the model's tensor names) for model {}",
                    m + 1
                ),
            })
            .collect()
    }

    /// Checks the number of models the method takes (before any tensor is read).
    pub fn check(&self, agents: usize) -> Result<()> {
        let kind = self.kind;
        let need = |ok: bool, what: &str| -> Result<()> {
            if ok {
                Ok(())
            } else {
                bail!(
                    "{} needs {what}, got {agents} model(s) besides the base",
                    kind.name()
                )
            }
        };
        match kind {
            Kind::Slerp | Kind::Nearswap | Kind::ArceeFusion => {
                need(agents == 1, "exactly one model besides the base")?
            }
            Kind::ModelStock => need(agents >= 2, "at least two models besides the base")?,
            Kind::Passthrough => need(agents == 1, "exactly one model")?,
            Kind::Nuslerp => need(agents == 2, "exactly two models")?,
            _ => {}
        }
        // Keys and values are checked by `method::build`, the one place requests are validated.
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranks_follow_mergekit() {
        let top = |hi| Sparsify::Ranks {
            lo: 0,
            hi,
            high_first: false,
        };
        assert_eq!(top_k(0.5, 10), top(5));
        assert_eq!(top_k(0.01, 10), top(1));
        assert_eq!(top_k(1.0, 10), Sparsify::All);
        // 100 elements, density 0.9, γ 0.05: drop the top 5, keep 90, drop the bottom 5.
        let band = |lo, hi| Sparsify::Ranks {
            lo,
            hi,
            high_first: true,
        };
        assert_eq!(breadcrumbs(0.9, 0.05, 100), band(5, 95));
        // density 0.98 + γ 0.05 > 1: the bottom drop is 0, so the top drop shrinks to 2.
        assert_eq!(breadcrumbs(0.98, 0.05, 100), band(2, 100));
    }
}
