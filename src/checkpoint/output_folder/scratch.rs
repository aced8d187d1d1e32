//! Scratch folders: each with a lock file held while its process runs, removed on a termination
//! signal unless a commit has started, and swept by a later run only when nobody holds its lock.

use crate::checkpoint::open_files::Identity;
use anyhow::{bail, Context, Result};
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

/// Scratch folders (and their lock files) of this process, removed on a termination signal.
static LIVE: Mutex<Vec<PathBuf>> = Mutex::new(Vec::new());

fn live() -> std::sync::MutexGuard<'static, Vec<PathBuf>> {
    LIVE.lock().unwrap_or_else(|p| p.into_inner())
}

/// Set, under [`LIVE`]'s lock, once a commit has started: from then on a termination signal no
/// longer ends the process — the commit finishes and the run reports what it did.
static COMMITTING: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Set when a termination signal came while a commit held it off: a run whose commit was not its
/// last (a multi-stage recipe's earlier stage) learns of it in [`intermediate_commit_done`].
static PENDING: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Ends the commit of an output that is not the run's last (a multi-stage recipe's earlier stage,
/// into scratch): termination signals end the process again, and one that came during the commit
/// is the [`crate::cancel::Interrupted`] returned here, so the run stops as interrupted.
pub fn intermediate_commit_done() -> Result<(), crate::cancel::Interrupted> {
    let _registry = live();
    COMMITTING.store(false, std::sync::atomic::Ordering::SeqCst);
    match PENDING.swap(false, std::sync::atomic::Ordering::SeqCst) {
        true => Err(crate::cancel::Interrupted),
        false => Ok(()),
    }
}

/// Holds off termination signals while outputs are renamed into place ([`remove_live_scratch`]
/// waits for it, then lets the process finish instead of exiting).
pub struct CommitGuard(#[allow(dead_code)] std::sync::MutexGuard<'static, Vec<PathBuf>>);

/// Starts a commit: see [`CommitGuard`].
pub fn begin_commit() -> CommitGuard {
    let guard = live();
    COMMITTING.store(true, std::sync::atomic::Ordering::SeqCst);
    CommitGuard(guard)
}

/// Removes every scratch folder and lock file of this process; for a signal handler, just before
/// the process exits. Waits for a commit in progress (it holds the same lock) to finish first.
/// Returns `false`, removing nothing, when a commit has started: its outputs are (being) put in
/// place, so the process must finish and report them rather than exit saying nothing was written.
pub fn remove_live_scratch() -> bool {
    let paths = live();
    if COMMITTING.load(std::sync::atomic::Ordering::SeqCst) {
        PENDING.store(true, std::sync::atomic::Ordering::SeqCst);
        return false;
    }
    for p in paths.iter() {
        // A worker may still be creating a file in it: try a few times.
        for _ in 0..20 {
            let gone = match p.symlink_metadata() {
                Err(_) => true,
                Ok(m) if m.is_dir() => std::fs::remove_dir_all(p).is_ok(),
                Ok(_) => std::fs::remove_file(p).is_ok(),
            };
            if gone {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
    }
    // Keep the registry locked: nothing may start a new scratch folder while the process exits.
    std::mem::forget(paths);
    true
}

/// A random identifier for scratch names: the process id, so a person can tell whose it is, and
/// 64 random bits, so processes of other PID namespaces or hosts never collide.
fn scratch_id() -> String {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos()),
    );
    format!("{}-{:016x}", std::process::id(), h.finish())
}

/// A folder `PREFIX-ID` of this process, with its lock file `PREFIX-ID.lock` held until drop.
/// Dropping it removes both (a committed output folder has been renamed away by then).
pub struct Scratch {
    dir: PathBuf,
    id: String,
    lock_path: PathBuf,
    _lock: File,
}

impl Scratch {
    /// Creates `PREFIX-ID` in `parent` (which must exist), its lock taken first.
    pub fn create(parent: &Path, prefix: &str) -> Result<Scratch> {
        for _ in 0..8 {
            let id = scratch_id();
            let lock_path = parent.join(format!("{prefix}-{id}.lock"));
            // Created and registered under the registry's lock: a termination signal's cleanup
            // (which takes that lock and keeps it) sees the file, or runs before it exists.
            let mut registry = live();
            let lock = File::options()
                .read(true)
                .write(true)
                .create_new(true)
                .open(&lock_path)
                .with_context(|| format!("cannot create {}", lock_path.display()))?;
            registry.push(lock_path.clone());
            drop(registry);
            let scratch = Scratch {
                dir: parent.join(format!("{prefix}-{id}")),
                id,
                lock_path,
                _lock: lock,
            };
            // From here on, dropping `scratch` removes what exists of it.
            scratch
                ._lock
                .lock()
                .with_context(|| format!("cannot lock {}", scratch.lock_path.display()))?;
            // A sweep may have taken the unlocked file for a dead one's and removed it in the
            // instant before our lock: then start again under another name.
            if !same_file(&scratch._lock, &scratch.lock_path) {
                continue;
            }
            let mut registry = live();
            registry.push(scratch.dir.clone());
            std::fs::create_dir(&scratch.dir)
                .with_context(|| format!("cannot create {}", scratch.dir.display()))?;
            drop(registry);
            return Ok(scratch);
        }
        bail!(
            "cannot create a scratch folder in {} (its lock files keep disappearing)",
            parent.display()
        )
    }

    /// The scratch folder's path.
    pub fn path(&self) -> &Path {
        &self.dir
    }

    /// The identifier in its name, for sibling names that share its lock.
    pub fn id(&self) -> &str {
        &self.id
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
        let _ = std::fs::remove_file(&self.lock_path);
        live().retain(|p| *p != self.dir && *p != self.lock_path);
    }
}

/// Whether the open `file` is the file at `path` now (not one created there since).
fn same_file(file: &File, path: &Path) -> bool {
    match (file.metadata(), path.metadata()) {
        (Ok(a), Ok(b)) => Identity::of(&a) == Identity::of(&b),
        _ => false,
    }
}

/// A scratch lock file's name, `PREFIX-PID-HEX.lock` with `.rlmerge-` in PREFIX, as its prefix
/// and identifier (`PID-HEX`, [`scratch_id`]).
fn lock_name(name: &str) -> Option<(&str, &str)> {
    let stem = name.strip_suffix(".lock")?;
    let (rest, hex) = stem.rsplit_once('-')?;
    let (prefix, pid) = rest.rsplit_once('-')?;
    let id = &stem[prefix.len() + 1..];
    let numeric = !pid.is_empty() && pid.bytes().all(|b| b.is_ascii_digit());
    (numeric && !hex.is_empty() && prefix.contains(".rlmerge-")).then_some((prefix, id))
}

/// The lock files in `parent` whose scratch prefix `matches` and which no process holds: each
/// one's prefix, identifier and path. A name that is no scratch lock file ([`lock_name`]) is
/// passed by; a folder without a lock file is never anyone's scratch.
fn dead_locks(parent: &Path, matches: impl Fn(&str) -> bool) -> Vec<(String, String, PathBuf)> {
    let Ok(entries) = std::fs::read_dir(parent) else {
        return Vec::new();
    };
    let mut dead = Vec::new();
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some((prefix, id)) = name
            .to_str()
            .and_then(lock_name)
            .map(|(p, i)| (p.to_string(), i.to_string()))
        else {
            continue;
        };
        if !matches(&prefix) {
            continue;
        }
        let lock_path = entry.path();
        let Ok(lock) = File::open(&lock_path) else {
            continue;
        };
        if lock.try_lock().is_err() || !same_file(&lock, &lock_path) {
            continue; // alive (or just removed by another sweep)
        }
        dead.push((prefix, id, lock_path));
    }
    dead
}

