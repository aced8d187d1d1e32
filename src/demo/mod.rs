//! The built-in example: a tiny Qwen2-shaped base model and three RL-like agents whose task vectors
//! are sparse and partly overlapping (densities ≈ 3.2 %, 46.2 %, 54.3 %), written as real Hugging
//! Face folders. Also the generator the tests and benchmarks use for larger synthetic checkpoints.

use crate::checkpoint::output_folder::{replaceable, Identity, DEMO_MANIFEST};
use crate::checkpoint::weight_file::FileChecksum;
use crate::checkpoint::{CheckpointWriter, DType, OutputFolder, OutputTensor};
use crate::error::usage;
use crate::hash::SplitMix64;
use anyhow::{Context, Result};
use std::path::Path;

mod tokenizer;

/// Shape of a synthetic decoder-only transformer.
#[derive(Clone, Debug)]
pub struct ModelShape {
    /// Vocabulary rows of the embeddings and the LM head.
    pub vocab: usize,
    /// Hidden size.
    pub hidden: usize,
    /// MLP intermediate size.
    pub intermediate: usize,
    /// Decoder layers.
    pub layers: usize,
}

impl ModelShape {
    /// The demo's tiny model (~170 k parameters).
    pub fn tiny() -> ModelShape {
        ModelShape {
            vocab: 512,
            hidden: 64,
            intermediate: 176,
            layers: 2,
        }
    }

    /// A shape of at least `bytes` of bf16 weights, not much more: hidden 1024 and vocab 32000
    /// with as many layers as it takes, or for small sizes a narrower model (hidden, vocab and
    /// intermediate halved until one layer fits).
    pub fn of_bf16_bytes(bytes: u64) -> ModelShape {
        let (mut vocab, mut hidden, mut intermediate) = (32000usize, 1024usize, 2816usize);
        let elems = (bytes / 2).max(1) as usize;
        let per_layer = |h: usize, i: usize| 4 * h * h + 3 * h * i + 2 * h;
        let fixed = |v: usize, h: usize| 2 * v * h + h;
        while hidden > 16 && fixed(vocab, hidden) + per_layer(hidden, intermediate) > elems {
            (vocab, hidden, intermediate) = ((vocab / 2).max(64), hidden / 2, intermediate / 2);
        }
        let layers = elems
            .saturating_sub(fixed(vocab, hidden))
            .div_ceil(per_layer(hidden, intermediate))
            .max(1);
        ModelShape {
            vocab,
            hidden,
            intermediate,
            layers,
        }
    }

    /// Bytes of this shape's bf16 weights.
    pub fn bf16_bytes(&self) -> u64 {
        self.tensors()
            .iter()
            .map(|(_, s)| s.iter().product::<usize>() as u64 * 2)
            .sum()
    }

    /// Tensor names and shapes of a Qwen2 model (Hugging Face naming, as mergekit expects them).
    pub fn tensors(&self) -> Vec<(String, Vec<usize>)> {
        let (h, i) = (self.hidden, self.intermediate);
        let mut t = vec![("model.embed_tokens.weight".to_string(), vec![self.vocab, h])];
        for l in 0..self.layers {
            let p = format!("model.layers.{l}");
            for proj in ["q_proj", "k_proj", "v_proj", "o_proj"] {
                t.push((format!("{p}.self_attn.{proj}.weight"), vec![h, h]));
                // Qwen2's attention has biases on q, k and v.
                if proj != "o_proj" {
                    t.push((format!("{p}.self_attn.{proj}.bias"), vec![h]));
                }
            }
            t.push((format!("{p}.mlp.gate_proj.weight"), vec![i, h]));
            t.push((format!("{p}.mlp.up_proj.weight"), vec![i, h]));
            t.push((format!("{p}.mlp.down_proj.weight"), vec![h, i]));
            t.push((format!("{p}.input_layernorm.weight"), vec![h]));
            t.push((format!("{p}.post_attention_layernorm.weight"), vec![h]));
        }
        t.push(("model.norm.weight".to_string(), vec![h]));
        t.push(("lm_head.weight".to_string(), vec![self.vocab, h]));
        t
    }

    fn config_json(&self) -> serde_json::Value {
        serde_json::json!({
            "architectures": ["Qwen2ForCausalLM"],
            "model_type": "qwen2",
            "vocab_size": self.vocab,
            "hidden_size": self.hidden,
            "intermediate_size": self.intermediate,
            "num_hidden_layers": self.layers,
            "num_attention_heads": 4,
            "num_key_value_heads": 4,
            "rms_norm_eps": 1e-6,
            "torch_dtype": "bfloat16",
            "tie_word_embeddings": false
        })
    }
}

