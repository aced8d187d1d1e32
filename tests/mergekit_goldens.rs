//! rlmerge against mergekit 0.1.5 itself: every recipe in tests/fixtures/mergekit/recipes/ runs on
//! the small Llama-shaped bf16 models beside it, and each output element must be within 1 ULP of
//! what mergekit wrote for the same recipe (`dtype: float32`, `out_dtype: bfloat16`: mergekit
//! computes in f32 and rounds once to bf16, as rlmerge does; its outputs are checked in under
//! expected/, made by scripts/mergekit_goldens.py, so CI needs no torch). Same tensor names and
//! shapes, and the same layer count in config.json.

mod common;
use common::*;
use safetensors::tensor::Dtype;
use std::path::{Path, PathBuf};

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/mergekit")
}

/// Integers ordered like the f32 values, adjacent floats one apart.
fn ordered(x: f32) -> i64 {
    let b = x.to_bits() as i32 as i64;
    if b < 0 {
        -(b & 0x7fff_ffff)
    } else {
        b
    }
}

fn recipes() -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(root().join("recipes"))
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .filter_map(|n| n.strip_suffix(".yml").map(str::to_string))
        .collect();
    names.sort();
    names
}

/// arcee_fusion keeps an element when its importance |τ|·KL(row) reaches a fence over the
/// tensor's importances. mergekit's KL is an f32 sum with cancellation (up to 0.7 % off on a
/// dense agent's rows, far more on rows that barely changed), rlmerge's an f64 one, so elements
/// at the fence may fall on the other side: like ties at a rank cut, at most this share of the
/// elements may differ, and only by that decision (one output the base's value, the other the
/// model's).
const FENCE_FLIPS: f64 = 0.001;

/// The model's and the base's tensors of a fusion recipe (base first), or none.
fn fusion_inputs(name: &str) -> Option<[std::collections::BTreeMap<String, Read>; 2]> {
    let recipe: serde_yaml::Value = serde_yaml::from_str(
        &std::fs::read_to_string(root().join("recipes").join(format!("{name}.yml"))).unwrap(),
    )
    .unwrap();
    if recipe["merge_method"].as_str() != Some("arcee_fusion") {
        return None;
    }
    let base = recipe["base_model"].as_str().unwrap();
    let models = recipe["models"].as_sequence().unwrap();
    let model = models
        .iter()
        .map(|m| m["model"].as_str().unwrap())
        .find(|&m| m != base)
        .unwrap();
    let read = |m: &str| read_folder(&root().join("models").join(m));
    Some([read(base), read(model)])
}