/// Removes what dead processes left in `parent` under `prefix`: for every `PREFIX-ID.lock` that no
/// process holds, `dead(id)` runs (to restore or remove siblings sharing the lock), then
/// `PREFIX-ID` and the lock file go. A folder without a lock file is never touched. Returns the
/// bytes removed.
pub fn sweep(parent: &Path, prefix: &str, mut dead: impl FnMut(&str) -> Result<()>) -> Result<u64> {
    let mut removed = 0;
    for (_, id, lock_path) in dead_locks(parent, |p| p == prefix) {
        dead(&id)?;
        let dir = parent.join(format!("{prefix}-{id}"));
        if dir.symlink_metadata().is_ok() {
            removed += size_of_tree(&dir);
            std::fs::remove_dir_all(&dir).with_context(|| {
                format!("cannot remove {}, left by a killed run", dir.display())
            })?;
        }
        let _ = std::fs::remove_file(&lock_path);
    }
    Ok(removed)
}

/// Bytes of the files under `path` on disk (what removing them frees: space reserved for output
/// shards counts before it is written), links not followed.
fn size_of_tree(path: &Path) -> u64 {
    let Ok(meta) = path.symlink_metadata() else {
        return 0;
    };
    if !meta.is_dir() {
        #[cfg(unix)]
        return std::os::unix::fs::MetadataExt::blocks(&meta) * 512;
        #[cfg(not(unix))]
        return meta.len();
    }
    std::fs::read_dir(path)
        .map(|entries| entries.flatten().map(|e| size_of_tree(&e.path())).sum())
        .unwrap_or(0)
}

/// A line for each scratch folder in `folders` that a killed process left (its lock held by
/// nobody: SIGKILL, the OOM killer, `docker kill` leave them; a later merge into the same output
/// removes them): its path, its size, and the command that removes it.
pub fn stale_notes(folders: &[PathBuf]) -> Vec<String> {
    let mut seen = std::collections::BTreeSet::new();
    let mut notes = Vec::new();
    for folder in folders {
        for (prefix, id, lock_path) in dead_locks(folder, |_| true) {
            let dir = folder.join(format!("{prefix}-{id}"));
            if !seen.insert(dir.clone()) {
                continue;
            }
            let pid = id.split('-').next().unwrap_or("?");
            notes.push(format!(
                "{} ({}) is the scratch folder of an rlmerge run that was killed (process {pid} \
                 holds it no more); nothing uses it — remove it with: rm -rf {} {}",
                dir.display(),
                crate::checkpoint::writer::size_text(size_of_tree(&dir)),
                shell_word(&dir),
                shell_word(&lock_path),
            ));
        }
    }
    notes
}

/// `path` quoted for a POSIX shell.
fn shell_word(path: &Path) -> String {
    let text = path.display().to_string();
    format!("'{}'", text.replace('\'', "'\\''"))
}
