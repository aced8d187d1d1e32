//! An output tensor's plan: its base tensor and where each agent keeps its counterpart, and how
//! its tiles are sized.

use super::*;

/// One output tensor: its base tensor (θ₀, and the name, shape and dtype of the output) and where
/// each agent keeps its counterpart: its index in that agent's [`ModelFolder::tensors`] (`None`:
/// that agent lacks it). Indices, not copies: a model may have 10^5 tensors.
pub struct TensorPlan {
    /// The base's copy of the tensor.
    pub base: ModelTensor,
    /// Per agent: its index of the tensor in that agent's model, or `None` where it lacks it.
    pub agents: Box<[Option<u32>]>,
    /// Slices: the output name (layers renumbered; `None`: the base tensor's name), the agent
    /// whose folder holds `base` when a slice takes it from a model other than the base (methods
    /// without θ₀), and where the tensor sits among the slices.
    pub sliced: Option<SlicedTensor>,
    /// A tensor indexed by token whose rows are re-indexed for the output's vocabulary.
    pub vocab: Option<VocabPlan>,
}

/// A re-indexed tensor's rows ([`VocabTensor`]) and its output shape.
pub struct VocabPlan {
    /// Where each output row comes from.
    pub rows: VocabTensor,
    /// The output tensor's shape.
    pub shape: Arc<[usize]>,
}

/// What a sliced merge adds to a [`TensorPlan`].
pub struct SlicedTensor {
    /// The output tensor's name.
    pub name: Arc<str>,
    /// The agent whose layer stands in for the base's in this slice (`None`: the base's own).
    pub base_from: Option<usize>,
    /// The slice and the layer's place in it (for gradients over layers).
    pub placement: Placement,
}

impl TensorPlan {
    /// The output tensor's name.
    pub fn name(&self) -> &str {
        match &self.sliced {
            Some(s) => &s.name,
            None => &self.base.entry.name,
        }
    }

    /// [`Self::name`], shared.
    pub fn out_name(&self) -> Arc<str> {
        match &self.sliced {
            Some(s) => s.name.clone(),
            None => self.base.entry.name.clone(),
        }
    }

    /// The folder `base` is read from.
    pub fn base_folder<'a>(&self, inputs: &'a Inputs) -> &'a ModelFolder {
        match self.sliced.as_ref().and_then(|s| s.base_from) {
            Some(t) => &inputs.agents[t],
            None => &inputs.base,
        }
    }

    /// This tensor in a companion folder read beside the inputs (a Fisher folder, a merged
    /// output), which must hold it with the base's shape; `what` names the folder in errors.
    pub fn in_companion<'a>(&self, folder: &'a ModelFolder, what: &str) -> Result<&'a ModelTensor> {
        let Some(t) = folder.get(self.name()) else {
            bail!(
                "tensor '{}' is missing in the {what} {}",
                crate::escape::terminal(self.name()),
                folder.dir.display()
            );
        };
        ensure!(
            t.entry.shape == *self.shape(),
            "tensor '{}' in {} has shape {}, but the model's is {}",
            crate::escape::terminal(self.name()),
            folder.file_of(t).display(),
            shape_text(&t.entry.shape),
            shape_text(self.shape())
        );
        Ok(t)
    }

    /// Elements in the output tensor.
    pub fn numel(&self) -> usize {
        match &self.vocab {
            Some(v) => v.shape.iter().product(),
            None => self.base.entry.numel,
        }
    }

    /// The output tensor's shape: the base's, but for the rows of a re-indexed vocabulary.
    pub fn shape(&self) -> &Arc<[usize]> {
        match &self.vocab {
            Some(v) => &v.shape,
            None => &self.base.entry.shape,
        }
    }

    /// Which input `base` is read from.
    pub fn base_source(&self) -> Source {
        match self.sliced.as_ref().and_then(|s| s.base_from) {
            Some(t) => Source::Agent(t),
            None => Source::Base,
        }
    }

    /// Agent `t`'s counterpart, if it has one.
    pub fn agent<'a>(&self, inputs: &'a Inputs, t: usize) -> Option<&'a ModelTensor> {
        self.agents[t].map(|i| &inputs.agents[t].tensors[i as usize])
    }

    /// Whether agent `t`'s copy of the tensor is the base's own (a conversion: the one model is
    /// its own layout): the same folder, the same tensor, read alike (no adapter over it).
    pub fn agent_is_the_base(&self, inputs: &Inputs, t: usize) -> bool {
        let (agent, base) = (&inputs.agents[t], self.base_folder(inputs));
        agent.dir == base.dir
            && agent.lora.is_none()
            && base.lora.is_none()
            && self.agent(inputs, t).is_some_and(|a| {
                a.entry.name == self.base.entry.name && a.entry.dtype == self.base.entry.dtype
            })
    }

    /// The dtype its tiles are read in (SPEC §5): the base's when every agent holding the tensor
    /// has it too, else f32 — bf16 and f16 convert to f32 exactly, so inputs of mixed dtypes meet
    /// in f32 and the maths is that of every input first converted to f32.
    pub fn tile_dtype(&self, inputs: &Inputs) -> DType {
        let base = self.base.entry.dtype;
        // Re-indexed rows may be means, made in f32.
        if self.vocab.is_some() {
            return DType::F32;
        }
        // A LoRA agent's tensor is θ₀ plus its update, made in f32.
        let mixed = (0..self.agents.len())
            .filter_map(|t| Some((t, self.agent(inputs, t)?)))
            .any(|(t, a)| a.entry.dtype != base || inputs.agents[t].has_update(&a.entry.name));
        if mixed {
            DType::F32
        } else {
            base
        }
    }

    /// Bytes of the LoRA A/B pairs of this tensor's agents, as stored.
    pub fn lora_bytes(&self, inputs: &Inputs) -> usize {
        (0..self.agents.len())
            .filter_map(|t| {
                let name = &self.agent(inputs, t)?.entry.name;
                inputs.agents[t].lora.as_ref()?.update(name)
            })
            .map(|u| u.stored_bytes())
            .sum()
    }

    /// Global indices of the agents that have this tensor.
    pub fn present(&self) -> Vec<usize> {
        (0..self.agents.len())
            .filter(|&t| self.agents[t].is_some())
            .collect()
    }
}

