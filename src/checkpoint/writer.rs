//! Streaming safetensors output: shards planned up front (every size is known before the first byte),
//! headers written first, tensor bytes written tile by tile at their final offsets (inside the
//! scratch folder of an [`super::OutputFolder`], which becomes the output only when complete).

use super::crc::{self, CrcStream};
use super::dtype::DType;
use super::files::{INDEX_FILE, SINGLE_FILE};
use super::positional::{reserve, write_all_at};
use super::weight_file::{crc32_of_file, FileChecksum};
use anyhow::{bail, ensure, Context, Result};
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

/// One tensor to be written.
#[derive(Clone, Debug)]
pub struct OutputTensor {
    /// The tensor's name in the output.
    pub name: std::sync::Arc<str>,
    /// Its output dtype.
    pub dtype: DType,
    /// Its shape.
    pub shape: std::sync::Arc<[usize]>,
}

impl OutputTensor {
    /// The tensor's size in bytes.
    pub fn byte_len(&self) -> u64 {
        self.shape.iter().product::<usize>() as u64 * self.dtype.size() as u64
    }
}

/// Splits tensors (in order) into shards of at most `max_shard_bytes` of data each, as Hugging Face
/// does: a tensor larger than the limit gets a shard of its own.
pub fn plan_shards(tensors: &[OutputTensor], max_shard_bytes: u64) -> Vec<Vec<usize>> {
    let mut shards: Vec<Vec<usize>> = Vec::new();
    let mut current = Vec::new();
    let mut current_bytes = 0u64;
    for (i, t) in tensors.iter().enumerate() {
        let len = t.byte_len();
        if !current.is_empty() && current_bytes + len > max_shard_bytes {
            shards.push(std::mem::take(&mut current));
            current_bytes = 0;
        }
        current.push(i);
        current_bytes += len;
    }
    if !current.is_empty() || shards.is_empty() {
        shards.push(current);
    }
    shards
}

/// `model.safetensors` when there is one shard, else `model-0000i-of-0000N.safetensors`.
pub fn shard_file_name(index: usize, count: usize) -> String {
    if count == 1 {
        SINGLE_FILE.to_string()
    } else {
        format!("model-{:05}-of-{:05}.safetensors", index + 1, count)
    }
}

