//! The zip format `torch.save` writes (`pytorch_model.bin`, `.pt`; torch ≥ 1.6): a pickle
//! (`ARCHIVE/data.pkl`) that says which tensor lies where, and one uncompressed entry per storage
//! (`ARCHIVE/data/KEY`). The pickle is read as data by [`super::pickle`], never run; each
//! tensor becomes a [`TensorEntry`] at its storage's bytes in the file, read in tiles like a
//! safetensors tensor. Several tensors may share a storage (a view, tied weights): each is read
//! from its own offset, and the file's checksum runs over each storage once.
//!
//! What a state dict of plain tensors holds is read: `_rebuild_tensor_v2` (and the older
//! `_rebuild_tensor`, and both inside `_rebuild_parameter`) of a BF16, F16 or F32 storage,
//! contiguous, inside its storage. Anything else a key holds — a DTensor, a tensor subclass, a
//! nested dict, a number — is refused naming the key.

use super::dtype::DType;
use super::pickle::{self, Value};
use super::positional::{read_exact_at, read_vec_at};
use super::weight_file::{repeated_name, shape_text, Interner, TensorEntry, WeightFile};
use super::zip::{self, ZipEntry};
use anyhow::{bail, ensure, Context, Result};
use std::collections::HashMap;
use std::fs::File;
use std::path::Path;

/// The largest pickle read (a state dict of 10^6 tensors pickles to about 200 MB).
pub(super) const MAX_PICKLE: u64 = 1 << 30;

/// A tensor as the pickle describes it, before it is placed in the file.
struct Described {
    /// The storage's key: its entry is `ARCHIVE/data/KEY`.
    key: String,
    /// The storage class's dtype name (`BFloat16`).
    class: String,
    /// Elements in the storage.
    storage_numel: u64,
    /// The tensor's first element within its storage.
    offset: u64,
    size: Vec<usize>,
    stride: Vec<i64>,
    /// Where the tensor is one rank's piece of a DTensor: the whole tensor's spec.
    dtensor: Option<dtensor::Spec>,
}

/// One tensor of a torch file, placed: a plain tensor, or one rank's piece of a DTensor.
pub struct FileTensor {
    /// The tensor (a DTensor's local piece) as it lies in the file.
    pub entry: TensorEntry,
    /// A DTensor's spec: the whole tensor's shape, its placements, the mesh.
    pub dtensor: Option<dtensor::Spec>,
}

/// Opens the torch zip file `path` of plain tensors (`pytorch_model.bin`): [`read`], with a
/// DTensor refused — one rank's file of a distributed checkpoint is not a model.
pub fn open(path: &Path, interner: &mut Interner) -> Result<(WeightFile, Vec<TensorEntry>)> {
    let (file, tensors) = read(path, interner)?;
    let entries = tensors
        .into_iter()
        .map(|t| match t.dtensor {
            None => Ok(t.entry),
            Some(_) => bail!(
                "{}: '{}' is a DTensor, one rank's piece of a distributed checkpoint: give the \
                 folder of every rank's files (verl's actor/), not one of them",
                path.display(),
                crate::escape::terminal(&t.entry.name)
            ),
        })
        .collect::<Result<_>>()?;
    Ok((file, entries))
}

