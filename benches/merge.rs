//! Merge throughput in bytes of bf16 input per second, for each backend: the tile kernels alone,
//! and the whole engine (read, probe, merge, write) on a synthetic base + 3 RL-like agents.
//!
//! `cargo bench --bench merge`. `RLMERGE_BENCH_MODEL_MB` sets the end-to-end model size (default
//! 256). The GPU groups run where wgpu finds an adapter (lavapipe included) and print where the
//! GPU backend's time went per chunk (upload, submit, wait, readback). `host_device_copy` prints
//! the adapter's copy limit through wgpu alone — 64 MiB written to a device buffer (queue write
//! and submit) and read back (copy to a mappable buffer, map, copy out) — the ceiling of any kernel
//! that moves its inputs to the device and its result back.

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use rlmerge::backend::cpu::CpuBackend;
use rlmerge::backend::gpu::{AdapterChoice, GpuBackend, GpuContext};
use rlmerge::backend::{Backend, MergeParams, Tile};
use rlmerge::checkpoint::DType;
use rlmerge::demo::{self, ModelShape};
use rlmerge::engine::{self, MergeOptions};
use rlmerge::hash::SplitMix64;
use rlmerge::inputs::Inputs;
use rlmerge::method::settings::{Scalar, Setting};
use rlmerge::method::SharedRule;
use rlmerge::method::{Kind, Method, MethodConfig, DEFAULT_EPSILON};

/// A bf16 base tile and 3 agents changing 3 %, 46 %, 54 % of its elements.
fn tile_data(len: usize) -> (Vec<u8>, Vec<Vec<u8>>) {
    let mut rng = SplitMix64::new(7);
    let base: Vec<u16> = (0..len)
        .map(|_| half::bf16::from_f32((rng.next_f64() as f32 - 0.5) * 0.1).to_bits() | 0x0080)
        .collect();
    let agents = [0.032, 0.462, 0.543]
        .iter()
        .map(|&d| {
            base.iter()
                .flat_map(|&b| (if rng.next_f64() < d { b + 2 } else { b }).to_le_bytes())
                .collect()
        })
        .collect();
    (base.iter().flat_map(|b| b.to_le_bytes()).collect(), agents)
}

enum Bench {
    Cpu(CpuBackend),
    Gpu(Box<GpuBackend>),
}

impl Bench {
    fn backend(&self) -> &dyn Backend {
        match self {
            Bench::Cpu(b) => b,
            Bench::Gpu(b) => b.as_ref(),
        }
    }

    /// Where the GPU backend's time went, per chunk.
    fn report_phases(&self, name: &str) {
        if let Bench::Gpu(gpu) = self {
            let t = gpu.phase_times();
            if t.chunks == 0 {
                return; // its benchmarks were filtered out
            }
            let per = |d: std::time::Duration| d.as_secs_f64() * 1e3 / t.chunks.max(1) as f64;
            eprintln!(
                "{name}: {} chunks; per chunk upload {:.2} ms, submit {:.2} ms, wait {:.2} ms, readback {:.2} ms",
                t.chunks,
                per(t.upload),
                per(t.submit),
                per(t.wait),
                per(t.readback)
            );
        }
    }
}

fn backends() -> Vec<(&'static str, Bench)> {
    let mut v = vec![("cpu", Bench::Cpu(CpuBackend::new(0).unwrap()))];
    match GpuContext::open(AdapterChoice::Any) {
        Ok(Some(ctx)) => {
            eprintln!("gpu backend: {}", ctx.describe());
            v.push(("gpu", Bench::Gpu(Box::new(GpuBackend::new(ctx)))));
        }
        _ => eprintln!("no GPU adapter: GPU benchmarks skipped"),
    }
    v
}

