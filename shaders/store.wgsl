// Storing a pair of results: how every kernel with an output (merge, combine, update) ends.
// Put before those kernels by the host (src/backend/gpu/mod.rs); `out` is each kernel's own
// binding, which WGSL finds wherever the module declares it.

// Elements 2g and 2g+1 (when `has_second`) of the chunk's output, from their encoded bits `v0`
// and `v1`: a word each for f32, one packed word for a 16-bit pair.
fn store_pair(g: u32, has_second: bool, v0: u32, v1: u32) {
    if (p.out_dt == DT_F32) {
        out[2u * g] = v0;
        if (has_second) {
            out[2u * g + 1u] = v1;
        }
    } else {
        out[g] = v0 | (v1 << 16u);
    }
}
