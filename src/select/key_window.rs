//! Which elements of a chunk have magnitude keys in a window of high bins: bit masks made eight
//! or sixteen elements at a time (AVX2 / AVX-512, with a scalar twin), and the scans built on them.

use super::bins::BINS;
use super::cut::magnitude_key;
use crate::simd::multiversion;

/// A run of high bins `lo..=hi` (the top 16 bits of magnitude keys) that a histogram pass
/// counts bin by bin; keys above and below it are only counted.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(super) struct KeyWindow {
    pub(super) lo: u32,
    pub(super) hi: u32,
}

impl KeyWindow {
    /// Every bin: a full histogram.
    pub(super) const ALL: KeyWindow = KeyWindow {
        lo: 0,
        hi: (BINS / 2 - 1) as u32,
    };

    /// The window around some bins (at least one).
    pub(super) fn around(bins: &[u32]) -> KeyWindow {
        KeyWindow {
            lo: *bins.iter().min().expect("a bin"),
            hi: *bins.iter().max().expect("a bin"),
        }
    }

    /// The smallest and the largest key in the window.
    pub(super) fn keys(self) -> (u32, u32) {
        (self.lo << 16, (self.hi << 16) | 0xffff)
    }
}

/// What [`window_bits`] counts besides its bits.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(super) struct WindowTally {
    /// Keys above the window.
    pub(super) above: u64,
    /// Keys in the window (non-zero).
    pub(super) inside: u64,
}

impl WindowTally {
    pub(super) const NONE: WindowTally = WindowTally {
        above: 0,
        inside: 0,
    };

    pub(super) fn add(&mut self, o: WindowTally) {
        self.above += o.above;
        self.inside += o.inside;
    }
}

/// Bit `i % 64` of `inside[i / 64]`: whether element i's magnitude key is non-zero and in
/// `window`; of `low[i / 64]`: whether it is also not a multiple of 2^16 (its bin holds more than
/// one key). Keys above the window are only counted; zeros and keys below it, neither (the rest).
/// With AVX2, eight elements per compare and `movemask`; with AVX-512, sixteen per compare into
/// mask registers (compilers do not find either for bit packing); the same result every way.
pub(super) fn window_bits(
    v: &[f32],
    window: KeyWindow,
    inside: &mut [u64],
    low: &mut [u64],
) -> WindowTally {
    let whole = v.len() / 64;
    let (blocks, rest) = v.split_at(whole * 64);
    #[cfg(target_arch = "x86_64")]
    let mut tally = {
        use crate::simd::{level, Level};
        match level() {
            // SAFETY: the CPU supports AVX-512 F/BW/VL, detected by `level`; every block read
            // is 64 elements.
            Level::Avx512 => unsafe { window_bits_avx512(blocks, window, inside, low) },
            // SAFETY: the CPU supports AVX2, detected by `level`; blocks of 64 elements.
            Level::Avx2 => unsafe { window_bits_avx2(blocks, window, inside, low) },
            Level::Baseline => window_bits_scalar(blocks, window, inside, low),
        }
    };
    #[cfg(not(target_arch = "x86_64"))]
    let mut tally = window_bits_scalar(blocks, window, inside, low);
    tally.add(window_bits_scalar(
        rest,
        window,
        &mut inside[whole..],
        &mut low[whole..],
    ));
    tally
}

pub(super) fn window_bits_scalar(
    v: &[f32],
    window: KeyWindow,
    inside: &mut [u64],
    low: &mut [u64],
) -> WindowTally {
    let (first, last) = window.keys();
    let (mut above, mut count) = (0, 0);
    for ((x, n), l) in v.chunks(64).zip(inside.iter_mut()).zip(low.iter_mut()) {
        let (mut wn, mut wl) = (0u64, 0u64);
        for (i, &e) in x.iter().enumerate() {
            let key = magnitude_key(e);
            above += (key > last) as u64;
            let is_in = (key != 0) & (key <= last) & (key >= first);
            wn |= (is_in as u64) << i;
            wl |= ((is_in & (key & 0xffff != 0)) as u64) << i;
        }
        count += wn.count_ones() as u64;
        *n = wn;
        *l = wl;
    }
    WindowTally {
        above,
        inside: count,
    }
}

