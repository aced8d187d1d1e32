//! Streaming safetensors output: shards planned up front (every size is known before the first byte),
//! headers written first, tensor bytes appended tile by tile, all inside a temporary folder that
//! becomes the output only by one rename at the very end.

use super::dtype::DType;
use super::model::{INDEX_FILE, SINGLE_FILE};
use super::safetensors_file::{crc32_of_file, FileChecksum};
use anyhow::{bail, ensure, Context, Result};
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

/// One tensor to be written.
#[derive(Clone, Debug)]
pub struct OutputTensor {
    pub name: String,
    pub dtype: DType,
    pub shape: Vec<usize>,
}

impl OutputTensor {
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
    Ok(bytes as u64)
}

/// The output folder while it is being written: a hidden sibling of the final path. Dropping it
/// without [`OutputFolder::commit`] deletes it, so a failed merge leaves nothing behind.
pub struct OutputFolder {
    final_dir: PathBuf,
    tmp_dir: PathBuf,
    committed: bool,
}

impl OutputFolder {
    /// Refuses an existing `final_dir` unless `force`; the old folder is replaced only at commit.
    pub fn create(final_dir: &Path, force: bool) -> Result<OutputFolder> {
        let name = final_dir
            .file_name()
            .with_context(|| format!("invalid output path {}", final_dir.display()))?
            .to_string_lossy()
            .to_string();
        let parent = match final_dir.parent() {
            Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
            _ => PathBuf::from("."),
        };
        ensure!(
            parent.is_dir(),
            "the parent folder of the output, {}, does not exist",
            parent.display()
        );
        // First, so an output a killed merge had moved aside counts as existing.
        clean_stale(&parent, &name, final_dir)?;
        if final_dir.exists() && !force {
            bail!(
                "output folder {} already exists (use --force to replace it)",
                final_dir.display()
            );
        }
        let tmp_dir = parent.join(format!(".{name}.rlmerge-tmp-{}", std::process::id()));
        if tmp_dir.exists() {
            std::fs::remove_dir_all(&tmp_dir)
                .with_context(|| format!("cannot remove stale {}", tmp_dir.display()))?;
        }
        std::fs::create_dir(&tmp_dir)
            .with_context(|| format!("cannot create {}", tmp_dir.display()))?;
        Ok(OutputFolder {
            final_dir: final_dir.to_path_buf(),
            tmp_dir,
            committed: false,
        })
    }

    /// Where files go until commit.
    pub fn path(&self) -> &Path {
        &self.tmp_dir
    }

    pub fn final_path(&self) -> &Path {
        &self.final_dir
    }

    /// Moves the finished folder into place (replacing an old one only now, when forced).
    pub fn commit(mut self) -> Result<()> {
        let old = if self.final_dir.exists() {
            let old = self.tmp_dir.with_file_name(format!(
                ".{}.rlmerge-old-{}",
                self.final_dir
                    .file_name()
                    .unwrap_or_default()
                    .to_string_lossy(),
                std::process::id()
            ));
            std::fs::rename(&self.final_dir, &old).with_context(|| {
                format!("cannot move the old {} aside", self.final_dir.display())
            })?;
            Some(old)
        } else {
            None
        };
        std::fs::rename(&self.tmp_dir, &self.final_dir).with_context(|| {
            format!(
                "cannot rename {} to {}",
                self.tmp_dir.display(),
                self.final_dir.display()
            )
        })?;
        self.committed = true;
        if let Some(old) = old {
            let path = if old.is_dir() { old } else { return Ok(()) };
            std::fs::remove_dir_all(&path).with_context(|| {
                format!("merged, but cannot remove the replaced {}", path.display())
            })?;
        }
        Ok(())
    }
}

impl Drop for OutputFolder {
    fn drop(&mut self) {
        if !self.committed {
            let _ = std::fs::remove_dir_all(&self.tmp_dir);
        }
    }
}

/// Whether process `pid` is alive; `None` where that cannot be told (no /proc).
fn process_alive(pid: u32) -> Option<bool> {
    let proc = Path::new("/proc");
    proc.is_dir().then(|| proc.join(pid.to_string()).exists())
}

