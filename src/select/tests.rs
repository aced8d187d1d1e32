use super::key_window::*;
use super::*;
use crate::scans::memory::scan_of;
use crate::scans::SCAN_CHUNK;

/// Exact top-k with ties at the threshold going to lower indices, for any tiling.
#[test]
fn rank_cuts_are_exact_with_ties() {
    let v = vec![vec![0.5f32, -2.0, 1.0, 2.0, -1.0, 1.0, 0.0, 1.0]];
    for (tile, memory) in [(1, 0), (3, 0), (8, 0), (1, 100), (3, 100), (8, 100)] {
        let cuts_of = |want| {
            rank_cuts_remembering(
                &mut scan_of(v.clone(), tile),
                true,
                (1, v.len() as u64, 0),
                &[want],
                memory,
            )
            .unwrap()
        };
        // k = 4: 2, 2 (indices 1, 3) then two of the three 1.0s: indices 2 and 4.
        let cuts = cuts_of((0, 4, false));
        assert_eq!(cuts[0].value, magnitude_key(1.0));
        assert_eq!(cuts[0].index, 5, "tile {tile}");
        let kept: Vec<usize> = (0..8)
            .filter(|&i| cuts[0].inside(magnitude_key(v[0][i]), i as u32))
            .collect();
        assert_eq!(kept, [1, 2, 3, 4]);
        // Higher index first: the 1.0s at indices 7 and 5.
        let cuts = cuts_of((0, 4, true));
        let kept: Vec<usize> = (0..8)
            .filter(|&i| cuts[0].inside(magnitude_key(v[0][i]), i as u32))
            .collect();
        assert_eq!(kept, [1, 3, 5, 7], "tile {tile}");
    }
}

/// Several chunks, several agents, heavy ties: every cut keeps exactly the sort's top k (ties
/// by index), whether the threshold's bin is remembered or searched, though the any-order
/// passes see the chunks last first on two workers.
#[test]
fn rank_cuts_match_a_sort_over_many_chunks() {
    let len = 40 * SCAN_CHUNK + 17;
    let mut rng = crate::hash::SplitMix64::new(7);
    // Few distinct magnitudes, zeros, both signs: many ties at any threshold. Agent 2 also
    // has magnitudes that share a high bin with different low bits.
    let v: Vec<Vec<f32>> = (0..3)
        .map(|t| {
            (0..len)
                .map(|_| {
                    let r = rng.next_f64();
                    if r < 0.3 + 0.2 * t as f64 {
                        return 0.0;
                    }
                    let mut m = [0.25f32, 0.5, 0.75, 1.0, 3.0][(r * 1000.0) as usize % 5];
                    if t == 2 && r > 0.9 {
                        m = f32::from_bits(m.to_bits() + 1 + (r * 1e4) as u32 % 3);
                    }
                    if r < 0.8 {
                        m
                    } else {
                        -m
                    }
                })
                .collect()
        })
        .collect();
    let cases = [
        (0, 1, false),
        (1, 7777, false),
        (2, 50_000, true),
        (2, 20_000, false),
        (0, 90_000, true),
        // Deep among agent 2's zeros (70 % of it): pass 1 counts bin 0 alone.
        (2, 150_000, false),
    ];
    // The cut keeps exactly the sort's top k (zeros aside).
    let check = |cut: RankCut, (t, k, high_first): (usize, u64, bool), what: &str| {
        let got: Vec<usize> = (0..len)
            .filter(|&i| cut.inside(magnitude_key(v[t][i]), i as u32) && v[t][i] != 0.0)
            .collect();
        assert_eq!(got, sorted_top(&v[t], k as usize, high_first), "{what}");
    };
    for (memory, sample_min) in [(0, 0), (1 << 20, 0), (0, u64::MAX), (1 << 20, u64::MAX)] {
        for (t, k, high_first) in cases {
            let cut = rank_cuts_remembering(
                &mut scan_of(v.clone(), 1000),
                true,
                (3, len as u64, sample_min),
                &[(t, k, high_first)],
                memory,
            )
            .unwrap()[0];
            let what = format!("agent {t}, k {k}, high first {high_first}, memory {memory}");
            check(
                cut,
                (t, k, high_first),
                &format!("{what}, sample {sample_min}"),
            );
        }
        // Every cut at once, as breadcrumbs asks two per agent: one lane per cut, far apart.
        let all = rank_cuts_remembering(
            &mut scan_of(v.clone(), 1000),
            true,
            (3, len as u64, sample_min),
            &cases,
            memory,
        )
        .unwrap();
        for (&(t, k, high_first), cut) in cases.iter().zip(all) {
            let what = format!("together: agent {t}, k {k}, memory {memory}, sample {sample_min}");
            check(cut, (t, k, high_first), &what);
        }
    }
}

