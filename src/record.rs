//! What a merged folder records about how it was made: the record `rlmerge_record.json`
//! (machine-readable: method, λ, every input and output checksum) and the README.md model card.
//! ("Recipe" means only the mergekit YAML a merge may come from, saved as `mergekit_config.yml`.)

use crate::checkpoint::safetensors_file::FileChecksum;
use crate::job::MERGEKIT_CONFIG_FILE;
use crate::method::{AgentCounts, Method, SharedRule};
use anyhow::{Context, Result};
use serde::{Deserialize, Serialize};
use std::fmt::Write;
use std::path::{Path, PathBuf};

pub use crate::checkpoint::output_folder::{CARD_FILE, LEGACY_RECORD_FILE, RECORD_FILE};

/// The overlap figure a RAM+ merge writes beside its weights (see `crate::figures::overlap`).
pub const OVERLAP_FIGURE: &str = "overlap.svg";

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct AgentSummary {
    pub path: String,
    /// λ_t (global scope and `ram`); `None` for tensor scope, see `tensor_lambdas`.
    pub lambda: Option<f64>,
    /// Unique / shared element counts from the probe, when one ran.
    pub counts: Option<AgentCounts>,
}

/// The weight files of one input model as the merge read them.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct InputChecksums {
    /// The folder, resolved to an absolute path.
    pub path: PathBuf,
    /// `org/name@commit` where the folder is a Hugging Face cache snapshot (a model named by Hub
    /// id): a rerun or `verify --against` elsewhere names the same snapshot.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hub_id: Option<String>,
    pub files: Vec<FileChecksum>,
}

/// How the model card names an input: a Hub snapshot by its id (`org/name` in the front matter,
/// `org/name@commit` in the text), a folder by its path.
fn card_name(path: &str) -> (String, String) {
    match crate::hub::id_of_snapshot(std::path::Path::new(path)) {
        Some(id) => (id.split('@').next().unwrap_or(&id).to_string(), id),
        None => (path.to_string(), path.to_string()),
    }
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct MergeRecord {
    pub tool: String,
    pub version: String,
    pub method: Method,
    pub epsilon: f32,
    /// NaN/±Inf inputs were merged by IEEE rules instead of refused.
    pub allow_nonfinite: bool,
    /// Tensors missing in some models were let through (`--allow-missing-tensors`).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub allow_missing_tensors: bool,
    pub base: String,
    pub agents: Vec<AgentSummary>,
    /// Tensor scope: λ per agent for each tensor.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tensor_lambdas: Vec<(std::sync::Arc<str>, Vec<f64>)>,
    /// Layer and module scope: λ per agent for each group (a layer, or a module kind).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub group_lambdas: Vec<(String, Vec<f64>)>,
    /// `None`: each tensor kept the base's dtype.
    pub out_dtype: Option<String>,
    /// mergekit's `slices`: which layers of which input each output layer is.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub slices: Option<crate::slices::Slices>,
    /// The tokenizer source and token settings (`None`: the base's tokenizer, rows as they are);
    /// a record of 0.x before them may hold the source model's folder alone.
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "tokenizer_settings"
    )]
    pub tokenizer: Option<crate::vocabulary::TokenizerSettings>,
    pub shard_size: u64,
    pub warnings: Vec<String>,
    /// Base first, then the agents in order.
    pub inputs: Vec<InputChecksums>,
    /// Every file written beside this record but the model card: shards, index, config and
    /// tokenizer copies.
    pub outputs: Vec<FileChecksum>,
}

impl MergeRecord {
    /// The output's weight shards.
    pub fn shards(&self) -> impl Iterator<Item = &FileChecksum> {
        self.outputs
            .iter()
            .filter(|f| f.file.ends_with(".safetensors"))
    }

