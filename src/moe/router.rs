//! The routers of a MoE (`mlp.gate.weight`, one row per expert; Qwen2-MoE's
//! `mlp.shared_expert_gate.weight` too), as mergekit-moe makes them without a forward pass:
//!
//! - `cheap_embed`: for each expert, the sum in f32 of its positive prompts' token embeddings
//!   (each prompt's tokens in order, then the prompts in order), divided by its norm (at least
//!   10⁻⁸); the same of its negative prompts subtracted; the difference divided by its norm.
//!   The same rows for every layer. Only the rows of the prompts' tokens are read.
//! - `random`: standard normal values; `uniform_random`: uniform in ±1/√hidden — from the seed,
//!   a row per expert and layer, the same for any thread count.
//!
//! Router rows that are nearly linearly dependent (condition number above 5, as mergekit warns)
//! route tokens to a few experts only: their layers are named.

use super::config::{Expert, GateMode, MoeConfig};
use crate::checkpoint::dtype::decode;
use crate::checkpoint::{ModelFolder, ModelTensor};
use crate::vocabulary::PromptTokenizer;
use anyhow::{bail, Context, Result};

/// The router rows of every layer: `experts` (E × hidden, row-major) and `shared` (S × hidden).
pub struct Routers {
    pub experts: Vec<Vec<f32>>,
    pub shared: Vec<Vec<f32>>,
    /// Layers whose rows are nearly dependent (condition number > [`DEGENERATE`]).
    pub degenerate: Vec<usize>,
}

/// mergekit's threshold on the router rows' condition number.
const DEGENERATE: f64 = 5.0;

/// The routers of `config` for `layers` layers of width `hidden`, from `base`.
pub fn routers(
    config: &MoeConfig,
    base: &ModelFolder,
    (layers, hidden): (usize, usize),
) -> Result<Routers> {
    let shared = &config.shared_experts;
    // Rows nearly linearly dependent: one expert's router is the others' mix.
    let degenerate_rows = |e: &[f32], s: &[f32]| -> Result<bool> {
        let rows: Vec<&[f32]> = e.chunks(hidden).chain(s.chunks(hidden)).collect();
        Ok(condition(&rows)? > DEGENERATE)
    };
    let (experts, shared, degenerate) = match config.gate_mode {
        GateMode::CheapEmbed => {
            let embed = Embeddings::of(base)?;
            let tokenizer = crate::vocabulary::PromptTokenizer::open(&base.dir)?;
            let rows = |list: &[Expert]| -> Result<Vec<f32>> {
                let mut rows = Vec::with_capacity(list.len() * hidden);
                for e in list {
                    rows.extend(embed.gate_row(base, &tokenizer, e)?);
                }
                Ok(rows)
            };
            let (e, s) = (rows(&config.experts)?, rows(shared)?);
            // Every layer's rows are these: judged once.
            let degenerate = match degenerate_rows(&e, &s)? {
                true => (0..layers).collect(),
                false => Vec::new(),
            };
            (vec![e; layers], vec![s; layers], degenerate)
        }
        mode => {
            let key = crate::hash::splitmix64(config.seed);
            let scale = (1.0 / hidden as f64).sqrt();
            let (e, s) = (config.experts.len(), shared.len());
            let row = (e + s) * hidden;
            let draw = |i: usize| -> f32 {
                let i = i as u64;
                match mode {
                    GateMode::UniformRandom => {
                        ((crate::hash::uniform_at(key, i) * 2.0 - 1.0) * scale) as f32
                    }
                    _ => crate::hash::normal_at(key, i) as f32,
                }
            };
            let (mut experts, mut shared, mut degenerate) = (Vec::new(), Vec::new(), Vec::new());
            for l in 0..layers {
                let mut rows: Vec<f32> = (l * row..(l + 1) * row).map(draw).collect();
                let s = rows.split_off(e * hidden);
                if degenerate_rows(&rows, &s)? {
                    degenerate.push(l);
                }
                experts.push(rows);
                shared.push(s);
            }
            (experts, shared, degenerate)
        }
    };
    Ok(Routers {
        experts,
        shared,
        degenerate,
    })
}

/// The condition number of the matrix of `rows` (σ_max / σ_min; infinite where they are
/// dependent), from the eigenvalues of their Gram matrix.
fn condition(rows: &[&[f32]]) -> Result<f64> {
    let n = rows.len();
    if n < 2 {
        return Ok(1.0);
    }
    let gram = crate::linalg::Mat::from_fn(n, n, |i, j| {
        rows[i]
            .iter()
            .zip(rows[j])
            .map(|(&a, &b)| f64::from(a) * f64::from(b))
            .sum()
    });
    let eig = crate::linalg::symmetric_eigen(gram, 1, "the routers' Gram matrix")?;
    let (max, min) = (eig.values[0], eig.values[n - 1]);
    Ok(match min > 0.0 && max > 0.0 {
        true => (max / min).sqrt(),
        false => f64::INFINITY,
    })
}

