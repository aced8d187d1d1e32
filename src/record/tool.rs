//! The records of rlmerge's tools that make something other than a merge — `extract-lora`'s
//! adapter, `moe`'s mixture of experts: `rlmerge_record.json` as a merge's, with a `kind` that
//! says which tool wrote it, the checksums of every file read and written (`verify` checks them),
//! and what the tool was asked. `verify --against` recomputes merges only: such a folder is made
//! again by running its tool again.

use super::{recorded_path, InputChecksums, RECORD_FILE};
use crate::checkpoint::ModelFolder;
use crate::error::usage;
use anyhow::{Context, Result};
use std::path::Path;

/// The kinds of record these tools write, with the command that makes each again.
pub const TOOL_KINDS: [(&str, &str); 2] = [
    (
        "extract-lora",
        "running rlmerge extract-lora with the options its record holds",
    ),
    (
        "moe",
        "running rlmerge moe on the mergekit_moe_config.yml it holds",
    ),
];

/// The `kind` of the tool record in `dir`, where it holds one.
pub fn tool_kind(dir: &Path) -> Option<&'static str> {
    let path = dir.join(RECORD_FILE);
    let kind = crate::checkpoint::files::check_regular_file(&path)
        .ok()
        .and_then(|_| std::fs::read_to_string(&path).ok())
        .and_then(|t| serde_json::from_str::<serde_json::Value>(&t).ok())?["kind"]
        .as_str()
        .map(str::to_string)?;
    TOOL_KINDS.iter().find(|(k, _)| *k == kind).map(|(k, _)| *k)
}

/// The answer to `verify --against` of a tool's folder: a usage error saying how it is made again.
pub fn against_refused(kind: &str) -> anyhow::Error {
    let how = TOOL_KINDS
        .iter()
        .find(|(k, _)| *k == kind)
        .map_or("running its tool again", |(_, how)| how);
    usage(format!(
        "--against recomputes merges; this folder is rlmerge {kind}'s, made again by {how}"
    ))
}

/// Input model `m`'s checksums, its path as seen from the output `out`.
pub fn input(out: &Path, m: &ModelFolder) -> Result<InputChecksums> {
    Ok(InputChecksums {
        path: recorded_path(out, &m.dir),
        hub_id: crate::hub::id_of_snapshot(&m.dir),
        files: m.checksums()?,
        format: m.other_format(),
    })
}

/// Writes `record` as `dir`'s record (pretty JSON).
pub fn write(dir: &Path, record: &impl serde::Serialize) -> Result<()> {
    let path = dir.join(RECORD_FILE);
    std::fs::write(&path, serde_json::to_string_pretty(record)? + "\n")
        .with_context(|| format!("cannot write {}", path.display()))
}
