//! The checks that make a set of folders the inputs of one merge: agents opened (LoRA agents on
//! the base they were trained on), of the base's architecture, not given twice; identical
//! inputs noticed.

use super::*;

/// An agent folder, or a LoRA agent: an adapter folder, or `BASE+ADAPTER` whose BASE is the
/// merge's base (the adapter is applied to it).
pub(super) fn open_agent(
    base_dir: &Path,
    dir: &Path,
    interner: &mut Interner,
    raw_f32: bool,
) -> Result<ModelFolder> {
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
        None => {
            ModelFolder::open_with(dir, interner, raw_f32).context("cannot open an agent model")
        }
    }
}

/// Refuses an agent whose `config.json` gives another architecture than the base's (a key of
/// [`crate::model_config::ARCHITECTURE_KEYS`] differs): its tensors would otherwise
/// merge by name into a model neither of them is. The layer count may differ in slices (each slice
/// names its layers), the vocabulary with a tokenizer source (rows are re-indexed). Agents without
/// a config.json (and LoRA agents, which are the base) are compared by their tensors alone.
/// Returns the base's config, when it has one.
pub(super) fn refuse_other_architectures(
    base: &ModelFolder,
    agents: &[ModelFolder],
    layout: Layout,
) -> Result<Option<serde_json::Value>> {
    use crate::model_config::architecture_difference;
    let Some(base_config) = base.own_config().map(|c| c.json()) else {
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
        let Some(config) = agent.own_config().map(|c| c.json()) else {
            continue;
        };
        if let Some((key, b, a)) = architecture_difference(base_config, config, &skip) {
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
    Ok(Some(base_config.clone()))
}

/// For a tensor whose shape differs between the base and an agent: the base config's
/// architecture key whose value is a dimension that differs (`; a different architecture: …`).
pub(super) fn architecture_key_of(
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
            crate::model_config::ARCHITECTURE_KEYS
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
pub(super) fn check_adapters_base(
    base: &ModelFolder,
    agents: &[ModelFolder],
) -> Result<Vec<String>> {
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
pub(super) fn same_model(a: &Path, b: &Path) -> bool {
    use crate::model_config::ModelConfig;
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
            let crc = |d: &Path| crate::checkpoint::weight_file::crc32_of_file(&d.join(name)).ok();
            matches!((crc(a), crc(b)), (Some(x), Some(y)) if x == y)
        })
    };
    matches!((ModelConfig::read(a), ModelConfig::read(b)), (Ok(x), Ok(y)) if x == y)
        && same_sizes
        && same_bytes()
}

pub(super) fn real_path(p: &Path) -> PathBuf {
    std::fs::canonicalize(p).unwrap_or_else(|_| p.to_path_buf())
}

/// Warnings for inputs with identical weights (every weight file of the same size and CRC-32,
/// known for free from the checksums the merge computed): two copies of one agent count its
/// changes as shared by two; an agent equal to the base changes nothing.
pub(crate) fn identical_inputs(sums: &[InputChecksums], uses_base: bool) -> Vec<String> {
    fn key(i: &InputChecksums) -> Vec<(u64, &str)> {
        // The weights: a config.json that differs in a name or a tool's version changes none.
        let mut k: Vec<(u64, &str)> = i
            .files
            .iter()
            .filter(|f| f.file != "config.json")
            .map(|f| (f.size, f.crc32.as_str()))
            .collect();
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
pub(super) fn refuse_repeated_agents(agent_dirs: &[PathBuf]) -> Result<()> {
    let mut seen: Vec<(PathBuf, &Path)> = Vec::new();
    for dir in agent_dirs {
        let r = real_path(dir);
        if let Some((_, first)) = seen.iter().find(|(s, _)| *s == r) {
            return Err(usage(crate::message![
                crate::error::Arg::named("--model", "model"),
                format!(
                    " {} is given twice (also as {}); give each agent once",
                    dir.display(),
                    first.display()
                ),
            ]));
        }
        seen.push((r, dir));
    }
    Ok(())
}

/// Above this share of sampled elements changed, an agent is unlikely to be RL-trained from the
/// base: RL fine-tuning changes a minority of parameters (SPEC §1), dense noise or another base
/// nearly all of them.
pub const DENSE_SHARE: f64 = 0.95;
/// Above this ‖τ‖ / ‖θ₀‖ on the sampled elements, an agent is unlikely to come from the base.
pub const DENSE_UPDATE: f64 = 0.5;
/// Elements sampled from each of the largest matrices.
const SAMPLE_ELEMS: usize = 16_384;
/// Matrices sampled.
const SAMPLE_TENSORS: usize = 8;

impl Inputs {
    /// A note for each input whose weights are not safetensors: the format they are read from.
    pub fn format_notes(&self) -> Vec<String> {
        // A conversion's source is the base and the one model: said once.
        let named = std::iter::once(("base", &self.base)).chain(
            self.agents
                .iter()
                .filter(|a| a.dir != self.base.dir)
                .map(|a| ("agent", a)),
        );
        let mut notes = Vec::new();
        for (role, m) in named {
            if let Some(f) = m.other_format() {
                // Every other format but FP8 safetensors holds pickles.
                let how = match m.format {
                    crate::checkpoint::files::WeightFormat::Torch => {
                        ": their pickle as data (never run), their tensors in place"
                    }
                    crate::checkpoint::files::WeightFormat::Safetensors => ", tile by tile",
                };
                notes.push(format!(
                    "{role} {} is read from its {f}{how}",
                    m.dir.display()
                ));
            }
            if let Some(first) = m.skipped.first() {
                notes.push(format!(
                    "{role} {}: {} entries that are not the model's tensors are not read ('{}'{})",
                    m.dir.display(),
                    m.skipped.len(),
                    crate::escape::terminal(first),
                    if m.skipped.len() > 1 { ", …" } else { "" }
                ));
            }
            for (dropped, kept) in &m.aliases {
                notes.push(format!(
                    "{role} {}: '{dropped}' is '{kept}' saved under a second name (tied \
                     weights): read once, as '{kept}', as transformers saves it",
                    m.dir.display()
                ));
            }
        }
        notes
    }

    /// Warnings for agents that look as if they did not come from the base by RL fine-tuning:
    /// on a sample of the largest matrices (a window in the middle of each, read without
    /// touching the merge's checksums), the share of elements with |τ| > `epsilon` above
    /// [`DENSE_SHARE`], or ‖τ‖ / ‖θ₀‖ above [`DENSE_UPDATE`]. LoRA agents (dense by construction)
    /// and re-indexed vocabularies are not sampled.
    pub fn dense_agent_warnings(&self, epsilon: f32) -> Result<Vec<String>> {
        let mut matrices: Vec<&TensorPlan> = self
            .tensors
            .iter()
            .filter(|p| p.vocab.is_none() && p.sliced.is_none() && p.shape().len() >= 2)
            .collect();
        matrices.sort_by_key(|p| std::cmp::Reverse(p.numel()));
        matrices.truncate(SAMPLE_TENSORS);
        // Per agent: (changed, sampled, Σ τ², Σ θ₀²).
        let mut stats = vec![(0u64, 0u64, 0f64, 0f64); self.agents.len()];
        let mut bytes = Vec::new();
        let (mut base, mut agent) = (Vec::new(), Vec::new());
        let mut window = |model: &ModelFolder, t: &ModelTensor, out: &mut Vec<f32>| -> Result<()> {
            let len = t.entry.numel.min(SAMPLE_ELEMS);
            let start = ((t.entry.numel - len) / 2) as u64;
            let size = t.entry.dtype.size();
            bytes.resize(len * size, 0u8);
            model.read(t, start * size as u64, &mut bytes)?;
            out.resize(len, 0.0);
            crate::checkpoint::dtype::decode(t.entry.dtype, &bytes, out);
            Ok(())
        };
        for plan in matrices {
            window(plan.base_folder(self), &plan.base, &mut base)?;
            for (t, s) in stats.iter_mut().enumerate() {
                let model = &self.agents[t];
                let Some(tensor) = plan.agent(self, t) else {
                    continue;
                };
                if model.lora.is_some() || tensor.entry.numel != plan.base.entry.numel {
                    continue;
                }
                window(model, tensor, &mut agent)?;
                // As the merge reads it: fp32 master weights as their 16-bit rounding.
                if let Some(to) = self.agent_rounding(tensor.entry.dtype, plan.base.entry.dtype) {
                    crate::checkpoint::dtype::round_through(to, &mut agent);
                }
                for (&a, &b) in agent.iter().zip(&base) {
                    let tau = f64::from(a) - f64::from(b);
                    s.0 += u64::from(tau.abs() > f64::from(epsilon));
                    s.1 += 1;
                    s.2 += tau * tau;
                    s.3 += f64::from(b) * f64::from(b);
                }
            }
        }
        let mut warnings = Vec::new();
        for (t, &(changed, sampled, tau2, base2)) in stats.iter().enumerate() {
            if sampled == 0 {
                continue;
            }
            let share = changed as f64 / sampled as f64;
            let size = if base2 > 0.0 {
                (tau2 / base2).sqrt()
            } else {
                0.0
            };
            if share > DENSE_SHARE || size > DENSE_UPDATE {
                warnings.push(format!(
                    "agent {} changed {:.2} % of the elements sampled from the largest matrices \
                     (‖τ‖/‖θ₀‖ = {size:.3}): RL fine-tuning changes few parameters, so it may \
                     not come from this base (or was trained densely); check --base. \
                     --allow-dense-agents silences this",
                    self.agents[t].dir.display(),
                    100.0 * share
                ));
            }
        }
        Ok(warnings)
    }
}

/// A note for each agent that stores F32 weights over a 16-bit base (fp32 master weights), which
/// the merge reads as their rounding to the base's dtype ([`super::Inputs::agent_rounding`]).
pub(super) fn rounded_agents(base: &ModelFolder, agents: &[ModelFolder]) -> Vec<String> {
    let mut notes = Vec::new();
    for agent in agents.iter().filter(|a| a.lora.is_none()) {
        let over = agent.tensors.iter().find_map(|t| {
            let b = base.get(&t.entry.name)?;
            (t.entry.dtype == DType::F32 && b.entry.dtype != DType::F32).then_some(b.entry.dtype)
        });
        if let Some(dtype) = over {
            notes.push(format!(
                "agent {} stores F32 weights over a {dtype} base (fp32 master weights): they are \
                 read as their {dtype} rounding (to nearest even, as a trainer's converter and \
                 torch's .to({}) write them), so a change below a {dtype} step is no change; \
                 --raw-f32-agents reads them as stored",
                agent.dir.display(),
                dtype.torch_name()
            ));
        }
    }
    notes
}
