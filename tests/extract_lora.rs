//! `rlmerge extract-lora` (issue #54 item 1): a fine-tuned model as a PEFT adapter against its
//! base. At full rank the factors give back Δ (f32 inputs, to f32 rounding); at rank r they are
//! its best rank-r approximation, whose kept share the command reports; bad requests and inputs
//! are refused by name with nothing written; the bytes do not depend on the thread count.

mod common;
use common::*;
use safetensors::tensor::Dtype;
use std::path::Path;

/// A base and two agents in f32: a 24 × 16 and a 16 × 40 projection with biases, a norm.
fn models() -> Fixture {
    fixture(
        71,
        Dtype::F32,
        &[
            ("model.layers.0.self_attn.q_proj.weight", vec![24, 16]),
            ("model.layers.0.self_attn.q_proj.bias", vec![24]),
            ("model.layers.0.mlp.down_proj.weight", vec![16, 40]),
            ("model.layers.0.input_layernorm.weight", vec![16]),
        ],
        &[0.3, 0.6],
        1,
    )
}

fn extract(f: &Fixture, out: &Path, extra: &[&str]) -> std::process::Output {
    rlmerge()
        .arg("extract-lora")
        .arg("--base")
        .arg(&f.base)
        .arg("--model")
        .arg(&f.agents[0])
        .arg("-o")
        .arg(out)
        .args(extra)
        .output()
        .unwrap()
}

/// B·A of module `m` of the adapter in `dir`, row-major m × n.
fn product(dir: &Path, module: &str) -> Vec<f64> {
    let t = read_file(&dir.join("adapter_model.safetensors"));
    let (da, sa, a) = &t[&format!("base_model.model.{module}.lora_A.weight")];
    let (db, sb, b) = &t[&format!("base_model.model.{module}.lora_B.weight")];
    let (a, b) = (from_bytes(*da, a), from_bytes(*db, b));
    let (r, n, m) = (sa[0], sa[1], sb[0]);
    assert_eq!(sb[1], r);
    let mut p = vec![0.0f64; m * n];
    for i in 0..m {
        for k in 0..r {
            for j in 0..n {
                p[i * n + j] += f64::from(b[i * r + k]) * f64::from(a[k * n + j]);
            }
        }
    }
    p
}

/// The matrices of [`models`] the adapter factors.
const FACTORED: [&str; 2] = [
    "model.layers.0.self_attn.q_proj",
    "model.layers.0.mlp.down_proj",
];

/// The model's update of `module`'s weight, row-major.
fn delta(f: &Fixture, module: &str) -> Vec<f64> {
    let name = format!("{module}.weight");
    let b = f.base_tensors.iter().find(|t| t.name == name).unwrap();
    let a = f.agent_tensors[0].iter().find(|t| t.name == name).unwrap();
    a.values
        .iter()
        .zip(&b.values)
        .map(|(x, y)| f64::from(*x) - f64::from(*y))
        .collect()
}

fn rel(a: &[f64], b: &[f64]) -> f64 {
    let d: f64 = a.iter().zip(b).map(|(x, y)| (x - y) * (x - y)).sum();
    let n: f64 = b.iter().map(|y| y * y).sum();
    (d / n).sqrt()
}

