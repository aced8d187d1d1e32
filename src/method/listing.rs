//! Every method as `rlmerge methods --json` and Python's `rlmerge.methods()` list it: name,
//! what it does, reference, cost and memory classes, and each parameter's scope, default and
//! range — with SVC, the modifier, after the methods.

use super::catalog::{Cost, Footprint, Param, ParamScope};
use super::Kind;

/// What `rlmerge methods` says of SVC, the modifier: in a line.
pub const SVC_SUMMARY: &str = "spectral calibration after any method: --svc A";
/// What `rlmerge methods svc` says of it.
pub const SVC_ABOUT: &str = "SVC, spectral calibration after any method: each merged matrix's \
                         singular values rescaled by how many agents reached them; --svc ALPHA, or \
                         svc: in a recipe (SPEC §4e)";
/// Where SVC was published.
pub const SVC_REFERENCE: &str = "arXiv:2602.05536";

/// How a parameter's scope is named.
pub fn scope_name(p: &Param) -> &'static str {
    match p.scope {
        ParamScope::MethodWide => "method-wide",
        ParamScope::PerModel => "per model",
    }
}

/// One parameter as the listing gives it.
pub fn param_json(p: &Param) -> serde_json::Value {
    serde_json::json!({
        "name": p.name,
        "scope": scope_name(p),
        "default": p.default.text(p.range),
        "range": p.range.text(),
        "about": p.about,
    })
}

/// One method, or SVC, as `rlmerge methods --json` gives it.
pub fn method_json(kind: Option<Kind>) -> serde_json::Value {
    match kind {
        Some(kind) => serde_json::json!({
            "name": kind.name(),
            "summary": kind.summary(),
            "about": kind.about(),
            "reference": kind.reference(),
            "cost": kind.cost().name(),
            "memory": kind.footprint().name(),
            "default": kind == Kind::RamPlus,
            "parameters": kind.params().iter().map(param_json).collect::<Vec<_>>(),
        }),
        None => {
            let svc = &super::catalog::SVC;
            serde_json::json!({
                "name": svc.name,
                "modifier": true,
                "summary": SVC_SUMMARY,
                "about": SVC_ABOUT,
                "reference": SVC_REFERENCE,
                "cost": Cost::Spectral.name(),
                "memory": Footprint::Matrices.name(),
                "default": false,
                "parameters": [param_json(svc)],
            })
        }
    }
}

/// Every method, then SVC.
pub fn all_json() -> serde_json::Value {
    Kind::ALL
        .iter()
        .map(|&k| method_json(Some(k)))
        .chain([method_json(None)])
        .collect()
}
