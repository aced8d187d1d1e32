//! One `.safetensors` file: its header parsed and validated, its data read by byte range (pread).
//!
//! Only the header is held in memory; tensor bytes are read tile by tile into caller buffers, so the
//! resident set stays bounded whatever the file size (an mmap would keep every touched page).

use super::crc::{self, CrcStream};
use super::dtype::DType;
use super::open_files::Identity;
use super::positional::read_exact_at;
use anyhow::{bail, Context, Result};
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// Largest header we accept (the reference implementation's limit).
const MAX_HEADER_BYTES: u64 = 100_000_000;

/// Where one tensor lives inside its file.
#[derive(Clone, Debug)]
pub struct TensorEntry {
    /// Shared, not copied, by every structure that names the tensor (a model may have 10^5).
    pub name: Arc<str>,
    /// Element type.
    pub dtype: DType,
    /// Its shape.
    pub shape: Arc<[usize]>,
    /// Absolute byte offset of the first element in the file.
    pub offset: u64,
    /// Elements in the tensor.
    pub numel: usize,
}

impl TensorEntry {
    /// The tensor's size in bytes.
    pub fn byte_len(&self) -> u64 {
        (self.numel * self.dtype.size()) as u64
    }
}

/// An open safetensors file.
pub struct SafetensorsFile {
    /// The file's path.
    pub path: PathBuf,
    /// (offset, byte length) of each tensor, in offset order; the entries themselves belong to
    /// the model folder ([`super::ModelFolder`]), which holds one list for all its shards.
    spans: Vec<(u64, u64)>,
    /// The file as opened (inode, size, modification time), to notice it changed while it is
    /// read; the file itself is opened on demand ([`super::open_files`]).
    identity: Identity,
    /// Bytes of the JSON header (after the 8 length bytes).
    header_len: u64,
    /// CRC-32 of the 8 length bytes and the header.
    header_crc: crc32fast::Hasher,
    /// Per tensor (same order as `tensors`): CRC-32 of its bytes read so far, from its start.
    tensor_crcs: Vec<std::sync::Mutex<CrcStream>>,
}

/// A shape for messages: in full up to 8 dimensions, else the first ones and the count (a
/// hostile header may hold thousands).
pub fn shape_text(shape: &[usize]) -> String {
    if shape.len() <= 8 {
        format!("{shape:?}")
    } else {
        let head: Vec<String> = shape[..6].iter().map(|d| d.to_string()).collect();
        format!("[{}, … ({} dimensions)]", head.join(", "), shape.len())
    }
}

/// A file's size and CRC-32, as the merge record holds it.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct FileChecksum {
    /// The file's name in its folder.
    pub file: String,
    /// Its size in bytes.
    pub size: u64,
    /// Its CRC-32, as 8 hex digits.
    pub crc32: String,
}

/// CRC-32 of a whole file, read in 8 MiB blocks.
pub fn crc32_of_file(path: &Path) -> Result<FileChecksum> {
    super::files::check_regular_file(path)?;
    let file = File::open(path).with_context(|| format!("cannot open {}", path.display()))?;
    let size = file.metadata()?.len();
    let mut hasher = crc32fast::Hasher::new();
    hash_range(&file, path, 0, size, &mut hasher)?;
    Ok(FileChecksum {
        file: path
            .file_name()
            .unwrap_or_default()
            .to_string_lossy()
            .to_string(),
        size,
        crc32: format!("{:08x}", hasher.finalize()),
    })
}

/// Feeds bytes `from..to` of `file` to `hasher`.
fn hash_range(
    file: &File,
    path: &Path,
    from: u64,
    to: u64,
    hasher: &mut crc32fast::Hasher,
) -> Result<()> {
    let mut buf = vec![0u8; (8 << 20).min((to - from) as usize)];
    let mut at = from;
    while at < to {
        let n = ((to - at) as usize).min(buf.len());
        read_exact_at(file, &mut buf[..n], at).with_context(|| {
            format!(
                "cannot read {} (bytes {at}..{})",
                path.display(),
                at + n as u64
            )
        })?;
        hasher.update(&buf[..n]);
        at += n as u64;
    }
    Ok(())
}

