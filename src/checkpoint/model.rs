//! A Hugging Face model folder: `model.safetensors`, or shards listed by `model.safetensors.index.json`.

use super::dtype::DType;
use super::fsdp_shards;
use super::lora::LoraAdapter;
use super::pieces::Pieces;
use super::quantized::Quantized;
use super::weight_file::{crc32_of_file, FileChecksum, Interner, TensorEntry, WeightFile};
use anyhow::{bail, ensure, Context, Result};
use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use super::files::{
    check_regular_file, WeightFormat, INDEX_FILE, SINGLE_FILE, TORCH_INDEX_FILE, TORCH_SINGLE_FILE,
};
use crate::model_config::{ModelConfig, CONFIG_FILE};

/// A tensor of a model: which shard holds it and where.
#[derive(Clone, Debug)]
pub struct ModelTensor {
    /// Index of the shard that holds it in [`ModelFolder::shards`].
    pub shard: usize,
    /// Its header entry: dtype, shape, offset — as the folder presents it.
    pub entry: TensorEntry,
    /// Where a tensor is not one range of one file in its presented dtype (a sharded trainer
    /// checkpoint's, cut over its ranks' files, fp32 masters shown as bf16): its pieces.
    pub pieces: Option<Arc<Pieces>>,
}

/// An opened model folder: every shard's header is parsed; no tensor data is read.
pub struct ModelFolder {
    /// The folder.
    pub dir: PathBuf,
    /// The format of its weight files.
    pub format: WeightFormat,
    /// What it was read from where it is a trainer's checkpoint or a quantized one, not a plain
    /// Hugging Face folder (`verl FSDP shards (2 ranks)`, `FP8 block-scaled safetensors …`).
    pub trainer: Option<String>,
    /// (name dropped, name kept) for each tensor its files hold under two names (tied weights).
    pub aliases: Vec<(Arc<str>, Arc<str>)>,
    /// Entries of a trainer's checkpoint that are not the model's tensors, not read (a DCP
    /// checkpoint's optimizer state, non-tensor objects).
    pub skipped: Vec<String>,
    /// Its weight files in shard order, headers parsed and validated.
    pub shards: Vec<WeightFile>,
    /// Tensors in storage order (shard, then offset).
    pub tensors: Vec<ModelTensor>,
    /// Indices into `tensors`, sorted by name: lookups by binary search, 4 bytes per tensor (a
    /// model may have 10^5 tensors).
    by_name: Vec<u32>,
    /// A LoRA agent: the base's shards read through this adapter (`dir` is the adapter's).
    pub lora: Option<LoraAdapter>,
    /// The folder holding the model's config.json: `dir`, or a LoRA agent's base.
    config_dir: PathBuf,
    /// That config.json, read once as the folder opened (`None`: the folder has none).
    config: Option<ModelConfig>,
}

/// A model folder that is not there: a usage error naming the folder meant where a sibling's
/// name is close (a typo); a broken or looping link, bad input.
fn refuse_missing(dir: &Path) -> Result<()> {
    if dir.exists() {
        return Ok(());
    }
    if dir.symlink_metadata().is_ok() {
        bail!(
            "model folder {} does not exist (a broken or looping link)",
            dir.display()
        );
    }
    Err(crate::error::usage(format!(
        "model folder {} does not exist{}",
        dir.display(),
        crate::error::sibling_hint(dir)
    )))
}

impl ModelFolder {
    /// Opens the model folder `dir`: its config, index and every shard's header (no tensor data).
    pub fn open(dir: &Path) -> Result<ModelFolder> {
        Self::open_interned(dir, &mut Interner::default())
    }

    /// [`Self::open`], sharing tensor names and shapes with the folders opened before through
    /// `interner` (see [`Interner`]).
    pub fn open_interned(dir: &Path, interner: &mut Interner) -> Result<ModelFolder> {
        Self::open_with(dir, interner, false)
    }

