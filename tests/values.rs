//! Odd values: NaN and ±Inf are refused (error naming tensor, file and element) unless
//! --allow-nonfinite, then merged by IEEE rules; subnormals and −0.0 are exact. Both backends.

mod common;
use common::*;
use safetensors::tensor::Dtype;
use std::path::{Path, PathBuf};

fn folder(dir: &Path, name: &str, dtype: Dtype, values: Vec<f32>) -> PathBuf {
    let p = dir.join(name);
    let n = values.len();
    write_folder(
        &p,
        &[T {
            name: "w".into(),
            dtype,
            shape: vec![n],
            values,
        }],
        1,
    );
    p
}

fn merge(base: &Path, agents: &[&PathBuf], out: &Path, extra: &[&str]) -> std::process::Output {
    let mut cmd = rlmerge();
    cmd.args(["merge", "--quiet"])
        .args(extra)
        .arg("--base")
        .arg(base);
    for a in agents {
        cmd.arg("--model").arg(a);
    }
    cmd.arg("-o").arg(out).output().unwrap()
}

#[test]
fn nonfinite_inputs_are_refused_with_the_tensor_and_element() {
    let dir = tempfile::tempdir().unwrap();
    for dtype in [Dtype::BF16, Dtype::F16, Dtype::F32] {
        let clean: Vec<f32> = (0..5000).map(|i| (i % 7) as f32 * 0.25).collect();
        for (who, bad, at) in [
            ("base", f32::NAN, 4321),
            ("agent", f32::INFINITY, 7),
            ("agent", f32::NEG_INFINITY, 4999),
        ] {
            let mut dirty = clean.clone();
            dirty[at] = bad;
            let tag = format!("{dtype:?}-{who}-{at}");
            let (b, a) = if who == "base" {
                (
                    folder(dir.path(), &format!("{tag}-b"), dtype, dirty),
                    folder(dir.path(), &format!("{tag}-a"), dtype, clean.clone()),
                )
            } else {
                (
                    folder(dir.path(), &format!("{tag}-b"), dtype, clean.clone()),
                    folder(dir.path(), &format!("{tag}-a"), dtype, dirty),
                )
            };
            // ram is caught by the merge pass's scan, ram+ already by its probe pass.
            for (device, method) in devices()
                .into_iter()
                .flat_map(|d| [(d, "ram"), (d, "ram+")])
            {
                let out = dir.path().join(format!("{tag}-{device}-{method}"));
                let o = merge(
                    &b,
                    &[&a],
                    &out,
                    &[
                        "--device",
                        device,
                        "--method",
                        method,
                        "--tile-elems",
                        "1000",
                    ],
                );
                let err = String::from_utf8_lossy(&o.stderr);
                assert_eq!(o.status.code(), Some(1), "{method}: {err}");
                let file = if who == "base" { &b } else { &a }.join("model.safetensors");
                for needle in [
                    "tensor 'w'",
                    &file.display().to_string(),
                    &format!("element {at}"),
                    "--allow-nonfinite",
                ] {
                    assert!(err.contains(needle), "{needle} not in {err}");
                }
                assert!(!out.exists());
            }
        }
    }
}

/// Small tiles are read in runs of consecutive tiles (`engine::tiles::READ_RUN_BYTES`), taken by
/// workers at once: wherever two bad elements fall — the same run or two, read by one worker or
/// two, in whatever order — the earlier one is named, every time.
#[test]
fn the_earliest_nonfinite_element_is_named_whatever_the_runs() {
    let dir = tempfile::tempdir().unwrap();
    // f32 tiles of 1000 elements: runs of 64 tiles, 64 000 elements.
    let clean: Vec<f32> = (0..200_000).map(|i| (i % 7) as f32 * 0.25).collect();
    let b = folder(dir.path(), "b", Dtype::F32, clean.clone());
    for (n, bad) in [[70_000, 150_000], [64_500, 64_010], [199_999, 130_000]]
        .into_iter()
        .enumerate()
    {
        let mut dirty = clean.clone();
        for at in bad {
            dirty[at] = f32::NAN;
        }
        let a = folder(dir.path(), &format!("a{n}"), Dtype::F32, dirty);
        let want = format!("element {}", bad.iter().min().unwrap());
        for (threads, round) in [("1", 0), ("2", 0), ("3", 0), ("2", 1), ("3", 1)] {
            let out = dir.path().join(format!("out{n}-{threads}-{round}"));
            let args = [
                "--device",
                "cpu",
                "--tile-elems",
                "1000",
                "--threads",
                threads,
            ];
            let o = merge(&b, &[&a], &out, &args);
            let err = String::from_utf8_lossy(&o.stderr);
            assert_eq!(o.status.code(), Some(1), "{err}");
            assert!(
                err.contains(&want),
                "{threads} threads: {want} not in {err}"
            );
            assert!(!out.exists());
        }
    }
}

