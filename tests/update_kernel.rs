//! The update kernel (shaders/update.wgsl, `Backend::add_update`): θ₀ + Δ in f32, encoded once —
//! the last step of every host-computed update (Iso-C, TSV-M, ResMerge, SVC). The CPU twin
//! against an independent reference (the `half` crate's round-to-nearest-even conversions), and
//! the GPU (lavapipe in CI) against the CPU byte for byte: every input and output dtype, odd
//! lengths, chunks cut mid-tile, infinities, and the CPU route for tiny values on adapters that
//! flush subnormals.

mod common;
use half::{bf16, f16};
use rlmerge::backend::gpu::{AdapterChoice, GpuBackend, GpuContext};
use rlmerge::backend::{cpu::CpuBackend, Backend, Tile};
use rlmerge::checkpoint::DType;

fn encode(dtype: DType, v: f32) -> Vec<u8> {
    match dtype {
        DType::BF16 => bf16::from_f32(v).to_le_bytes().to_vec(),
        DType::F16 => f16::from_f32(v).to_le_bytes().to_vec(),
        DType::F32 => v.to_le_bytes().to_vec(),
    }
}

fn decode(dtype: DType, b: &[u8]) -> f32 {
    match dtype {
        DType::BF16 => bf16::from_le_bytes([b[0], b[1]]).to_f32(),
        DType::F16 => f16::from_le_bytes([b[0], b[1]]).to_f32(),
        DType::F32 => f32::from_le_bytes([b[0], b[1], b[2], b[3]]),
    }
}

/// A base of `len` values of `dtype` and an update: values of every sign and a wide range of
/// magnitudes, a few ±Inf sums.
fn case(dtype: DType, len: usize, seed: u64) -> (Vec<u8>, Vec<f32>) {
    let mut rng = common::Rng(seed);
    let mut base = Vec::new();
    let mut update = Vec::new();
    for i in 0..len {
        let b = (rng.f32() - 0.5) * 8.0;
        base.extend(encode(dtype, b));
        let scale = [1e-6, 1e-3, 1.0, 1e3][i % 4];
        update.push(if i % 997 == 5 {
            f32::INFINITY
        } else {
            (rng.f32() - 0.5) * scale
        });
    }
    (base, update)
}

const DTYPES: [DType; 3] = [DType::BF16, DType::F16, DType::F32];

/// The CPU twin is the definition: each element decoded, plus Δ in f32, encoded with ties to
/// even.
#[test]
fn the_cpu_update_is_base_plus_delta_rounded_once() {
    let cpu = CpuBackend::new(2).unwrap();
    for dtype in DTYPES {
        for out_dtype in DTYPES {
            let len = 2501;
            let (base, update) = case(dtype, len, 3);
            let tile = Tile {
                dtype,
                len,
                base: &base,
                agents: &[],
            };
            let mut got = vec![0u8; len * out_dtype.size()];
            cpu.add_update(&tile, &update, out_dtype, &mut got).unwrap();
            let want: Vec<u8> = (0..len)
                .flat_map(|i| {
                    let b = decode(dtype, &base[i * dtype.size()..]);
                    encode(out_dtype, b + update[i])
                })
                .collect();
            assert_eq!(got, want, "{dtype:?} → {out_dtype:?}");
        }
    }
}

fn gpu() -> Option<GpuContext> {
    if !common::gpu_available("the update kernel's GPU test") {
        return None;
    }
    GpuContext::open(AdapterChoice::Any).unwrap()
}

#[test]
fn the_gpu_update_kernel_writes_the_cpus_bytes() {
    let Some(ctx) = gpu() else { return };
    // Chunks of 998 elements: tiles of several chunks, the last one short and odd.
    let gpu = GpuBackend::new(ctx).with_chunk_elems(998);
    let cpu = CpuBackend::new(2).unwrap();
    for dtype in DTYPES {
        for out_dtype in DTYPES {
            for len in [1, 2, 3, 997, 2501] {
                let (base, update) = case(dtype, len, len as u64);
                let tile = Tile {
                    dtype,
                    len,
                    base: &base,
                    agents: &[],
                };
                let mut want = vec![0u8; len * out_dtype.size()];
                let mut got = vec![0u8; len * out_dtype.size()];
                cpu.add_update(&tile, &update, out_dtype, &mut want)
                    .unwrap();
                gpu.add_update(&tile, &update, out_dtype, &mut got).unwrap();
                assert_eq!(got, want, "{dtype:?} → {out_dtype:?}, {len} elements");
            }
        }
    }
    assert_eq!(
        gpu.phase_times().cpu_tiles,
        0,
        "every tile ran on the device"
    );
}

/// On an adapter that flushes subnormals, a tile whose base or update holds a value below 2^-60
/// runs on the CPU kernels (forced here: lavapipe keeps subnormals); the bytes are the CPU's.
#[test]
fn tiny_updates_go_to_the_cpu_where_the_adapter_flushes_subnormals() {
    let Some(ctx) = gpu() else { return };
    let gpu = GpuBackend::new(ctx).assume_flushing_subnormals();
    let cpu = CpuBackend::new(1).unwrap();
    let len = 100;
    let (base, normal) = case(DType::F32, len, 8);
    let mut tiny = normal.clone();
    tiny[40] = f32::from_bits(5);
    for (update, cpu_tiles) in [(&normal, 0), (&tiny, 1)] {
        let tile = Tile {
            dtype: DType::F32,
            len,
            base: &base,
            agents: &[],
        };
        let before = gpu.phase_times().cpu_tiles;
        let (mut want, mut got) = (vec![0u8; len * 4], vec![0u8; len * 4]);
        cpu.add_update(&tile, update, DType::F32, &mut want)
            .unwrap();
        gpu.add_update(&tile, update, DType::F32, &mut got).unwrap();
        assert_eq!(gpu.phase_times().cpu_tiles - before, cpu_tiles);
        assert_eq!(got, want);
    }
}