    /// Reads the record of a merged folder ([`RECORD_FILE`], else [`LEGACY_RECORD_FILE`]).
    pub fn read(dir: &Path) -> Result<MergeRecord> {
        let legacy = dir.join(LEGACY_RECORD_FILE);
        let path = match dir.join(RECORD_FILE) {
            p if !p.exists() && legacy.exists() => legacy,
            p => p,
        };
        let text = crate::checkpoint::files::check_regular_file(&path)
            .and_then(|()| Ok(std::fs::read_to_string(&path)?))
            .with_context(|| {
                format!(
                    "cannot read {} (not a folder rlmerge wrote?)",
                    path.display()
                )
            })?;
        let record: MergeRecord = serde_json::from_str(&text)
            .with_context(|| format!("{}: invalid record", path.display()))?;
        record
            .check_file_names()
            .with_context(|| format!("{}: invalid record", path.display()))?;
        Ok(record)
    }

    /// Every file a record lists — outputs, and each input folder's files — must be a plain file
    /// name inside its folder (a downloaded merge's record is not trusted to send `verify`
    /// elsewhere: no `/`, `\`, `..`, `.`, empty or NUL names).
    fn check_file_names(&self) -> Result<()> {
        let files = self
            .outputs
            .iter()
            .chain(self.inputs.iter().flat_map(|i| &i.files));
        for f in files {
            let name = f.file.as_str();
            let plain = !name.is_empty()
                && name != "."
                && name != ".."
                && !name.contains(['/', '\\', '\0'])
                && !std::path::Path::new(name).is_absolute();
            if !plain {
                anyhow::bail!(
                    "it lists the file '{}', which is not a plain file name inside its folder",
                    crate::escape::terminal(name)
                );
            }
        }
        Ok(())
    }
}

/// Writes the record and the model card into `dir`.
pub fn write(dir: &Path, record: &MergeRecord) -> Result<()> {
    let path = dir.join(RECORD_FILE);
    std::fs::write(&path, serde_json::to_string_pretty(record)? + "\n")
        .with_context(|| format!("cannot write {}", path.display()))?;
    let path = dir.join(CARD_FILE);
    std::fs::write(&path, model_card(record))
        .with_context(|| format!("cannot write {}", path.display()))?;
    Ok(())
}

