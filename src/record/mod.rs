//! What a merged folder records about how it was made: the record `rlmerge_record.json`
//! (machine-readable: method, λ, every input and output checksum) and the README.md model card.
//! ("Recipe" means only the mergekit YAML a merge may come from, saved as `mergekit_config.yml`.)

use crate::checkpoint::weight_file::FileChecksum;
use crate::method::{AgentCounts, Merging, Method};
use anyhow::{Context, Result};
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

mod card;
pub mod tool;

pub use crate::checkpoint::output_folder::{CARD_FILE, LEGACY_RECORD_FILE, RECORD_FILE};
pub use card::model_card;

/// How a record names a model taken from the Hugging Face cache: `hf://org/name@commit`.
pub const HUB_PREFIX: &str = "hf://";

/// How a record names the input folder `folder` of the merged folder `out` (its final place): a
/// Hugging Face cache snapshot by [`HUB_PREFIX`] and its `org/name@commit`, any other folder by
/// its path relative to `out` — so a published folder says nothing of the machine it was made
/// on, and `verify` finds the inputs wherever the output and its inputs move together.
pub fn recorded_path(out: &Path, folder: &Path) -> PathBuf {
    let absolute = |p: &Path| -> PathBuf {
        std::fs::canonicalize(p).unwrap_or_else(|_| std::path::absolute(p).unwrap_or(p.into()))
    };
    let folder = absolute(folder);
    if let Some(id) = crate::hub::id_of_snapshot(&folder) {
        return PathBuf::from(format!("{HUB_PREFIX}{id}"));
    }
    // The output's parent exists (the merge is written beside it); the output may not yet. A
    // bare name's parent is the working directory.
    let out = match (out.parent(), out.file_name()) {
        (Some(parent), Some(name)) if parent.as_os_str().is_empty() => {
            absolute(Path::new(".")).join(name)
        }
        (Some(parent), Some(name)) => absolute(parent).join(name),
        _ => absolute(out),
    };
    relative(&out, &folder)
}

/// `path` made absolute with its `.` and `..` taken away lexically (`a/b/../c` is `a/c`).
fn lexical(path: &Path) -> PathBuf {
    let mut out = PathBuf::new();
    for c in std::path::absolute(path)
        .unwrap_or(path.into())
        .components()
    {
        match c {
            std::path::Component::ParentDir => {
                out.pop();
            }
            std::path::Component::CurDir => {}
            c => out.push(c),
        }
    }
    out
}

/// `to` relative to the folder `from` (both absolute): `..` up to their common ancestor, then
/// down to `to`.
fn relative(from: &Path, to: &Path) -> PathBuf {
    let (from, to): (Vec<_>, Vec<_>) = (from.components().collect(), to.components().collect());
    let common = from.iter().zip(&to).take_while(|(a, b)| a == b).count();
    let mut rel = PathBuf::new();
    for _ in common..from.len() {
        rel.push("..");
    }
    for c in &to[common..] {
        rel.push(c);
    }
    if rel.as_os_str().is_empty() {
        rel.push(".");
    }
    rel
}

/// The folder a record's name for an input stands for, read from the merged folder `out`: a Hub
/// snapshot found in the cache (as named when it is not there), a relative path under `out`, an
/// absolute path (records before relative ones) as it is.
pub fn resolved_path(out: &Path, recorded: &Path) -> PathBuf {
    if let Some(id) = recorded.to_str().and_then(|s| s.strip_prefix(HUB_PREFIX)) {
        return crate::hub::ModelId::parse(id)
            .and_then(|m| crate::hub::cached(&m, &crate::hub::cache_dir()))
            .map_or_else(|| recorded.to_path_buf(), |(dir, _)| dir);
    }
    if recorded.is_absolute() {
        recorded.to_path_buf()
    } else {
        out.join(recorded)
    }
}

/// The overlap figure a RAM+ merge writes beside its weights (see `crate::figures::overlap`).
pub const OVERLAP_FIGURE: &str = "overlap.svg";

/// One agent as the record names it, with its λ and probe counts.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct AgentSummary {
    /// The folder as [`recorded_path`] names it.
    pub path: String,
    /// The name the user gave the agent (`--name`, a recipe's `name:`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// λ_t (global scope and `ram`); `None` for tensor scope, see `tensor_lambdas`.
    pub lambda: Option<f64>,
    /// Unique / shared element counts from the probe, when one ran.
    pub counts: Option<AgentCounts>,
    /// What the merge kept of the agent's update, Σ Δ·τ / Σ τ² over the elements it changed
    /// (ResMerge, which can keep nothing of a low-rank agent).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kept: Option<f64>,
    /// RAM+ into a dtype narrower than f32: the share of the elements the agent alone changed
    /// (λ ≠ 1) that the output holds at plain RAM's value — the boost rounded away.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub boost_rounded_away: Option<f64>,
}

