//! A torch Distributed Checkpoint (DCP) folder, as `torch.distributed.checkpoint.save` writes it
//! — NeMo-RL's default, AReaL's recovery format, accelerate's FSDP `SHARDED_STATE_DICT`
//! (`pytorch_model_fsdp_0/`): `.metadata`, a pickle of data classes saying each tensor's dtype,
//! shape and chunks (offsets and sizes in the whole tensor) and where each chunk's bytes are
//! (`__R_I.distcp`, offset, length); each chunk is a `torch.save(tensor)` archive at that range.
//! The pickle and every chunk's pickle are read as data ([`super::pickle`]), never run. A tensor
//! is its chunks in row order, read in place and in the stored dtype, as `dcp.load` gives it;
//! chunks that cut along another dimension (tensor parallelism), overlap or leave rows out are
//! refused naming the tensor.
//!
//! Names are the state dict's: where the checkpoint holds the model under a key (`{"model":
//! model.state_dict()}`, accelerate's and NeMo-RL's layout, flattened by DCP to
//! `model.<name>`), the model's tensors are those under `model`, named as the model names them;
//! other entries (an optimizer's state, non-tensor objects) are not read, and said.

use super::dtype::DType;
use super::pickle::{self, Value};
use super::pieces::{Assembled, Piece, Pieces, Stored};
use super::torch_file::{int, ints, read_one_at, MAX_PICKLE};
use super::weight_file::{shape_text, Interner, TensorEntry, WeightFile};
use anyhow::{bail, ensure, Context, Result};
use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;

/// The file that makes a folder a DCP checkpoint.
pub const METADATA: &str = ".metadata";

/// The key a checkpoint holding more than the model keeps the model under.
const MODEL_KEY: &str = "model";

/// Whether `dir` is a DCP checkpoint (holds [`METADATA`]).
pub fn is_dcp(dir: &Path) -> bool {
    dir.join(METADATA).symlink_metadata().is_ok()
}

/// One chunk of a tensor as the metadata lists it.
struct Chunk {
    offsets: Vec<usize>,
    sizes: Vec<usize>,
}

/// A tensor as the metadata lists it: its dtype's name, its size, its chunks.
struct TensorMeta {
    dtype: String,
    size: Vec<usize>,
    chunks: Vec<Chunk>,
}

/// A `.distcp` file chunks are read from: its name, the open file, its metadata, and the byte
/// ranges read from it (its checksum's spans).
struct ChunkFile {
    name: String,
    file: std::fs::File,
    meta: std::fs::Metadata,
    spans: Vec<(u64, u64)>,
}

/// The output head and the embeddings a config with `tie_word_embeddings` ties.
const TIED_HEAD: &str = "lm_head.weight";
const TIED_EMBEDDINGS: &str = "model.embed_tokens.weight";

/// Where a chunk's archive is.
struct ChunkAt {
    file: String,
    offset: u64,
    length: u64,
}

/// Opens the DCP folder `dir`: its metadata, then each chunk's archive (its small pickle), the
/// tensors assembled from their chunks. No tensor data is read. A tied head saved beside the
/// embeddings is read once, as transformers loads and saves it.
pub fn open(dir: &Path, interner: &mut Interner) -> Result<Assembled> {
    let path = dir.join(METADATA);
    let (file, meta) = super::files::open_regular(&path)?;
    ensure!(
        meta.len() <= MAX_PICKLE,
        "{}: {} bytes (at most {MAX_PICKLE})",
        path.display(),
        meta.len()
    );
    let bytes = super::positional::read_vec_at(&file, 0, meta.len() as usize)
        .with_context(|| format!("cannot read {}", path.display()))?;
    let value = pickle::read(&bytes, &path.display().to_string())?;
    drop(bytes);
    let metadata = Metadata::of(&value).with_context(|| {
        format!(
            "{}: not the metadata torch.distributed.checkpoint writes",
            path.display()
        )
    })?;
    let mut opened = metadata.tensors(dir, interner)?;
    // A model's state dict holds a tied head under its own name too; transformers ties it to the
    // embeddings on loading whatever it holds (tied is its default where the config is silent).
    let tied = crate::model_config::ModelConfig::read_if_present(dir)?.is_some_and(|c| {
        let key = |v: &serde_json::Value| v.get("tie_word_embeddings").cloned();
        key(c.decoder()).or_else(|| key(c.json())) != Some(serde_json::Value::Bool(false))
    });
    let has = |n: &str| opened.tensors.iter().any(|t| &*t.0.name == n);
    if tied && has(TIED_HEAD) && has(TIED_EMBEDDINGS) {
        opened.tensors.retain(|t| &*t.0.name != TIED_HEAD);
        opened.aliases = vec![(TIED_HEAD.into(), TIED_EMBEDDINGS.into())];
    }
    Ok(opened)
}

