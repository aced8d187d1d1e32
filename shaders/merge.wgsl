// SPEC §2 selective merge for the RAM family, in the spec's arithmetic order: τ = a − b in f32;
// Σ of active τ in agent order; c = 1 → b + λ·τ; c ≥ 2 → b + Σ·f32(1/c) with the reciprocal from
// the host (never divide here); c = 0 → the base's bits. One invocation per pair of elements, so a
// packed 16-bit output word is written by one invocation. Needs dtype.wgsl prepended.

struct Params {
    len: u32,
    pairs: u32,
    n: u32,
    in_dt: u32,
    out_dt: u32,
    stride: u32,
    eps: f32,
    zero: u32,
    groups_x: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> base: array<u32>;
@group(0) @binding(2) var<storage, read> agents: array<u32>;
@group(0) @binding(3) var<storage, read> lambdas: array<f32>;
@group(0) @binding(4) var<storage, read> recips: array<f32>;
@group(0) @binding(5) var<storage, read_write> out: array<u32>;

const WG: u32 = 256u;

fn elem_bits(word_at: u32, e: u32, dt: u32, from_base: bool) -> u32 {
    if (dt == DT_F32) {
        if (from_base) {
            return base[e];
        }
        return agents[word_at + e];
    }
    var w: u32;
    if (from_base) {
        w = base[e >> 1u];
    } else {
        w = agents[word_at + (e >> 1u)];
    }
    return half_of(w, e);
}

// The output bits of element e.
fn merge_one(e: u32) -> u32 {
    let bb = elem_bits(0u, e, p.in_dt, true);
    let b = decode_bits(bb, p.in_dt);
    var sum = 0.0;
    var c = 0u;
    var lam = 1.0;
    for (var t = 0u; t < p.n; t = t + 1u) {
        let a = decode_bits(elem_bits(t * p.stride, e, p.in_dt, false), p.in_dt);
        let tau = a - b;
        if (abs(tau) > p.eps) {
            sum = sum + tau;
            c = c + 1u;
            lam = lambdas[t];
        }
    }
    if (c == 0u) {
        if (p.out_dt == p.in_dt) {
            return bb;
        }
        return encode_bits(b, p.out_dt);
    }
    var scale = lam;
    if (c >= 2u) {
        scale = recips[c];
    }
    // XOR with a runtime zero: the compiler cannot see the product, so cannot fuse it into an FMA.
    let step = bitcast<f32>(bitcast<u32>(sum * scale) ^ p.zero);
    return encode_bits(b + step, p.out_dt);
}

@compute @workgroup_size(256)
fn merge(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    let g = (wid.y * p.groups_x + wid.x) * WG + li;
    if (g >= p.pairs) {
        return;
    }
    let e0 = 2u * g;
    let v0 = merge_one(e0);
    var v1 = 0u;
    let has_second = e0 + 1u < p.len;
    if (has_second) {
        v1 = merge_one(e0 + 1u);
    }
    if (p.out_dt == DT_F32) {
        out[e0] = v0;
        if (has_second) {
            out[e0 + 1u] = v1;
        }
    } else {
        out[g] = v0 | (v1 << 16u);
    }
}
