//! How a tensor's elements map to coefficient rows, the runs of elements within a row, and the
//! fixed-order dot product the statistics sum chunks with.

use super::last_dim;
use crate::method::combine::coef_row;
use crate::method::tensor_params::{BaseTerm, TensorParams, Vectors};

/// How a tensor's elements map to coefficient rows ([`coef_row`]).
#[derive(Clone, Copy, Debug, PartialEq)]
pub(super) struct CoefRows {
    /// Elements per row (0: one row for the whole tensor).
    pub(super) len: u64,
    /// Rows repeat every `period` (0: never).
    pub(super) period: u64,
    /// Number of rows.
    pub(super) count: usize,
}

impl CoefRows {
    pub(super) fn of(&self, idx: u64) -> usize {
        coef_row(idx, self.len, self.period) as usize
    }

    /// The runs of `len` elements from element `start` that lie in one row each: (first
    /// element, elements).
    pub(super) fn runs(&self, start: u64, len: usize) -> impl Iterator<Item = (u64, usize)> + '_ {
        let end = start + len as u64;
        let mut at = start;
        std::iter::from_fn(move || {
            if at >= end {
                return None;
            }
            let next = match self.len {
                0 => end,
                l => ((at / l + 1) * l).min(end),
            };
            let run = (at, (next - at) as usize);
            at = next;
            Some(run)
        })
    }

    /// The runs of elements in `within` whose rows lie in `part` (rows of `len` > 0 elements),
    /// in element order: (first element, elements).
    pub(super) fn runs_in(
        &self,
        part: std::ops::Range<usize>,
        within: std::ops::Range<u64>,
    ) -> impl Iterator<Item = (u64, usize)> {
        let len = self.len.max(1);
        // Rows repeat every `period` rows, else never: one block of every row.
        let rows = match self.period {
            0 => self.count as u64,
            p => p,
        };
        let block = len * rows;
        let (lo, hi) = (part.start as u64 * len, part.end as u64 * len);
        (within.start / block..within.end.div_ceil(block)).filter_map(move |b| {
            let start = (b * block + lo).max(within.start);
            let end = (b * block + hi).min(within.end);
            (start < end).then(|| (start, (end - start) as usize))
        })
    }
}

/// Σ aᵢbᵢ in f64, in a fixed order that vectorizes: element i adds into lane i mod 8, then the
/// lanes are summed in lane order.
pub(super) fn dot(a: &[f32], b: &[f32]) -> f64 {
    let mut lanes = [0.0f64; 8];
    let (xs, ys) = (a.chunks_exact(8), b.chunks_exact(8));
    let rest = xs.remainder().iter().zip(ys.remainder());
    for (x, y) in xs.zip(ys) {
        for j in 0..8 {
            lanes[j] += x[j] as f64 * y[j] as f64;
        }
    }
    for (j, (&x, &y)) in rest.enumerate() {
        lanes[j] += x as f64 * y as f64;
    }
    lanes.iter().sum()
}

/// The coefficient rows of a tensor: one per element for Fisher, one per vector of
/// [`BaseTerm::vectors`] for model_stock and nuslerp, else one for the whole tensor (slerp
/// included: mergekit 0.1.5 interpolates each whole tensor).
pub(super) fn coef_rows(params: &TensorParams, numel: u64, shape: &[usize]) -> CoefRows {
    let first = shape.first().copied().unwrap_or(1).max(1) as u64;
    let (len, period) = match (&params.base, params.base.vectors()) {
        (BaseTerm::Fisher, _) => (1, 0),
        (_, Vectors::Rows) => (last_dim(numel, shape), 0),
        (_, Vectors::Columns) => (1, (numel / first).max(1)),
        (_, Vectors::Whole) => (0, 0),
    };
    let count = match (len, period) {
        (0, _) => 1,
        (_, 0) => numel.div_ceil(len).max(1) as usize,
        (_, p) => p as usize,
    };
    CoefRows { len, period, count }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_chunk_splits_at_row_ends_and_its_dot_products_are_the_sums() {
        let rows = CoefRows {
            len: 5,
            period: 0,
            count: 4,
        };
        assert_eq!(
            rows.runs(3, 12).collect::<Vec<_>>(),
            [(3, 2), (5, 5), (10, 5)]
        );
        let whole = CoefRows {
            len: 0,
            period: 0,
            count: 1,
        };
        assert_eq!(whole.runs(7, 4).collect::<Vec<_>>(), [(7, 4)]);
        assert_eq!(whole.runs(7, 0).count(), 0);
        // A share of the rows: every element whose row is in it, in order — rows of 5 (4 of
        // them), and columns (rows of 1 repeating every 3).
        let collect = |rows: CoefRows, part, within| {
            let runs = rows.runs_in(part, within);
            runs.flat_map(|(at, len)| at..at + len as u64)
                .collect::<Vec<u64>>()
        };
        assert_eq!(collect(rows, 1..3, 7..18), (7..15).collect::<Vec<u64>>());
        let columns = CoefRows {
            len: 1,
            period: 3,
            count: 3,
        };
        for (part, within) in [(0..1, 0..12u64), (1..3, 2..11), (2..3, 0..1)] {
            let want: Vec<u64> = within
                .clone()
                .filter(|&i| part.contains(&columns.of(i)))
                .collect();
            assert_eq!(
                collect(columns, part.clone(), within.clone()),
                want,
                "{part:?} {within:?}"
            );
        }
        // Small integers: every order of adding gives the exact sum.
        let a: Vec<f32> = (0..21).map(|i| i as f32).collect();
        let b: Vec<f32> = (0..21).map(|i| 2.0 * i as f32 - 3.0).collect();
        let want: f64 = a.iter().zip(&b).map(|(&a, &b)| a as f64 * b as f64).sum();
        assert_eq!(dot(&a, &b), want);
        assert_eq!(dot(&a[..5], &b[..5]), 2.0 * 30.0 - 3.0 * 10.0);
    }
}