/// Reads the torch zip file `path`: its zip directory, its pickle, each tensor (a DTensor's
/// local piece) checked against its storage (dtype, contiguity, bounds). Tensors come back in
/// offset order, names and shapes shared through `interner`.
pub fn read(path: &Path, interner: &mut Interner) -> Result<(WeightFile, Vec<FileTensor>)> {
    let (file, meta) = super::files::open_regular(path)?;
    refuse_legacy(&file, path, meta.len())?;
    let entries = zip::entries(&file, path, meta.len())?;
    let (prefix, pickle_entry) = pickle_entry(&entries).with_context(|| {
        format!(
            "{}: a zip archive, but not one torch.save wrote",
            path.display()
        )
    })?;
    let by_name: HashMap<&str, &ZipEntry> = entries.iter().map(|e| (e.name.as_str(), e)).collect();
    check_byte_order(
        &file,
        path,
        by_name.get(format!("{prefix}/byteorder").as_str()),
    )?;
    let bytes = read_entry(&file, path, pickle_entry)?;
    let value = pickle::read(&bytes, &format!("{}'s data.pkl", path.display()))?;
    drop(bytes);
    let mut tensors = Vec::new();
    let mut storages: HashMap<String, (String, u64)> = HashMap::new();
    for (key, value) in
        state_dict_items(&value).with_context(|| format!("{}: not a state dict", path.display()))?
    {
        let name = match key {
            Value::Str(s) => s.to_string(),
            other => bail!(
                "{}: a state dict key is {}, not a tensor name",
                path.display(),
                other.kind()
            ),
        };
        let d = describe(&value).with_context(|| {
            format!(
                "{}: '{}' is not a tensor rlmerge reads",
                path.display(),
                crate::escape::terminal(&name)
            )
        })?;
        let seen = storages
            .entry(d.key.clone())
            .or_insert((d.class.clone(), d.storage_numel));
        ensure!(
            seen.0 == d.class,
            "{}: tensor '{}' reads storage {} as {}, another tensor as {}",
            path.display(),
            crate::escape::terminal(&name),
            d.key,
            d.class,
            seen.0
        );
        seen.1 = seen.1.max(d.storage_numel);
        tensors.push((name, d));
    }
    // The tree is done with: its 10^5 objects go before the tensors are placed.
    drop(value);
    let mut placed = Vec::with_capacity(tensors.len());
    let mut spans = HashMap::new();
    for (name, d) in tensors {
        let entry = by_name
            .get(format!("{prefix}/data/{}", d.key).as_str())
            .with_context(|| {
                format!(
                    "{}: tensor '{}' is in storage {}, which the archive does not hold \
                     (truncated or damaged file?)",
                    path.display(),
                    crate::escape::terminal(&name),
                    d.key
                )
            })?;
        let t = place(&name, &d, entry, storages[&d.key].1, interner).with_context(|| {
            format!(
                "{}: tensor '{}'",
                path.display(),
                crate::escape::terminal(&name)
            )
        })?;
        spans.insert(d.key, (entry.data_offset, entry.size));
        placed.push(FileTensor {
            entry: t,
            dtensor: d.dtensor,
        });
    }
    if let Some(name) = repeated_name(placed.iter().map(|t| &t.entry)) {
        bail!(
            "{}: tensor '{name}' appears twice in its state dict",
            path.display()
        );
    }
    placed.sort_by_key(|t| t.entry.offset);
    placed.shrink_to_fit();
    Ok((
        WeightFile::new(path, &meta, spans.into_values().collect()),
        placed,
    ))
}

/// The one tensor of the `torch.save` archive that is bytes `at.0..at.0 + at.1` of `file` (at
/// `path`): a torch DCP chunk, which `torch.save(tensor)` wrote into its `.distcp` file. Returns
/// it placed in the file, named `name`, and the byte range of its storage.
pub(super) fn read_one_at(
    file: &File,
    path: &Path,
    at: (u64, u64),
    name: &str,
    interner: &mut Interner,
) -> Result<(TensorEntry, (u64, u64))> {
    let entries = zip::entries_at(file, path, at)?;
    let (prefix, pickle_entry) = pickle_entry(&entries).with_context(|| {
        format!(
            "{}: bytes at {} are no torch.save archive",
            path.display(),
            at.0
        )
    })?;
    let by_name: HashMap<&str, &ZipEntry> = entries.iter().map(|e| (e.name.as_str(), e)).collect();
    check_byte_order(
        file,
        path,
        by_name.get(format!("{prefix}/byteorder").as_str()),
    )?;
    let bytes = read_entry(file, path, pickle_entry)?;
    let what = format!(
        "{}'s chunk of '{}'",
        path.display(),
        crate::escape::terminal(name)
    );
    let value = pickle::read(&bytes, &what)?;
    let d = describe(&value).with_context(|| format!("{what} is not a tensor rlmerge reads"))?;
    ensure!(d.dtensor.is_none(), "{what} is a DTensor, not a chunk");
    let entry = by_name
        .get(format!("{prefix}/data/{}", d.key).as_str())
        .with_context(|| format!("{what}: its storage {} is missing (damaged file?)", d.key))?;
    let t = place(name, &d, entry, d.storage_numel, interner).with_context(|| what.clone())?;
    Ok((t, (entry.data_offset, entry.size)))
}

