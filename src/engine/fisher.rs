//! Fisher merging's second input: each merged model's diagonal Fisher, read tile by tile.

use crate::checkpoint::dtype::decode;
use crate::checkpoint::ModelFolder;
use crate::inputs::{Inputs, TensorPlan};
use crate::method::combine::{fisher_coefs, CombineSpec};
use crate::method::MethodConfig;
use anyhow::{Context, Result};

/// Fisher merging's second input: each merged model's diagonal Fisher, a folder of safetensors
/// with the model's tensor names and shapes (any of bf16, f16, f32).
pub(super) struct FisherInputs {
    pub(super) folders: Vec<ModelFolder>,
}

impl FisherInputs {
    /// Opens every model's Fisher folder and checks it has each tensor that model merges.
    pub(super) fn open(config: &MethodConfig, inputs: &Inputs) -> Result<FisherInputs> {
        let folders = config
            .fisher_folders(inputs.agents.len())?
            .iter()
            .map(|d| ModelFolder::open(d).context("cannot open a Fisher folder"))
            .collect::<Result<Vec<_>>>()?;
        for plan in &inputs.tensors {
            for t in plan.present() {
                plan.in_companion(&folders[t], "Fisher folder")
                    .with_context(|| format!("model {}", t + 1))?;
            }
        }
        Ok(FisherInputs { folders })
    }

    /// The coefficient rows of elements `start..start + len` of `plan` (see
    /// [`crate::method::combine::fisher_coefs`]); λ is the spec's tensor row.
    pub(super) fn tile_coefs(
        &self,
        plan: &TensorPlan,
        present: &[usize],
        spec: &CombineSpec,
        (start, len): (u64, usize),
        out: &mut Vec<f32>,
    ) -> Result<()> {
        let fisher = present
            .iter()
            .map(|&t| {
                let f = &self.folders[t];
                let ft = f.get(plan.name()).expect("checked at open");
                let size = ft.entry.dtype.size();
                let mut bytes = vec![0u8; len * size];
                f.read(ft, start * size as u64, &mut bytes)?;
                let mut values = vec![0.0f32; len];
                decode(ft.entry.dtype, &bytes, &mut values);
                Ok(values)
            })
            .collect::<Result<Vec<_>>>()?;
        let lambdas: Vec<f64> = spec.coefs[1..=present.len()]
            .iter()
            .map(|&l| l as f64)
            .collect();
        fisher_coefs(&lambdas, &fisher, len, out);
        Ok(())
    }
}
