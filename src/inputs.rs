//! The inputs of a merge: the base and the agent folders, opened and checked against each other,
//! and the plan of which agents hold each base tensor.

use crate::checkpoint::safetensors_file::shape_text;
use crate::checkpoint::safetensors_file::Interner;
use crate::checkpoint::{DType, ModelFolder, ModelTensor};
use crate::error::usage;
use crate::method::{self};
use crate::names::{is_embedding, is_token_indexed};
use crate::record::InputChecksums;
use crate::slices::{LayerStack, Placement, Slices, Source};
use crate::vocabulary::{TokenizerSettings, VocabTensor, Vocabulary};
use anyhow::{bail, ensure, Context, Result};
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// The base and the agents, opened and checked against each other.
pub struct Inputs {
    pub base: ModelFolder,
    pub agents: Vec<ModelFolder>,
    /// Tensors to merge, in the base's storage order.
    pub tensors: Vec<TensorPlan>,
    /// Things the user should know (tensors missing in some agents, extra tensors ignored).
    pub warnings: Vec<String>,
    /// mergekit's `slices`, when the output's layers are taken from ranges of the inputs'.
    pub slices: Option<Slices>,
    /// The output's vocabulary when a tokenizer source is set (mergekit's `tokenizer_source`).
    pub vocabulary: Option<Arc<Vocabulary>>,
    /// Bytes of the largest set of LoRA A/B pairs one tensor's tiles hold (0: no LoRA agent),
    /// which the tiles of the merge leave room for ([`TensorPlan::tile_elems`]).
    pub lora_room: usize,
    /// The user let tensors missing in some models through ([`Layout::allow_missing_tensors`]).
    pub allow_missing_tensors: bool,
    /// Stops the passes over these inputs between tiles (see [`crate::cancel`]): the token of
    /// the thread that opened them.
    pub cancel: crate::cancel::Token,
}

/// What shapes the output beyond the base's tensors: mergekit's slices and tokenizer source.
#[derive(Clone, Copy, Default)]
pub struct Layout<'a> {
    pub slices: Option<&'a Slices>,
    pub tokenizer: Option<&'a TokenizerSettings>,
    /// Whether θ₀ enters the merge: a token some model lacks then takes the base's row first.
    pub with_base: bool,
    /// Tensors some agent lacks, or has and the base lacks, are merged from the models that have
    /// them (or ignored) with a warning instead of refused (`--allow-missing-tensors`).
    pub allow_missing_tensors: bool,
}

/// One output tensor: its base tensor (θ₀, and the name, shape and dtype of the output) and where
/// each agent keeps its counterpart: its index in that agent's [`ModelFolder::tensors`] (`None`:
/// that agent lacks it). Indices, not copies: a model may have 10^5 tensors.
pub struct TensorPlan {
    pub base: ModelTensor,
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
    pub rows: VocabTensor,
    pub shape: Arc<[usize]>,
}

/// What a sliced merge adds to a [`TensorPlan`].
pub struct SlicedTensor {
    pub name: Arc<str>,
    pub base_from: Option<usize>,
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

