//! Element types of checkpoint tensors and the one place where they are decoded to / encoded from f32.
//!
//! bf16→f32 and f16→f32 are exact; f32→bf16/f16 rounds to nearest, ties to even (SPEC §"Values").

use crate::simd::multiversion;
use half::f16;
use half::slice::HalfFloatSliceExt;
use std::fmt;

/// A floating-point element type rlmerge can merge.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub enum DType {
    /// bfloat16.
    #[serde(rename = "BF16")]
    BF16,
    /// IEEE half precision.
    #[serde(rename = "F16")]
    F16,
    /// IEEE single precision.
    #[serde(rename = "F32")]
    F32,
}

impl DType {
    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            DType::BF16 | DType::F16 => 2,
            DType::F32 => 4,
        }
    }

    /// The name safetensors headers use ("BF16", "F16", "F32").
    pub fn safetensors_name(self) -> &'static str {
        match self {
            DType::BF16 => "BF16",
            DType::F16 => "F16",
            DType::F32 => "F32",
        }
    }

    /// Parses a safetensors header dtype; `None` for dtypes rlmerge cannot merge (I64, F8_E4M3, …).
    pub fn from_safetensors(name: &str) -> Option<DType> {
        match name {
            "BF16" => Some(DType::BF16),
            "F16" => Some(DType::F16),
            "F32" => Some(DType::F32),
            _ => None,
        }
    }

    /// The dtype of a torch storage class (`torch.BFloat16Storage`: `BFloat16`), as `torch.save`
    /// names it in a pickle; `None` for dtypes rlmerge cannot merge (`Double`, `Long`, …).
    pub fn from_torch_storage(class: &str) -> Option<DType> {
        match class {
            "BFloat16" => Some(DType::BF16),
            "Half" => Some(DType::F16),
            "Float" => Some(DType::F32),
            _ => None,
        }
    }

    /// Parses the user-facing spelling (`bf16`, `float16`, `fp32`, …) used on the CLI and in recipes.
    pub fn parse_user(s: &str) -> Option<DType> {
        match s.to_ascii_lowercase().as_str() {
            "bf16" | "bfloat16" => Some(DType::BF16),
            "f16" | "fp16" | "float16" | "half" => Some(DType::F16),
            "f32" | "fp32" | "float32" | "float" => Some(DType::F32),
            _ => None,
        }
    }

    /// The name torch and `config.json` use (`torch_dtype`).
    pub fn torch_name(self) -> &'static str {
        match self {
            DType::BF16 => "bfloat16",
            DType::F16 => "float16",
            DType::F32 => "float32",
        }
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            DType::BF16 => "bf16",
            DType::F16 => "f16",
            DType::F32 => "f32",
        })
    }
}

multiversion! {
    /// Decodes little-endian `bytes` of `dtype` into `out` (`out.len()` elements; `bytes` must hold exactly that many).
    pub fn decode(dtype: DType, bytes: &[u8], out: &mut [f32]) {
        debug_assert_eq!(bytes.len(), out.len() * dtype.size());
        match dtype {
            DType::BF16 => {
                for (o, b) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                    *o = bf16_bits_to_f32(u16::from_le_bytes([b[0], b[1]]));
                }
            }
            DType::F16 => match bytemuck::try_cast_slice::<u8, f16>(bytes) {
                // The slice conversion uses F16C / NEON where the CPU has them.
                Ok(halves) if cfg!(target_endian = "little") => halves.convert_to_f32_slice(out),
                _ => {
                    for (o, b) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                        *o = f16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32();
                    }
                }
            },
            DType::F32 => {
                for (o, b) in out.iter_mut().zip(bytes.chunks_exact(4)) {
                    *o = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
                }
            }
        }
    }
}

multiversion! {
    /// `out[i]` = element i of `bytes` − `base[i]`: a task vector decoded, in one pass over the
    /// bytes where the format allows (the same values as [`decode`] then subtracting).
    pub fn decode_minus(dtype: DType, bytes: &[u8], base: &[f32], out: &mut [f32]) {
        debug_assert_eq!(bytes.len(), out.len() * dtype.size());
        let base = &base[..out.len()];
        match dtype {
            DType::BF16 => {
                for ((o, b), &z) in out.iter_mut().zip(bytes.chunks_exact(2)).zip(base) {
                    *o = bf16_bits_to_f32(u16::from_le_bytes([b[0], b[1]])) - z;
                }
            }
            DType::F16 => {
                decode(dtype, bytes, out);
                for (o, &z) in out.iter_mut().zip(base) {
                    *o -= z;
                }
            }
            DType::F32 => {
                for ((o, b), &z) in out.iter_mut().zip(bytes.chunks_exact(4)).zip(base) {
                    *o = f32::from_le_bytes([b[0], b[1], b[2], b[3]]) - z;
                }
            }
        }
    }
}

