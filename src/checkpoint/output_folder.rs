//! Where a merge writes, made so that no user data is ever lost (README "Guarantees"):
//!
//! - `-o` is resolved (symbolic links, `.`, `..`) and refused when it equals, contains or lies
//!   inside an input folder, an input file or the recipe ([`OutputFolder::create`]);
//! - an existing output is replaced only with `--force`, and only when it is an empty folder or
//!   a folder rlmerge wrote, holding nothing but the files its manifest lists ([`replaceable`]);
//! - the output is written into a hidden scratch folder beside it, which becomes the output by one
//!   rename that cannot replace anything ([`rename_noreplace`]); whatever appeared at `-o` while
//!   the merge ran is left alone, or, with `--force`, replaced under the same rule as above;
//! - every scratch folder has a lock file, held while its process runs. A later run removes only
//!   scratch folders whose lock nobody holds: file locks belong to the kernel (and to NFS's lock
//!   manager), so a live merge in another PID namespace, container or host sharing the volume
//!   keeps its folder;
//! - Ctrl-C, SIGTERM and SIGHUP remove the running process's scratch folders
//!   ([`remove_live_scratch`], called by the binary's signal handler).

use super::open_files::Identity;
use crate::error::usage;
use anyhow::{bail, Context, Result};
use std::ffi::OsStr;
use std::fs::File;
use std::io;
use std::path::{Component, Path, PathBuf};
use std::sync::Mutex;

/// The merge record an output folder holds (the `record` module), which lists every file rlmerge
/// wrote there.
pub const RECORD_FILE: &str = "rlmerge_record.json";
/// The record's name in folders written by rlmerge 0.1 before it had its own word; still read by
/// `verify` and by the `--force` check.
pub const LEGACY_RECORD_FILE: &str = "rlmerge_recipe.json";
/// The model card.
pub const CARD_FILE: &str = "README.md";
/// The manifest of a folder `rlmerge demo` wrote: `{"files": [...]}`.
pub const DEMO_MANIFEST: &str = ".rlmerge-demo.json";

/// Scratch folders (and their lock files) of this process, removed on a termination signal.
static LIVE: Mutex<Vec<PathBuf>> = Mutex::new(Vec::new());

fn live() -> std::sync::MutexGuard<'static, Vec<PathBuf>> {
    LIVE.lock().unwrap_or_else(|p| p.into_inner())
}

/// Set, under [`LIVE`]'s lock, once a commit has started: from then on a termination signal no
/// longer ends the process — the commit finishes and the run reports what it did.
static COMMITTING: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

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