#[test]
fn allowed_nonfinite_values_follow_ieee_on_both_backends() {
    let dir = tempfile::tempdir().unwrap();
    // Element: 0 base NaN; 1 agent NaN; 2 agent +Inf; 3 agent −Inf; 4 both agents ±Inf (NaN sum);
    // 5 base +Inf with an ordinary agent change; 6 an ordinary element.
    let base = vec![f32::NAN, 1.0, 1.0, 1.0, 1.0, f32::INFINITY, 2.0];
    let a1 = vec![
        f32::NAN,
        f32::NAN,
        f32::INFINITY,
        f32::NEG_INFINITY,
        f32::INFINITY,
        3.0,
        2.5,
    ];
    let a2 = vec![
        f32::NAN,
        1.0,
        1.0,
        1.0,
        f32::NEG_INFINITY,
        f32::INFINITY,
        2.0,
    ];
    let b = folder(dir.path(), "b", Dtype::F32, base.clone());
    let p1 = folder(dir.path(), "a1", Dtype::F32, a1.clone());
    let p2 = folder(dir.path(), "a2", Dtype::F32, a2.clone());
    let mut outputs = vec![];
    for device in devices() {
        let out = dir.path().join(device);
        let o = merge(
            &b,
            &[&p1, &p2],
            &out,
            &["--device", device, "--allow-nonfinite", "--method", "ram"],
        );
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        outputs.push(read_folder(&out)["w"].2.clone());
    }
    let got = from_bytes(Dtype::F32, &outputs[0]);
    assert!(got[0].is_nan(), "base NaN passes through");
    assert_eq!(got[1], 1.0, "an agent's NaN is no change");
    assert_eq!(got[2], f32::INFINITY);
    assert_eq!(got[3], f32::NEG_INFINITY);
    assert!(got[4].is_nan(), "+Inf + −Inf");
    assert!(got[5].is_nan() || got[5] == f32::INFINITY);
    assert_eq!(got[6], 2.5);
    let want = reference_merge(
        &T {
            name: "w".into(),
            dtype: Dtype::F32,
            shape: vec![7],
            values: base,
        },
        &[
            &T {
                name: "w".into(),
                dtype: Dtype::F32,
                shape: vec![7],
                values: a1,
            },
            &T {
                name: "w".into(),
                dtype: Dtype::F32,
                shape: vec![7],
                values: a2,
            },
        ],
        1e-5,
        &[1.0, 1.0],
        Dtype::F32,
    );
    assert_eq!(outputs[0], want, "cpu vs reference");
    for o in &outputs[1..] {
        assert_eq!(o, &outputs[0], "gpu vs cpu");
    }
    // The record says so.
    let record = std::fs::read_to_string(dir.path().join("cpu/rlmerge_record.json")).unwrap();
    assert!(record.contains("\"allow_nonfinite\": true"));
}

#[test]
fn subnormals_and_negative_zero_are_exact_on_both_backends() {
    let dir = tempfile::tempdir().unwrap();
    for dtype in [Dtype::BF16, Dtype::F16, Dtype::F32] {
        // Smallest subnormals of each dtype, −0.0, and their neighbours.
        let tiny = match dtype {
            Dtype::BF16 => f32::from_bits(0x0001_0000),
            Dtype::F16 => 5.960_464_5e-8,
            _ => f32::from_bits(1),
        };
        let base = vec![-0.0, 0.0, tiny, -tiny, 3.0 * tiny, -0.0, 0.5, tiny];
        let a1 = vec![0.0, -0.0, 2.0 * tiny, tiny, 0.0, 0.25, 0.5, 0.5];
        let a2 = vec![-0.0, 0.0, tiny, -tiny, -0.0, -0.25, -0.5, tiny];
        let b = folder(dir.path(), &format!("{dtype:?}-b"), dtype, base.clone());
        let p1 = folder(dir.path(), &format!("{dtype:?}-1"), dtype, a1.clone());
        let p2 = folder(dir.path(), &format!("{dtype:?}-2"), dtype, a2.clone());
        let mk = |v: &Vec<f32>| T {
            name: "w".into(),
            dtype,
            shape: vec![8],
            values: v.clone(),
        };
        for eps in ["1e-5", "0"] {
            let want = reference_merge(
                &mk(&base),
                &[&mk(&a1), &mk(&a2)],
                eps.parse().unwrap(),
                &[1.0, 1.0],
                dtype,
            );
            for device in devices() {
                let out = dir.path().join(format!("{dtype:?}-{eps}-{device}"));
                let o = merge(
                    &b,
                    &[&p1, &p2],
                    &out,
                    &["--device", device, "--method", "ram", "--epsilon", eps],
                );
                assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
                assert_same_bytes(
                    &format!("{dtype:?} ε={eps} {device}"),
                    dtype,
                    &read_folder(&out)["w"].2,
                    &want,
                );
            }
        }
    }
}