multiversion! {
    /// Encodes `values` into little-endian `out` of `dtype`, rounding to nearest even once.
    pub fn encode(dtype: DType, values: &[f32], out: &mut [u8]) {
        debug_assert_eq!(out.len(), values.len() * dtype.size());
        match dtype {
            DType::BF16 => {
                for (v, o) in values.iter().zip(out.chunks_exact_mut(2)) {
                    o.copy_from_slice(&f32_to_bf16_bits(*v).to_le_bytes());
                }
            }
            DType::F16 => match bytemuck::try_cast_slice_mut::<u8, f16>(out) {
                Ok(halves) if cfg!(target_endian = "little") => halves.convert_from_f32_slice(values),
                _ => {
                    for (v, o) in values.iter().zip(out.chunks_exact_mut(2)) {
                        o.copy_from_slice(&f16::from_f32(*v).to_bits().to_le_bytes());
                    }
                }
            },
            DType::F32 => {
                for (v, o) in values.iter().zip(out.chunks_exact_mut(4)) {
                    o.copy_from_slice(&v.to_le_bytes());
                }
            }
        }
    }
}

multiversion! {
    /// The first element of `bytes` that is NaN or ±Inf (all exponent bits set), if any. Scans u64
    /// words, several elements per test (SWAR), so the common all-finite case runs at memory speed.
    pub fn first_nonfinite(dtype: DType, bytes: &[u8]) -> Option<usize> {
        // Per lane: the exponent mask, and the lanes' low and high bits for the zero-lane test.
        let (exp, low, high) = match dtype {
            DType::BF16 => (
                0x7f80_7f80_7f80_7f80u64,
                0x0001_0001_0001_0001u64,
                0x8000_8000_8000_8000u64,
            ),
            DType::F16 => (
                0x7c00_7c00_7c00_7c00,
                0x0001_0001_0001_0001,
                0x8000_8000_8000_8000,
            ),
            DType::F32 => (
                0x7f80_0000_7f80_0000,
                0x0000_0001_0000_0001,
                0x8000_0000_8000_0000,
            ),
        };
        // A lane whose exponent bits are all set becomes zero after `& exp ^ exp`; the classic
        // has-zero-lane test then flags the word (exp keeps each lane's top bit clear, so no borrow).
        let flagged = |w: u64| {
            let t = (w & exp) ^ exp;
            (t.wrapping_sub(low) & !t & high) != 0
        };
        const BLOCK: usize = 4096;
        let size = dtype.size();
        let words = bytes.len() / 8;
        for block in (0..words).step_by(BLOCK) {
            let end = (block + BLOCK).min(words);
            let hit = bytes[block * 8..end * 8]
                .chunks_exact(8)
                .fold(false, |acc, c| {
                    acc | flagged(u64::from_le_bytes(c.try_into().expect("8 bytes")))
                });
            if hit {
                return first_nonfinite_scalar(dtype, &bytes[block * 8..end * 8])
                    .map(|i| block * 8 / size + i);
            }
        }
        let tail = words * 8;
        first_nonfinite_scalar(dtype, &bytes[tail..]).map(|i| tail / size + i)
    }
}

/// Element by element: for the block that holds a hit, and the bytes after the last whole word.
fn first_nonfinite_scalar(dtype: DType, bytes: &[u8]) -> Option<usize> {
    match dtype {
        DType::BF16 => bytes
            .chunks_exact(2)
            .position(|b| u16::from_le_bytes([b[0], b[1]]) & 0x7f80 == 0x7f80),
        DType::F16 => bytes
            .chunks_exact(2)
            .position(|b| u16::from_le_bytes([b[0], b[1]]) & 0x7c00 == 0x7c00),
        DType::F32 => bytes.chunks_exact(4).position(|b| {
            u32::from_le_bytes([b[0], b[1], b[2], b[3]]) & 0x7f80_0000 == 0x7f80_0000
        }),
    }
}

/// `bytes` of `dtype` read in place as values of `T` — bf16 bit patterns as u16, or f32 — for
/// kernels that widen each value in a register as they read it ([`bf16_bits_to_f32`] for bf16:
/// the values [`decode`] gives) instead of decoding a row first. `Some` when `dtype` is `stored`
/// (the dtype `T` holds) and the bytes can be read in place (aligned, a little-endian machine —
/// every tile buffer); `None` otherwise: decode.
#[inline(always)]
pub fn in_place<T: bytemuck::Pod>(dtype: DType, stored: DType, bytes: &[u8]) -> Option<&[T]> {
    debug_assert_eq!(stored.size(), std::mem::size_of::<T>());
    if dtype != stored || cfg!(target_endian = "big") {
        return None;
    }
    bytemuck::try_cast_slice(bytes).ok()
}