/// Writes `files` (name, bytes) into folder `dir` — analyze's figures — under the rules of every
/// rlmerge output: `dir` resolved and refused when it is or lies inside one of `protect` (the
/// inputs); a folder a merge wrote (it holds a record) is refused, its files are `verify`'s; a
/// target that exists and is not a regular file (a symbolic link, FIFO, folder, device) is
/// refused, never followed or opened; each file is written in a scratch folder beside and
/// renamed into place (replacing a regular file of that name), all of them after every one is
/// complete. A usage error (exit 2) leaves `dir` as it was. Returns the paths written.
pub fn write_files(
    dir: &Path,
    files: &[(&str, Vec<u8>)],
    protect: &[PathBuf],
) -> Result<Vec<PathBuf>> {
    let resolved = resolve_output(dir)?;
    refuse_inside(dir, &resolved, protect)?;
    let target_ok = |path: &Path| -> Result<()> {
        match path.symlink_metadata() {
            Ok(m) if !m.file_type().is_file() => Err(usage(format!(
                "{} exists and is {}; rlmerge writes only regular files and replaces nothing \
                 else (nothing was written)",
                path.display(),
                kind_of(&m)
            ))),
            _ => Ok(()),
        }
    };
    if resolved.symlink_metadata().is_ok() {
        if !resolved.is_dir() {
            return Err(usage(format!(
                "{} is not a folder (nothing was written)",
                dir.display()
            )));
        }
        if [RECORD_FILE, LEGACY_RECORD_FILE]
            .iter()
            .any(|r| resolved.join(r).symlink_metadata().is_ok())
        {
            return Err(usage(format!(
                "{} is a merged folder (it holds {RECORD_FILE}); its files are checked by \
                 `rlmerge verify` and are not replaced: choose another folder (nothing was \
                 written)",
                dir.display()
            )));
        }
    }
    for (name, _) in files {
        target_ok(&resolved.join(name))?;
    }
    std::fs::create_dir_all(&resolved)
        .with_context(|| format!("cannot create {}", dir.display()))?;
    let scratch = Scratch::create(&resolved, ".rlmerge-tmp")?;
    for (name, bytes) in files {
        let path = scratch.path().join(name);
        let mut f = File::options()
            .write(true)
            .create_new(true)
            .open(&path)
            .with_context(|| format!("cannot create {}", path.display()))?;
        io::Write::write_all(&mut f, bytes)
            .with_context(|| format!("cannot write {}", path.display()))?;
    }
    let _commit = begin_commit();
    let mut written = Vec::with_capacity(files.len());
    for (name, _) in files {
        let to = resolved.join(name);
        // Checked again now: what appeared there since is not replaced either.
        target_ok(&to)?;
        std::fs::rename(scratch.path().join(name), &to)
            .with_context(|| format!("cannot write {}", to.display()))?;
        written.push(dir.join(name));
    }
    Ok(written)
}

/// What a file type is, for messages.
fn kind_of(m: &std::fs::Metadata) -> &'static str {
    use std::os::unix::fs::FileTypeExt;
    let t = m.file_type();
    if t.is_symlink() {
        "a symbolic link"
    } else if t.is_dir() {
        "a folder"
    } else if t.is_fifo() {
        "a FIFO"
    } else if t.is_socket() {
        "a socket"
    } else if t.is_block_device() || t.is_char_device() {
        "a device"
    } else {
        "not a regular file"
    }
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
            let lock = File::options()
                .read(true)
                .write(true)
                .create_new(true)
                .open(&lock_path)
                .with_context(|| format!("cannot create {}", lock_path.display()))?;
            live().push(lock_path.clone());
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
            live().push(scratch.dir.clone());
            std::fs::create_dir(&scratch.dir)
                .with_context(|| format!("cannot create {}", scratch.dir.display()))?;
            return Ok(scratch);
        }
        bail!(
            "cannot create a scratch folder in {} (its lock files keep disappearing)",
            parent.display()
        )
    }

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

/// Removes what dead processes left in `parent` under `prefix`: for every `PREFIX-ID.lock` that no
/// process holds, `dead(id)` runs (to restore or remove siblings sharing the lock), then
/// `PREFIX-ID` and the lock file go. A folder without a lock file is never touched.
pub fn sweep(parent: &Path, prefix: &str, mut dead: impl FnMut(&str) -> Result<()>) -> Result<()> {
    let Ok(entries) = std::fs::read_dir(parent) else {
        return Ok(());
    };
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(id) = name
            .to_str()
            .and_then(|n| n.strip_prefix(prefix))
            .and_then(|n| n.strip_prefix('-'))
            .and_then(|n| n.strip_suffix(".lock"))
        else {
            continue;
        };
        let lock_path = entry.path();
        let Ok(lock) = File::open(&lock_path) else {
            continue;
        };
        if lock.try_lock().is_err() || !same_file(&lock, &lock_path) {
            continue; // alive (or just removed by another sweep)
        }
        dead(id)?;
        let dir = parent.join(format!("{prefix}-{id}"));
        if dir.symlink_metadata().is_ok() {
            std::fs::remove_dir_all(&dir).with_context(|| {
                format!("cannot remove {}, left by a killed run", dir.display())
            })?;
        }
        let _ = std::fs::remove_file(&lock_path);
    }
    Ok(())
}

