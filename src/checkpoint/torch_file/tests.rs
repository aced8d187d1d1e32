//! Torch zip files as torch 2.15 wrote them (tests/fixtures/torch, made by
//! `torch.save`), and hostile ones built here with the zip writer and hand-written pickles.

use super::*;
use crate::checkpoint::dtype::decode;
use crate::checkpoint::weight_file::crc32_of_file;
use crate::checkpoint::zip::tests::archive;

fn fixture(name: &str) -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/torch")
        .join(name)
}

fn values(file: &WeightFile, t: &TensorEntry) -> Vec<f32> {
    let mut bytes = vec![0u8; t.byte_len() as usize];
    file.read(t, 0, &mut bytes).unwrap();
    file.record_read(t, 0, &bytes);
    let mut out = vec![0f32; t.numel];
    decode(t.dtype, &bytes, &mut out);
    out
}

/// What `torch.save` wrote for an OrderedDict of bf16, f32, f16 tensors, a view sharing a
/// storage, an `nn.Parameter` and an empty tensor: each read back as torch holds it, and the
/// file's CRC-32 from the bytes read equals the whole file's.
#[test]
fn a_state_dict_reads_as_torch_wrote_it() {
    let path = fixture("state_dict.bin");
    let (file, tensors) = open(&path, &mut Interner::default()).unwrap();
    let get = |n: &str| tensors.iter().find(|t| &*t.name == n).unwrap();
    assert_eq!(tensors.len(), 6);
    assert!(tensors.windows(2).all(|p| p[0].offset <= p[1].offset));
    let a = get("a.weight");
    assert_eq!((a.dtype, &*a.shape), (DType::BF16, &[2, 3][..]));
    assert_eq!(values(&file, a), [1.5, -2.0, 3.0, 0.25, 4.0, -8.0]);
    assert_eq!(values(&file, get("b")), [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]);
    assert_eq!(values(&file, get("tied")), [2.0, 3.0, 4.0]);
    let h = get("h");
    assert_eq!(
        (h.dtype, values(&file, h)),
        (DType::F16, vec![1.0, 2.0, 3.0])
    );
    assert_eq!(values(&file, get("p")), [7.0, 9.0]);
    assert_eq!((get("empty").numel, &*get("empty").shape), (0, &[0, 3][..]));
    assert_eq!(file.checksum().unwrap(), crc32_of_file(&path).unwrap());
}

/// Each refusal names the file and the key, and says what to do.
#[test]
fn tensors_rlmerge_cannot_read_in_place_are_refused_by_name() {
    for (name, expect) in [
        ("transposed.bin", "tensor 't': not contiguous"),
        ("float64.bin", "torch.DoubleStorage"),
        (
            "nested.bin",
            "'model' is not a tensor rlmerge reads: it is a dict",
        ),
        ("legacy.bin", "before torch 1.6"),
    ] {
        let e = open(&fixture(name), &mut Interner::default())
            .err()
            .unwrap_or_else(|| panic!("{name} opened"));
        let msg = format!("{e:#}");
        assert!(msg.contains(expect) && msg.contains(name), "{name}: {msg}");
    }
}

/// A pickle that calls `os.system`, inside a torch-shaped zip: refused naming the global, a
/// usage error (exit 2), before any tensor is placed.
#[test]
fn a_malicious_pickle_in_a_bin_is_refused() {
    let evil = include_bytes!("../../../tests/fixtures/pickles/evil.pkl");
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("pytorch_model.bin");
    std::fs::write(&path, archive(&[("archive/data.pkl", evil)], false, 64)).unwrap();
    let e = open(&path, &mut Interner::default()).err().unwrap();
    let msg = format!("{e:#}");
    assert!(
        msg.contains("'posix.system'") && msg.contains("pytorch_model.bin"),
        "{msg}"
    );
    assert!(crate::error::is_usage(&e), "{msg}");
}