/// The top k of `v[t]` by magnitude, ties to the lower index (`high_first`: the higher), as a
/// sort finds them, zeros left out (which zeros a zero threshold keeps changes nothing).
fn sorted_top(v: &[f32], k: usize, high_first: bool) -> Vec<usize> {
    let mut order: Vec<usize> = (0..v.len()).collect();
    order.sort_by(|&a, &b| {
        let (ka, kb) = (magnitude_key(v[a]), magnitude_key(v[b]));
        kb.cmp(&ka)
            .then(if high_first { b.cmp(&a) } else { a.cmp(&b) })
    });
    let mut top: Vec<usize> = order[..k]
        .iter()
        .copied()
        .filter(|&i| v[i] != 0.0)
        .collect();
    top.sort();
    top
}

/// A sample that sees only the large values guesses a window that misses the cut: pass 1
/// counts again over every bin, and the cut is still exact.
#[test]
fn rank_cuts_survive_a_misleading_sample() {
    let len = 40 * SCAN_CHUNK;
    let mut rng = crate::hash::SplitMix64::new(11);
    // The sampled chunks (every 16th) hold large magnitudes, the others small ones and zeros.
    let v: Vec<f32> = (0..len)
        .map(|i| {
            let r = rng.next_f64();
            let m = if (i / SCAN_CHUNK).is_multiple_of(SAMPLE_EVERY) {
                [8.0f32, 16.0][(r * 2.0) as usize]
            } else if r < 0.3 {
                0.0
            } else {
                [0.25f32, 0.5, 0.75][(r * 3.0) as usize]
            };
            if r < 0.5 {
                m
            } else {
                -m
            }
        })
        .collect();
    for (k, high_first) in [(5_000, false), (30_000, false), (100_000, true)] {
        for memory in [0, 1 << 20] {
            let cut = rank_cuts_remembering(
                &mut scan_of(vec![v.clone()], 1000),
                true,
                (1, len as u64, 0),
                &[(0, k as u64, high_first)],
                memory,
            )
            .unwrap()[0];
            let got: Vec<usize> = (0..len)
                .filter(|&i| cut.inside(magnitude_key(v[i]), i as u32) && v[i] != 0.0)
                .collect();
            assert_eq!(got, sorted_top(&v, k, high_first), "k {k}, memory {memory}");
        }
    }
}

/// Finely spread magnitudes (f32 task vectors, a LoRA agent's products), each row of its own
/// scale: a sample of whole chunks strays by far more ranks than the bins next to its guess
/// hold, and the window reaching SAMPLE_MARGIN deviations around it still holds the cut — one
/// pass 1, no second one over every bin — and the cut is exact.
#[test]
fn a_sample_of_spread_keys_guesses_a_window_that_holds_the_cut() {
    let (rows, width) = (64, 2 * SCAN_CHUNK);
    let mut rng = crate::hash::SplitMix64::new(23);
    let v: Vec<f32> = (0..rows)
        .flat_map(|r| {
            let scale = (1.0 + r as f64 * 0.37).powi(2);
            (0..width)
                .map(|_| ((rng.next_f64() - 0.5) * scale) as f32)
                .collect::<Vec<f32>>()
        })
        .collect();
    let len = v.len() as u64;
    for k in [len / 10, len / 2, len * 8 / 10] {
        let mut scan = scan_of(vec![v.clone()], 1000);
        let cut = rank_cuts_remembering(&mut scan, true, (1, len, 0), &[(0, k, false)], 1 << 20)
            .unwrap()[0];
        let got: Vec<usize> = (0..v.len())
            .filter(|&i| cut.inside(magnitude_key(v[i]), i as u32) && v[i] != 0.0)
            .collect();
        assert_eq!(got, sorted_top(&v, k as usize, false), "k {k}");
        // Pass 1 once, then pass 2 in the cut's bin (it holds several keys).
        assert_eq!(scan.full_passes, 2, "k {k}: pass 1 missed the cut");
    }
}