/// [`window_bits`] over whole blocks of 64 elements.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,bmi1,bmi2,lzcnt,popcnt")]
pub(super) fn window_bits_avx2(
    v: &[f32],
    window: KeyWindow,
    inside: &mut [u64],
    low: &mut [u64],
) -> WindowTally {
    use std::arch::x86_64::*;
    let (first, last_key) = window.keys();
    // Keys are below 2^31: signed compares order them. From bin 0 on, a key is in the window
    // unless zero; from a later bin, unless below its first key (then it is not zero either).
    let from_zero = first == 0;
    let below_first = _mm256_set1_epi32(first as i32 - 1);
    let last = _mm256_set1_epi32(last_key as i32);
    let magnitude = _mm256_set1_epi32(0x7fff_ffff);
    let low_bits = _mm256_set1_epi32(0xffff);
    let zero = _mm256_setzero_si256();
    // Per-lane counts (a true compare is −1), reduced at the end.
    let mut above = zero;
    let mut count = 0u64;
    for ((x, n), l) in v
        .chunks_exact(64)
        .zip(inside.iter_mut())
        .zip(low.iter_mut())
    {
        let (mut wn, mut wl) = (0u64, 0u64);
        for (g, group) in x.chunks_exact(8).enumerate() {
            // SAFETY: `group` holds eight f32 (32 bytes); unaligned loads are allowed.
            let bits = unsafe { _mm256_loadu_si256(group.as_ptr().cast()) };
            let key = _mm256_and_si256(bits, magnitude);
            let is_above = _mm256_cmpgt_epi32(key, last);
            let is_in = if from_zero {
                _mm256_andnot_si256(
                    _mm256_or_si256(_mm256_cmpeq_epi32(key, zero), is_above),
                    _mm256_set1_epi32(-1),
                )
            } else {
                _mm256_andnot_si256(is_above, _mm256_cmpgt_epi32(key, below_first))
            };
            let low_zero = _mm256_cmpeq_epi32(_mm256_and_si256(key, low_bits), zero);
            let is_low = _mm256_andnot_si256(low_zero, is_in);
            above = _mm256_sub_epi32(above, is_above);
            let mi = _mm256_movemask_ps(_mm256_castsi256_ps(is_in)) as u64;
            let ml = _mm256_movemask_ps(_mm256_castsi256_ps(is_low)) as u64;
            wn |= mi << (8 * g);
            wl |= ml << (8 * g);
        }
        count += wn.count_ones() as u64;
        *n = wn;
        *l = wl;
    }
    let lanes = |v: __m256i| -> [i32; 8] {
        let mut out = [0i32; 8];
        // SAFETY: `out` holds eight i32 (32 bytes).
        unsafe { _mm256_storeu_si256(out.as_mut_ptr().cast(), v) };
        out
    };
    WindowTally {
        above: lanes(above).iter().map(|&c| c as u64).sum(),
        inside: count,
    }
}

/// [`window_bits_avx2`] with AVX-512: sixteen elements per compare, straight into bit masks.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,avx512f,avx512bw,avx512vl,bmi1,bmi2,lzcnt,popcnt")]
pub(super) fn window_bits_avx512(
    v: &[f32],
    window: KeyWindow,
    inside: &mut [u64],
    low: &mut [u64],
) -> WindowTally {
    use std::arch::x86_64::*;
    let (first, last_key) = window.keys();
    // As in `window_bits_avx2`: keys are below 2^31, so signed compares order them.
    let from_zero = first == 0;
    let below_first = _mm512_set1_epi32(first as i32 - 1);
    let last = _mm512_set1_epi32(last_key as i32);
    let magnitude = _mm512_set1_epi32(0x7fff_ffff);
    let low_bits = _mm512_set1_epi32(0xffff);
    let zero = _mm512_setzero_si512();
    let (mut above, mut count) = (0u64, 0u64);
    for ((x, n), l) in v
        .chunks_exact(64)
        .zip(inside.iter_mut())
        .zip(low.iter_mut())
    {
        let (mut wn, mut wl, mut wa) = (0u64, 0u64, 0u64);
        for (g, group) in x.chunks_exact(16).enumerate() {
            // SAFETY: `group` holds sixteen f32 (64 bytes); unaligned loads are allowed.
            let bits = unsafe { _mm512_loadu_si512(group.as_ptr().cast()) };
            let key = _mm512_and_si512(bits, magnitude);
            let is_above = _mm512_cmpgt_epi32_mask(key, last);
            let is_in = if from_zero {
                !(_mm512_cmpeq_epi32_mask(key, zero) | is_above)
            } else {
                _mm512_cmpgt_epi32_mask(key, below_first) & !is_above
            };
            let is_low = _mm512_mask_test_epi32_mask(is_in, key, low_bits);
            wn |= (is_in as u64) << (16 * g);
            wl |= (is_low as u64) << (16 * g);
            wa |= (is_above as u64) << (16 * g);
        }
        count += wn.count_ones() as u64;
        above += wa.count_ones() as u64;
        *n = wn;
        *l = wl;
    }
    WindowTally {
        above,
        inside: count,
    }
}

multiversion! {
    /// Bit `i % 64` of `bits[i / 64]`: whether element i's magnitude key is non-zero and, when
    /// `in_bin` is given, has those high 16 bits.
    pub(super) fn key_bits(v: &[f32], in_bin: Option<u32>, bits: &mut [u64]) {
        let (bin, any) = (in_bin.unwrap_or(0), in_bin.is_none());
        for (x, word) in v.chunks(64).zip(bits.iter_mut()) {
            let mut w = 0u64;
            for (i, &e) in x.iter().enumerate() {
                let key = magnitude_key(e);
                let pass = (key != 0) & ((key >> 16 == bin) | any);
                w |= (pass as u64) << i;
            }
            *word = w;
        }
    }
}

/// Calls `f(index, key)` for each element with a non-zero magnitude key in high bin `in_bin`
/// (any bin: `None`): a bit mask first (vectorized), then only the set bits — cheap on sparse
/// task vectors and on a single bin.
#[inline(always)]
pub(super) fn for_each_key(v: &[f32], in_bin: Option<u32>, mut f: impl FnMut(usize, u32)) {
    let mut bits = [0u64; 64];
    for (chunk, x) in v.chunks(64 * 64).enumerate() {
        let words = x.len().div_ceil(64);
        key_bits(x, in_bin, &mut bits[..words]);
        for (w, &word) in bits[..words].iter().enumerate() {
            let mut word = word;
            while word != 0 {
                let i = (chunk * 64 + w) * 64 + word.trailing_zeros() as usize;
                f(i, magnitude_key(v[i]));
                word &= word - 1;
            }
        }
    }
}

pub(super) fn nonzero_count(v: &[f32]) -> u64 {
    v.iter().map(|&e| (magnitude_key(e) != 0) as u64).sum()
}