    /// [`Self::open_interned`]; `raw_f32`: a trainer checkpoint's fp32 masters are shown as
    /// stored, not as their bf16 rounding (`--raw-f32-agents`).
    pub fn open_with(dir: &Path, interner: &mut Interner, raw_f32: bool) -> Result<ModelFolder> {
        refuse_missing(dir)?;
        if !dir.is_dir() {
            bail!(
                "{} is not a folder (expected a Hugging Face model folder)",
                dir.display()
            );
        }
        // A trainer's checkpoint: verl's rank shards, or a torch DCP folder.
        let trainer = match fsdp_shards::rank_files(dir)? {
            Some((_, paths)) => Some(fsdp_shards::open(dir, &paths, interner, raw_f32)?),
            None if super::dcp::is_dcp(dir) => Some(super::dcp::open(dir, interner)?),
            None => None,
        };
        if let Some(opened) = trainer {
            let tensors = opened
                .tensors
                .into_iter()
                .map(|(entry, pieces, shard)| ModelTensor {
                    shard,
                    entry,
                    pieces: Some(pieces),
                })
                .collect();
            let config = ModelConfig::read_if_present(&opened.config_dir)?;
            let mut folder = Self::from_parts(
                dir,
                (WeightFormat::Torch, opened.files, tensors),
                (opened.config_dir, config),
            )?;
            folder.trainer = Some(opened.described);
            folder.aliases = opened.aliases;
            folder.skipped = opened.skipped;
            return Ok(folder);
        }
        Self::open_hf(dir, interner)
    }

    /// A Hugging Face folder's weight files, safetensors or torch.save; an FP8 block-scaled
    /// checkpoint's matrices and an MXFP4 one's experts presented as bf16 ([`super::fp8`],
    /// [`super::mxfp4`]).
    fn open_hf(dir: &Path, interner: &mut Interner) -> Result<ModelFolder> {
        let Some((format, index_path, index, shard_names)) = weight_files(dir)? else {
            return Err(no_weights(dir));
        };
        // The config, read once: it also says whether the weights are quantized.
        let config = ModelConfig::read_if_present(dir)?;
        let quantized = match format {
            WeightFormat::Safetensors => Quantized::of(config.as_ref().map(ModelConfig::json))
                .with_context(|| format!("{}", dir.join(CONFIG_FILE).display()))?,
            WeightFormat::Torch => None,
        };
        let mut shards = Vec::with_capacity(shard_names.len());
        let (mut tensors, mut raw) = (Vec::new(), Vec::new());
        for (i, name) in shard_names.iter().enumerate() {
            let path = dir.join(name);
            if path.symlink_metadata().is_err() {
                bail!(
                    "{}: names shard {name}, which is missing at {}",
                    index_path.display(),
                    path.display()
                );
            }
            let (file, listed) = match format {
                WeightFormat::Safetensors => {
                    let raw_dtype = quantized.map(Quantized::raw_dtype);
                    super::safetensors_file::open_with(&path, interner, raw_dtype)?
                }
                WeightFormat::Torch => {
                    let (file, entries) = super::torch_file::open(&path, interner)?;
                    (file, entries.into_iter().map(|e| (e, false)).collect())
                }
            };
            for (entry, stored_raw) in listed {
                tensors.push(ModelTensor {
                    shard: i,
                    entry,
                    pieces: None,
                });
                raw.push(stored_raw);
            }
            shards.push(file);
        }
        if let Some(index) = &index {
            check_index_matches(&index_path, index, &shard_names, &tensors)?;
        }
        let Some(quantized) = quantized else {
            return Self::from_parts(dir, (format, shards, tensors), (dir.to_path_buf(), config));
        };
        let listed = tensors
            .into_iter()
            .zip(raw)
            .map(|(t, raw)| (t.shard, t.entry, raw))
            .collect();
        let tensors = quantized
            .dequantized(dir, &shards, listed, interner)?
            .into_iter()
            .map(|(shard, entry, pieces)| ModelTensor {
                shard,
                entry,
                pieces,
            })
            .collect();
        let mut folder =
            Self::from_parts(dir, (format, shards, tensors), (dir.to_path_buf(), config))?;
        folder.trainer = Some(quantized.described());
        Ok(folder)
    }