/// bf16 bits → f32 (exact).
#[inline(always)]
pub fn bf16_bits_to_f32(bits: u16) -> f32 {
    f32::from_bits((bits as u32) << 16)
}

/// f32 → bf16 bits, round to nearest even; NaN stays NaN (quiet bit set). Branch-free so loops
/// vectorize; bit-identical to `half::bf16::from_f32`.
#[inline(always)]
pub fn f32_to_bf16_bits(v: f32) -> u16 {
    let x = v.to_bits();
    let rounded = (x.wrapping_add(0x7fff + ((x >> 16) & 1)) >> 16) as u16;
    let nan = ((x >> 16) as u16) | 0x0040;
    if v.is_nan() {
        nan
    } else {
        rounded
    }
}

/// A `float8_e4m3fn` byte as f32 (exact): 1 sign, 4 exponent (bias 7) and 3 mantissa bits, no
/// infinities, `S.1111.111` NaN, exponent 0 subnormal (m/8 · 2⁻⁶) — the weights of FP8
/// block-scaled checkpoints (DeepSeek-V3, Kimi K2), as torch's `.to(torch.float32)` widens them.
pub fn f8_e4m3fn_to_f32(byte: u8) -> f32 {
    let (exponent, mantissa) = (i32::from((byte >> 3) & 0xf), f32::from(byte & 7));
    let magnitude = match exponent {
        0xf if mantissa == 7.0 => f32::NAN,
        0 => mantissa / 8.0 * 2f32.powi(-6),
        e => (1.0 + mantissa / 8.0) * 2f32.powi(e - 7),
    };
    if byte & 0x80 != 0 {
        -magnitude
    } else {
        magnitude
    }
}

/// Each value rounded to `dtype` (to nearest even, as torch's `.bfloat16()` and `.half()` round)
/// and back to f32: what storing it in `dtype` keeps. f32 values stay as they are.
pub fn round_through(dtype: DType, values: &mut [f32]) {
    match dtype {
        DType::BF16 => {
            for v in values.iter_mut() {
                *v = bf16_bits_to_f32(f32_to_bf16_bits(*v));
            }
        }
        DType::F16 => {
            for v in values.iter_mut() {
                *v = f16::from_f32(*v).to_f32();
            }
        }
        DType::F32 => {}
    }
}