/// The parts of DCP's `Metadata` rlmerge reads.
struct Metadata {
    /// Each entry's flattened name and, for a tensor, its metadata.
    entries: Vec<(String, Option<TensorMeta>)>,
    /// Where each (name, chunk offsets) is stored.
    storage: HashMap<(String, Vec<usize>), ChunkAt>,
    /// Each flattened name's path in the saved state dict (`("model", "lm_head.weight")`).
    paths: HashMap<String, Vec<String>>,
}

impl Metadata {
    fn of(value: &Value) -> Result<Metadata> {
        ensure!(
            value
                .callable_name()
                .is_some_and(|n| n.ends_with("checkpoint.metadata.Metadata")),
            "its pickle holds {}",
            value.kind()
        );
        let mut entries = Vec::new();
        for (key, entry) in dict(&field(value, "state_dict_metadata")?)? {
            let name = text(&key, "a state dict name")?;
            let tensor = match entry.callable_name() {
                Some(n) if n.ends_with(".TensorStorageMetadata") => Some(
                    tensor_metadata(&entry)
                        .with_context(|| format!("the metadata of '{}'", shown(&name)))?,
                ),
                _ => None,
            };
            entries.push((name, tensor));
        }
        let mut storage = HashMap::new();
        for (index, info) in dict(&field(value, "storage_data")?)? {
            let name = text(&field(&index, "fqn")?, "a chunk's tensor name")?;
            // A non-tensor entry (bytes: an optimizer's settings) has no offset.
            let offsets = match field(&index, "offset") {
                Ok(Value::None) | Err(_) => continue,
                Ok(offset) => sizes(&offset, "a chunk's offset")?,
            };
            let transforms = field(&info, "transform_descriptors").unwrap_or(Value::None);
            let plain = match &transforms {
                Value::None => true,
                Value::List(l) => l.borrow().is_empty(),
                Value::Tuple(t) => t.is_empty(),
                _ => false,
            };
            ensure!(
                plain,
                "'{}' is stored through transforms (compression or another extension), which \
                 rlmerge does not read",
                shown(&name)
            );
            let stored = ChunkAt {
                file: text(&field(&info, "relative_path")?, "a chunk's file")?,
                offset: count(&field(&info, "offset")?, "a chunk's offset in its file")?,
                length: count(&field(&info, "length")?, "a chunk's length")?,
            };
            storage.insert((name, offsets), stored);
        }
        let mut paths = HashMap::new();
        if let Ok(Value::Dict(planner)) = field(value, "planner_data") {
            for (key, path) in planner.borrow().iter() {
                let parts = match path {
                    Value::Tuple(t) => t.iter().map(|p| text(p, "a key path")).collect(),
                    Value::List(l) => l.borrow().iter().map(|p| text(p, "a key path")).collect(),
                    _ => Err(anyhow::anyhow!("a key path that is no tuple")),
                };
                if let (Value::Str(k), Ok(parts)) = (key, parts) {
                    paths.insert(k.to_string(), parts);
                }
            }
        }
        Ok(Metadata {
            entries,
            storage,
            paths,
        })
    }

    /// The model's name for a flattened entry, where the checkpoint holds the model under
    /// [`MODEL_KEY`] (`under_model`); `None` for an entry outside it.
    fn model_name(&self, flat: &str, under_model: bool) -> Option<String> {
        if !under_model {
            return Some(flat.to_string());
        }
        match self.paths.get(flat).map(Vec::as_slice) {
            Some([top, rest @ ..]) if top == MODEL_KEY && !rest.is_empty() => Some(rest.join(".")),
            _ => None,
        }
    }

    /// Every tensor of the model, its chunks opened in their files.
    fn tensors(&self, dir: &Path, interner: &mut Interner) -> Result<Assembled> {
        // Only the saved key paths tell a model kept under `model` from a flat state dict whose
        // own names start with `model.` (transformers' do): without them, names stay as saved.
        let under_model = self
            .paths
            .values()
            .any(|p| p.len() > 1 && p[0] == MODEL_KEY);
        let mut files = Vec::new();
        let mut tensors = Vec::new();
        let mut skipped = Vec::new();
        for (flat, tensor) in &self.entries {
            match (self.model_name(flat, under_model), tensor) {
                (Some(name), Some(meta)) => tensors.push(
                    self.assemble(dir, (flat, name, meta), &mut files, interner)
                        .with_context(|| format!("{}: tensor '{}'", dir.display(), shown(flat)))?,
                ),
                _ => skipped.push(flat.clone()),
            }
        }
        ensure!(
            !tensors.is_empty(),
            "{}: its {METADATA} lists no tensors of a model",
            dir.display()
        );
        let described = format!(
            "torch DCP checkpoint ({METADATA}, {} .distcp file(s))",
            files.len()
        );
        Ok(Assembled {
            files: files
                .into_iter()
                .map(|f| WeightFile::new(&dir.join(f.name), &f.meta, f.spans))
                .collect(),
            tensors,
            aliases: Vec::new(),
            skipped,
            described,
            config_dir: dir.to_path_buf(),
        })
    }

