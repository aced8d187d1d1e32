//! The GPU backend (lavapipe in CI) against the CPU backend, byte for byte, through the CLI.
//!
//! Without a GPU adapter these tests say so and pass, unless RLMERGE_REQUIRE_GPU is set (CI sets
//! it after installing lavapipe), where a missing adapter fails them.

mod common;
use common::*;
use rlmerge::method::SharedRule;
use safetensors::tensor::Dtype;

const VARIANTS: [&[&str]; 8] = [
    &["--method", "ram"],
    &["--method", "ram+"],
    &["--method", "ram+", "--rule", "official"],
    &["--method", "ram+", "--scope", "tensor"],
    &["--method", "ram", "--shared", "consensus"],
    &[
        "--method",
        "ram+",
        "--scope",
        "tensor",
        "--shared",
        "consensus",
    ],
    &["--method", "ram+", "--scope", "layer"],
    &[
        "--method", "ram+", "--scope", "module", "--rule", "official",
    ],
];

#[test]
fn gpu_equals_cpu_for_every_dtype_variant_and_agent_count() {
    if !gpu_available("this GPU parity test") {
        return;
    }
    for (d, dtype) in [Dtype::BF16, Dtype::F16, Dtype::F32]
        .into_iter()
        .enumerate()
    {
        for n in 1..=8 {
            let f = fixture(
                500 + 10 * d as u64 + n as u64,
                dtype,
                &odd_shapes(),
                &DENSITIES[..n],
                1 + n % 2,
            );
            for (v, args) in VARIANTS.iter().enumerate() {
                assert_same(&f, &format!("v{v}"), args, &[]);
            }
        }
    }
}

#[test]
fn gpu_probe_counts_equal_cpu() {
    if !gpu_available("this GPU parity test") {
        return;
    }
    for dtype in [Dtype::BF16, Dtype::F16, Dtype::F32] {
        let f = fixture(41, dtype, &odd_shapes(), &DENSITIES[..5], 2);
        let analyze = |device: &str, extra: &[&str]| -> serde_json::Value {
            let mut cmd = rlmerge();
            cmd.args([
                "analyze",
                "--json",
                "--per-tensor",
                "--quiet",
                "--device",
                device,
            ])
            .args(extra);
            cmd.arg("--base").arg(&f.base);
            for a in &f.agents {
                cmd.arg("--model").arg(a);
            }
            serde_json::from_slice(&cmd.assert().success().get_output().stdout).unwrap()
        };
        let cpu = analyze("cpu", &[]);
        assert_eq!(cpu, analyze("gpu", &[]), "{dtype:?}");
        assert_eq!(
            cpu,
            analyze("gpu", &["--gpu-chunk-elems", "10", "--tile-elems", "33"]),
            "{dtype:?}"
        );
    }
}

#[test]
fn gpu_output_dtype_conversions_equal_cpu() {
    if !gpu_available("this GPU parity test") {
        return;
    }
    for (dtype, outs) in [
        (Dtype::BF16, ["f16", "f32"]),
        (Dtype::F16, ["bf16", "f32"]),
        (Dtype::F32, ["bf16", "f16"]),
    ] {
        let f = fixture(61, dtype, &odd_shapes(), &DENSITIES[..3], 1);
        for out in outs {
            assert_same(
                &f,
                &format!("to-{out}"),
                &["--method", "ram+", "--out-dtype", out],
                &[],
            );
        }
    }
}

#[test]
fn gpu_chunking_and_tiling_do_not_change_the_bytes() {
    if !gpu_available("this GPU parity test") {
        return;
    }
    let f = fixture(71, Dtype::BF16, &odd_shapes(), &DENSITIES[..4], 1);
    let cpu = f.dir.path().join("cpu");
    merge_cmd(&f, &cpu, &["--device", "cpu", "--method", "ram+"])
        .assert()
        .success();
    // Chunks from a few elements (many bindings per tensor) up to whole tiles.
    for (tile, chunk) in [
        ("1", "2"),
        ("7", "6"),
        ("4096", "10"),
        ("4096", "1024"),
        ("1000000", "1048576"),
    ] {
        let gpu = f.dir.path().join(format!("gpu-{tile}-{chunk}"));
        merge_cmd(
            &f,
            &gpu,
            &[
                "--device",
                "gpu",
                "--method",
                "ram+",
                "--tile-elems",
                tile,
                "--gpu-chunk-elems",
                chunk,
            ],
        )
        .assert()
        .success();
        compare(&cpu, &gpu, &format!("tile {tile} chunk {chunk}"));
    }
}