/// The Hugging Face model card: YAML front matter, then what was merged and how.
pub fn model_card(r: &MergeRecord) -> String {
    let mut s = String::new();
    let _ = writeln!(s, "---\nbase_model:");
    let _ = writeln!(s, "- {}", yaml_str(&card_name(&r.base).0));
    for a in &r.agents {
        let _ = writeln!(s, "- {}", yaml_str(&card_name(&a.path).0));
    }
    let _ = writeln!(
        s,
        "library_name: transformers\ntags:\n- merge\n- rlmerge\n- {}\n---\n",
        r.method.name()
    );
    let _ = writeln!(s, "# Merged model\n");
    match &r.method {
        Method::Combine(c) => {
            let _ = writeln!(
                s,
                "This model merges {} model(s) with rlmerge {} using **{}** — {} ({}), \
                 with mergekit's semantics.\n",
                r.agents.len(),
                r.version,
                c.kind.name(),
                c.kind.about(),
                c.kind.reference()
            );
        }
        _ => {
            let _ = writeln!(
                s,
                "This model merges {} reinforcement-learning-trained agents into their common base with \
                 rlmerge {} using **{}**: parameters no agent changed \
                 (|τ| ≤ ε = {:e}) keep the base value, parameters changed by several agents take the mean of \
                 their task vectors over those agents only{}, and parameters changed by one agent keep that \
                 agent's update{} (Reinforced Agent Merging, [arXiv:2601.13572](https://arxiv.org/abs/2601.13572)).\n",
                r.agents.len(),
                r.version,
                r.method,
                r.epsilon,
                match r.method.shared() {
                    SharedRule::Mean => "",
                    SharedRule::Consensus => " whose change has the sign of the changes' sum",
                },
                if r.method.boost().is_some() { ", scaled by λ_t" } else { "" }
            );
        }
    }
    let _ = writeln!(s, "## Inputs\n\n- base: {}", code(&card_name(&r.base).1));
    for (t, a) in r.agents.iter().enumerate() {
        let lambda = match (a.lambda, &r.method) {
            (_, Method::Combine(_)) => "parameters in the record".into(),
            (Some(l), _) => format!("λ = {l:.6}"),
            (None, m) => format!(
                "λ per {} (see {RECORD_FILE})",
                m.scope().map_or("tensor", |s| s.name())
            ),
        };
        let counts = match a.counts {
            Some(c) => format!(
                ", {} unique and {} shared changed elements",
                c.unique, c.shared
            ),
            None => String::new(),
        };
        let _ = writeln!(
            s,
            "- agent {}: {} — {lambda}{counts}",
            t + 1,
            code(&card_name(&a.path).1)
        );
    }
    if r.outputs.iter().any(|f| f.file == OVERLAP_FIGURE) {
        let _ = writeln!(
            s,
            "\nEach agent's changed elements by how many other agents changed them too (k = 0: \
             unique; the paper's Figure 1):\n\n![overlap]({OVERLAP_FIGURE})"
        );
    }
    let _ = writeln!(
        s,
        "\n## Output\n\n{} shard(s), dtype {}. How it was made is recorded in `{RECORD_FILE}`{}.",
        r.shards().count(),
        r.out_dtype.as_deref().unwrap_or("as the base"),
        if r.outputs.iter().any(|f| f.file == MERGEKIT_CONFIG_FILE) {
            format!(" and the mergekit configuration in `{MERGEKIT_CONFIG_FILE}`")
        } else {
            String::new()
        }
    );
    if let Some(t) = &r.tokenizer {
        use crate::vocabulary::TokenizerSource;
        let source = match &t.source {
            TokenizerSource::Base => "the base's".to_string(),
            TokenizerSource::Union => "the union of every model's".to_string(),
            TokenizerSource::Model(p) => {
                format!("{}'s", code(&card_name(&p.display().to_string()).1))
            }
        };
        let _ = writeln!(
            s,
            "\nVocabulary: {source} tokenizer{}{}; each model's embedding and output rows follow it \
             token by token (a token a model lacks takes another model's row, \
             as mergekit does).",
            if t.tokens.is_empty() {
                String::new()
            } else {
                format!(
                    ", with {}",
                    t.tokens
                        .iter()
                        .map(|k| code(&k.token))
                        .collect::<Vec<_>>()
                        .join(", ")
                )
            },
            t.pad_to_multiple_of
                .map_or(String::new(), |m| format!(", rows padded to a multiple of {m}"))
        );
    }
    if !r.warnings.is_empty() {
        let _ = writeln!(s, "\n## Notes\n");
        for w in &r.warnings {
            let _ = writeln!(s, "- {}", crate::escape::markdown_text(w));
        }
    }
    s
}

/// A name in the card's YAML front matter: double-quoted (JSON's escapes are YAML's), hidden
/// characters escaped first ([`crate::escape::terminal`]).
fn yaml_str(s: &str) -> String {
    serde_json::to_string(&crate::escape::terminal(s)).expect("strings serialize")
}

/// A name in the card's Markdown: a code span it cannot leave ([`crate::escape::markdown_code`]).
fn code(s: &str) -> String {
    crate::escape::markdown_code(s)
}

/// [`MergeRecord::tokenizer`]: the settings, or an older record's model folder.
fn tokenizer_settings<'de, D: serde::Deserializer<'de>>(
    d: D,
) -> std::result::Result<Option<crate::vocabulary::TokenizerSettings>, D::Error> {
    use crate::vocabulary::{TokenizerSettings, TokenizerSource};
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Written {
        Folder(String),
        Settings(TokenizerSettings),
    }
    Ok(match Option::<Written>::deserialize(d)? {
        None => None,
        Some(Written::Settings(s)) => Some(s),
        Some(Written::Folder(f)) => Some(TokenizerSettings {
            source: TokenizerSource::Model(f.into()),
            tokens: Vec::new(),
            pad_to_multiple_of: None,
        }),
    })
}
