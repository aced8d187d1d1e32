//! The one place a method name and its parameters become a validated [`Method`], for the command
//! line (`--method`, its flags and `--param`) and for recipes alike: every key must be one of the
//! method's parameters (catalog), every value — each scalar, gradient point and conditional value —
//! must lie in the parameter's documented range, and what depends on several parameters (RAM+'s
//! rule and its coefficients, DELLA's density ± ε, multislerp's weight sum) is checked here too.
//! Every failure is a usage error (exit 2) naming the parameter, the model and the range.

use super::catalog::{Kind, Param, ParamDefault, ParamScope, Range};
use super::settings::{ConditionalValue, Scalar, Setting, Settings};
use super::tensor_params::{MethodConfig, SliceSettings};
use super::{defaults, BoostRule, BoostScope, Method, SharedRule, MAX_AGENTS};
use crate::error::{usage, Arg};
use anyhow::Result;

/// A method and its parameters as given: `method_wide` for the method, `models` per merged model (in
/// agent order; missing entries are empty).
pub struct MethodRequest {
    /// The method asked for.
    pub kind: Kind,
    /// Parameters set once for the whole method (a recipe's top-level `parameters:`).
    pub method_wide: Settings,
    /// Each merged model's own parameters, in order.
    pub models: Vec<Settings>,
    /// Seed of random masks (DARE, DELLA).
    pub seed: u64,
    /// Whether θ₀ enters the formula (see [`MethodConfig::with_base`]).
    pub with_base: bool,
    /// Each slice's own parameters (recipes with `slices`).
    pub slices: Vec<SliceSettings>,
}

/// The RAM threshold ε a request sets, validated (`None`: not set).
pub fn epsilon(req: &MethodRequest) -> Result<Option<f32>> {
    shared_number(req, "epsilon")?
        .map(epsilon_value)
        .transpose()
}

/// Validates `req` for `agents` merged models and builds the method.
pub fn build(req: MethodRequest, agents: usize) -> Result<Method> {
    check_keys_and_values(&req)?;
    if agents > MAX_AGENTS {
        return Err(usage(format!(
            "at most {MAX_AGENTS} models can be merged at once, got {agents}"
        )));
    }
    let ram_family = req.kind.is_ram_family();
    let slice_settings = req
        .slices
        .iter()
        .any(|s| !s.parameters.is_empty() || s.models.iter().any(|m| !m.is_empty()));
    if ram_family && slice_settings {
        return Err(usage(format!(
            "{} takes its parameters method-wide; set them under the recipe's top-level \
             `parameters`, not in a slice",
            req.kind.name()
        )));
    }
    match req.kind {
        Kind::Ram => Ok(Method::Ram {
            shared: shared_rule(&req),
        }),
        Kind::RamPlus | Kind::RamplusTl => ram_plus(&req),
        kind => {
            let config = MethodConfig {
                kind,
                parameters: req.method_wide,
                models: req.models,
                seed: req.seed,
                with_base: req.with_base,
                slices: req.slices,
            };
            // With slices each slice has its own models: the recipe reader checks each.
            if config.slices.is_empty() {
                check_required(&config, agents)?;
                config.check(agents).map_err(|e| usage(e.to_string()))?;
            }
            cross_checks(&config, agents)?;
            Ok(Method::Combine(config))
        }
    }
}

/// Every parameter the method requires (no default) is given — per model, or once for all —
/// before any tensor is read, with the fix in the error.
fn check_required(config: &MethodConfig, agents: usize) -> Result<()> {
    for p in config.kind.params() {
        if !matches!(p.default, ParamDefault::Required) || config.parameters.contains_key(p.name) {
            continue;
        }
        let missing: Vec<usize> = match p.scope {
            ParamScope::MethodWide => vec![0],
            ParamScope::PerModel => (0..agents)
                .filter(|&m| config.models.get(m).is_none_or(|s| !s.contains_key(p.name)))
                .collect(),
        };
        if let Some(&m) = missing.first() {
            let whom = match p.scope {
                ParamScope::MethodWide => String::new(),
                ParamScope::PerModel => format!(" for model {}", m + 1),
            };
            return Err(usage(crate::message![
                format!(
                    "method {} needs parameter '{}'{whom}: ",
                    config.kind.name(),
                    p.name
                ),
                Arg::give_param(p.name),
                format!(" ({})", p.range.requirement()),
            ]));
        }
    }
    Ok(())
}

