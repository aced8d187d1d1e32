//! A recipe's settings beside its method and models: SVC's α (`svc:`), the output dtype
//! (`out_dtype`, or mergekit's older `dtype`) and the largest shard (`shard_size`, rlmerge's).

use super::RawConfig;
use crate::checkpoint::DType;
use crate::error::usage;
use crate::method::settings::Scalar;
use anyhow::{Context, Result};

/// The recipe's `svc:`: `true` (α's default), a number, or `{alpha: ALPHA}`; `false` or absent,
/// none. α is checked with the method it calibrates (`method::build::merging`).
pub(super) fn svc_of(raw: &RawConfig) -> Result<Option<Scalar>> {
    use serde_yaml::Value;
    let default = || Ok(Some(Scalar::Number(crate::method::catalog::SVC_DEFAULT)));
    let alpha = match &raw.svc {
        None | Some(Value::Null) | Some(Value::Bool(false)) => return Ok(None),
        Some(Value::Bool(true)) => return default(),
        Some(Value::Mapping(m)) => {
            if let Some(k) = m.keys().find(|k| k.as_str() != Some("alpha")) {
                return Err(crate::error::usage(format!(
                    "svc: unknown key {}; svc takes alpha",
                    serde_yaml::to_string(k).unwrap_or_default().trim()
                )));
            }
            match m.get("alpha") {
                Some(v) => v.clone(),
                None => return default(),
            }
        }
        Some(v) => v.clone(),
    };
    // A number, a word or a bool as a recipe's parameters are read; anything else (a list, a
    // mapping) as its text, which the range check refuses by name.
    let scalar = serde_yaml::from_value::<Scalar>(alpha.clone()).unwrap_or_else(|_| {
        Scalar::Text(
            serde_yaml::to_string(&alpha)
                .unwrap_or_default()
                .trim()
                .into(),
        )
    });
    Ok(Some(scalar))
}

/// The output dtype the recipe asks (`out_dtype`, or mergekit's older `dtype`).
pub(super) fn out_dtype(raw: &RawConfig) -> Result<Option<DType>> {
    match raw.out_dtype.as_ref().or(raw.dtype.as_ref()) {
        None => Ok(None),
        Some(d) => Ok(Some(DType::parse_user(d).with_context(|| {
            format!("unknown dtype '{d}' (use bfloat16, float16 or float32)")
        })?)),
    }
}

/// The recipe's `shard_size`: bytes, or a size as `--shard-size` reads it (`5GB`, `2GiB`).
pub(super) fn shard_size(raw: &RawConfig) -> Result<Option<u64>> {
    use serde_yaml::Value;
    let text = match &raw.shard_size {
        None | Some(Value::Null) => return Ok(None),
        Some(Value::Number(n)) => n.to_string(),
        Some(Value::String(s)) => s.clone(),
        Some(other) => serde_yaml::to_string(other).unwrap_or_default(),
    };
    crate::checkpoint::writer::parse_size(text.trim())
        .map(Some)
        .map_err(|e| usage(format!("shard_size: {e}")))
}
