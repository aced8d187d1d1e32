//! MXFP4 checkpoints, as gpt-oss ships its experts (`quantization_config.quant_method: mxfp4`):
//! each expert tensor `X` stored as `X_blocks` (U8 [E, N, G, 16]: 32 FP4 E2M1 values a block, two
//! a byte) and `X_scales` (U8 [E, N, G]: an E8M0 exponent a block). Such a pair is presented as
//! the bf16 tensor `X` [E, G·32, N] — the name, layout and values transformers gives it when it
//! dequantizes the model (`convert_moe_packed_tensors`), which is what bf16 agents trained from
//! it hold — read tile by tile ([`Mxfp4Experts`]); the outputs keep no `quantization_config`.

use super::fp8::InShard;
use super::pieces::{Mxfp4Experts, Pieces, Stored};
use super::weight_file::{shape_text, Interner, TensorEntry};
use anyhow::{bail, ensure, Result};
use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;

/// The stored tensors' suffixes.
const BLOCKS: &str = "_blocks";
const SCALES: &str = "_scales";

/// Whether `config` says the checkpoint is MXFP4-quantized.
pub fn is_mxfp4(config: Option<&serde_json::Value>) -> bool {
    config
        .and_then(|c| c.get(super::fp8::QUANTIZATION_KEY))
        .and_then(|q| q.get("quant_method"))
        .and_then(|m| m.as_str())
        == Some("mxfp4")
}

/// The folder's tensors with each `X_blocks` / `X_scales` pair (both U8, `listed` marks them)
/// presented as bf16 `X`; a pair missing its half, or whose shapes do not fit, is refused by name.
pub fn dequantized(
    dir: &Path,
    listed: Vec<InShard<bool>>,
    interner: &mut Interner,
) -> Result<Vec<InShard<Option<Arc<Pieces>>>>> {
    let raw: HashMap<&str, usize> = listed
        .iter()
        .enumerate()
        .filter(|(_, t)| t.2)
        .map(|(i, t)| (&*t.1.name, i))
        .collect();
    let mut made = Vec::new();
    let mut used = std::collections::HashSet::new();
    for (name, &b) in &raw {
        let Some(x) = name.strip_suffix(BLOCKS) else {
            continue;
        };
        let what = || format!("{}: MXFP4 tensor '{x}'", dir.display());
        let Some(&s) = raw.get(format!("{x}{SCALES}").as_str()) else {
            bail!("{} has no '{x}{SCALES}' beside its blocks", what());
        };
        let (blocks, scales) = (&listed[b].1, &listed[s].1);
        let dims = match (&blocks.shape[..], &scales.shape[..]) {
            ([e, n, g, 16], [e2, n2, g2]) if (e, n, g) == (e2, n2, g2) => (*e, *n, *g),
            _ => bail!(
                "{}: its blocks are {} and its scales {}; MXFP4 stores [E, N, G, 16] and [E, N, G]",
                what(),
                shape_text(&blocks.shape),
                shape_text(&scales.shape)
            ),
        };
        let shape = vec![dims.0, dims.2 * 32, dims.1];
        let experts = Mxfp4Experts {
            blocks: (listed[b].0, blocks.offset),
            scales: (listed[s].0, scales.offset),
            dims,
            id: Mxfp4Experts::next_id(),
        };
        let entry = TensorEntry {
            name: interner.name(x.to_string()),
            dtype: super::dtype::DType::BF16,
            numel: shape.iter().product(),
            shape: interner.shape(shape),
            offset: blocks.offset,
        };
        let pieces = Pieces {
            stored: Stored::Mxfp4(experts),
            parts: Box::new([]),
        };
        made.push((b, (listed[b].0, entry, Some(Arc::new(pieces)))));
        used.extend([b, s]);
    }
    if let Some((_, t, _)) = listed
        .iter()
        .enumerate()
        .find_map(|(i, t)| (t.2 && !used.contains(&i)).then_some(t))
    {
        bail!(
            "{}: '{}' is stored as bytes (U8) but is not the blocks or scales of an MXFP4 pair",
            dir.display(),
            t.name
        );
    }
    ensure!(
        !made.is_empty(),
        "{}: its config says MXFP4, but it holds no *_blocks / *_scales pairs",
        dir.display()
    );
    // The presented tensors take their blocks' places; the others keep theirs.
    let mut made: HashMap<usize, InShard<Option<Arc<Pieces>>>> = made.into_iter().collect();
    Ok(listed
        .into_iter()
        .enumerate()
        .filter_map(|(i, (shard, t, raw))| match made.remove(&i) {
            Some(x) => Some(x),
            None if raw => None,
            None => Some((shard, t, None)),
        })
        .collect())
}

/// How the record, the card and stderr name such a folder.
pub fn described() -> String {
    "MXFP4 safetensors (gpt-oss experts: *_blocks and *_scales), dequantized to bf16 as \
     transformers' convert_moe_packed_tensors does"
        .to_string()
}
