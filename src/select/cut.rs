//! A rank cut: the threshold, on magnitude keys and tensor index, between the elements inside
//! "the k largest |v|" and the rest. What every rank-cut pass resolves and every keep rule tests.

use serde::{Deserialize, Serialize};

/// The magnitude key of a value: its |v| bits, ordered like |v| for every non-NaN value.
#[inline]
pub fn magnitude_key(v: f32) -> u32 {
    v.to_bits() & 0x7fff_ffff
}

/// The rank cut "among the `k` largest |v|": an element with magnitude key `key` at tensor index
/// `idx` is inside when `key > value`, or when `key == value` and `idx < index` — ties at the
/// threshold go to the lower index first (SPEC §4's top-k rule, a stable descending sort) — or, with
/// `high_first`, `idx >= index`: the higher index first (a stable ascending sort, as breadcrumbs
/// ranks).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RankCut {
    /// The magnitude key at the cut.
    pub value: u32,
    /// The index at the cut among elements of that key.
    pub index: u32,
    /// Ties at the cut: the higher index first.
    pub high_first: bool,
}

impl RankCut {
    /// The cut with no element inside (k = 0).
    pub const EMPTY: RankCut = RankCut {
        value: u32::MAX,
        index: 0,
        high_first: false,
    };

    /// The cut with every element inside (k = n).
    pub const FULL: RankCut = RankCut {
        value: 0,
        index: u32::MAX,
        high_first: false,
    };

    /// Whether the element of magnitude key `key` and index `idx` is inside the cut.
    #[inline(always)]
    pub fn inside(&self, key: u32, idx: u32) -> bool {
        // Bitwise, not short-circuit: no branches, so mask loops vectorize.
        (key > self.value) | ((key == self.value) & ((idx < self.index) != self.high_first))
    }
}
