//! The adapter's files: PEFT's tensors of each factored module, the tensors saved whole (read
//! again from the model as the file is written), `adapter_config.json` and the card.

use super::{card, each_chunk, Extraction, Factors, Request};
use crate::checkpoint::dtype::encode;
use crate::checkpoint::files::{ADAPTER_CONFIG, ADAPTER_WEIGHTS, SINGLE_FILE};
use crate::checkpoint::{CheckpointWriter, DType, ModelFolder, ModelTensor, OutputTensor};
use anyhow::{Context, Result};
use std::path::Path;

/// One tensor of the adapter file, in the base's dtype.
pub(super) struct Written<'m> {
    name: String,
    shape: Vec<usize>,
    source: Source<'m>,
}

/// Where a tensor of the adapter file comes from.
enum Source<'m> {
    /// Values made here (factors, biases) in the adapter's dtype, held until the file is written
    /// (a module's factors are small beside its matrix).
    Bytes(Vec<u8>),
    /// A tensor of the model saved whole: read again chunk by chunk as the file is written, so
    /// an embedding of any vocabulary is never held.
    Model(&'m ModelTensor),
}

impl Written<'_> {
    pub(super) fn new(
        name: String,
        shape: Vec<usize>,
        values: &[f32],
        dtype: DType,
    ) -> Written<'static> {
        let mut bytes = vec![0u8; values.len() * dtype.size()];
        encode(dtype, values, &mut bytes);
        Written {
            name,
            shape,
            source: Source::Bytes(bytes),
        }
    }

    /// Tensor `t` of the model, saved whole under `name`.
    pub(super) fn whole(name: String, t: &ModelTensor) -> Written<'_> {
        Written {
            name,
            shape: t.entry.shape.to_vec(),
            source: Source::Model(t),
        }
    }
}

/// PEFT's tensors of a factored module: `lora_A.weight` (r × n) and `lora_B.weight` (m × r) of a
/// linear layer; of an embedding (Δ of vocab × hidden), `lora_embedding_A` (r × vocab) and
/// `lora_embedding_B` (hidden × r), PEFT's ΔW = (B·A)ᵀ.
pub(super) fn adapter_tensors(
    module: &str,
    f: &Factors,
    (embedding, n): (bool, usize),
    dtype: DType,
) -> Vec<Written<'static>> {
    let r = f.a_rows.len();
    let m = f.b_cols.first().map_or(0, Vec::len);
    // Row-major r × n from rows, and m × r from columns.
    let rows = |rows: &[Vec<f64>]| {
        rows.iter()
            .flatten()
            .map(|&x| x as f32)
            .collect::<Vec<f32>>()
    };
    let cols = |cols: &[Vec<f64>], len: usize| {
        (0..len)
            .flat_map(|i| cols.iter().map(move |c| c[i] as f32))
            .collect::<Vec<f32>>()
    };
    // A linear layer's A (r × n) from A's rows and B (m × r) from B's columns; an embedding's
    // Δᵀ = A_rowsᵀ·B_colsᵀ: its A (r × vocab) from B's columns as rows, its B (hidden × r) from
    // A's rows as columns.
    let (names, (a_rows, b_cols), (b_len, a_len)) = match embedding {
        false => (
            ["lora_A.weight", "lora_B.weight"],
            (&f.a_rows, &f.b_cols),
            (m, n),
        ),
        true => (
            ["lora_embedding_A", "lora_embedding_B"],
            (&f.b_cols, &f.a_rows),
            (n, m),
        ),
    };
    let p = format!("base_model.model.{module}");
    vec![
        Written::new(
            format!("{p}.{}", names[0]),
            vec![r, a_len],
            &rows(a_rows),
            dtype,
        ),
        Written::new(
            format!("{p}.{}", names[1]),
            vec![b_len, r],
            &cols(b_cols, b_len),
            dtype,
        ),
    ]
}

/// Writes `adapter_model.safetensors` (every tensor in `dtype`), `adapter_config.json` (rank,
/// alpha = rank so PEFT's scaling is 1, per-module ranks where they differ, the target modules and
/// the modules saved whole) and a model card into `dir`.
pub(super) fn write_adapter(
    req: &Request,
    dir: &Path,
    (tensors, model): (&[Written], &ModelFolder),
    (dtype, lora_bias): (DType, bool),
    done: &Extraction,
) -> Result<()> {
    let plan: Vec<OutputTensor> = tensors
        .iter()
        .map(|t| OutputTensor {
            name: t.name.as_str().into(),
            dtype,
            shape: t.shape.clone().into(),
        })
        .collect();
    let mut writer = CheckpointWriter::new(dir, plan, u64::MAX)?;
    let mut bytes = Vec::new();
    for t in tensors {
        match &t.source {
            Source::Bytes(b) => writer.write(&t.name, b)?,
            Source::Model(mt) => each_chunk(model, mt, |_, values| {
                crate::cancel::current().check()?;
                bytes.resize(values.len() * dtype.size(), 0);
                encode(dtype, values, &mut bytes);
                writer.write(&t.name, &bytes)
            })?,
        }
    }
    writer.finish()?;
    let (from, to) = (dir.join(SINGLE_FILE), dir.join(ADAPTER_WEIGHTS));
    std::fs::rename(&from, &to).with_context(|| format!("cannot write {}", to.display()))?;
    let rank = done
        .modules
        .iter()
        .map(|m| m.rank)
        .max()
        .unwrap_or(req.rank)
        .max(1);
    let pattern: serde_json::Map<String, serde_json::Value> = done
        .modules
        .iter()
        .filter(|m| m.rank != rank && m.rank > 0)
        .map(|m| (regex::escape(&m.module) + "$", m.rank.into()))
        .collect();
    let config = serde_json::json!({
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": req.base.display().to_string(),
        "r": rank,
        "lora_alpha": rank,
        "rank_pattern": pattern,
        "alpha_pattern": pattern,
        "target_modules": done.modules.iter().filter(|m| m.rank > 0).map(|m| m.module.clone()).collect::<Vec<_>>(),
        "modules_to_save": done.whole,
        "lora_dropout": 0.0,
        "bias": "none",
        "fan_in_fan_out": false,
        "inference_mode": true,
        "init_lora_weights": true,
        "use_rslora": false,
        "use_dora": false,
        "lora_bias": lora_bias,
    });
    let path = dir.join(ADAPTER_CONFIG);
    std::fs::write(&path, serde_json::to_string_pretty(&config)? + "\n")
        .with_context(|| format!("cannot write {}", path.display()))?;
    std::fs::write(dir.join("README.md"), card(req, done))
        .with_context(|| format!("cannot write {}", dir.join("README.md").display()))?;
    Ok(())
}
