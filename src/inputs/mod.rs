//! The inputs of a merge — one wing, one room per idea: the base and the agent folders opened and
//! checked against each other (`checks.rs`), and the plan of which agents hold each output tensor
//! (`plan.rs`), for whole models or mergekit's slices (`sliced.rs`), with token-indexed tensors
//! re-indexed for a tokenizer source (`reindex.rs`).

mod checks;
mod dora;
mod gate;
mod plan;
mod reindex;
mod sliced;
mod source;
mod tile_bytes;

pub(crate) use checks::identical_inputs;
use checks::{
    architecture_key_of, check_adapters_base, open_agent, real_path, refuse_other_architectures,
    refuse_repeated_agents,
};
use plan::whole_model_plans;
pub use plan::{SlicedTensor, TensorPlan, VocabPlan};
use reindex::Reindex;
use sliced::sliced_plans;
pub use source::{resize_exact, BaseTile, SourceRead, TensorSource};
pub use tile_bytes::TileBytes;

use crate::checkpoint::weight_file::shape_text;
use crate::checkpoint::weight_file::Interner;
use crate::checkpoint::{DType, ModelFolder, ModelTensor};
use crate::error::usage;
use crate::method::{self};
use crate::names::is_token_indexed;
use crate::record::InputChecksums;
use crate::slices::{Placement, Slices, Source};
use crate::structure::LayerStack;
use crate::vocabulary::{TokenizerSettings, VocabTensor, Vocabulary};
use anyhow::{bail, ensure, Context, Result};
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// The base and the agents, opened and checked against each other.
pub struct Inputs {
    /// The base model.
    pub base: ModelFolder,
    /// The agents, in order.
    pub agents: Vec<ModelFolder>,
    /// Tensors to merge, in the base's storage order.
    pub tensors: Vec<TensorPlan>,
    /// Things the user should know (tensors missing in some agents, extra tensors ignored).
    pub warnings: Vec<String>,
    /// mergekit's `slices`, when the output's layers are taken from ranges of the inputs'.
    pub slices: Option<Slices>,
    /// The output's vocabulary when a tokenizer source is set (mergekit's `tokenizer_source`).
    pub vocabulary: Option<Arc<Vocabulary>>,
    /// The user let tensors missing in some models through ([`Layout::allow_missing_tensors`]).
    pub allow_missing_tensors: bool,
    /// Agents' F32 tensors are read as stored ([`Layout::raw_f32_agents`]).
    pub raw_f32_agents: bool,
    /// Stops the passes over these inputs between tiles (see [`crate::cancel`]): the token of
    /// the thread that opened them.
    pub cancel: crate::cancel::Token,
    /// The agents' names where the user gave them (`--name`, a recipe's `name:`), by agent;
    /// tables, figures, the record and the card show them.
    pub names: Vec<Option<String>>,
    /// The output's stacks (decoder, MTP, towers): the base's, with the slices' layer count.
    pub structure: crate::structure::Structure,
}

/// What shapes the output beyond the base's tensors: mergekit's slices and tokenizer source.
#[derive(Clone, Copy, Default)]
pub struct Layout<'a> {
    /// mergekit's `slices`, when the merge selects layers.
    pub slices: Option<&'a Slices>,
    /// The output's vocabulary, when agents added tokens.
    pub tokenizer: Option<&'a TokenizerSettings>,
    /// Whether θ₀ enters the merge: a token some model lacks then takes the base's row first.
    pub with_base: bool,
    /// Tensors some agent lacks, or has and the base lacks, are merged from the models that have
    /// them (or ignored) with a warning instead of refused (`--allow-missing-tensors`).
    pub allow_missing_tensors: bool,
    /// Agents' F32 tensors over a 16-bit base are read as stored, not as their rounding to the
    /// base's dtype (`--raw-f32-agents`; see [`Inputs::agent_rounding`]).
    pub raw_f32_agents: bool,
}

impl Inputs {
    /// Opens every folder and checks each agent tensor's shape against the base's.
    pub fn open(base_dir: &Path, agent_dirs: &[PathBuf]) -> Result<Inputs> {
        Inputs::open_with(base_dir, agent_dirs, Layout::default())
    }