    /// The folder `dir` of weight files `shards` holding `tensors`, with `config`, the
    /// config.json its caller read (once) from `config_dir`: tensor names checked unique across
    /// files and indexed.
    fn from_parts(
        dir: &Path,
        (format, shards, mut tensors): (WeightFormat, Vec<WeightFile>, Vec<ModelTensor>),
        (config_dir, config): (PathBuf, Option<ModelConfig>),
    ) -> Result<ModelFolder> {
        tensors.shrink_to_fit();
        let mut by_name: Vec<u32> = (0..tensors.len() as u32).collect();
        by_name.sort_unstable_by(|&a, &b| {
            tensors[a as usize]
                .entry
                .name
                .cmp(&tensors[b as usize].entry.name)
        });
        // A name twice within a shard was refused by its header's parser: here, across shards.
        if let Some(pair) = by_name
            .windows(2)
            .find(|p| tensors[p[0] as usize].entry.name == tensors[p[1] as usize].entry.name)
        {
            bail!(
                "{}: tensor '{}' appears in more than one shard",
                dir.display(),
                tensors[pair[0] as usize].entry.name
            );
        }
        Ok(ModelFolder {
            dir: dir.to_path_buf(),
            format,
            shards,
            tensors,
            by_name,
            lora: None,
            config,
            config_dir,
            trainer: None,
            aliases: Vec::new(),
            skipped: Vec::new(),
        })
    }

    /// A LoRA agent: the base at `base_dir` with adapter folder `adapter_dir` applied (see
    /// [`super::lora`]); every module the adapter updates must be a base tensor of its shape.
    pub fn open_lora(
        base_dir: &Path,
        adapter_dir: &Path,
        interner: &mut Interner,
    ) -> Result<ModelFolder> {
        let mut folder = Self::open_interned(base_dir, interner)?;
        let adapter = LoraAdapter::open(adapter_dir, interner)?;
        for name in adapter.targets() {
            let Some(t) = folder.get(name) else {
                bail!(
                    "{}: the adapter updates '{name}', which the base {} does not have; was it \
                     trained on this base?",
                    adapter_dir.display(),
                    base_dir.display()
                );
            };
            adapter.check_shape(name, &t.entry.shape)?;
        }
        for (name, len) in adapter.bias_targets() {
            match folder.get(name) {
                Some(t) if t.entry.shape[..] == [len] => {}
                found => bail!(
                    "{}: the adapter's lora_B bias adds to '{name}' ({len} values), which the base \
                     {} {}",
                    adapter_dir.display(),
                    base_dir.display(),
                    match found {
                        Some(t) => format!("has as {}", super::weight_file::shape_text(&t.entry.shape)),
                        None => "does not have (PEFT adds a lora_B bias to the layer's own bias, and refuses \
                                 to merge one without)"
                            .into(),
                    }
                ),
            }
        }
        folder.replace_with_whole_modules(&adapter, adapter_dir)?;
        folder.dir = adapter_dir.to_path_buf();
        folder.lora = Some(adapter);
        Ok(folder)
    }

    /// A LoRA agent's tensors that its adapter saves whole (`modules_to_save`) are read from the
    /// adapter's file, a shard of its own: the base's tensor of that name and shape replaced.
    fn replace_with_whole_modules(
        &mut self,
        adapter: &LoraAdapter,
        adapter_dir: &Path,
    ) -> Result<()> {
        if adapter.whole.is_empty() {
            return Ok(());
        }
        let path = &adapter.file.path;
        let meta =
            std::fs::metadata(path).with_context(|| format!("cannot stat {}", path.display()))?;
        let spans = adapter
            .whole
            .iter()
            .map(|(_, e)| (e.offset, e.byte_len()))
            .collect();
        self.shards.push(WeightFile::new(path, &meta, spans));
        let shard = self.shards.len() - 1;
        for (name, e) in &adapter.whole {
            let Some(i) = self.index_of(name) else {
                bail!(
                    "{}: the adapter saves '{name}' whole, which the base {} does not have",
                    adapter_dir.display(),
                    self.dir.display()
                );
            };
            let t = &mut self.tensors[i];
            ensure!(
                t.entry.shape == e.shape,
                "{}: the adapter saves '{name}' as {}, the base has it as {}",
                adapter_dir.display(),
                super::weight_file::shape_text(&e.shape),
                super::weight_file::shape_text(&t.entry.shape)
            );
            let name = t.entry.name.clone();
            *t = ModelTensor {
                shard,
                entry: TensorEntry { name, ..e.clone() },
                pieces: None,
            };
        }
        Ok(())
    }

