//! The unpickler against pickles torch 2.15 and Python wrote (tests/fixtures/pickles) and hostile
//! ones built here.

use super::*;

const STATE_DICT: &[u8] = include_bytes!("../../../tests/fixtures/pickles/state_dict.pkl");
const DTENSOR: &[u8] = include_bytes!("../../../tests/fixtures/pickles/dtensor.pkl");
const EVIL: &[u8] = include_bytes!("../../../tests/fixtures/pickles/evil.pkl");
const EVIL_P4: &[u8] = include_bytes!("../../../tests/fixtures/pickles/evil_p4.pkl");

/// An `OrderedDict` saved by torch.save: three tensors (one a view of another's storage) as
/// calls of `_rebuild_tensor_v2` with their storages' persistent ids, and its `_metadata`.
#[test]
fn a_torch_state_dict_reads_as_the_calls_it_asks_for() {
    let v = read(STATE_DICT, "state_dict.pkl").unwrap();
    assert_eq!(
        v.callable_name().as_deref(),
        Some("collections.OrderedDict")
    );
    let Value::Object(o) = &v else { panic!() };
    let o = o.borrow();
    let names: Vec<String> = o
        .items
        .iter()
        .map(|(k, _)| match k {
            Value::Str(s) => s.to_string(),
            _ => panic!(),
        })
        .collect();
    assert_eq!(names, ["a.weight", "b", "tied"]);
    let tied = &o.items[2].1;
    assert_eq!(
        tied.callable_name().as_deref(),
        Some("torch._utils._rebuild_tensor_v2")
    );
    let Value::Object(t) = tied else { panic!() };
    let Value::Tuple(args) = &t.borrow().args else {
        panic!()
    };
    // (storage, storage offset 3, size (3,), stride (1,), …)
    assert!(matches!(args[0], Value::Persistent(_)));
    assert!(matches!(args[1], Value::Int(3)));
    assert!(o.state.is_some(), "the _metadata BUILD");
}

#[test]
fn a_dtensor_reads_with_its_spec() {
    let v = read(DTENSOR, "dtensor.pkl").unwrap();
    let Value::Dict(d) = &v else {
        panic!("{}", v.kind())
    };
    let w = &d.borrow()[0].1;
    assert_eq!(
        w.callable_name().as_deref(),
        Some("torch._tensor._rebuild_from_type_v2")
    );
}

/// A pickle that calls `os.system` (`posix.system` as Python writes it), in protocols 2 and 4:
/// refused by name as a usage error; nothing is called (there is nothing that could call it).
#[test]
fn a_global_torch_does_not_write_is_refused_by_name() {
    for evil in [EVIL, EVIL_P4] {
        let e = read(evil, "evil.pkl").unwrap_err();
        let msg = format!("{e:#}");
        assert!(msg.contains("'posix.system'"), "{msg}");
        assert!(crate::error::is_usage(&e), "{msg}");
    }
    for name in [
        "builtins.eval",
        "torch.load",
        "torch.storage._load_from_bytes",
        "_codecs.encode",
    ] {
        assert!(!allowed(name), "{name}");
    }
}

#[test]
fn damaged_pickles_are_errors_not_panics() {
    // Every prefix of a real pickle, and every byte of it flipped: an error or a value, never a
    // panic or a hang.
    for n in 0..STATE_DICT.len() {
        assert!(read(&STATE_DICT[..n], "cut").is_err(), "{n} bytes");
    }
    for i in 0..DTENSOR.len() {
        for flip in [0x01u8, 0x80, 0xff] {
            let mut bytes = DTENSOR.to_vec();
            bytes[i] ^= flip;
            let _ = read(&bytes, "flipped");
        }
    }
    // A string that claims more bytes than there are; a memo read before it is written; a tuple
    // of the stack below a MARK; an unknown opcode.
    for bad in [
        &b"\x80\x02X\xff\xff\xff\x7fabc."[..],
        b"\x80\x02h\x05.",
        b"\x80\x02K\x01(\x86.",
        b"\x80\x02\xff.",
        b"\x80\x01N.",
    ] {
        assert!(read(bad, "bad").is_err(), "{bad:?}");
    }
}
