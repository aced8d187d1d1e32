//! From a mergekit-family method and its settings to one tensor's recipe: what each agent's
//! sparsifier keeps, the weights, consensus and normalization, and which statistics the probe
//! pass must gather before [`super::combine::CombineSpec`] can be built.

use super::catalog::Kind;
use super::settings::{Scalar, Settings, TensorPlace};
use anyhow::{bail, Result};
use serde::{Deserialize, Serialize};

/// A mergekit-family method with its settings as the recipe gave them.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct MethodConfig {
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
}

fn yes() -> bool {
    true
}

/// What one agent's sparsifier keeps, in ranks by |τ| descending (ties by lower index).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Sparsify {
    All,
    /// Ranks in `[lo, hi)`; ties at a cut go to the lower index first, or to the higher with
    /// `high_first`.
    Ranks {
        lo: u64,
        hi: u64,
        high_first: bool,
    },
    Random {
        density: f64,
    },
    /// DELLA's magnitude-ranked drop: keep probability from density − ε (smallest |τ| of its
    /// row) to density + ε (largest).
    RowRank {
        density: f64,
        epsilon: f64,
    },
}

/// How the base enters the result.
#[derive(Clone, Debug, PartialEq)]
pub enum BaseTerm {
    /// θ₀ + Δ (task vectors).
    Add,
    /// Δ alone (θ_t absolute, e.g. linear).
    None,
    /// Model Stock: t from the task vectors' mean pairwise cosine.
    ModelStock,
    /// Row-wise slerp from θ₀ toward the one agent by `t`.
    Slerp { t: f64 },
    /// Slerp between the two models' vectors (task vectors with a base), whole tensors.
    Nuslerp { t: f64 },
    /// Spherical weighted mean of the vectors, scaled by their weighted mean norm.
    Multislerp { weights: Vec<f64> },
    /// Karcher mean of the unit vectors on the sphere, scaled by the mean norm.
    Karcher { max_iter: usize, tol: f64 },
    /// NearSwap toward the one model where it is within about `t` of the base.
    Nearswap { t: f64 },
    /// SCE: θ₀ + the consensus mean of the task vectors on the `density` highest-variance
    /// elements, weighted by each vector's mean square there.
    Sce { density: f64 },
    /// Fisher merging: Σ λ_t F_t θ_t / Σ λ_t F_t, coefficients per element from the Fisher files.
    Fisher,
}

impl BaseTerm {
    /// The Gram matrix these coefficients need: of the task vectors (`Some(true)`), of the
    /// models (`Some(false)`), or none.
    pub fn gram_of(&self, delta: bool) -> Option<bool> {
        match self {
            BaseTerm::ModelStock => Some(true),
            BaseTerm::Nuslerp { .. } | BaseTerm::Multislerp { .. } | BaseTerm::Karcher { .. } => {
                Some(delta)
            }
            _ => None,
        }
    }
}

/// One tensor's method recipe, before statistics.
#[derive(Clone, Debug, PartialEq)]
pub struct TensorRecipe {
    /// v_t = θ_t − θ₀ (and out = θ₀ + …) when true; v_t = θ_t when false.
    pub delta: bool,
    pub weights: Vec<f64>,
    pub sparsify: Vec<Sparsify>,
    /// L1-rescale each sparsified vector.
    pub rescale: bool,
    pub consensus: bool,
    pub normalize: bool,
    pub lambda: f64,
    pub base: BaseTerm,
}

