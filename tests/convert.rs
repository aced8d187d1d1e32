//! `rlmerge convert` (issue #52 item 5): one model as a trainer or the Hub wrote it, written as a
//! Hugging Face safetensors folder holding the same tensors — with the atomic output, record,
//! saved recipe and `verify` of a merge. Trainer formats (verl shards, `.bin`, BASE+ADAPTER)
//! against their official converters: python/tests/test_convert.py.

mod common;
use common::*;
use safetensors::tensor::Dtype;
use std::path::Path;

fn convert(source: &Path, out: &Path, extra: &[&str]) -> std::process::Output {
    rlmerge()
        .arg("convert")
        .arg(source)
        .arg("-o")
        .arg(out)
        .args(extra)
        .output()
        .unwrap()
}

fn model_files(dir: &Path) -> Vec<(String, Vec<u8>)> {
    files_of(dir, |p| {
        p.extension()
            .is_some_and(|e| e == "safetensors" || e == "json")
            && !p.ends_with(rlmerge::record::RECORD_FILE)
    })
}

#[test]
fn a_folder_converts_to_its_own_tensors_and_its_record_remakes_it() {
    let f = fixture(41, Dtype::BF16, &odd_shapes(), &DENSITIES[..1], 3);
    let source = &f.agents[0];
    let mut outs = Vec::new();
    for threads in ["1", "3"] {
        let out = f.dir.path().join(format!("out{threads}"));
        let o = convert(
            source,
            &out,
            &["-q", "--shard-size", "2KB", "--threads", threads],
        );
        assert!(o.status.success(), "{}", err_of(&o));
        assert!(String::from_utf8_lossy(&o.stdout).starts_with("converted "));
        assert_eq!(read_folder(&out), read_folder(source));
        assert!(out.join("model.safetensors.index.json").exists());
        outs.push(out);
    }
    assert_eq!(model_files(&outs[0]), model_files(&outs[1]), "threads");
    let card = std::fs::read_to_string(outs[0].join("README.md")).unwrap();
    assert!(card.contains("# Converted with rlmerge"), "{card}");
    let o = rlmerge()
        .arg("verify")
        .arg(&outs[0])
        .arg("--against")
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", err_of(&o));
    // The saved recipe, run from elsewhere, writes the same folder.
    let again = f.dir.path().join("again");
    let o = rlmerge()
        .current_dir(std::env::temp_dir())
        .arg("run")
        .arg(outs[0].join("mergekit_config.yml"))
        .args(["-q", "-o"])
        .arg(&again)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", err_of(&o));
    assert_eq!(model_files(&again), model_files(&outs[0]));
}

#[test]
fn out_dtype_widens_exactly() {
    let f = fixture(42, Dtype::BF16, &odd_shapes(), &DENSITIES[..1], 1);
    let out = f.dir.path().join("out");
    let o = convert(&f.base, &out, &["-q", "--out-dtype", "f32"]);
    assert!(o.status.success(), "{}", err_of(&o));
    let (got, want) = (read_folder(&out), read_folder(&f.base));
    for (name, (dtype, shape, bytes)) in &want {
        let g = &got[name];
        assert_eq!((g.0, &g.1), (Dtype::F32, shape), "{name}");
        assert_eq!(
            from_bytes(Dtype::F32, &g.2),
            from_bytes(*dtype, bytes),
            "{name}"
        );
    }
}

#[test]
fn a_verl_actor_converts_to_what_verls_converter_wrote() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out");
    let fixtures = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/verl");
    let o = convert(&fixtures.join("actor"), &out, &["-q"]);
    assert!(o.status.success(), "{}", err_of(&o));
    assert_eq!(
        read_file(&out.join("model.safetensors")),
        read_file(&fixtures.join("converted.safetensors"))
    );
    assert!(out.join("config.json").exists());
}

