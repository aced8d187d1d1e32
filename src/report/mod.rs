//! The distribution report of the probe (SPEC §1): per agent density, unique/shared counts, the
//! histogram "changed and shared with k other agents", ρ_t and λ_t under each rule — globally, per
//! module and per tensor, as text tables or JSON.

pub mod retention;

use crate::backend::TileCounts;
use crate::method::{defaults, AgentCounts, BoostRule, BoostScope};
use crate::names::Module;
use crate::structure::{Part, Structure};
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::fmt::Write;

/// The group of tensors whose counts give a tensor's λ in `scope` (SPEC §3), from where the
/// tensor is (`part`) and its module kind: in layer scope "layer N" for a tensor of decoder layer
/// N, its stack for a tower's or the MTP layers' (`vision`, `mtp`), else its module kind (embed,
/// norm, lm_head, other); in module scope its module kind across the decoder's layers, by stack
/// elsewhere (`vision attn`); `None` in global scope (one group: the model) and tensor scope
/// (each tensor its own).
pub fn boost_group(scope: BoostScope, part: Part, module: Module) -> Option<String> {
    match scope {
        BoostScope::Global | BoostScope::Tensor => None,
        BoostScope::Layer => Some(Structure::layer_group(part, module)),
        BoostScope::Module => Some(Structure::module_group(part, module)),
    }
}

/// Probe counts of one tensor, indexed by global agent.
#[derive(Clone, Debug)]
pub struct TensorStats {
    /// Shared with the model's entry (a model may have 10^5 tensors).
    pub name: std::sync::Arc<str>,
    pub module: Module,
    /// Its stack and layer there.
    pub part: Part,
    pub numel: u64,
    /// Which agents have this tensor: bit t for agent t (at most 64 agents).
    pub present: u64,
    pub counts: TileCounts,
}

impl TensorStats {
    /// The counts of tensor `name` of `numel` elements, at `part` of its model, which the agents
    /// in mask `present` (bit t: agent t) have.
    pub fn new(
        name: std::sync::Arc<str>,
        part: Part,
        numel: u64,
        present: u64,
        counts: TileCounts,
    ) -> TensorStats {
        TensorStats {
            module: Module::of(&name),
            part,
            name,
            numel,
            present,
            counts,
        }
    }

    /// Whether agent `t` has this tensor.
    pub fn has(&self, t: usize) -> bool {
        self.present >> t & 1 == 1
    }

    pub fn agent_counts(&self) -> Vec<AgentCounts> {
        agent_counts(&self.counts)
    }
}

/// Unique (k = 0) and shared (k ≥ 1) counts of each agent from a histogram.
pub fn agent_counts(counts: &TileCounts) -> Vec<AgentCounts> {
    (0..counts.agents)
        .map(|t| {
            let row = counts.row(t);
            AgentCounts {
                unique: row[0],
                shared: row[1..].iter().sum(),
            }
        })
        .collect()
}