/// `to` must not exist: the rename fails with `AlreadyExists` instead of replacing anything.
/// Linux: `renameat2(RENAME_NOREPLACE)`; macOS: `renamex_np(RENAME_EXCL)`. Where the filesystem
/// or OS has neither, a check and a plain rename: in the instant between them only an empty
/// folder can be replaced (POSIX `rename` fails on a non-empty folder and on a file).
pub fn rename_noreplace(from: &Path, to: &Path) -> io::Result<()> {
    match os_rename_noreplace(from, to) {
        Some(Err(e)) if exists_error(&e) => Err(io::ErrorKind::AlreadyExists.into()),
        Some(result) => result,
        None => {
            if to.symlink_metadata().is_ok() {
                return Err(io::ErrorKind::AlreadyExists.into());
            }
            std::fs::rename(from, to).map_err(|e| {
                if exists_error(&e) {
                    io::ErrorKind::AlreadyExists.into()
                } else {
                    e
                }
            })
        }
    }
}

fn exists_error(e: &io::Error) -> bool {
    #[cfg(unix)]
    if matches!(e.raw_os_error(), Some(libc::EEXIST | libc::ENOTEMPTY)) {
        return true;
    }
    e.kind() == io::ErrorKind::AlreadyExists
}

/// The OS's atomic no-replace rename; `None` where there is none, or the filesystem refuses the
/// flag (the caller falls back).
#[cfg(unix)]
fn os_rename_noreplace(from: &Path, to: &Path) -> Option<io::Result<()>> {
    use std::os::unix::ffi::OsStrExt;
    let c_path = |p: &Path| {
        std::ffi::CString::new(p.as_os_str().as_bytes())
            .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "path holds a NUL byte"))
    };
    let (f, t) = match (c_path(from), c_path(to)) {
        (Ok(f), Ok(t)) => (f, t),
        (Err(e), _) | (_, Err(e)) => return Some(Err(e)),
    };
    if raw_rename_noreplace(&f, &t)? == 0 {
        return Some(Ok(()));
    }
    let e = io::Error::last_os_error();
    match e.raw_os_error() {
        // An old kernel, or a filesystem without the flag.
        Some(libc::ENOSYS | libc::EINVAL | libc::ENOTSUP) => None,
        _ => Some(Err(e)),
    }
}

/// `renameat2(RENAME_NOREPLACE)`: its return value.
#[cfg(any(target_os = "linux", target_os = "android"))]
fn raw_rename_noreplace(from: &std::ffi::CStr, to: &std::ffi::CStr) -> Option<i64> {
    const RENAME_NOREPLACE: libc::c_uint = 1;
    // SAFETY: both paths are NUL-terminated C strings that outlive the call.
    let r = unsafe {
        libc::syscall(
            libc::SYS_renameat2,
            libc::AT_FDCWD,
            from.as_ptr(),
            libc::AT_FDCWD,
            to.as_ptr(),
            RENAME_NOREPLACE,
        )
    };
    Some(r as i64)
}

/// `renamex_np(RENAME_EXCL)`: its return value.
#[cfg(any(target_os = "macos", target_os = "ios"))]
fn raw_rename_noreplace(from: &std::ffi::CStr, to: &std::ffi::CStr) -> Option<i64> {
    // SAFETY: both paths are NUL-terminated C strings that outlive the call.
    Some(unsafe { libc::renamex_np(from.as_ptr(), to.as_ptr(), libc::RENAME_EXCL) } as i64)
}

#[cfg(all(
    unix,
    not(any(
        target_os = "linux",
        target_os = "android",
        target_os = "macos",
        target_os = "ios"
    ))
))]
fn raw_rename_noreplace(_from: &std::ffi::CStr, _to: &std::ffi::CStr) -> Option<i64> {
    None
}

