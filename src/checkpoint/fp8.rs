//! FP8 block-scaled checkpoints, as DeepSeek-V3/R1 and Kimi K2 ship their bases
//! (`quantization_config.quant_method: fp8` in config.json): each quantized matrix is stored as
//! `float8_e4m3fn` (`F8_E4M3`) beside a `NAME_scale_inv` holding one f32 per block of
//! `weight_block_size` (128 × 128). Such a matrix is presented as bf16, each value its byte widened
//! to f32, times its block's scale, rounded once to bf16 — what DeepSeek's `weight_dequant`
//! (`fp8_cast_bf16.py`) writes — read tile by tile ([`Stored::Fp8Blocks`]); the scales are
//! consumed, not shown. A merged or converted output is then bf16 (or `--out-dtype`), with no
//! scales and no `quantization_config` in its config.

use super::dtype::decode;
use super::pieces::{BlockScales, Piece, Pieces, Stored};
use super::weight_file::{shape_text, TensorEntry, WeightFile};
use anyhow::{bail, ensure, Context, Result};
use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;

/// The suffix of a quantized matrix's scales.
pub const SCALE_SUFFIX: &str = "_scale_inv";

/// The config key transformers reads a quantization from; no output of rlmerge is quantized.
pub const QUANTIZATION_KEY: &str = "quantization_config";

/// The block size of the FP8 block-scaled checkpoint whose config is `config` (`None`: it is
/// not one). Another quantization named in the config is left to the dtype checks, which refuse
/// what they cannot read.
pub fn block_size(config: Option<&serde_json::Value>) -> Result<Option<(usize, usize)>> {
    let Some(q) = config.and_then(|c| c.get(QUANTIZATION_KEY)) else {
        return Ok(None);
    };
    if q.get("quant_method").and_then(|m| m.as_str()) != Some("fp8") {
        return Ok(None);
    }
    match q.get("weight_block_size") {
        None | Some(serde_json::Value::Null) => Ok(Some((128, 128))),
        Some(v) => {
            let sizes: Option<Vec<usize>> = v.as_array().map(|a| {
                a.iter()
                    .filter_map(|n| n.as_u64().and_then(|n| usize::try_from(n).ok()))
                    .filter(|&n| n > 0)
                    .collect()
            });
            match sizes.as_deref() {
                Some(&[rows, cols]) => Ok(Some((rows, cols))),
                _ => bail!(
                    "its {QUANTIZATION_KEY}.weight_block_size is {v}, not two positive integers"
                ),
            }
        }
    }
}

/// A tensor of a folder: its shard, its entry, whether it is stored as FP8 (listed) or how it is
/// read (returned: `Some` pieces for a dequantized matrix).
pub type InShard<T> = (usize, TensorEntry, T);