    /// The folder whose config.json describes this model: its own, or a LoRA agent's base's.
    pub fn config_dir(&self) -> &Path {
        &self.config_dir
    }

    /// The config.json that describes this model (a LoRA agent's: its base's), read as the
    /// folder opened; `None` where there is none.
    pub fn config(&self) -> Option<&ModelConfig> {
        self.config.as_ref()
    }

    /// The folder's own config.json: `None` for a LoRA agent (it runs with its base's) and for a
    /// folder without one.
    pub fn own_config(&self) -> Option<&ModelConfig> {
        self.config.as_ref().filter(|_| self.lora.is_none())
    }

    /// Whether tensor `name` is the base's plus a LoRA update (read as f32).
    pub fn has_update(&self, name: &str) -> bool {
        self.lora_for(name).is_some()
    }

    /// The adapter that updates tensor `name`, when this agent is a LoRA one that does.
    pub fn lora_for(&self, name: &str) -> Option<&LoraAdapter> {
        self.lora.as_ref().filter(|l| l.adds_to(name))
    }

    /// The tensor called `name`, if the model has it.
    pub fn get(&self, name: &str) -> Option<&ModelTensor> {
        self.index_of(name).map(|i| &self.tensors[i])
    }

    /// The index of tensor `name` in [`Self::tensors`].
    pub fn index_of(&self, name: &str) -> Option<usize> {
        self.by_name
            .binary_search_by(|&i| (*self.tensors[i as usize].entry.name).cmp(name))
            .ok()
            .map(|k| self.by_name[k] as usize)
    }

    /// Reads `buf.len()` bytes of `tensor` from byte `start` within it.
    pub fn read(&self, tensor: &ModelTensor, start: u64, buf: &mut [u8]) -> Result<()> {
        match &tensor.pieces {
            None => self.shards[tensor.shard].read(&tensor.entry, start, buf),
            Some(p) => p.read(&self.shards, &tensor.entry, start, buf),
        }
    }

    /// Feeds bytes just read to the shard's running checksum (see [`WeightFile::record_read`]).
    pub fn record_read(&self, tensor: &ModelTensor, start: u64, bytes: &[u8]) {
        // A tensor read from pieces was hashed as stored while it was read.
        if tensor.pieces.is_none() {
            self.shards[tensor.shard].record_read(&tensor.entry, start, bytes)
        }
    }

    /// Path of the file holding `tensor` (for messages; of a tensor in pieces, its first's).
    pub fn file_of(&self, tensor: &ModelTensor) -> &Path {
        &self.shards[tensor.shard].path
    }

    /// Path of the file holding element `element` of `tensor` (a tensor in pieces has several).
    pub fn file_holding(&self, tensor: &ModelTensor, element: u64) -> &Path {
        match tensor.pieces.as_ref().and_then(|p| p.part_at(element)) {
            Some(part) => &self.shards[part.file].path,
            None => self.file_of(tensor),
        }
    }

