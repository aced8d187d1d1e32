// SPEC §1 probe: per element, which agents changed it (|θ_t − θ₀| > ε) and how many; per agent the
// histogram "changed and shared with k other agents", reduced in workgroup memory, then added to
// the chunk's totals (u32 per chunk: a chunk has < 2^32 elements; the host sums chunks in u64).
// Needs dtype.wgsl prepended.

struct Params {
    len: u32,        // elements in this chunk
    pairs: u32,      // ceil(len / 2): one invocation per pair of elements
    n: u32,          // agents
    in_dt: u32,
    out_dt: u32,
    stride: u32,     // words per agent segment in `agents`
    eps: f32,
    zero: u32,       // always 0: makes a product opaque so it is never fused into an FMA
    groups_x: u32,   // workgroups along x (2-D dispatch past 65 535)
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> base: array<u32>;
@group(0) @binding(2) var<storage, read> agents: array<u32>;
@group(0) @binding(3) var<storage, read_write> hist: array<atomic<u32>>;

const WG: u32 = 256u;
const MAX_AGENTS: u32 = 32u;
var<workgroup> local_hist: array<atomic<u32>, 1024>; // MAX_AGENTS²

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

@compute @workgroup_size(256)
fn probe(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    let nn = p.n * p.n;
    for (var i = li; i < nn; i = i + WG) {
        atomicStore(&local_hist[i], 0u);
    }
    workgroupBarrier();
    let g = (wid.y * p.groups_x + wid.x) * WG + li;
    if (g < p.pairs) {
        for (var k = 0u; k < 2u; k = k + 1u) {
            let e = 2u * g + k;
            if (e < p.len) {
                let b = decode_bits(elem_bits(0u, e, p.in_dt, true), p.in_dt);
                var mask = 0u;
                for (var t = 0u; t < p.n; t = t + 1u) {
                    let a = decode_bits(elem_bits(t * p.stride, e, p.in_dt, false), p.in_dt);
                    if (abs(a - b) > p.eps) {
                        mask = mask | (1u << t);
                    }
                }
                if (mask != 0u) {
                    let others = countOneBits(mask) - 1u;
                    var bits = mask;
                    while (bits != 0u) {
                        let t = firstTrailingBit(bits);
                        atomicAdd(&local_hist[t * p.n + others], 1u);
                        bits = bits & (bits - 1u);
                    }
                }
            }
        }
    }
    workgroupBarrier();
    for (var i = li; i < nn; i = i + WG) {
        let v = atomicLoad(&local_hist[i]);
        if (v != 0u) {
            atomicAdd(&hist[i], v);
        }
    }
}