/// Every f16 bit pattern decoded (f16 → f32) and a spread of f32 bit patterns (subnormals, NaN,
/// infinities, rounding ties, values that overflow the narrower type) encoded to bf16 and f16, by
/// each backend's merge kernel directly: agents equal the base, so c = 0 everywhere and the output
/// is the base converted. (Through the CLI, an overflow to ±Inf is refused by the output policy,
/// tested in tests/values.rs; the codecs below it must still agree on every pattern.)
#[test]
fn gpu_codecs_equal_cpu_on_every_f16_and_many_f32_patterns() {
    use rlmerge::backend::gpu::{AdapterChoice, GpuBackend, GpuContext};
    use rlmerge::backend::{cpu::CpuBackend, Backend, MergeParams, Tile};
    use rlmerge::checkpoint::DType;
    if !gpu_available("this GPU parity test") {
        return;
    }
    let ctx = GpuContext::open(AdapterChoice::Any).unwrap().unwrap();
    let backends: [Box<dyn Backend>; 2] = [
        Box::new(CpuBackend::new(0).unwrap()),
        Box::new(GpuBackend::new(ctx)),
    ];
    let f16_bytes: Vec<u8> = (0..=u16::MAX).flat_map(|h| h.to_le_bytes()).collect();
    let mut x = 0x9e37_79b9u32;
    let mut f32_bits: Vec<u32> = vec![
        0,
        0x8000_0000,
        1,
        0x007f_ffff,
        0x7f80_0000,
        0xff80_0000,
        0x7fc0_0000,
        0x7f80_0001,
        0x3f80_8000,
        0x3f81_8000,
    ];
    f32_bits.extend(0x3380_0000u32..0x3380_0400); // around f16's smallest subnormal
    f32_bits.extend(0x4780_0000u32 - 0x400..0x4780_0000 + 0x400); // around f16's overflow
    for _ in 0..200_000 {
        x ^= x << 13;
        x ^= x >> 17;
        x ^= x << 5;
        f32_bits.push(x);
    }
    let f32_bytes: Vec<u8> = f32_bits.iter().flat_map(|b| b.to_le_bytes()).collect();
    for (dtype, bytes, outs) in [
        (DType::F16, &f16_bytes, [DType::F32, DType::BF16]),
        (DType::F32, &f32_bytes, [DType::F16, DType::BF16]),
    ] {
        let len = bytes.len() / dtype.size();
        let tile = Tile {
            dtype,
            len,
            base: bytes,
            agents: &[bytes],
        };
        for out_dtype in outs {
            let outputs: Vec<Vec<u8>> = backends
                .iter()
                .map(|b| {
                    let mut out = vec![0u8; len * out_dtype.size()];
                    let params = MergeParams {
                        epsilon: 1e-5,
                        lambdas: &[1.0],
                        out_dtype,
                        shared: SharedRule::Mean,
                    };
                    b.merge(&tile, &params, &mut out).unwrap();
                    out
                })
                .collect();
            let what = format!("{dtype} → {out_dtype}");
            let want: Vec<u8> = {
                let mut v = vec![0f32; len];
                rlmerge::checkpoint::dtype::decode(dtype, bytes, &mut v);
                let mut o = vec![0u8; len * out_dtype.size()];
                rlmerge::checkpoint::dtype::encode(out_dtype, &v, &mut o);
                o
            };
            assert!(
                outputs[0] == want,
                "{what}: the CPU kernel differs from the codec"
            );
            assert!(
                outputs[1] == want,
                "{what}: the GPU kernel differs from the CPU"
            );
        }
    }
}

