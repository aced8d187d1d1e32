// C = A · B in f32, row-major: A rows × k, B k × cols, C rows × cols — the GEMM of the spectral
// methods' row maps (SPEC §4g). A standalone kernel (no codecs: its inputs are f32). Each
// workgroup computes a 16 × 16 tile of C, walking k in steps of 16 through workgroup memory; each
// element's sum runs over k in order, so the bits do not depend on the dispatch.

struct Dims {
    rows: u32,
    k: u32,
    cols: u32,
    // Columns of C the output buffer holds per row (a panel of B writes its own columns).
    c_stride: u32,
    // C's first column for this panel.
    c_offset: u32,
    _pad0: u32,
    _pad1: u32,
    _pad2: u32,
}

@group(0) @binding(0) var<uniform> dims: Dims;
@group(0) @binding(1) var<storage, read> a: array<f32>;
@group(0) @binding(2) var<storage, read> b: array<f32>;
@group(0) @binding(3) var<storage, read_write> c: array<f32>;

const TILE: u32 = 16u;

var<workgroup> tile_a: array<array<f32, 16>, 16>;
var<workgroup> tile_b: array<array<f32, 16>, 16>;

@compute @workgroup_size(16, 16)
fn gemm(@builtin(workgroup_id) group: vec3<u32>, @builtin(local_invocation_id) local: vec3<u32>) {
    let row = group.y * TILE + local.y;
    let col = group.x * TILE + local.x;
    var acc = 0.0;
    let steps = (dims.k + TILE - 1u) / TILE;
    for (var s = 0u; s < steps; s = s + 1u) {
        let ka = s * TILE + local.x;
        var va = 0.0;
        if (row < dims.rows && ka < dims.k) {
            va = a[row * dims.k + ka];
        }
        tile_a[local.y][local.x] = va;
        let kb = s * TILE + local.y;
        var vb = 0.0;
        if (kb < dims.k && col < dims.cols) {
            vb = b[kb * dims.cols + col];
        }
        tile_b[local.y][local.x] = vb;
        workgroupBarrier();
        for (var i = 0u; i < TILE; i = i + 1u) {
            acc = acc + tile_a[local.y][i] * tile_b[i][local.x];
        }
        workgroupBarrier();
    }
    if (row < dims.rows && col < dims.cols) {
        c[row * dims.c_stride + dims.c_offset + col] = acc;
    }
}
