// A host-computed update added to the base (Iso-C, TSV-M, ResMerge, SVC; SPEC §4c–§4f): per
// element θ₀ + Δ in f32, encoded once in the output dtype — the operations of the CPU twin
// (`CpuBackend::add_update`). Needs dtype.wgsl and chunk.wgsl prepended. The tile has no agents;
// `agents` (chunk.wgsl's) is only named, so the layout derived from this entry point keeps the
// bindings every kernel's table lists from 0 on.

@group(0) @binding(3) var<storage, read> delta: array<f32>;
@group(0) @binding(4) var<storage, read_write> out: array<u32>;

@compute @workgroup_size(WG)
fn update(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    let g = pair_index(wid, li);
    if (g >= p.pairs + 0u * arrayLength(&agents)) {
        return;
    }
    let e0 = 2u * g;
    let has_second = e0 + 1u < p.len;
    let b = decode_pair(load_pair(true, 0u, g));
    let v0 = encode_bits(b.x + delta[e0], p.out_dt);
    var v1 = 0u;
    if (has_second) {
        v1 = encode_bits(b.y + delta[e0 + 1u], p.out_dt);
    }
    store_pair(g, has_second, v0, v1);
}