/// The folders of the finite-input cases: a base of 300 f32 values and agents `a` (every third
/// element +0.5), `b` (every second −0.25: shared with `a` at every sixth), `huge` (every second
/// +1e37: boosted by λ = 1 + 100·ρ = 51, the unique ones pass f32's largest value) and `big`
/// (past f16's range, 70000, at element 124).
struct Values {
    base: PathBuf,
    base_v: Vec<f32>,
    a: PathBuf,
    b: PathBuf,
    huge: PathBuf,
    big: PathBuf,
}

fn value_folders(dir: &Path) -> Values {
    let base_v: Vec<f32> = (0..300).map(|i| 0.01 * (i % 13) as f32 - 0.05).collect();
    let mut a_v = base_v.clone();
    let mut b_v = base_v.clone();
    for i in (0..300).step_by(3) {
        a_v[i] += 0.5;
    }
    // b changes every second element: shared with a at every sixth, its own elsewhere.
    for i in (0..300).step_by(2) {
        b_v[i] -= 0.25;
    }
    // f32 values past f16's range (65504) in an agent's change.
    let mut big_v = base_v.clone();
    big_v[124] = 70000.0;
    // Changes of 1e37 (finite) on every second element; boosted by λ = 1 + 100·ρ = 51, the
    // unique ones pass f32's largest value.
    let mut huge_v = base_v.clone();
    for i in (0..300).step_by(2) {
        huge_v[i] += 1e37;
    }
    let base = folder(dir, "base", Dtype::F32, base_v.clone());
    let huge = folder(dir, "huge", Dtype::F32, huge_v);
    let a = folder(dir, "a", Dtype::F32, a_v);
    let b = folder(dir, "b", Dtype::F32, b_v);
    let big = folder(dir, "big", Dtype::F32, big_v);
    Values {
        base,
        base_v,
        a,
        b,
        huge,
        big,
    }
}

/// Issue #12 item 6: finite inputs never give a non-finite output silently — an overflow of the
/// method's arithmetic or of the output dtype is an error naming the tensor and element, with no
/// output, on both backends; where an input itself is not finite (`--allow-nonfinite`) IEEE
/// rules still decide.
#[test]
fn finite_inputs_that_would_merge_to_nonfinite_values_are_errors() {
    let dir = tempfile::tempdir().unwrap();
    let Values {
        base, a, huge, big, ..
    } = value_folders(dir.path());
    let cases: Vec<(Vec<&PathBuf>, Vec<&str>, &str)> = vec![
        // A weight finite in f32 (1e39 is not, and is refused as a parameter) times changes of
        // 1e37.
        (
            vec![&huge, &a],
            vec!["--method", "task_arithmetic", "--param", "weight=100"],
            "element 0",
        ),
        (
            vec![&huge, &a],
            vec!["--method", "ram+", "--r", "100"],
            "element 2",
        ),
        (
            vec![&big, &a],
            vec!["--method", "ram", "--out-dtype", "f16"],
            "element 124",
        ),
        (
            vec![&huge, &a],
            vec![
                "--method",
                "linear",
                "--param",
                "weight=100",
                "--param",
                "normalize=false",
            ],
            "element 0",
        ),
    ];
    for device in devices() {
        for (k, (agents, args, element)) in cases.iter().enumerate() {
            let out = dir.path().join(format!("out-{device}-{k}"));
            let mut extra = args.clone();
            extra.extend(["--device", device]);
            let o = merge(&base, agents, &out, &extra);
            let err = String::from_utf8_lossy(&o.stderr);
            assert_eq!(o.status.code(), Some(1), "{device} {args:?}: {err}");
            assert!(
                err.contains("non-finite") && err.contains("'w'") && err.contains(element),
                "{device} {args:?}: {err}"
            );
            assert!(!out.exists());
        }
    }
}

