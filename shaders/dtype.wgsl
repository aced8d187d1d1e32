// Element codecs: the GPU twin of src/checkpoint/dtype.rs. All integer arithmetic, so results do
// not depend on the adapter's float conversion or subnormal handling. bf16 and f16 travel two per
// u32 word (element 2i in the low half); f32 one per word.

const DT_BF16: u32 = 0u;
const DT_F16: u32 = 1u;
const DT_F32: u32 = 2u;

fn is_nan_bits(x: u32) -> bool {
    return (x & 0x7fffffffu) > 0x7f800000u;
}

// bf16 -> f32 is a shift: exact.
fn bf16_to_f32(h: u32) -> f32 {
    return bitcast<f32>(h << 16u);
}

// f32 -> bf16, round to nearest even; NaN keeps its top bits with the quiet bit set.
fn f32_to_bf16(v: f32) -> u32 {
    let x = bitcast<u32>(v);
    if (is_nan_bits(x)) {
        return ((x >> 16u) | 0x40u) & 0xffffu;
    }
    return ((x + 0x7fffu + ((x >> 16u) & 1u)) >> 16u) & 0xffffu;
}

// f16 -> f32, exact; subnormals normalised with integer ops; NaN gets the quiet bit.
fn f16_to_f32(h: u32) -> f32 {
    let sign = (h & 0x8000u) << 16u;
    let e = (h >> 10u) & 0x1fu;
    let m = h & 0x3ffu;
    if (e == 0x1fu) {
        if (m == 0u) {
            return bitcast<f32>(sign | 0x7f800000u);
        }
        return bitcast<f32>(sign | 0x7fc00000u | (m << 13u));
    }
    if (e == 0u) {
        if (m == 0u) {
            return bitcast<f32>(sign);
        }
        // value = m · 2^-24; the top set bit p of m gives the exponent p − 24.
        let p = 31u - countLeadingZeros(m);
        let mant = (m << (23u - p)) & 0x7fffffu;
        return bitcast<f32>(sign | ((p + 103u) << 23u) | mant);
    }
    return bitcast<f32>(sign | ((e + 112u) << 23u) | (m << 13u));
}

// f32 -> f16, round to nearest even (overflow to infinity, underflow through subnormals to zero).
fn f32_to_f16(v: f32) -> u32 {
    let x = bitcast<u32>(v);
    let sign = (x >> 16u) & 0x8000u;
    let e32 = (x >> 23u) & 0xffu;
    let m = x & 0x7fffffu;
    if (e32 == 0xffu) {
        if (m == 0u) {
            return sign | 0x7c00u;
        }
        return sign | 0x7e00u | (m >> 13u);
    }
    let e = i32(e32) - 112;
    if (e >= 31) {
        return sign | 0x7c00u;
    }
    if (e <= 0) {
        // Subnormal result: shift the full significand right; below half the smallest, zero.
        let shift = u32(14 - e);
        if (shift > 24u) {
            return sign;
        }
        let full = m | 0x800000u;
        let half_bit = 1u << (shift - 1u);
        var r = full >> shift;
        if ((full & half_bit) != 0u && (full & (3u * half_bit - 1u)) != 0u) {
            r = r + 1u;
        }
        return sign | r;
    }
    let r = sign | (u32(e) << 10u) | (m >> 13u);
    // Round bit 12; sticky bits 0..11 or the result's lowest bit (13) break the tie.
    if ((m & 0x1000u) != 0u && (m & 0x2fffu) != 0u) {
        return r + 1u;
    }
    return r;
}

// A 16-bit half or an f32 word, decoded.
fn decode_bits(bits: u32, dt: u32) -> f32 {
    if (dt == DT_BF16) {
        return bf16_to_f32(bits);
    }
    if (dt == DT_F16) {
        return f16_to_f32(bits);
    }
    return bitcast<f32>(bits);
}

fn encode_bits(v: f32, dt: u32) -> u32 {
    if (dt == DT_BF16) {
        return f32_to_bf16(v);
    }
    if (dt == DT_F16) {
        return f32_to_f16(v);
    }
    return bitcast<u32>(v);
}