#[cfg(not(unix))]
fn os_rename_noreplace(_from: &Path, _to: &Path) -> Option<io::Result<()>> {
    None
}

/// The absolute path `out` names, with symbolic links, `.` and `..` resolved in the part that
/// exists; the part that does not exist yet must be plain names. `-o` itself must not be a link.
pub fn resolve_output(out: &Path) -> Result<PathBuf> {
    let invalid = |why: &str| usage(format!("invalid output path {}: {why}", out.display()));
    if out.as_os_str().is_empty() {
        return Err(invalid("it is empty"));
    }
    let abs = if out.is_absolute() {
        out.to_path_buf()
    } else {
        std::env::current_dir()
            .context("cannot read the current folder")?
            .join(out)
    };
    if abs
        .symlink_metadata()
        .is_ok_and(|m| m.file_type().is_symlink())
    {
        return Err(usage(format!(
            "output path {} is a symbolic link; give the folder it points to, or another path",
            out.display()
        )));
    }
    // The deepest part of the path that exists, resolved by the OS; then the rest, by name.
    let mut existing = abs.as_path();
    let mut rest: Vec<&OsStr> = Vec::new();
    while existing.symlink_metadata().is_err() {
        match existing.components().next_back() {
            Some(Component::Normal(n)) => rest.push(n),
            Some(Component::CurDir) => {}
            _ => return Err(invalid("'..' after a folder that does not exist")),
        }
        existing = existing
            .parent()
            .ok_or_else(|| invalid("no part of it exists"))?;
    }
    let mut resolved = std::fs::canonicalize(existing)
        .with_context(|| format!("cannot resolve {}", existing.display()))?;
    resolved.extend(rest.iter().rev());
    if resolved.parent().is_none() {
        return Err(invalid("it is the root folder"));
    }
    Ok(resolved)
}

/// How `out` (resolved) and an input path overlap, if they do.
fn overlap(out: &Path, input: &Path) -> Option<&'static str> {
    if out == input {
        Some("is")
    } else if out.starts_with(input) {
        Some("lies inside")
    } else if input.starts_with(out) {
        Some("contains")
    } else {
        None
    }
}

/// Refuses an output that equals, contains or lies inside any of `inputs` (folders or files,
/// compared after resolving links), so no merge can write over what it reads.
pub fn refuse_overlap(out: &Path, resolved: &Path, inputs: &[PathBuf]) -> Result<()> {
    refuse(out, resolved, inputs, true)
}

/// Refuses an output folder that is or lies inside any of `inputs`: for files written into a
/// folder (figures) rather than a folder replaced whole, a folder containing the inputs is fine.
pub fn refuse_inside(out: &Path, resolved: &Path, inputs: &[PathBuf]) -> Result<()> {
    refuse(out, resolved, inputs, false)
}

fn refuse(out: &Path, resolved: &Path, inputs: &[PathBuf], containing: bool) -> Result<()> {
    for input in inputs {
        let real = std::fs::canonicalize(input).unwrap_or_else(|_| input.clone());
        let how = overlap(resolved, &real).filter(|&how| containing || how != "contains");
        if let Some(how) = how {
            let what = if real.is_dir() { "folder" } else { "file" };
            return Err(usage(format!(
                "output path {} {how} the input {what} {}{}; choose an output outside every input \
                 (nothing was written)",
                out.display(),
                input.display(),
                if std::path::absolute(input).is_ok_and(|a| a != real) {
                    format!(" ({})", real.display())
                } else {
                    String::new()
                }
            )));
        }
    }
    Ok(())
}

