//! `rlmerge verify`: re-reads a merged folder and checks it against the checksums its record
//! recorded — every output file and every input file — and, with `--against`, recomputes the merge
//! from the record and compares the bytes.

use crate::backend::Backend;
use crate::checkpoint::output_folder::{sweep, Scratch};
use crate::checkpoint::safetensors_file::{crc32_of_file, FileChecksum};
use crate::checkpoint::{DType, ModelFolder};
use crate::engine::{self, MergeOptions, PassOptions};
use crate::inputs::{Inputs, Layout};
use crate::record::{resolved_path, MergeRecord};
use anyhow::{Context, Result};
use std::io::Read;
use std::path::{Path, PathBuf};

/// Prefix of the scratch folders `--against` recomputes into.
const VERIFY_SCRATCH: &str = ".rlmerge-verify";

/// What verification found: lines that passed, and problems (any problem fails the command).
#[derive(Default, Debug)]
pub struct Verification {
    /// Checks that passed, one line each.
    pub ok: Vec<String>,
    /// Checks that could not run (an input no longer there), one line each.
    pub skipped: Vec<String>,
    /// Checks that failed, one line each.
    pub problems: Vec<String>,
    /// Scratch that killed runs left in the folder or beside it, named with its size.
    pub notes: Vec<String>,
}

fn check_file(dir: &Path, want: &FileChecksum, what: &str, v: &mut Verification) {
    let path = dir.join(&want.file);
    let shown = crate::escape::terminal(&path.display().to_string()).into_owned();
    match crc32_of_file(&path) {
        Ok(got) if got == *want => v.ok.push(format!(
            "{what} {} ({} bytes, crc32 {})",
            shown, got.size, got.crc32
        )),
        Ok(got) => v.problems.push(format!(
            "{what} {} differs from the record: {} bytes crc32 {} (recorded {} bytes crc32 {})",
            shown, got.size, got.crc32, want.size, want.crc32
        )),
        Err(e) => v.problems.push(format!("{what} {}: {e:#}", shown)),
    }
}

/// Verifies `out_dir`; with `against`, also recomputes the merge on `backend` into a temporary
/// folder beside it and compares every shard byte for byte.
pub fn verify(out_dir: &Path, against: Option<&dyn Backend>) -> Result<Verification> {
    let record = MergeRecord::read(out_dir)?;
    let mut v = Verification::default();
    let beside = out_dir.parent().filter(|p| !p.as_os_str().is_empty());
    let near: Vec<std::path::PathBuf> = std::iter::once(out_dir)
        .chain(beside)
        .map(Path::to_path_buf)
        .collect();
    v.notes = crate::checkpoint::output_folder::stale_notes(&near);
    for f in &record.outputs {
        check_file(out_dir, f, "output", &mut v);
    }
    // Structure: every shard's header and the index parse and agree (also catches extra shards).
    match ModelFolder::open(out_dir) {
        Ok(m) => {
            let recorded: Vec<&str> = record.shards().map(|f| f.file.as_str()).collect();
            for s in &m.shards {
                let name = s
                    .path
                    .file_name()
                    .unwrap_or_default()
                    .to_string_lossy()
                    .to_string();
                if !recorded.contains(&name.as_str()) {
                    v.problems
                        .push(format!("shard {} is not in the record", s.path.display()));
                }
            }
            if m.tensors.is_empty() {
                v.problems
                    .push("structure: the model has no tensors".into());
            }
            v.ok.push(format!(
                "structure: {} shard(s), {} tensors, headers and index consistent",
                m.shards.len(),
                m.tensors.len()
            ));
        }
        Err(e) => v.problems.push(format!("structure: {e:#}")),
    }
    // A weight file the record does not list (a stray shard, a pytorch_model.bin) is loaded by
    // some tools or makes the folder ambiguous: the folder is not what was merged.
    let listed: Vec<&str> = record.outputs.iter().map(|f| f.file.as_str()).collect();
    for entry in
        std::fs::read_dir(out_dir).with_context(|| format!("cannot list {}", out_dir.display()))?
    {
        let name = entry?.file_name().to_string_lossy().into_owned();
        if is_weight_file(&name) && !listed.contains(&name.as_str()) {
            v.problems.push(format!(
                "{} holds the weight file {}, which the record does not list",
                out_dir.display(),
                crate::escape::terminal(&name)
            ));
        }
    }
    let mut inputs_intact = true;
    for input in &record.inputs {
        let path = resolved_path(out_dir, &input.path);
        if !path.is_dir() {
            inputs_intact = false;
            v.skipped.push(format!(
                "input {} not found: not checked",
                input.path.display()
            ));
            continue;
        }
        for f in &input.files {
            let before = v.problems.len();
            check_file(&path, f, "input", &mut v);
            inputs_intact &= v.problems.len() == before;
        }
    }
    if let Some(backend) = against {
        if inputs_intact {
            recompute_and_compare(&record, out_dir, backend, &mut v)?;
        } else {
            v.problems.push("--against: the inputs are missing or changed since the merge, so it cannot be recomputed".into());
        }
    }
    Ok(v)
}