#[test]
fn full_rank_gives_the_update_back_and_a_low_rank_says_what_it_keeps() {
    let f = models();
    let out = f.dir.path().join("full");
    let o = extract(&f, &out, &["--rank", "16", "-v"]);
    assert!(o.status.success(), "{}", err_of(&o));
    for module in FACTORED {
        let e = rel(&product(&out, module), &delta(&f, module));
        assert!(e < 1e-5, "{module}: {e}");
    }
    let stdout = String::from_utf8_lossy(&o.stdout);
    assert!(stdout.contains("keeping 100.0 %"), "{stdout}");
    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("adapter_config.json")).unwrap())
            .unwrap();
    assert_eq!(config["r"], 16);
    assert_eq!(config["lora_alpha"], 16);
    assert_eq!(
        config["modules_to_save"][0],
        "model.layers.0.input_layernorm"
    );
    // The one bias's module is factored but another is not biased: left out, and said.
    assert!(
        err_of(&o).contains("changed biases left out"),
        "{}",
        err_of(&o)
    );
    // A low rank keeps less, reports it per module, and warns where it keeps under one half.
    for rank in ["1", "2"] {
        let low = f.dir.path().join(format!("low{rank}"));
        let o = extract(&f, &low, &["--rank", rank, "-v"]);
        assert!(o.status.success(), "{}", err_of(&o));
        let stdout = String::from_utf8_lossy(&o.stdout);
        assert!(stdout.contains(&format!("rank    {rank}")), "{stdout}");
        let kept: f64 = stdout
            .split("keeping ")
            .nth(1)
            .unwrap()
            .split(' ')
            .next()
            .unwrap()
            .parse()
            .unwrap();
        assert!(kept < 100.0, "{stdout}");
        let warned = err_of(&o).contains("of the update's energy");
        assert_eq!(warned, kept < 50.0, "{kept}: {}", err_of(&o));
    }
    // An error target gives each module the least rank that meets it.
    let target = f.dir.path().join("target");
    let o = extract(&f, &target, &["--rank", "16", "--rel-error", "0.5"]);
    assert!(o.status.success(), "{}", err_of(&o));
    for module in FACTORED {
        let e = rel(&product(&target, module), &delta(&f, module));
        assert!(e <= 0.5 + 1e-6, "{module}: {e}");
    }
}

/// mergekit's options: `--sv-epsilon` drops small singular values, `--save-module` saves a
/// module whole, `-i`/`-e` may be repeated (any matches).
#[test]
fn mergekit_options_drop_small_directions_save_modules_and_filter() {
    let f = models();
    let q = "model.layers.0.self_attn.q_proj";
    // Every singular value of a random update is above 1e-9 and below 1e9.
    let all = f.dir.path().join("all");
    assert!(extract(&f, &all, &["--rank", "8", "--sv-epsilon", "1e-9"])
        .status
        .success());
    let none = f.dir.path().join("none");
    let o = extract(&f, &none, &["--rank", "8", "--sv-epsilon", "1e9", "-v"]);
    assert!(o.status.success(), "{}", err_of(&o));
    assert!(
        String::from_utf8_lossy(&o.stdout).contains("rank    0"),
        "{}",
        String::from_utf8_lossy(&o.stdout)
    );
    let config = |dir: &Path| -> serde_json::Value {
        serde_json::from_str(&std::fs::read_to_string(dir.join("adapter_config.json")).unwrap())
            .unwrap()
    };
    assert_eq!(config(&all)["r"], 8);
    // Every direction dropped: no factors written, no target named.
    assert!(config(&none)["target_modules"]
        .as_array()
        .unwrap()
        .is_empty());
    let factors = read_file(&none.join("adapter_model.safetensors"));
    assert!(
        !factors.keys().any(|k| k.contains("lora_")),
        "{:?}",
        factors.keys()
    );
    let saved = f.dir.path().join("saved");
    assert!(extract(&f, &saved, &["--save-module", "q_proj"])
        .status
        .success());
    let c = config(&saved);
    assert!(
        c["modules_to_save"]
            .as_array()
            .unwrap()
            .iter()
            .any(|m| m == q),
        "{c}"
    );
    assert!(
        !c["target_modules"]
            .as_array()
            .unwrap()
            .iter()
            .any(|m| m == q),
        "{c}"
    );
    let whole = read_file(&saved.join("adapter_model.safetensors"));
    let (_, _, bytes) = &whole[&format!("base_model.model.{q}.weight")];
    let theirs = f.agent_tensors[0]
        .iter()
        .find(|t| t.name == format!("{q}.weight"))
        .unwrap();
    assert_eq!(from_bytes(Dtype::F32, bytes), theirs.values);
    let filtered = f.dir.path().join("filtered");
    let o = extract(
        &f,
        &filtered,
        &[
            "-i",
            "q_proj",
            "--include-regex",
            "down_proj",
            "-e",
            "layernorm",
        ],
    );
    assert!(o.status.success(), "{}", err_of(&o));
    let c = config(&filtered);
    assert_eq!(c["target_modules"].as_array().unwrap().len(), 2, "{c}");
    assert!(c["modules_to_save"].as_array().unwrap().is_empty(), "{c}");
}

