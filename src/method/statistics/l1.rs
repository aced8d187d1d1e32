//! The L1 norms' sums (DARE's and DELLA's rescale): Σ|x| and Σ|kept x| of a chunk in one fixed
//! order — eight f32 lanes per block of 64, their f64 sum, block after block — so no tiling, thread
//! count or SIMD level changes them.

use crate::simd::multiversion;

/// (Σ|x|, Σ|x| of the kept x) over a chunk, `mask` all ones where x is kept: eight f32 lanes
/// over eight elements each, then f64 — a fixed order, so every run and thread count gives the
/// same sums. Lane j adds elements j, j + 8, … of each block of 64 in turn (eight-wide vector
/// adds); the block's lanes are summed in f64 in lane order and added to the total, block after
/// block. With AVX-512 the whole groups of eight blocks go first, both sums in one pass
/// ([`abs_sums_avx512`]: the same additions), then the rest.
pub(super) fn abs_sums(values: &[f32], mask: &[u32]) -> (f64, f64) {
    let mask = &mask[..values.len()];
    // (Σ|x|, Σ|kept x|) of the whole groups of eight blocks, and the elements they hold.
    #[cfg(target_arch = "x86_64")]
    let (all, kept, done) = if crate::simd::level() == crate::simd::Level::Avx512 {
        let done = values.len() / 512 * 512;
        // SAFETY: the CPU supports AVX-512 F/BW/VL, detected by `level`.
        let (all, kept) = unsafe { abs_sums_avx512(&values[..done], &mask[..done]) };
        (all, kept, done)
    } else {
        (0.0, 0.0, 0)
    };
    #[cfg(not(target_arch = "x86_64"))]
    let (all, kept, done) = (0.0, 0.0, 0);
    (
        abs_sum_from(all, &values[done..], None),
        abs_sum_from(kept, &values[done..], Some(&mask[done..])),
    )
}

/// [`abs_sums`] of whole groups of eight blocks (`values.len()` a multiple of 512) with AVX-512,
/// each value and mask word loaded once for both sums: per sum, the eight blocks' f32 lanes as
/// eight vectors, widened to f64 and transposed ([`block_sums`]), so that one vector add per lane
/// position takes the eight blocks' lane sums side by side — the same additions, in the same
/// order, as block by block, where each block's sum was a scalar chain of eight loads,
/// conversions and adds.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,avx512f,avx512bw,avx512vl,bmi1,bmi2,lzcnt,popcnt")]
fn abs_sums_avx512(values: &[f32], mask: &[u32]) -> (f64, f64) {
    use std::arch::x86_64::*;
    assert!(values.len().is_multiple_of(512) && mask.len() == values.len());
    let magnitude = _mm256_set1_epi32(0x7fff_ffff);
    let (mut all, mut kept) = (0.0f64, 0.0f64);
    for (x, m) in values.chunks_exact(512).zip(mask.chunks_exact(512)) {
        // Block b's lanes, widened: rows[b][k] = lane k of block b. (Loops, not closures: a
        // closure does not inherit the function's target features, and is then not inlined.)
        let mut rows_all = [_mm512_setzero_pd(); 8];
        let mut rows_kept = [_mm512_setzero_pd(); 8];
        for b in 0..8 {
            let mut lanes_all = _mm256_setzero_ps();
            let mut lanes_kept = _mm256_setzero_ps();
            for g in 0..8 {
                let at = 64 * b + 8 * g;
                // SAFETY: `at + 8 ≤ 512`, within the group (the mask is as long as the values);
                // unaligned loads are allowed.
                let (v, k) = unsafe {
                    (
                        _mm256_loadu_si256(x[at..at + 8].as_ptr().cast()),
                        _mm256_loadu_si256(m[at..at + 8].as_ptr().cast()),
                    )
                };
                let v = _mm256_and_si256(v, magnitude);
                lanes_all = _mm256_add_ps(lanes_all, _mm256_castsi256_ps(v));
                let v = _mm256_and_si256(v, k);
                lanes_kept = _mm256_add_ps(lanes_kept, _mm256_castsi256_ps(v));
            }
            rows_all[b] = _mm512_cvtps_pd(lanes_all);
            rows_kept[b] = _mm512_cvtps_pd(lanes_kept);
        }
        let (a, k) = (block_sums(rows_all), block_sums(rows_kept));
        // The blocks' sums into the totals in block order.
        for (a, k) in a.into_iter().zip(k) {
            all += a;
            kept += k;
        }
    }
    (all, kept)
}

