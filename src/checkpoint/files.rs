//! The file names of the model folders rlmerge reads, and the one check that a path is a
//! regular file before it is read. A leaf: the readers (`model`, `safetensors_file`, `lora`,
//! `folder_files`, `output_folder`) use it, it uses none of them.

use anyhow::{bail, Context, Result};
use std::path::Path;

/// A model's weights in one file.
pub const SINGLE_FILE: &str = "model.safetensors";
/// The index of a sharded model's weights.
pub const INDEX_FILE: &str = "model.safetensors.index.json";
/// A model's weights in the format `torch.save` writes, in one file (transformers' name).
pub const TORCH_SINGLE_FILE: &str = "pytorch_model.bin";
/// The index of a sharded model's `torch.save` weights.
pub const TORCH_INDEX_FILE: &str = "pytorch_model.bin.index.json";

/// The format of a model folder's weight files.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WeightFormat {
    /// `model.safetensors`, or shards and `model.safetensors.index.json`.
    Safetensors,
    /// `pytorch_model.bin`, or shards and `pytorch_model.bin.index.json`: zip archives of a
    /// pickle and its storages, read as data ([`super::torch_file`]).
    Torch,
}

impl WeightFormat {
    /// The formats in the order transformers looks for them: a folder holding both is read as
    /// safetensors, as `from_pretrained` reads it.
    pub const ALL: [WeightFormat; 2] = [WeightFormat::Safetensors, WeightFormat::Torch];

    /// The weights' file when there is one.
    pub fn single_file(self) -> &'static str {
        match self {
            WeightFormat::Safetensors => SINGLE_FILE,
            WeightFormat::Torch => TORCH_SINGLE_FILE,
        }
    }

    /// The index of the shards when there are several.
    pub fn index_file(self) -> &'static str {
        match self {
            WeightFormat::Safetensors => INDEX_FILE,
            WeightFormat::Torch => TORCH_INDEX_FILE,
        }
    }

    /// How messages, the record and the card name it.
    pub fn name(self) -> &'static str {
        match self {
            WeightFormat::Safetensors => "safetensors",
            WeightFormat::Torch => "torch.save (pytorch_model.bin)",
        }
    }
}

/// A PEFT adapter's config.
pub const ADAPTER_CONFIG: &str = "adapter_config.json";
/// A PEFT adapter's weights.
pub const ADAPTER_WEIGHTS: &str = "adapter_model.safetensors";
/// A PEFT adapter's weights as older PEFT saved them (`torch.save`).
pub const ADAPTER_TORCH_WEIGHTS: &str = "adapter_model.bin";

/// Opens the regular file `path` ([`check_regular_file`]) and returns it with its metadata.
pub fn open_regular(path: &Path) -> Result<(std::fs::File, std::fs::Metadata)> {
    check_regular_file(path)?;
    let file =
        std::fs::File::open(path).with_context(|| format!("cannot open {}", path.display()))?;
    let meta = file
        .metadata()
        .with_context(|| format!("cannot stat {}", path.display()))?;
    Ok((file, meta))
}

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
