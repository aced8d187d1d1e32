// SPEC §1 probe: per element, which agents changed it (|θ_t − θ₀| > ε) and how many; per agent the
// histogram "changed and shared with k other agents", reduced in workgroup memory, then added to
// the chunk's totals (u32 per chunk: a chunk has < 2^32 elements; the host sums chunks in u64).
// Needs dtype.wgsl and chunk.wgsl prepended.

@group(0) @binding(3) var<storage, read_write> hist: array<atomic<u32>>;

const MAX_AGENTS: u32 = 32u;
var<workgroup> local_hist: array<atomic<u32>, 1024>; // MAX_AGENTS²

fn count_mask(mask: u32) {
    if (mask == 0u) {
        return;
    }
    let others = countOneBits(mask) - 1u;
    var bits = mask;
    while (bits != 0u) {
        let t = firstTrailingBit(bits);
        atomicAdd(&local_hist[t * p.n + others], 1u);
        bits = bits & (bits - 1u);
    }
}

@compute @workgroup_size(WG)
fn probe(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    let nn = p.n * p.n;
    for (var i = li; i < nn; i = i + WG) {
        atomicStore(&local_hist[i], 0u);
    }
    workgroupBarrier();
    let g = pair_index(wid, li);
    if (g < p.pairs) {
        let b = decode_pair(load_pair(true, 0u, g));
        var mask = vec2<u32>(0u, 0u);
        for (var t = 0u; t < p.n; t = t + 1u) {
            mask = mask | select(vec2<u32>(0u, 0u), vec2<u32>(1u << t, 1u << t), is_active(tau_pair(b, t, g)));
        }
        count_mask(mask.x);
        if (2u * g + 1u < p.len) {
            count_mask(mask.y);
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
