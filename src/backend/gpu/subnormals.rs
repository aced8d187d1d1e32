//! Adapters that flush subnormal floats, and the tiles they must not compute.
//!
//! WGSL lets an implementation flush subnormal f32 values to zero in arithmetic. lavapipe keeps
//! them; NVIDIA's Vulkan driver (580, H200) flushes them: there, with `--epsilon 0`, an agent's
//! subnormal change read as "no change" and RAM's shared mean divided by one agent fewer. So
//! [`GpuBackend::new`] asks the adapter once, with a probe of two subnormal changes, and on an
//! adapter that flushes, every tile holding a tiny value is computed by the CPU kernels instead —
//! the output bytes stay the CPU backend's whatever the adapter does.
//!
//! "Tiny" is a nonzero magnitude below 2^-60, far above the subnormal range: a flush can only
//! bite where an input, a difference of inputs or a product of one with a method's weights goes
//! below 2^-126. Inputs of magnitude 2^-60 or more differ by multiples of 2^-83 at least, and stay
//! normal through weights down to 2^-40 (about 1e-12). Real weights this small are rare, so the
//! GPU keeps nearly every tile.

use super::GpuBackend;
use crate::backend::Tile;
use crate::checkpoint::DType;

/// Bits of 2^-60 in f32 and bf16: magnitudes below these (and above zero) are tiny.
const TINY_F32: u32 = (127 - 60) << 23;
const TINY_BF16: u16 = ((127 - 60) << 7) as u16;

/// Whether any input of the tile (base or agent) is nonzero with magnitude below 2^-60. f16 holds
/// no such value (its smallest is 2^-24).
pub(super) fn holds_tiny_values(tile: &Tile) -> bool {
    let inputs = std::iter::once(tile.base).chain(tile.agents.iter().copied());
    match tile.dtype {
        DType::F16 => false,
        DType::BF16 => inputs.into_iter().any(|bytes| {
            bytes.chunks_exact(2).any(|b| {
                let m = u16::from_le_bytes([b[0], b[1]]) & 0x7fff;
                m != 0 && m < TINY_BF16
            })
        }),
        DType::F32 => inputs.into_iter().any(|bytes| {
            bytes.chunks_exact(4).any(|b| {
                let m = u32::from_le_bytes([b[0], b[1], b[2], b[3]]) & 0x7fff_ffff;
                m != 0 && m < TINY_F32
            })
        }),
    }
}

/// Whether any of `values` (a host-computed update) is nonzero with magnitude below 2^-60.
pub(super) fn holds_tiny_f32(values: &[f32]) -> bool {
    values.iter().any(|v| {
        let m = v.to_bits() & 0x7fff_ffff;
        m != 0 && m < TINY_F32
    })
}

/// Asks the adapter whether it flushes subnormals: a probe (ε = 0) of one agent that changes two
/// elements by a subnormal amount — from 0 to the smallest subnormal, and from the smallest normal
/// to the next float up. IEEE arithmetic counts both; a flushing adapter misses at least one. A
/// probe that fails counts as flushing (the merge will meet the same failure and report it).
pub(super) fn adapter_flushes(gpu: &GpuBackend) -> bool {
    let base = [0.0f32, f32::MIN_POSITIVE];
    let agent = [
        f32::from_bits(1),
        f32::from_bits(f32::MIN_POSITIVE.to_bits() + 1),
    ];
    let bytes = |v: &[f32]| -> Vec<u8> { v.iter().flat_map(|x| x.to_le_bytes()).collect() };
    let (base, agent) = (bytes(&base), bytes(&agent));
    let agents = [agent.as_slice()];
    let tile = Tile {
        dtype: DType::F32,
        len: 2,
        base: &base,
        agents: &agents,
    };
    gpu.probe_on_device(&tile, 0.0)
        .map_or(true, |counts| counts.row(0)[0] != 2)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tile_of(dtype: DType, bytes: &[u8]) -> bool {
        let agents = [bytes];
        let len = bytes.len() / dtype.size();
        holds_tiny_values(&Tile {
            dtype,
            len,
            base: &vec![0u8; bytes.len()],
            agents: &agents,
        })
    }

    #[test]
    fn tiny_means_nonzero_below_two_to_the_minus_60_in_every_dtype() {
        let f32s = |v: &[f32]| -> Vec<u8> { v.iter().flat_map(|x| x.to_le_bytes()).collect() };
        let bf16s = |v: &[f32]| -> Vec<u8> {
            v.iter()
                .flat_map(|x| half::bf16::from_f32(*x).to_le_bytes())
                .collect()
        };
        let edge = 2f32.powi(-60);
        for (v, tiny) in [
            (vec![0.0, -0.0, 1.0, edge, -edge], false),
            (vec![1.0, f32::from_bits(1 << 16)], true),
            (vec![-f32::MIN_POSITIVE], true),
            (vec![edge * 0.75], true),
            (vec![f32::NAN, f32::INFINITY], false),
        ] {
            assert_eq!(tile_of(DType::F32, &f32s(&v)), tiny, "f32 {v:?}");
            assert_eq!(tile_of(DType::BF16, &bf16s(&v)), tiny, "bf16 {v:?}");
        }
        let f16s: Vec<u8> = [half::f16::from_bits(1), half::f16::MIN_POSITIVE]
            .iter()
            .flat_map(|x| x.to_le_bytes())
            .collect();
        assert!(!tile_of(DType::F16, &f16s));
    }
}
