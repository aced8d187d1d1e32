//! The safetensors format: a file's header parsed and validated into its tensors' places (the
//! reading itself is [`WeightFile`]'s).

use super::dtype::DType;
use super::positional::{read_exact_at, read_vec_at};
use super::weight_file::{repeated_name, shape_text, Interner, TensorEntry, WeightFile};
use anyhow::{bail, Context, Result};
use std::path::Path;

/// Largest header we accept (the reference implementation's limit).
const MAX_HEADER_BYTES: u64 = 100_000_000;

/// Opens and validates `path` — header length, JSON, dtypes, shapes, offsets against the file
/// size — and returns the file and its tensors in offset order, sharing tensor names and
/// shapes through `interner` with the files opened before (a base and its agents name the
/// same 10^5 tensors: one copy each).
pub fn open(path: &Path, interner: &mut Interner) -> Result<(WeightFile, Vec<TensorEntry>)> {
    let (file, listed) = open_with(path, interner, None)?;
    Ok((file, listed.into_iter().map(|(t, _)| t).collect()))
}

/// A tensor as a header lists it, and whether it is stored in a quantized checkpoint's byte
/// dtype (its entry then presents it as BF16, one stored byte per element: [`super::fp8`],
/// [`super::mxfp4`]).
pub type Listed = (TensorEntry, bool);

/// [`open`]; with `raw`, tensors of that one-byte dtype are listed too (`F8_E4M3` in an FP8
/// block-scaled checkpoint, `U8` in an MXFP4 one).
pub fn open_with(
    path: &Path,
    interner: &mut Interner,
    raw: Option<&'static str>,
) -> Result<(WeightFile, Vec<Listed>)> {
    let (file, meta) = super::files::open_regular(path)?;
    let file_len = meta.len();
    let fail = |msg: String| -> anyhow::Error { anyhow::anyhow!("{}: {msg}", path.display()) };
    if file_len < 8 {
        return Err(fail(format!(
            "truncated file: {file_len} bytes, too short for a safetensors header"
        )));
    }
    let mut len_bytes = [0u8; 8];
    read_exact_at(&file, &mut len_bytes, 0)
        .with_context(|| format!("cannot read {}", path.display()))?;
    let header_len = u64::from_le_bytes(len_bytes);
    if header_len > MAX_HEADER_BYTES {
        return Err(fail(format!(
            "header length {header_len} exceeds the {MAX_HEADER_BYTES}-byte limit (corrupt or not a safetensors file)"
        )));
    }
    if 8 + header_len > file_len {
        return Err(fail(format!(
            "truncated file: header says {header_len} bytes but the file has {file_len}"
        )));
    }
    let header = read_vec_at(&file, 8, header_len as usize)
        .with_context(|| format!("cannot read the header of {}", path.display()))?;
    let data_start = 8 + header_len;
    let data_len = file_len - data_start;
    let tensors = parse_header(&header, (data_start, data_len, raw), interner)
        .map_err(|e| fail(format!("{e:#}")))?;
    let spans = tensors
        .iter()
        .map(|t| (t.0.offset, stored_len(t)))
        .collect();
    Ok((WeightFile::new(path, &meta, spans), tensors))
}

/// The bytes a listed tensor takes in the file.
fn stored_len((t, raw): &Listed) -> u64 {
    match raw {
        true => t.numel as u64,
        false => t.byte_len(),
    }
}

/// Parses the JSON header. Offsets must be in range and sized for shape × dtype; unsupported dtypes
/// are an error naming the tensor.
/// The header's tensors, each checked and converted as soon as it is read: a header of 10^5 or
/// more tensors (MoE checkpoints) never exists as a JSON tree, only one entry at a time. The
/// first invalid entry's error is kept in `error` (the parse then stops).
struct HeaderSeed<'a> {
    data_start: u64,
    data_len: u64,
    /// The one-byte dtype of a quantized checkpoint's tensors, listed too.
    raw: Option<&'static str>,
    error: &'a mut Option<anyhow::Error>,
    interner: &'a mut Interner,
}

impl<'de> serde::de::DeserializeSeed<'de> for HeaderSeed<'_> {
    type Value = Vec<Listed>;
    fn deserialize<D: serde::Deserializer<'de>>(
        self,
        deserializer: D,
    ) -> Result<Self::Value, D::Error> {
        deserializer.deserialize_map(self)
    }
}

impl<'de> serde::de::Visitor<'de> for HeaderSeed<'_> {
    type Value = Vec<Listed>;
    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("a JSON object of tensors")
    }
    fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        let mut tensors = Vec::with_capacity(map.size_hint().unwrap_or(0));
        while let Some(name) = map.next_key::<String>()? {
            let info: serde_json::Value = map.next_value()?;
            // Free-form string metadata: not needed to read tensors.
            if name == "__metadata__" {
                continue;
            }
            let data = (self.data_start, self.data_len, self.raw);
            match tensor_entry(name, &info, data, self.interner) {
                Ok(t) => tensors.push(t),
                Err(e) => {
                    *self.error = Some(e);
                    return Err(serde::de::Error::custom("invalid tensor entry"));
                }
            }
        }
        Ok(tensors)
    }
}