/// Every key known for the method and in the right scope; every value in its range.
fn check_keys_and_values(req: &MethodRequest) -> Result<()> {
    let params = req.kind.params();
    let known: Vec<&str> = params.iter().map(|p| p.name).collect();
    let find = |key: &str, model: Option<usize>| -> Result<&Param> {
        let place = model.map_or(String::new(), |m| format!(" of model {}", m + 1));
        params.iter().find(|p| p.name == key).ok_or_else(|| {
            usage(format!(
                "unknown parameter '{key}'{place} for method {}{} (it takes: {})",
                req.kind.name(),
                crate::error::did_you_mean(key, known.iter().copied()),
                known.join(", ")
            ))
        })
    };
    let slices = req.slices.iter();
    for method_wide in
        std::iter::once(&req.method_wide).chain(slices.clone().map(|s| &s.parameters))
    {
        for (key, setting) in method_wide {
            check_setting(find(key, None)?, setting, None)?;
        }
    }
    let per_model = slices.flat_map(|s| s.models.iter().enumerate());
    for (m, settings) in req.models.iter().enumerate().chain(per_model) {
        for (key, setting) in settings {
            let param = find(key, Some(m))?;
            if param.scope == ParamScope::MethodWide {
                return Err(usage(format!(
                    "parameter '{key}' of method {} is set once for the method, not per model \
                     (model {})",
                    req.kind.name(),
                    m + 1
                )));
            }
            check_setting(param, setting, Some(m))?;
        }
    }
    Ok(())
}

fn check_setting(param: &Param, setting: &Setting, model: Option<usize>) -> Result<()> {
    let values: Vec<&Scalar> = match setting {
        Setting::Scalar(s) => vec![s],
        Setting::Gradient(v) => v.iter().collect(),
        Setting::Conditional(list) => list
            .iter()
            .flat_map(|c| match &c.value {
                ConditionalValue::Scalar(s) => vec![s],
                ConditionalValue::Gradient(v) => v.iter().collect(),
            })
            .collect(),
    };
    if values.is_empty() {
        return Err(bad(param, model, "an empty list"));
    }
    for v in values {
        check_scalar(param, v, model)?;
    }
    Ok(())
}

/// `value` shown as the user wrote it.
fn shown(value: &Scalar) -> String {
    match value {
        Scalar::Bool(b) => b.to_string(),
        Scalar::Number(x) => number(*x),
        Scalar::Text(t) => format!("'{}'", crate::escape::terminal(t)),
    }
}

/// A number as errors show it: plainly, or in exponent form where that is shorter than 12
/// characters' worth of digits (1e300 is not 301 digits).
pub fn number(x: f64) -> String {
    let plain = x.to_string();
    if plain.len() > 12 && x.is_finite() {
        format!("{x:e}")
    } else {
        plain
    }
}

/// SVC's α, checked against [`crate::method::catalog::SVC`]'s range (a usage error naming `svc`
/// otherwise).
/// A merge's whole rule (SPEC §4e): `method`, calibrated by SVC where `svc` gives α — checked
/// here, once, whichever front end gave it: α in its range, and a method whose formula has a θ₀
/// to calibrate the update against (linear, passthrough, karcher… merge without one, even with a
/// `--base` for the layout).
pub fn merging(method: Method, svc: Option<&Scalar>) -> Result<crate::method::Merging> {
    let svc = svc.map(svc_alpha).transpose()?;
    if svc.is_some() && !method.uses_base() {
        return Err(usage(format!(
            "svc calibrates a merge's update against its base model, and method {} merges \
             without one (use a method with a base, e.g. task_arithmetic)",
            method.name()
        )));
    }
    Ok(crate::method::Merging { method, svc })
}

