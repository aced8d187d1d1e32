//! Whether a test's GPU half runs: wgpu's adapters (lavapipe in CI); and the GPU's merge
//! compared with the CPU's.

use super::{assert_same_bytes, merge_cmd, read_folder, Fixture};
use std::path::Path;

/// Whether wgpu sees an adapter. Without one the test's GPU half (`what`) is skipped with a
/// line saying so — unless `RLMERGE_REQUIRE_GPU` is set (CI sets it after installing lavapipe),
/// where a missing adapter fails the test instead of skipping anything silently.
pub fn gpu_available(what: &str) -> bool {
    let ok = !rlmerge::backend::gpu::list_adapters().is_empty();
    if !ok {
        assert!(
            std::env::var_os("RLMERGE_REQUIRE_GPU").is_none(),
            "RLMERGE_REQUIRE_GPU is set but wgpu sees no adapter for {what} (install \
             mesa-vulkan-drivers libvulkan1)"
        );
        eprintln!("no GPU adapter: {what} skipped");
    }
    ok
}

/// The `--device` values a test runs on: `cpu`, and `gpu` where [`gpu_available`].
pub fn devices() -> Vec<&'static str> {
    if gpu_available("the GPU device's runs") {
        vec!["cpu", "gpu"]
    } else {
        vec!["cpu"]
    }
}

/// Merges with `--device cpu` and `--device gpu` (plus `extra`) and asserts identical tensors.
pub fn assert_same(f: &Fixture, name: &str, args: &[&str], gpu_extra: &[&str]) {
    let cpu = f.dir.path().join(format!("{name}-cpu"));
    let gpu = f.dir.path().join(format!("{name}-gpu"));
    merge_cmd(f, &cpu, &[args, &["--device", "cpu"]].concat())
        .assert()
        .success();
    merge_cmd(f, &gpu, &[args, &["--device", "gpu"], gpu_extra].concat())
        .assert()
        .success();
    compare(&cpu, &gpu, &format!("{name} {args:?} {gpu_extra:?}"));
}

/// Asserts that two merged folders hold the same tensors, bytes and overlap figure.
pub fn compare(a: &Path, b: &Path, what: &str) {
    // RAM-family merges draw each agent's counts (plain RAM's from its merge kernels).
    let figure = |dir: &Path| std::fs::read_to_string(dir.join("overlap.svg")).ok();
    assert_eq!(figure(a), figure(b), "{what}: overlap.svg");
    let (x, y) = (read_folder(a), read_folder(b));
    assert_eq!(
        x.keys().collect::<Vec<_>>(),
        y.keys().collect::<Vec<_>>(),
        "{what}"
    );
    for (k, (dt, shape, bytes)) in &x {
        let (dt2, shape2, bytes2) = &y[k];
        assert_eq!((dt, shape), (dt2, shape2), "{what}: {k}");
        assert_same_bytes(
            &format!("{what}: tensor {k} (gpu vs cpu)"),
            *dt,
            bytes2,
            bytes,
        );
    }
}

/// The spectral methods' GPU merge against the CPU's (SPEC §4g): their row maps' f32 products run
/// on each backend's own GEMM, whose sums run in another order, so the tensors agree within
/// `rel` (relative, Frobenius) rather than bit for bit; and a second GPU merge writes the first's
/// bytes (deterministic for a given adapter).
pub fn assert_gpu_close(cpu: &Path, gpu: &Path, rel: f64, merge_again: impl Fn(&Path)) {
    let (x, y) = (read_folder(cpu), read_folder(gpu));
    assert_eq!(x.keys().collect::<Vec<_>>(), y.keys().collect::<Vec<_>>());
    for (k, (dt, shape, bytes)) in &x {
        let (dt2, shape2, bytes2) = &y[k];
        assert_eq!((dt, shape), (dt2, shape2), "{k}");
        let (a, b) = (
            super::from_bytes(*dt, bytes),
            super::from_bytes(*dt, bytes2),
        );
        let diff: f64 = a
            .iter()
            .zip(&b)
            .map(|(p, q)| f64::from(p - q).powi(2))
            .sum();
        let norm: f64 = a.iter().map(|p| f64::from(*p).powi(2)).sum();
        assert!(
            diff.sqrt() <= rel * norm.sqrt(),
            "{k}: {:e}",
            (diff / norm).sqrt()
        );
    }
    let again = gpu.with_extension("again");
    merge_again(&again);
    assert!(
        read_folder(gpu) == read_folder(&again),
        "GPU bytes differ between runs"
    );
}