/// The λ rules the report lists, with SPEC §3's defaults: (label, rule).
pub fn reported_rules() -> [(&'static str, BoostRule); 2] {
    [
        (
            "ram+ paper",
            BoostRule::Paper {
                r: defaults::R,
                alpha: defaults::ALPHA_GLOBAL,
            },
        ),
        (
            "ram+ official",
            BoostRule::Official {
                rescale_factor: defaults::RESCALE_FACTOR,
            },
        ),
    ]
}

/// The rule of the layer and module scopes as `analyze` reports them: the paper rule with its global
/// defaults (SPEC §3).
pub fn group_rule() -> BoostRule {
    BoostRule::Paper {
        r: defaults::R,
        alpha: defaults::ALPHA_GLOBAL,
    }
}

/// The per-tensor rule (mergekit's `ramplus_tl` defaults).
pub fn tensor_rule() -> BoostRule {
    BoostRule::Paper {
        r: defaults::R,
        alpha: defaults::ALPHA_TENSOR,
    }
}

/// The whole-model probe result.
#[derive(Clone, Debug)]
pub struct ProbeReport {
    pub agents: Vec<String>,
    pub epsilon: f32,
    /// Per tensor, or after [`Self::compact`] per module and set of agents.
    pub tensors: Vec<TensorStats>,
    /// Tensors probed (also after [`Self::compact`]).
    pub tensor_count: usize,
}

/// `tensors` merged into one entry per module and set of agents present (see
/// [`ProbeReport::compact`]).
pub fn compact(tensors: Vec<TensorStats>) -> Vec<TensorStats> {
    let mut groups: BTreeMap<(Module, u64), TensorStats> = BTreeMap::new();
    for t in tensors {
        match groups.entry((t.module, t.present)) {
            std::collections::btree_map::Entry::Occupied(mut g) => {
                let g = g.get_mut();
                g.numel += t.numel;
                g.counts.add(&t.counts);
            }
            std::collections::btree_map::Entry::Vacant(v) => {
                v.insert(TensorStats {
                    name: t.module.name().into(),
                    part: Part {
                        stack: t.part.stack,
                        layer: None,
                    },
                    ..t
                });
            }
        }
    }
    groups.into_values().collect()
}

/// One group's totals (the model, a module).
struct Group {
    /// Elements each agent has in the group.
    numel: Vec<u64>,
    counts: TileCounts,
}

impl ProbeReport {
    fn group<'a>(&self, tensors: impl Iterator<Item = &'a TensorStats>) -> Group {
        let n = self.agents.len();
        let mut g = Group {
            numel: vec![0; n],
            counts: TileCounts::zeros(n),
        };
        for t in tensors {
            g.counts.add(&t.counts);
            for (a, numel) in g.numel.iter_mut().enumerate() {
                if t.has(a) {
                    *numel += t.numel;
                }
            }
        }
        g
    }

    /// Merges the tensors' entries into one per module and set of agents present: every total,
    /// module figure and λ stays exactly as it was; only the per-tensor breakdown goes (a model
    /// of 10^5 tensors keeps a handful of entries instead).
    pub fn compact(&mut self) {
        self.tensors = compact(std::mem::take(&mut self.tensors));
    }

    /// The tensors of each [`boost_group`] of `scope`, in group order (the groups outside the
    /// layers by name, then the layers by number). Needs the per-tensor entries: call it before
    /// [`Self::compact`].
    fn boost_groups(&self, scope: BoostScope) -> Vec<(String, Group)> {
        let mut groups: BTreeMap<(Option<usize>, String), Vec<&TensorStats>> = BTreeMap::new();
        for t in &self.tensors {
            let Some(g) = boost_group(scope, t.part, t.module) else {
                continue;
            };
            let layer = g.strip_prefix("layer ").and_then(|n| n.parse().ok());
            groups.entry((layer, g)).or_default().push(t);
        }
        groups
            .into_iter()
            .map(|((_, name), tensors)| (name, self.group(tensors.into_iter())))
            .collect()
    }

    /// Each agent's unique and shared counts per [`boost_group`] of `scope` (see
    /// [`Self::boost_groups`]).
    pub fn group_agent_counts(&self, scope: BoostScope) -> Vec<(String, Vec<AgentCounts>)> {
        self.boost_groups(scope)
            .into_iter()
            .map(|(name, g)| (name, agent_counts(&g.counts)))
            .collect()
    }

    /// Per layer group (layer scope's groups) and agent: (density, unique share of its changes).
    pub fn layer_profile(&self) -> Vec<(String, Vec<(f64, f64)>)> {
        self.boost_groups(BoostScope::Layer)
            .into_iter()
            .map(|(name, g)| {
                let rows = agent_counts(&g.counts)
                    .iter()
                    .enumerate()
                    .map(|(t, c)| {
                        let changed = c.unique + c.shared;
                        (ratio(changed, g.numel[t]), ratio(c.unique, changed))
                    })
                    .collect();
                (name, rows)
            })
            .collect()
    }

    /// Counts summed over every tensor.
    pub fn total(&self) -> TileCounts {
        self.group(self.tensors.iter()).counts
    }

    /// Each agent's unique and shared counts over the whole model.
    pub fn total_agent_counts(&self) -> Vec<AgentCounts> {
        agent_counts(&self.total())
    }

    pub fn elements(&self) -> u64 {
        self.tensors.iter().map(|t| t.numel).sum()
    }

    fn modules(&self) -> BTreeMap<Module, Group> {
        let mut names: Vec<Module> = self.tensors.iter().map(|t| t.module).collect();
        names.sort();
        names.dedup();
        names
            .into_iter()
            .map(|m| (m, self.group(self.tensors.iter().filter(|t| t.module == m))))
            .collect()
    }

    fn agent_json(&self, g: &Group, with_lambdas: bool) -> Vec<Value> {
        let counts = agent_counts(&g.counts);
        (0..self.agents.len())
            .map(|t| {
                let c = counts[t];
                let changed = c.unique + c.shared;
                let mut v = json!({
                    "agent": self.agents[t],
                    "elements": g.numel[t],
                    "changed": changed,
                    "density": ratio(changed, g.numel[t]),
                    "unique": c.unique,
                    "shared": c.shared,
                    "rho": rho_json(c),
                    "shared_with_k_others": g.counts.row(t),
                });
                if with_lambdas {
                    let mut l = serde_json::Map::new();
                    l.insert("ram".into(), json!(1.0));
                    for (label, rule) in reported_rules() {
                        l.insert(
                            label.replace(' ', "_").replace('+', "_plus"),
                            json!(rule.lambda(c)),
                        );
                    }
                    v["lambda"] = Value::Object(l);
                }
                v
            })
            .collect()
    }

    /// The report as JSON; `per_tensor` adds the module and tensor breakdowns.
    pub fn to_json(&self, per_tensor: bool) -> Value {
        let total = self.group(self.tensors.iter());
        let mut v = json!({
            "epsilon": self.epsilon,
            "tensors": self.tensor_count,
            "elements": self.elements(),
            "agents": self.agent_json(&total, true),
        });
        if per_tensor {
            let modules: serde_json::Map<String, Value> = self
                .modules()
                .iter()
                .map(|(m, g)| {
                    (
                        m.name().to_string(),
                        json!({"agents": self.agent_json(g, false)}),
                    )
                })
                .collect();
            v["modules"] = Value::Object(modules);
            for scope in [BoostScope::Layer, BoostScope::Module] {
                let groups: Vec<Value> = self
                    .group_agent_counts(scope)
                    .into_iter()
                    .map(|(g, counts)| {
                        let l: Vec<f64> = counts.iter().map(|&c| group_rule().lambda(c)).collect();
                        json!({"group": g, "lambda_ram_plus_paper": l})
                    })
                    .collect();
                v[format!("lambda_by_{}", scope.name())] = Value::Array(groups);
            }
            v["per_tensor"] = self
                .tensors
                .iter()
                .map(|t| {
                    let g = self.group(std::iter::once(t));
                    let lambdas: Vec<f64> = t
                        .agent_counts()
                        .iter()
                        .map(|&c| tensor_rule().lambda(c))
                        .collect();
                    json!({
                        "name": &*t.name,
                        "module": t.module.name(),
                        "elements": t.numel,
                        "agents": self.agent_json(&g, false),
                        "lambda_ram_plus_tensor": lambdas,
                    })
                })
                .collect();
        }
        v
    }

    /// The report as text tables for a terminal.
    pub fn render_text(&self, per_tensor: bool) -> String {
        let n = self.agents.len();
        let total = self.group(self.tensors.iter());
        let counts = agent_counts(&total.counts);
        let mut s = String::new();
        let _ = writeln!(
            s,
            "{} agents, {} tensors, {} elements; changed means |τ| > ε = {:e}\n",
            n,
            self.tensor_count,
            self.elements(),
            self.epsilon
        );
        let _ = writeln!(
            s,
            "{:<4} {:>14} {:>9} {:>14} {:>14} {:>8} {:>11} {:>14}  path",
            "#", "changed", "density", "unique", "shared", "ρ", "λ ram+", "λ ram+"
        );
        let _ = writeln!(
            s,
            "{:<4} {:>14} {:>9} {:>14} {:>14} {:>8} {:>11} {:>14}",
            "", "", "", "", "", "", "(paper)", "(official)"
        );
        let [(_, paper), (_, official)] = reported_rules();
        for (t, c) in counts.iter().enumerate() {
            let changed = c.unique + c.shared;
            let _ = writeln!(
                s,
                "{:<4} {:>14} {:>8.2}% {:>14} {:>14} {:>8} {:>11.4} {:>14.4}  {}",
                t + 1,
                changed,
                100.0 * ratio(changed, total.numel[t]),
                c.unique,
                c.shared,
                rho_text(*c),
                paper.lambda(*c),
                official.lambda(*c),
                crate::escape::terminal(&self.agents[t])
            );
        }
        let _ = writeln!(
            s,
            "\nchanged and shared with k other agents (% of the agent's changed elements)"
        );
        let _ = write!(s, "{:<4}", "#");
        for k in 0..n {
            let _ = write!(s, " {:>16}", format!("k={k}"));
        }
        let _ = writeln!(s);
        for (t, c) in counts.iter().enumerate() {
            let changed = c.unique + c.shared;
            let _ = write!(s, "{:<4}", t + 1);
            for &v in total.counts.row(t) {
                let _ = write!(s, " {:>9} {:>5.1}%", v, 100.0 * ratio(v, changed));
            }
            let _ = writeln!(s);
        }
        if per_tensor {
            self.render_details(&mut s);
        }
        s
    }

    /// [`Self::render_text`]'s per-module, per-group and per-tensor tables.
    fn render_details(&self, s: &mut String) {
        let _ = writeln!(s, "\nby module: density (unique / shared) per agent");
        for (m, g) in self.modules() {
            let _ = write!(s, "{:<8}", m.name());
            for (t, c) in agent_counts(&g.counts).iter().enumerate() {
                let changed = c.unique + c.shared;
                let _ = write!(
                    s,
                    "  #{} {:>6.2}% ({}/{})",
                    t + 1,
                    100.0 * ratio(changed, g.numel[t]),
                    c.unique,
                    c.shared
                );
            }
            let _ = writeln!(s);
        }
        for scope in [BoostScope::Layer, BoostScope::Module] {
            let _ = writeln!(
                s,
                "\nλ under ram+ scope {} (rule paper, r = {}, α = {}) per agent",
                scope.name(),
                defaults::R,
                defaults::ALPHA_GLOBAL
            );
            for (g, counts) in self.group_agent_counts(scope) {
                let _ = write!(s, "{g:<10}");
                for (t, c) in counts.iter().enumerate() {
                    let _ = write!(s, "  #{} {:.4}", t + 1, group_rule().lambda(*c));
                }
                let _ = writeln!(s);
            }
        }
        let _ = writeln!(
            s,
            "\nby tensor: density per agent, and λ under ram+ scope tensor (r = {}, α = {})",
            defaults::R,
            defaults::ALPHA_TENSOR
        );
        for t in &self.tensors {
            let _ = write!(
                s,
                "{:<48} {:<7} {:>11}",
                crate::escape::terminal(&t.name),
                t.module.name(),
                t.numel
            );
            for (a, c) in t.agent_counts().iter().enumerate() {
                if t.has(a) {
                    let _ = write!(
                        s,
                        "  #{} {:>6.2}% λ {:.4}",
                        a + 1,
                        100.0 * ratio(c.unique + c.shared, t.numel),
                        tensor_rule().lambda(*c)
                    );
                } else {
                    let _ = write!(s, "  #{} missing", a + 1);
                }
            }
            let _ = writeln!(s);
        }
    }
}