/// Removes what killed merges into `final_dir` left beside it: `.NAME.rlmerge-tmp-PID` folders of
/// dead processes; a `.NAME.rlmerge-old-PID` (the previous output, moved aside at commit) goes back
/// into place if the kill came before the new output replaced it, and is removed otherwise.
fn clean_stale(parent: &Path, name: &str, final_dir: &Path) -> Result<()> {
    let Ok(entries) = std::fs::read_dir(parent) else {
        return Ok(());
    };
    for entry in entries.flatten() {
        let file = entry.file_name().to_string_lossy().to_string();
        let Some(rest) = file.strip_prefix(&format!(".{name}.rlmerge-")) else {
            continue;
        };
        let (kind, pid) = match rest.split_once('-') {
            Some((kind @ ("tmp" | "old"), pid)) => (kind, pid),
            _ => continue,
        };
        let Ok(pid) = pid.parse::<u32>() else {
            continue;
        };
        if pid == std::process::id() || process_alive(pid) != Some(false) {
            continue;
        }
        let path = entry.path();
        if kind == "old" && !final_dir.exists() {
            std::fs::rename(&path, final_dir).with_context(|| {
                format!(
                    "cannot restore {} to {}",
                    path.display(),
                    final_dir.display()
                )
            })?;
        } else {
            std::fs::remove_dir_all(&path).with_context(|| {
                format!("cannot remove {}, left by a killed merge", path.display())
            })?;
        }
    }
    Ok(())
}

/// Writes planned tensors into shards, in order, from a stream of bytes per tensor.
pub struct CheckpointWriter {
    dir: PathBuf,
    tensors: Vec<OutputTensor>,
    shards: Vec<Vec<usize>>,
    /// Position: shard index, index within it, bytes written into the current tensor.
    shard: usize,
    slot: usize,
    written: u64,
    out: Option<BufWriter<File>>,
    /// CRC-32 and size of the shard being written, and of those finished.
    crc: (crc32fast::Hasher, u64),
    done: Vec<FileChecksum>,
}

const WRITE_BUFFER: usize = 8 << 20;

impl CheckpointWriter {
    pub fn new(
        dir: &Path,
        tensors: Vec<OutputTensor>,
        max_shard_bytes: u64,
    ) -> Result<CheckpointWriter> {
        let shards = plan_shards(&tensors, max_shard_bytes);
        let mut w = CheckpointWriter {
            dir: dir.to_path_buf(),
            tensors,
            shards,
            shard: 0,
            slot: 0,
            written: 0,
            out: None,
            crc: (crc32fast::Hasher::new(), 0),
            done: Vec::new(),
        };
        w.open_shard()?;
        w.skip_empty()?;
        Ok(w)
    }

    pub fn shard_count(&self) -> usize {
        self.shards.len()
    }

    /// The tensor the next bytes belong to.
    pub fn current_tensor(&self) -> Option<&OutputTensor> {
        self.shards
            .get(self.shard)
            .and_then(|s| s.get(self.slot))
            .map(|&i| &self.tensors[i])
    }

    fn shard_path(&self, shard: usize) -> PathBuf {
        self.dir.join(shard_file_name(shard, self.shards.len()))
    }

    fn open_shard(&mut self) -> Result<()> {
        let path = self.shard_path(self.shard);
        let file =
            File::create(&path).with_context(|| format!("cannot create {}", path.display()))?;
        let mut out = BufWriter::with_capacity(WRITE_BUFFER, file);
        let header = self.header(self.shard);
        let len = (header.len() as u64).to_le_bytes();
        out.write_all(&len)
            .and_then(|_| out.write_all(&header))
            .with_context(|| format!("cannot write {}", path.display()))?;
        self.crc = (crc32fast::Hasher::new(), (len.len() + header.len()) as u64);
        self.crc.0.update(&len);
        self.crc.0.update(&header);
        self.out = Some(out);
        Ok(())
    }

    /// The JSON header of `shard`, space-padded to a multiple of 8 bytes so data stays aligned.
    fn header(&self, shard: usize) -> Vec<u8> {
        let mut map = serde_json::Map::new();
        map.insert("__metadata__".into(), serde_json::json!({"format": "pt"}));
        let mut offset = 0u64;
        for &i in &self.shards[shard] {
            let t = &self.tensors[i];
            let end = offset + t.byte_len();
            map.insert(
                t.name.clone(),
                serde_json::json!({"dtype": t.dtype.safetensors_name(), "shape": t.shape, "data_offsets": [offset, end]}),
            );
            offset = end;
        }
        let mut bytes =
            serde_json::to_vec(&serde_json::Value::Object(map)).expect("header serializes");
        while !bytes.len().is_multiple_of(8) {
            bytes.push(b' ');
        }
        bytes
    }

