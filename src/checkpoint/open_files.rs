//! Input files opened on demand, at most [`max_open`] at a time (least recently used closed
//! first), so a merge of any number of shards stays within the process's limit of open files
//! (`ulimit -n`): 4 models of 400 shards each hold a handful. A file reopened after eviction must be the one
//! first opened — same device and inode (Unix), size and modification time — or the read fails
//! as if the file had changed under the merge.

use anyhow::{bail, Context, Result};
use std::collections::HashMap;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

/// Input files open at once, at most, where the open-file limit allows it.
pub const MAX_OPEN: usize = 128;

/// Input files open at once, at most: [`MAX_OPEN`], or a quarter of the process's soft limit of
/// open files (`ulimit -n`) where that is lower — the rest stays for output shards, the GPU
/// driver, Python — and never fewer than 4.
pub fn max_open() -> usize {
    static LIMIT: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *LIMIT.get_or_init(|| {
        #[cfg(unix)]
        {
            let mut r = libc::rlimit {
                rlim_cur: 0,
                rlim_max: 0,
            };
            // SAFETY: getrlimit writes the struct it is given, which lives across the call.
            if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut r) } == 0
                && r.rlim_cur != libc::RLIM_INFINITY
            {
                return ((r.rlim_cur / 4) as usize).clamp(4, MAX_OPEN);
            }
        }
        MAX_OPEN
    })
}

/// What identifies one version of a file: (device, inode) where the OS has them, size and
/// modification time.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Identity {
    node: (u64, u64),
    /// The file's length in bytes.
    pub len: u64,
    modified: Option<std::time::SystemTime>,
}

impl Identity {
    /// The identity of the file `meta` describes.
    pub fn of(meta: &std::fs::Metadata) -> Identity {
        #[cfg(unix)]
        let node = {
            use std::os::unix::fs::MetadataExt;
            (meta.dev(), meta.ino())
        };
        #[cfg(not(unix))]
        let node = (0, 0);
        Identity {
            node,
            len: meta.len(),
            modified: meta.modified().ok(),
        }
    }
}

struct Entry {
    file: Arc<File>,
    /// The version opened: a caller that opened another version (the file was replaced between
    /// two merges of one process) gets the file opened again.
    identity: Identity,
    last_use: u64,
}

#[derive(Default)]
struct Cache {
    open: HashMap<PathBuf, Entry>,
    clock: u64,
}

static CACHE: Mutex<Option<Cache>> = Mutex::new(None);

/// The open file at `path`, which must still be the version `identity` describes; opened (and
/// the least recently used one closed) when it is not open.
pub fn get(path: &Path, identity: &Identity) -> Result<Arc<File>> {
    {
        let mut guard = CACHE.lock().unwrap_or_else(|p| p.into_inner());
        let cache = guard.get_or_insert_with(Cache::default);
        cache.clock += 1;
        let now = cache.clock;
        if let Some(e) = cache.open.get_mut(path) {
            if e.identity == *identity {
                e.last_use = now;
                return Ok(e.file.clone());
            }
            cache.open.remove(path);
        }
    }
    // Opened outside the lock: other threads keep reading their files meanwhile.
    let file = File::open(path).with_context(|| format!("cannot open {}", path.display()))?;
    let meta = file
        .metadata()
        .with_context(|| format!("cannot stat {}", path.display()))?;
    if Identity::of(&meta) != *identity {
        bail!(
            "{} changed while it was being read (it was replaced, or its size or modification \
             time moved)",
            path.display()
        );
    }
    let file = Arc::new(file);
    let mut guard = CACHE.lock().unwrap_or_else(|p| p.into_inner());
    let cache = guard.get_or_insert_with(Cache::default);
    if cache.open.len() >= max_open() {
        if let Some(oldest) = cache
            .open
            .iter()
            .min_by_key(|(_, e)| e.last_use)
            .map(|(p, _)| p.clone())
        {
            // Readers still holding it keep it open until they finish.
            cache.open.remove(&oldest);
        }
    }
    let now = cache.clock;
    cache.open.insert(
        path.to_path_buf(),
        Entry {
            file: file.clone(),
            identity: *identity,
            last_use: now,
        },
    );
    Ok(file)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_replaced_file_is_opened_anew_or_refused() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("f");
        std::fs::write(&p, b"one").unwrap();
        let first = Identity::of(&std::fs::metadata(&p).unwrap());
        assert!(get(&p, &first).is_ok());
        // Replaced by rename: a new inode.
        let q = d.path().join("g");
        std::fs::write(&q, b"two!").unwrap();
        std::fs::rename(&q, &p).unwrap();
        let second = Identity::of(&std::fs::metadata(&p).unwrap());
        assert_ne!(first, second);
        // The open handle still is the first version: its reader keeps it (check_unchanged, by
        // path, reports the replacement at the end of the merge).
        assert_eq!(get(&p, &first).unwrap().metadata().unwrap().len(), 3);
        // A reader of the second version gets the new file, not the cached old one ...
        assert_eq!(get(&p, &second).unwrap().metadata().unwrap().len(), 4);
        // ... and the first version, closed now, cannot be had again.
        assert!(get(&p, &first).is_err());
    }
}
