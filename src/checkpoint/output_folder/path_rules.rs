//! Where an output may go: `-o` resolved, refused around the inputs, and replaced only when it is
//! empty or holds nothing but what rlmerge wrote there.

use super::{CARD_FILE, DEMO_MANIFEST, LEGACY_RECORD_FILE, RECORD_FILE};
use crate::error::usage;
use anyhow::{Context, Result};
use std::ffi::OsStr;
use std::path::{Component, Path, PathBuf};

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
pub(super) fn overlap(out: &Path, input: &Path) -> Option<&'static str> {
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

/// How closely [`replaceable`] checks that each entry of a folder is the file its manifest says
/// rlmerge wrote.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Identity {
    /// Each entry a regular file (no folder, link or device at a listed name), of the size the
    /// manifest records: a cheap look before a folder is moved aside.
    Sizes,
    /// [`Identity::Sizes`], and each file's CRC-32 the one the manifest records: what `--force`
    /// checks before anything is removed.
    Checksums,
}

/// Whether `--force` may replace `path`: an empty folder, or a folder whose manifest (a merge's
/// record, or the demo's manifest) lists every entry in it, each a regular file of the recorded
/// size and (with [`Identity::Checksums`]) checksum — a user's folder or file that merely
/// carries a listed name is not rlmerge's. `Err` says why not.
pub fn replaceable(path: &Path, identity: Identity) -> std::result::Result<(), String> {
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
    for entry in &entries {
        let shown = crate::escape::terminal(entry);
        let Some(written) = listed.iter().find(|w| w.file == *entry) else {
            return Err(format!(
                "it holds '{shown}', which rlmerge did not write there"
            ));
        };
        let file = path.join(entry);
        let meta = file
            .symlink_metadata()
            .map_err(|e| format!("cannot inspect '{shown}' in it: {e}"))?;
        if !meta.file_type().is_file() {
            return Err(format!(
                "its '{shown}' is {}, not the file rlmerge wrote there",
                super::kind_of(&meta)
            ));
        }
        let changed = || format!("its '{shown}' is not the file rlmerge wrote there (it changed)");
        if written.size.is_some_and(|size| size != meta.len()) {
            return Err(changed());
        }
        if let (Identity::Checksums, Some(crc)) = (identity, &written.crc32) {
            let now = crate::checkpoint::weight_file::crc32_of_file(&file)
                .map_err(|e| format!("cannot read '{shown}' in it: {e:#}"))?;
            if now.crc32 != *crc {
                return Err(changed());
            }
        }
    }
    Ok(())
}

/// A file a manifest says rlmerge wrote, with the size and CRC-32 it records (older manifests
/// record names alone).
struct Written {
    file: String,
    size: Option<u64>,
    crc32: Option<String>,
}

/// The files a manifest in `dir` says rlmerge wrote there, the manifest itself included.
fn manifest(dir: &Path) -> Option<Vec<Written>> {
    let read = |name: &str, key: &str| -> Option<Vec<Written>> {
        let path = dir.join(name);
        // Not a regular file (a FIFO would block the read): no manifest.
        crate::checkpoint::files::check_regular_file(&path).ok()?;
        let text = std::fs::read_to_string(&path).ok()?;
        let json: serde_json::Value = serde_json::from_str(&text).ok()?;
        let mut files: Vec<Written> = json
            .get(key)?
            .as_array()?
            .iter()
            .map(|f| {
                Some(Written {
                    file: f.get("file").unwrap_or(f).as_str()?.to_string(),
                    size: f.get("size").and_then(|s| s.as_u64()),
                    crc32: f.get("crc32").and_then(|c| c.as_str()).map(str::to_string),
                })
            })
            .collect::<Option<_>>()?;
        files.push(Written::named(name));
        Some(files)
    };
    for record in [RECORD_FILE, LEGACY_RECORD_FILE] {
        if let Some(mut files) = read(record, "outputs") {
            files.push(Written::named(CARD_FILE));
            return Some(files);
        }
    }
    read(DEMO_MANIFEST, "files")
}

impl Written {
    /// A file the manifest names without a size or checksum (the manifest, the model card).
    fn named(file: &str) -> Written {
        Written {
            file: file.to_string(),
            size: None,
            crc32: None,
        }
    }
}