impl TensorRecipe {
    /// Every model whole with weight 1; the base term's statistics set the coefficients.
    fn interpolation(models: usize, delta: bool, base: BaseTerm) -> TensorRecipe {
        TensorRecipe {
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

/// The tensor-wise settings lookup: model setting first, then method-wide, then the default.
struct Lookup<'a> {
    config: &'a MethodConfig,
    at: TensorPlace<'a>,
}

impl Lookup<'_> {
    fn find(&self, name: &str, model: Option<usize>) -> Option<Scalar> {
        model
            .and_then(|m| self.config.models.get(m))
            .and_then(|s| s.get(name))
            .and_then(|s| s.resolve(self.at))
            .or_else(|| {
                self.config
                    .parameters
                    .get(name)
                    .and_then(|s| s.resolve(self.at))
            })
    }

    fn number(&self, name: &str, model: Option<usize>, default: Option<f64>) -> Result<f64> {
        let value = match (self.find(name, model), default) {
            (Some(v), _) => v.as_f64(name)?,
            (None, Some(d)) => d,
            (None, None) => match model {
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

    fn flag(&self, name: &str, default: bool) -> Result<bool> {
        self.find(name, None)
            .map_or(Ok(default), |v| v.as_bool(name))
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

impl MethodConfig {
    /// The recipe of tensor `at` with `numel` elements merged from the `present` agents.
    pub fn tensor_recipe(
        &self,
        at: TensorPlace,
        numel: u64,
        present: &[usize],
    ) -> Result<TensorRecipe> {
        let l = Lookup { config: self, at };
        let kind = self.kind;
        let per = |name: &str, default: Option<f64>| -> Result<Vec<f64>> {
            present
                .iter()
                .map(|&m| l.number(name, Some(m), default))
                .collect()
        };
        let gta = |sparsify: Vec<Sparsify>, consensus: bool, normalize: bool, rescale: bool| {
            Ok::<_, anyhow::Error>(TensorRecipe {
                delta: true,
                weights: per("weight", None)?,
                sparsify,
                rescale: l.flag("rescale", rescale)?,
                consensus,
                normalize: l.flag("normalize", normalize)?,
                lambda: l.number("lambda", None, Some(1.0))?,
                base: BaseTerm::Add,
            })
        };
        let densities = || per("density", Some(1.0));
        let recipe = match kind {
            Kind::TaskArithmetic | Kind::Ties | Kind::Breadcrumbs | Kind::BreadcrumbsTies => {
                let d = densities()?;
                let sparsify: Vec<Sparsify> = match kind {
                    Kind::TaskArithmetic => vec![Sparsify::All; present.len()],
                    Kind::Ties => d.iter().map(|&d| top_k(d, numel)).collect(),
                    _ => {
                        let g = per("gamma", Some(0.01))?;
                        d.iter()
                            .zip(&g)
                            .map(|(&d, &g)| breadcrumbs(d, g, numel))
                            .collect()
                    }
                };
                let consensus = matches!(kind, Kind::Ties | Kind::BreadcrumbsTies);
                gta(sparsify, consensus, kind == Kind::Ties, false)?
            }
            Kind::DareLinear | Kind::DareTies => {
                let sparsify = densities()?
                    .into_iter()
                    .map(|density| {
                        if density >= 1.0 {
                            Sparsify::All
                        } else {
                            Sparsify::Random { density }
                        }
                    })
                    .collect();
                gta(sparsify, kind == Kind::DareTies, false, true)?
            }
            Kind::Della | Kind::DellaLinear => {
                let eps = per("epsilon", Some(0.15))?;
                let sparsify = densities()?
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
                gta(sparsify, kind == Kind::Della, kind == Kind::Della, true)?
            }
            Kind::Linear => TensorRecipe {
                delta: false,
                weights: per("weight", None)?,
                sparsify: vec![Sparsify::All; present.len()],
                rescale: false,
                consensus: false,
                normalize: l.flag("normalize", true)?,
                lambda: 1.0,
                base: BaseTerm::None,
            },
            Kind::Passthrough => {
                if present.len() != 1 {
                    bail!("passthrough takes exactly one model, got {}", present.len());
                }
                TensorRecipe {
                    delta: false,
                    weights: per("scale", Some(1.0))?,
                    sparsify: vec![Sparsify::All],
                    rescale: false,
                    consensus: false,
                    normalize: false,
                    lambda: 1.0,
                    base: BaseTerm::None,
                }
            }
            Kind::ModelStock => {
                if l.flag("filter_wise", false)? {
                    bail!("model_stock with filter_wise: true is not supported yet");
                }
                TensorRecipe::interpolation(present.len(), false, BaseTerm::ModelStock)
            }
            Kind::Slerp => TensorRecipe::interpolation(
                present.len(),
                false,
                BaseTerm::Slerp {
                    t: l.number("t", None, None)?,
                },
            ),
            // A single model is returned as it is (mergekit's multislerp and karcher).
            Kind::Multislerp | Kind::Karcher if present.len() == 1 => {
                TensorRecipe::interpolation(1, false, BaseTerm::None)
            }
            Kind::Nuslerp => {
                if l.flag("nuslerp_row_wise", false)? || !l.flag("nuslerp_flatten", true)? {
                    bail!("nuslerp with nuslerp_row_wise or nuslerp_flatten: false is not supported yet");
                }
                if present.len() != 2 {
                    bail!("nuslerp takes exactly two models, got {}", present.len());
                }
                let w = per("weight", None)?;
                let total = w[0] + w[1];
                let t = if total.abs() < 1e-6 {
                    0.5
                } else {
                    w[1] / total
                };
                TensorRecipe::interpolation(2, self.with_base, BaseTerm::Nuslerp { t })
            }
            Kind::Multislerp => {
                let mut weights = per("weight", None)?;
                if l.flag("normalize_weights", true)? {
                    let sum: f64 = weights.iter().sum();
                    weights.iter_mut().for_each(|w| *w /= sum);
                }
                TensorRecipe::interpolation(
                    present.len(),
                    self.with_base,
                    BaseTerm::Multislerp { weights },
                )
            }
            Kind::Sce => TensorRecipe {
                consensus: true,
                normalize: true,
                ..TensorRecipe::interpolation(
                    present.len(),
                    true,
                    BaseTerm::Sce {
                        density: l.number("select_topk", None, Some(1.0))?,
                    },
                )
            },
            Kind::Fisher => TensorRecipe {
                weights: per("weight", Some(1.0))?,
                ..TensorRecipe::interpolation(present.len(), false, BaseTerm::Fisher)
            },
            Kind::Nearswap => TensorRecipe::interpolation(
                present.len(),
                true,
                BaseTerm::Nearswap {
                    t: l.number("t", None, None)?,
                },
            ),
            Kind::Karcher => TensorRecipe::interpolation(
                present.len(),
                false,
                BaseTerm::Karcher {
                    max_iter: l.number("max_iter", None, Some(10.0))?.max(0.0) as usize,
                    tol: l.number("tol", None, Some(1e-5))?,
                },
            ),
            Kind::Ram | Kind::RamPlus | Kind::RamplusTl => {
                bail!("internal: {} is not a combine method", kind.name())
            }
        };
        Ok(recipe)
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
            Kind::Slerp | Kind::Nearswap => {
                need(agents == 1, "exactly one model besides the base")?
            }
            Kind::ModelStock => need(agents >= 2, "at least two models besides the base")?,
            Kind::Passthrough => need(agents == 1, "exactly one model")?,
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