    /// The tensor `flat` (the model's `name`), its chunks in row order, each opened in its file.
    fn assemble(
        &self,
        dir: &Path,
        (flat, name, meta): (&str, String, &TensorMeta),
        files: &mut Vec<ChunkFile>,
        interner: &mut Interner,
    ) -> Result<(TensorEntry, Arc<Pieces>, usize)> {
        let ordered = row_order(&meta.size, &meta.chunks)?;
        let mut parts = Vec::with_capacity(ordered.len());
        let mut stored = DType::parse_user(&meta.dtype);
        for chunk in ordered {
            let at = self
                .storage
                .get(&(flat.to_string(), chunk.offsets.clone()))
                .with_context(|| {
                    format!(
                        "its chunk at {} has no storage entry in {METADATA}",
                        shape_text(&chunk.offsets)
                    )
                })?;
            let index = file_index(dir, files, &at.file)?;
            let path = dir.join(&at.file);
            let (t, span) = read_one_at(
                &files[index].file,
                &path,
                (at.offset, at.length),
                &name,
                interner,
            )?;
            ensure!(
                *t.shape == chunk.sizes[..],
                "its chunk in {} holds {}, where {METADATA} says {}",
                at.file,
                shape_text(&t.shape),
                shape_text(&chunk.sizes)
            );
            ensure!(
                stored == Some(t.dtype),
                "its chunk in {} is {}, where {METADATA} says {}",
                at.file,
                t.dtype.torch_name(),
                meta.dtype
            );
            stored = Some(t.dtype);
            files[index].spans.push(span);
            parts.push(Piece {
                file: index,
                offset: t.offset,
                numel: t.numel as u64,
            });
        }
        let stored = stored
            .with_context(|| format!("stored as {}, a dtype rlmerge cannot merge", meta.dtype))?;
        let first = parts.first().map_or(0, |p| p.file);
        let entry = TensorEntry {
            name: interner.name(name),
            dtype: stored,
            shape: interner.shape(meta.size.clone()),
            offset: parts.first().map_or(0, |p| p.offset),
            numel: meta.size.iter().product(),
        };
        let pieces = Pieces {
            stored: Stored::Plain(stored),
            parts: parts.into(),
        };
        Ok((entry, Arc::new(pieces), first))
    }
}

/// The index of the chunk file `name` of `dir` in `files`, opened the first time it is named.
/// Only a plain `.distcp` file name inside the folder is read.
fn file_index(dir: &Path, files: &mut Vec<ChunkFile>, name: &str) -> Result<usize> {
    if let Some(i) = files.iter().position(|f| f.name == name) {
        return Ok(i);
    }
    ensure!(
        name.ends_with(".distcp") && !name.contains(['/', '\\', '\0']) && !name.starts_with('.'),
        "its chunk is in '{}', which is no .distcp file of the folder",
        shown(name)
    );
    let (file, meta) = super::files::open_regular(&dir.join(name))?;
    files.push(ChunkFile {
        name: name.to_string(),
        file,
        meta,
        spans: Vec::new(),
    });
    Ok(files.len() - 1)
}