    /// Size and CRC-32 of every file the merge reads: the files that hold weights (shards, and
    /// the index when sharded) and the config.json that says how they are used; a LoRA agent's
    /// are its adapter's files (its base's are the base input's). `verify` checks them all, so a
    /// config changed since the merge is caught as a weight is.
    pub fn checksums(&self) -> Result<Vec<FileChecksum>> {
        if let Some(l) = &self.lora {
            return Ok(vec![
                l.file.checksum()?,
                crc32_of_file(&l.dir.join(super::files::ADAPTER_CONFIG))?,
            ]);
        }
        let mut sums = self
            .shards
            .iter()
            .map(|s| s.checksum())
            .collect::<Result<Vec<_>>>()?;
        for path in [
            self.dir.join(self.format.index_file()),
            self.dir.join(super::dcp::METADATA),
            self.config_dir.join(CONFIG_FILE),
        ] {
            if path.symlink_metadata().is_ok() {
                let mut sum = crc32_of_file(&path)?;
                // Named from the folder: `huggingface/config.json` in a trainer's checkpoint.
                if let Ok(inside) = path.strip_prefix(&self.dir) {
                    sum.file = inside.to_string_lossy().into_owned();
                }
                sums.push(sum);
            }
        }
        Ok(sums)
    }

    /// Fails if any shard changed since it was opened.
    pub fn check_unchanged(&self) -> Result<()> {
        self.shards.iter().try_for_each(|s| s.check_unchanged())?;
        self.lora.iter().try_for_each(|l| l.file.check_unchanged())
    }

    /// The folder and every file of it that holds weights (shards, index).
    pub fn paths(&self) -> Vec<PathBuf> {
        let mut paths = vec![self.dir.clone()];
        paths.extend(self.shards.iter().map(|s| s.path.clone()));
        let index = self.dir.join(self.format.index_file());
        if index.symlink_metadata().is_ok() {
            paths.push(index);
        }
        if let Some(l) = &self.lora {
            paths.push(l.file.path.clone());
            paths.push(l.dir.join(super::files::ADAPTER_CONFIG));
        }
        paths
    }

    /// The format its weights are read from where it is not safetensors (said on stderr, in the
    /// record and the card): `torch.save (pytorch_model.bin)`, or a LoRA agent's adapter saved
    /// by torch.save.
    pub fn other_format(&self) -> Option<String> {
        if let Some(t) = &self.trainer {
            return Some(t.clone());
        }
        let format = match &self.lora {
            Some(l) => l
                .file
                .path
                .ends_with(super::files::ADAPTER_TORCH_WEIGHTS)
                .then_some("torch.save (adapter_model.bin)"),
            None => (self.format != WeightFormat::Safetensors).then(|| self.format.name()),
        };
        format.map(|f| format!("{f} files"))
    }

    /// Total bytes of tensor data.
    pub fn data_bytes(&self) -> u64 {
        self.tensors.iter().map(|t| t.entry.byte_len()).sum()
    }

    /// The most common dtype among the tensors (the model's dtype, for defaults and config.json).
    pub fn main_dtype(&self) -> Option<DType> {
        let mut counts: BTreeMap<&'static str, (u64, DType)> = BTreeMap::new();
        for t in &self.tensors {
            counts
                .entry(t.entry.dtype.safetensors_name())
                .or_insert((0, t.entry.dtype))
                .0 += t.entry.numel as u64;
        }
        counts.values().max_by_key(|(n, _)| *n).map(|(_, d)| *d)
    }
}

/// The weight files of `dir` in the first format it holds (see [`WeightFormat::ALL`]): the
/// format, the index's path, the index when sharded, and the shard names; `None` when it holds
/// none. A folder with both one file and an index of one format is refused: which is the model
/// is ambiguous.
#[allow(clippy::type_complexity)]
fn weight_files(
    dir: &Path,
) -> Result<Option<(WeightFormat, PathBuf, Option<IndexJson>, Vec<String>)>> {
    // Present even as a broken or looping link: opening it then says what is wrong with it.
    let present = |p: &Path| p.symlink_metadata().is_ok();
    for format in WeightFormat::ALL {
        let (single, index) = (format.single_file(), format.index_file());
        let index_path = dir.join(index);
        let single_path = dir.join(single);
        if present(&index_path) && present(&single_path) {
            bail!(
                "{} holds both {single} and {index}: transformers would load {single} alone, so \
                 which weights are meant is ambiguous; remove the one that is not the model",
                dir.display()
            );
        }
        if present(&index_path) {
            // Read once: it names the shards, and then every tensor must be where it says.
            let parsed = read_index(&index_path)?;
            let shards = index_shards(&index_path, &parsed)?;
            return Ok(Some((format, index_path, Some(parsed), shards)));
        }
        if present(&single_path) {
            return Ok(Some((format, index_path, None, vec![single.to_string()])));
        }
    }
    Ok(None)
}