fn ratio(a: u64, b: u64) -> f64 {
    if b == 0 {
        0.0
    } else {
        a as f64 / b as f64
    }
}

fn rho_json(c: AgentCounts) -> Value {
    let rho = c.overlap_ratio();
    if rho.is_infinite() {
        json!("inf")
    } else {
        json!(rho)
    }
}

fn rho_text(c: AgentCounts) -> String {
    let rho = c.overlap_ratio();
    if rho.is_infinite() {
        "inf".into()
    } else {
        format!("{rho:.4}")
    }
}

#[cfg(test)]
mod tests {
    use super::{Module, ProbeReport, TensorStats, TileCounts};

    #[test]
    fn compacting_keeps_every_total_and_module_figure() {
        let stats = |name: &str, numel: u64, present: u64, hist: Vec<u64>| TensorStats {
            name: name.into(),
            module: Module::of(name),
            part: crate::structure::Structure::default().part(name),
            numel,
            present,
            counts: TileCounts { agents: 2, hist },
        };
        let mut report = ProbeReport {
            agents: vec!["a".into(), "b".into()],
            epsilon: 1e-5,
            tensors: vec![
                stats(
                    "model.layers.0.mlp.up_proj.weight",
                    100,
                    0b11,
                    vec![5, 2, 7, 2],
                ),
                stats(
                    "model.layers.1.mlp.up_proj.weight",
                    50,
                    0b01,
                    vec![9, 0, 0, 0],
                ),
                stats(
                    "model.layers.1.mlp.down_proj.weight",
                    70,
                    0b11,
                    vec![1, 4, 3, 4],
                ),
                stats(
                    "model.layers.0.self_attn.q_proj.weight",
                    30,
                    0b11,
                    vec![0, 1, 2, 1],
                ),
            ],
            tensor_count: 4,
        };
        let (text, json) = (report.render_text(false), report.to_json(false));
        report.compact();
        assert_eq!(report.tensors.len(), 3, "mlp both, mlp a only, attn both");
        assert_eq!(report.render_text(false), text);
        assert_eq!(report.to_json(false), json);
    }
}
