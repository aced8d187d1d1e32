//! The GPU backend against the CPU backend, byte for byte, through the CLI: every method, in every
//! dtype, with chunks that cut rows and tiles. Without a GPU adapter these tests say so and pass,
//! unless RLMERGE_REQUIRE_GPU is set (CI sets it after installing lavapipe).

mod common;
use common::*;
use safetensors::tensor::Dtype;

/// Every mergekit-family method: GPU equals CPU byte for byte for each dtype, with chunks small
/// enough to cut rows, rank ties and random masks across dispatches.
#[test]
fn gpu_equals_cpu_for_every_method() {
    if !gpu_available("this GPU parity test") {
        return;
    }
    for (d, dtype) in [Dtype::BF16, Dtype::F16, Dtype::F32]
        .into_iter()
        .enumerate()
    {
        let f = fixture(700 + d as u64, dtype, &odd_shapes(), &DENSITIES[..3], 2);
        for (i, (method, params)) in METHODS.iter().enumerate() {
            let owned = method_args(method, params);
            let args: Vec<&str> = owned.iter().map(String::as_str).collect();
            assert_same(&f, &format!("m{i}"), &args, &["--gpu-chunk-elems", "998"]);
        }
        // DELLA on a tensor of three dimensions (ranks along dimension 1, in strided groups), and
        // model_stock per row, beside a matrix.
        let shapes = [
            ("model.layers.0.mlp.experts.weight", vec![3, 40, 7]),
            ("model.layers.0.self_attn.q_proj.weight", vec![23, 19]),
        ];
        let f = fixture(780 + d as u64, dtype, &shapes, &DENSITIES[..3], 1);
        for (i, (method, params)) in [
            ("della", &["weight=1", "density=0.5", "epsilon=0.2"][..]),
            (
                "della_linear",
                &["weight=0.7", "density=0.4", "epsilon=0.3"],
            ),
            ("model_stock", &["filter_wise=true"]),
        ]
        .into_iter()
        .enumerate()
        {
            let owned = method_args(method, params);
            let args: Vec<&str> = owned.iter().map(String::as_str).collect();
            assert_same(&f, &format!("d{i}"), &args, &["--gpu-chunk-elems", "998"]);
        }
        // nuslerp takes exactly two models.
        let f = fixture(740 + d as u64, dtype, &odd_shapes(), &DENSITIES[..2], 1);
        // … one angle per tensor, per row, or per column (rows that repeat across a chunk).
        for (i, mode) in [
            &[][..],
            &["nuslerp_flatten=false"],
            &["nuslerp_flatten=false", "nuslerp_row_wise=true"],
        ]
        .into_iter()
        .enumerate()
        {
            let owned = method_args("nuslerp", &[&["weight=0.4"][..], mode].concat());
            let args: Vec<&str> = owned.iter().map(String::as_str).collect();
            for chunk in ["998", "7"] {
                assert_same(
                    &f,
                    &format!("nu{i}-{chunk}"),
                    &args,
                    &["--gpu-chunk-elems", chunk],
                );
            }
        }
        // Two-model methods: slerp (row-wise coefficients) and passthrough.
        let f = fixture(720 + d as u64, dtype, &odd_shapes(), &DENSITIES[..1], 1);
        for (i, (method, params)) in [
            ("slerp", &["t=0.3"][..]),
            ("passthrough", &["scale=0.7"]),
            ("nearswap", &["t=0.004"]),
            ("arcee_fusion", &[]),
        ]
        .into_iter()
        .enumerate()
        {
            let owned = method_args(method, params);
            let args: Vec<&str> = owned.iter().map(String::as_str).collect();
            assert_same(&f, &format!("s{i}"), &args, &["--gpu-chunk-elems", "6"]);
            assert_same(
                &f,
                &format!("t{i}"),
                &[&args[..], &["--out-dtype", "f32"]].concat(),
                &[],
            );
        }
    }
}

