//! The records of rlmerge's tools that make something other than a merge — `extract-lora`'s
//! adapter, `moe`'s mixture of experts: `rlmerge_record.json` as a merge's, with a `kind` that
//! says which tool wrote it, the checksums of every file read and written (`verify` checks them),
//! and what the tool was asked (`verify --against` builds a MoE again from it).

use super::{recorded_path, InputChecksums, RECORD_FILE};
use crate::checkpoint::ModelFolder;
use crate::error::usage;
use anyhow::{Context, Result};
use std::path::Path;

/// The kinds of record these tools write.
const TOOL_KINDS: [&str; 2] = ["extract-lora", "moe"];

/// The `kind` of the tool record in `dir`, where it holds one.
pub fn tool_kind(dir: &Path) -> Option<&'static str> {
    let path = dir.join(RECORD_FILE);
    let kind = crate::checkpoint::files::check_regular_file(&path)
        .ok()
        .and_then(|_| std::fs::read_to_string(&path).ok())
        .and_then(|t| serde_json::from_str::<serde_json::Value>(&t).ok())?["kind"]
        .as_str()
        .map(str::to_string)?;
    TOOL_KINDS.iter().find(|k| **k == kind).copied()
}

/// The answer to `verify --against` of an extracted adapter: a usage error saying how it is made
/// again (a MoE is built again from its saved config and compared).
pub fn against_refused() -> anyhow::Error {
    usage(
        "--against recomputes merges and MoEs; an adapter rlmerge extract-lora wrote is made \
         again by running rlmerge extract-lora with the options its record holds",
    )
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