/// SVC's α as given (`--svc`, a recipe's `svc:`, Python's `svc=`), checked against its range.
fn svc_alpha(value: &Scalar) -> Result<f64> {
    let param = &crate::method::catalog::SVC;
    check_scalar(param, value, None)?;
    value.as_f64(param.name)
}

/// RAM's ε as `--epsilon` or `analyze` gives it, checked as a recipe's `epsilon` is (the
/// catalog's [`crate::method::catalog::EPSILON`]): finite and ≥ 0 in f32, the type the probe
/// compares in.
pub fn epsilon_value(x: f64) -> Result<f32> {
    check_scalar(&crate::method::catalog::EPSILON, &Scalar::Number(x), None)?;
    Ok(x as f32)
}

fn bad(param: &Param, model: Option<usize>, got: &str) -> anyhow::Error {
    let place = model.map_or(String::new(), |m| format!(" of model {}", m + 1));
    usage(format!(
        "parameter '{}'{place} must be {}, got {got}",
        param.name,
        param.range.requirement()
    ))
}

fn check_scalar(param: &Param, value: &Scalar, model: Option<usize>) -> Result<()> {
    let fail = || Err(bad(param, model, &shown(value)));
    match param.range {
        Range::Number { lo, hi } | Range::Integer { lo, hi } => {
            let Ok(x) = value.as_f64(param.name) else {
                return fail();
            };
            let whole = !matches!(param.range, Range::Integer { .. }) || x.fract() == 0.0;
            if !(x.is_finite() && x >= lo && x <= hi && whole) {
                return fail();
            }
            if !param.compute.finite(x) {
                let place = model.map_or(String::new(), |m| format!(" of model {}", m + 1));
                return Err(usage(format!(
                    "parameter '{}'{place} must be {}, got {}, which is infinite as an f32 \
                     (the type it is computed in; at most {:e})",
                    param.name,
                    param.range.requirement(),
                    shown(value),
                    f32::MAX
                )));
            }
        }
        Range::Bool => {
            if value.as_bool(param.name).is_err() {
                return fail();
            }
        }
        Range::Choice(words) => match value {
            Scalar::Text(t) if words.contains(&t.as_str()) => {}
            _ => return fail(),
        },
        Range::Folder => {
            if !matches!(value, Scalar::Text(t) if !t.trim().is_empty()) {
                return fail();
            }
        }
    }
    Ok(())
}

/// A method-wide parameter given as one number (already range-checked).
fn shared_number(req: &MethodRequest, key: &str) -> Result<Option<f64>> {
    match req.method_wide.get(key) {
        None => Ok(None),
        Some(Setting::Scalar(s)) => Ok(Some(s.as_f64(key)?)),
        Some(_) => Err(usage(format!(
            "parameter '{key}' of method {} must be a single number (no gradient or filter)",
            req.kind.name()
        ))),
    }
}

fn shared_word(req: &MethodRequest, key: &str) -> Option<String> {
    match req.method_wide.get(key) {
        Some(Setting::Scalar(Scalar::Text(t))) => Some(t.clone()),
        _ => None,
    }
}

/// The RAM family's shared-region rule (the catalog checked the word).
fn shared_rule(req: &MethodRequest) -> SharedRule {
    shared_word(req, "shared")
        .and_then(|w| SharedRule::from_name(&w))
        .unwrap_or_default()
}

