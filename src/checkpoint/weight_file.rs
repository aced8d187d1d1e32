//! One weight file as rlmerge reads it, whatever its format: where each tensor's bytes lie
//! (found by the format's reader: [`super::safetensors_file`], [`super::torch_file`]), read by
//! byte range (pread) into caller buffers, the file's CRC-32 kept as its bytes go by, and a
//! check that it did not change while read.
//!
//! Only the tensor list is held in memory; tensor bytes are read tile by tile, so the resident
//! set stays bounded whatever the file size (an mmap would keep every touched page).

use super::crc::{self, CrcStream};
use super::dtype::DType;
use super::open_files::Identity;
use super::positional::read_exact_at;
use anyhow::{bail, Context, Result};
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Arc;

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

/// An open weight file.
pub struct WeightFile {
    /// The file's path.
    pub path: PathBuf,
    /// (offset, byte length) of each region that holds tensor bytes — a safetensors tensor, a
    /// torch storage — in offset order, none empty, none overlapping; tensors lie inside them
    /// (several in one torch storage). The entries themselves belong to the model folder
    /// ([`super::ModelFolder`]), which holds one list for all its shards.
    spans: Vec<(u64, u64)>,
    /// The file as opened (inode, size, modification time), to notice it changed while it is
    /// read; the file itself is opened on demand ([`super::open_files`]).
    identity: Identity,
    /// Per span: CRC-32 of its bytes read so far, from its start.
    span_crcs: Vec<std::sync::Mutex<CrcStream>>,
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
    let (file, meta) = super::files::open_regular(path)?;
    let size = meta.len();
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

impl WeightFile {
    /// The file at `path`, as `meta` describes it, whose tensor bytes lie in `spans` (offset,
    /// length; in any order, the empty ones dropped; they must not overlap — the format's
    /// reader checked its tensors).
    pub fn new(path: &Path, meta: &std::fs::Metadata, mut spans: Vec<(u64, u64)>) -> WeightFile {
        spans.retain(|&(_, len)| len > 0);
        spans.sort_unstable();
        spans.shrink_to_fit();
        debug_assert!(spans.windows(2).all(|p| p[0].0 + p[0].1 <= p[1].0));
        let span_crcs = spans
            .iter()
            .map(|_| std::sync::Mutex::new(CrcStream::default()))
            .collect();
        WeightFile {
            path: path.to_path_buf(),
            spans,
            identity: Identity::of(meta),
            span_crcs,
        }
    }

    /// The file's size and CRC-32. Tensor bytes already read in order from their span's start are
    /// not read again: their running CRCs are combined in file order, and only what was never
    /// read (headers, tensors not merged, gaps) is read now.
    pub fn checksum(&self) -> Result<FileChecksum> {
        let file = self.file()?;
        let mut total = crc32fast::Hasher::new();
        let mut at = 0;
        for (&(offset, len), crc) in self.spans.iter().zip(&self.span_crcs) {
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
        let end = start + buf.len() as u64;
        self.read_at(tensor.offset + start, buf, || {
            format!("tensor '{}' (bytes {start}..{end})", tensor.name)
        })
    }

    /// Adds `bytes`, read at byte `start` within `tensor`, to the running CRC of the span that
    /// holds it (see [`CrcStream`]: tiles may come in any order; re-reads change nothing).
    pub fn record_read(&self, tensor: &TensorEntry, start: u64, bytes: &[u8]) {
        self.record_at(tensor.offset + start, bytes)
    }

    /// Adds `bytes`, read at byte `at` of the file, to the running CRC of the span that holds
    /// them.
    pub fn record_at(&self, at: u64, bytes: &[u8]) {
        let Some(i) = self.spans.partition_point(|&(o, _)| o <= at).checked_sub(1) else {
            return;
        };
        let (offset, len) = self.spans[i];
        if at + bytes.len() as u64 <= offset + len {
            CrcStream::record(&self.span_crcs[i], at - offset, bytes);
        }
    }

    /// Reads `buf.len()` bytes at byte `at` of the file; `what` says what they are, for the
    /// error (made only then: reads are per tile).
    pub fn read_at(&self, at: u64, buf: &mut [u8], what: impl FnOnce() -> String) -> Result<()> {
        let file = self.file()?;
        read_exact_at(&file, buf, at).with_context(|| {
            format!(
                "{}: cannot read {}: file truncated or unreadable",
                self.path.display(),
                what()
            )
        })
    }
}

/// A name two of `tensors` share (the first in name order), for the reader to refuse: a
/// format's map of names may hold one twice, where keeping either would be a guess.
pub fn repeated_name<'a>(tensors: impl IntoIterator<Item = &'a TensorEntry>) -> Option<Arc<str>> {
    let mut by_name: Vec<&TensorEntry> = tensors.into_iter().collect();
    by_name.sort_unstable_by(|a, b| a.name.cmp(&b.name));
    by_name
        .windows(2)
        .find(|p| p[0].name == p[1].name)
        .map(|p| p[0].name.clone())
}

/// One shared copy of each tensor name and shape across the files of a merge.
#[derive(Default)]
pub struct Interner {
    names: std::collections::HashSet<Arc<str>>,
    shapes: std::collections::HashSet<Arc<[usize]>>,
}

impl Interner {
    pub(super) fn name(&mut self, name: String) -> Arc<str> {
        if let Some(n) = self.names.get(name.as_str()) {
            return n.clone();
        }
        let n: Arc<str> = name.into();
        self.names.insert(n.clone());
        n
    }

    pub(super) fn shape(&mut self, shape: Vec<usize>) -> Arc<[usize]> {
        if let Some(s) = self.shapes.get(shape.as_slice()) {
            return s.clone();
        }
        let s: Arc<[usize]> = shape.into();
        self.shapes.insert(s.clone());
        s
    }
}