impl SafetensorsFile {
    /// Opens and validates `path` — header length, JSON, dtypes, shapes, offsets against the file
    /// size — and returns the file and its tensors in offset order, sharing tensor names and
    /// shapes through `interner` with the files opened before (a base and its agents name the
    /// same 10^5 tensors: one copy each).
    pub fn open_interned(
        path: &Path,
        interner: &mut Interner,
    ) -> Result<(SafetensorsFile, Vec<TensorEntry>)> {
        super::files::check_regular_file(path)?;
        let file = File::open(path).with_context(|| format!("cannot open {}", path.display()))?;
        let meta = file
            .metadata()
            .with_context(|| format!("cannot stat {}", path.display()))?;
        let file_len = meta.len();
        let fail = |msg: String| -> anyhow::Error { anyhow::anyhow!("{}: {msg}", path.display()) };
        if file_len < 8 {
            return Err(fail(format!(
                "truncated file: {file_len} bytes, too short for a safetensors header"
            )));
        }
        let mut len_bytes = [0u8; 8];
        read_exact_at(&file, &mut len_bytes, 0)
            .with_context(|| format!("cannot read {}", path.display()))?;
        let header_len = u64::from_le_bytes(len_bytes);
        if header_len > MAX_HEADER_BYTES {
            return Err(fail(format!(
                "header length {header_len} exceeds the {MAX_HEADER_BYTES}-byte limit (corrupt or not a safetensors file)"
            )));
        }
        if 8 + header_len > file_len {
            return Err(fail(format!(
                "truncated file: header says {header_len} bytes but the file has {file_len}"
            )));
        }
        let mut header = vec![0u8; header_len as usize];
        read_exact_at(&file, &mut header, 8)
            .with_context(|| format!("cannot read the header of {}", path.display()))?;
        let data_start = 8 + header_len;
        let data_len = file_len - data_start;
        let tensors = parse_header(&header, data_start, data_len, interner)
            .map_err(|e| fail(format!("{e:#}")))?;
        let mut header_crc = crc32fast::Hasher::new();
        header_crc.update(&len_bytes);
        header_crc.update(&header);
        let tensor_crcs = tensors
            .iter()
            .map(|_| std::sync::Mutex::new(CrcStream::default()))
            .collect();
        let spans = tensors.iter().map(|t| (t.offset, t.byte_len())).collect();
        let file = SafetensorsFile {
            path: path.to_path_buf(),
            spans,
            identity: Identity::of(&meta),
            header_len,
            header_crc,
            tensor_crcs,
        };
        Ok((file, tensors))
    }

    /// The file's size and CRC-32. Tensor bytes already read in order from their start are not read
    /// again: their running CRCs are combined with the header's in file order, and only what was
    /// never read (tensors not merged, gaps) is read now.
    pub fn checksum(&self) -> Result<FileChecksum> {
        let file = self.file()?;
        let mut total = self.header_crc.clone();
        let mut at = 8 + self.header_len;
        for (&(offset, len), crc) in self.spans.iter().zip(&self.tensor_crcs) {
            if offset > at {
                hash_range(&file, &self.path, at, offset, &mut total)?;
            }
            let stream = crc::lock(crc);
            total.combine(stream.crc());
            hash_range(
                &file,
                &self.path,
                offset + stream.done(),
                offset + len,
                &mut total,
            )?;
            at = offset + len;
        }
        hash_range(&file, &self.path, at, self.identity.len, &mut total)?;
        Ok(FileChecksum {
            file: self
                .path
                .file_name()
                .unwrap_or_default()
                .to_string_lossy()
                .to_string(),
            size: self.identity.len,
            crc32: format!("{:08x}", total.finalize()),
        })
    }

    /// Fails if the open file's size or modification time moved since it was opened: bytes read
    /// before and after such a change may not belong together.
    pub fn check_unchanged(&self) -> Result<()> {
        let meta = std::fs::metadata(&self.path)
            .with_context(|| format!("cannot stat {}", self.path.display()))?;
        let now = Identity::of(&meta);
        if now != self.identity {
            bail!(
                "{} changed while it was being read (size {} -> {} bytes, its modification time, \
                 or it was replaced)",
                self.path.display(),
                self.identity.len,
                now.len
            );
        }
        Ok(())
    }