/// Whether `--force` may replace `path`: an empty folder, or a folder whose manifest (a merge's
/// record, or the demo's manifest) lists every file in it. `Err` says why not.
pub fn replaceable(path: &Path) -> std::result::Result<(), String> {
    let meta = path
        .symlink_metadata()
        .map_err(|e| format!("cannot inspect it: {e}"))?;
    if meta.file_type().is_symlink() {
        return Err("it is a symbolic link".into());
    }
    if !meta.is_dir() {
        return Err("it is not a folder (rlmerge replaces only folders it wrote)".into());
    }
    let entries: Vec<String> = std::fs::read_dir(path)
        .map_err(|e| format!("cannot list it: {e}"))?
        .map(|e| {
            e.map(|e| e.file_name().to_string_lossy().into_owned())
                .map_err(|e| format!("cannot list it: {e}"))
        })
        .collect::<std::result::Result<_, _>>()?;
    if entries.is_empty() {
        return Ok(());
    }
    let listed = manifest(path).ok_or_else(|| {
        "it is not empty and rlmerge did not write it (no rlmerge_record.json)".to_string()
    })?;
    match entries.iter().find(|e| !listed.contains(e)) {
        Some(foreign) => Err(format!(
            "it holds '{}', which rlmerge did not write there",
            escape(foreign)
        )),
        None => Ok(()),
    }
}

/// The files a manifest in `dir` says rlmerge wrote there, the manifest itself included.
fn manifest(dir: &Path) -> Option<Vec<String>> {
    let read = |name: &str, key: &str| -> Option<Vec<String>> {
        let path = dir.join(name);
        // Not a regular file (a FIFO would block the read): no manifest.
        super::files::check_regular_file(&path).ok()?;
        let text = std::fs::read_to_string(&path).ok()?;
        let json: serde_json::Value = serde_json::from_str(&text).ok()?;
        let mut files: Vec<String> = json
            .get(key)?
            .as_array()?
            .iter()
            .map(|f| f.get("file").unwrap_or(f).as_str().map(str::to_string))
            .collect::<Option<_>>()?;
        files.push(name.to_string());
        Some(files)
    };
    for record in [RECORD_FILE, LEGACY_RECORD_FILE] {
        if let Some(mut files) = read(record, "outputs") {
            files.push(CARD_FILE.to_string());
            return Some(files);
        }
    }
    read(DEMO_MANIFEST, "files")
}

/// `name` with control characters escaped, for messages.
fn escape(name: &str) -> String {
    name.escape_debug().to_string()
}

/// The output folder while it is being written: a hidden scratch sibling of the final path,
/// renamed into place by [`OutputFolder::commit`]. Dropping it uncommitted removes it.
pub struct OutputFolder {
    /// As the user gave it (messages).
    shown: PathBuf,
    /// Resolved, absolute.
    final_dir: PathBuf,
    force: bool,
    scratch: Scratch,
}

/// The scratch prefix of outputs named `name`: `.NAME.rlmerge-tmp`.
fn tmp_prefix(name: &OsStr) -> String {
    format!(".{}.rlmerge-tmp", name.to_string_lossy())
}

/// Where a commit moves a replaced output while the new one goes in: `.NAME.rlmerge-old-ID`.
fn aside(final_dir: &Path, id: &str) -> PathBuf {
    let name = final_dir.file_name().unwrap_or_default().to_string_lossy();
    final_dir.with_file_name(format!(".{name}.rlmerge-old-{id}"))
}

