// SPEC §4: the generalized task-arithmetic rule (src/method/combine.rs, `combine_element`), one
// invocation per pair of elements. Per element: v_t = θ_t − θ₀ or θ_t; d_t = keep_t ? v_t·c_t : 0;
// with consensus only the d_t of Σ d_t's sign count; Δ · f32(1/Σw) (host-computed reciprocals, never
// a division here); Δ · λ; out = bc·θ₀ + Δ. Every product is made opaque so none fuses into an FMA.
// Needs dtype.wgsl and chunk.wgsl prepended.

// Keep rules (word 0 of an agent's 8 in `rules`) and normalization modes (`c.norm_mode`); the host's
// twins are in src/backend/gpu/layout.rs, checked against these by a test.
const KEEP_ALL: u32 = 0u;
const KEEP_BAND: u32 = 1u;
const KEEP_RANDOM: u32 = 2u;
const KEEP_FLAGGED: u32 = 3u;
const NORM_NONE: u32 = 0u;
const NORM_FIXED: u32 = 1u;
const NORM_TABLE: u32 = 2u;

struct Comb {
    start: u32,       // tensor index of the chunk's first element
    row_len: u32,     // elements per coefficient row; 0 = one row
    first_row: u32,   // row of the chunk's first element (the coefs buffer starts there)
    delta: u32,       // 1: v = θ_t − θ₀; 0: v = θ_t
    consensus: u32,
    norm_mode: u32,   // NORM_NONE, NORM_FIXED (fixed_recip) or NORM_TABLE (per-mask table)
    lambda: f32,
    fixed_recip: f32,
    nearswap: u32,    // 1: NearSwap instead of the rule above (one model)
    nearswap_t: f32,
    element_keep: u32,    // 1: SCE's variance cut (value, index; low index first) applies
    element_value: u32,
    element_index: u32,
    inv_n: f32,
    sign_of_values: u32,  // 1: the consensus sign is that of Σ kept v (SCE)
    row_period: u32,      // rows repeat every row_period (0: never; columns of a matrix)
}

@group(0) @binding(3) var<uniform> c: Comb;
// Per agent, 8 words: kind (KEEP_ALL, KEEP_BAND, KEEP_RANDOM, KEEP_FLAGGED), then for a band: lo
// value, lo index, hi value, hi index, tie flags (bit 0: lo high-first, bit 1: hi high-first); for
// random: words 5–7 = threshold, hash key 0, hash key 1.
@group(0) @binding(4) var<storage, read> rules: array<u32>;
@group(0) @binding(5) var<storage, read> coefs: array<f32>;
@group(0) @binding(6) var<storage, read> recips: array<f32>;
@group(0) @binding(7) var<storage, read_write> out: array<u32>;
// KEEP_FLAGGED: agent t's keep flag of chunk element i (0: dropped) at flags[t * flag_stride() + i]
// — DELLA's keep decisions by rank, arcee_fusion's importance test, both made on the host.
@group(0) @binding(8) var<storage, read> flags: array<u32>;

fn opaque(x: f32) -> f32 {
    return bitcast<f32>(bitcast<u32>(x) ^ p.zero);
}

// Raw bits of element i of the agent segment starting at word `at`.
fn agent_bits(at: u32, i: u32) -> u32 {
    if (p.in_dt == DT_F32) {
        return agents[at + i];
    }
    return (agents[at + i / 2u] >> (16u * (i & 1u))) & 0xffffu;
}

fn mix32(v: u32) -> u32 {
    var x = v;
    x = x ^ (x >> 16u);
    x = x * 0x7feb352du;
    x = x ^ (x >> 15u);
    x = x * 0x846ca68bu;
    x = x ^ (x >> 16u);
    return x;
}

// src/select/cut.rs `RankCut::inside`.
fn inside(key: u32, idx: u32, value: u32, index: u32, high_first: bool) -> bool {
    return key > value || (key == value && ((idx < index) != high_first));
}

fn keeps(t: u32, v: f32, idx: u32) -> bool {
    let r = t * 8u;
    let kind = rules[r];
    if (kind == KEEP_BAND) {
        let key = bitcast<u32>(v) & 0x7fffffffu;
        let flags = rules[r + 5u];
        return inside(key, idx, rules[r + 3u], rules[r + 4u], (flags & 2u) != 0u)
            && !inside(key, idx, rules[r + 1u], rules[r + 2u], (flags & 1u) != 0u);
    }
    if (kind == KEEP_RANDOM) {
        let h = mix32(idx ^ rules[r + 6u]) ^ rules[r + 7u];
        return h < rules[r + 5u];
    }
    if (kind == KEEP_FLAGGED) {
        return flags[t * flag_stride() + (idx - c.start)] != 0u;
    }
    return true;
}

// Words per agent in `flags`: the chunk length rounded up to even.
fn flag_stride() -> u32 {
    return (p.len + 1u) / 2u * 2u;
}

// The coefficient row (relative to the chunk's first row) of chunk element i.
fn row_of(i: u32) -> u32 {
    if (c.row_len == 0u) {
        return 0u;
    }
    let r = (c.start + i) / c.row_len;
    if (c.row_period == 0u) {
        return r - c.first_row;
    }
    // src/method/combine.rs `coef_row`, relative to the chunk's first row, which the host's
    // window of rows starts at and wraps past the period from.
    let m = r % c.row_period;
    return select(m + c.row_period - c.first_row, m - c.first_row, m >= c.first_row);
}