    /// The open file (opened again if the cache closed it; it must be the same file).
    fn file(&self) -> Result<std::sync::Arc<File>> {
        super::open_files::get(&self.path, &self.identity)
    }

    /// Reads `buf.len()` bytes of `tensor` starting at byte `start` within it.
    pub fn read(&self, tensor: &TensorEntry, start: u64, buf: &mut [u8]) -> Result<()> {
        debug_assert!(start + buf.len() as u64 <= tensor.byte_len());
        let file = self.file()?;
        read_exact_at(&file, buf, tensor.offset + start).with_context(|| {
            format!(
                "{}: cannot read tensor '{}' (bytes {}..{}): file truncated or unreadable",
                self.path.display(),
                tensor.name,
                start,
                start + buf.len() as u64
            )
        })
    }

    /// Adds `bytes`, read at byte `start` within `tensor`, to the tensor's running CRC (see
    /// [`CrcStream`]: tiles may come in any order; re-reads change nothing).
    pub fn record_read(&self, tensor: &TensorEntry, start: u64, bytes: &[u8]) {
        // Empty tensors can share an offset with the next one; bytes belong to the one that
        // is not empty (tensors never overlap).
        let first = self.spans.partition_point(|&(o, _)| o < tensor.offset);
        let found = self.spans[first..]
            .iter()
            .take_while(|&&(o, _)| o == tensor.offset)
            .position(|&(_, len)| len > 0);
        if let Some(i) = found.map(|i| first + i) {
            CrcStream::record(&self.tensor_crcs[i], start, bytes);
        }
    }
}

/// Parses the JSON header. Offsets must be in range and sized for shape × dtype; unsupported dtypes
/// are an error naming the tensor.
/// The header's tensors, each checked and converted as soon as it is read: a header of 10^5 or
/// more tensors (MoE checkpoints) never exists as a JSON tree, only one entry at a time. The
/// first invalid entry's error is kept in `error` (the parse then stops).
struct HeaderSeed<'a> {
    data_start: u64,
    data_len: u64,
    error: &'a mut Option<anyhow::Error>,
    interner: &'a mut Interner,
}

/// One shared copy of each tensor name and shape across the files of a merge.
#[derive(Default)]
pub struct Interner {
    names: std::collections::HashSet<Arc<str>>,
    shapes: std::collections::HashSet<Arc<[usize]>>,
}

impl Interner {
    fn name(&mut self, name: String) -> Arc<str> {
        if let Some(n) = self.names.get(name.as_str()) {
            return n.clone();
        }
        let n: Arc<str> = name.into();
        self.names.insert(n.clone());
        n
    }

    fn shape(&mut self, shape: Vec<usize>) -> Arc<[usize]> {
        if let Some(s) = self.shapes.get(shape.as_slice()) {
            return s.clone();
        }
        let s: Arc<[usize]> = shape.into();
        self.shapes.insert(s.clone());
        s
    }
}

impl<'de> serde::de::DeserializeSeed<'de> for HeaderSeed<'_> {
    type Value = Vec<TensorEntry>;
    fn deserialize<D: serde::Deserializer<'de>>(
        self,
        deserializer: D,
    ) -> Result<Self::Value, D::Error> {
        deserializer.deserialize_map(self)
    }
}

impl<'de> serde::de::Visitor<'de> for HeaderSeed<'_> {
    type Value = Vec<TensorEntry>;
    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("a JSON object of tensors")
    }
    fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        let mut tensors = Vec::with_capacity(map.size_hint().unwrap_or(0));
        while let Some(name) = map.next_key::<String>()? {
            let info: serde_json::Value = map.next_value()?;
            // Free-form string metadata: not needed to read tensors.
            if name == "__metadata__" {
                continue;
            }
            match tensor_entry(name, &info, self.data_start, self.data_len, self.interner) {
                Ok(t) => tensors.push(t),
                Err(e) => {
                    *self.error = Some(e);
                    return Err(serde::de::Error::custom("invalid tensor entry"));
                }
            }
        }
        Ok(tensors)
    }
}