#[test]
fn the_bytes_do_not_depend_on_the_thread_count() {
    let f = models();
    let (one, two) = (f.dir.path().join("one"), f.dir.path().join("two"));
    assert!(extract(&f, &one, &["--rank", "3", "--threads", "1"])
        .status
        .success());
    assert!(extract(&f, &two, &["--rank", "3", "--threads", "2"])
        .status
        .success());
    let file = "adapter_model.safetensors";
    assert_eq!(
        std::fs::read(one.join(file)).unwrap(),
        std::fs::read(two.join(file)).unwrap()
    );
}

#[test]
fn bad_requests_and_inputs_are_refused_by_name_and_write_nothing() {
    let f = models();
    let out = f.dir.path().join("out");
    for (args, needle) in [
        (&["--rank", "0"][..], "--rank"),
        (&["--rel-error", "1.5"][..], "--rel-error"),
        (&["--include", "("][..], "--include"),
        (&["--sv-epsilon=-1"][..], "--sv-epsilon"),
        (&["--max-held-mib=-1"][..], "--max-held-mib"),
        (&["--max-held-mib", "1.5"][..], "--max-held-mib"),
        (
            &["--max-held-mib", "99999999999999999999999"][..],
            "--max-held-mib",
        ),
    ] {
        let o = extract(&f, &out, args);
        assert_eq!(o.status.code(), Some(2), "{args:?}: {}", err_of(&o));
        assert!(err_of(&o).contains(needle), "{}", err_of(&o));
        assert!(!out.exists());
    }
    // A base that is nowhere, or a file, is named.
    let file = f.dir.path().join("file");
    std::fs::write(&file, b"x").unwrap();
    for base in [f.dir.path().join("nowhere"), file] {
        let o = rlmerge()
            .args(["extract-lora", "--model"])
            .arg(&f.agents[0])
            .arg("--base")
            .arg(&base)
            .arg("-o")
            .arg(&out)
            .output()
            .unwrap();
        assert!(!o.status.success());
        assert!(
            err_of(&o).contains(&*base.to_string_lossy()),
            "{}",
            err_of(&o)
        );
        assert!(!out.exists());
    }
    // A model of another shape, or holding a NaN, names the tensor.
    let other = fixture(
        72,
        Dtype::F32,
        &[
            ("model.layers.0.self_attn.q_proj.weight", vec![24, 8]),
            ("model.layers.0.self_attn.q_proj.bias", vec![24]),
            ("model.layers.0.mlp.down_proj.weight", vec![16, 40]),
            ("model.layers.0.input_layernorm.weight", vec![16]),
        ],
        &[0.3],
        1,
    );
    let o = rlmerge()
        .args(["extract-lora", "--base"])
        .arg(&f.base)
        .arg("--model")
        .arg(&other.agents[0])
        .arg("-o")
        .arg(&out)
        .output()
        .unwrap();
    assert!(!o.status.success());
    assert!(err_of(&o).contains("q_proj.weight"), "{}", err_of(&o));
    assert!(!out.exists());
    let mut nan = f.agent_tensors[0].clone();
    nan[0].values[3] = f32::NAN;
    let bad = f.dir.path().join("nan-agent");
    write_folder(&bad, &nan, 1);
    let o = rlmerge()
        .args(["extract-lora", "--base"])
        .arg(&f.base)
        .arg("--model")
        .arg(&bad)
        .arg("-o")
        .arg(&out)
        .output()
        .unwrap();
    assert!(!o.status.success());
    assert!(err_of(&o).contains("NaN"), "{}", err_of(&o));
    assert!(!out.exists());
    assert_eq!(leftovers(f.dir.path()), Vec::<String>::new());
    // An output that exists is replaced only with --force.
    assert!(extract(&f, &out, &["--rank", "2"]).status.success());
    let o = extract(&f, &out, &["--rank", "2"]);
    assert_eq!(o.status.code(), Some(2), "{}", err_of(&o));
    assert!(extract(&f, &out, &["--rank", "2", "--force"])
        .status
        .success());
}

