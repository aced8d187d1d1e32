//! How many elements one tile of a tensor holds — engine policy, kept apart from the inputs it
//! reads (`crate::inputs`): a pass states the elements a tile holds of each input when every
//! input is stored like the base, and each tensor's tiles are sized so the pass's bytes stay
//! what that promises.

use crate::inputs::{Inputs, TensorPlan};

/// The run tiles are cut to when [`tile_elems`] shrinks them: a statistics scan's chunk, so
/// chunks still start at its multiples ([`crate::scans::Scans::any_order`]).
pub const TILE_QUANTUM: usize = crate::scans::SCAN_CHUNK;

/// Elements per tile of `plan`'s tensor in a pass of `workers` workers whose tiles hold `elems`
/// elements of each input: as many as keep the pass's bytes what they are when every input is
/// stored like the base. Tiles read in f32 from a 16-bit base (mixed dtypes, LoRA agents,
/// re-indexed rows; [`TensorPlan::tile_dtype`]) hold half as many elements. A LoRA merge holds
/// the A/B pairs of one tensor at a time, shared by the workers on it (the tile loop starts a
/// LoRA tensor only once the one before is done, `par_tiles`), so every tile of the merge leaves
/// room for a worker's share of the largest ([`Inputs::lora_room`] / `workers`): tile buffers,
/// which workers keep from tensor to tensor, plus the pairs then never exceed the full
/// checkpoints' tiles, while that share leaves a run. Cut for pairs to whole runs of
/// [`TILE_QUANTUM`] elements, never below one run (nor below the widened size, when that is
/// smaller).
pub fn tile_elems(plan: &TensorPlan, inputs: &Inputs, elems: usize, workers: usize) -> usize {
    let readers = 1 + plan.present().len();
    let budget = readers * elems.max(1) * plan.base.entry.dtype.size();
    let per_elem = readers * plan.tile_dtype(inputs).size();
    let widened = (budget / per_elem).max(1);
    let reserve = inputs.lora_room.div_ceil(workers.max(1));
    let q = TILE_QUANTUM;
    if reserve == 0 || widened <= q {
        return widened;
    }
    let fit = budget.saturating_sub(reserve) / per_elem;
    (fit - fit % q).max(q)
}