fn kernels(c: &mut Criterion) {
    // One large tile: each backend's own tiling is measured end to end below.
    let len = 4 << 20;
    let (base, agents) = tile_data(len);
    let slices: Vec<&[u8]> = agents.iter().map(|a| a.as_slice()).collect();
    let tile = Tile {
        dtype: DType::BF16,
        len,
        base: &base,
        agents: &slices,
    };
    let mut out = vec![0u8; len * 2];
    let mut g = c.benchmark_group("tile_bf16_3_agents");
    g.throughput(Throughput::Bytes((len * 2 * 4) as u64));
    for (name, bench) in backends() {
        let backend = bench.backend();
        g.bench_function(format!("{name}/probe"), |b| {
            b.iter(|| backend.probe(&tile, DEFAULT_EPSILON).unwrap())
        });
        for (method, lambdas) in [
            ("merge_ram", [1.0f32; 3]),
            ("merge_ram_plus", [1.2, 1.1257, 1.0919]),
        ] {
            let params = MergeParams {
                epsilon: DEFAULT_EPSILON,
                lambdas: &lambdas,
                out_dtype: DType::BF16,
                shared: SharedRule::Mean,
            };
            g.bench_function(format!("{name}/{method}"), |b| {
                b.iter(|| backend.merge(&tile, &params, &mut out).unwrap())
            });
            if method == "merge_ram" {
                // Plain RAM's merge with its counts (the overlap figure, no probe pass).
                g.bench_function(format!("{name}/merge_ram_counted"), |b| {
                    b.iter(|| backend.merge_counted(&tile, &params, &mut out).unwrap())
                });
            }
        }
        bench.report_phases(name);
    }
    g.finish();
}

fn end_to_end(c: &mut Criterion) {
    let mb: u64 = std::env::var("RLMERGE_BENCH_MODEL_MB")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(256);
    let dir = tempfile::tempdir().unwrap();
    let (base, agents) =
        demo::write_example(dir.path(), &ModelShape::of_bf16_bytes(mb << 20), 1).unwrap();
    let inputs = Inputs::open(&base, &agents).unwrap();
    let mut g = c.benchmark_group("end_to_end_bf16_3_agents");
    g.sample_size(10);
    g.throughput(Throughput::Bytes(inputs.pass_bytes()));
    let plus = Method::default_ram_plus();
    for (name, bench) in backends() {
        let backend = bench.backend();
        let methods = [
            (
                "ram",
                Method::Ram {
                    shared: SharedRule::Mean,
                },
            ),
            ("ram_plus_global", plus.clone()),
            (
                "task_arithmetic",
                mergekit(Kind::TaskArithmetic, &[("weight", 0.5)]),
            ),
            (
                "ties",
                mergekit(Kind::Ties, &[("weight", 1.0), ("density", 0.5)]),
            ),
            (
                "dare_ties",
                mergekit(Kind::DareTies, &[("weight", 1.0), ("density", 0.5)]),
            ),
        ];
        for (method_name, method) in methods {
            let mut options = MergeOptions::new(rlmerge::method::Merging::of(method), backend);
            options.force = true;
            let out = dir.path().join(format!("{name}-{method_name}"));
            g.bench_function(format!("{name}/{method_name}"), |b| {
                b.iter(|| engine::merge(&inputs, &options, backend, &out).unwrap())
            });
        }
    }
    g.finish();
}

/// A mergekit-family method with the same parameters for every model.
fn mergekit(kind: Kind, params: &[(&str, f64)]) -> Method {
    Method::Combine(MethodConfig {
        kind,
        parameters: params
            .iter()
            .map(|&(k, v)| (k.to_string(), Setting::Scalar(Scalar::Number(v))))
            .collect(),
        models: vec![Default::default(); 3],
        seed: 0,
        with_base: true,
        slices: Vec::new(),
    })
}

/// Host→device and device→host copy rate through wgpu, without any kernel: the library's own
/// measurement (`GpuContext::copy_rates`, which `rlmerge devices --copy-rate` prints), on 64 MiB.
fn host_device_copy(_: &mut Criterion) {
    let Ok(Some(ctx)) = GpuContext::open(AdapterChoice::Any) else {
        eprintln!("no GPU adapter: copy benchmark skipped");
        return;
    };
    let (up, down) = ctx.copy_rates(64 << 20, 5).expect("the copy measurement");
    eprintln!(
        "host_device_copy on {}: {:.2} GB/s host to device, {:.2} GB/s device to host (best of 5)",
        ctx.describe(),
        up / 1e9,
        down / 1e9
    );
}

criterion_group!(benches, kernels, end_to_end, host_device_copy);
criterion_main!(benches);
