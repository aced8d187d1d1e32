//! The MoE's weights, streamed: every planned tensor's parts cut into chunks of at most
//! [`CHUNK`] elements, each chunk read, converted and written at its final place in the shards by
//! whichever worker takes it (the writer places bytes by offset and checksums them in any order).
//! A part read in the output dtype with nothing to change is copied as its bytes; else its values
//! go through f32 — a LoRA expert's update added, the expert's noise and residual scale applied
//! in the expert's dtype as mergekit-moe applies them (each step rounded to it) — and are encoded
//! in the output dtype. Every element's value is computed alone: the bytes do not depend on the
//! thread count.

use super::config::MoeConfig;
use super::plan::{expert_of, Part, Planned};
use crate::checkpoint::dtype::{decode, encode, first_nonfinite, round_through};
use crate::checkpoint::weight_file::FileChecksum;
use crate::checkpoint::{CheckpointWriter, DType, ModelFolder, ModelTensor};
use anyhow::{bail, Context, Result};
use rayon::prelude::*;
use std::path::Path;

/// Elements read at a time.
const CHUNK: usize = 1 << 22;

/// Elements a worker converts at a time.
const SPAN: usize = 1 << 16;

/// One chunk of work: output tensor `index`'s bytes from `at`, made of `part` (for a tensor,
/// its elements `start..start + len` of `tensor`).
struct Item<'a> {
    index: usize,
    at: u64,
    part: &'a Part,
    tensor: Option<&'a ModelTensor>,
    start: usize,
    len: usize,
}

/// Writes every planned tensor into the shards of `dir` (at most `options.shard_bytes` each);
/// `models` are the opened inputs the parts name.
pub fn write(
    planned: &[Planned],
    models: &[ModelFolder],
    config: &MoeConfig,
    dir: &Path,
    options: super::Options,
) -> Result<Vec<FileChecksum>> {
    let plan: Vec<_> = planned.iter().map(|p| p.out.clone()).collect();
    let total = plan.iter().map(|t| t.byte_len()).sum();
    let progress = crate::engine::progress_bar(total, options.show_progress, "moe");
    let writer = CheckpointWriter::new(dir, plan, options.shard_bytes)?;
    let items = items(planned, models)?;
    let cancel = crate::cancel::current();
    items
        .par_iter()
        .try_for_each_init(Buffers::default, |io, item| -> Result<()> {
            cancel.check()?;
            let p = &planned[item.index];
            let (name, dtype) = (&*p.out.name, p.out.dtype);
            let bytes: &[u8] = match item.part {
                Part::Zeros(n) => {
                    io.out.clear();
                    io.out.resize(n * dtype.size(), 0);
                    &io.out
                }
                Part::Values(v) => {
                    io.out.resize(v.len() * dtype.size(), 0);
                    encode(dtype, v, &mut io.out);
                    &io.out
                }
                Part::Tensor {
                    model,
                    name: source,
                    expert,
                } => {
                    let adjust = match expert {
                        Some((k, down)) => {
                            let e = expert_of(config, *k);
                            Adjust {
                                noise: e.noise_scale.map(|s| (s, noise_key(config.seed, name, *k))),
                                scale: e.residual_scale.filter(|_| *down),
                            }
                        }
                        None => Adjust::default(),
                    };
                    let from = Source {
                        model: &models[*model],
                        tensor: item.tensor.expect("a tensor part's items hold it"),
                        name: source,
                        adjust,
                        allow_nonfinite: options.allow_nonfinite,
                    };
                    from.chunk((item.start, item.len), dtype, io)?
                }
            };
            writer.write_at(item.index, item.at, bytes)?;
            progress.inc(bytes.len() as u64);
            Ok(())
        })?;
    progress.finish_and_clear();
    writer.finish()
}

/// Every planned tensor's parts as chunks, in the output's order, each with its place.
fn items<'a>(planned: &'a [Planned], models: &'a [ModelFolder]) -> Result<Vec<Item<'a>>> {
    let mut items = Vec::new();
    for (index, p) in planned.iter().enumerate() {
        let size = p.out.dtype.size() as u64;
        let mut at = 0u64;
        for part in &p.parts {
            let tensor = match part {
                Part::Tensor { model, name, .. } => {
                    let m = &models[*model];
                    Some(m.get(name).with_context(|| {
                        format!("internal: {} has no '{name}'", m.dir.display())
                    })?)
                }
                _ => None,
            };
            let numel = match part {
                Part::Zeros(n) => *n,
                Part::Values(v) => v.len(),
                Part::Tensor { .. } => tensor.map_or(0, |t| t.entry.numel),
            };
            let chunk = match part {
                Part::Tensor { .. } => CHUNK,
                _ => numel.max(1),
            };
            let mut start = 0;
            while start < numel {
                let len = chunk.min(numel - start);
                let at_chunk = at + start as u64 * size;
                items.push(Item {
                    index,
                    at: at_chunk,
                    part,
                    tensor,
                    start,
                    len,
                });
                start += len;
            }
            at += numel as u64 * size;
        }
    }
    Ok(items)
}

/// The buffers one chunk goes through, kept from chunk to chunk.
#[derive(Default)]
struct Buffers {
    bytes: Vec<u8>,
    values: Vec<f32>,
    out: Vec<u8>,
}