/// Decodes one element at `index` (for reports and tests; loops use [`decode`]).
pub fn decode_one(dtype: DType, bytes: &[u8], index: usize) -> f32 {
    let mut v = [0f32];
    let s = dtype.size();
    decode(dtype, &bytes[index * s..(index + 1) * s], &mut v);
    v[0]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn float8_e4m3fn_widens_as_torch_does() {
        // (byte, value): torch.tensor([v]).to(torch.float8_e4m3fn).view(torch.uint8).
        for (byte, want) in [
            (0x00u8, 0.0f32),
            (0x38, 1.0),
            (0xb8, -1.0),
            (0x7e, 448.0),
            (0xfe, -448.0),
            (0x01, 2f32.powi(-9)),
            (0x08, 2f32.powi(-6)),
            (0x3c, 1.5),
            (0x30, 0.5),
        ] {
            assert_eq!(f8_e4m3fn_to_f32(byte), want, "{byte:#x}");
        }
        assert!(f8_e4m3fn_to_f32(0x7f).is_nan() && f8_e4m3fn_to_f32(0xff).is_nan());
        assert!(f8_e4m3fn_to_f32(0x80).is_sign_negative());
    }
    use half::bf16;

    #[test]
    fn bf16_round_trip_is_exact_and_encode_rounds_to_even() {
        // 1 + 2^-8 lies exactly between two bf16 values (1 and 1 + 2^-7): ties go to the even one, 1.0.
        let tie = 1.0f32 + f32::powi(2.0, -8);
        let mut out = [0u8; 2];
        encode(DType::BF16, &[tie], &mut out);
        assert_eq!(u16::from_le_bytes(out), 0x3f80);
        // Just above the tie rounds up.
        encode(DType::BF16, &[f32::from_bits(tie.to_bits() + 1)], &mut out);
        assert_eq!(u16::from_le_bytes(out), 0x3f81);
        let mut back = [0f32];
        decode(DType::BF16, &out, &mut back);
        assert_eq!(back[0], 1.0 + f32::powi(2.0, -7));
    }

    #[test]
    fn f16_and_f32_round_trip() {
        let vals = [0.0f32, -0.0, 1.5, -2.25, 65504.0, 6.1035156e-5];
        for dt in [DType::F16, DType::F32] {
            let mut bytes = vec![0u8; vals.len() * dt.size()];
            encode(dt, &vals, &mut bytes);
            let mut back = vec![0f32; vals.len()];
            decode(dt, &bytes, &mut back);
            for (a, b) in vals.iter().zip(&back) {
                assert_eq!(a.to_bits(), b.to_bits(), "{dt}");
            }
        }
    }

    #[test]
    fn bf16_encode_matches_half_on_every_class_of_value() {
        let mut x = 0x1234_5678u32;
        let mut specials = vec![
            0.0f32,
            -0.0,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::NAN,
            f32::MAX,
            f32::MIN_POSITIVE,
            1e-40,
        ];
        specials.push(f32::from_bits(0x7f80_0001)); // signalling NaN
        specials.push(f32::from_bits(0x7f7f_ffff)); // rounds up to infinity
        for _ in 0..200_000 {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            specials.push(f32::from_bits(x));
        }
        for v in specials {
            assert_eq!(
                f32_to_bf16_bits(v),
                bf16::from_f32(v).to_bits(),
                "{v:e} ({:#x})",
                v.to_bits()
            );
        }
    }

    #[test]
    fn f16_slice_and_scalar_paths_agree() {
        let vals: Vec<f32> = (0..1000).map(|i| (i as f32 - 500.0) * 0.37).collect();
        let mut aligned = vec![0u16; vals.len()];
        encode(DType::F16, &vals, bytemuck::cast_slice_mut(&mut aligned));
        for (v, h) in vals.iter().zip(&aligned) {
            assert_eq!(*h, f16::from_f32(*v).to_bits());
        }
        // A misaligned buffer takes the scalar path and gives the same bytes.
        let mut raw = vec![0u8; vals.len() * 2 + 1];
        encode(DType::F16, &vals, &mut raw[1..]);
        assert_eq!(&raw[1..], bytemuck::cast_slice::<u16, u8>(&aligned));
        let mut back = vec![0f32; vals.len()];
        decode(DType::F16, &raw[1..], &mut back);
        let mut back2 = vec![0f32; vals.len()];
        decode(DType::F16, bytemuck::cast_slice(&aligned), &mut back2);
        assert_eq!(back, back2);
    }

    #[test]
    fn nonfinite_values_are_found_in_every_dtype() {
        for dt in [DType::BF16, DType::F16, DType::F32] {
            for (bad, at) in [
                (f32::NAN, 5000),
                (f32::INFINITY, 0),
                (f32::NEG_INFINITY, 8191),
            ] {
                let mut vals = vec![1.5f32; 9000];
                vals[at] = bad;
                vals[8999] = f32::NAN;
                let mut bytes = vec![0u8; vals.len() * dt.size()];
                encode(dt, &vals, &mut bytes);
                assert_eq!(first_nonfinite(dt, &bytes), Some(at), "{dt} {bad}");
            }
            let mut bytes = vec![0u8; 100 * dt.size()];
            encode(dt, &[65504.0; 100], &mut bytes);
            assert_eq!(first_nonfinite(dt, &bytes), None, "{dt}");
            // Every position, including the tail after the last whole word, against a plain scan.
            for len in [1usize, 3, 5, 4099] {
                for at in 0..len.min(9) {
                    let mut vals = vec![-2.0f32; len];
                    vals[len - 1 - at] = f32::NAN;
                    let mut bytes = vec![0u8; len * dt.size()];
                    encode(dt, &vals, &mut bytes);
                    assert_eq!(
                        first_nonfinite(dt, &bytes),
                        Some(len - 1 - at),
                        "{dt} len {len}"
                    );
                }
            }
        }
        // Every 16-bit pattern, in each lane of a word: SWAR agrees with the scalar test.
        for dt in [DType::BF16, DType::F16] {
            for h in 0..=u16::MAX {
                for lane in 0..4 {
                    let mut words = [0x3c00u16; 4];
                    words[lane] = h;
                    let bytes: Vec<u8> = words.iter().flat_map(|w| w.to_le_bytes()).collect();
                    assert_eq!(
                        first_nonfinite(dt, &bytes),
                        first_nonfinite_scalar(dt, &bytes),
                        "{dt} {h:#x}"
                    );
                }
            }
        }
    }

    #[test]
    fn names_parse() {
        assert_eq!(DType::parse_user("bfloat16"), Some(DType::BF16));
        assert_eq!(DType::parse_user("FP16"), Some(DType::F16));
        assert_eq!(DType::from_safetensors("I64"), None);
        assert_eq!(DType::from_safetensors("F32"), Some(DType::F32));
    }
}