/// A base value: norms near 1, weights of magnitude 0.005–0.05, so one bf16 ULP exceeds ε = 1e-5.
fn base_value(name: &str, rng: &mut SplitMix64) -> f32 {
    if name.contains("norm") {
        (1.0 + 0.1 * (rng.next_f64() - 0.5)) as f32
    } else {
        let m = 0.005 + 0.045 * rng.next_f64();
        (if rng.next_u64() & 1 == 0 { m } else { -m }) as f32
    }
}

/// The base's bf16 bits for every element of tensor `index` (deterministic per seed and tensor).
fn base_bits(seed: u64, index: usize, name: &str, numel: usize) -> Vec<u16> {
    let mut rng = SplitMix64::new(seed ^ (index as u64).wrapping_mul(0x2545_f491_4f6c_dd1d));
    (0..numel)
        .map(|_| half::bf16::from_f32(base_value(name, &mut rng)).to_bits())
        .collect()
}

/// Writes one bf16 model folder at `dir`, through an [`OutputFolder`] so that a killed demo
/// leaves no partial file: an existing folder is replaced only when a demo wrote it (its manifest
/// lists every file in it). `agent = Some((seed, density))` moves that fraction of elements by
/// ±1–4 bf16 ULPs (an RL-like sparse task vector), `None` writes the base.
fn write_model(
    dir: &Path,
    shape: &ModelShape,
    seed: u64,
    agent: Option<(u64, f64)>,
    shard_size: u64,
) -> Result<()> {
    let folder = OutputFolder::create(dir, true, &[])
        .with_context(|| format!("demo: cannot write {}", dir.display()))?;
    let tmp = folder.path();
    let tensors: Vec<OutputTensor> = shape
        .tensors()
        .into_iter()
        .map(|(name, shape)| OutputTensor {
            name: name.into(),
            dtype: DType::BF16,
            shape: shape.into(),
        })
        .collect();
    let mut writer = CheckpointWriter::new(tmp, tensors.clone(), shard_size)?;
    let mut rng = agent.map(|(s, _)| SplitMix64::new(s));
    let mut bytes = Vec::new();
    for (i, t) in tensors.iter().enumerate() {
        let numel: usize = t.shape.iter().product();
        let mut bits = base_bits(seed, i, &t.name, numel);
        if let (Some(rng), Some((_, density))) = (rng.as_mut(), agent) {
            for b in bits.iter_mut() {
                if rng.next_f64() < density {
                    let step = 1 + (rng.next_u64() % 4) as u16;
                    *b = if rng.next_u64() & 1 == 0 {
                        *b + step
                    } else {
                        *b - step
                    };
                }
            }
        }
        bytes.clear();
        bytes.extend(bits.iter().flat_map(|b| b.to_le_bytes()));
        writer.write(&t.name, &bytes)?;
    }
    // Each file with its size and CRC-32: `--force` replaces only files that are still these.
    let mut files: Vec<FileChecksum> = writer.finish()?;
    let write_json = |files: &mut Vec<FileChecksum>, name: &str, v: serde_json::Value| {
        let p = tmp.join(name);
        let text = serde_json::to_string_pretty(&v)? + "\n";
        std::fs::write(&p, &text).with_context(|| format!("cannot write {}", p.display()))?;
        files.push(FileChecksum {
            file: name.to_string(),
            size: text.len() as u64,
            crc32: format!("{:08x}", crc32fast::hash(text.as_bytes())),
        });
        Result::<()>::Ok(())
    };
    write_json(&mut files, "config.json", shape.config_json())?;
    write_json(
        &mut files,
        "generation_config.json",
        serde_json::json!({"bos_token_id": 1, "eos_token_id": 2, "do_sample": false}),
    )?;
    write_json(
        &mut files,
        "tokenizer_config.json",
        serde_json::json!({"model_max_length": 2048, "tokenizer_class": "PreTrainedTokenizerFast",
                           "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}),
    )?;
    write_json(
        &mut files,
        "tokenizer.json",
        tokenizer::tokenizer_json(shape.vocab),
    )?;
    let manifest = serde_json::json!({ "written_by": "rlmerge demo", "files": files });
    write_json(&mut files, DEMO_MANIFEST, manifest)?;
    folder.commit()
}

/// Refuses, as a usage error, to write the demo over `path` unless it is absent or a folder a
/// demo (or a merge) wrote and nobody added to ([`replaceable`]).
pub fn check_replaceable(path: &Path) -> Result<()> {
    if path.symlink_metadata().is_err() {
        return Ok(());
    }
    replaceable(path, Identity::Checksums).map_err(|why| {
        usage(format!(
            "demo: {} exists and will not be replaced: {why}; choose another folder",
            path.display()
        ))
    })
}

/// The demo's agents: folder name, seed, density.
pub const DEMO_AGENTS: [(&str, u64, f64); 3] = [
    ("coding-agent", 11, 0.032),
    ("tool-agent", 22, 0.462),
    ("memory-agent", 33, 0.543),
];

/// The demo's mergekit recipe, written beside its models: `rlmerge run rlmerge-demo/recipe.yml`.
pub const RECIPE_FILE: &str = "recipe.yml";

/// [`RECIPE_FILE`]'s text. Its model paths are the folders beside it (a recipe's paths resolve
/// against the working directory, then the recipe's folder).
const RECIPE: &str = "\
# A mergekit recipe over the demo's models; `rlmerge run recipe.yml -o OUT` (from this folder, or
# with its path) merges them, as mergekit-yaml would.
merge_method: ties
base_model: base
parameters:
  weight: 1.0
  density: 0.5
models:
  - model: coding-agent
  - model: tool-agent
  - model: memory-agent
";

/// The demo's mergekit-moe config, written beside its models: `rlmerge moe rlmerge-demo/moe.yml
/// OUT` builds a Qwen2-MoE of the agents (docs/moe.md).
pub const MOE_FILE: &str = "moe.yml";

/// [`MOE_FILE`]'s text (model paths beside it, as the recipe's).
const MOE: &str = "\
# A mergekit-moe config over the demo's models; `rlmerge moe moe.yml OUT` builds a Qwen2-MoE of
# the agents with the base as its shared expert, as mergekit-moe would.
base_model: base
architecture: qwen
gate_mode: cheap_embed
experts_per_token: 1
shared_experts:
  - source_model: base
    positive_prompts: [\"hello\"]
experts:
  - source_model: coding-agent
    positive_prompts: [\"write a python function\", \"fix this bug\"]
  - source_model: tool-agent
    positive_prompts: [\"call the search tool with JSON arguments\"]
";

/// Writes `dir/base`, one folder per agent, the recipe [`RECIPE_FILE`] and the MoE config
/// [`MOE_FILE`]. One agent is sharded so both layouts are exercised.
/// Folders a demo wrote before are replaced; any other existing folder of those names is refused
/// before anything is written. Returns (base dir, agent dirs).
pub fn write_example(
    dir: &Path,
    shape: &ModelShape,
    seed: u64,
) -> Result<(std::path::PathBuf, Vec<std::path::PathBuf>)> {
    let base = dir.join("base");
    let total = shape.bf16_bytes();
    for d in std::iter::once("base").chain(DEMO_AGENTS.iter().map(|a| a.0)) {
        check_replaceable(&dir.join(d))?;
    }
    // The recipe and MoE config beside them are replaced only where they are the demo's own (the
    // same text): a user's file, a link or a FIFO of that name is refused before anything is
    // written.
    for (name, text) in [(RECIPE_FILE, RECIPE), (MOE_FILE, MOE)] {
        let path = dir.join(name);
        if let Ok(m) = path.symlink_metadata() {
            let ours = m.is_file() && std::fs::read(&path).is_ok_and(|b| b == text.as_bytes());
            if !ours {
                return Err(usage(format!(
                    "demo: {} exists and is not the demo's; it will not be replaced: choose \
                     another folder",
                    path.display()
                )));
            }
        }
    }
    write_model(&base, shape, seed, None, u64::MAX)?;
    let mut agents = Vec::new();
    for (name, agent_seed, density) in DEMO_AGENTS {
        let p = dir.join(name);
        // The memory agent is written in two shards, with an index.
        let shard = if name == "memory-agent" {
            total / 2 + 1
        } else {
            u64::MAX
        };
        write_model(&p, shape, seed, Some((seed ^ agent_seed, density)), shard)?;
        agents.push(p);
    }
    crate::checkpoint::output_folder::write_files(
        dir,
        &[
            (RECIPE_FILE, RECIPE.as_bytes().to_vec()),
            (MOE_FILE, MOE.as_bytes().to_vec()),
        ],
        &[],
    )?;
    Ok((base, agents))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn synthetic_sizes_are_at_least_and_near_what_was_asked() {
        for bytes in [1u64 << 20, 64 << 20, 200 << 20, 1 << 30] {
            let got = ModelShape::of_bf16_bytes(bytes).bf16_bytes();
            assert!(
                got >= bytes && got < bytes + bytes / 2 + (1 << 20),
                "{bytes} → {got}"
            );
        }
    }
}
