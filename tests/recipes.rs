//! Bytes that depend on neither tiles, threads nor SIMD, and mergekit's recipes through the CLI:
//! the documented recipes run unchanged, `merge --config` equals `run`, recipe errors are clear
//! (a method's model count among them, before the merge), and `rlmerge methods` lists every
//! method.

mod common;
use common::*;
use safetensors::tensor::Dtype;
use std::path::{Path, PathBuf};

/// `RLMERGE_SIMD` caps below the widest kernel build (see src/simd.rs).
const SIMD_CAPS: [&str; 2] = ["baseline", "avx2"];

/// Every method, every tile size and CPU thread count gives the same bytes (ranks, masks and
/// statistics are computed over whole tensors, whatever the tiling; the statistics scans run on
/// the CPU backend's threads, however many).
#[test]
fn results_do_not_depend_on_tiles_threads_or_simd() {
    let f = fixture(900, Dtype::BF16, &odd_shapes(), &DENSITIES[..3], 2);
    // RAM, and the methods that decompose whole matrices (faer's SVDs and ResMerge's Lanczos
    // process run on the pool --threads sets).
    let ram: [(&str, &[&str]); 6] = [
        ("ram", &[]),
        ("ram+", &[]),
        ("ram", &["shared=consensus"]),
        ("iso_c", &[]),
        ("tsv", &[]),
        ("resmerge", &["rank_topk=2"]),
    ];
    // Methods of one model besides the base.
    let one = fixture(902, Dtype::BF16, &odd_shapes(), &DENSITIES[1..2], 2);
    let single: [(&str, &[&str]); 3] = [
        ("arcee_fusion", &[]),
        ("slerp", &["t=0.3"]),
        ("nearswap", &["t=0.004"]),
    ];
    let cases = METHODS
        .iter()
        .chain(&ram)
        .map(|m| (&f, m))
        .chain(single.iter().map(|m| (&one, m)));
    for (i, (f, (method, params))) in cases.enumerate() {
        let whole = f.dir.path().join(format!("{i}-{method}-whole"));
        let small = f.dir.path().join(format!("{i}-{method}-small"));
        let owned = method_args(method, params);
        let args: Vec<&str> = owned.iter().map(String::as_str).collect();
        merge_cmd(f, &whole, &args).assert().success();
        let small_args = ["--tile-elems", "37", "--device", "cpu", "--threads", "3"];
        merge_cmd(f, &small, &[&args[..], &small_args].concat())
            .assert()
            .success();
        let want = read_folder(&whole);
        assert_eq!(want, read_folder(&small), "{method}: tiles, 3 threads");
        let one = f.dir.path().join(format!("{i}-{method}-one-thread"));
        let one_args = ["--device", "cpu", "--threads", "1"];
        merge_cmd(f, &one, &[&args[..], &one_args].concat())
            .assert()
            .success();
        assert_eq!(want, read_folder(&one), "{method}: one thread");
        // Where the CPU has AVX-512 or AVX2, the kernels' narrower builds give the same bytes.
        for cap in SIMD_CAPS {
            let capped = f.dir.path().join(format!("{i}-{method}-{cap}"));
            merge_cmd(f, &capped, &args)
                .env("RLMERGE_SIMD", cap)
                .assert()
                .success();
            assert_eq!(want, read_folder(&capped), "{method}: SIMD {cap}");
        }
    }
    // The 16- and 32-bit codecs, both builds.
    for dtype in [Dtype::F16, Dtype::F32] {
        let f = fixture(901, dtype, &odd_shapes(), &DENSITIES[..3], 2);
        for method in ["ram", "ties"] {
            let owned = method_args(
                method,
                &["weight=1", "density=0.5"][..2 * (method == "ties") as usize],
            );
            let args: Vec<&str> = owned.iter().map(String::as_str).collect();
            let (a, b) = (
                f.dir.path().join(method),
                f.dir.path().join(format!("{method}-b")),
            );
            merge_cmd(&f, &a, &args).assert().success();
            for cap in SIMD_CAPS {
                let _ = std::fs::remove_dir_all(&b);
                merge_cmd(&f, &b, &args)
                    .env("RLMERGE_SIMD", cap)
                    .assert()
                    .success();
                assert_eq!(
                    read_folder(&a),
                    read_folder(&b),
                    "{method} {dtype:?}: SIMD {cap}"
                );
            }
        }
    }
}