/// The chunks of a tensor of shape `size`, in row order, each rows of the whole — and all of
/// them, once.
fn row_order<'a>(size: &[usize], chunks: &'a [Chunk]) -> Result<Vec<&'a Chunk>> {
    let mut ordered: Vec<&Chunk> = chunks.iter().collect();
    for c in &ordered {
        ensure!(
            c.offsets.len() == size.len() && c.sizes.len() == size.len(),
            "a chunk at {} of {} in a tensor of {}",
            shape_text(&c.offsets),
            shape_text(&c.sizes),
            shape_text(size)
        );
        if let Some(d) = (1..size.len()).find(|&d| c.offsets[d] != 0 || c.sizes[d] != size[d]) {
            bail!(
                "a chunk cuts it along dimension {d} (offsets {}, sizes {}): tensor parallelism, \
                 which rlmerge does not read (FSDP cuts rows; gather it with dcp.load first)",
                shape_text(&c.offsets),
                shape_text(&c.sizes)
            );
        }
    }
    if size.is_empty() {
        ensure!(ordered.len() == 1, "a scalar in {} chunks", ordered.len());
        return Ok(ordered);
    }
    ordered.sort_by_key(|c| c.offsets[0]);
    let mut row = 0;
    for c in &ordered {
        ensure!(
            c.offsets[0] == row,
            "its chunks {} rows {row}..{} (overlapping or missing chunks)",
            if c.offsets[0] > row {
                "leave out"
            } else {
                "overlap at"
            },
            c.offsets[0].max(row)
        );
        row += c.sizes[0];
    }
    ensure!(
        row == size[0],
        "its chunks hold {row} of its {} rows (missing chunks)",
        size[0]
    );
    Ok(ordered.into_iter().filter(|c| c.sizes[0] > 0).collect())
}

/// A `TensorStorageMetadata`.
fn tensor_metadata(entry: &Value) -> Result<TensorMeta> {
    let properties = field(entry, "properties")?;
    // TensorProperties pickles its state as a tuple (dtype first) in current torch, as a dict
    // in older ones.
    let dtype = match object_state(&properties)? {
        Value::Tuple(t) => t.first().cloned().context("properties without a dtype")?,
        _ => field(&properties, "dtype")?,
    };
    let dtype = match dtype {
        Value::Global(g) => g.strip_prefix("torch.").unwrap_or(&g).to_string(),
        other => bail!("its dtype is {}", other.kind()),
    };
    let size = sizes(&field(entry, "size")?, "its size")?;
    let chunks = match field(entry, "chunks")? {
        Value::List(l) => l.borrow().clone(),
        other => bail!("its chunks are {}", other.kind()),
    };
    let chunks = chunks
        .iter()
        .map(|c| {
            Ok(Chunk {
                offsets: sizes(&field(c, "offsets")?, "a chunk's offsets")?,
                sizes: sizes(&field(c, "sizes")?, "a chunk's sizes")?,
            })
        })
        .collect::<Result<_>>()?;
    Ok(TensorMeta {
        dtype,
        size,
        chunks,
    })
}

/// The state BUILD gave an object (a dataclass's `__dict__`, or what `__getstate__` returned).
fn object_state(value: &Value) -> Result<Value> {
    match value {
        Value::Object(o) => o
            .borrow()
            .state
            .clone()
            .with_context(|| format!("{} without its fields", value.kind())),
        other => bail!("{} where an object was expected", other.kind()),
    }
}

/// Field `name` of a data class object.
fn field(value: &Value, name: &str) -> Result<Value> {
    let state = object_state(value)?;
    let found = match &state {
        Value::Dict(items) => items
            .borrow()
            .iter()
            .find(|(k, _)| matches!(k, Value::Str(s) if &**s == name))
            .map(|(_, v)| v.clone()),
        // (dict, slots) as pickle writes an object with __slots__.
        Value::Tuple(t) if t.len() == 2 => t
            .iter()
            .filter_map(|part| match part {
                Value::Dict(items) => items
                    .borrow()
                    .iter()
                    .find(|(k, _)| matches!(k, Value::Str(s) if &**s == name))
                    .map(|(_, v)| v.clone()),
                _ => None,
            })
            .next(),
        _ => None,
    };
    found.with_context(|| format!("{} without its field '{name}'", value.kind()))
}

fn dict(value: &Value) -> Result<Vec<(Value, Value)>> {
    match value {
        Value::Dict(items) => Ok(items.borrow().clone()),
        other => bail!("{} where a dict was expected", other.kind()),
    }
}

fn text(value: &Value, what: &str) -> Result<String> {
    match value {
        Value::Str(s) => Ok(s.to_string()),
        other => bail!("{what} is {}, not text", other.kind()),
    }
}

fn count(value: &Value, what: &str) -> Result<u64> {
    u64::try_from(int(value, what)?)
        .ok()
        .with_context(|| format!("{what} is negative"))
}

fn sizes(value: &Value, what: &str) -> Result<Vec<usize>> {
    ints(value, what)?
        .into_iter()
        .map(|i| usize::try_from(i).ok())
        .collect::<Option<_>>()
        .with_context(|| format!("{what} has a negative number"))
}

/// A name read from the checkpoint, safe on a terminal.
fn shown(name: &str) -> String {
    crate::escape::terminal(name).into_owned()
}

#[cfg(test)]
mod tests;