    /// Moves past tensors with no data and, at the end of a shard, on to the next shard.
    fn skip_empty(&mut self) -> Result<()> {
        loop {
            match self.current_tensor() {
                Some(t) if self.written == t.byte_len() => {
                    self.slot += 1;
                    self.written = 0;
                }
                Some(_) => return Ok(()),
                None if self.shard + 1 < self.shards.len() => {
                    self.close_shard()?;
                    self.shard += 1;
                    self.slot = 0;
                    self.open_shard()?;
                }
                None => return Ok(()),
            }
        }
    }

    fn close_shard(&mut self) -> Result<()> {
        if let Some(out) = self.out.take() {
            let path = self.shard_path(self.shard);
            out.into_inner()
                .map_err(|e| e.into_error())
                .with_context(|| format!("cannot write {}", path.display()))?;
            let (crc, size) = std::mem::replace(&mut self.crc, (crc32fast::Hasher::new(), 0));
            self.done.push(FileChecksum {
                file: shard_file_name(self.shard, self.shards.len()),
                size,
                crc32: format!("{:08x}", crc.finalize()),
            });
        }
        Ok(())
    }

    /// Appends bytes of tensor `name`, which must be the one the plan expects next.
    pub fn write(&mut self, name: &str, bytes: &[u8]) -> Result<()> {
        let t = self.current_tensor().with_context(|| {
            format!("internal: tensor '{name}' written after the last planned tensor")
        })?;
        ensure!(
            t.name == name,
            "internal: tensor '{name}' written where '{}' was planned",
            t.name
        );
        ensure!(
            self.written + bytes.len() as u64 <= t.byte_len(),
            "internal: too many bytes for tensor '{name}'"
        );
        let path = self.shard_path(self.shard);
        self.out
            .as_mut()
            .expect("a shard is open while tensors remain")
            .write_all(bytes)
            .with_context(|| format!("cannot write tensor '{name}' to {}", path.display()))?;
        self.crc.0.update(bytes);
        self.crc.1 += bytes.len() as u64;
        self.written += bytes.len() as u64;
        self.skip_empty()
    }

    /// Flushes the last shard, checks every tensor was written, and writes the index when sharded.
    /// Returns each written file (shards, then the index) with its size and CRC-32.
    pub fn finish(mut self) -> Result<Vec<FileChecksum>> {
        if let Some(t) = self.current_tensor() {
            bail!("internal: tensor '{}' was not completely written", t.name);
        }
        self.close_shard()?;
        let n = self.shards.len();
        let names: Vec<String> = (0..n).map(|i| shard_file_name(i, n)).collect();
        if n > 1 {
            let mut weight_map = serde_json::Map::new();
            let mut tensors_sorted: Vec<(String, String)> = Vec::new();
            for (s, shard) in self.shards.iter().enumerate() {
                for &i in shard {
                    tensors_sorted.push((self.tensors[i].name.clone(), names[s].clone()));
                }
            }
            tensors_sorted.sort();
            for (t, f) in tensors_sorted {
                weight_map.insert(t, serde_json::Value::String(f));
            }
            let total: u64 = self.tensors.iter().map(|t| t.byte_len()).sum();
            let index =
                serde_json::json!({"metadata": {"total_size": total}, "weight_map": weight_map});
            let path = self.dir.join(INDEX_FILE);
            std::fs::write(&path, serde_json::to_string_pretty(&index)? + "\n")
                .with_context(|| format!("cannot write {}", path.display()))?;
            self.done.push(crc32_of_file(&path)?);
        }
        Ok(self.done)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(name: &str, n: usize) -> OutputTensor {
        OutputTensor {
            name: name.into(),
            dtype: DType::BF16,
            shape: vec![n],
        }
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
    }

    #[test]
    fn names_follow_hugging_face() {
        assert_eq!(shard_file_name(0, 1), "model.safetensors");
        assert_eq!(shard_file_name(1, 3), "model-00002-of-00003.safetensors");
    }
}