/// The folder's tensors with each FP8 matrix (`listed` marks them) presented as bf16 through
/// its scales, which are read now (a few KB each) and dropped from the list. A matrix without its
/// scales, scales that do not cover it, and scales without their matrix are refused by name.
pub fn dequantized(
    dir: &Path,
    shards: &[WeightFile],
    listed: Vec<InShard<bool>>,
    block: (usize, usize),
) -> Result<Vec<InShard<Option<Arc<Pieces>>>>> {
    let by_name: HashMap<&str, usize> = listed
        .iter()
        .enumerate()
        .map(|(i, (_, t, _))| (&*t.name, i))
        .collect();
    let mut scales_of = HashMap::new();
    for (i, (_, t, _)) in listed.iter().enumerate().filter(|(_, (_, _, fp8))| *fp8) {
        let name = &t.name;
        let what = || format!("{}: FP8 tensor '{name}'", dir.display());
        ensure!(
            t.shape.len() == 2,
            "{}: FP8 weights are block-scaled matrices; this one is {}",
            what(),
            shape_text(&t.shape)
        );
        let scale_name = format!("{name}{SCALE_SUFFIX}");
        let s = *by_name
            .get(scale_name.as_str())
            .with_context(|| format!("{} has no '{scale_name}' to scale it", what()))?;
        let (rows, cols) = (t.shape[0], t.shape[1]);
        let want = [rows.div_ceil(block.0), cols.div_ceil(block.1)];
        let (scale_shard, scale, scale_fp8) = &listed[s];
        ensure!(
            !scale_fp8 && *scale.shape == want,
            "{}: its '{scale_name}' is {}, where {} blocks of {} × {} need {}",
            what(),
            shape_text(&scale.shape),
            shape_text(&t.shape),
            block.0,
            block.1,
            shape_text(&want)
        );
        let values = read_scales(&shards[*scale_shard], scale).with_context(what)?;
        scales_of.insert(i, (s, values));
    }
    let used: std::collections::HashSet<usize> = scales_of.values().map(|(s, _)| *s).collect();
    if let Some((_, t, _)) = listed
        .iter()
        .enumerate()
        .find_map(|(i, t)| (!used.contains(&i) && t.1.name.ends_with(SCALE_SUFFIX)).then_some(t))
    {
        bail!(
            "{}: '{}' scales no FP8 tensor of the checkpoint",
            dir.display(),
            t.name
        );
    }
    Ok(listed
        .into_iter()
        .enumerate()
        .filter(|(i, _)| !used.contains(i))
        .map(|(i, (shard, t, _))| {
            let pieces = scales_of.remove(&i).map(|(_, scales)| {
                let parts = Box::new([Piece {
                    file: shard,
                    offset: t.offset,
                    numel: t.numel as u64,
                }]);
                let stored = Stored::Fp8Blocks(BlockScales {
                    scales,
                    cols: t.shape[1],
                    block,
                });
                Arc::new(Pieces { stored, parts })
            });
            (shard, t, pieces)
        })
        .collect())
}

/// A scale tensor's values, read whole from `file` (and counted in its checksum).
fn read_scales(file: &WeightFile, scale: &TensorEntry) -> Result<Box<[f32]>> {
    let mut bytes = vec![0u8; scale.byte_len() as usize];
    file.read(scale, 0, &mut bytes)?;
    file.record_read(scale, 0, &bytes);
    let mut values = vec![0f32; scale.numel];
    decode(scale.dtype, &bytes, &mut values);
    if let Some(bad) = values.iter().find(|v| !v.is_finite()) {
        bail!(
            "its scales '{}' hold {bad}: every block's scale must be finite",
            scale.name
        );
    }
    Ok(values.into())
}

/// How the record, the card and stderr name such a folder.
pub fn described(block: (usize, usize)) -> String {
    format!(
        "FP8 block-scaled safetensors (F8_E4M3 weights, a weight_scale_inv per {} × {} block), \
         dequantized to bf16 as DeepSeek's weight_dequant does",
        block.0, block.1
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_block_size_is_read_from_the_quantization_config() {
        let of = |v: serde_json::Value| block_size(Some(&v));
        assert_eq!(of(serde_json::json!({})).unwrap(), None);
        assert_eq!(
            of(serde_json::json!({"quantization_config": {"quant_method": "mxfp4"}})).unwrap(),
            None
        );
        assert_eq!(
            of(serde_json::json!({"quantization_config": {"quant_method": "fp8"}})).unwrap(),
            Some((128, 128))
        );
        assert_eq!(
            of(serde_json::json!({"quantization_config":
                {"quant_method": "fp8", "weight_block_size": [64, 32]}}))
            .unwrap(),
            Some((64, 32))
        );
        for bad in [
            serde_json::json!([0, 128]),
            serde_json::json!([128]),
            serde_json::json!("x"),
        ] {
            let err = of(serde_json::json!({"quantization_config":
                {"quant_method": "fp8", "weight_block_size": bad}}))
            .unwrap_err();
            assert!(format!("{err}").contains("weight_block_size"), "{err}");
        }
    }
}
