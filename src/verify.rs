//! `rlmerge verify`: re-reads a merged folder and checks it against the checksums its record
//! recorded — every output file and every input file — and, with `--against`, recomputes the merge
//! from the record and compares the bytes.

use crate::backend::Backend;
use crate::checkpoint::output_folder::{sweep, Scratch, MERGEKIT_CONFIG_FILE};
use crate::checkpoint::weight_file::{crc32_of_file, FileChecksum};
use crate::checkpoint::ModelFolder;
use crate::engine;
use crate::job::Job;
use crate::record::{resolved_path, InputChecksums, MergeRecord};
use anyhow::{Context, Result};
use std::io::Read;
use std::path::Path;

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
        Ok(got) if (got.size, &got.crc32) == (want.size, &want.crc32) => v.ok.push(format!(
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

/// Verifies the folder `dir` (`rlmerge verify`, Python's `verify`) against its record; with
/// `against`, recomputes it — a merge on the backend its record's method asks for (said), a MoE
/// from its saved config — and compares the bytes. An extracted adapter's `--against` is refused.
pub fn verify_folder(
    dir: &Path,
    against: bool,
    compute: &crate::service::Compute,
    say: &mut dyn FnMut(crate::service::Said),
) -> Result<Verification> {
    if let Some(v) = verify_tool_output(dir, against, compute.threads)? {
        return Ok(v);
    }
    let backend = match against {
        true => Some(crate::service::backend_for_record(
            &MergeRecord::read(dir)?,
            compute,
            say,
        )?),
        false => None,
    };
    verify(dir, backend.as_deref())
}

/// Verifies `out_dir`; with `against`, also recomputes the merge on `backend` into a temporary
/// folder beside it and compares every shard byte for byte.
pub fn verify(out_dir: &Path, against: Option<&dyn Backend>) -> Result<Verification> {
    if let Some(v) = verify_tool_output(out_dir, against.is_some(), 0)? {
        return Ok(v);
    }
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
    let (inputs_intact, stages) = check_inputs(&record.inputs, out_dir, &mut v);
    if let Some(backend) = against {
        if inputs_intact && !stages {
            recompute_and_compare(&record, out_dir, backend, &mut v)?;
        } else if !record.stages.is_empty() {
            v.problems.push(format!(
                "--against: inputs of this merge are stages of its multi-stage recipe that were \
                 scratch, so it cannot be recomputed here; `rlmerge run {}/{MERGEKIT_CONFIG_FILE} \
                 OUT` makes every stage again (--intermediate-dir DIR keeps them)",
                out_dir.display()
            ));
        } else {
            v.problems.push("--against: the inputs are missing or changed since the merge, so it cannot be recomputed".into());
        }
    }
    Ok(v)
}

/// Checks every input file a record lists (a merge's or a tool's) against its checksum, where the
/// input is there (a missing one, or a multi-stage recipe's scratch stage, is skipped and said);
/// whether every input other than a stage is there and intact, and whether one was a stage.
fn check_inputs(inputs: &[InputChecksums], out_dir: &Path, v: &mut Verification) -> (bool, bool) {
    let (mut inputs_intact, mut stages) = (true, false);
    for input in inputs {
        let path = resolved_path(out_dir, &input.path);
        let stage = input
            .path
            .to_str()
            .and_then(|p| p.strip_prefix(crate::record::STAGE_PREFIX));
        if !path.is_dir() {
            stages |= stage.is_some();
            inputs_intact &= stage.is_some();
            let why = match stage {
                Some(name) => format!(
                    "is stage '{}' of a multi-stage recipe, made in scratch and removed",
                    crate::escape::terminal(name)
                ),
                None => "not found".into(),
            };
            let shown = input.path.display().to_string();
            let line = format!(
                "input {} {why}: not checked",
                crate::escape::terminal(&shown)
            );
            if !v.skipped.contains(&line) {
                v.skipped.push(line);
            }
            continue;
        }
        for f in &input.files {
            let before = v.problems.len();
            check_file(&path, f, "input", v);
            inputs_intact &= v.problems.len() == before;
        }
    }
    (inputs_intact, stages)
}

/// Verifies a folder `rlmerge extract-lora` or `rlmerge moe` wrote (its record's `kind`): every
/// output and input file against its checksum; `None` where `dir` holds a merge's record. With
/// `against`, a MoE is built again from the config saved beside it (on `threads` workers) and
/// compared byte for byte; an extracted adapter is refused (run the extraction again).
fn verify_tool_output(dir: &Path, against: bool, threads: usize) -> Result<Option<Verification>> {
    /// A tool's record, as far as verify reads it (a MoE's: how `--against` builds it again).
    #[derive(serde::Deserialize)]
    struct ToolRecord {
        #[serde(default)]
        inputs: Vec<InputChecksums>,
        #[serde(default)]
        outputs: Vec<FileChecksum>,
        #[serde(default)]
        shard_bytes: Option<u64>,
        #[serde(default)]
        allow_nonfinite: bool,
    }
    let Some(kind) = crate::record::tool::tool_kind(dir) else {
        return Ok(None);
    };
    if against && kind != "moe" {
        return Err(crate::record::tool::against_refused());
    }
    let path = dir.join(crate::checkpoint::output_folder::RECORD_FILE);
    let record: ToolRecord = serde_json::from_str(&std::fs::read_to_string(&path)?)
        .with_context(|| format!("{}: invalid record", path.display()))?;
    crate::record::check_file_names(&record.outputs, &record.inputs)
        .with_context(|| format!("{}: invalid record", path.display()))?;
    let mut v = Verification::default();
    for f in &record.outputs {
        check_file(dir, f, "output", &mut v);
    }
    // Stages are made again from the saved config: only the models given as folders must be here.
    let (inputs_intact, _) = check_inputs(&record.inputs, dir, &mut v);
    if against && !inputs_intact {
        v.problems.push(
            "--against: the inputs are missing or changed since the MoE was built, so it cannot \
             be built again"
                .into(),
        );
    }
    if against && v.problems.is_empty() {
        let shard_bytes = record
            .shard_bytes
            .with_context(|| format!("{}: a MoE record without its shard size", path.display()))?;
        let options = crate::moe::Options {
            shard_bytes,
            allow_nonfinite: record.allow_nonfinite,
            show_progress: false,
        };
        rebuild_and_compare(dir, &record.outputs, (options, threads), &mut v)?;
    }
    Ok(Some(v))
}

/// `verify --against` of a MoE: its saved config built again (the record's shard size and
/// non-finite rule) into scratch beside the folder, every output file compared byte for byte.
fn rebuild_and_compare(
    dir: &Path,
    outputs: &[FileChecksum],
    (options, threads): (crate::moe::Options, usize),
    v: &mut Verification,
) -> Result<()> {
    let config = dir.join(crate::moe::CONFIG_FILE);
    let scratch = verify_scratch(dir)?;
    let again = scratch.path().join("moe");
    // The saved config, with the merge stages it holds, as `rlmerge moe` of it runs.
    crate::service::moe_recipe(
        &config,
        (None, true, None),
        (&again, false, None),
        (options, threads),
        &mut |_| {},
    )?;
    for f in outputs {
        check_file(&again, f, "rebuilt", v);
    }
    Ok(())
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
    // The merge the record describes, through the service any merge goes through.
    let job = Job::from_record(record, out_dir)?;
    let inputs = crate::service::open_inputs(&job)?;
    let compute = crate::service::Compute::on(crate::service::Device::Auto);
    let scratch = verify_scratch(out_dir)?;
    let again = scratch.path().join("recomputed");
    let options = crate::service::merge_options(
        &job,
        (backend, &compute),
        (&again, true, false),
        Vec::new(),
    )?;
    let result = engine::merge(&inputs, &options, backend, &again)
        .and_then(|summary| compare_outputs(record, &summary.record, out_dir, &again, backend, v));
    drop(scratch);
    result
}

/// The relative difference (Frobenius, per tensor) within which a spectral merge recomputed on
/// another backend agrees with the output: their GEMMs sum in another order (docs/gpu.md). A
/// 16-bit output rounds those f32 values once more, so its elements may differ by one step.
pub const CROSS_BACKEND_TOLERANCE: f64 = 1e-6;

/// Compares the recomputed folder `again` (its record `redone`) with the output: the same model
/// files (a record whose shard size or dtype was changed names files the recomputation does not
/// write), each byte for byte — weights, index, config and tokenizer files — or,
/// for a spectral merge made on another backend than `backend`, each tensor within
/// [`CROSS_BACKEND_TOLERANCE`], said so.
fn compare_outputs(
    record: &MergeRecord,
    redone: &MergeRecord,
    out_dir: &Path,
    again: &Path,
    backend: &dyn Backend,
    v: &mut Verification,
) -> Result<()> {
    // The model's files; the saved recipe names its models relative to its own folder, the
    // figure its agents as they were given.
    let files = |r: &MergeRecord| -> Vec<String> {
        r.outputs
            .iter()
            .map(|f| f.file.clone())
            .filter(|f| {
                f != crate::checkpoint::output_folder::MERGEKIT_CONFIG_FILE
                    && f != crate::record::OVERLAP_FIGURE
            })
            .collect()
    };
    let (recorded, recomputed) = (files(record), files(redone));
    if recorded != recomputed {
        v.problems.push(format!(
            "the recomputed merge writes {} where the record lists {} (the record's shard_size is \
             {}, its out_dtype {}): the record does not describe this output",
            recomputed.join(", "),
            recorded.join(", "),
            record.shard_size,
            record.out_dtype.as_deref().unwrap_or("the base's")
        ));
        return Ok(());
    }
    let made_on = record.backend.as_deref();
    let decomposed = record.merging.decomposes();
    let tolerant = decomposed && made_on != Some(backend.kind());
    for file in &recorded {
        let (a, b) = (out_dir.join(file), again.join(file));
        match first_difference(&a, &b)? {
            None => v.ok.push(format!("recomputed {file} is identical")),
            Some(_) if tolerant && file.ends_with(".safetensors") => {
                match worst_tensor(out_dir, again, file)? {
                    Some((name, apart)) if !apart.within_tolerance() => v.problems.push(format!(
                        "recomputed {file} differs from the output beyond the backends' \
                             rounding: tensor '{name}' by {:.1e} (relative), up to {} steps of \
                             its dtype (their GEMMs' rounding stays within \
                             {CROSS_BACKEND_TOLERANCE:e}, or one step of a 16-bit dtype)",
                        apart.relative, apart.steps
                    )),
                    _ => v.ok.push(format!(
                        "recomputed {file} agrees within {CROSS_BACKEND_TOLERANCE:e} (relative, \
                         per tensor; a 16-bit output within one step), not byte for byte: the \
                         merge was made on {}, recomputed on {}, whose GEMMs sum in another \
                         order (docs/gpu.md)",
                        made_on.unwrap_or("a backend the record does not name"),
                        backend.kind()
                    )),
                }
            }
            Some(at) => v.problems.push(format!(
                "recomputed {file} differs from the output at byte {at}{}",
                match (decomposed, made_on) {
                    (true, Some(kind)) => format!(" (made on {kind}, recomputed on {kind})"),
                    _ => String::new(),
                }
            )),
        }
    }
    Ok(())
}

/// How far one tensor of two outputs is from the other: ‖a − b‖ / ‖a‖ (Frobenius), and the most
/// steps of its stored dtype between two of its elements (16-bit dtypes).
#[derive(Clone, Copy, Debug, Default)]
struct Apart {
    relative: f64,
    steps: u32,
}

impl Apart {
    /// Within what two backends' GEMMs give (docs/gpu.md): the f32 values within
    /// [`CROSS_BACKEND_TOLERANCE`], so a 16-bit output's elements within one step of it.
    fn within_tolerance(&self) -> bool {
        self.relative <= CROSS_BACKEND_TOLERANCE || self.steps <= 1
    }
}

/// The tensor of shard `file` of the merged folders `a` and `b` (the same names, shapes and
/// dtypes) farthest apart ([`Apart`]), or one the other lacks or holds in another shape or dtype
/// (infinitely apart).
fn worst_tensor(a: &Path, b: &Path, file: &str) -> Result<Option<(String, Apart)>> {
    let (fa, fb) = (ModelFolder::open(a)?, ModelFolder::open(b)?);
    let in_file = |m: &ModelFolder, t: &crate::checkpoint::model::ModelTensor| {
        m.shards[t.shard].path.file_name() == Some(std::ffi::OsStr::new(file))
    };
    let far = Apart {
        relative: f64::INFINITY,
        steps: u32::MAX,
    };
    let mut worst: Option<(String, Apart)> = None;
    for ta in fa.tensors.iter().filter(|t| in_file(&fa, t)) {
        let (ea, name) = (&ta.entry, ta.entry.name.to_string());
        let Some(tb) = fb.get(&name).filter(|tb| {
            (tb.entry.dtype, &tb.entry.shape) == (ea.dtype, &ea.shape) && in_file(&fb, tb)
        }) else {
            return Ok(Some((name, far)));
        };
        let (size, step) = (ea.dtype.size(), 1usize << 20);
        let (mut ba, mut bb) = (vec![0u8; step * size], vec![0u8; step * size]);
        let (mut xa, mut xb) = (vec![0f32; step], vec![0f32; step]);
        let (mut diff, mut norm, mut steps) = (0.0f64, 0.0f64, 0u32);
        for start in (0..ea.numel).step_by(step) {
            let n = step.min(ea.numel - start);
            let at = (start * size) as u64;
            fa.read(ta, at, &mut ba[..n * size])?;
            fb.read(tb, at, &mut bb[..n * size])?;
            crate::checkpoint::dtype::decode(ea.dtype, &ba[..n * size], &mut xa[..n]);
            crate::checkpoint::dtype::decode(ea.dtype, &bb[..n * size], &mut xb[..n]);
            for (p, q) in xa[..n].iter().zip(&xb[..n]) {
                diff += f64::from(p - q).powi(2);
                norm += f64::from(*p).powi(2);
            }
            if size == 2 {
                let ordered = |c: &[u8]| {
                    let bits = i32::from(u16::from_le_bytes([c[0], c[1]]));
                    if bits & 0x8000 != 0 {
                        -(bits & 0x7fff)
                    } else {
                        bits
                    }
                };
                let pairs = ba[..n * 2].chunks_exact(2).zip(bb[..n * 2].chunks_exact(2));
                for (p, q) in pairs {
                    steps = steps.max(ordered(p).abs_diff(ordered(q)));
                }
            } else {
                steps = u32::MAX;
            }
        }
        let relative = if diff == 0.0 {
            0.0
        } else if norm == 0.0 {
            f64::INFINITY
        } else {
            (diff / norm).sqrt()
        };
        let apart = Apart {
            relative,
            steps: if diff == 0.0 { 0 } else { steps },
        };
        let farther = |w: &Apart| (apart.relative, apart.steps) > (w.relative, w.steps);
        if worst.as_ref().is_none_or(|(_, w)| farther(w)) {
            worst = Some((name, apart));
        }
    }
    Ok(worst)
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

/// A scratch folder to recompute in: beside the output (the same disk, which held the output
/// once), or where that folder is read-only, in the system's temporary folder. A killed verify's
/// folder is removed by the next one (its lock is free).
fn verify_scratch(out_dir: &Path) -> Result<Scratch> {
    let beside = out_dir
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    for place in [beside.to_path_buf(), std::env::temp_dir()] {
        let _ = sweep(&place, VERIFY_SCRATCH, |_| Ok(()));
        if let Ok(s) = Scratch::create(&place, VERIFY_SCRATCH) {
            return Ok(s);
        }
    }
    anyhow::bail!(
        "--against: cannot create a folder to recompute in, beside {} or in {}",
        out_dir.display(),
        std::env::temp_dir().display()
    )
}