/// The base's input embeddings, read a row at a time.
struct Embeddings<'a> {
    tensor: &'a ModelTensor,
    rows: usize,
    hidden: usize,
}

impl<'a> Embeddings<'a> {
    /// The base's `model.embed_tokens.weight` (mergekit's name; else a tensor ending in
    /// `embed_tokens.weight`).
    fn of(base: &'a ModelFolder) -> Result<Embeddings<'a>> {
        let tensor = base
            .get("model.embed_tokens.weight")
            .or_else(|| {
                base.tensors
                    .iter()
                    .find(|t| t.entry.name.ends_with("embed_tokens.weight"))
            })
            .with_context(|| {
                format!(
                    "the base {} has no model.embed_tokens.weight, whose rows gate_mode \
                     cheap_embed averages",
                    base.dir.display()
                )
            })?;
        let shape = &tensor.entry.shape;
        if shape.len() != 2 {
            bail!(
                "the base's '{}' is {}, not a matrix of token rows",
                tensor.entry.name,
                crate::checkpoint::weight_file::shape_text(shape)
            );
        }
        Ok(Embeddings {
            tensor,
            rows: shape[0],
            hidden: shape[1],
        })
    }

    /// The sum in f32 of the rows of every token of `prompts` (each prompt's tokens in order,
    /// then the prompts in order), divided by its norm.
    fn normalized_sum(
        &self,
        (base, tokenizer): (&ModelFolder, &PromptTokenizer),
        prompts: &[String],
        who: &Expert,
    ) -> Result<Vec<f32>> {
        let size = self.tensor.entry.dtype.size();
        let (mut bytes, mut row) = (vec![0u8; self.hidden * size], vec![0f32; self.hidden]);
        let mut total = vec![0f32; self.hidden];
        for p in prompts {
            let ids = tokenizer.encode(p)?;
            let mut sum = vec![0f32; self.hidden];
            for id in ids {
                if id as usize >= self.rows {
                    bail!(
                        "the prompt {p:?} of {} has token {id}, past the {} rows of the base's \
                         '{}'",
                        who.reference,
                        self.rows,
                        self.tensor.entry.name
                    );
                }
                let start = (id as usize * self.hidden * size) as u64;
                base.read(self.tensor, start, &mut bytes)?;
                decode(self.tensor.entry.dtype, &bytes, &mut row);
                sum.iter_mut().zip(&row).for_each(|(s, &x)| *s += x);
            }
            total.iter_mut().zip(&sum).for_each(|(t, &s)| *t += s);
        }
        if let Some(i) = total.iter().position(|x| !x.is_finite()) {
            bail!(
                "the prompts of {} sum to a non-finite value at column {i} of the base's '{}' \
                 (a NaN or ±Inf in its rows, or an overflow)",
                who.reference,
                self.tensor.entry.name
            );
        }
        normalize(&mut total);
        Ok(total)
    }

    /// Expert `e`'s router row.
    fn gate_row(
        &self,
        base: &ModelFolder,
        tokenizer: &PromptTokenizer,
        e: &Expert,
    ) -> Result<Vec<f32>> {
        let mut row = self.normalized_sum((base, tokenizer), &e.positive_prompts, e)?;
        if !e.negative_prompts.is_empty() {
            let negative = self.normalized_sum((base, tokenizer), &e.negative_prompts, e)?;
            row.iter_mut().zip(&negative).for_each(|(r, &n)| *r -= n);
        }
        normalize(&mut row);
        Ok(row)
    }
}

/// `v` divided by its Euclidean norm (at least 10⁻⁸), in f32 (the norm summed in f64).
fn normalize(v: &mut [f32]) {
    let norm = v
        .iter()
        .map(|&x| f64::from(x) * f64::from(x))
        .sum::<f64>()
        .sqrt() as f32;
    let norm = norm.max(1e-8);
    v.iter_mut().for_each(|x| *x /= norm);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn normalize_divides_by_the_norm_and_leaves_zero_at_zero() {
        let mut v = [3.0f32, 4.0];
        normalize(&mut v);
        assert_eq!(v, [0.6, 0.8]);
        let mut z = [0.0f32; 3];
        normalize(&mut z);
        assert_eq!(z, [0.0; 3]);
    }

    #[test]
    fn dependent_rows_have_an_infinite_or_large_condition() {
        let a = [1.0f32, 0.0, 0.0];
        let b = [0.0f32, 1.0, 0.0];
        assert!((condition(&[&a, &b]).unwrap() - 1.0).abs() < 1e-9);
        let c = [1.0f32, 0.01, 0.0];
        assert!(condition(&[&a, &c]).unwrap() > DEGENERATE);
    }
}
