//! How many elements one tile of a tensor holds — engine policy, kept apart from the inputs it
//! reads (`crate::inputs`): a pass states the elements a tile holds of each input when every
//! input is stored like the base, and each tensor's tiles are sized so the pass's bytes stay
//! what that promises.

use crate::inputs::{Inputs, TensorPlan};

/// Elements per tile of `plan`'s tensor in a pass whose tiles hold `elems` elements of each
/// input: as many as keep the pass's tile bytes what they are when every input is stored like the
/// base. Tiles read in f32 from a 16-bit base (mixed dtypes, LoRA agents, re-indexed rows;
/// [`TensorPlan::tile_dtype`]) hold half as many elements. A LoRA merge holds one tensor's A/B
/// pairs beside the tiles, shared by the workers on it (the tile loop starts a LoRA tensor only
/// once the one before is done, `par_tiles`): its memory is the full checkpoints' plus one
/// tensor's pairs as stored. (Tiles cut to leave room for a worker's share of the pairs, as they
/// were until 2026-12-05, made 7B-shaped LoRA merges 11–17 % slower — two-row tiles decode A's
/// terms for two rows — for no peak-RSS difference that measured.)
pub fn tile_elems(plan: &TensorPlan, inputs: &Inputs, elems: usize) -> usize {
    let readers = 1 + plan.present().len();
    let budget = readers * elems.max(1) * plan.base.entry.dtype.size();
    let per_elem = readers * plan.tile_dtype(inputs).size();
    (budget / per_elem).max(1)
}