/// The demo's Qwen2 folders, where the fixtures' model names point.
fn demo_models() -> tempfile::TempDir {
    let d = tempfile::tempdir().unwrap();
    rlmerge()
        .args(["demo", "--write-only", "-q"])
        .arg(d.path())
        .assert()
        .success();
    d
}

fn fixtures() -> Vec<PathBuf> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/recipes");
    let mut v: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "yml"))
        .collect();
    v.sort();
    v
}

/// mergekit's documented recipes (ties, dare_ties, slerp, model_stock, linear, ram, and more) run
/// unchanged; the recipe is saved as mergekit_config.yml (run from anywhere, it makes the same
/// merge), the output dtype follows `dtype`, and `rlmerge verify` accepts the result.
#[test]
fn mergekit_recipes_run_unchanged() {
    let d = demo_models();
    let names: Vec<String> = fixtures()
        .iter()
        .map(|p| p.file_stem().unwrap().to_string_lossy().into())
        .collect();
    for want in ["ties", "dare_ties", "slerp", "model_stock", "linear", "ram"] {
        assert!(
            names.iter().any(|n| n == want),
            "fixture {want}.yml missing"
        );
    }
    for recipe in fixtures() {
        let name = recipe.file_stem().unwrap().to_string_lossy().to_string();
        let out = d.path().join(format!("out-{name}"));
        rlmerge()
            .current_dir(d.path())
            .arg("run")
            .arg(&recipe)
            .args(["-q", "-o"])
            .arg(&out)
            .assert()
            .success();
        let text = std::fs::read_to_string(&recipe).unwrap();
        // The saved recipe is the recipe — its method and parameters as written, its model paths
        // relative to the output — and makes the same merge from any folder.
        let saved = std::fs::read_to_string(out.join("mergekit_config.yml")).unwrap();
        let (a, b): (serde_yaml::Value, serde_yaml::Value) = (
            serde_yaml::from_str(&text).unwrap(),
            serde_yaml::from_str(&saved).unwrap(),
        );
        for key in ["merge_method", "parameters", "dtype", "tokenizer_source"] {
            assert_eq!(a.get(key), b.get(key), "{name}: {key}");
        }
        let elsewhere = tempfile::tempdir().unwrap();
        rlmerge()
            .current_dir(elsewhere.path())
            .arg("run")
            .arg(out.join("mergekit_config.yml"))
            .args(["-q", "-o", "again"])
            .assert()
            .success();
        assert_eq!(
            read_folder(&out),
            read_folder(&elsewhere.path().join("again")),
            "{name}: the saved recipe makes the same merge"
        );
        let want = if text.contains("dtype: float16") {
            Dtype::F16
        } else if text.contains("dtype: float32") {
            Dtype::F32
        } else {
            Dtype::BF16
        };
        for (tensor, (dt, _, _)) in read_folder(&out) {
            assert_eq!(dt, want, "{name}: {tensor}");
        }
        rlmerge().arg("verify").arg(&out).assert().success();
    }
}

/// `merge --config` is `run`.
#[test]
fn merge_config_equals_run() {
    let d = demo_models();
    let recipe = fixtures()
        .into_iter()
        .find(|p| p.ends_with("ties.yml"))
        .unwrap();
    for (i, cmd) in [&["run"][..], &["merge", "--config"][..]]
        .iter()
        .enumerate()
    {
        rlmerge()
            .current_dir(d.path())
            .args(*cmd)
            .arg(&recipe)
            .args(["-q", "-o", &format!("o{i}")])
            .assert()
            .success();
    }
    assert_eq!(
        read_folder(&d.path().join("o0")),
        read_folder(&d.path().join("o1"))
    );
}