/// One header entry, checked: dtype, shape, offsets against the data section.
fn tensor_entry(
    name: String,
    info: &serde_json::Value,
    data_start: u64,
    data_len: u64,
    interner: &mut Interner,
) -> Result<TensorEntry> {
    let bad = |what: &str| anyhow::anyhow!("tensor '{name}': {what}");
    let info = info
        .as_object()
        .ok_or_else(|| bad("entry is not an object"))?;
    let dtype_name = info
        .get("dtype")
        .and_then(|d| d.as_str())
        .ok_or_else(|| bad("missing dtype"))?;
    let dtype = DType::from_safetensors(dtype_name).ok_or_else(|| {
        bad(&format!(
            "unsupported dtype {dtype_name} (rlmerge merges BF16, F16 and F32)"
        ))
    })?;
    let shape: Vec<usize> = info
        .get("shape")
        .and_then(|s| s.as_array())
        .ok_or_else(|| bad("missing shape"))?
        .iter()
        .map(|d| d.as_u64().and_then(|d| usize::try_from(d).ok()))
        .collect::<Option<_>>()
        .ok_or_else(|| bad("shape is not a list of non-negative integers"))?;
    let numel = shape
        .iter()
        .try_fold(1usize, |acc, &d| acc.checked_mul(d))
        .ok_or_else(|| bad("shape's element count overflows"))?;
    let offsets = info
        .get("data_offsets")
        .and_then(|o| o.as_array())
        .filter(|o| o.len() == 2)
        .and_then(|o| Some((o[0].as_u64()?, o[1].as_u64()?)))
        .ok_or_else(|| bad("data_offsets is not a pair of integers"))?;
    let (begin, end) = offsets;
    if begin > end || end > data_len {
        if end > data_len {
            return Err(bad(&format!(
                "data offsets {begin}..{end} out of range: the data section has {data_len} bytes (truncated file?)"
            )));
        }
        return Err(bad(&format!("data offsets {begin}..{end} are reversed")));
    }
    let expected = (numel as u64).checked_mul(dtype.size() as u64);
    if expected != Some(end - begin) {
        return Err(bad(&format!(
            "data offsets {begin}..{end} hold {} bytes but shape {} of {dtype_name} needs {}",
            end - begin,
            shape_text(&shape),
            expected.map_or("more than u64".to_string(), |e| e.to_string())
        )));
    }
    Ok(TensorEntry {
        name: interner.name(name),
        dtype,
        shape: interner.shape(shape),
        offset: data_start + begin,
        numel,
    })
}

fn parse_header(
    header: &[u8],
    data_start: u64,
    data_len: u64,
    interner: &mut Interner,
) -> Result<Vec<TensorEntry>> {
    use serde::de::DeserializeSeed;
    let text = std::str::from_utf8(header).context("corrupt header: not UTF-8")?;
    let mut error = None;
    let mut de = serde_json::Deserializer::from_str(text.trim_end_matches(' '));
    let parsed = HeaderSeed {
        data_start,
        data_len,
        error: &mut error,
        interner,
    }
    .deserialize(&mut de)
    .and_then(|t| de.end().map(|()| t));
    let mut tensors = match (parsed, error) {
        (_, Some(e)) => return Err(e),
        (Err(e), None) => return Err(e).context("corrupt header JSON"),
        (Ok(t), None) => t,
    };
    // A name given twice is an error, not the last one silently kept (a JSON map would).
    let mut by_name: Vec<&TensorEntry> = tensors.iter().collect();
    by_name.sort_unstable_by(|a, b| a.name.cmp(&b.name));
    if let Some(pair) = by_name.windows(2).find(|p| p[0].name == p[1].name) {
        bail!(
            "corrupt header JSON: tensor '{}' appears twice",
            pair[0].name
        );
    }
    tensors.sort_by_key(|t| t.offset);
    tensors.shrink_to_fit();
    for pair in tensors.windows(2) {
        if pair[0].offset + pair[0].byte_len() > pair[1].offset {
            bail!(
                "tensors '{}' and '{}' have overlapping data offsets",
                pair[0].name,
                pair[1].name
            );
        }
    }
    Ok(tensors)
}
