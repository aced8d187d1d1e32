//! Every hash and generator rlmerge uses, in one place: SplitMix64 (the demo's data, the tests'
//! random values, the (seed, tensor, agent) key of random masks, `moe`'s random routers and noise) and the per-element mask hash,
//! which shaders/combine.wgsl computes too (`mix32`: u32 arithmetic only, so both agree).

/// SplitMix64's golden-ratio increment.
const GOLDEN: u64 = 0x9e37_79b9_7f4a_7c15;

/// SplitMix64's output for state `z`: the state advanced once, then mixed so that every output
/// bit depends on every input bit.
pub fn splitmix64(z: u64) -> u64 {
    let mut z = z.wrapping_add(GOLDEN);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// A small deterministic PRNG (SplitMix64): reproducible data without a dependency.
pub struct SplitMix64(u64);

impl SplitMix64 {
    /// A generator seeded with `seed`.
    pub fn new(seed: u64) -> SplitMix64 {
        SplitMix64(seed)
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        let z = splitmix64(self.0);
        self.0 = self.0.wrapping_add(GOLDEN);
        z
    }

    /// Uniform in [0, 1).
    pub fn next_f64(&mut self) -> f64 {
        unit(self.next_u64())
    }
}

/// Uniform value `i` in [0, 1) of the stream keyed `key` (splitmix64(key + i)): any element
/// computed alone, in any order, on any thread, is the same value.
pub fn uniform_at(key: u64, i: u64) -> f64 {
    unit(splitmix64(key.wrapping_add(i)))
}

/// 64 random bits as a uniform value in [0, 1): their top 53, the mantissa's.
fn unit(bits: u64) -> f64 {
    (bits >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
}

/// Standard normal value `i` of the stream keyed `key` (Box–Muller on uniforms 2i and 2i + 1 of
/// [`uniform_at`]; the cosine's): as reproducible element by element.
pub fn normal_at(key: u64, i: u64) -> f64 {
    let at = i.wrapping_mul(2);
    let u1 = 1.0 - uniform_at(key, at);
    let u2 = uniform_at(key, at.wrapping_add(1));
    (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()
}

/// Wellons' lowbias32 integer hash (u32 only, so the shaders compute the same).
#[inline]
pub fn mix32(mut x: u32) -> u32 {
    x ^= x >> 16;
    x = x.wrapping_mul(0x7feb_352d);
    x ^= x >> 15;
    x = x.wrapping_mul(0x846c_a68b);
    x ^= x >> 16;
    x
}

/// The per-element hash of DARE-style random masks: a function of (seed, tensor, agent) through
/// `key` and of the element's index in the tensor only — never of tiles or backends. One mixing
/// round: distinct indices give distinct inputs, and lowbias32 spreads them.
#[inline]
pub fn element_hash(key: [u32; 2], idx: u32) -> u32 {
    mix32(idx ^ key[0]) ^ key[1]
}

/// The (seed, tensor name, agent) part of the hash, computed on the host.
pub fn hash_key(seed: u64, tensor: &str, agent: usize) -> [u32; 2] {
    // FNV-1a over the name, then SplitMix64 finalizers.
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in tensor.bytes() {
        h = (h ^ b as u64).wrapping_mul(0x0000_0100_0000_01b3);
    }
    let mut z = seed ^ splitmix64(h ^ splitmix64(agent as u64 + 1));
    z = splitmix64(z);
    [z as u32, (z >> 32) as u32]
}
