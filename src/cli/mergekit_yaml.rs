//! mergekit-yaml's options on `rlmerge run`, for a user whose command lines were written for
//! mergekit: each is done the same way (`--random-seed`, `--out-shard-size`) or answered on
//! stderr with what rlmerge does instead — never "unexpected argument".

use super::{MergekitYamlArgs, OutputArgs};
use crate::error::usage;
use anyhow::Result;

/// Sets on `output` what mergekit's options ask that rlmerge does the same way, and returns the
/// seed (`--random-seed`, or rlmerge's `--seed`; both, differing, is a usage error).
pub(crate) fn apply(
    m: &MergekitYamlArgs,
    output: &mut OutputArgs,
    seed: Option<u64>,
) -> Result<Option<u64>> {
    if let Some(params) = m.out_shard_size {
        if output.shard_size.is_some() {
            return Err(usage(
                "--out-shard-size (mergekit's) and --shard-size both set the shard size: give one",
            ));
        }
        let bytes = output.out_dtype.map_or(2, |d| d.size()) as u64;
        output.shard_size = Some(params.saturating_mul(bytes));
    }
    match (seed, m.random_seed) {
        (Some(a), Some(b)) if a != b => Err(usage(format!(
            "--seed {a} and --random-seed {b} (mergekit's) disagree: give one"
        ))),
        (a, b) => Ok(a.or(b)),
    }
}

/// What rlmerge says of each mergekit option given: what it does instead, or that it does it.
pub(crate) fn notes(m: &MergekitYamlArgs) -> Vec<String> {
    let said = [
        (m.cuda, "--cuda: rlmerge chooses the device (--device auto: the CPU for element-wise methods, where it is the faster; --device gpu uses a GPU)"),
        (m.no_cuda, "--no-cuda: rlmerge chooses the device (--device cpu keeps it on the CPU)"),
        (m.allow_crimes, "--allow-crimes: rlmerge merges models of one architecture and refuses others by name; there is no override"),
        (m.copy_tokenizer, "--copy-tokenizer: rlmerge always writes the base's tokenizer (or tokenizer_source's)"),
        (m.no_copy_tokenizer, "--no-copy-tokenizer: rlmerge always writes a tokenizer with the model (the base's, or tokenizer_source's); delete its files if unwanted"),
        (m.lazy_unpickle, "--lazy-unpickle: rlmerge always reads weights in place, tile by tile, and reads pickles as data"),
        (m.low_cpu_memory, "--low-cpu-memory: rlmerge's memory is bounded whatever the model (a few tiles per thread)"),
        (m.clone_tensors, "--clone-tensors: not needed; a layer used twice is written twice"),
        (m.trust_remote_code, "--trust-remote-code: rlmerge runs no model code; it reads config.json as data"),
        (m.write_model_card, "--write-model-card: rlmerge always writes the model card (README.md)"),
        (m.no_write_model_card, "--no-write-model-card: rlmerge always writes the model card (README.md) with the record it describes; delete it if unwanted"),
        (m.safe_serialization, "--safe-serialization: rlmerge always writes safetensors"),
        (m.no_safe_serialization, "--no-safe-serialization: rlmerge writes safetensors only, never pickles"),
        (m.transformers_cache.is_some(), "--transformers-cache: rlmerge takes Hub models from the Hugging Face cache; set HF_HUB_CACHE (or HF_HOME) to move it"),
        (m.lora_merge_cache.is_some(), "--lora-merge-cache: rlmerge applies LoRA adapters as it reads them; it writes no merged copy"),
        (m.verbose > 0, "-v: rlmerge shows progress unless -q; warnings and notes always"),
    ];
    let mut notes: Vec<String> = said
        .into_iter()
        .filter(|(given, _)| *given)
        .map(|(_, text)| text.to_string())
        .collect();
    if let Some(params) = m.out_shard_size {
        notes.push(format!(
            "--out-shard-size {params}: mergekit counts parameters per shard, rlmerge bytes \
             (--shard-size): taken as {params} parameters of the output's dtype"
        ));
    }
    if let Some(seed) = m.random_seed {
        notes.push(format!("--random-seed {seed}: rlmerge's --seed {seed}"));
    }
    notes
}