/// A pickle of one f32 tensor `w`: storage `0` of `numel` elements, from element `offset`, of
/// `size` (contiguous), the way `_rebuild_tensor_v2` is called.
fn one_tensor(class: &str, numel: u8, offset: i32, size: u8) -> Vec<u8> {
    let mut p = b"\x80\x02}(X\x01\x00\x00\x00wctorch._utils\n_rebuild_tensor_v2\n((X\x07\x00\x00\x00storage".to_vec();
    p.extend_from_slice(format!("ctorch\n{class}Storage\n").as_bytes());
    p.extend_from_slice(b"X\x01\x00\x00\x000X\x03\x00\x00\x00cpuK");
    p.push(numel);
    p.extend_from_slice(b"tQJ");
    p.extend_from_slice(&offset.to_le_bytes());
    p.extend_from_slice(b"K");
    p.push(size);
    p.extend_from_slice(b"\x85K\x01\x85\x89ccollections\nOrderedDict\n)RtRu.");
    p
}

/// The archive of `entries` opened from a file (kept while the returned folder lives).
fn open_built(
    entries: &[(&str, &[u8])],
) -> Result<(WeightFile, Vec<TensorEntry>, tempfile::TempDir)> {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("m.bin");
    std::fs::write(&path, archive(entries, false, 64)).unwrap();
    let (file, tensors) = open(&path, &mut Interner::default())?;
    Ok((file, tensors, dir))
}

#[test]
fn a_hand_built_archive_reads_and_its_bounds_hold() {
    let floats: Vec<u8> = [1.0f32, 2.0, 3.0, 4.0]
        .iter()
        .flat_map(|v| v.to_le_bytes())
        .collect();
    let pickle = one_tensor("Float", 4, 1, 3);
    let (file, t, _dir) = open_built(&[("m/data.pkl", &pickle), ("m/data/0", &floats)]).unwrap();
    assert_eq!(values(&file, &t[0]), [2.0, 3.0, 4.0]);
    for (pickle, storage, byteorder, expect) in [
        (
            one_tensor("Float", 4, 2, 3),
            &floats[..],
            &b"little"[..],
            "past its storage",
        ),
        (
            one_tensor("Float", 4, -1, 3),
            &floats[..],
            b"little",
            "negative storage offset",
        ),
        (
            one_tensor("Float", 4, 0, 3),
            &floats[..8],
            b"little",
            "truncated file?",
        ),
        (one_tensor("Float", 4, 0, 3), &floats[..], b"big", "big"),
        (
            one_tensor("Long", 4, 0, 3),
            &floats[..],
            b"little",
            "torch.LongStorage",
        ),
    ] {
        let e = open_built(&[
            ("m/data.pkl", &pickle),
            ("m/byteorder", byteorder),
            ("m/data/0", storage),
        ])
        .err()
        .unwrap_or_else(|| panic!("{expect}: opened"));
        let msg = format!("{e:#}");
        assert!(
            msg.contains(expect) && msg.contains("m.bin"),
            "{expect}: {msg}"
        );
    }
    let e = open_built(&[("m/data.pkl", &pickle)]).err().unwrap();
    assert!(
        format!("{e:#}").contains("which the archive does not hold"),
        "{e:#}"
    );
    let e = open_built(&[("m/data/0", &floats)]).err().unwrap();
    assert!(format!("{e:#}").contains("no ARCHIVE/data.pkl"), "{e:#}");
}

/// Every cut of a real file, and bytes flipped across it: an error or a file, never a panic.
#[test]
fn damaged_files_are_errors_not_panics() {
    let bytes = std::fs::read(fixture("state_dict.bin")).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("cut.bin");
    for n in (0..bytes.len()).step_by(7) {
        std::fs::write(&path, &bytes[..n]).unwrap();
        let e = open(&path, &mut Interner::default()).err().unwrap();
        assert!(format!("{e:#}").contains("cut.bin"), "{n}: {e:#}");
    }
    for i in (0..bytes.len()).step_by(3) {
        let mut b = bytes.clone();
        b[i] ^= 0x5a;
        std::fs::write(&path, &b).unwrap();
        let _ = open(&path, &mut Interner::default());
    }
}