/// The output tensors of a merge of whole models: every base tensor, with where each agent keeps
/// it. A tensor some agent lacks, or one an agent has and the base lacks, is refused unless
/// `layout.allow_missing_tensors` (then a warning); shapes must agree, or a token-indexed tensor is
/// re-indexed (`reindex`).
pub(super) fn whole_model_plans(
    base: &ModelFolder,
    agents: &[ModelFolder],
    layout: Layout,
    reindex: Option<&Reindex>,
    base_config: Option<&serde_json::Value>,
    warnings: &mut Vec<String>,
) -> Result<Vec<TensorPlan>> {
    let mut tensors = Vec::with_capacity(base.tensors.len());
    for bt in &base.tensors {
        let mut found = Vec::with_capacity(agents.len());
        for agent in agents {
            let Some(index) = agent.index_of(&bt.entry.name) else {
                found.push(None);
                continue;
            };
            let at = &agent.tensors[index];
            // Dtypes may differ (each input is decoded exactly to f32: `tile_dtype`);
            // rows of a token-indexed tensor too, when re-indexed.
            let reindexed = reindex
                .as_ref()
                .is_some_and(|r| r.indexed_by_token(bt, Source::Base, at));
            if at.entry.shape != bt.entry.shape && !reindexed {
                return Err(shape_mismatch(base, bt, agent, at, layout, base_config));
            }
            found.push(Some(index as u32));
        }
        note_missing(bt, &found, agents, layout, warnings)?;
        tensors.push(TensorPlan {
            base: bt.clone(),
            agents: found.into(),
            sliced: None,
            vocab: None,
        });
    }
    if let Some(r) = reindex {
        r.plan_all(base, agents, &mut tensors, warnings)?;
    }
    for agent in agents {
        refuse_extra(base, agent, layout, warnings)?;
    }
    Ok(tensors)
}