#[test]
fn a_conversion_never_writes_over_its_source_and_an_interrupted_one_leaves_nothing() {
    let f = fixture(43, Dtype::BF16, &odd_shapes(), &DENSITIES[..1], 1);
    let before = read_folder(&f.base);
    for out in [f.base.clone(), f.base.join("inside")] {
        let o = convert(&f.base, &out, &["-q", "--force"]);
        assert_eq!(o.status.code(), Some(2), "{}", err_of(&o));
    }
    assert_eq!(read_folder(&f.base), before);
    assert!(!f.base.join("inside").exists());

    let f = processes::slow_fixture(44);
    let out = f.dir.path().join("out");
    let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_rlmerge"));
    cmd.args(["convert", "-q", "--threads", "1", "--tile-elems", "1"])
        .arg(&f.base)
        .arg("-o")
        .arg(&out)
        .stderr(std::process::Stdio::piped());
    processes::default_signals(&mut cmd);
    let child = cmd.spawn().unwrap();
    processes::wait_until_running(f.dir.path());
    processes::assert_interrupted(child, f.dir.path(), &out);
}

/// A 3 × 5 FP8 matrix in blocks of 2 × 2 (scales 2 × 3, partial blocks at the edges): each
/// value is its byte's float8_e4m3fn value times its block's scale (all exact in bf16 here).
#[test]
fn an_fp8_matrix_converts_to_its_bytes_times_its_block_scales() {
    use safetensors::tensor::TensorView;
    let dir = tempfile::tempdir().unwrap();
    let source = dir.path().join("fp8");
    // float8_e4m3fn bytes and their values (torch: tensor.to(float8_e4m3fn).view(uint8)).
    let bytes: [u8; 15] = [
        0x38, 0x3c, 0xb8, 0x30, 0x00, 0x7e, 0x38, 0x38, 0x3c, 0x30, 0x30, 0xb8, 0x00, 0x38, 0x01,
    ];
    let values = [
        1.0,
        1.5,
        -1.0,
        0.5,
        0.0,
        448.0,
        1.0,
        1.0,
        1.5,
        0.5,
        0.5,
        -1.0,
        0.0,
        1.0,
        2f32.powi(-9),
    ];
    let scales: [f32; 6] = [0.5, 2.0, 0.25, 4.0, 1.0, 3.0];
    let want: Vec<f32> = (0..15)
        .map(|e| values[e] * scales[(e / 5) / 2 * 3 + (e % 5) / 2])
        .collect();
    let scale_bytes = to_bytes(Dtype::F32, &scales);
    let norm = to_bytes(Dtype::BF16, &[1.0, 2.0, 3.0, 4.0, 5.0]);
    write_folder(&source, &[case_tensor("x", &[1], &[0.0])], 1);
    let tensors = vec![
        (
            "w.weight",
            TensorView::new(Dtype::F8_E4M3, vec![3, 5], &bytes).unwrap(),
        ),
        (
            "w.weight_scale_inv",
            TensorView::new(Dtype::F32, vec![2, 3], &scale_bytes).unwrap(),
        ),
        (
            "norm.weight",
            TensorView::new(Dtype::BF16, vec![5], &norm).unwrap(),
        ),
    ];
    safetensors::tensor::serialize_to_file(tensors, None, &source.join("model.safetensors"))
        .unwrap();
    let config = r#"{"architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "quantization_config": {"quant_method": "fp8", "weight_block_size": [2, 2]}}"#;
    std::fs::write(source.join("config.json"), config).unwrap();
    let out = dir.path().join("out");
    let o = convert(&source, &out, &["-q"]);
    assert!(o.status.success(), "{}", err_of(&o));
    let got = read_folder(&out);
    assert_eq!(got.len(), 2, "the scales are consumed: {:?}", got.keys());
    assert_eq!(got["w.weight"].0, Dtype::BF16);
    assert_eq!(from_bytes(Dtype::BF16, &got["w.weight"].2), want);
    assert_eq!(got["norm.weight"].2, norm);
    let config = std::fs::read_to_string(out.join("config.json")).unwrap();
    assert!(!config.contains("quantization_config"), "{config}");
}