/// Recipe errors name the key and line, exit non-zero and leave no output.
#[test]
fn recipe_errors_are_clear() {
    let d = tempfile::tempdir().unwrap();
    write_cases(d.path(), &[2], &[0., 0.], &[&[1., 0.], &[0., 1.]]);
    let cases: [(&str, &[&str]); 10] = [
        ("merge_method: ties\nbase_model: base\nmodels:\n  - model: a\nfrobnicate: 1\n", &["frobnicate", "line 5"]),
        ("merge_method: ties\nbase_model: base\nmodules:\n  x: {}\n", &["modules", "not supported yet", "line 3"]),
        ("merge_method: ties\nbase_model: base\nslices:\n  - sources:\n      - model: a\n        layer_range: [0, 1]\n", &["config.json"]),
        ("merge_method: fisher\nbase_model: base\nmodels:\n  - model: a\n", &["fisher", "needs parameter 'fisher'"]),
        ("merge_method: nonsense\nmodels:\n  - model: a\n", &["unknown merge_method 'nonsense'", "line 1"]),
        ("merge_method: ties\nbase_model: base\nmodels:\n  - model: a\n    parameters: {density: 0.5}\n", &["needs parameter 'weight' for model 1", "weight:"]),
        ("merge_method: ties\nbase_model: base\nmodels:\n  - model: a\n    parameters: {weight: 1, gamma: 0.1}\n", &["unknown parameter 'gamma'", "line 5"]),
        // The new modes' switches take true or false only.
        ("merge_method: model_stock\nbase_model: base\nmodels:\n  - model: a\n  - model: b\nparameters:\n  filter_wise: maybe\n", &["parameter 'filter_wise' must be true or false", "line 7"]),
        ("merge_method: nuslerp\nbase_model: base\nmodels:\n  - model: a\n    parameters: {weight: 1}\n  - model: b\n    parameters: {weight: 1}\nparameters:\n  nuslerp_row_wise: 2\n", &["parameter 'nuslerp_row_wise' must be true or false"]),
        // arcee_fusion takes no parameters.
        ("merge_method: arcee_fusion\nbase_model: base\nmodels:\n  - model: a\nparameters:\n  t: 0.5\n", &["unknown parameter 't'", "arcee_fusion"]),
    ];
    for (yaml, wants) in cases {
        std::fs::write(d.path().join("r.yml"), yaml).unwrap();
        let out = rlmerge()
            .current_dir(d.path())
            .args(["run", "r.yml", "-q", "-o", "out"])
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{yaml}");
        for w in wants {
            assert!(err.contains(w), "{yaml}: want '{w}' in: {err}");
        }
        assert!(!d.path().join("out").exists(), "{yaml}: output left behind");
    }
}

#[test]
fn methods_lists_every_method_with_parameters() {
    let out = rlmerge().arg("methods").output().unwrap();
    assert!(out.status.success());
    let text = String::from_utf8(out.stdout).unwrap();
    for m in [
        "linear",
        "task_arithmetic",
        "ties",
        "dare_linear",
        "dare_ties",
        "breadcrumbs",
        "breadcrumbs_ties",
        "della",
        "della_linear",
        "model_stock",
        "slerp",
        "nuslerp",
        "multislerp",
        "karcher",
        "sce",
        "nearswap",
        "passthrough",
        "fisher",
        "ram",
        "ramplus_tl",
        "iso_c",
        "tsv",
        "resmerge",
        "svc",
    ] {
        assert!(
            text.lines().any(|l| l.starts_with(&format!("{m} "))),
            "{m} missing:\n{text}"
        );
    }
    let ties = rlmerge().args(["methods", "ties"]).output().unwrap();
    let ties = String::from_utf8(ties.stdout).unwrap();
    assert!(
        ties.contains("density") && ties.contains("arXiv:2306.01708"),
        "{ties}"
    );
}

/// nuslerp takes two models: a third is a usage error before anything is read (exit 2), not a
/// failure inside the merge.
#[test]
fn a_methods_model_count_is_checked_before_the_merge() {
    let f = fixture(6, Dtype::BF16, &[("w", vec![8, 4])], &DENSITIES[..3], 1);
    let out = f.dir.path().join("out");
    let o = merge_cmd(&f, &out, &["--method", "nuslerp", "--param", "weight=1"])
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(2), "{}", err_of(&o));
    assert!(
        err_of(&o).contains("nuslerp needs exactly two models, got 3"),
        "{}",
        err_of(&o)
    );
    assert!(!out.exists() && leftovers(f.dir.path()).is_empty());
}