/// Base tensor `bt` and agent `agent`'s `at` differ in shape: the error, naming the config key
/// where the architectures differ, or the tokenizer setting when only the vocabulary does.
fn shape_mismatch(
    base: &ModelFolder,
    bt: &ModelTensor,
    agent: &ModelFolder,
    at: &ModelTensor,
    layout: Layout,
    base_config: Option<&serde_json::Value>,
) -> anyhow::Error {
    // Embeddings that differ in rows alone: a vocabulary that grew.
    let by_token = is_token_indexed(&bt.entry.name)
        && at.entry.shape.len() == bt.entry.shape.len()
        && at.entry.shape[1..] == bt.entry.shape[1..];
    let rows_only = layout.tokenizer.is_none() && by_token;
    // With a tokenizer source, a token-indexed tensor not re-indexed: its rows
    // are not its model's config vocab_size.
    if layout.tokenizer.is_some() && by_token {
        let vocab = base_config.and_then(crate::vocabulary::config_vocab_size);
        return anyhow::anyhow!(
            "tensor '{}' has {} rows in {} and {} in the base {}: a tokenizer \
             source re-indexes the tensors whose rows are their model's \
             config.json vocab_size, and the base's says {}; make each model's \
             vocab_size its embedding rows",
            crate::escape::terminal(&bt.entry.name),
            at.entry.shape[0],
            agent.file_of(at).display(),
            bt.entry.shape[0],
            base.file_of(bt).display(),
            vocab.map_or("none".to_string(), |v| v.to_string())
        );
    }
    anyhow::anyhow!(
        "tensor '{}' in {} is {} {} but in the base ({}) it is {} {}{}",
        bt.entry.name,
        agent.file_of(at).display(),
        at.entry.dtype,
        shape_text(&at.entry.shape),
        base.file_of(bt).display(),
        bt.entry.dtype,
        shape_text(&bt.entry.shape),
        if rows_only {
            "; its vocabulary differs from the base's: set tokenizer_source \
             (union, base or model:NAME) in a recipe to merge the embeddings \
             token by token"
                .to_string()
        } else {
            architecture_key_of(base_config, &bt.entry.shape, &at.entry.shape)
        }
    )
}

/// Base tensor `bt` missing in some agents (`found`): an error unless `--allow-missing-tensors`,
/// then a warning saying how it is merged.
fn note_missing(
    bt: &ModelTensor,
    found: &[Option<u32>],
    agents: &[ModelFolder],
    layout: Layout,
    warnings: &mut Vec<String>,
) -> Result<()> {
    let missing: Vec<String> = found
        .iter()
        .enumerate()
        .filter(|(_, f)| f.is_none())
        .map(|(t, _)| agents[t].dir.display().to_string())
        .collect();
    if !missing.is_empty() {
        if !layout.allow_missing_tensors {
            return Err(usage(crate::message![
                format!(
                    "tensor '{}' of the base is missing in {}: an agent of the same \
                     architecture has every tensor of its base; pass ",
                    crate::escape::terminal(&bt.entry.name),
                    missing.join(", ")
                ),
                crate::error::Arg::switch("allow-missing-tensors"),
                " to merge it from the models that have it",
            ]));
        }
        let what = if missing.len() == agents.len() {
            "kept from the base".to_string()
        } else {
            "merged from the agents that have it".to_string()
        };
        warnings.push(format!(
            "tensor '{}' is missing in {}; {what}",
            bt.entry.name,
            missing.join(", ")
        ));
    }
    Ok(())
}

/// Tensors `agent` has and the base lacks: an error unless `--allow-missing-tensors`, then a
/// warning (they are ignored).
fn refuse_extra(
    base: &ModelFolder,
    agent: &ModelFolder,
    layout: Layout,
    warnings: &mut Vec<String>,
) -> Result<()> {
    let extra: Vec<&str> = agent
        .tensors
        .iter()
        .filter(|t| base.get(&t.entry.name).is_none())
        .map(|t| &*t.entry.name)
        .collect();
    if let Some(first) = extra.first() {
        if !layout.allow_missing_tensors {
            return Err(usage(crate::message![
                format!(
                    "{} has {} tensor(s) the base lacks (first: '{}'): an agent of the same \
                     architecture has only its base's tensors; pass ",
                    agent.dir.display(),
                    extra.len(),
                    crate::escape::terminal(first)
                ),
                crate::error::Arg::switch("allow-missing-tensors"),
                " to ignore them",
            ]));
        }
        warnings.push(format!(
            "{} has {} tensor(s) the base lacks (first: '{first}'); they are ignored",
            agent.dir.display(),
            extra.len()
        ));
    }
    Ok(())
}