/// Fisher merging's per-element coefficients (from f32 Fisher folders, the models in every dtype)
/// give the CPU's bytes on the GPU.
#[test]
fn gpu_equals_cpu_for_fisher() {
    if !gpu_available("this GPU parity test") {
        return;
    }
    for (d, dtype) in [Dtype::BF16, Dtype::F16, Dtype::F32]
        .into_iter()
        .enumerate()
    {
        let f = fixture(760 + d as u64, dtype, &odd_shapes(), &DENSITIES[..3], 1);
        let mut rng = Rng(77 + d as u64);
        let mut recipe = String::from("merge_method: fisher\nmodels:\n");
        for (a, agent) in f.agents.iter().enumerate() {
            let fisher: Vec<T> = odd_shapes()
                .into_iter()
                .map(|(name, shape)| T {
                    name: name.into(),
                    dtype: Dtype::F32,
                    values: (0..shape.iter().product::<usize>())
                        .map(|i| if i % 5 == 0 { 0.0 } else { rng.f32() })
                        .collect(),
                    shape,
                })
                .collect();
            let dir = f.dir.path().join(format!("fisher{a}"));
            write_folder(&dir, &fisher, 1);
            recipe += &format!(
                "  - model: {}\n    parameters: {{fisher: {}, weight: {}}}\n",
                agent.display(),
                dir.display(),
                1 + a
            );
        }
        std::fs::write(f.dir.path().join("fisher.yml"), recipe).unwrap();
        let mut outs = vec![];
        for (device, extra) in [("cpu", &[][..]), ("gpu", &["--gpu-chunk-elems", "998"][..])] {
            let o = f.dir.path().join(format!("fisher-{device}"));
            rlmerge()
                .args(["run", "-q", "--device", device])
                .arg(f.dir.path().join("fisher.yml"))
                .arg("-o")
                .arg(&o)
                .args(extra)
                .assert()
                .success();
            outs.push(o);
        }
        compare(&outs[0], &outs[1], "fisher");
    }
}

/// The GPU's GEMM (`shaders/gemm.wgsl`, the spectral methods' row maps) against faer's on the
/// CPU: shapes that do not fill its 16 × 16 tiles, a B kept on the device while its key comes
/// back and replaced when another key comes — within f32's rounding of the sums, and the same
/// bits on a second call.
#[test]
fn the_gpu_gemm_equals_the_cpus() {
    use rlmerge::backend::gpu::{AdapterChoice, GpuBackend, GpuContext};
    use rlmerge::backend::Backend;
    if !gpu_available("the GEMM's GPU test") {
        return;
    }
    let gpu = GpuBackend::new(GpuContext::open(AdapterChoice::Any).unwrap().unwrap());
    let cpu = rlmerge::backend::cpu::CpuBackend::new(1).unwrap();
    let mut rng = Rng(5);
    for (key, (rows, k, cols)) in [(1, (37, 50, 29)), (2, (1, 16, 16)), (3, (300, 7, 5))] {
        let a: Vec<f32> = (0..rows * k).map(|_| rng.f32() - 0.5).collect();
        let b: Vec<f32> = (0..k * cols).map(|_| rng.f32() - 0.5).collect();
        let (mut on_gpu, mut on_cpu) = (vec![0.0f32; rows * cols], vec![0.0f32; rows * cols]);
        for _ in 0..2 {
            let first = on_gpu.clone();
            gpu.matmul(&a, (&b, key), (rows, k, cols), &mut on_gpu)
                .unwrap();
            if first.iter().any(|&x| x != 0.0) {
                assert_eq!(first, on_gpu, "a second call's bits");
            }
        }
        cpu.matmul(&a, (&b, key), (rows, k, cols), &mut on_cpu)
            .unwrap();
        for (g, c) in on_gpu.iter().zip(&on_cpu) {
            assert!((g - c).abs() <= 1e-5 * (1.0 + c.abs()), "{g} vs {c}");
        }
    }
}