/// RAM+ (and mergekit's `ramplus_tl`, the paper rule in tensor scope): the rule, its scope and its
/// coefficients, with the coefficients of the other rule refused.
fn ram_plus(req: &MethodRequest) -> Result<Method> {
    let r = shared_number(req, "r")?;
    let alpha = shared_number(req, "alpha")?;
    let rescale_factor = shared_number(req, "rescale_factor")?;
    let (rule, scope) = if req.kind == Kind::RamplusTl {
        ("paper".to_string(), BoostScope::Tensor)
    } else {
        // The catalog checked the word.
        let scope = shared_word(req, "scope")
            .and_then(|w| BoostScope::from_name(&w))
            .unwrap_or(BoostScope::Global);
        (
            shared_word(req, "rule").unwrap_or_else(|| "paper".into()),
            scope,
        )
    };
    let rule = if rule == "official" {
        if r.is_some() || alpha.is_some() {
            return Err(usage(crate::message![
                "r and alpha (",
                Arg::named("--r, --alpha", "r=, alpha="),
                ") apply to rule paper only; rule official takes rescale_factor (",
                Arg::option("rescale-factor"),
                ")",
            ]));
        }
        BoostRule::Official {
            rescale_factor: rescale_factor.unwrap_or(defaults::RESCALE_FACTOR),
        }
    } else {
        if rescale_factor.is_some() {
            return Err(usage(crate::message![
                "rescale_factor (",
                Arg::option("rescale-factor"),
                ") applies to rule official only",
            ]));
        }
        BoostRule::Paper {
            r: r.unwrap_or(defaults::R),
            alpha: alpha.unwrap_or(match scope {
                BoostScope::Tensor => defaults::ALPHA_TENSOR,
                _ => defaults::ALPHA_GLOBAL,
            }),
        }
    };
    Ok(Method::RamPlus {
        rule,
        scope,
        shared: shared_rule(req),
    })
}

/// Model `m`'s value of `key` when it is one number (per-model first, then method-wide, then the
/// catalog's default).
fn model_number(config: &MethodConfig, key: &str, m: usize) -> Option<f64> {
    let setting = config
        .models
        .get(m)
        .and_then(|s| s.get(key))
        .or_else(|| config.parameters.get(key));
    match setting {
        Some(Setting::Scalar(v)) => v.as_f64(key).ok(),
        Some(_) => None,
        None => match config.kind.param(key).map(|p| p.default) {
            Some(ParamDefault::Number(d)) => Some(d),
            _ => None,
        },
    }
}

