//! The plans of a sliced merge (mergekit's `slices`).

use super::*;

/// The output tensors of a sliced merge (see [`crate::slices`]): the embeddings from the first
/// slice's sources, each slice's layers renumbered consecutively, then the other tensors outside
/// the layers from the last slice's sources. Every source must hold each tensor its slice's lead
/// has, with the same shape.
pub(super) fn sliced_plans(
    base: &ModelFolder,
    agents: &[ModelFolder],
    slices: &Slices,
    reindex: Option<&Reindex>,
) -> Result<Vec<TensorPlan>> {
    let mut planner = SlicePlanner {
        base,
        agents,
        slices,
        reindex,
        stacks: Vec::new(),
    };
    // Each model's decoder stack (the layers its config counts; another numbered stack, such as
    // a vision tower's, stays whole and goes with the embeddings).
    for slice in &slices.0 {
        for src in &slice.sources {
            if !planner.stacks.iter().any(|(m, _)| *m == src.model) {
                let stack = planner.stack_of(src.model)?;
                planner.stacks.push((src.model, stack));
            }
        }
    }
    let mut tensors = planner.outside(true)?;
    for (layer, (s, i)) in slices.output_layers().enumerate() {
        planner.layer(layer, s, i, &mut tensors)?;
    }
    tensors.extend(planner.outside(false)?);
    ensure!(!tensors.is_empty(), "the slices select no tensors");
    Ok(tensors)
}

/// What planning the slices reads: the inputs, the slices, and each source model's decoder stack.
struct SlicePlanner<'a> {
    base: &'a ModelFolder,
    agents: &'a [ModelFolder],
    slices: &'a Slices,
    reindex: Option<&'a Reindex<'a>>,
    stacks: Vec<(Source, LayerStack)>,
}

impl<'a> SlicePlanner<'a> {
    fn folder(&self, m: Source) -> &'a ModelFolder {
        match m {
            Source::Base => self.base,
            Source::Agent(t) => &self.agents[t],
        }
    }

    /// Model `m`'s decoder stack, from its tensor names and config.
    fn stack_of(&self, m: Source) -> Result<LayerStack> {
        let f = self.folder(m);
        let config = crate::checkpoint::folder_files::read_config(f.config_dir())
            .context("slices need the model's config.json")?;
        LayerStack::find(
            f.tensors.iter().map(|t| &*t.entry.name),
            &config,
            &f.dir.display().to_string(),
        )
    }

    fn stack(&self, m: Source) -> &LayerStack {
        &self
            .stacks
            .iter()
            .find(|(x, _)| *x == m)
            .expect("every source's")
            .1
    }

    /// One output tensor of slice `s` from its lead's tensor `lead_tensor`: in each other source,
    /// the tensor `source_name(its first layer)`.
    fn plan(
        &self,
        s: usize,
        placement: Placement,
        lead_tensor: &ModelTensor,
        source_name: &dyn Fn(usize) -> String,
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
            let name = source_name(src.start);
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

    /// Tensors outside the layers: the embeddings from the first slice's lead, the rest from the
    /// last slice's.
    fn outside(&self, embeddings: bool) -> Result<Vec<TensorPlan>> {
        let placement = self.slices.outside_layers(embeddings);
        let lead = self.slices.lead(placement.slice).model;
        let mut plans = Vec::new();
        for t in &self.folder(lead).tensors {
            let name = &t.entry.name;
            // Before the layers: the embeddings and other numbered stacks (a vision tower).
            let pre = is_embedding(name) || crate::names::numbered(name).is_some();
            if self.stack(lead).layer_of(name).is_some() || pre != embeddings {
                continue;
            }
            let name = t.entry.name.clone();
            let same = |_| name.to_string();
            plans.push(self.plan(placement.slice, placement, t, &same, name.clone())?);
        }
        Ok(plans)
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
            let source_name = |start: usize| {
                lead_stack
                    .rename(&t.entry.name, start + i)
                    .unwrap_or_default()
            };
            tensors.push(self.plan(s, self.slices.placement(s, i), t, &source_name, out)?);
        }
        Ok(())
    }
}
