// What every kernel (probe, merge, combine) reads: the chunk's uniforms and its input words.
// Prepended (after dtype.wgsl) to each kernel by the host; `Params` mirrors the struct of that name
// in src/backend/gpu/layout.rs, and a test compares the two.

struct Params {
    len: u32,        // elements in this chunk
    pairs: u32,      // ceil(len / 2): one invocation per pair of elements
    n: u32,          // agents
    in_dt: u32,
    out_dt: u32,
    stride: u32,     // words per agent segment in `agents` (even)
    eps: f32,
    zero: u32,       // always 0: makes a product opaque so it is never fused into an FMA
    groups_x: u32,   // workgroups along x (2-D dispatch past 65 535)
    shared_rule: u32, // merge.wgsl: SHARED_MEAN or SHARED_CONSENSUS
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> base: array<u32>;
@group(0) @binding(2) var<storage, read> agents: array<u32>;

const WG: u32 = 256u;

// The invocation's pair index from a possibly 2-D dispatch.
fn pair_index(wid: vec3<u32>, li: u32) -> u32 {
    return (wid.y * p.groups_x + wid.x) * WG + li;
}

// Raw bits of elements 2g and 2g+1 of the base (`at` ignored) or of the agent segment at word `at`:
// one word for a packed 16-bit pair, two for f32 (segments are padded to an even word count).
fn load_pair(from_base: bool, at: u32, g: u32) -> vec2<u32> {
    if (p.in_dt == DT_F32) {
        if (from_base) {
            return vec2<u32>(base[2u * g], base[2u * g + 1u]);
        }
        return vec2<u32>(agents[at + 2u * g], agents[at + 2u * g + 1u]);
    }
    var w: u32;
    if (from_base) {
        w = base[g];
    } else {
        w = agents[at + g];
    }
    return vec2<u32>(w & 0xffffu, w >> 16u);
}

fn decode_pair(bits: vec2<u32>) -> vec2<f32> {
    return vec2<f32>(decode_bits(bits.x, p.in_dt), decode_bits(bits.y, p.in_dt));
}

// τ = θ_t − θ₀ for the pair, in f32.
fn tau_pair(b: vec2<f32>, t: u32, g: u32) -> vec2<f32> {
    return decode_pair(load_pair(false, t * p.stride, g)) - b;
}

// SPEC §1: an element is changed when |τ| > ε, strictly.
fn is_active(tau: vec2<f32>) -> vec2<bool> {
    return abs(tau) > vec2<f32>(p.eps, p.eps);
}
