//! The file names of the model folders rlmerge reads, and the one check that a path is a
//! regular file before it is read. A leaf: the readers (`model`, `safetensors_file`, `lora`,
//! `folder_files`, `output_folder`) use it, it uses none of them.

use anyhow::{bail, Context, Result};
use std::path::Path;

/// A model's weights in one file.
pub const SINGLE_FILE: &str = "model.safetensors";
/// The index of a sharded model's weights.
pub const INDEX_FILE: &str = "model.safetensors.index.json";
/// A PEFT adapter's config.
pub const ADAPTER_CONFIG: &str = "adapter_config.json";
/// A PEFT adapter's weights.
pub const ADAPTER_WEIGHTS: &str = "adapter_model.safetensors";

/// Fails unless `path` is a regular file (after links): folders, FIFOs, sockets and devices are
/// refused before any read, which on a FIFO would wait forever.
pub fn check_regular_file(path: &Path) -> Result<()> {
    let meta =
        std::fs::metadata(path).with_context(|| format!("cannot open {}", path.display()))?;
    if !meta.is_file() {
        let kind = if meta.is_dir() {
            "a folder"
        } else {
            "not a regular file (a FIFO, socket or device)"
        };
        bail!("{} is {kind}", path.display());
    }
    Ok(())
}