impl OutputFolder {
    /// Checks `out` against `inputs` and the replace rule (usage errors, nothing touched), then
    /// creates missing parent folders, removes what killed merges into `out` left, and creates
    /// the scratch folder.
    pub fn create(out: &Path, force: bool, inputs: &[PathBuf]) -> Result<OutputFolder> {
        let final_dir = resolve_output(out)?;
        refuse_overlap(out, &final_dir, inputs)?;
        let name = final_dir.file_name().expect("resolved paths end in a name");
        let parent = final_dir.parent().expect("resolved paths have a parent");
        let check_existing = || -> Result<()> {
            if final_dir.symlink_metadata().is_err() {
                return Ok(());
            }
            if !force {
                return Err(usage(format!(
                    "output {} already exists (use --force to replace a folder rlmerge wrote)",
                    out.display()
                )));
            }
            replaceable(&final_dir).map_err(|why| {
                usage(format!(
                    "--force will not replace {}: {why}; choose another output",
                    out.display()
                ))
            })
        };
        check_existing()?;
        std::fs::create_dir_all(parent)
            .with_context(|| format!("cannot create the output's folder {}", parent.display()))?;
        let prefix = tmp_prefix(name);
        // An output a killed commit had moved aside goes back first, and then counts as existing.
        sweep(parent, &prefix, |id| {
            let old = aside(&final_dir, id);
            if old.symlink_metadata().is_err() {
                return Ok(());
            }
            match rename_noreplace(&old, &final_dir) {
                Ok(()) => Ok(()),
                // The killed merge's new output went in: the old one was on its way out.
                Err(e) if e.kind() == io::ErrorKind::AlreadyExists => std::fs::remove_dir_all(&old)
                    .with_context(|| format!("cannot remove {}", old.display())),
                Err(e) => Err(e).with_context(|| {
                    format!(
                        "cannot restore {} to {}",
                        old.display(),
                        final_dir.display()
                    )
                }),
            }
        })?;
        check_existing()?;
        let scratch = Scratch::create(parent, &prefix)?;
        Ok(OutputFolder {
            shown: out.to_path_buf(),
            final_dir,
            force,
            scratch,
        })
    }

    /// Where files go until commit.
    pub fn path(&self) -> &Path {
        self.scratch.path()
    }

    /// The resolved output path.
    pub fn final_path(&self) -> &Path {
        &self.final_dir
    }