    /// Elements per tile of this tensor in a pass of `workers` workers whose tiles hold `elems`
    /// elements of each input: as many as keep the pass's bytes what they are when every input is
    /// stored like the base. Tiles read in f32 from a 16-bit base (mixed dtypes, LoRA agents,
    /// re-indexed rows) hold half as many elements. A LoRA merge holds the A/B pairs of one
    /// tensor at a time, shared by the workers on it (the tile loop starts a LoRA tensor only
    /// once the one before is done, [`crate::engine`]'s `par_tiles`), so every tile of the merge
    /// leaves room for a worker's share of the largest ([`Inputs::lora_room`] / `workers`): tile
    /// buffers, which workers keep from tensor to tensor, plus the pairs then never exceed the
    /// full checkpoints' tiles, while that share leaves a run. Cut for pairs to whole runs of
    /// [`Self::TILE_QUANTUM`] elements, never below one run (nor below the widened size, when
    /// that is smaller).
    pub fn tile_elems(&self, inputs: &Inputs, elems: usize, workers: usize) -> usize {
        let readers = 1 + self.present().len();
        let budget = readers * elems.max(1) * self.base.entry.dtype.size();
        let per_elem = readers * self.tile_dtype(inputs).size();
        let widened = (budget / per_elem).max(1);
        let reserve = inputs.lora_room.div_ceil(workers.max(1));
        let q = Self::TILE_QUANTUM;
        if reserve == 0 || widened <= q {
            return widened;
        }
        let fit = budget.saturating_sub(reserve) / per_elem;
        (fit - fit % q).max(q)
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

    /// The run tiles are cut to when [`Self::tile_elems`] shrinks them: a statistics scan's chunk,
    /// so chunks still start at its multiples ([`crate::scans::Scans::any_order`]).
    pub const TILE_QUANTUM: usize = crate::scans::SCAN_CHUNK;

    /// Global indices of the agents that have this tensor.
    pub fn present(&self) -> Vec<usize> {
        (0..self.agents.len())
            .filter(|&t| self.agents[t].is_some())
            .collect()
    }
}

impl Inputs {
    /// Opens every folder and checks each agent tensor's shape against the base's.
    pub fn open(base_dir: &Path, agent_dirs: &[PathBuf]) -> Result<Inputs> {
        Inputs::open_with(base_dir, agent_dirs, Layout::default())
    }