/// One tensor past the 128 MiB binding of lavapipe: several chunks, and a chunk with more than
/// 65 535 workgroups, so the 2-D dispatch is used.
#[test]
fn gpu_tensor_larger_than_one_binding() {
    if !gpu_available("this GPU parity test") {
        return;
    }
    let numel = (1usize << 25) + 3; // 33 554 435 bf16 elements: odd, and over 65 535 × 256 pairs
    let dir = tempfile::tempdir().unwrap();
    let mut rng = Rng(5);
    let base: Vec<f32> = (0..numel)
        .map(|i| if i % 5 == 0 { 0.25 } else { -0.5 })
        .collect();
    let agent: Vec<f32> = base
        .iter()
        .map(|&b| if rng.chance(0.05) { b + 0.125 } else { b })
        .collect();
    let mk = |name: &str, v: Vec<f32>| {
        let p = dir.path().join(name);
        write_folder(
            &p,
            &[T {
                name: "big".into(),
                dtype: Dtype::BF16,
                shape: vec![numel],
                values: v,
            }],
            1,
        );
        p
    };
    let (b, a) = (mk("base", base), mk("agent", agent));
    let mut outs = vec![];
    for (device, extra) in [
        ("cpu", vec![]),
        (
            "gpu",
            vec!["--gpu-chunk-elems", "40000000", "--tile-elems", "40000000"],
        ),
    ] {
        let o = dir.path().join(device);
        rlmerge()
            .args(["merge", "--quiet", "--method", "ram+", "--device", device])
            .args(&extra)
            .arg("--base")
            .arg(&b)
            .arg("--model")
            .arg(&a)
            .arg("-o")
            .arg(&o)
            .assert()
            .success();
        outs.push(o);
    }
    compare(&outs[0], &outs[1], "big tensor");
}

/// A device error (here a binding past the adapter's limit, injected) fails the merge with an
/// error naming the tensor and tile, exit 1, and no output — never a panic.
#[test]
fn gpu_device_errors_fail_cleanly() {
    if !gpu_available("this GPU parity test") {
        return;
    }
    // The fault: one chunk of 40M f32 elements bound at once, past lavapipe's 128 MiB binding.
    // A GPU whose binding takes it (2 GiB on an H200) cannot be made to fail this way.
    let fits = rlmerge::backend::gpu::list_adapters()
        .iter()
        .any(|a| a.limits.max_storage_buffer_binding_size >= 160_000_000);
    if fits {
        eprintln!("the adapter binds 160 MB at once: no device error to provoke, test skipped");
        return;
    }
    let f = fixture(81, Dtype::F32, &[("w", vec![40_000_000])], &[0.1], 1);
    let out = f.dir.path().join("out");
    let output = merge_cmd(
        &f,
        &out,
        &[
            "--device",
            "gpu",
            "--gpu-chunk-elems",
            "40000000",
            "--tile-elems",
            "40000000",
        ],
    )
    .env("RLMERGE_TEST_GPU_IGNORE_LIMITS", "1")
    .output()
    .unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("tensor 'w'") && stderr.contains("tile 0"),
        "{stderr}"
    );
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert!(!out.exists());
}

#[test]
fn device_gpu_without_adapter_says_how_to_get_one() {
    // With no backend enabled wgpu sees no adapter, whatever the machine has.
    let f = fixture(91, Dtype::BF16, &odd_shapes(), &DENSITIES[..2], 1);
    let out = f.dir.path().join("out");
    let output = merge_cmd(&f, &out, &["--device", "gpu"])
        .env("WGPU_BACKEND", "gl")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("mesa-vulkan-drivers"), "{stderr}");
    assert!(!out.exists());
}