/// A file that is not a zip archive: torch's format before 1.6 (a bare pickle, which needs
/// torch's loader to place its storages) is named as such, anything else as not a torch file.
fn refuse_legacy(file: &File, path: &Path, len: u64) -> Result<()> {
    let mut magic = [0u8; 4];
    if len >= 4 {
        read_exact_at(file, &mut magic, 0)
            .with_context(|| format!("cannot read {}", path.display()))?;
    }
    match magic {
        [b'P', b'K', 3, 4] => Ok(()),
        [0x80, 2..=5, ..] => bail!(
            "{}: a torch file in the format before torch 1.6 (a bare pickle), which rlmerge does \
             not read; save it again with a current torch (torch.save), or as safetensors",
            path.display()
        ),
        _ => bail!(
            "{}: not a torch checkpoint (it does not start as the zip archive torch.save writes)",
            path.display()
        ),
    }
}

/// The archive's folder name and its `data.pkl`: exactly one, one level down.
fn pickle_entry(entries: &[ZipEntry]) -> Result<(String, &ZipEntry)> {
    let mut found = entries.iter().filter_map(|e| {
        let (prefix, file) = e.name.split_once('/')?;
        (file == "data.pkl").then(|| (prefix.to_string(), e))
    });
    let first = found.next().context("it holds no ARCHIVE/data.pkl")?;
    ensure!(
        found.next().is_none(),
        "it holds more than one ARCHIVE/data.pkl"
    );
    Ok(first)
}

/// Fails unless the archive's storages are little-endian (torch writes `byteorder`; an archive
/// without one predates it and is little-endian).
fn check_byte_order(file: &File, path: &Path, entry: Option<&&ZipEntry>) -> Result<()> {
    let Some(entry) = entry else { return Ok(()) };
    ensure!(
        entry.size <= 16,
        "{}: its byteorder entry is {} bytes",
        path.display(),
        entry.size
    );
    let order = read_entry(file, path, entry)?;
    ensure!(
        order == b"little",
        "{}: its storages are {} (rlmerge reads little-endian ones)",
        path.display(),
        crate::escape::terminal(&String::from_utf8_lossy(&order))
    );
    Ok(())
}

/// The bytes of a small stored entry.
fn read_entry(file: &File, path: &Path, entry: &ZipEntry) -> Result<Vec<u8>> {
    ensure!(
        entry.stored,
        "{}: entry {} is compressed (torch.save stores entries as they are)",
        path.display(),
        crate::escape::terminal(&entry.name)
    );
    ensure!(
        entry.size <= MAX_PICKLE,
        "{}: entry {} is {} bytes (at most {MAX_PICKLE})",
        path.display(),
        crate::escape::terminal(&entry.name),
        entry.size
    );
    read_vec_at(file, entry.data_offset, entry.size as usize).with_context(|| {
        format!(
            "{}: cannot read entry {} (truncated file?)",
            path.display(),
            crate::escape::terminal(&entry.name)
        )
    })
}

/// The (key, value) pairs of the pickle's top value: a dict, or an `OrderedDict` (what
/// `model.state_dict()` is).
fn state_dict_items(value: &Value) -> Result<Vec<(Value, Value)>> {
    match value {
        Value::Dict(items) => Ok(items.borrow().clone()),
        Value::Object(o) if value.callable_name().as_deref() == Some("collections.OrderedDict") => {
            Ok(o.borrow().items.clone())
        }
        other => bail!("its pickle holds {}, not a dict of tensors", other.kind()),
    }
}

/// The tensor a state dict value rebuilds.
fn describe(value: &Value) -> Result<Described> {
    let name = value.callable_name();
    let args = match value {
        Value::Object(o) => match &o.borrow().args {
            Value::Tuple(t) => t.clone(),
            _ => bail!("its arguments are not a tuple"),
        },
        other => bail!("it is {}", other.kind()),
    };
    match name.as_deref() {
        Some("torch._utils._rebuild_parameter" | "torch._utils._rebuild_parameter_with_state") => {
            describe(args.first().context("a parameter without its tensor")?)
        }
        Some("torch._utils._rebuild_tensor_v2" | "torch._utils._rebuild_tensor") => {
            ensure!(
                args.len() >= 4,
                "a tensor rebuilt from {} arguments",
                args.len()
            );
            let (key, class, storage_numel) = storage(&args[0])?;
            Ok(Described {
                key,
                class,
                storage_numel,
                offset: u64::try_from(int(&args[1], "storage offset")?)
                    .ok()
                    .context("a negative storage offset")?,
                size: ints(&args[2], "size")?
                    .into_iter()
                    .map(|d| usize::try_from(d).ok())
                    .collect::<Option<_>>()
                    .context("a negative size")?,
                stride: ints(&args[3], "stride")?,
                dtensor: None,
            })
        }
        Some("torch._tensor._rebuild_from_type_v2") => {
            let (local, spec) = dtensor::spec(&args)?;
            let mut d = describe(&local)?;
            ensure!(d.dtensor.is_none(), "a DTensor of DTensors");
            d.dtensor = Some(spec);
            Ok(d)
        }
        _ => bail!("it is {}", value.kind()),
    }
}

