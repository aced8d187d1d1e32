//! The quantized checkpoints rlmerge reads, as its config's `quantization_config` names them:
//! which one-byte dtype their safetensors hold, how their tensors are presented as bf16
//! ([`super::fp8`], [`super::mxfp4`]), and how the record names them.

use super::fp8::InShard;
use super::pieces::Pieces;
use super::weight_file::{Interner, WeightFile};
use anyhow::Result;
use std::path::Path;
use std::sync::Arc;

/// A quantized checkpoint's kind.
#[derive(Clone, Copy, Debug)]
pub enum Quantized {
    /// FP8 block-scaled (DeepSeek-V3, Kimi K2), with its block's rows and columns.
    Fp8Blocks((usize, usize)),
    /// MXFP4 experts (gpt-oss).
    Mxfp4,
}

impl Quantized {
    /// The kind `config` (a folder's config.json) names; `None` for a plain checkpoint, or a
    /// quantization the dtype checks refuse.
    pub fn of(config: Option<&serde_json::Value>) -> Result<Option<Quantized>> {
        Ok(match super::fp8::block_size(config)? {
            Some(block) => Some(Quantized::Fp8Blocks(block)),
            None if super::mxfp4::is_mxfp4(config) => Some(Quantized::Mxfp4),
            None => None,
        })
    }

    /// The safetensors dtype its quantized tensors are stored in.
    pub fn raw_dtype(self) -> &'static str {
        match self {
            Quantized::Fp8Blocks(_) => "F8_E4M3",
            Quantized::Mxfp4 => "U8",
        }
    }

    /// The folder's tensors (`listed` marks those in [`Self::raw_dtype`]) with the quantized
    /// ones presented as bf16.
    pub fn dequantized(
        self,
        dir: &Path,
        shards: &[WeightFile],
        listed: Vec<InShard<bool>>,
        interner: &mut Interner,
    ) -> Result<Vec<InShard<Option<Arc<Pieces>>>>> {
        match self {
            Quantized::Fp8Blocks(block) => super::fp8::dequantized(dir, shards, listed, block),
            Quantized::Mxfp4 => super::mxfp4::dequantized(dir, listed, interner),
        }
    }

    /// How the record, the card and stderr name such a folder.
    pub fn described(self) -> String {
        match self {
            Quantized::Fp8Blocks(block) => super::fp8::described(block),
            Quantized::Mxfp4 => super::mxfp4::described(),
        }
    }
}