/// `bytes` as people read sizes: "512 B", "3.4 MB", "15.2 GB" (decimal units, as `--shard-size`
/// takes them).
pub fn size_text(bytes: u64) -> String {
    let units = [("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)];
    match units.iter().find(|(_, size)| bytes as f64 >= *size) {
        Some((unit, size)) => format!("{:.1} {unit}", bytes as f64 / size),
        None => format!("{bytes} B"),
    }
}

/// The largest shard when none is asked (`--shard-size`'s default): 5 GB, as mergekit's.
pub const DEFAULT_SHARD_SIZE: u64 = 5_000_000_000;

/// Parses a shard size: bytes, or with a unit `KB/MB/GB/TB` (powers of 1000, as Hugging Face) or
/// `KiB/MiB/GiB/TiB` (powers of 1024).
pub fn parse_size(text: &str) -> Result<u64> {
    let t = text.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let value: f64 = num
        .parse()
        .with_context(|| format!("invalid size '{text}' (examples: 5GB, 500MiB, 1000000)"))?;
    let mult: f64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1.0,
        "kb" => 1e3,
        "mb" => 1e6,
        "gb" => 1e9,
        "tb" => 1e12,
        "kib" => 1024.0,
        "mib" => 1024.0 * 1024.0,
        "gib" => 1024.0 * 1024.0 * 1024.0,
        "tib" => 1024f64.powi(4),
        other => {
            bail!("invalid size unit '{other}' in '{text}' (use B, KB, MB, GB, KiB, MiB, GiB)")
        }
    };
    let bytes = (value * mult).round();
    ensure!(bytes >= 1.0, "size '{text}' must be at least one byte");
    // 2^64 as f64: every smaller f64 converts to u64 exactly (no saturation).
    ensure!(
        bytes < 18_446_744_073_709_551_616.0,
        "size '{text}' is larger than 16 EiB (2^64 bytes)"
    );
    Ok(bytes as u64)
}

/// One output shard: created with its header up front; tensor bytes land at their offsets.
struct ShardFile {
    path: PathBuf,
    file: File,
    /// Header (with its 8 length bytes) plus tensor data.
    size: u64,
    /// CRC-32 of the bytes written so far, folded in file order.
    crc: Mutex<CrcStream>,
    /// Held while bytes are written to the file. The kernel serializes buffered writes to one
    /// file on its inode lock, and a second writer spins on it (a tenth of a two-worker `ties`
    /// merge's CPU went there); a worker that finds this taken can keep its bytes and merge on
    /// ([`CheckpointWriter::try_write_at`]).
    writing: Mutex<()>,
}

/// Writes planned tensors into shards. Every shard's layout is known before the first byte, so
/// tiles are written at their final offsets from any thread, in any order ([`Self::write_at`]);
/// [`Self::write`] appends tensor after tensor for callers that produce them in order.
pub struct CheckpointWriter {
    dir: PathBuf,
    tensors: Vec<OutputTensor>,
    shards: Vec<Vec<usize>>,
    files: Vec<ShardFile>,
    /// Per tensor: its shard and the file offset of its first byte.
    places: Vec<(usize, u64)>,
    /// Where [`Self::write`] appends next: tensor index, bytes written into it.
    cursor: (usize, u64),
}

impl CheckpointWriter {
    /// Creates every shard file with its header.
    pub fn new(
        dir: &Path,
        tensors: Vec<OutputTensor>,
        max_shard_bytes: u64,
    ) -> Result<CheckpointWriter> {
        let shards = plan_shards(&tensors, max_shard_bytes);
        let mut places = vec![(0, 0); tensors.len()];
        let mut files = Vec::with_capacity(shards.len());
        for (s, members) in shards.iter().enumerate() {
            let path = dir.join(shard_file_name(s, shards.len()));
            let header = shard_header(&tensors, members);
            let mut head = (header.len() as u64).to_le_bytes().to_vec();
            head.extend_from_slice(&header);
            let mut at = head.len() as u64;
            for &i in members {
                places[i] = (s, at);
                at += tensors[i].byte_len();
            }
            let file =
                File::create(&path).with_context(|| format!("cannot create {}", path.display()))?;
            reserve(&file, at)
                .with_context(|| format!("cannot reserve {at} bytes for {}", path.display()))?;
            write_all_at(&file, &head, 0)
                .with_context(|| format!("cannot write {}", path.display()))?;
            let mut crc = crc32fast::Hasher::new();
            crc.update(&head);
            files.push(ShardFile {
                path,
                file,
                size: at,
                crc: Mutex::new(CrcStream::starting_with(crc, head.len() as u64)),
                writing: Mutex::new(()),
            });
        }
        Ok(CheckpointWriter {
            dir: dir.to_path_buf(),
            tensors,
            shards,
            files,
            places,
            cursor: (0, 0),
        })
    }

    /// The dtype tensor `index` (in the planned list) is written in.
    pub fn dtype(&self, index: usize) -> DType {
        self.tensors[index].dtype
    }

    /// Writes `bytes` of tensor `index` (in the planned list) starting at byte `start` within it.
    pub fn write_at(&self, index: usize, start: u64, bytes: &[u8]) -> Result<()> {
        let f = &self.files[self.places[index].0];
        let _writing = f.writing.lock().unwrap_or_else(|p| p.into_inner());
        self.write_now(index, start, bytes)
    }

    /// [`Self::write_at`] when no other thread is writing to the file that holds tensor `index`;
    /// `Ok(false)`, nothing written, when one is.
    pub fn try_write_at(&self, index: usize, start: u64, bytes: &[u8]) -> Result<bool> {
        let f = &self.files[self.places[index].0];
        let _writing = match f.writing.try_lock() {
            Ok(g) => g,
            Err(std::sync::TryLockError::Poisoned(p)) => p.into_inner(),
            Err(std::sync::TryLockError::WouldBlock) => return Ok(false),
        };
        self.write_now(index, start, bytes)?;
        Ok(true)
    }

    /// Holds the `writing` lock of the file of tensor `index`, as another worker's write would.
    #[cfg(test)]
    pub(crate) fn hold_file(&self, index: usize) -> std::sync::MutexGuard<'_, ()> {
        let f = &self.files[self.places[index].0];
        f.writing.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The write of [`Self::write_at`], its file's `writing` lock held.
    fn write_now(&self, index: usize, start: u64, bytes: &[u8]) -> Result<()> {
        let t = &self.tensors[index];
        ensure!(
            start + bytes.len() as u64 <= t.byte_len(),
            "internal: bytes {start}..{} are past the end of tensor '{}' ({} bytes)",
            start + bytes.len() as u64,
            t.name,
            t.byte_len()
        );
        let (shard, offset) = self.places[index];
        let f = &self.files[shard];
        write_all_at(&f.file, bytes, offset + start)
            .with_context(|| format!("cannot write tensor '{}' to {}", t.name, f.path.display()))?;
        CrcStream::record(&f.crc, offset + start, bytes);
        Ok(())
    }

    /// Appends bytes of tensor `name`, which must be the one the plan expects next.
    pub fn write(&mut self, name: &str, bytes: &[u8]) -> Result<()> {
        // Past finished (and empty) tensors, unless more bytes of nothing are for this one.
        while self.tensors.get(self.cursor.0).is_some_and(|t| {
            self.cursor.1 == t.byte_len() && (*t.name != *name || !bytes.is_empty())
        }) {
            self.cursor = (self.cursor.0 + 1, 0);
        }
        let t = self.tensors.get(self.cursor.0).with_context(|| {
            format!("internal: tensor '{name}' written after the last planned tensor")
        })?;
        ensure!(
            *t.name == *name,
            "internal: tensor '{name}' written where '{}' was planned",
            t.name
        );
        self.write_at(self.cursor.0, self.cursor.1, bytes)?;
        self.cursor.1 += bytes.len() as u64;
        Ok(())
    }

    /// Checks every byte of every shard was written, and writes the index when sharded. Returns
    /// each written file (shards, then the index) with its size and CRC-32.
    pub fn finish(self) -> Result<Vec<FileChecksum>> {
        let n = self.shards.len();
        let mut done = Vec::with_capacity(n + 1);
        for (s, f) in self.files.iter().enumerate() {
            let stream = crc::lock(&f.crc);
            if stream.done() < f.size {
                let missing = self.shards[s]
                    .iter()
                    .find(|&&i| self.places[i].1 + self.tensors[i].byte_len() > stream.done())
                    .map_or("?", |&i| &*self.tensors[i].name);
                bail!("internal: tensor '{missing}' was not completely written");
            }
            done.push(FileChecksum {
                file: shard_file_name(s, n),
                size: f.size,
                crc32: format!("{:08x}", stream.crc().clone().finalize()),
            });
        }
        if n > 1 {
            // Written as it goes (names sorted, as Hugging Face writes them): no JSON tree of
            // every tensor is built, whatever the tensor count.
            let mut names: Vec<(&str, usize)> = Vec::with_capacity(self.tensors.len());
            for (s, shard) in self.shards.iter().enumerate() {
                names.extend(shard.iter().map(|&i| (&*self.tensors[i].name, s)));
            }
            names.sort_unstable();
            let total: u64 = self.tensors.iter().map(|t| t.byte_len()).sum();
            let mut text = format!(
                "{{\n  \"metadata\": {{\n    \"total_size\": {total}\n  }},\n  \"weight_map\": {{"
            );
            for (k, (name, s)) in names.iter().enumerate() {
                text.push_str(if k == 0 { "\n    " } else { ",\n    " });
                text.push_str(&serde_json::to_string(name)?);
                text.push_str(": \"");
                text.push_str(&shard_file_name(*s, n));
                text.push('"');
            }
            text.push_str("\n  }\n}\n");
            let path = self.dir.join(INDEX_FILE);
            std::fs::write(&path, text)
                .with_context(|| format!("cannot write {}", path.display()))?;
            done.push(crc32_of_file(&path)?);
        }
        Ok(done)
    }
}

/// The JSON header of a shard holding `members`, space-padded to a multiple of 8 bytes so data
/// stays aligned.
fn shard_header(tensors: &[OutputTensor], members: &[usize]) -> Vec<u8> {
    use std::io::Write;
    // Written as it goes: no JSON tree of every tensor is built, whatever the tensor count.
    let mut bytes = br#"{"__metadata__":{"format":"pt"}"#.to_vec();
    let mut offset = 0u64;
    for &i in members {
        let t = &tensors[i];
        let end = offset + t.byte_len();
        bytes.push(b',');
        serde_json::to_writer(&mut bytes, &*t.name).expect("strings serialize");
        let _ = write!(
            bytes,
            r#":{{"dtype":"{}","shape":{:?},"data_offsets":[{offset},{end}]}}"#,
            t.dtype.safetensors_name(),
            &*t.shape
        );
        offset = end;
    }
    bytes.push(b'}');
    while !bytes.len().is_multiple_of(8) {
        bytes.push(b' ');
    }
    bytes
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(name: &str, n: usize) -> OutputTensor {
        OutputTensor {
            name: name.into(),
            dtype: DType::BF16,
            shape: vec![n].into(),
        }
    }

    #[test]
    fn headers_are_valid_json_with_escaped_names() {
        let ts = [t("a\"b\n", 3), t("λ", 2)];
        let h = shard_header(&ts, &[0, 1]);
        assert_eq!(h.len() % 8, 0);
        let v: serde_json::Value =
            serde_json::from_str(std::str::from_utf8(&h).unwrap().trim_end()).unwrap();
        assert_eq!(v["a\"b\n"]["shape"], serde_json::json!([3]));
        assert_eq!(v["λ"]["data_offsets"], serde_json::json!([6, 10]));
        assert_eq!(v["__metadata__"]["format"], "pt");
    }

    #[test]
    fn shards_split_greedily_and_big_tensors_stand_alone() {
        let ts = [t("a", 10), t("b", 10), t("c", 100), t("d", 5)];
        // 20 bytes each for a, b; 200 for c; 10 for d.
        assert_eq!(plan_shards(&ts, 40), vec![vec![0, 1], vec![2], vec![3]]);
        assert_eq!(plan_shards(&ts, 1000), vec![vec![0, 1, 2, 3]]);
    }

    #[test]
    fn sizes_parse_like_hugging_face() {
        assert_eq!(parse_size("5GB").unwrap(), 5_000_000_000);
        assert_eq!(parse_size("2MiB").unwrap(), 2 << 20);
        assert_eq!(parse_size("1000").unwrap(), 1000);
        assert_eq!(parse_size("1.5KB").unwrap(), 1500);
        assert!(parse_size("5 parsecs").is_err());
        assert!(parse_size("0").is_err());
        assert!(parse_size("20EB").is_err());
        assert!(parse_size("99999999999999999999").is_err());
    }

    #[test]
    fn names_follow_hugging_face() {
        assert_eq!(shard_file_name(0, 1), "model.safetensors");
        assert_eq!(shard_file_name(1, 3), "model-00002-of-00003.safetensors");
    }
}
