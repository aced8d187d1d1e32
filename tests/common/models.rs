//! Small models several test files share.

use super::{fixture, Fixture};
use safetensors::tensor::Dtype;

/// Two projection matrices and a norm in bf16, with sparse agents (densities 0.1–0.2): a small
/// model every method has work in, the spectral ones included.
pub fn matrices(seed: u64) -> Fixture {
    fixture(
        seed,
        Dtype::BF16,
        &[
            ("model.layers.0.self_attn.q_proj.weight", vec![24, 16]),
            ("model.layers.0.mlp.up_proj.weight", vec![32, 16]),
            ("model.norm.weight", vec![16]),
        ],
        &[0.1, 0.15, 0.2],
        1,
    )
}

/// Two f32 matrices of other shapes and a vector, with denser agents (0.3–0.7): the spectral
/// methods' test model, where a decomposition has directions to keep and drop.
pub fn f32_matrices(seed: u64) -> Fixture {
    fixture(
        seed,
        Dtype::F32,
        &[
            ("layers.0.w", vec![24, 40]),
            ("layers.0.v", vec![40, 16]),
            ("layers.0.b", vec![40]),
        ],
        &[0.3, 0.5, 0.7],
        1,
    )
}