/// Ctrl-C in the middle of an extraction: exit 130, nothing at the output, no scratch left.
#[test]
fn an_interrupted_extraction_leaves_nothing() {
    let shapes: Vec<(String, Vec<usize>)> = (0..4)
        .map(|l| {
            (
                format!("model.layers.{l}.mlp.up_proj.weight"),
                vec![1536, 1536],
            )
        })
        .collect();
    let named: Vec<(&str, Vec<usize>)> = shapes
        .iter()
        .map(|(n, s)| (n.as_str(), s.clone()))
        .collect();
    let f = fixture(73, Dtype::F32, &named, &[0.5], 1);
    let out = f.dir.path().join("out");
    let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_rlmerge"));
    cmd.args(["extract-lora", "--rank", "64", "--threads", "1", "--base"])
        .arg(&f.base)
        .arg("--model")
        .arg(&f.agents[0])
        .arg("-o")
        .arg(&out);
    interrupt_midway(cmd, f.dir.path(), &out);
}

/// A NaN is refused wherever it lies — in a factored matrix, a vector saved whole, a module the
/// filters leave out, past the first million elements of a matrix — naming the tensor and the
/// element, with nothing written; the update of a tensor not factored is checked chunk by chunk.
#[test]
fn a_nan_is_named_by_tensor_and_element_whatever_the_tensors_role() {
    let big = ("model.layers.0.mlp.up_proj.weight", vec![1040, 1024]);
    let f = fixture(
        73,
        Dtype::F32,
        &[
            ("model.layers.0.self_attn.q_proj.weight", vec![24, 16]),
            ("model.layers.0.input_layernorm.weight", vec![16]),
            ("model.layers.0.self_attn.k_proj.weight", vec![8, 16]),
            big,
        ],
        &[0.3],
        1,
    );
    let out = f.dir.path().join("out");
    let cases: [(usize, usize, &[&str]); 5] = [
        (0, 7, &[]),
        (1, 3, &[]),
        (2, 5, &["-e", "k_proj"]),
        (
            3,
            (1 << 20) + 5,
            &["-e", "up_proj", "--save-module", "up_proj"],
        ),
        (3, (1 << 20) + 9, &["--max-held-mib", "0"]),
    ];
    for (i, (tensor, element, extra)) in cases.into_iter().enumerate() {
        let mut nan = f.agent_tensors[0].clone();
        nan[tensor].values[element] = f32::NAN;
        let bad = f.dir.path().join(format!("nan-{i}"));
        write_folder(&bad, &nan, 1);
        let o = rlmerge()
            .args(["extract-lora", "--rank", "2", "--base"])
            .arg(&f.base)
            .arg("--model")
            .arg(&bad)
            .arg("-o")
            .arg(&out)
            .args(extra)
            .output()
            .unwrap();
        assert_eq!(o.status.code(), Some(1), "{}", err_of(&o));
        let err = err_of(&o);
        assert!(
            err.contains(&nan[tensor].name) && err.contains(&format!("element {element} ")),
            "{err}"
        );
        assert!(!out.exists());
    }
    assert_eq!(leftovers(f.dir.path()), Vec::<String>::new());
}