/// Merges that stay finite stay so (karcher with tol = 0, any max_iter), and an input that is
/// itself infinite may give an infinite output, by IEEE rules.
#[test]
fn finite_merges_stay_finite_and_infinite_inputs_follow_ieee() {
    let dir = tempfile::tempdir().unwrap();
    let Values {
        base, base_v, a, b, ..
    } = value_folders(dir.path());
    for device in devices() {
        // karcher with tol = 0 (any max_iter) stays finite.
        for max_iter in ["1", "5", "100"] {
            let out = dir.path().join(format!("karcher-{device}-{max_iter}"));
            let o = merge(
                &base,
                &[&a, &b],
                &out,
                &[
                    "--method",
                    "karcher",
                    "--param",
                    "tol=0",
                    "--param",
                    &format!("max_iter={max_iter}"),
                    "--device",
                    device,
                ],
            );
            assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
            let merged = read_folder(&out);
            let v = from_bytes(Dtype::F32, &merged["w"].2);
            assert!(v.iter().all(|x| x.is_finite()));
        }
    }
    // An input that is itself infinite may give an infinite output, by IEEE rules.
    let mut inf_v = base_v.clone();
    inf_v[5] = f32::INFINITY;
    let inf = folder(dir.path(), "inf", Dtype::F32, inf_v);
    for device in devices() {
        let out = dir.path().join(format!("inf-{device}"));
        let o = merge(
            &base,
            &[&inf, &a],
            &out,
            &["--allow-nonfinite", "--device", device],
        );
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        let v = from_bytes(Dtype::F32, &read_folder(&out)["w"].2);
        assert_eq!(v[5], f32::INFINITY);
    }
}

/// Issue #12 item 7: with --allow-nonfinite, +Inf in one agent and −Inf in another at one element
/// give the same bytes on both backends for every sparsifying method; TIES-family consensus takes
/// a NaN sum's sign as − (mergekit's `(Σ >= 0) * 2 - 1`), and an infinite L1 norm skips the
/// rescale instead of turning every finite element into NaN or ±Inf.
#[test]
fn opposite_infinities_merge_alike_on_both_backends() {
    let dir = tempfile::tempdir().unwrap();
    let base_v: Vec<f32> = (0..64)
        .map(|i| 0.01 * ((i * 7) % 13) as f32 - 0.05)
        .collect();
    let mut a_v: Vec<f32> = base_v
        .iter()
        .enumerate()
        .map(|(i, b)| b + 0.1 * ((i % 5) as f32 - 2.0))
        .collect();
    let mut b_v: Vec<f32> = base_v
        .iter()
        .enumerate()
        .map(|(i, b)| b - 0.07 * ((i % 3) as f32 - 1.0))
        .collect();
    a_v[10] = f32::INFINITY;
    b_v[10] = f32::NEG_INFINITY;
    let base = folder(dir.path(), "base", Dtype::F32, base_v);
    let a = folder(dir.path(), "a", Dtype::F32, a_v);
    let b = folder(dir.path(), "b", Dtype::F32, b_v);
    for method in [
        "ties",
        "dare_ties",
        "breadcrumbs_ties",
        "della",
        "dare_linear",
        "della_linear",
    ] {
        let mut results = Vec::new();
        for device in devices() {
            let out = dir.path().join(format!("{method}-{device}"));
            let o = merge(
                &base,
                &[&a, &b],
                &out,
                &[
                    &["--allow-nonfinite", "--device", device][..],
                    &at_half_density(method),
                ]
                .concat(),
            );
            assert!(
                o.status.success(),
                "{method} {device}: {}",
                String::from_utf8_lossy(&o.stderr)
            );
            let v = from_bytes(Dtype::F32, &read_folder(&out)["w"].2);
            for (i, x) in v.iter().enumerate() {
                assert!(
                    i == 10 || x.is_finite(),
                    "{method} {device}: element {i} = {x}"
                );
            }
            if method == "ties" {
                assert_eq!(v[10], f32::NEG_INFINITY, "{device}");
            }
            results.push(read_folder(&out)["w"].2.clone());
        }
        assert!(
            results.windows(2).all(|w| w[0] == w[1]),
            "{method}: backends differ"
        );
    }
}