    /// [`Inputs::open`], the output's layers taken from `layout.slices` and its vocabulary from
    /// `layout.tokenizer` when given.
    pub fn open_with(base_dir: &Path, agent_dirs: &[PathBuf], layout: Layout) -> Result<Inputs> {
        if agent_dirs.is_empty() {
            return Err(usage(crate::message![
                "at least one agent model is needed (",
                crate::error::Arg::named("--model DIR", "models=[…]"),
                ")",
            ]));
        }
        if agent_dirs.len() > method::MAX_AGENTS {
            return Err(usage(format!(
                "at most {} agent models can be handled at once, got {}",
                method::MAX_AGENTS,
                agent_dirs.len()
            )));
        }
        refuse_repeated_agents(agent_dirs)?;
        // One copy of each tensor name and shape for all models.
        let mut interner = crate::checkpoint::weight_file::Interner::default();
        // A conversion's one model is its own layout: named as the model, not a base.
        let role = match agent_dirs {
            [only] if only == base_dir => "the model",
            _ => "the base model",
        };
        let base = ModelFolder::open_with(base_dir, &mut interner, layout.raw_f32_agents)
            .with_context(|| format!("cannot open {role}"))?;
        ensure!(
            !base.tensors.is_empty(),
            "the base model {} has no tensors (its header is empty)",
            base_dir.display()
        );
        let agents = agent_dirs
            .iter()
            .map(|d| open_agent(base_dir, d, &mut interner, layout.raw_f32_agents))
            .collect::<Result<Vec<_>>>()?;
        refuse_foreign_names(&base, &agents)?;
        let base_config = refuse_other_architectures(&base, &agents, layout)?;
        let structure = crate::structure::Structure::of(
            base.tensors.iter().map(|t| &*t.entry.name),
            base_config.as_ref(),
        );
        let mut warnings = check_adapters_base(&base, &agents)?;
        if !layout.raw_f32_agents {
            warnings.extend(checks::rounded_agents(&base, &agents));
        }
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
            let mut tensors =
                sliced_plans(&base, &agents, slices, reindex.as_ref(), &mut warnings)?;
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
                allow_missing_tensors: layout.allow_missing_tensors,
                raw_f32_agents: layout.raw_f32_agents,
                cancel: crate::cancel::current(),
                names: Vec::new(),
                structure: structure.with_layers(slices.layers()),
            });
        }
        let tensors = whole_model_plans(
            &base,
            &agents,
            layout,
            reindex.as_ref(),
            base_config.as_ref(),
            &mut warnings,
        )?;
        Ok(Inputs {
            base,
            agents,
            tensors,
            warnings,
            slices: None,
            vocabulary,
            allow_missing_tensors: layout.allow_missing_tensors,
            raw_f32_agents: layout.raw_f32_agents,
            cancel: crate::cancel::current(),
            names: Vec::new(),
            structure,
        })
    }

    /// The dtype an agent's tensor stored as `stored` over a base tensor of dtype `base` is read
    /// rounded to (issue #50 item 8, SPEC §5): F32 weights over a BF16 or F16 base are fp32
    /// master weights, which drift below a 16-bit step almost everywhere — read raw, every element
    /// would count as changed. They are read as their rounding to the base's dtype (to nearest
    /// even), as a trainer's converter writes them, unless `--raw-f32-agents`.
    pub fn agent_rounding(&self, stored: DType, base: DType) -> Option<DType> {
        (!self.raw_f32_agents && stored == DType::F32 && base != DType::F32).then_some(base)
    }

    /// Refuses the base given as an agent too, for every use that takes task vectors against
    /// it (all but methods without a base, which merge the models themselves).
    pub fn refuse_base_as_agent(&self) -> Result<()> {
        let base = real_path(&self.base.dir);
        match self.agents.iter().find(|a| real_path(&a.dir) == base) {
            Some(a) => Err(usage(crate::message![
                crate::error::Arg::named("--model", "model"),
                format!(
                    " {} is the base model {}; its task vector is zero — give each agent once, \
                     and not the base",
                    a.dir.display(),
                    self.base.dir.display()
                ),
            ])),
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

    /// Each agent as tables and figures name it: its name where given, else its folder.
    pub fn agent_labels(&self) -> Vec<String> {
        self.agents
            .iter()
            .enumerate()
            .map(|(t, a)| match self.names.get(t).cloned().flatten() {
                Some(name) => name,
                None => a.dir.display().to_string(),
            })
            .collect()
    }

    /// Names the agents (`names[t]` for agent t, `None`: by its folder), checked: one per agent at
    /// most, each non-empty, printable, and used once.
    pub fn set_names(&mut self, names: Vec<Option<String>>) -> Result<()> {
        if names.len() > self.agents.len() {
            return Err(usage(format!(
                "{} agent names for {} agents: give one name per agent, in the agents' order",
                names.len(),
                self.agents.len()
            )));
        }
        use unicode_normalization::UnicodeNormalization;
        let given: Vec<&String> = names.iter().flatten().collect();
        // Compared as Unicode's NFC: one name in two spellings (é precomposed, or e and a
        // combining accent) shows identically in the card and the figures.
        let composed: Vec<String> = given.iter().map(|n| n.nfc().collect()).collect();
        for (i, n) in given.iter().enumerate() {
            if n.trim().is_empty() || n.chars().any(char::is_control) {
                return Err(usage(format!(
                    "agent name {n:?} is empty or holds a control character"
                )));
            }
            if let Some(j) = composed[..i].iter().position(|c| *c == composed[i]) {
                let spelled = match given[j] == *n {
                    true => String::new(),
                    false => format!(" (spelled {:?} and {n:?}: one name in Unicode)", given[j]),
                };
                return Err(usage(format!(
                    "agent name {n:?} is given twice{spelled}; names tell agents apart"
                )));
            }
        }
        self.names = names;
        Ok(())
    }
}

/// Refuses an agent that holds none of the base's tensor names: not fine-tuned from it, or
/// saved with other names.
fn refuse_foreign_names(base: &ModelFolder, agents: &[ModelFolder]) -> Result<()> {
    for agent in agents {
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
                base.dir.display()
            );
        }
    }
    Ok(())
}