/// An update the Gram path factors (a rank over 32, a long thin matrix at rank 8 or more) or one
/// over `--max-held-mib` is never held: its short-side rows are read from the files (a tall
/// matrix's rows, a wide one's columns), in blocks. At full rank the factors give Δ back, tall and
/// wide, the same bytes on any number of threads; a square matrix the Lanczos process factors
/// when held keeps the same share read from the files.
#[test]
fn an_update_read_from_the_files_gives_the_held_updates_factors() {
    // 1024 columns: 4096 rows a block, so the short-side rows come in two blocks.
    let f = fixture(
        79,
        Dtype::F32,
        &[
            ("model.layers.0.mlp.up_proj.weight", vec![4200, 1024]),
            ("model.layers.0.mlp.down_proj.weight", vec![1024, 4200]),
            ("model.layers.0.self_attn.o_proj.weight", vec![1100, 1024]),
        ],
        &[0.3],
        1,
    );
    let run = |name: &str, extra: &[&str]| {
        let out = f.dir.path().join(name);
        let o = extract(&f, &out, extra);
        assert!(o.status.success(), "{}", err_of(&o));
        (out, String::from_utf8_lossy(&o.stdout).into_owned())
    };
    let file = |dir: &Path| std::fs::read(dir.join("adapter_model.safetensors")).unwrap();
    let thin = ["-e", "o_proj", "--rank", "1024"];
    let (one, _) = run("one", &[&thin[..], &["--threads", "1"]].concat());
    let (two, _) = run("two", &[&thin[..], &["--threads", "2"]].concat());
    assert!(
        file(&one) == file(&two),
        "the factors depend on the thread count"
    );
    for module in ["model.layers.0.mlp.up_proj", "model.layers.0.mlp.down_proj"] {
        let e = rel(&product(&one, module), &delta(&f, module));
        assert!(e < 1e-5, "{module}: {e}");
    }
    let square = "model.layers.0.self_attn.o_proj";
    let (held, said_held) = run("held", &["-i", "o_proj", "--rank", "8", "-v"]);
    let (read, said_read) = run(
        "read",
        &["-i", "o_proj", "--rank", "8", "-v", "--max-held-mib", "1"],
    );
    let kept = |said: &str| said.split("keeping ").nth(1).unwrap().to_string();
    assert_eq!(kept(&said_held), kept(&said_read));
    let truth = delta(&f, square);
    let (h, r) = (product(&held, square), product(&read, square));
    let (eh, er) = (rel(&h, &truth), rel(&r, &truth));
    assert!(er < 1.0 && (eh - er).abs() < 1e-9, "{eh} {er}");
    assert!(rel(&r, &h) < 1e-5, "{}", rel(&r, &h));
}

/// `--embed-lora` factors a changed embedding as PEFT's `lora_embedding_A` (r × vocab) and
/// `lora_embedding_B` (hidden × r), ΔW = (B·A)ᵀ: at full rank they give Δ back.
#[test]
fn embed_lora_gives_the_embeddings_update_back_as_peft_lays_it_out() {
    let f = fixture(
        83,
        Dtype::F32,
        &[
            ("model.embed_tokens.weight", vec![40, 16]),
            ("model.layers.0.self_attn.q_proj.weight", vec![16, 16]),
        ],
        &[0.4],
        1,
    );
    let out = f.dir.path().join("out");
    let o = extract(&f, &out, &["--embed-lora", "--rank", "16"]);
    assert!(o.status.success(), "{}", err_of(&o));
    let t = read_file(&out.join("adapter_model.safetensors"));
    let key = |s: &str| format!("base_model.model.model.embed_tokens.{s}");
    let (da, sa, a) = &t[&key("lora_embedding_A")];
    let (db, sb, b) = &t[&key("lora_embedding_B")];
    assert_eq!((&sa[..], &sb[..]), (&[16, 40][..], &[16, 16][..]));
    let (a, b) = (from_bytes(*da, a), from_bytes(*db, b));
    let (r, vocab, hidden) = (16, 40, 16);
    let mut got = vec![0.0f64; vocab * hidden];
    for i in 0..vocab {
        for j in 0..hidden {
            got[i * hidden + j] = (0..r)
                .map(|k| f64::from(b[j * r + k]) * f64::from(a[k * vocab + i]))
                .sum();
        }
    }
    let e = rel(&got, &delta(&f, "model.embed_tokens"));
    assert!(e < 1e-5, "{e}");
    assert!(!t.contains_key("base_model.model.model.embed_tokens.weight"));
}
