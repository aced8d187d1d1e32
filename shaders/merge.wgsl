// SPEC §2 selective merge for the RAM family, in the spec's arithmetic order: τ = a − b in f32;
// Σ of active τ in agent order; c = 1 → b + λ·τ; c ≥ 2 → b + Σ/c, the correctly rounded quotient
// from integer arithmetic (`div_by_count`: WGSL's `/` may be 2.5 ULP off); c = 0 → the base's bits.
// With p.shared_rule = SHARED_CONSENSUS (SPEC §2b), c ≥ 2 takes Σ and c of the active agents whose τ has
// the sign of Σ (+ where Σ ≥ 0, else −), src/backend/cpu/merge.rs `consensus_in_shared_region`.
// One invocation per pair of elements, so a packed 16-bit output word is written by one
// invocation. Needs dtype.wgsl and chunk.wgsl prepended.

const SHARED_MEAN: u32 = 0u;
const SHARED_CONSENSUS: u32 = 1u;

@group(0) @binding(3) var<storage, read> lambdas: array<f32>;
@group(0) @binding(4) var<storage, read_write> out: array<u32>;

// sum / c rounded to nearest even for 1 ≤ c ≤ 64, subnormal results included; ±0, ±Inf and NaN
// pass through. src/method/mod.rs `div_by_count`, step for step (tested against IEEE division).
fn div_by_count(sum: f32, c: u32) -> f32 {
    let bits = bitcast<u32>(sum);
    let sign = bits & 0x80000000u;
    let a = bits & 0x7fffffffu;
    if (a >= 0x7f800000u || a == 0u || c == 1u) {
        return sum;
    }
    var ea = i32(a >> 23u);
    var ma = a & 0x7fffffu;
    if (ea == 0) {
        let shift = 23 - i32(firstLeadingBit(ma));
        ma = ma << u32(shift);
        ea = 1 - shift;
    } else {
        ma = ma | 0x800000u;
    }
    let n = ma << 8u;
    let q = n / c;
    let r = n % c;
    let len = i32(firstLeadingBit(q)) + 1;
    var shift = len - 24;
    var biased = ea - 32 + len;
    if (biased < 1) {
        shift = shift + 1 - biased;
        biased = 1;
    }
    if (shift >= 32) {
        return bitcast<f32>(sign);
    }
    let s = u32(shift);
    let m = q >> s;
    let guard = (q >> (s - 1u)) & 1u;
    let sticky = (q & ((1u << (s - 1u)) - 1u)) != 0u || r != 0u;
    var mm = m;
    if (guard == 1u && (sticky || (m & 1u) == 1u)) {
        mm = m + 1u;
    }
    return bitcast<f32>(sign | ((u32(biased - 1) << 23u) + mm));
}

// The output bits of one element from its base bits and value, Σ of active τ, count and λ; for
// c ≥ 2, `kept` and `k` are the Σ and count the shared rule keeps (Σ and c for the mean).
fn finish(bb: u32, b: f32, sum: f32, c: u32, lam: f32, kept: f32, k: u32) -> u32 {
    if (c == 0u) {
        if (p.out_dt == p.in_dt) {
            return bb;
        }
        return encode_bits(b, p.out_dt);
    }
    var step = div_by_count(kept, k);
    if (c == 1u) {
        // XOR with a runtime zero: the compiler cannot see the product, so cannot fuse it into an FMA.
        step = bitcast<f32>(bitcast<u32>(sum * lam) ^ p.zero);
    }
    return encode_bits(b + step, p.out_dt);
}

@compute @workgroup_size(WG)
fn merge(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    let g = pair_index(wid, li);
    if (g >= p.pairs) {
        return;
    }
    let bb = load_pair(true, 0u, g);
    let b = decode_pair(bb);
    var sum = vec2<f32>(0.0, 0.0);
    var c = vec2<u32>(0u, 0u);
    var lam = vec2<f32>(1.0, 1.0);
    for (var t = 0u; t < p.n; t = t + 1u) {
        let tau = tau_pair(b, t, g);
        let changed = is_active(tau);
        sum = select(sum, sum + tau, changed);
        c = c + select(vec2<u32>(0u, 0u), vec2<u32>(1u, 1u), changed);
        lam = select(lam, vec2<f32>(lambdas[t], lambdas[t]), changed);
    }
    var kept = sum;
    var k = c;
    if (p.shared_rule == SHARED_CONSENSUS) {
        kept = vec2<f32>(0.0, 0.0);
        k = vec2<u32>(0u, 0u);
        let positive = sum >= vec2<f32>(0.0, 0.0);
        for (var t = 0u; t < p.n; t = t + 1u) {
            let tau = tau_pair(b, t, g);
            let same_sign = (positive & (tau > vec2<f32>(0.0, 0.0)))
                | (!positive & (tau < vec2<f32>(0.0, 0.0)));
            let agrees = is_active(tau) & same_sign;
            kept = select(kept, kept + tau, agrees);
            k = k + select(vec2<u32>(0u, 0u), vec2<u32>(1u, 1u), agrees);
        }
    }
    let e0 = 2u * g;
    let v0 = finish(bb.x, b.x, sum.x, c.x, lam.x, kept.x, k.x);
    let has_second = e0 + 1u < p.len;
    var v1 = 0u;
    if (has_second) {
        v1 = finish(bb.y, b.y, sum.y, c.y, lam.y, kept.y, k.y);
    }
    store_pair(g, has_second, v0, v1);
}