/// Why a folder without weight files cannot be read: a LoRA adapter is named as one.
fn no_weights(dir: &Path) -> anyhow::Error {
    if dir
        .join(super::files::ADAPTER_CONFIG)
        .symlink_metadata()
        .is_ok()
    {
        return crate::error::data(crate::message![
            format!(
                "{} is a LoRA adapter, not a full model: give it as an agent (",
                dir.display()
            ),
            crate::error::Arg::named("--model", "one of models"),
            ", or BASE+ADAPTER), with the model it was trained on as the base",
        ]);
    }
    anyhow::anyhow!(
        "{}: no {SINGLE_FILE}, {INDEX_FILE}, {TORCH_SINGLE_FILE} or {TORCH_INDEX_FILE} (rlmerge \
         reads Hugging Face folders of safetensors or torch.save weights)",
        dir.display()
    )
}

#[derive(serde::Deserialize)]
struct IndexJson {
    weight_map: BTreeMap<String, String>,
}

/// The distinct shard files an index names, in first-seen order of sorted file names.
fn index_shards(index_path: &Path, index: &IndexJson) -> Result<Vec<String>> {
    let mut files: Vec<String> = index.weight_map.values().cloned().collect();
    files.sort();
    files.dedup();
    for f in &files {
        check_shard_name(index_path, f)?;
    }
    if files.is_empty() {
        bail!("{}: weight_map is empty", index_path.display());
    }
    Ok(files)
}

/// Reads and parses an index (a regular file: a FIFO would block the read forever).
fn read_index(index_path: &Path) -> Result<IndexJson> {
    check_regular_file(index_path)?;
    let text = std::fs::read_to_string(index_path)
        .with_context(|| format!("cannot read {}", index_path.display()))?;
    serde_json::from_str(&text)
        .with_context(|| format!("{}: corrupt index JSON", index_path.display()))
}

/// A shard name in an index: a path of plain names inside the model folder (`sub/x` and `./x`
/// as well as `x`), never empty, absolute or with `..`.
fn check_shard_name(index_path: &Path, name: &str) -> Result<()> {
    use std::path::Component;
    let p = Path::new(name);
    let bad = |why: &str| {
        anyhow::anyhow!(
            "{}: shard name '{}' {why}",
            index_path.display(),
            crate::escape::terminal(name)
        )
    };
    if name.is_empty() {
        return Err(bad("is empty"));
    }
    if p.components().any(|c| {
        matches!(
            c,
            Component::RootDir | Component::Prefix(_) | Component::ParentDir
        )
    }) {
        return Err(bad("must name a file inside the model folder"));
    }
    if !p.components().any(|c| matches!(c, Component::Normal(_))) || name.ends_with('/') {
        return Err(bad("names a folder, not a file"));
    }
    Ok(())
}

/// Every tensor the index maps must be in the shard it names.
fn check_index_matches(
    index_path: &Path,
    index: &IndexJson,
    shard_names: &[String],
    tensors: &[ModelTensor],
) -> Result<()> {
    let found: HashMap<&str, &str> = tensors
        .iter()
        .map(|t| (&*t.entry.name, shard_names[t.shard].as_str()))
        .collect();
    for (name, file) in &index.weight_map {
        match found.get(name.as_str()) {
            Some(actual) if actual == file => {}
            Some(actual) => bail!(
                "{}: maps tensor '{name}' to {file}, but it is in {actual}",
                index_path.display()
            ),
            None => bail!(
                "{}: maps tensor '{name}' to {file}, which does not contain it",
                index_path.display()
            ),
        }
    }
    Ok(())
}