/// A persistent id `('storage', torch.XStorage, KEY, LOCATION, NUMEL)`: key, dtype name, numel.
fn storage(value: &Value) -> Result<(String, String, u64)> {
    let Value::Persistent(id) = value else {
        bail!("its storage is {}, not a persistent id", value.kind())
    };
    let Value::Tuple(id) = &**id else {
        bail!("its storage's id is {}", id.kind())
    };
    match &id[..] {
        [Value::Str(tag), Value::Global(class), Value::Str(key), _, numel]
            if &**tag == "storage" =>
        {
            let class = class
                .strip_prefix("torch.")
                .and_then(|c| c.strip_suffix("Storage"))
                .with_context(|| format!("its storage is a {class}"))?;
            let numel = u64::try_from(int(numel, "storage size")?)
                .ok()
                .context("a negative storage size")?;
            Ok((key.to_string(), class.to_string(), numel))
        }
        _ => bail!("its storage's id is not ('storage', class, key, location, size)"),
    }
}

pub(super) fn int(value: &Value, what: &str) -> Result<i64> {
    match value {
        Value::Int(i) => Ok(*i),
        other => bail!("its {what} is {}, not an integer", other.kind()),
    }
}

/// A tuple of integers (`torch.Size(...)` too).
pub(super) fn ints(value: &Value, what: &str) -> Result<Vec<i64>> {
    match value {
        Value::Tuple(items) => items.iter().map(|v| int(v, what)).collect(),
        Value::Object(o) if value.callable_name().as_deref() == Some("torch.Size") => {
            match &o.borrow().args {
                Value::Tuple(args) if args.len() == 1 => ints(&args[0], what),
                _ => bail!("its {what} is a torch.Size of no tuple"),
            }
        }
        other => bail!("its {what} is {}, not a tuple of integers", other.kind()),
    }
}

/// The tensor `d`, checked against its storage's entry, placed in the file.
fn place(
    name: &str,
    d: &Described,
    entry: &ZipEntry,
    storage_numel: u64,
    interner: &mut Interner,
) -> Result<TensorEntry> {
    let dtype = DType::from_torch_storage(&d.class).with_context(|| {
        format!(
            "stored as torch.{}Storage, a dtype rlmerge cannot merge (BF16, F16 and F32)",
            d.class
        )
    })?;
    ensure!(
        d.size.len() == d.stride.len(),
        "size {} with {} strides",
        shape_text(&d.size),
        d.stride.len()
    );
    let numel = d
        .size
        .iter()
        .try_fold(1usize, |acc, &n| acc.checked_mul(n))
        .context("its element count overflows")?;
    let mut expected = 1i64;
    for (&n, &s) in d.size.iter().zip(&d.stride).rev() {
        ensure!(
            n <= 1 || s == expected,
            "not contiguous (size {}, stride {:?}): rlmerge reads tensors as torch lays out a \
             fresh one; save it after .contiguous()",
            shape_text(&d.size),
            d.stride
        );
        expected = expected.saturating_mul(n as i64);
    }
    let size = dtype.size() as u64;
    let storage_bytes = storage_numel
        .checked_mul(size)
        .context("its storage overflows")?;
    ensure!(
        entry.stored,
        "its storage entry {} is compressed (torch.save stores entries as they are)",
        crate::escape::terminal(&entry.name)
    );
    ensure!(
        entry.size >= storage_bytes,
        "its storage {} holds {} bytes, not the {storage_bytes} its {storage_numel} elements \
         need (truncated file?)",
        crate::escape::terminal(&entry.name),
        entry.size
    );
    let end = d
        .offset
        .checked_add(numel as u64)
        .context("its end overflows")?;
    ensure!(
        numel == 0 || end <= storage_numel,
        "elements {}..{end} are past its storage's {storage_numel}",
        d.offset
    );
    Ok(TensorEntry {
        name: interner.name(name.to_string()),
        dtype,
        shape: interner.shape(d.size.clone()),
        offset: entry.data_offset + d.offset.min(storage_numel) * size,
        numel,
    })
}

pub mod dtensor;
#[cfg(test)]
mod tests;
