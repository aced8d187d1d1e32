//! The plans of a sliced merge (mergekit's `slices`).

use super::*;
use crate::names::{Module, Stack};
use crate::structure::Part;

/// The output tensors of a sliced merge (see [`crate::slices`]): the embeddings and the towers
/// (vision, audio) whole from the first slice's lead, each slice's decoder layers renumbered
/// consecutively, then the other tensors outside the layers — the final norm, lm_head, the MTP
/// layers renumbered after the output's last — whole from the last slice's lead. Every source
/// must hold each tensor its slice's lead has, with the same shape. The output's config must be
/// able to say the slices' order of dense and MoE layers (checked here, before any byte is
/// written); `notes` says which model each module outside the decoder comes from.
pub(super) fn sliced_plans(
    base: &ModelFolder,
    agents: &[ModelFolder],
    slices: &Slices,
    reindex: Option<&Reindex>,
    notes: &mut Vec<String>,
) -> Result<Vec<TensorPlan>> {
    let mut planner = SlicePlanner {
        base,
        agents,
        slices,
        reindex,
        models: Vec::new(),
    };
    // Each model's config and decoder stack (the layers its config counts; another numbered
    // stack, such as a vision tower's, stays whole).
    for slice in &slices.0 {
        for src in &slice.sources {
            if !planner.models.iter().any(|(m, _, _)| *m == src.model) {
                let (config, stack) = planner.stack_of(src.model)?;
                planner.models.push((src.model, config, stack));
            }
        }
    }
    // The output's config must say the slices' order (a dense layer after a MoE one…): refused
    // now, before any tensor is planned.
    if let Some(config) = base.config() {
        let mut config = config.json().clone();
        slices.rewrite_config(&mut config, &|m| planner.config(m).clone())?;
    }
    let mut tensors = planner.outside(true)?;
    for (layer, (s, i)) in slices.output_layers().enumerate() {
        planner.layer(layer, s, i, &mut tensors)?;
    }
    tensors.extend(planner.outside(false)?);
    ensure!(!tensors.is_empty(), "the slices select no tensors");
    notes.extend(planner.owners_note(&tensors));
    Ok(tensors)
}

/// What planning the slices reads: the inputs, the slices, and each source model's config and
/// decoder stack.
struct SlicePlanner<'a> {
    base: &'a ModelFolder,
    agents: &'a [ModelFolder],
    slices: &'a Slices,
    reindex: Option<&'a Reindex<'a>>,
    models: Vec<(Source, serde_json::Value, LayerStack)>,
}

