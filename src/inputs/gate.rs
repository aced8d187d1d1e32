//! The finiteness gate every input read passes (SPEC §5): the first NaN or ±Inf of what is read
//! is refused, naming the tensor, the file and the element — stored bytes, a LoRA agent's
//! values with its update added, a DoRA agent's rescaled rows. A leaf of the inputs' wing:
//! `source.rs` and `dora.rs` both call it.

use super::TensorPlan;
use crate::checkpoint::dtype::{decode_one, first_nonfinite};
use crate::checkpoint::{ModelFolder, ModelTensor};
use anyhow::Result;

/// Fails on the first NaN or ±Inf of `raw` (elements of `tensor` from `start`), naming the
/// tensor as its file stores it, the file and the element — and the merged tensor it is read
/// for where that is another (a slice taking other layers than the output's).
pub(super) fn refuse_nonfinite(
    plan: &TensorPlan,
    model: &ModelFolder,
    tensor: &ModelTensor,
    raw: &[u8],
    start: usize,
) -> Result<()> {
    let dtype = tensor.entry.dtype;
    if let Some(i) = first_nonfinite(dtype, raw) {
        let stored = &*tensor.entry.name;
        let read_for = if plan.name() == stored {
            String::new()
        } else {
            format!(" (read for the merged tensor '{}')", plan.name())
        };
        return Err(crate::error::data(crate::message![
            format!(
                "tensor '{stored}' in {}{read_for} has a non-finite value ({}) at element {}; \
                 rlmerge refuses NaN and infinity unless ",
                model.file_holding(tensor, (start + i) as u64).display(),
                decode_one(dtype, raw, i),
                start + i
            ),
            crate::error::Arg::switch("allow-nonfinite"),
        ]));
    }
    Ok(())
}

/// The finiteness gate's second half for a LoRA agent: its stored base values passed
/// [`refuse_nonfinite`]; its values with the update added (`values`, f32 bytes of elements from
/// `start`) must be finite too — a NaN or ±Inf in A or B, or an update that overflows, is named.
pub(super) fn refuse_nonfinite_update(
    tensor: &ModelTensor,
    lora: &crate::checkpoint::lora::LoraAdapter,
    values: &[u8],
    start: usize,
) -> Result<()> {
    let f32 = crate::checkpoint::DType::F32;
    match first_nonfinite(f32, values) {
        Some(i) => Err(lora.nonfinite_error(
            &tensor.entry.name,
            (start + i) as u64,
            decode_one(f32, values, i),
        )),
        None => Ok(()),
    }
}