/// File names that loaders take for weights (safetensors, PyTorch, TensorFlow, Flax, GGUF) or
/// their indexes.
fn is_weight_file(name: &str) -> bool {
    const EXT: [&str; 9] = [
        ".safetensors",
        ".bin",
        ".pt",
        ".pth",
        ".ckpt",
        ".h5",
        ".msgpack",
        ".gguf",
        ".index.json",
    ];
    EXT.iter().any(|e| name.ends_with(e))
}

fn recompute_and_compare(
    record: &MergeRecord,
    out_dir: &Path,
    backend: &dyn Backend,
    v: &mut Verification,
) -> Result<()> {
    let base = record
        .inputs
        .first()
        .context("the record lists no inputs")?;
    let agents: Vec<PathBuf> = record.inputs[1..]
        .iter()
        .map(|i| resolved_path(out_dir, &i.path))
        .collect();
    let tokenizer = record
        .tokenizer
        .as_ref()
        .map(|t| t.with_folders(|p| resolved_path(out_dir, p)));
    let inputs = Inputs::open_with(
        &resolved_path(out_dir, &base.path),
        &agents,
        Layout {
            slices: record.slices.as_ref(),
            tokenizer: tokenizer.as_ref(),
            with_base: record.method.uses_base(),
            allow_missing_tensors: record.allow_missing_tensors,
        },
    )?;
    let options = MergeOptions {
        pass: PassOptions {
            epsilon: record.epsilon,
            scan_nonfinite: !record.allow_nonfinite,
            ..PassOptions::default_for(backend)
        },
        out_dtype: record
            .out_dtype
            .as_deref()
            .map(|d| {
                DType::parse_user(d).with_context(|| format!("record: unknown out_dtype '{d}'"))
            })
            .transpose()?,
        shard_size: record.shard_size,
        force: true,
        svc: record.svc,
        config_from: match record.config_from.as_deref() {
            None => None,
            Some("base") => Some(engine::ConfigFrom::Base),
            Some(named) => Some(engine::ConfigFrom::Agent(
                record
                    .agents
                    .iter()
                    .position(|a| a.path == named)
                    .context("the record's config_from names none of its agents")?,
            )),
        },
        ..MergeOptions::new(record.method.clone(), backend)
    };
    // Recomputed beside the output (the same disk, which held the output once), or where that
    // folder is read-only, in the system's temporary folder. A killed verify's folder is removed
    // by the next one (its lock is free).
    let beside = out_dir
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    let mut scratch = None;
    for place in [beside.to_path_buf(), std::env::temp_dir()] {
        let _ = sweep(&place, VERIFY_SCRATCH, |_| Ok(()));
        if let Ok(s) = Scratch::create(&place, VERIFY_SCRATCH) {
            scratch = Some(s);
            break;
        }
    }
    let scratch = scratch.with_context(|| {
        format!(
            "--against: cannot create a folder to recompute in, beside {} or in {}",
            out_dir.display(),
            std::env::temp_dir().display()
        )
    })?;
    let again = scratch.path().join("recomputed");
    let result = engine::merge(&inputs, &options, backend, &again).and_then(|_| {
        for shard in record.shards() {
            match first_difference(&out_dir.join(&shard.file), &again.join(&shard.file))? {
                None => v.ok.push(format!("recomputed {} is identical", shard.file)),
                Some(at) => v.problems.push(format!(
                    "recomputed {} differs from the output at byte {at}",
                    shard.file
                )),
            }
        }
        Ok(())
    });
    drop(scratch);
    result
}

/// The first byte offset where two files differ (a length difference counts), or `None`.
fn first_difference(a: &Path, b: &Path) -> Result<Option<u64>> {
    let open =
        |p: &Path| std::fs::File::open(p).with_context(|| format!("cannot open {}", p.display()));
    let (mut fa, mut fb) = (open(a)?, open(b)?);
    let (mut ba, mut bb) = (vec![0u8; 8 << 20], vec![0u8; 8 << 20]);
    let mut at = 0u64;
    loop {
        let na = read_full(&mut fa, &mut ba)?;
        let nb = read_full(&mut fb, &mut bb)?;
        if let Some(i) = ba[..na.min(nb)]
            .iter()
            .zip(&bb[..na.min(nb)])
            .position(|(x, y)| x != y)
        {
            return Ok(Some(at + i as u64));
        }
        if na != nb {
            return Ok(Some(at + na.min(nb) as u64));
        }
        if na == 0 {
            return Ok(None);
        }
        at += na as u64;
    }
}

fn read_full(f: &mut std::fs::File, buf: &mut [u8]) -> Result<usize> {
    let mut n = 0;
    while n < buf.len() {
        match f.read(&mut buf[n..])? {
            0 => break,
            k => n += k,
        }
    }
    Ok(n)
}
