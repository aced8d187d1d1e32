//! Retention of each agent in a merged folder, as reported: per agent t and region (its unique
//! elements U_t, its shared elements S_t, all it changed), r = Σ (θ_out − θ₀)·τ_t / Σ τ_t² and
//! the share of its changed elements whose sign survived. `engine::retention` computes it.

use serde::Serialize;
use serde_json::{json, Value};
use std::fmt::Write;

/// One agent's sums over one region.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct RegionSums {
    /// Σ (θ_out − θ₀)·τ_t.
    pub dot: f64,
    /// Σ τ_t².
    pub norm2: f64,
    /// Elements the agent changed in the region.
    pub changed: u64,
    /// Of those, the elements where θ_out − θ₀ has the sign of τ_t.
    pub sign_kept: u64,
}

impl RegionSums {
    pub(crate) fn add(&mut self, o: &RegionSums) {
        self.dot += o.dot;
        self.norm2 += o.norm2;
        self.changed += o.changed;
        self.sign_kept += o.sign_kept;
    }

    /// r = Σ (θ_out − θ₀)·τ / Σ τ² (0 where the agent changed nothing there).
    pub fn retention(&self) -> f64 {
        if self.norm2 > 0.0 {
            self.dot / self.norm2
        } else {
            0.0
        }
    }

    /// The share of changed elements whose sign survived (0 where none changed).
    pub fn sign_share(&self) -> f64 {
        if self.changed > 0 {
            self.sign_kept as f64 / self.changed as f64
        } else {
            0.0
        }
    }
}

/// The regions of one agent's changes.
pub const REGIONS: [&str; 3] = ["unique", "shared", "all"];

/// Retention of every agent in a merged folder.
#[derive(Clone, Debug)]
pub struct Retention {
    /// The merged folder.
    pub merged: String,
    /// The agents' labels, in order.
    pub agents: Vec<String>,
    /// Per agent: unique, shared, all ([`REGIONS`]).
    pub regions: Vec<[RegionSums; 3]>,
    /// Per agent, the λ the merge gave it, where the merged folder's record says (an rlmerge
    /// merge of the RAM family with one λ per agent); empty otherwise.
    pub lambdas: Vec<Option<f64>>,
}

impl Retention {
    /// Agent `t`'s λ in the merge, if known.
    pub fn lambda(&self, t: usize) -> Option<f64> {
        self.lambdas.get(t).copied().flatten()
    }

    /// The retention as `analyze --json` prints it.
    pub fn to_json(&self) -> Value {
        let agents: Vec<Value> = self
            .agents
            .iter()
            .zip(&self.regions)
            .map(|(a, r)| {
                let mut v = json!({ "agent": a });
                for (name, s) in REGIONS.iter().zip(r) {
                    v[*name] = json!({
                        "retention": s.retention(),
                        "sign_kept": s.sign_share(),
                        "changed": s.changed,
                    });
                }
                v
            })
            .collect();
        json!({ "merged": self.merged, "agents": agents })
    }

    /// The retention as `analyze` prints it.
    pub fn render_text(&self) -> String {
        let mut s = String::new();
        let _ = writeln!(
            s,
            "\nretention in {}: r = Σ (θ_out − θ₀)·τ / Σ τ² per region, and the share of changed \
             elements whose sign survived",
            crate::escape::terminal(&self.merged)
        );
        let _ = writeln!(
            s,
            "{:<4} {:>20} {:>20} {:>20}  path",
            "#", "unique r (sign)", "shared r (sign)", "all r (sign)"
        );
        for (t, (a, r)) in self.agents.iter().zip(&self.regions).enumerate() {
            let _ = write!(s, "{:<4}", t + 1);
            for region in r {
                let cell = format!(
                    "{:.4} ({:.1}%)",
                    region.retention(),
                    100.0 * region.sign_share()
                );
                let _ = write!(s, " {cell:>20}");
            }
            let _ = writeln!(s, "  {}", crate::escape::terminal(a));
        }
        s
    }
}