#[test]
fn devices_lists_adapters_and_merges_name_the_backend() {
    if !gpu_available("this GPU parity test") {
        return;
    }
    let adapters = rlmerge::backend::gpu::list_adapters();
    let listed = String::from_utf8(
        rlmerge()
            .arg("devices")
            .assert()
            .success()
            .get_output()
            .stdout
            .clone(),
    )
    .unwrap();
    for a in &adapters {
        assert!(listed.contains(&a.info.name), "{listed}");
    }
    assert!(listed.contains("max storage binding"), "{listed}");
    // The copy rates an elementwise merge on the adapter cannot beat, measured both ways.
    let measured = rlmerge()
        .args(["devices", "--copy-rate"])
        .assert()
        .success()
        .get_output()
        .stdout
        .clone();
    let measured = String::from_utf8(measured).unwrap();
    let line = measured
        .lines()
        .find(|l| l.starts_with("copy rate on "))
        .unwrap_or_else(|| panic!("{measured}"));
    let rates: Vec<f64> = line
        .split(": ")
        .nth(1)
        .unwrap()
        .split(", ")
        .map(|part| part.split(' ').next().unwrap().parse().unwrap())
        .collect();
    assert!(rates.len() == 2 && rates.iter().all(|r| *r > 0.0), "{line}");
    let f = fixture(95, Dtype::BF16, &odd_shapes(), &DENSITIES[..2], 1);
    for (device, want) in [("gpu", "backend: gpu: "), ("cpu", "backend: cpu (")] {
        let out = f.dir.path().join(device);
        let mut cmd = rlmerge();
        cmd.args(["merge", "--device", device])
            .arg("--base")
            .arg(&f.base);
        for a in &f.agents {
            cmd.arg("--model").arg(a);
        }
        let output = cmd
            .arg("-o")
            .arg(&out)
            .assert()
            .success()
            .get_output()
            .clone();
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(stderr.contains(want), "{stderr}");
        // Where a GPU merge's bytes and time went; the CPU moves nothing.
        assert_eq!(stderr.contains("GPU: "), device == "gpu", "{stderr}");
        assert_eq!(
            stderr.contains("chunks in flight"),
            device == "gpu",
            "{stderr}"
        );
    }
}

/// CPU and integrated adapters (lavapipe here) map their storage buffers instead of copying
/// through staging buffers; `RLMERGE_GPU_MAPPED=0` takes the staged path discrete GPUs use. Both
/// give the CPU's bytes, and the backend line says which ran.
#[test]
fn gpu_mapped_and_staged_buffers_equal_cpu() {
    if !gpu_available("this GPU parity test") {
        return;
    }
    let f = fixture(96, Dtype::BF16, &odd_shapes(), &DENSITIES[..3], 2);
    // The adapter a merge picks: the best ranked, which is the only one where CI runs.
    let adapters = rlmerge::backend::gpu::list_adapters();
    let mapped_adapter = adapters.len() == 1 && adapters[0].mapped;
    let methods: [&[&str]; 3] = [
        &["--method", "ram"],
        &["--method", "ram+"],
        &[
            "--method",
            "ties",
            "--param",
            "weight=1",
            "--param",
            "density=0.4",
        ],
    ];
    for (m, args) in methods.iter().enumerate() {
        let cpu = f.dir.path().join(format!("{m}-cpu"));
        merge_cmd(&f, &cpu, &[args, &["--device", "cpu"][..]].concat())
            .assert()
            .success();
        for mapped in ["1", "0"] {
            let gpu = f.dir.path().join(format!("{m}-gpu-{mapped}"));
            // Not --quiet: the backend line says whether buffers were mapped.
            let mut cmd = merge_of(&f.base, &f.agents);
            let output = cmd
                .arg("-o")
                .arg(&gpu)
                .args(*args)
                .args(["--device", "gpu", "--gpu-chunk-elems", "998"])
                .env("RLMERGE_GPU_MAPPED", mapped)
                .assert()
                .success()
                .get_output()
                .clone();
            let stderr = String::from_utf8_lossy(&output.stderr);
            let says_mapped = stderr.contains("mapped buffers");
            if adapters.len() == 1 {
                assert_eq!(says_mapped, mapped == "1" && mapped_adapter, "{stderr}");
            }
            compare(&cpu, &gpu, &format!("{args:?} mapped={mapped}"));
        }
    }
}

