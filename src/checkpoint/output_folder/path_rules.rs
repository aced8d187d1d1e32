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
            crate::escape::terminal(foreign)
        )),
        None => Ok(()),
    }
}

/// The files a manifest in `dir` says rlmerge wrote there, the manifest itself included.
fn manifest(dir: &Path) -> Option<Vec<String>> {
    let read = |name: &str, key: &str| -> Option<Vec<String>> {
        let path = dir.join(name);
        // Not a regular file (a FIFO would block the read): no manifest.
        crate::checkpoint::files::check_regular_file(&path).ok()?;
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