/// The eight blocks' f64 sums of their lanes (`rows[b][k]` = lane k of block b), each from −0.0
/// as `Iterator::sum` starts and in lane order: the rows transposed (pairs of rows interleaved,
/// then pairs of 128-bit lanes of those, then of those again), then one vector add per lane.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,avx512f,avx512bw,avx512vl,bmi1,bmi2,lzcnt,popcnt")]
#[inline]
fn block_sums(rows: [std::arch::x86_64::__m512d; 8]) -> [f64; 8] {
    use std::arch::x86_64::*;
    let mut t = [_mm512_setzero_pd(); 8];
    for i in 0..4 {
        t[2 * i] = _mm512_unpacklo_pd(rows[2 * i], rows[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_pd(rows[2 * i], rows[2 * i + 1]);
    }
    let mut u = [_mm512_setzero_pd(); 8];
    for (i, j) in [0, 1, 4, 5].into_iter().enumerate() {
        u[2 * i] = _mm512_shuffle_f64x2::<0x88>(t[j], t[j + 2]);
        u[2 * i + 1] = _mm512_shuffle_f64x2::<0xdd>(t[j], t[j + 2]);
    }
    // cols[k][b] = lane k of block b.
    let mut cols = [_mm512_setzero_pd(); 8];
    for (c, k) in [0, 2, 1, 3].into_iter().enumerate() {
        cols[c] = _mm512_shuffle_f64x2::<0x88>(u[k], u[k + 4]);
        cols[c + 4] = _mm512_shuffle_f64x2::<0xdd>(u[k], u[k + 4]);
    }
    let mut sums = _mm512_set1_pd(-0.0);
    for c in cols {
        sums = _mm512_add_pd(sums, c);
    }
    let mut by_block = [0.0f64; 8];
    // SAFETY: `by_block` holds eight f64 (64 bytes); unaligned stores are allowed.
    unsafe { _mm512_storeu_pd(by_block.as_mut_ptr(), sums) };
    by_block
}

multiversion! {
    /// Σ|x| (of the kept x when `mask` is given) block by block ([`abs_sums`]' order), adding
    /// each block's sum to `total`.
    fn abs_sum_from(total: f64, values: &[f32], mask: Option<&[u32]>) -> f64 {
        let mut total = total;
        for (block, x) in values.chunks(64).enumerate() {
            let mut lanes = [0.0f32; 8];
            // Whole groups of eight, then the rest (a partial group would become a masked
            // store, microcoded on AMD).
            let m = mask.map(|m| &m[block * 64..block * 64 + x.len()]);
            let whole = x.len() / 8 * 8;
            let add = |lanes: &mut [f32], x: &[f32], m: Option<&[u32]>| match m {
                None => {
                    for (l, &v) in lanes.iter_mut().zip(x) {
                        *l += v.abs();
                    }
                }
                Some(m) => {
                    for ((l, &v), &m) in lanes.iter_mut().zip(x).zip(m) {
                        *l += f32::from_bits(v.to_bits() & m & 0x7fff_ffff);
                    }
                }
            };
            for g in (0..whole).step_by(8) {
                add(&mut lanes, &x[g..g + 8], m.map(|m| &m[g..g + 8]));
            }
            add(&mut lanes[..x.len() - whole], &x[whole..], m.map(|m| &m[whole..]));
            total += lanes.iter().map(|&l| l as f64).sum::<f64>();
        }
        total
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hash::SplitMix64;

    /// The L1 sums in their defining order, block by block: each block of 64's eight f32 lanes
    /// (lane j: elements j, j + 8, … from 0.0), their f64 sum added to the total.
    fn reference(values: &[f32], mask: Option<&[u32]>) -> f64 {
        let mut total = 0.0f64;
        for (block, x) in values.chunks(64).enumerate() {
            let mut lanes = [0.0f32; 8];
            for (i, &v) in x.iter().enumerate() {
                let kept = mask.is_none_or(|m| m[block * 64 + i] != 0);
                if kept {
                    lanes[i % 8] += v.abs();
                }
            }
            let mut s = 0.0f64;
            for l in lanes {
                s += l as f64;
            }
            total += s;
        }
        total
    }

    /// The order of a block's lanes shows in its f64 sum: 1 + 2^-53 + 2^-52 is 1 + 2^-52 in
    /// that order and 1 + 2^-51 with the last two swapped (round half to even), and 1 coming
    /// later gives the latter too. Every placement of the three lanes, in each of the eight
    /// places a group's blocks are summed side by side: abs_sums' total is that block's sum.
    #[test]
    fn abs_sums_keep_the_lane_order() {
        let lanes = [1.0f32, f32::powi(2.0, -53), f32::powi(2.0, -52)];
        for b in 0..8 {
            for one in 0..8 {
                for half in (0..8).filter(|&k| k != one) {
                    for ulp in (0..8).filter(|&k| k != one && k != half) {
                        let mut v = vec![0.0f32; 1024];
                        for (k, x) in [one, half, ulp].into_iter().zip(lanes) {
                            v[64 * b + k] = -x;
                        }
                        // Kept: lane `one` alone (its 1.0 is the kept sum), then every lane
                        // (the two sums alike).
                        let mut m = vec![0u32; v.len()];
                        m[64 * b + one] = u32::MAX;
                        let (all, kept) = abs_sums(&v, &m);
                        assert_eq!(
                            all.to_bits(),
                            reference(&v, None).to_bits(),
                            "block {b}, lanes {one} {half} {ulp}"
                        );
                        assert_eq!(kept, 1.0);
                        let (all, kept) = abs_sums(&v, &vec![u32::MAX; v.len()]);
                        assert_eq!(all.to_bits(), kept.to_bits());
                    }
                }
            }
        }
        // The reference tells the orders apart.
        let mut v = vec![0.0f32; 64];
        v[..3].copy_from_slice(&lanes);
        let swapped = [lanes[0], lanes[2], lanes[1]];
        let mut w = vec![0.0f32; 64];
        w[..3].copy_from_slice(&swapped);
        assert_ne!(reference(&v, None), reference(&w, None));
    }

    /// abs_sums' vectorized lanes are the block-by-block sum bit for bit: lengths around the
    /// blocks and the groups of eight, with and without a mask, values over many binades (so the
    /// order of the additions shows).
    #[test]
    fn abs_sums_keep_the_block_order() {
        let mut rng = SplitMix64::new(9);
        for len in [0usize, 1, 7, 63, 64, 65, 511, 512, 513, 1000, 4096, 5000] {
            // Each lane of each block (element i: lane i % 8 of block i / 64) in its own
            // binades, up to 2^120 apart, so the f64 sums round and their order shows.
            let lane_exp: Vec<i32> = (0..len.div_ceil(64) * 8)
                .map(|_| (rng.next_u64() % 120) as i32 - 60)
                .collect();
            let v: Vec<f32> = (0..len)
                .map(|i| {
                    let u = rng.next_u64();
                    let e = lane_exp[i / 64 * 8 + i % 8] + (u % 4) as i32;
                    let x = (u >> 40) as f32 * f32::powi(2.0, e - 24);
                    if u & 1 == 0 {
                        x
                    } else {
                        -x
                    }
                })
                .collect();
            let m: Vec<u32> = (0..len)
                .map(|_| rng.next_u64().is_multiple_of(3) as u32 * u32::MAX)
                .collect();
            let (all, kept) = abs_sums(&v, &m);
            assert_eq!(all.to_bits(), reference(&v, None).to_bits(), "len {len}");
            assert_eq!(
                kept.to_bits(),
                reference(&v, Some(&m)).to_bits(),
                "len {len}, masked"
            );
        }
    }
}