/// SPEC §2's shared mean is the correctly rounded quotient Σ/c: the GPU's integer division equals
/// the CPU's IEEE division for every count up to 32 agents, over sums of every magnitude
/// (subnormal ones included, with ε = 0), and both equal an independent reference that divides.
#[test]
fn gpu_shared_mean_is_the_correctly_rounded_quotient() {
    use rlmerge::backend::gpu::{AdapterChoice, GpuBackend, GpuContext};
    use rlmerge::backend::{cpu::CpuBackend, Backend, MergeParams, Tile};
    use rlmerge::checkpoint::DType;
    if !gpu_available("this GPU parity test") {
        return;
    }
    let n = 32;
    let len = 40_000;
    let mut rng = Rng(77);
    let base = vec![0.0f32; len];
    let mut agents = vec![vec![0.0f32; len]; n];
    for i in 0..len {
        let c = 2 + i % (n - 1);
        for agent in agents.iter_mut().take(c) {
            // Random sign, mantissa and exponent: from subnormal to 2^40.
            let exp = (rng.u64() % 170) as u32;
            let bits = ((rng.u64() as u32) & 0x807f_ffff) | (exp << 23);
            agent[i] = f32::from_bits(bits);
        }
    }
    let bytes = |v: &[f32]| -> Vec<u8> { v.iter().flat_map(|x| x.to_le_bytes()).collect() };
    let base_bytes = bytes(&base);
    let agent_bytes: Vec<Vec<u8>> = agents.iter().map(|a| bytes(a)).collect();
    let slices: Vec<&[u8]> = agent_bytes.iter().map(|a| a.as_slice()).collect();
    let tile = Tile {
        dtype: DType::F32,
        len,
        base: &base_bytes,
        agents: &slices,
    };
    let lambdas = vec![1.0f32; n];
    let params = MergeParams {
        epsilon: 0.0,
        lambdas: &lambdas,
        out_dtype: DType::F32,
        shared: SharedRule::Mean,
    };
    let ctx = GpuContext::open(AdapterChoice::Any).unwrap().unwrap();
    let backends: [Box<dyn Backend>; 2] = [
        Box::new(CpuBackend::new(0).unwrap()),
        Box::new(GpuBackend::new(ctx)),
    ];
    let outs: Vec<Vec<f32>> = backends
        .iter()
        .map(|b| {
            let mut out = vec![0u8; len * 4];
            b.merge(&tile, &params, &mut out).unwrap();
            from_bytes(Dtype::F32, &out)
        })
        .collect();
    for i in 0..len {
        let (mut sum, mut c) = (0.0f32, 0u32);
        for a in &agents {
            if a[i].abs() > 0.0 {
                sum += a[i];
                c += 1;
            }
        }
        let want = if c == 1 { sum } else { 0.0 + sum / c as f32 };
        assert_eq!(
            outs[0][i].to_bits(),
            want.to_bits(),
            "cpu, element {i}, c = {c}"
        );
        assert_eq!(
            outs[1][i].to_bits(),
            want.to_bits(),
            "gpu, element {i}: {sum:e} / {c}"
        );
    }
}

/// On an adapter that flushes subnormals (NVIDIA's Vulkan driver does), a tile holding a value
/// below 2^-60 is computed by the CPU kernels and every other tile by the GPU: the bytes are the
/// CPU backend's either way. lavapipe keeps subnormals, so the route is forced here; the probe
/// that detects flushing must not report it on lavapipe.
#[test]
fn tiles_with_tiny_values_go_to_the_cpu_where_the_adapter_flushes_subnormals() {
    use rlmerge::backend::gpu::{AdapterChoice, GpuBackend, GpuContext};
    use rlmerge::backend::{cpu::CpuBackend, Backend, MergeParams, Tile};
    use rlmerge::checkpoint::DType;
    if !gpu_available("this GPU parity test") {
        return;
    }
    let honest = GpuBackend::new(GpuContext::open(AdapterChoice::Any).unwrap().unwrap());
    if honest.describe().contains("llvmpipe") {
        assert!(
            !honest.describe().contains("flushes"),
            "{}",
            honest.describe()
        );
    }
    drop(honest);
    let gpu = GpuBackend::new(GpuContext::open(AdapterChoice::Any).unwrap().unwrap())
        .assume_flushing_subnormals();
    assert!(gpu.describe().contains("flushes subnormals"));
    let cpu = CpuBackend::new(0).unwrap();
    let bytes = |v: &[f32]| -> Vec<u8> { v.iter().flat_map(|x| x.to_le_bytes()).collect() };
    let len = 1000;
    let base: Vec<f32> = (0..len).map(|i| i as f32 * 1e-3).collect();
    let normal: Vec<f32> = base.iter().map(|b| b + 0.5).collect();
    let mut tiny = normal.clone();
    tiny[999] = f32::from_bits(3); // a subnormal change, counted with ε = 0
    let lambdas = [1.0f32, 1.0];
    let params = MergeParams {
        epsilon: 0.0,
        lambdas: &lambdas,
        out_dtype: DType::F32,
        shared: SharedRule::Mean,
    };
    let base = bytes(&base);
    for (agents, cpu_tiles) in [([&normal, &normal], 0), ([&normal, &tiny], 1)] {
        let agents: Vec<Vec<u8>> = agents.iter().map(|a| bytes(a)).collect();
        let slices: Vec<&[u8]> = agents.iter().map(|a| a.as_slice()).collect();
        let tile = Tile {
            dtype: DType::F32,
            len,
            base: &base,
            agents: &slices,
        };
        let before = gpu.phase_times().cpu_tiles;
        let (mut want, mut got) = (vec![0u8; len * 4], vec![0u8; len * 4]);
        let want_counts = cpu.merge_counted(&tile, &params, &mut want).unwrap();
        let got_counts = gpu.merge_counted(&tile, &params, &mut got).unwrap();
        assert_eq!(gpu.phase_times().cpu_tiles - before, cpu_tiles);
        assert_eq!(got, want);
        assert_eq!(got_counts, want_counts);
        assert_eq!(
            gpu.probe(&tile, 0.0).unwrap(),
            cpu.probe(&tile, 0.0).unwrap()
        );
    }
}