/// Rules between parameters, checked up front where the values are plain numbers (gradients and
/// filters are checked per tensor, with the tensor named).
fn cross_checks(config: &MethodConfig, agents: usize) -> Result<()> {
    match config.kind {
        Kind::ResMerge => {
            let number = |key: &str| match config.parameters.get(key) {
                Some(Setting::Scalar(v)) => v.as_f64(key).ok(),
                _ => Kind::ResMerge.param(key).and_then(|p| p.default.number()),
            };
            let (Some(lo), Some(hi)) = (number("beta_min"), number("beta_max")) else {
                return Ok(());
            };
            if lo > hi {
                return Err(usage(format!(
                    "resmerge: beta_min ({lo}) must not exceed beta_max ({hi})"
                )));
            }
        }
        Kind::Della | Kind::DellaLinear => {
            for m in 0..agents {
                let (Some(d), Some(e)) = (
                    model_number(config, "density", m),
                    model_number(config, "epsilon", m),
                ) else {
                    continue;
                };
                if d > 0.0 && d < 1.0 && (d + e >= 1.0 || d - e <= 0.0) {
                    return Err(usage(format!(
                        "{}: density ± epsilon must lie within (0, 1) for model {} \
                         (density {d}, epsilon {e})",
                        config.kind.name(),
                        m + 1
                    )));
                }
            }
        }
        Kind::Multislerp => {
            let normalize = !matches!(
                config.parameters.get("normalize_weights"),
                Some(Setting::Scalar(v)) if v.as_bool("normalize_weights").ok() == Some(false)
            );
            let weights: Option<Vec<f64>> = (0..agents)
                .map(|m| model_number(config, "weight", m))
                .collect();
            if let (true, Some(w)) = (normalize, weights) {
                if w.iter().sum::<f64>().abs() < 1e-12 {
                    return Err(usage(format!(
                        "multislerp: the weights {w:?} sum to 0, so they cannot be normalized"
                    )));
                }
            }
        }
        _ => {}
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(kind: Kind, method_wide: &[(&str, Scalar)], models: Vec<Settings>) -> MethodRequest {
        MethodRequest {
            kind,
            method_wide: method_wide
                .iter()
                .map(|(k, v)| (k.to_string(), Setting::Scalar(v.clone())))
                .collect(),
            models,
            seed: 0,
            with_base: true,
            slices: Vec::new(),
        }
    }

    fn message(r: Result<Method>) -> String {
        let e = r.unwrap_err();
        assert!(crate::error::is_usage(&e), "{e}");
        e.to_string()
    }

    #[test]
    fn values_outside_their_range_name_parameter_and_range() {
        use Scalar::*;
        let cases: Vec<(Kind, &str, Scalar, &str)> = vec![
            (Kind::Ties, "density", Number(1.5), "[0, 1]"),
            (Kind::Ties, "density", Number(-0.1), "[0, 1]"),
            (Kind::Ties, "density", Number(f64::NAN), "[0, 1]"),
            (Kind::Ram, "epsilon", Number(-1.0), "≥ 0"),
            (Kind::Ram, "epsilon", Number(f64::NAN), "≥ 0"),
            (Kind::RamPlus, "r", Number(1e308), "[0, 100]"),
            (Kind::RamPlus, "alpha", Number(-2.0), "[0, 1e6]"),
            (Kind::RamPlus, "rescale_factor", Number(-1.0), "[1, 100]"),
            (
                Kind::RamPlus,
                "rule",
                Text("fast".into()),
                "paper, official",
            ),
            (Kind::Sce, "select_topk", Number(2.0), "[0, 1]"),
            (
                Kind::Ties,
                "normalize",
                Text("maybe".into()),
                "true or false",
            ),
            (Kind::Karcher, "max_iter", Number(2.5), "whole number"),
            (Kind::Slerp, "t", Number(1.5), "[0, 1]"),
        ];
        for (kind, key, value, want) in cases {
            let m = message(build(req(kind, &[(key, value.clone())], vec![]), 2));
            assert!(
                m.contains(key) && m.contains(want),
                "{kind:?} {key}={value:?}: {m}"
            );
            assert!(!m.contains("Text("), "{m}");
        }
        // Per model, and inside a gradient.
        let mut model = Settings::new();
        model.insert(
            "gamma".into(),
            Setting::Gradient(vec![Scalar::Number(0.1), Scalar::Number(5.0)]),
        );
        let m = message(build(
            req(
                Kind::Breadcrumbs,
                &[("weight", Number(1.0))],
                vec![Settings::new(), model],
            ),
            2,
        ));
        assert!(
            m.contains("'gamma' of model 2") && m.contains("[0, 1]"),
            "{m}"
        );
    }

    #[test]
    fn rules_between_parameters() {
        use Scalar::*;
        let m = message(build(
            req(
                Kind::RamPlus,
                &[("rule", Text("official".into())), ("r", Number(0.2))],
                vec![],
            ),
            2,
        ));
        assert!(m.contains("rule paper only"), "{m}");
        let m = message(build(
            req(
                Kind::Della,
                &[
                    ("density", Number(0.9)),
                    ("epsilon", Number(0.2)),
                    ("weight", Number(1.0)),
                ],
                vec![],
            ),
            2,
        ));
        assert!(m.contains("density ± epsilon"), "{m}");
        let mut a = Settings::new();
        a.insert("weight".into(), Setting::Scalar(Number(1.0)));
        let mut b = Settings::new();
        b.insert("weight".into(), Setting::Scalar(Number(-1.0)));
        let m = message(build(req(Kind::Multislerp, &[], vec![a, b]), 2));
        assert!(m.contains("sum to 0"), "{m}");
        // Defaults: ram+ is the paper rule in global scope, ramplus_tl in tensor scope.
        assert_eq!(
            build(req(Kind::RamPlus, &[], vec![]), 2).unwrap(),
            Method::RamPlus {
                rule: BoostRule::Paper { r: 0.1, alpha: 2.0 },
                scope: BoostScope::Global,
                shared: SharedRule::Mean,
            }
        );
        assert_eq!(
            build(req(Kind::RamplusTl, &[], vec![]), 2).unwrap(),
            Method::RamPlus {
                rule: BoostRule::Paper { r: 0.1, alpha: 0.2 },
                scope: BoostScope::Tensor,
                shared: SharedRule::Mean,
            }
        );
    }
}