/// The weight files of one input model as the merge read them.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct InputChecksums {
    /// The folder as [`recorded_path`] names it (relative to the merged folder, or a Hub id;
    /// absolute in records before 0.2). [`resolved_path`] finds it.
    pub path: PathBuf,
    /// `org/name@commit` where the folder is a Hugging Face cache snapshot (a model named by Hub
    /// id): a rerun or `verify --against` elsewhere names the same snapshot.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hub_id: Option<String>,
    /// Each weight file read, with its size and CRC-32.
    pub files: Vec<FileChecksum>,
    /// The format its weights were read from, where it is not safetensors
    /// ([`crate::checkpoint::ModelFolder::other_format`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub format: Option<String>,
}

/// How a merged folder was made (`rlmerge_record.json`): the method and its parameters, λ per
/// agent, and the checksums of every file read and written (`rlmerge verify` checks them).
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct MergeRecord {
    /// `rlmerge`.
    pub tool: String,
    /// The rlmerge version that wrote it.
    pub version: String,
    /// The method with its parameters, and SVC's α where the merge was spectrally calibrated
    /// (SPEC §4e): the record's `method` and `svc`.
    #[serde(flatten)]
    pub merging: Merging,
    /// RAM's ε.
    pub epsilon: f32,
    /// NaN/±Inf inputs were merged by IEEE rules instead of refused.
    pub allow_nonfinite: bool,
    /// Tensors missing in some models were let through (`--allow-missing-tensors`).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub allow_missing_tensors: bool,
    /// Agents' F32 weights were read as stored, not rounded to the base's dtype
    /// (`--raw-f32-agents`).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub raw_f32_agents: bool,
    /// Whose config.json the output took when the user said (`base`, or an agent as
    /// [`recorded_path`] names it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub config_from: Option<String>,
    /// The backend that made the merge (`cpu` or `gpu`; `None` in records before it): the
    /// spectral methods' bytes depend on it, so `verify --against` recomputes on it where it can,
    /// or compares within their tolerance.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub backend: Option<String>,
    /// The base model's folder as [`recorded_path`] names it.
    pub base: String,
    /// The agents in order.
    pub agents: Vec<AgentSummary>,
    /// Tensor scope: λ per agent for each tensor.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tensor_lambdas: Vec<(std::sync::Arc<str>, Vec<f64>)>,
    /// Layer and module scope: λ per agent for each group (a layer, or a module kind).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub group_lambdas: Vec<(String, Vec<f64>)>,
    /// `None`: each tensor kept the base's dtype.
    pub out_dtype: Option<String>,
    /// The dtype of the output's tensors by its torch name (of most of them, where the base mixes
    /// dtypes); `None` in records older than it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub main_dtype: Option<String>,
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
    /// Largest output shard in bytes.
    pub shard_size: u64,
    /// What the merge warned about.
    pub warnings: Vec<String>,
    /// Base first, then the agents in order.
    pub inputs: Vec<InputChecksums>,
    /// Every file written beside this record but the model card: shards, index, config and
    /// tokenizer copies.
    pub outputs: Vec<FileChecksum>,
    /// A multi-stage recipe's earlier stages, in the order they ran, each with the record of its
    /// merge (paths as seen from this folder); this record is its last stage's.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub stages: Vec<StageRecord>,
}

/// One earlier stage of a multi-stage recipe: its name and the record of its merge.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct StageRecord {
    /// The stage's `name:`, by which later stages take it as a model.
    pub name: String,
    /// The stage's merge, its paths as seen from the final output.
    pub record: Box<MergeRecord>,
}

/// How a record names a stage's output that was made in scratch and removed after the merge:
/// `stage:NAME`.
pub const STAGE_PREFIX: &str = "stage:";

impl MergeRecord {
    /// Whether this is a conversion (`rlmerge convert`): a passthrough of one model over itself as
    /// the layout, or of an adapter over its base.
    pub fn is_conversion(&self) -> bool {
        let passthrough = matches!(&self.merging.method,
            Method::Combine(c) if c.kind == crate::method::Kind::Passthrough);
        match self.agents.as_slice() {
            [a] if passthrough => a.path == self.base || self.adapter_applied(),
            _ => false,
        }
    }

    /// Whether the one agent of a conversion was an adapter (its files are PEFT's).
    pub fn adapter_applied(&self) -> bool {
        self.inputs.get(1).is_some_and(|i| {
            i.files
                .iter()
                .any(|f| f.file == crate::checkpoint::files::ADAPTER_CONFIG)
        })
    }