impl<'a> SlicePlanner<'a> {
    fn folder(&self, m: Source) -> &'a ModelFolder {
        match m {
            Source::Base => self.base,
            Source::Agent(t) => &self.agents[t],
        }
    }

    /// Model `m`'s config and decoder stack, from its tensor names and config.
    fn stack_of(&self, m: Source) -> Result<(serde_json::Value, LayerStack)> {
        let f = self.folder(m);
        let config = f
            .config()
            .with_context(|| {
                format!(
                    "{} has no config.json; slices need the model's config.json",
                    f.config_dir().display()
                )
            })?
            .json()
            .clone();
        let stack = LayerStack::find(
            f.tensors.iter().map(|t| &*t.entry.name),
            &config,
            &f.dir.display().to_string(),
        )?;
        Ok((config, stack))
    }

    fn model(&self, m: Source) -> &(Source, serde_json::Value, LayerStack) {
        self.models
            .iter()
            .find(|(x, _, _)| *x == m)
            .expect("every source's")
    }

    fn stack(&self, m: Source) -> &LayerStack {
        &self.model(m).2
    }

    fn config(&self, m: Source) -> &serde_json::Value {
        &self.model(m).1
    }

    /// One output tensor of slice `s` from its lead's tensor `lead_tensor`: in each other source,
    /// the tensor `source_name(the source, its first layer)`.
    fn plan(
        &self,
        s: usize,
        placement: Placement,
        lead_tensor: &ModelTensor,
        source_name: &dyn Fn(Source, usize) -> String,
        out_name: Arc<str>,
    ) -> Result<TensorPlan> {
        let (agents, slices) = (self.agents, self.slices);
        let lead = slices.lead(s);
        let bt = lead_tensor;
        let mut found: Vec<Option<u32>> = vec![None; agents.len()];
        for src in &slices.0[s].sources {
            let Source::Agent(t) = src.model else {
                continue;
            };
            let name = source_name(src.model, src.start);
            let Some(index) = agents[t].index_of(&name) else {
                bail!(
                    "slice {} takes tensor '{}' from {}, which does not have it",
                    s + 1,
                    crate::escape::terminal(&name),
                    agents[t].dir.display()
                );
            };
            let at = &agents[t].tensors[index];
            let reindexed = self
                .reindex
                .is_some_and(|r| r.indexed_by_token(bt, lead.model, at));
            if at.entry.shape != bt.entry.shape && !reindexed {
                bail!(
                    "tensor '{}' in {} is {} but in {} it is {} (slice {})",
                    at.entry.name,
                    agents[t].file_of(at).display(),
                    shape_text(&at.entry.shape),
                    self.folder(lead.model).file_of(bt).display(),
                    shape_text(&bt.entry.shape),
                    s + 1
                );
            }
            found[t] = Some(index as u32);
        }
        Ok(TensorPlan {
            base: bt.clone(),
            agents: found.into(),
            sliced: Some(SlicedTensor {
                name: out_name,
                base_from: match lead.model {
                    Source::Base => None,
                    Source::Agent(t) => Some(t),
                },
                placement,
            }),
            vocab: None,
        })
    }

    /// Tensors outside the decoder's layers from the first slice's lead (`first`: the embeddings
    /// and the towers) or the last's (the rest, MTP layers renumbered after the output's last).
    fn outside(&self, first: bool) -> Result<Vec<TensorPlan>> {
        let placement = self.slices.outside_layers(first);
        let lead = self.slices.lead(placement.slice).model;
        let mut plans = Vec::new();
        for t in &self.folder(lead).tensors {
            let name = &t.entry.name;
            let part = self.stack(lead).part(name);
            if part.decoder_layer().is_some() || from_first(part, name) != first {
                continue;
            }
            let mtp = self.stack(lead).mtp_of(name);
            let source_name = |m: Source, _| match mtp {
                Some(j) => {
                    let stack = self.stack(m);
                    stack.rename(name, stack.layers + j).unwrap_or_default()
                }
                None => name.to_string(),
            };
            let out: Arc<str> = match mtp {
                Some(j) => self
                    .stack(lead)
                    .rename(name, self.slices.layers() + j)
                    .unwrap_or_default()
                    .into(),
                None => name.clone(),
            };
            plans.push(self.plan(placement.slice, placement, t, &source_name, out)?);
        }
        Ok(plans)
    }

    /// Which model the modules outside the decoder's layers come from, where the first and the
    /// last slice's leads differ.
    fn owners_note(&self, tensors: &[TensorPlan]) -> Option<String> {
        let (first, last) = (
            self.slices.lead(0).model,
            self.slices.lead(self.slices.0.len() - 1).model,
        );
        if first == last {
            return None;
        }
        // The output's stack: the first lead's, with the slices' layer count.
        let output = self.stack(first).with_layers(self.slices.layers());
        let mut modules: [Vec<&str>; 2] = [Vec::new(), Vec::new()];
        for plan in tensors.iter().filter_map(|p| p.sliced.as_ref()) {
            let from_last = plan.placement.slice != 0;
            let Some(what) = module_words(output.part(&plan.name), &plan.name) else {
                continue;
            };
            if !modules[from_last as usize].contains(&what) {
                modules[from_last as usize].push(what);
            }
        }
        let model = |m: Source| self.folder(m).dir.display().to_string();
        Some(format!(
            "slices: {} come whole from {} (the first slice's model); {} from {} (the last \
             slice's)",
            words(&modules[0]),
            model(first),
            words(&modules[1]),
            model(last)
        ))
    }

    /// The tensors of output layer `layer`: layer `i` of slice `s`.
    fn layer(&self, layer: usize, s: usize, i: usize, tensors: &mut Vec<TensorPlan>) -> Result<()> {
        let lead = self.slices.lead(s);
        let lead_stack = self.stack(lead.model);
        for t in &self.folder(lead.model).tensors {
            if lead_stack.layer_of(&t.entry.name) != Some(lead.start + i) {
                continue;
            }
            // A tensor of a layer has a layer number to replace (every source of the base's
            // architecture names its stack alike).
            let out: Arc<str> = lead_stack
                .rename(&t.entry.name, layer)
                .unwrap_or_default()
                .into();
            let source_name = |_, start: usize| {
                lead_stack
                    .rename(&t.entry.name, start + i)
                    .unwrap_or_default()
            };
            tensors.push(self.plan(s, self.slices.placement(s, i), t, &source_name, out)?);
        }
        Ok(())
    }
}

/// Whether a tensor outside the decoder's layers comes from the first slice's model (mergekit's
/// "pre" weights: the embeddings, and the towers that feed them) or the last's (the final norm,
/// lm_head, and the MTP layers that read the last layer's output).
fn from_first(part: Part, name: &str) -> bool {
    match part.stack {
        Stack::Vision | Stack::Audio => true,
        Stack::Mtp => false,
        // Another numbered stack beside the decoder's (an encoder's) goes before it too.
        Stack::Decoder => {
            Module::of(name) == Module::Embed || crate::names::numbered(name).is_some()
        }
    }
}

/// The module an output tensor at `part` outside the decoder's layers is part of, in words;
/// `None` for a decoder layer's.
fn module_words(part: Part, out_name: &str) -> Option<&'static str> {
    Some(match part.stack {
        Stack::Decoder if part.layer.is_some() => return None,
        Stack::Decoder => match Module::of(out_name) {
            Module::Embed => "the embeddings",
            Module::Norm => "the final norm",
            Module::LmHead => "lm_head",
            _ => "the other tensors",
        },
        Stack::Mtp => "the MTP layers",
        Stack::Vision => "the vision tower",
        Stack::Audio => "the audio tower",
    })
}

/// "a, b and c".
fn words(list: &[&str]) -> String {
    match list {
        [] => "nothing".to_string(),
        [one] => one.to_string(),
        [rest @ .., last] => format!("{} and {last}", rest.join(", ")),
    }
}