// v_t of chunk element i.
fn v_of(t: u32, i: u32, b: f32) -> f32 {
    let x = decode_bits(agent_bits(t * p.stride, i), p.in_dt);
    if (c.delta == 1u) {
        return x - b;
    }
    return x;
}

// SCE: whether element i is among the highest-variance ones (src/method/combine.rs
// `variance_key`, same order of operations).
fn element_kept(i: u32, b: f32) -> bool {
    if (c.element_keep == 0u) {
        return true;
    }
    var sum = 0.0;
    for (var t = 0u; t < p.n; t = t + 1u) {
        sum = sum + v_of(t, i, b);
    }
    let mean = opaque(sum * c.inv_n);
    var sq = 0.0;
    for (var t = 0u; t < p.n; t = t + 1u) {
        let e = v_of(t, i, b) - mean;
        sq = sq + opaque(e * e);
    }
    let key = bitcast<u32>(opaque(sq * c.inv_n)) & 0x7fffffffu;
    return inside(key, c.start + i, c.element_value, c.element_index, false);
}

// d_t of chunk element i (0 where not kept).
fn d_of(t: u32, i: u32, b: f32, row: u32, elem: bool) -> f32 {
    let v = v_of(t, i, b);
    if (!elem || !keeps(t, v, c.start + i)) {
        return 0.0;
    }
    return opaque(v * coefs[row * (p.n + 1u) + 1u + t]);
}

// a / b rounded to nearest even for 0 < a < b, both normal, with integer arithmetic only:
// src/method/combine.rs `div_rn`, step for step. A subnormal quotient is 0.
fn div_rn(a: f32, b: f32) -> f32 {
    let xa = bitcast<u32>(a);
    let xb = bitcast<u32>(b);
    var ma = (xa & 0x7fffffu) | 0x800000u;
    let mb = (xb & 0x7fffffu) | 0x800000u;
    var e = i32((xa >> 23u) & 0xffu) - i32((xb >> 23u) & 0xffu);
    if (ma < mb) {
        ma = ma << 1u;
        e = e - 1;
    }
    var q = 0u;
    var r = ma;
    for (var k = 0u; k < 25u; k = k + 1u) {
        q = q << 1u;
        if (r >= mb) {
            r = r - mb;
            q = q | 1u;
        }
        r = r << 1u;
    }
    let guard = q & 1u;
    var m = q >> 1u;
    if (guard == 1u && (r != 0u || (m & 1u) == 1u)) {
        m = m + 1u;
        if (m == 0x1000000u) {
            m = m >> 1u;
            e = e + 1;
        }
    }
    let biased = e + 127;
    if (biased <= 0) {
        return 0.0;
    }
    return bitcast<f32>((u32(biased) << 23u) | (m & 0x7fffffu));
}

// src/method/combine.rs `nearswap`.
fn nearswap(t: f32, b: f32, x: f32) -> f32 {
    let d = max(abs(x - b), 1e-6);
    var w = 0.0;
    if (t >= d) {
        w = 1.0;
    } else if (t > 0.0) {
        w = div_rn(t, d);
    }
    return opaque(w * x) + opaque((1.0 - w) * b);
}

fn combine_one(i: u32, bb: u32) -> u32 {
    let b = decode_bits(bb, p.in_dt);
    if (c.nearswap == 1u) {
        return encode_bits(nearswap(c.nearswap_t, b, decode_bits(agent_bits(0u, i), p.in_dt)), p.out_dt);
    }
    let row = row_of(i);
    let elem = element_kept(i, b);
    var sum = 0.0;
    var sum_v = 0.0;
    for (var t = 0u; t < p.n; t = t + 1u) {
        let d = d_of(t, i, b, row, elem);
        sum = sum + d;
        if (c.sign_of_values == 1u) {
            let v = v_of(t, i, b);
            if (elem && keeps(t, v, c.start + i)) {
                sum_v = sum_v + v;
            }
        }
    }
    if (c.sign_of_values == 1u) {
        sum = sum_v;
    }
    var delta = 0.0;
    var mask = 0u;
    for (var t = 0u; t < p.n; t = t + 1u) {
        let d = d_of(t, i, b, row, elem);
        var agrees = true;
        if (c.consensus == 1u) {
            agrees = select((d < 0.0), (d > 0.0), (sum >= 0.0));
        }
        if (agrees) {
            delta = delta + d;
            mask = mask | (1u << t);
        }
    }
    if (c.norm_mode == NORM_FIXED) {
        delta = opaque(delta * c.fixed_recip);
    } else if (c.norm_mode == NORM_TABLE) {
        delta = opaque(delta * recips[mask]);
    }
    if (c.lambda != 1.0) {
        delta = opaque(delta * c.lambda);
    }
    let bc = coefs[row * (p.n + 1u)];
    var r = delta;
    if (bc == 1.0) {
        r = b + delta;
    } else if (bc != 0.0) {
        r = opaque(bc * b) + delta;
    }
    return encode_bits(r, p.out_dt);
}

@compute @workgroup_size(WG)
fn combine(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    let g = pair_index(wid, li);
    if (g >= p.pairs) {
        return;
    }
    let bb = load_pair(true, 0u, g);
    let e0 = 2u * g;
    let v0 = combine_one(e0, bb.x);
    let has_second = e0 + 1u < p.len;
    var v1 = 0u;
    if (has_second) {
        v1 = combine_one(e0 + 1u, bb.y);
    }
    store_pair(g, has_second, v0, v1);
}