/// The vector and the scalar window scans agree on bits, counts and extremes, for windows from
/// bin 0, in the middle and at the top, with zeros, denormals and a NaN's key among the values.
#[test]
fn window_bits_vector_and_scalar_agree() {
    let mut rng = crate::hash::SplitMix64::new(5);
    let v: Vec<f32> = (0..1000)
        .map(|i| match i % 50 {
            0 => 0.0,
            1 => -0.0,
            2 => f32::from_bits(3),
            3 => f32::from_bits(u32::MAX),
            _ => ((rng.next_f64() - 0.5) * 4.0) as f32,
        })
        .collect();
    let key_bin = |x: f32| magnitude_key(x) >> 16;
    let windows = [
        KeyWindow::ALL,
        KeyWindow { lo: 0, hi: 0 },
        KeyWindow::around(&[key_bin(0.3), key_bin(1.5)]),
        KeyWindow::around(&[key_bin(1.0)]),
        KeyWindow::around(&[KeyWindow::ALL.hi]),
    ];
    for window in windows {
        for len in [0usize, 63, 64, 1000] {
            let words = len.div_ceil(64);
            let (mut a, mut b) = (
                (vec![0; words], vec![0; words]),
                (vec![0; words], vec![0; words]),
            );
            let fast = window_bits(&v[..len], window, &mut a.0, &mut a.1);
            let slow = window_bits_scalar(&v[..len], window, &mut b.0, &mut b.1);
            assert_eq!((fast, &a), (slow, &b), "window {window:?}, {len} values");
            // Each vector build the CPU runs, over the whole blocks.
            #[cfg(target_arch = "x86_64")]
            {
                use crate::simd::{detected, Level};
                let blocks = &v[..len / 64 * 64];
                let whole = blocks.len() / 64;
                let mut want = (vec![0; whole], vec![0; whole]);
                let want_tally = window_bits_scalar(blocks, window, &mut want.0, &mut want.1);
                let mut got = (vec![0; whole], vec![0; whole]);
                if detected() >= Level::Avx2 {
                    // SAFETY: the CPU has AVX2; blocks of 64 elements.
                    let t = unsafe { window_bits_avx2(blocks, window, &mut got.0, &mut got.1) };
                    assert_eq!((t, &got), (want_tally, &want), "AVX2, window {window:?}");
                }
                if detected() >= Level::Avx512 {
                    // SAFETY: the CPU has AVX-512 F/BW/VL; blocks of 64 elements.
                    let t = unsafe { window_bits_avx512(blocks, window, &mut got.0, &mut got.1) };
                    assert_eq!((t, &got), (want_tally, &want), "AVX-512, window {window:?}");
                }
            }
            let (first, last) = window.keys();
            let keys = v[..len].iter().map(|&x| magnitude_key(x));
            let inside = keys.clone().filter(|&k| k != 0 && k >= first && k <= last);
            let bits = (0..len).filter(|&i| a.0[i / 64] >> (i % 64) & 1 == 1);
            assert_eq!(slow.inside, bits.count() as u64);
            assert_eq!(slow.inside, inside.count() as u64);
            assert_eq!(slow.above, keys.filter(|&k| k > last).count() as u64);
        }
    }
}

/// The rank cut of a key over every agent at once (SCE's variance, arcee_fusion's importance)
/// keeps exactly a stable sort's top k, whatever the chunk order and worker: keys from few
/// values (ties across many chunks, more than one worker remembers: the bin turns to a histogram
/// and the tie is searched), from many values (members remembered), and zeros never kept.
#[test]
fn key_rank_cuts_match_a_sort() {
    use crate::scans::Values;
    let len = 80 * SCAN_CHUNK + 5;
    let mut rng = crate::hash::SplitMix64::new(11);
    let agents: Vec<Vec<f32>> = (0..2)
        .map(|_| (0..len).map(|_| rng.next_f64() as f32).collect())
        .collect();
    for distinct in [3u32, 1 << 20] {
        // A key from both agents' values, 0 for a tenth of the elements.
        let key_of = |a: f32, b: f32| -> u32 {
            let mixed = ((a * 9973.0 + b * 7919.0) * 1e3) as u32;
            if (a * 10.0) as u32 == 0 {
                0
            } else {
                0x0100_0000 + mixed % distinct
            }
        };
        let keys = |tile: &Values, out: &mut Vec<u32>| {
            out.clear();
            out.extend(
                tile.x[0]
                    .iter()
                    .zip(&tile.x[1])
                    .map(|(&a, &b)| key_of(a, b)),
            );
        };
        let all: Vec<u32> = (0..len)
            .map(|i| key_of(agents[0][i], agents[1][i]))
            .collect();
        let nonzero = all.iter().filter(|&&k| k != 0).count();
        let mut order: Vec<usize> = (0..len).filter(|&i| all[i] != 0).collect();
        order.sort_by(|&a, &b| all[b].cmp(&all[a]).then(a.cmp(&b)));
        for k in [1, nonzero / 3, nonzero / 2 + 1, nonzero] {
            let mut scan = scan_of(agents.clone(), 3 * SCAN_CHUNK + 1);
            let cut = key_rank_cut(&mut scan, len as u64, &keys, |n| {
                assert_eq!(n, nonzero as u64);
                k as u64
            })
            .unwrap();
            // The order statistic alone, without the tie search: the same key.
            let mut scan = scan_of(agents.clone(), 3 * SCAN_CHUNK + 1);
            let value = key_rank_value(&mut scan, len as u64, &keys, |_| k as u64).unwrap();
            assert_eq!(
                value,
                all[order[k - 1]],
                "{distinct} distinct keys, k = {k}"
            );
            let mut kept: Vec<usize> = (0..len)
                .filter(|&i| all[i] != 0 && cut.inside(all[i], i as u32))
                .collect();
            let mut want = order[..k].to_vec();
            want.sort_unstable();
            kept.sort_unstable();
            assert_eq!(kept, want, "{distinct} distinct keys, k = {k}");
        }
    }
}