/// What an expert does to its MLP weights (mergekit's `noise_scale`, `residual_scale`).
#[derive(Clone, Copy, Default)]
struct Adjust {
    /// σ of the normal noise added, and the key of its stream.
    noise: Option<(f32, u64)>,
    /// The factor on a `down_proj`.
    scale: Option<f32>,
}

/// The noise stream of expert `k` in output tensor `name`.
fn noise_key(seed: u64, name: &str, k: usize) -> u64 {
    let [a, b] = crate::hash::hash_key(seed, name, k);
    crate::hash::splitmix64(u64::from(a) << 32 | u64::from(b))
}

/// One input tensor as a part of an output tensor.
struct Source<'a> {
    model: &'a ModelFolder,
    tensor: &'a ModelTensor,
    name: &'a str,
    adjust: Adjust,
    allow_nonfinite: bool,
}

impl Source<'_> {
    /// Elements `start..start + len` of the tensor in `dtype`: its bytes as read, where they
    /// need no change, else converted into `io.out`.
    fn chunk<'b>(
        &self,
        (start, len): (usize, usize),
        dtype: DType,
        io: &'b mut Buffers,
    ) -> Result<&'b [u8]> {
        let (model, t) = (self.model, self.tensor);
        let lora = model.lora_for(self.name);
        let src = t.entry.dtype;
        let plain = lora.is_none() && self.adjust.noise.is_none() && self.adjust.scale.is_none();
        let offset = (start * src.size()) as u64;
        io.bytes.resize(len * src.size(), 0);
        model
            .read(t, offset, &mut io.bytes)
            .with_context(|| format!("cannot read '{}' of {}", self.name, model.dir.display()))?;
        model.record_read(t, offset, &io.bytes);
        if !self.allow_nonfinite {
            if let Some(k) = first_nonfinite(src, &io.bytes) {
                bail!(
                    "tensor '{}' of {} holds a NaN or ±Inf at element {} (--allow-nonfinite \
                     copies it)",
                    crate::escape::terminal(self.name),
                    model.file_holding(t, (start + k) as u64).display(),
                    start + k
                );
            }
        }
        if plain && src == dtype {
            return Ok(&io.bytes);
        }
        self.convert((src, dtype), start, io, lora)?;
        Ok(&io.out)
    }

    /// `io.bytes` (elements `start..` in `src`) into `io.out` in `dtype`: decoded, the LoRA
    /// update added, adjusted, encoded — on every worker, a span at a time.
    fn convert(
        &self,
        (src, dtype): (DType, DType),
        start: usize,
        io: &mut Buffers,
        lora: Option<&crate::checkpoint::lora::LoraAdapter>,
    ) -> Result<()> {
        let len = io.bytes.len() / src.size();
        io.values.resize(len, 0.0);
        io.out.resize(len * dtype.size(), 0);
        io.values
            .par_chunks_mut(SPAN)
            .zip(io.bytes.par_chunks(SPAN * src.size()))
            .for_each(|(v, b)| decode(src, b, v));
        // A LoRA expert's values are its merged f32 weights: its adjustments round to f32.
        let rounding = match lora {
            Some(l) => {
                let shape = &self.tensor.entry.shape;
                l.add_update(self.name, shape, start as u64, &mut io.values)?;
                if let Some(k) = io.values.iter().position(|v| !v.is_finite()) {
                    if !self.allow_nonfinite {
                        return Err(l.nonfinite_error(self.name, (start + k) as u64, io.values[k]));
                    }
                }
                DType::F32
            }
            None => src,
        };
        let adjust = self.adjust;
        io.values
            .par_chunks_mut(SPAN)
            .zip(io.out.par_chunks_mut(SPAN * dtype.size()))
            .enumerate()
            .for_each(|(c, (v, out))| {
                adjust.apply(v, (start + c * SPAN) as u64, rounding);
                encode(dtype, v, out);
            });
        if !self.allow_nonfinite {
            if let Some(k) = first_nonfinite(dtype, &io.out) {
                bail!(
                    "tensor '{}' of {} becomes {} at element {} in the output dtype {dtype}: the \
                     expert's residual_scale or noise_scale overflows it",
                    crate::escape::terminal(self.name),
                    self.model.dir.display(),
                    crate::checkpoint::dtype::decode_one(dtype, &io.out, k),
                    start + k
                );
            }
        }
        Ok(())
    }
}

impl Adjust {
    /// Noise then scale on values `v` (elements `first..` of the tensor), each step rounded to
    /// `dtype`: x + σ·n, then times the factor.
    fn apply(&self, v: &mut [f32], first: u64, dtype: DType) {
        if let Some((sigma, key)) = self.noise {
            let mut noise: Vec<f32> = (0..v.len() as u64)
                .map(|i| crate::hash::normal_at(key, first + i) as f32)
                .collect();
            round_through(dtype, &mut noise);
            noise.iter_mut().for_each(|n| *n *= sigma);
            round_through(dtype, &mut noise);
            v.iter_mut().zip(&noise).for_each(|(x, n)| *x += n);
            round_through(dtype, v);
        }
        if let Some(s) = self.scale {
            v.iter_mut().for_each(|x| *x *= s);
            round_through(dtype, v);
        }
    }
}
