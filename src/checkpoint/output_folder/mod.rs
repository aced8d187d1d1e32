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

mod path_rules;
mod rename;
mod scratch;

use crate::error::{usage, Arg};
use anyhow::{Context, Result};
pub use path_rules::{refuse_inside, refuse_overlap, replaceable, resolve_output, Identity};
pub use rename::rename_noreplace;
pub use scratch::{
    begin_commit, intermediate_commit_done, remove_live_scratch, stale_notes, sweep, CommitGuard,
    Scratch,
};
use std::ffi::OsStr;
use std::fs::File;
use std::io;
use std::path::{Path, PathBuf};

/// The merge record an output folder holds (the `record` module), which lists every file rlmerge
/// wrote there.
pub const RECORD_FILE: &str = "rlmerge_record.json";
/// The record's name in folders written by rlmerge 0.1 before it had its own word; still read by
/// `verify` and by the `--force` check.
pub const LEGACY_RECORD_FILE: &str = "rlmerge_recipe.json";
/// The model card.
pub const CARD_FILE: &str = "README.md";
/// The recipe that makes the merge again, saved beside the weights as mergekit saves its own.
pub const MERGEKIT_CONFIG_FILE: &str = "mergekit_config.yml";
/// The manifest of a folder `rlmerge demo` wrote: `{"files": [...]}`.
pub const DEMO_MANIFEST: &str = ".rlmerge-demo.json";

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

/// The output folder while it is being written: a hidden scratch sibling of the final path,
/// renamed into place by [`OutputFolder::commit`]. Dropping it uncommitted removes it.
pub struct OutputFolder {
    /// As the user gave it (messages).
    shown: PathBuf,
    /// Resolved, absolute.
    final_dir: PathBuf,
    force: bool,
    scratch: Scratch,
    /// What a user should know about the folder beside the output: scratch that killed runs
    /// left (removed, when it was a merge into this output; else named with its size).
    notes: Vec<String>,
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

/// Refuses an output `out` (resolved: `final_dir`) that exists, unless `force` and it is a folder
/// rlmerge may replace ([`replaceable`]): usage errors, nothing touched.
fn existing(out: &Path, final_dir: &Path, force: bool) -> Result<()> {
    if final_dir.symlink_metadata().is_err() {
        return Ok(());
    }
    if !force {
        return Err(usage(crate::message![
            format!("output {} already exists (use ", out.display()),
            Arg::switch("force"),
            " to replace a folder rlmerge wrote)",
        ]));
    }
    replaceable(final_dir, Identity::Checksums).map_err(|why| {
        usage(crate::message![
            Arg::switch("force"),
            format!(
                " will not replace {}: {why}; choose another output",
                out.display()
            ),
        ])
    })
}

impl OutputFolder {
    /// The checks [`OutputFolder::create`] makes of `out` itself, before work that comes ahead of
    /// it (a multi-stage recipe's earlier stages): a usage error where it could not be written;
    /// else its resolved, absolute path.
    pub fn check(out: &Path, force: bool) -> Result<PathBuf> {
        let resolved = resolve_output(out)?;
        existing(out, &resolved, force)?;
        Ok(resolved)
    }

    /// Checks `out` against `inputs` and the replace rule (usage errors, nothing touched), then
    /// creates missing parent folders, removes what killed merges into `out` left, and creates
    /// the scratch folder.
    pub fn create(out: &Path, force: bool, inputs: &[PathBuf]) -> Result<OutputFolder> {
        let final_dir = resolve_output(out)?;
        refuse_overlap(out, &final_dir, inputs)?;
        let name = final_dir.file_name().expect("resolved paths end in a name");
        let parent = final_dir.parent().expect("resolved paths have a parent");
        let check_existing = || existing(out, &final_dir, force);
        check_existing()?;
        std::fs::create_dir_all(parent)
            .with_context(|| format!("cannot create the output's folder {}", parent.display()))?;
        let prefix = tmp_prefix(name);
        // An output a killed commit had moved aside goes back first, and then counts as existing.
        let mut restored = false;
        let removed = sweep(parent, &prefix, |id| {
            let old = aside(&final_dir, id);
            if old.symlink_metadata().is_err() {
                return Ok(());
            }
            match rename_noreplace(&old, &final_dir) {
                Ok(()) => {
                    restored = true;
                    Ok(())
                }
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
        if restored {
            check_existing()?;
        }
        let mut notes = Vec::new();
        if removed > 0 {
            notes.push(format!(
                "removed {} of scratch that a killed merge into {} had left beside it",
                crate::checkpoint::writer::size_text(removed),
                out.display()
            ));
        }
        notes.extend(stale_notes(&[parent.to_path_buf()]));
        let scratch = Scratch::create(parent, &prefix)?;
        Ok(OutputFolder {
            shown: out.to_path_buf(),
            final_dir,
            force,
            scratch,
            notes,
        })
    }

    /// What a user should know about the folder beside the output (killed runs' scratch).
    pub fn notes(&self) -> &[String] {
        &self.notes
    }

    /// Where the output will be once committed (absolute).
    pub fn final_path(&self) -> &Path {
        &self.final_dir
    }

    /// Where files go until commit.
    pub fn path(&self) -> &Path {
        self.scratch.path()
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
            return Err(crate::error::data(crate::message![
                format!(
                    "{} appeared while the merge ran; it was left as it was and the merge \
                     discarded (rerun with ",
                    self.shown.display()
                ),
                Arg::switch("force"),
                " to replace a folder rlmerge wrote)",
            ]));
        }
        // A cheap look first (no file read), so a folder that is plainly not rlmerge's is never
        // moved; the checksums are read once it is aside, where nothing can change it.
        if let Err(why) = replaceable(out, Identity::Sizes) {
            return Err(crate::error::data(crate::message![
                Arg::switch("force"),
                format!(
                    " will not replace {}: {why} (it changed while the merge ran; the merge was \
                     discarded)",
                    self.shown.display()
                ),
            ]));
        }
        let old = aside(out, self.scratch.id());
        rename_noreplace(out, &old)
            .with_context(|| format!("cannot move the old {} aside", out.display()))?;
        // Under its private name now; check again what exactly is being replaced.
        if let Err(why) = replaceable(&old, Identity::Checksums) {
            let back = rename_noreplace(&old, out);
            return Err(crate::error::data(crate::message![
                Arg::switch("force"),
                format!(
                    " will not replace {}: {why}{}",
                    self.shown.display(),
                    match back {
                        Ok(()) => String::new(),
                        Err(_) => format!(" (it is kept at {})", old.display()),
                    }
                ),
            ]));
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
    use super::path_rules::*;
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
        let check = |p: &Path| replaceable(p, Identity::Checksums);
        assert!(check(&f).is_err());
        let m = d.path().join("m");
        std::fs::create_dir(&m).unwrap();
        assert!(check(&m).is_ok());
        std::fs::write(m.join("model.safetensors"), b"x").unwrap();
        assert!(check(&m).is_err());
        // crc32 of "x".
        std::fs::write(
            m.join(RECORD_FILE),
            r#"{"outputs": [{"file": "model.safetensors", "size": 1, "crc32": "8cdc1683"}]}"#,
        )
        .unwrap();
        assert!(check(&m).is_ok());
        std::fs::write(m.join("eval.json"), b"{}").unwrap();
        let why = check(&m).unwrap_err();
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
