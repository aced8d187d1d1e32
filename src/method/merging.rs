//! How a merge merges, whole: its method, then SVC's calibration of every matrix where asked
//! (SPEC §4e). The one value every question of that kind is asked of — what it costs and holds
//! in memory, whether mergekit runs it, which tensors it decomposes, how it is named — built and
//! checked once, by [`super::build::merging`].

use super::catalog::Kind;
use super::cost::{Cost, Footprint};
use super::Method;
use serde::{Deserialize, Serialize};

/// A method and SVC's α when the merge is spectrally calibrated. Serialized as the record's
/// `method` and `svc` fields.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Merging {
    /// The method, with its parameters.
    pub method: Method,
    /// SVC's α (SPEC §4e): each matrix the method merged is calibrated.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub svc: Option<f64>,
}

impl Merging {
    /// A method alone, not calibrated.
    pub fn of(method: Method) -> Merging {
        Merging { method, svc: None }
    }

    /// The method's catalog entry.
    pub fn kind(&self) -> Kind {
        self.method.kind()
    }

    /// Its work per byte read: SVC decomposes every matrix, whatever the method.
    pub fn cost(&self) -> Cost {
        match self.svc {
            Some(_) => Cost::Spectral,
            None => self.kind().cost(),
        }
    }

    /// What it holds in memory besides the files' pages.
    pub fn footprint(&self) -> Footprint {
        match self.cost() {
            Cost::Spectral => Footprint::Matrices,
            Cost::Stream | Cost::Scan => Footprint::Tiles,
        }
    }

    /// Whether mergekit runs it: a method mergekit has, without SVC (rlmerge's).
    pub fn in_mergekit(&self) -> bool {
        self.kind().in_mergekit() && self.svc.is_none()
    }

    /// Whether it decomposes matrices: a spectral method, or any method with SVC.
    pub fn decomposes(&self) -> bool {
        self.cost() == Cost::Spectral
    }

    /// How stdout and the model card name it: `ram+ (rule paper, …)`, `ties then SVC (α = 0.1)`.
    pub fn text(&self) -> String {
        match self.svc {
            Some(alpha) => format!("{} then SVC (α = {alpha})", self.method),
            None => self.method.to_string(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn svc_makes_any_method_spectral_and_rlmergess_own() {
        let ram = Merging::of(Method::default_ram_plus());
        assert_eq!(
            (ram.cost(), ram.footprint()),
            (Cost::Scan, Footprint::Tiles)
        );
        assert!(!ram.in_mergekit() && !ram.decomposes());
        let calibrated = Merging {
            svc: Some(0.1),
            ..ram
        };
        assert_eq!(calibrated.cost(), Cost::Spectral);
        assert_eq!(calibrated.footprint(), Footprint::Matrices);
        assert!(calibrated.decomposes() && calibrated.text().ends_with("then SVC (α = 0.1)"));
    }
}