/// The GPU keeps several chunks of a tile in flight — uploaded, computing and reading back at
/// once — on each worker's own buffers, and its counters say so: on lavapipe, a tile of 16
/// chunks reaches three chunks in flight; merged by two threads at once, it moves the bytes the
/// chunks hold up and the merged bytes down; every merge gives the CPU backend's bytes.
#[test]
fn gpu_keeps_chunks_in_flight_and_counts_the_bytes_it_moves() {
    use rlmerge::backend::gpu::{AdapterChoice, GpuBackend, GpuContext};
    use rlmerge::backend::{cpu::CpuBackend, Backend, MergeParams, Tile};
    use rlmerge::checkpoint::DType;
    if !gpu_available("this GPU parity test") {
        return;
    }
    let gpu = GpuBackend::new(GpuContext::open(AdapterChoice::Any).unwrap().unwrap())
        .with_chunk_elems(256);
    let cpu = CpuBackend::new(0).unwrap();
    let len = 16 * 256;
    let base_values: Vec<f32> = (0..len).map(|i| (i % 97) as f32 * 0.01).collect();
    let base = to_bytes(Dtype::F32, &base_values);
    let agents: Vec<Vec<u8>> = (0..2)
        .map(|t| {
            let changed: Vec<f32> = (0..len)
                .map(|i| base_values[i] + if (i + t) % 5 == 0 { 0.25 } else { 0.0 })
                .collect();
            to_bytes(Dtype::F32, &changed)
        })
        .collect();
    let slices: Vec<&[u8]> = agents.iter().map(|a| a.as_slice()).collect();
    let tile = Tile {
        dtype: DType::F32,
        len,
        base: &base,
        agents: &slices,
    };
    let lambdas = [1.0f32, 1.0];
    let params = MergeParams {
        epsilon: 1e-5,
        lambdas: &lambdas,
        out_dtype: DType::F32,
        shared: SharedRule::Mean,
    };
    let mut want = vec![0u8; len * 4];
    cpu.merge(&tile, &params, &mut want).unwrap();
    // One worker alone keeps three chunks in flight.
    let mut got = vec![0u8; len * 4];
    gpu.merge(&tile, &params, &mut got).unwrap();
    assert!(got == want, "the GPU's bytes differ from the CPU's");
    assert!(
        gpu.phase_times().max_in_flight >= 3,
        "{:?}",
        gpu.phase_times()
    );
    let before = gpu.phase_times();
    std::thread::scope(|s| {
        for _ in 0..2 {
            s.spawn(|| {
                let mut got = vec![0u8; len * 4];
                gpu.merge(&tile, &params, &mut got).unwrap();
                assert!(got == want, "the GPU's bytes differ from the CPU's");
            });
        }
    });
    let t = gpu.phase_times();
    assert_eq!(t.chunks - before.chunks, 32);
    // Up: the base and two agents, 4 bytes an element, twice; down: the merged tile, twice.
    assert_eq!(
        t.bytes_up - before.bytes_up,
        2 * 3 * len as u64 * 4,
        "{t:?}"
    );
    assert_eq!(
        t.bytes_down - before.bytes_down,
        2 * len as u64 * 4,
        "{t:?}"
    );
}
