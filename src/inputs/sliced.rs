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
    let folder = |m: Source| match m {
        Source::Base => base,
        Source::Agent(t) => &agents[t],
    };
    // Each model's decoder stack (the layers its config counts; another numbered stack, such as
    // a vision tower's, stays whole and goes with the embeddings).
    let stack_of = |m: Source| -> Result<LayerStack> {
        let f = folder(m);
        let config = crate::checkpoint::folder_files::read_config(f.config_dir())
            .context("slices need the model's config.json")?;
        LayerStack::find(
            f.tensors.iter().map(|t| &*t.entry.name),
            &config,
            &f.dir.display().to_string(),
        )
    };
    let mut stacks: Vec<(Source, LayerStack)> = Vec::new();
    for slice in &slices.0 {
        for src in &slice.sources {
            if !stacks.iter().any(|(m, _)| *m == src.model) {
                stacks.push((src.model, stack_of(src.model)?));
            }
        }
    }
    let stack = |m: Source| {
        &stacks
            .iter()
            .find(|(x, _)| *x == m)
            .expect("every source's")
            .1
    };
    // One output tensor of slice `s` from its lead's tensor `lead_tensor`: in each other source,
    // the tensor `source_name(its first layer)`.
    let plan = |s: usize,
                placement: Placement,
                lead_tensor: &ModelTensor,
                source_name: &dyn Fn(usize) -> String,
                out_name: Arc<str>|
     -> Result<TensorPlan> {
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
            let reindexed = reindex.is_some_and(|r| r.indexed_by_token(bt, lead.model, at));
            if at.entry.shape != bt.entry.shape && !reindexed {
                bail!(
                    "tensor '{}' in {} is {} but in {} it is {} (slice {})",
                    at.entry.name,
                    agents[t].file_of(at).display(),
                    shape_text(&at.entry.shape),
                    folder(lead.model).file_of(bt).display(),
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
    };
    // Tensors outside the layers: the embeddings from the first slice's lead, the rest from
    // the last slice's.
    let outside = |embeddings: bool| -> Result<Vec<TensorPlan>> {
        let placement = slices.outside_layers(embeddings);
        let lead = slices.lead(placement.slice).model;
        let mut plans = Vec::new();
        for t in &folder(lead).tensors {
            let name = &t.entry.name;
            // Before the layers: the embeddings and other numbered stacks (a vision tower).
            let pre = is_embedding(name) || crate::names::numbered(name).is_some();
            if stack(lead).layer_of(name).is_some() || pre != embeddings {
                continue;
            }
            let name = t.entry.name.clone();
            let same = |_| name.to_string();
            plans.push(plan(placement.slice, placement, t, &same, name.clone())?);
        }
        Ok(plans)
    };
    let mut tensors = outside(true)?;
    for (layer, (s, i)) in slices.output_layers().enumerate() {
        let lead = slices.lead(s);
        let lead_stack = stack(lead.model);
        for t in &folder(lead.model).tensors {
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
            tensors.push(plan(s, slices.placement(s, i), t, &source_name, out)?);
        }
    }
    tensors.extend(outside(false)?);
    ensure!(!tensors.is_empty(), "the slices select no tensors");
    Ok(tensors)
}