    /// [`Inputs::open`], the output's layers taken from `layout.slices` and its vocabulary from
    /// `layout.tokenizer` when given.
    pub fn open_with(base_dir: &Path, agent_dirs: &[PathBuf], layout: Layout) -> Result<Inputs> {
        ensure!(
            !agent_dirs.is_empty(),
            "at least one agent model is needed (--model DIR)"
        );
        if agent_dirs.len() > method::MAX_AGENTS {
            return Err(usage(format!(
                "at most {} agent models can be handled at once, got {}",
                method::MAX_AGENTS,
                agent_dirs.len()
            )));
        }
        refuse_repeated_agents(agent_dirs)?;
        // One copy of each tensor name and shape for all models.
        let mut interner = crate::checkpoint::safetensors_file::Interner::default();
        let base = ModelFolder::open_interned(base_dir, &mut interner)
            .context("cannot open the base model")?;
        ensure!(
            !base.tensors.is_empty(),
            "the base model {} has no tensors (its header is empty)",
            base_dir.display()
        );
        let agents = agent_dirs
            .iter()
            .map(|d| open_agent(base_dir, d, &mut interner))
            .collect::<Result<Vec<_>>>()?;
        for agent in &agents {
            if !agent
                .tensors
                .iter()
                .any(|t| base.get(&t.entry.name).is_some())
            {
                bail!(
                    "{} has none of the base's tensor names (agent: '{}', base: '{}'); was it \
                     fine-tuned from {}, and saved with the same names?",
                    agent.dir.display(),
                    agent.tensors.first().map_or("", |t| &*t.entry.name),
                    base.tensors[0].entry.name,
                    base_dir.display()
                );
            }
        }
        let base_config = refuse_other_architectures(&base, &agents, layout)?;
        let mut warnings = check_adapters_base(&base, &agents)?;
        let vocabulary = layout
            .tokenizer
            .map(|t| Vocabulary::build(t, &base, &agents).map(Arc::new))
            .transpose()
            .context("cannot build the output's vocabulary")?;
        let reindex = vocabulary.as_ref().map(|v| Reindex {
            vocabulary: v,
            with_base: layout.with_base,
        });
        warnings.extend(vocabulary.iter().flat_map(|v| v.warnings.iter().cloned()));
        if let Some(slices) = layout.slices {
            let mut tensors = sliced_plans(&base, &agents, slices, reindex.as_ref())?;
            if let Some(r) = &reindex {
                r.plan_all(&base, &agents, &mut tensors, &mut warnings)?;
            }
            return Ok(Inputs {
                base,
                agents,
                tensors,
                warnings,
                slices: Some(slices.clone()),
                vocabulary,
                lora_room: 0,
                allow_missing_tensors: layout.allow_missing_tensors,
                cancel: crate::cancel::current(),
            }
            .with_lora_room());
        }
        let mut tensors = Vec::with_capacity(base.tensors.len());
        for bt in &base.tensors {
            let mut found = Vec::with_capacity(agents.len());
            for agent in &agents {
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
                    // Embeddings that differ in rows alone: a vocabulary that grew.
                    let by_token = is_token_indexed(&bt.entry.name)
                        && at.entry.shape.len() == bt.entry.shape.len()
                        && at.entry.shape[1..] == bt.entry.shape[1..];
                    let rows_only = layout.tokenizer.is_none() && by_token;
                    // With a tokenizer source, a token-indexed tensor not re-indexed: its rows
                    // are not its model's config vocab_size.
                    if layout.tokenizer.is_some() && by_token {
                        let vocab = base_config
                            .as_ref()
                            .and_then(crate::vocabulary::config_vocab_size);
                        bail!(
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
                    bail!(
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
                            architecture_key_of(
                                base_config.as_ref(),
                                &bt.entry.shape,
                                &at.entry.shape,
                            )
                        }
                    );
                }
                found.push(Some(index as u32));
            }
            let missing: Vec<String> = found
                .iter()
                .enumerate()
                .filter(|(_, f)| f.is_none())
                .map(|(t, _)| agents[t].dir.display().to_string())
                .collect();
            if !missing.is_empty() {
                if !layout.allow_missing_tensors {
                    return Err(usage(format!(
                        "tensor '{}' of the base is missing in {}: an agent of the same \
                         architecture has every tensor of its base; pass --allow-missing-tensors \
                         to merge it from the models that have it",
                        crate::escape::terminal(&bt.entry.name),
                        missing.join(", ")
                    )));
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
            tensors.push(TensorPlan {
                base: bt.clone(),
                agents: found.into(),
                sliced: None,
                vocab: None,
            });
        }
        if let Some(r) = &reindex {
            r.plan_all(&base, &agents, &mut tensors, &mut warnings)?;
        }
        for agent in &agents {
            let extra: Vec<&str> = agent
                .tensors
                .iter()
                .filter(|t| base.get(&t.entry.name).is_none())
                .map(|t| &*t.entry.name)
                .collect();
            if let Some(first) = extra.first() {
                if !layout.allow_missing_tensors {
                    return Err(usage(format!(
                        "{} has {} tensor(s) the base lacks (first: '{}'): an agent of the same \
                         architecture has only its base's tensors; pass --allow-missing-tensors \
                         to ignore them",
                        agent.dir.display(),
                        extra.len(),
                        crate::escape::terminal(first)
                    )));
                }
                warnings.push(format!(
                    "{} has {} tensor(s) the base lacks (first: '{first}'); they are ignored",
                    agent.dir.display(),
                    extra.len()
                ));
            }
        }
        Ok(Inputs {
            base,
            agents,
            tensors,
            warnings,
            slices: None,
            vocabulary,
            lora_room: 0,
            allow_missing_tensors: layout.allow_missing_tensors,
            cancel: crate::cancel::current(),
        }
        .with_lora_room())
    }

    /// Sets [`Self::lora_room`] from the planned tensors.
    fn with_lora_room(mut self) -> Inputs {
        self.lora_room = self
            .tensors
            .iter()
            .map(|p| p.lora_bytes(&self))
            .max()
            .unwrap_or(0);
        self
    }

    /// Refuses the base given as an agent too, for every use that takes task vectors against
    /// it (all but methods without a base, which merge the models themselves).
    pub fn refuse_base_as_agent(&self) -> Result<()> {
        let base = real_path(&self.base.dir);
        match self.agents.iter().find(|a| real_path(&a.dir) == base) {
            Some(a) => Err(usage(format!(
                "--model {} is the base model {}; its task vector is zero — give each agent \
                 once, and not the base",
                a.dir.display(),
                self.base.dir.display()
            ))),
            None => Ok(()),
        }
    }

    /// Drops the LoRA agents' A and B matrices held for `plan`'s tensor, whose tiles are all
    /// read.
    pub fn forget_lora_tensor(&self, plan: &TensorPlan) {
        for t in plan.present() {
            if let (Some(l), Some(at)) = (&self.agents[t].lora, plan.agent(self, t)) {
                l.forget_one(&at.entry.name);
            }
        }
    }

    /// Drops the LoRA agents' A and B matrices held for the tensors just merged.
    pub fn forget_lora_matrices(&self) {
        self.agents
            .iter()
            .filter_map(|a| a.lora.as_ref())
            .for_each(|l| l.forget());
    }

    /// Bytes of tensor data one pass reads (base + every agent tensor).
    pub fn pass_bytes(&self) -> u64 {
        self.tensors
            .iter()
            // A re-indexed tensor's tiles count in output rows, at the base's element size.
            .map(|t| {
                (t.numel() * t.base.entry.dtype.size()) as u64 * (1 + t.present().len() as u64)
            })
            .sum()
    }

    /// Fails if any input file changed since it was opened.
    pub fn check_unchanged(&self) -> Result<()> {
        std::iter::once(&self.base)
            .chain(&self.agents)
            .try_for_each(|m| m.check_unchanged())
    }

    /// Every input folder and weight file (which may be links to elsewhere, as in the Hugging
    /// Face cache): what an output must never overlap.
    pub fn paths(&self) -> Vec<PathBuf> {
        std::iter::once(&self.base)
            .chain(&self.agents)
            .flat_map(ModelFolder::paths)
            .collect()
    }

    pub fn agent_labels(&self) -> Vec<String> {
        self.agents
            .iter()
            .map(|a| a.dir.display().to_string())
            .collect()
    }
}

/// The output tensors of a sliced merge (see [`crate::slices`]): the embeddings from the first
/// slice's sources, each slice's layers renumbered consecutively, then the other tensors outside
/// the layers from the last slice's sources. Every source must hold each tensor its slice's lead
/// has, with the same shape.
fn sliced_plans(
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

/// Re-indexing token-indexed tensors for the output's vocabulary.
struct Reindex<'a> {
    vocabulary: &'a Arc<Vocabulary>,
    with_base: bool,
}

impl Reindex<'_> {
    /// Whether tensor `bt` of model `of` is indexed by token (an embedding or output head of that
    /// model's vocab_size rows), and agent tensor `at` its counterpart: the same dimensions but
    /// the first.
    fn indexed_by_token(&self, bt: &ModelTensor, of: Source, at: &ModelTensor) -> bool {
        self.is_token_tensor(bt, of)
            && at.entry.shape.len() == bt.entry.shape.len()
            && at.entry.shape[1..] == bt.entry.shape[1..]
    }

    fn is_token_tensor(&self, bt: &ModelTensor, of: Source) -> bool {
        is_token_indexed(&bt.entry.name)
            && bt.entry.shape.len() >= 2
            && bt.entry.shape[0] == self.vocabulary.vocab_size(of)
    }

    /// Plans the re-indexed reads of every token-indexed tensor in `plans` (those whose rows
    /// all stay where they are are read as they are).
    fn plan_all(
        &self,
        base: &ModelFolder,
        agents: &[ModelFolder],
        plans: &mut [TensorPlan],
        warnings: &mut Vec<String>,
    ) -> Result<()> {
        for plan in plans.iter_mut() {
            if !self.is_token_tensor(&plan.base, plan.base_source()) {
                continue;
            }
            let lead = plan.base_source();
            let mut models: Vec<Source> = Vec::new();
            if self.with_base || plan.present().is_empty() {
                models.push(lead);
            }
            for t in plan.present() {
                if !models.contains(&Source::Agent(t)) {
                    models.push(Source::Agent(t));
                }
            }
            let rows_of = |s: Source| -> usize {
                if s == lead {
                    return plan.base.entry.shape[0];
                }
                match s {
                    Source::Agent(t) => {
                        plan.agents[t].map_or(0, |i| agents[t].tensors[i as usize].entry.shape[0])
                    }
                    Source::Base => base
                        .get(&plan.base.entry.name)
                        .map_or(0, |t| t.entry.shape[0]),
                }
            };
            let row_len: usize = plan.base.entry.shape[1..].iter().product();
            let rows = self
                .vocabulary
                .plan_tensor(plan.name(), &models, row_len, &rows_of)?;
            if self.vocabulary.keeps_rows(&rows, &models, &rows_of) {
                continue;
            }
            if !rows.missing_everywhere.is_empty() {
                warnings.push(format!(
                    "tensor '{}': no merged model has token(s) {:?}; their rows are zero",
                    plan.name(),
                    rows.missing_everywhere
                ));
            }
            if rows.rows() < plan.base.entry.shape[0]
                && self.vocabulary.settings.pad_to_multiple_of.is_none()
            {
                warnings.push(format!(
                    "tensor '{}' gets {} rows, one per token of the output's tokenizer, where \
                     the base has {} (as mergekit sizes it); a recipe's tokenizer.pad_to_multiple_of \
                     (e.g. 64) keeps padding rows",
                    plan.name(),
                    rows.rows(),
                    plan.base.entry.shape[0]
                ));
            }
            let mut shape = plan.base.entry.shape.to_vec();
            shape[0] = rows.rows();
            plan.vocab = Some(VocabPlan {
                rows,
                shape: shape.into(),
            });
        }
        Ok(())
    }
}

/// An agent folder, or a LoRA agent: an adapter folder, or `BASE+ADAPTER` whose BASE is the
/// merge's base (the adapter is applied to it).
fn open_agent(base_dir: &Path, dir: &Path, interner: &mut Interner) -> Result<ModelFolder> {
    use crate::checkpoint::lora::{is_adapter, split_reference};
    let text = dir.to_string_lossy();
    let adapter = match split_reference(&text) {
        Some((base, adapter)) => {
            if real_path(Path::new(base)) != real_path(base_dir) {
                return Err(usage(format!(
                    "LoRA agent {text}: its base {base} is not the merge's base {}; an adapter \
                     is applied to the merge's base",
                    base_dir.display()
                )));
            }
            if !is_adapter(Path::new(adapter)) {
                bail!(
                    "LoRA agent {text}: {adapter} is not a PEFT adapter folder (no {} beside \
                     {})",
                    crate::checkpoint::files::ADAPTER_CONFIG,
                    crate::checkpoint::files::ADAPTER_WEIGHTS
                );
            }
            Some(PathBuf::from(adapter))
        }
        None => is_adapter(dir).then(|| dir.to_path_buf()),
    };
    match adapter {
        Some(a) => ModelFolder::open_lora(base_dir, &a, interner)
            .with_context(|| format!("cannot open the LoRA agent {}", a.display())),
        None => ModelFolder::open_interned(dir, interner).context("cannot open an agent model"),
    }
}

/// Refuses an agent whose `config.json` gives another architecture than the base's (a key of
/// [`crate::checkpoint::folder_files::ARCHITECTURE_KEYS`] differs): its tensors would otherwise
/// merge by name into a model neither of them is. The layer count may differ in slices (each slice
/// names its layers), the vocabulary with a tokenizer source (rows are re-indexed). Agents without
/// a config.json (and LoRA agents, which are the base) are compared by their tensors alone.
/// Returns the base's config, when it has one.
fn refuse_other_architectures(
    base: &ModelFolder,
    agents: &[ModelFolder],
    layout: Layout,
) -> Result<Option<serde_json::Value>> {
    use crate::checkpoint::folder_files::{architecture_difference, read_config};
    let config_of = |m: &ModelFolder| -> Result<Option<serde_json::Value>> {
        if m.lora.is_some() || m.dir.join("config.json").symlink_metadata().is_err() {
            return Ok(None);
        }
        read_config(&m.dir).map(Some)
    };
    let Some(base_config) = config_of(base)? else {
        return Ok(None);
    };
    let mut skip = Vec::new();
    if layout.slices.is_some() {
        skip.push("num_hidden_layers");
    }
    if layout.tokenizer.is_some() {
        skip.push("vocab_size");
    }
    for agent in agents {
        let Some(config) = config_of(agent)? else {
            continue;
        };
        if let Some((key, b, a)) = architecture_difference(&base_config, &config, &skip) {
            return Err(usage(format!(
                "{} is a different architecture from the base {}: config.json key '{key}' is {a} \
                 there and {b} in the base; rlmerge merges agents fine-tuned from the base{}",
                agent.dir.display(),
                base.dir.display(),
                if key.ends_with("vocab_size") {
                    " (an agent that added tokens: set tokenizer_source — union, base or \
                     model:NAME — to merge the embeddings token by token)"
                } else {
                    ""
                }
            )));
        }
    }
    Ok(Some(base_config))
}

/// For a tensor whose shape differs between the base and an agent: the base config's
/// architecture key whose value is a dimension that differs (`; a different architecture: …`).
fn architecture_key_of(
    config: Option<&serde_json::Value>,
    base_shape: &[usize],
    agent_shape: &[usize],
) -> String {
    let differing = base_shape
        .iter()
        .zip(agent_shape)
        .filter(|(b, a)| b != a)
        .map(|(b, _)| *b as u64);
    let key = config.and_then(|c| {
        differing.clone().find_map(|d| {
            crate::checkpoint::folder_files::ARCHITECTURE_KEYS
                .iter()
                .find(|k| c.get(**k).and_then(|v| v.as_u64()) == Some(d))
        })
    });
    match key {
        Some(k) => format!(
            "; a different architecture: the base's config.json key '{k}' is {}",
            config
                .and_then(|c| c.get(*k))
                .map_or(String::new(), |v| v.to_string())
        ),
        None if base_shape.len() != agent_shape.len() => "; a different architecture".into(),
        None => "; a different architecture (another layer size than the base's)".into(),
    }
}

/// The rule for a LoRA agent and the model it is applied to (always the merge's base): where its
/// adapter names the model it was trained on (`base_model_name_or_path`), that must be the base.
/// - a local folder that exists: the base, or a copy of it (the same config.json and weight file
///   sizes); another model is refused (exit 2);
/// - a Hub id, with the base a snapshot of a Hub repository: the same repository, else refused;
/// - a Hub id, with the base a local folder: accepted, with a warning when the folder's name is
///   not the id's name (a download keeps it, `--local-dir` may not).
fn check_adapters_base(base: &ModelFolder, agents: &[ModelFolder]) -> Result<Vec<String>> {
    let mut warnings = Vec::new();
    let base_dir = real_path(&base.dir);
    let base_id = crate::hub::id_of_snapshot(&base_dir).map(|id| {
        id.split('@')
            .next()
            .unwrap_or_default()
            .to_ascii_lowercase()
    });
    for agent in agents {
        let Some(lora) = &agent.lora else { continue };
        let Some(named) = crate::checkpoint::lora::trained_on(&lora.dir) else {
            continue;
        };
        let refuse = |why: String| {
            usage(format!(
                "LoRA agent {} was trained on {} (its adapter_config.json's \
                 base_model_name_or_path), {why}; an adapter is applied to the merge's base: \
                 merge with that base, or correct base_model_name_or_path if it names the same \
                 model",
                lora.dir.display(),
                crate::escape::terminal(&named),
            ))
        };
        let named_path = Path::new(&named);
        if named_path.is_dir() {
            if real_path(named_path) != base_dir && !same_model(named_path, &base.dir) {
                return Err(refuse(format!(
                    "a different model from the merge's base {}",
                    base.dir.display()
                )));
            }
        } else if let Some(id) = crate::hub::ModelId::parse(&named) {
            let id_repo = format!("{}/{}", id.org, id.name).to_ascii_lowercase();
            match &base_id {
                Some(b) if *b != id_repo => {
                    return Err(refuse(format!(
                        "not the merge's base {b} (from the Hub cache)"
                    )))
                }
                Some(_) => {}
                None => {
                    let folder = base_dir
                        .file_name()
                        .map(|n| n.to_string_lossy().to_ascii_lowercase());
                    if folder.as_deref() != Some(&id.name.to_ascii_lowercase()) {
                        warnings.push(format!(
                            "LoRA agent {} was trained on {}, and is applied to the base {}: \
                             check that this folder holds that model",
                            lora.dir.display(),
                            crate::escape::terminal(&named),
                            base.dir.display()
                        ));
                    }
                }
            }
        } else if named_path.is_absolute() || named.starts_with('.') {
            warnings.push(format!(
                "LoRA agent {} was trained on {}, which is not here; it is applied to the base {}",
                lora.dir.display(),
                crate::escape::terminal(&named),
                base.dir.display()
            ));
        }
    }
    Ok(warnings)
}

/// Whether folders `a` and `b` hold the same model: equal config.json (as JSON) and the same
/// weight files with the same sizes and CRC-32s (a copy, a clone of a repository; an agent
/// fine-tuned from `b` has its config and sizes, not its bytes). Read only when an adapter names
/// a folder other than the base.
fn same_model(a: &Path, b: &Path) -> bool {
    use crate::checkpoint::folder_files::read_config;
    let weights = |d: &Path| -> Option<Vec<(std::ffi::OsString, u64)>> {
        let mut files: Vec<_> = std::fs::read_dir(d)
            .ok()?
            .filter_map(|e| e.ok())
            .filter(|e| e.file_name().to_string_lossy().ends_with(".safetensors"))
            .map(|e| Some((e.file_name(), std::fs::metadata(e.path()).ok()?.len())))
            .collect::<Option<_>>()?;
        files.sort();
        Some(files)
    };
    let same_sizes = matches!(
        (weights(a), weights(b)),
        (Some(x), Some(y)) if x == y && !x.is_empty()
    );
    let same_bytes = || {
        weights(a).unwrap_or_default().iter().all(|(name, _)| {
            let crc =
                |d: &Path| crate::checkpoint::safetensors_file::crc32_of_file(&d.join(name)).ok();
            matches!((crc(a), crc(b)), (Some(x), Some(y)) if x == y)
        })
    };
    matches!((read_config(a), read_config(b)), (Ok(x), Ok(y)) if x == y)
        && same_sizes
        && same_bytes()
}

fn real_path(p: &Path) -> PathBuf {
    std::fs::canonicalize(p).unwrap_or_else(|_| p.to_path_buf())
}

/// Warnings for inputs with identical weights (every weight file of the same size and CRC-32,
/// known for free from the checksums the merge computed): two copies of one agent count its
/// changes as shared by two; an agent equal to the base changes nothing.
pub(crate) fn identical_inputs(sums: &[InputChecksums], uses_base: bool) -> Vec<String> {
    fn key(i: &InputChecksums) -> Vec<(u64, &str)> {
        let mut k: Vec<(u64, &str)> = i.files.iter().map(|f| (f.size, f.crc32.as_str())).collect();
        k.sort_unstable();
        k
    }
    let mut warnings = Vec::new();
    let first = if uses_base { 0 } else { 1 };
    for a in first..sums.len() {
        for b in a + 1..sums.len() {
            if key(&sums[a]) == key(&sums[b]) {
                warnings.push(if a == 0 {
                    format!(
                        "agent {} holds the same weights as the base (every weight file has the \
                         same size and CRC-32): it changes nothing",
                        sums[b].path.display()
                    )
                } else {
                    format!(
                        "agents {} and {} hold the same weights (every weight file has the same \
                         size and CRC-32): their changes count as shared by two agents",
                        sums[a].path.display(),
                        sums[b].path.display()
                    )
                });
            }
        }
    }
    warnings
}

/// Refuses an agent folder given twice (after resolving links): it would count one agent's
/// changes as shared by two, and move every λ.
fn refuse_repeated_agents(agent_dirs: &[PathBuf]) -> Result<()> {
    let mut seen: Vec<(PathBuf, &Path)> = Vec::new();
    for dir in agent_dirs {
        let r = real_path(dir);
        if let Some((_, first)) = seen.iter().find(|(s, _)| *s == r) {
            return Err(usage(format!(
                "--model {} is given twice (also as {}); give each agent once",
                dir.display(),
                first.display()
            )));
        }
        seen.push((r, dir));
    }
    Ok(())
}