/// Runs recipe `name` with rlmerge and returns the worst distance in ULP from mergekit's output
/// (fence flips of arcee_fusion aside) and the number of such flips.
fn check(name: &str, out: &Path) -> (i64, usize) {
    rlmerge()
        .current_dir(root().join("models"))
        .arg("run")
        .arg(root().join("recipes").join(format!("{name}.yml")))
        .args(["-q", "--device", "cpu", "-o"])
        .arg(out)
        .assert()
        .success();
    let want = read_file(&root().join("expected").join(format!("{name}.safetensors")));
    let got = read_folder(out);
    assert_eq!(
        got.keys().collect::<Vec<_>>(),
        want.keys().collect::<Vec<_>>(),
        "{name}: tensor names"
    );
    let fusion = fusion_inputs(name);
    let rows = token_rows(name, out);
    let (mut worst, mut flips, mut total) = (0, 0usize, 0usize);
    for (tensor, (wdt, wshape, wbytes)) in &want {
        let (gdt, gshape, gbytes) = &got[tensor];
        assert_eq!((*gdt, gshape), (Dtype::BF16, wshape), "{name}: {tensor}");
        assert_eq!(*wdt, Dtype::BF16);
        // Token-indexed tensors of a tokenizer recipe: mergekit's rows put in rlmerge's order.
        let reordered;
        let wbytes = match &rows {
            Some(rows) if tensor.contains("embed_tokens") || tensor.contains("lm_head") => {
                let row_bytes = wbytes.len() / wshape[0];
                reordered = rows
                    .iter()
                    .flat_map(|&r| &wbytes[r * row_bytes..(r + 1) * row_bytes])
                    .copied()
                    .collect::<Vec<u8>>();
                &reordered
            }
            _ => wbytes,
        };
        let inputs = fusion.as_ref().map(|[b, m]| {
            let values = |r: &Read| from_bytes(r.0, &r.2);
            (values(&b[tensor]), values(&m[tensor]))
        });
        total += wshape.iter().product::<usize>();
        for (i, (g, w)) in from_bytes(*gdt, gbytes)
            .iter()
            .zip(from_bytes(*wdt, wbytes))
            .enumerate()
        {
            if let Some((b, m)) = &inputs {
                let swapped = (*g, w) == (b[i], m[i]) || (*g, w) == (m[i], b[i]);
                if *g != w && swapped {
                    flips += 1;
                    continue;
                }
            }
            // bf16 values are f32 values with 16 low bits zero: one bf16 ULP is 2¹⁶ f32 ones.
            let d = (ordered(*g) - ordered(w)).abs() >> 16;
            // A weighted sum that cancels: mergekit's f32 sum fuses a multiply-add where
            // rlmerge rounds each product (−9.5·10⁻¹² against 0 for 0.6·35·2⁻¹⁵ − 0.4·52.5·2⁻¹⁵);
            // both are zero at the weights' scale (10⁻²), yet far apart in ULP near zero.
            let cancelled = (*g - w).abs() <= 1e-9;
            assert!(
                d <= 1 || cancelled,
                "{name}: {tensor}[{i}] is {g}, mergekit wrote {w} ({d} ULP apart)"
            );
            if !cancelled {
                worst = worst.max(d);
            }
        }
    }
    let config = |p: PathBuf| -> serde_json::Value {
        serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap()
    };
    let (g, w) = (
        config(out.join("config.json")),
        config(root().join("expected").join(format!("{name}.config.json"))),
    );
    for key in ["num_hidden_layers", "layer_types", "vocab_size"] {
        assert_eq!(g[key], w[key], "{name}: config.json {key}");
    }
    assert!(
        flips as f64 <= FENCE_FLIPS * total as f64,
        "{name}: {flips} of {total} elements on the other side of the fence"
    );
    (worst, flips)
}

/// For a recipe that sets a tokenizer: for each row of rlmerge's token-indexed tensors, the row
/// of mergekit's that holds the same token (mergekit numbers a union's new tokens in an order
/// that varies between runs); padding rows in place. The two vocabularies must be the same, and
/// every added token's settings too.
fn token_rows(name: &str, out: &Path) -> Option<Vec<usize>> {
    let expected = root()
        .join("expected")
        .join(format!("{name}.tokenizer.json"));
    if !expected.exists() {
        return None;
    }
    let (ours, theirs) = (
        tokenizer_vocab(&out.join("tokenizer.json")),
        tokenizer_vocab(&expected),
    );
    let mut by_id: Vec<(&String, &usize)> = ours.iter().collect();
    by_id.sort_by_key(|(_, &i)| i);
    assert_eq!(
        {
            let mut k: Vec<&String> = ours.keys().collect();
            k.sort();
            k
        },
        {
            let mut k: Vec<&String> = theirs.keys().collect();
            k.sort();
            k
        },
        "{name}: the output vocabularies differ"
    );
    let settings = |p: &Path| -> std::collections::BTreeMap<String, serde_json::Value> {
        let json: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap();
        json["added_tokens"]
            .as_array()
            .unwrap()
            .iter()
            .map(|a| {
                let mut a = a.clone();
                a.as_object_mut().unwrap().remove("id");
                (a["content"].as_str().unwrap().to_string(), a)
            })
            .collect()
    };
    assert_eq!(
        settings(&out.join("tokenizer.json")),
        settings(&expected),
        "{name}: added tokens"
    );
    let rows = read_folder(out)["model.embed_tokens.weight"].1[0];
    Some(
        by_id
            .iter()
            .map(|(t, _)| theirs[*t])
            .chain(ours.len()..rows)
            .collect(),
    )
}

#[test]
fn outputs_are_within_one_ulp_of_mergekit() {
    let d = tempfile::tempdir().unwrap();
    let names = recipes();
    assert!(!names.is_empty());
    for name in &names {
        let (worst, flips) = check(name, &d.path().join(name));
        eprintln!("{name}: worst {worst} ULP, {flips} fence flips");
    }
}