    /// Moves the finished folder into place. Without `--force` nothing at the output path is
    /// replaced, not even what appeared there during the merge; with it, only what
    /// [`replaceable`] allows, and only now that the new folder is complete.
    pub fn commit(self) -> Result<()> {
        // Signals wait until the folders are where they belong, then let the run report them.
        let _hold = begin_commit();
        let (tmp, out) = (self.scratch.path(), &self.final_dir);
        match rename_noreplace(tmp, out) {
            Ok(()) => return Ok(()),
            Err(e) if e.kind() != io::ErrorKind::AlreadyExists => {
                return Err(e).with_context(|| {
                    format!("cannot rename {} to {}", tmp.display(), out.display())
                })
            }
            Err(_) => {}
        }
        if !self.force {
            bail!(
                "{} appeared while the merge ran; it was left as it was and the merge discarded \
                 (rerun with --force to replace a folder rlmerge wrote)",
                self.shown.display()
            );
        }
        if let Err(why) = replaceable(out) {
            bail!(
                "--force will not replace {}: {why} (it changed while the merge ran; the merge was \
                 discarded)",
                self.shown.display()
            );
        }
        let old = aside(out, self.scratch.id());
        rename_noreplace(out, &old)
            .with_context(|| format!("cannot move the old {} aside", out.display()))?;
        // Under its private name now; check again what exactly is being replaced.
        if let Err(why) = replaceable(&old) {
            let back = rename_noreplace(&old, out);
            bail!(
                "--force will not replace {}: {why}{}",
                self.shown.display(),
                match back {
                    Ok(()) => String::new(),
                    Err(_) => format!(" (it is kept at {})", old.display()),
                }
            );
        }
        if let Err(e) = rename_noreplace(tmp, out) {
            let back = rename_noreplace(&old, out);
            return Err(e).with_context(|| {
                format!(
                    "cannot rename {} to {}{}",
                    tmp.display(),
                    out.display(),
                    match back {
                        Ok(()) => String::new(),
                        Err(_) => format!(" (the old output is kept at {})", old.display()),
                    }
                )
            });
        }
        std::fs::remove_dir_all(&old)
            .with_context(|| format!("merged, but cannot remove the replaced {}", old.display()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rename_noreplace_never_replaces() {
        let d = tempfile::tempdir().unwrap();
        let (a, b) = (d.path().join("a"), d.path().join("b"));
        std::fs::create_dir(&a).unwrap();
        std::fs::create_dir(&b).unwrap();
        let e = rename_noreplace(&a, &b).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::AlreadyExists);
        std::fs::write(d.path().join("f"), b"x").unwrap();
        let e = rename_noreplace(&a, &d.path().join("f")).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::AlreadyExists);
        rename_noreplace(&a, &d.path().join("c")).unwrap();
        assert!(d.path().join("c").is_dir() && !a.exists());
    }

    #[test]
    fn outputs_resolve_through_links_dots_and_missing_folders() {
        let d = tempfile::tempdir().unwrap();
        let real = std::fs::canonicalize(d.path()).unwrap();
        std::fs::create_dir_all(real.join("m/s")).unwrap();
        assert_eq!(
            resolve_output(&real.join("m/./s/..")).unwrap(),
            real.join("m")
        );
        assert_eq!(
            resolve_output(&real.join("m/new/deeper")).unwrap(),
            real.join("m/new/deeper")
        );
        assert!(resolve_output(&real.join("m/new/../x")).is_err());
        #[cfg(unix)]
        {
            std::os::unix::fs::symlink(real.join("m"), real.join("link")).unwrap();
            assert_eq!(
                resolve_output(&real.join("link/sub")).unwrap(),
                real.join("m/sub")
            );
            assert!(resolve_output(&real.join("link")).is_err());
        }
    }

    #[test]
    fn overlaps_are_named() {
        let p = Path::new;
        assert_eq!(overlap(p("/m"), p("/m")), Some("is"));
        assert_eq!(overlap(p("/m/base/x"), p("/m/base")), Some("lies inside"));
        assert_eq!(overlap(p("/m"), p("/m/base")), Some("contains"));
        assert_eq!(overlap(p("/m/basement"), p("/m/base")), None);
    }

    #[test]
    fn only_empty_or_manifested_folders_are_replaceable() {
        let d = tempfile::tempdir().unwrap();
        let f = d.path().join("file");
        std::fs::write(&f, b"x").unwrap();
        assert!(replaceable(&f).is_err());
        let m = d.path().join("m");
        std::fs::create_dir(&m).unwrap();
        assert!(replaceable(&m).is_ok());
        std::fs::write(m.join("model.safetensors"), b"x").unwrap();
        assert!(replaceable(&m).is_err());
        std::fs::write(
            m.join(RECORD_FILE),
            r#"{"outputs": [{"file": "model.safetensors", "size": 1, "crc32": "0"}]}"#,
        )
        .unwrap();
        assert!(replaceable(&m).is_ok());
        std::fs::write(m.join("eval.json"), b"{}").unwrap();
        let why = replaceable(&m).unwrap_err();
        assert!(why.contains("eval.json"), "{why}");
    }

    #[test]
    fn sweep_spares_locked_scratch_and_removes_dead_ones() {
        let d = tempfile::tempdir().unwrap();
        let alive = Scratch::create(d.path(), ".o.rlmerge-tmp").unwrap();
        // A dead process's: its lock file is there, and nobody holds it.
        let dead = d.path().join(".o.rlmerge-tmp-1-dead");
        std::fs::create_dir(&dead).unwrap();
        std::fs::write(d.path().join(".o.rlmerge-tmp-1-dead.lock"), b"").unwrap();
        // No lock file: never touched.
        let unlocked = d.path().join(".o.rlmerge-tmp-2-nolock");
        std::fs::create_dir(&unlocked).unwrap();
        let mut seen = Vec::new();
        sweep(d.path(), ".o.rlmerge-tmp", |id| {
            seen.push(id.to_string());
            Ok(())
        })
        .unwrap();
        assert_eq!(seen, ["1-dead"]);
        assert!(alive.path().is_dir() && !dead.exists() && unlocked.is_dir());
        drop(alive);
        assert_eq!(std::fs::read_dir(d.path()).unwrap().count(), 1);
    }
}