/// One header entry, checked: dtype, shape, offsets against the data section.
fn tensor_entry(
    name: String,
    info: &serde_json::Value,
    (data_start, data_len, raw): (u64, u64, Option<&'static str>),
    interner: &mut Interner,
) -> Result<Listed> {
    let bad = |what: &str| anyhow::anyhow!("tensor '{name}': {what}");
    let info = info
        .as_object()
        .ok_or_else(|| bad("entry is not an object"))?;
    let dtype_name = info
        .get("dtype")
        .and_then(|d| d.as_str())
        .ok_or_else(|| bad("missing dtype"))?;
    let stored_raw = raw == Some(dtype_name);
    let dtype = match stored_raw {
        true => DType::BF16,
        false => DType::from_safetensors(dtype_name).ok_or_else(|| {
            bad(&format!(
                "unsupported dtype {dtype_name} (rlmerge merges BF16, F16 and F32, and reads \
                 F8_E4M3 in an FP8 block-scaled checkpoint and U8 in an MXFP4 one: quant_method \
                 fp8 or mxfp4 in its config.json)"
            ))
        })?,
    };
    let shape: Vec<usize> = info
        .get("shape")
        .and_then(|s| s.as_array())
        .ok_or_else(|| bad("missing shape"))?
        .iter()
        .map(|d| d.as_u64().and_then(|d| usize::try_from(d).ok()))
        .collect::<Option<_>>()
        .ok_or_else(|| bad("shape is not a list of non-negative integers"))?;
    let numel = shape
        .iter()
        .try_fold(1usize, |acc, &d| acc.checked_mul(d))
        .ok_or_else(|| bad("shape's element count overflows"))?;
    let offsets = info
        .get("data_offsets")
        .and_then(|o| o.as_array())
        .filter(|o| o.len() == 2)
        .and_then(|o| Some((o[0].as_u64()?, o[1].as_u64()?)))
        .ok_or_else(|| bad("data_offsets is not a pair of integers"))?;
    let (begin, end) = offsets;
    if begin > end || end > data_len {
        if end > data_len {
            return Err(bad(&format!(
                "data offsets {begin}..{end} out of range: the data section has {data_len} bytes (truncated file?)"
            )));
        }
        return Err(bad(&format!("data offsets {begin}..{end} are reversed")));
    }
    let element = if stored_raw { 1 } else { dtype.size() as u64 };
    let expected = (numel as u64).checked_mul(element);
    if expected != Some(end - begin) {
        return Err(bad(&format!(
            "data offsets {begin}..{end} hold {} bytes but shape {} of {dtype_name} needs {}",
            end - begin,
            shape_text(&shape),
            expected.map_or("more than u64".to_string(), |e| e.to_string())
        )));
    }
    let entry = TensorEntry {
        name: interner.name(name),
        dtype,
        shape: interner.shape(shape),
        offset: data_start + begin,
        numel,
    };
    Ok((entry, stored_raw))
}

fn parse_header(
    header: &[u8],
    (data_start, data_len, raw): (u64, u64, Option<&'static str>),
    interner: &mut Interner,
) -> Result<Vec<Listed>> {
    use serde::de::DeserializeSeed;
    let text = std::str::from_utf8(header).context("corrupt header: not UTF-8")?;
    let mut error = None;
    let mut de = serde_json::Deserializer::from_str(text.trim_end_matches(' '));
    let parsed = HeaderSeed {
        data_start,
        data_len,
        raw,
        error: &mut error,
        interner,
    }
    .deserialize(&mut de)
    .and_then(|t| de.end().map(|()| t));
    let mut tensors = match (parsed, error) {
        (_, Some(e)) => return Err(e),
        (Err(e), None) => return Err(e).context("corrupt header JSON"),
        (Ok(t), None) => t,
    };
    // A name given twice is an error, not the last one silently kept (a JSON map would).
    if let Some(name) = repeated_name(tensors.iter().map(|t| &t.0)) {
        bail!("corrupt header JSON: tensor '{name}' appears twice");
    }
    tensors.sort_by_key(|t| t.0.offset);
    tensors.shrink_to_fit();
    for pair in tensors.windows(2) {
        if pair[0].0.offset + stored_len(&pair[0]) > pair[1].0.offset {
            bail!(
                "tensors '{}' and '{}' have overlapping data offsets",
                pair[0].0.name,
                pair[1].0.name
            );
        }
    }
    Ok(tensors)
}