    /// The output's weight shards.
    pub fn shards(&self) -> impl Iterator<Item = &FileChecksum> {
        self.outputs
            .iter()
            .filter(|f| f.file.ends_with(".safetensors"))
    }

    /// This record, made in `from`, as read from `to`: every input path, its folder found from
    /// `from`, named from `to` — or `stage:NAME` where it is one of the `scratch` stage folders
    /// (name, folder), which are removed once the merge is done.
    pub fn rebased(mut self, from: &Path, to: &Path, scratch: &[(String, PathBuf)]) -> MergeRecord {
        if from == to && scratch.is_empty() {
            return self; // nothing moves
        }
        // `from` may not exist yet (a merge's record is written before its folder is put in
        // place): `..` is taken lexically first.
        let real = |p: &Path| {
            let lexical = lexical(p);
            std::fs::canonicalize(&lexical).unwrap_or(lexical)
        };
        let same = |a: &Path, b: &Path| real(a) == real(b);
        let moved = |recorded: &str| -> String {
            if recorded.starts_with(HUB_PREFIX) || recorded.starts_with(STAGE_PREFIX) {
                return recorded.to_string();
            }
            let folder = resolved_path(from, Path::new(recorded));
            match scratch.iter().find(|(_, f)| same(f, &folder)) {
                Some((name, _)) => format!("{STAGE_PREFIX}{name}"),
                None => recorded_path(to, &folder).display().to_string(),
            }
        };
        self.base = moved(&self.base);
        for a in &mut self.agents {
            a.path = moved(&a.path);
        }
        for i in &mut self.inputs {
            i.path = PathBuf::from(moved(&i.path.to_string_lossy()));
        }
        if let Some(c) = self.config_from.as_mut().filter(|c| *c != "base") {
            *c = moved(c);
        }
        self
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

    /// Every file the record lists is one it may list ([`check_file_names`]).
    fn check_file_names(&self) -> Result<()> {
        check_file_names(&self.outputs, &self.inputs)
    }
}

/// Every file a record lists — outputs, and each input folder's files — must be a plain file
/// name inside its folder (a downloaded folder's record is not trusted to send `verify`
/// elsewhere: no `/`, `\`, `..`, `.`, empty or NUL names); an input's may be one inside the
/// `huggingface/` folder of a trainer's checkpoint. A merge's record and a tool's alike.
pub fn check_file_names(outputs: &[FileChecksum], inputs: &[InputChecksums]) -> Result<()> {
    let outputs = outputs.iter().map(|f| (f, false));
    let inputs = inputs.iter().flat_map(|i| &i.files).map(|f| (f, true));
    for (f, input) in outputs.chain(inputs) {
        let name = f.file.as_str();
        if !is_recorded_file_name(name, input) {
            anyhow::bail!(
                "it lists the file '{}', which is not a plain file name inside its folder",
                crate::escape::terminal(name)
            );
        }
    }
    Ok(())
}

/// Whether a record may list `name`: a plain file name inside its folder ([`is_plain_file_name`]),
/// or for an `input`'s file, one inside the `huggingface/` folder of a trainer's checkpoint.
fn is_recorded_file_name(name: &str, input: bool) -> bool {
    let hf = format!("{}/", crate::checkpoint::fsdp_shards::HF_FOLDER);
    is_plain_file_name(name)
        || (input
            && name
                .strip_prefix(hf.as_str())
                .is_some_and(is_plain_file_name))
}

/// Whether a record's file name is a plain name inside its folder: not empty, `.` or `..`, no
/// `/`, `\`, NUL, not absolute — a downloaded folder's record is not trusted to send `verify`
/// elsewhere.
fn is_plain_file_name(name: &str) -> bool {
    !name.is_empty()
        && name != "."
        && name != ".."
        && !name.contains(['/', '\\', '\0'])
        && !std::path::Path::new(name).is_absolute()
}

/// Writes the record and the model card into `dir`; `recipe` is the mergekit recipe the merge
/// saved beside them (a recipe's, or the command line's as one), which the card shows, and
/// `config` the output's config.json (which class loads it).
pub fn write(
    dir: &Path,
    record: &MergeRecord,
    recipe: Option<&str>,
    config: Option<&serde_json::Value>,
) -> Result<()> {
    let path = dir.join(RECORD_FILE);
    std::fs::write(&path, serde_json::to_string_pretty(record)? + "\n")
        .with_context(|| format!("cannot write {}", path.display()))?;
    let path = dir.join(CARD_FILE);
    // The merged config says which class loads the model.
    std::fs::write(&path, model_card(record, recipe, config))
        .with_context(|| format!("cannot write {}", path.display()))?;
    Ok(())
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
