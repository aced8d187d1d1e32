//! LoRA extraction (`rlmerge extract-lora`, issue #54 item 1; mergekit's `mergekit-extract-lora`):
//! a fine-tuned model as a PEFT adapter of rank r against its base. Each changed matrix's update
//! Δ = θ − θ₀ is factored by its top r singular triplets (`linalg::top_k`: the Lanczos process, or
//! one eigendecomposition of Δ's Gram matrix on its short side — never a full SVD),
//! Δ_r = B·A with A = √s·Vᵀ and B = U·√s (`--no-distribute-scale`: A = Vᵀ, B = U·s), which PEFT
//! applies with scaling lora_alpha / r = 1. A changed embedding is saved whole
//! (`modules_to_save`), or factored as `lora_embedding_A/B` with `--embed-lora`; a changed vector
//! (a norm, a bias) is saved whole, or left out with `--skip-undecomposable`. One matrix is held
//! at a time (its Δ in f32 and the factors' work), the factors until the adapter is written; a
//! tensor saved whole is read again chunk by chunk as the file is written (`adapter.rs`). An
//! update factored from its Gram matrix ([`gram_is_cheaper`]: a large rank, a long thin matrix),
//! or larger than `--max-held-mib` in f32 (a 152k-token vocabulary's head: 2.2 GB), is not held
//! at all: its short-side rows are read from the files twice ([`top_k_by_gram`]) — the same
//! factors the held update's Gram matrix gives.
//!
//! What rank r keeps of each update is measured and said: ‖Δ_r‖/‖Δ‖ = √(Σ_{k≤r} s_k²) / ‖Δ‖_F, the
//! share of its energy, by the Eckart–Young theorem the most any rank-r adapter keeps. An RL
//! agent's update is sparse and spread over every direction: a small r keeps little of it.

mod adapter;

use crate::checkpoint::dtype::decode;
use crate::checkpoint::files::{ADAPTER_CONFIG, ADAPTER_WEIGHTS};
use crate::checkpoint::{DType, ModelFolder, ModelTensor, OutputFolder};
use crate::error::usage;
use crate::linalg::top_k::{gram_is_cheaper, top_k, top_k_by_gram, TopK};
use crate::linalg::truncated_svd::MAX_STEPS;
use adapter::{adapter_tensors, write_adapter, Written};
use anyhow::{Context, Result};
use std::path::{Path, PathBuf};

/// What to extract, as the command line and Python give it (and the record keeps it: the folders
/// as paths from the adapter, beside).
#[derive(Clone, Debug, serde::Serialize)]
pub struct Request {
    /// The base model's folder.
    #[serde(skip)]
    pub base: PathBuf,
    /// The fine-tuned model's folder.
    #[serde(skip)]
    pub model: PathBuf,
    /// The rank of every factored module (the most, with `rel_error`).
    pub rank: usize,
    /// A module's rank is the least that leaves at most this relative error ‖Δ − Δ_r‖/‖Δ‖
    /// (capped at `rank`).
    pub rel_error: Option<f64>,
    /// Singular values at most this are dropped (mergekit's `--sv-epsilon`; 0: none).
    pub sv_epsilon: f64,
    /// Modules saved whole whatever their shape (mergekit's `--save-module`): a module whose
    /// name is one of these or ends with `.` and one of these.
    pub save_whole: Vec<String>,
    /// √s on both factors (mergekit's default), else s on B.
    pub distribute_scale: bool,
    /// Embeddings factored too, not saved whole.
    pub embed_lora: bool,
    /// Changed vectors (norms, biases) left out instead of saved whole.
    pub skip_undecomposable: bool,
    /// A factored update larger than this many MiB in f32 is not held but read from the files
    /// as it is factored (from its Gram matrix, whatever the rank; as every update the Gram path
    /// factors is).
    pub max_held_mib: usize,
    /// Only modules whose name matches this regular expression (mergekit's `--include-regex`).
    pub include: Option<String>,
    /// No module whose name matches this one (`--exclude-regex`).
    pub exclude: Option<String>,
}

/// What one factored module kept.
#[derive(Clone, Debug, serde::Serialize)]
pub struct Kept {
    /// The module (the tensor's name without `.weight`).
    pub module: String,
    /// The rank it was given.
    pub rank: usize,
    /// ‖Δ_r‖/‖Δ‖.
    pub kept: f64,
    /// ‖Δ‖_F, to weigh it in the whole.
    pub norm: f64,
}

/// What an extraction wrote.
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct Extraction {
    /// Each factored module, in the base's order.
    pub modules: Vec<Kept>,
    /// Modules saved whole (`modules_to_save`).
    pub whole: Vec<String>,
    /// Changed tensors left out (`--skip-undecomposable`, or filtered).
    pub skipped: Vec<String>,
    /// Tensors the model left as the base's.
    pub unchanged: usize,
}

impl Extraction {
    /// ‖Δ_r‖/‖Δ‖ over every factored module together.
    pub fn kept(&self) -> f64 {
        let (mut kept, mut all) = (0.0, 0.0);
        for m in &self.modules {
            kept += (m.kept * m.norm).powi(2);
            all += m.norm * m.norm;
        }
        if all > 0.0 {
            (kept / all).sqrt()
        } else {
            1.0
        }
    }
}

/// The rank where none is given (the command line's, Python's).
pub const DEFAULT_RANK: usize = 32;

/// The most MiB of one matrix's update held in f32 where none is given: a 70B model's MLP
/// matrices (0.9 GiB) are held, a 128k- or 152k-token vocabulary's head (2.1 GB) is not.
pub const DEFAULT_MAX_HELD_MIB: usize = 1024;

/// The largest rank asked for: an adapter's factors are (m + n)·r values.
const MAX_RANK: usize = 4096;

impl Request {
    /// Whether the update of an m × n matrix is held in f32: one the Lanczos process factors, of
    /// at most `max_held_mib` (the Gram path reads its rows from the files, held or not, the
    /// same sums: holding it would cost its size and save a pass over the page cache).
    fn holds(&self, (m, n): (usize, usize)) -> bool {
        !gram_is_cheaper((m, n), self.rank)
            && (m as u128) * (n as u128) * 4 <= (self.max_held_mib as u128) << 20
    }

    /// Checks what no type can — a rank of at least 1 and at most [`MAX_RANK`], an error target
    /// in (0, 1), filters that are regular expressions — and returns the filters compiled.
    pub fn check(&self) -> Result<Filters> {
        if self.rank == 0 || self.rank > MAX_RANK {
            return Err(usage(format!(
                "--rank must be in [1, {MAX_RANK}], got {}",
                self.rank
            )));
        }
        if !(self.sv_epsilon >= 0.0 && self.sv_epsilon.is_finite()) {
            return Err(usage(format!(
                "--sv-epsilon must be a finite number ≥ 0 (singular values at most it are \
                 dropped), got {}",
                self.sv_epsilon
            )));
        }
        if let Some(e) = self.rel_error {
            if !(e > 0.0 && e < 1.0) {
                return Err(usage(format!(
                    "--rel-error must be in (0, 1) (the most relative error ‖Δ − Δ_r‖/‖Δ‖ a \
                     module may keep), got {e}"
                )));
            }
        }
        let regex = |flag: &str, r: &Option<String>| -> Result<Option<regex::Regex>> {
            r.as_deref()
                .map(regex::Regex::new)
                .transpose()
                .map_err(|e| usage(format!("--{flag} (a regular expression): {e}")))
        };
        Ok(Filters {
            include: regex("include", &self.include)?,
            exclude: regex("exclude", &self.exclude)?,
        })
    }
}

/// Several regular expressions as the one that matches where any of them does (mergekit's
/// repeated `--include-regex`), or `None` for none.
pub fn any_of(regexes: &[String]) -> Option<String> {
    match regexes {
        [] => None,
        [one] => Some(one.clone()),
        many => Some(
            many.iter()
                .map(|r| format!("(?:{r})"))
                .collect::<Vec<_>>()
                .join("|"),
        ),
    }
}

/// The module filters of a request, compiled.
pub struct Filters {
    include: Option<regex::Regex>,
    exclude: Option<regex::Regex>,
}

impl Filters {
    /// Whether a module is taken at all.
    fn wanted(&self, module: &str) -> bool {
        self.include.as_ref().is_none_or(|r| r.is_match(module))
            && !self.exclude.as_ref().is_some_and(|r| r.is_match(module))
    }
}

/// How one changed tensor goes into the adapter.
enum Role {
    Linear,
    Embedding,
    Whole,
}

/// The role of base tensor `name` of `shape`: a matrix is a linear layer's weight (factored), or
/// the input embeddings (whole, or factored with `--embed-lora`); anything else is whole.
fn role(name: &str, shape: &[usize], embed_lora: bool) -> Role {
    let embedding = [
        "embed_tokens.weight",
        "wte.weight",
        "word_embeddings.weight",
    ]
    .iter()
    .any(|s| name.ends_with(s));
    match (shape.len(), embedding) {
        (2, true) if embed_lora => Role::Embedding,
        (2, true) => Role::Whole,
        (2, false) if name.ends_with(".weight") => Role::Linear,
        _ => Role::Whole,
    }
}

/// Elements read at a time by [`each_chunk`].
const CHUNK: usize = 1 << 20;

/// Decodes elements `start..start + values.len()` of tensor `t` of `folder` into `values`.
fn read_values(
    folder: &ModelFolder,
    t: &ModelTensor,
    start: usize,
    bytes: &mut Vec<u8>,
    values: &mut [f32],
) -> Result<()> {
    let size = t.entry.dtype.size();
    let at = (start * size) as u64;
    bytes.resize(values.len() * size, 0);
    folder
        .read(t, at, bytes)
        .with_context(|| format!("cannot read '{}' of {}", t.entry.name, folder.dir.display()))?;
    folder.record_read(t, at, bytes);
    decode(t.entry.dtype, bytes, values);
    Ok(())
}

/// Tensor `t` of `folder` read in chunks of [`CHUNK`] elements, each decoded to f32 and handed to
/// `visit` with the index of its first element.
fn each_chunk(
    folder: &ModelFolder,
    t: &ModelTensor,
    mut visit: impl FnMut(usize, &[f32]) -> Result<()>,
) -> Result<()> {
    let (mut bytes, mut values) = (Vec::new(), Vec::new());
    for start in (0..t.entry.numel).step_by(CHUNK) {
        values.resize(CHUNK.min(t.entry.numel - start), 0.0);
        read_values(folder, t, start, &mut bytes, &mut values)?;
        visit(start, &values)?;
    }
    Ok(())
}

/// Extracts `req` into the adapter folder `out` (replaced only with `force`, and only once the
/// new one is complete).
pub fn extract(req: &Request, out: &Path, force: bool) -> Result<Extraction> {
    let filters = req.check()?;
    let base = ModelFolder::open(&req.base)?;
    let model = ModelFolder::open(&req.model)?;
    let dtype = base.main_dtype().unwrap_or(DType::BF16);
    let mut inputs = base.paths();
    inputs.extend(model.paths());
    let folder = OutputFolder::create(out, force, &inputs)?;
    let mut done = Extraction::default();
    let mut written: Vec<Written<'_>> = Vec::new();
    // Changed biases, by module: lora_B's bias where the module is factored.
    let mut biases: Vec<(String, Vec<usize>, Vec<f32>)> = Vec::new();
    for bt in &base.tensors {
        crate::cancel::current().check()?;
        let name = bt.entry.name.to_string();
        let mt = paired(req, &model, bt)?;
        let module = name.strip_suffix(".weight").unwrap_or(&name).to_string();
        let wanted = filters.wanted(&module);
        let shape = bt.entry.shape.to_vec();
        let bias = name.strip_suffix(".bias");
        let saved = req
            .save_whole
            .iter()
            .any(|m| module == *m || module.ends_with(&format!(".{m}")));
        let role = match saved {
            true => Role::Whole,
            false => role(&name, &shape, req.embed_lora),
        };
        // Only an update the Lanczos process factors (up to --max-held-mib) or a bias is held;
        // the rest is checked chunk by chunk.
        let held =
            bias.is_some() || (!matches!(role, Role::Whole) && req.holds((shape[0], shape[1])));
        let Update {
            changed,
            norm,
            delta,
        } = update((&base, &model), (bt, mt), wanted && held)?;
        if !changed {
            done.unchanged += 1;
            continue;
        }
        if !wanted {
            done.skipped.push(name);
            continue;
        }
        if let Some(owner) = bias {
            biases.push((owner.to_string(), shape, delta.unwrap_or_default()));
            continue;
        }
        match role {
            Role::Whole if req.skip_undecomposable && shape.len() != 2 && !saved => {
                done.skipped.push(name)
            }
            Role::Whole => {
                // The model's own values, read again as the file is written (θ₀ + Δ need not
                // give them back in f32).
                written.push(Written::whole(format!("base_model.model.{name}"), mt));
                done.whole.push(module);
            }
            role => {
                let delta = match &delta {
                    Some(held) => Delta::Held(held),
                    None => Delta::Files((&base, bt), (&model, mt)),
                };
                let (kept, factors) = factor(req, delta, (shape[0], shape[1]), (&name, norm))?;
                let embedding = matches!(role, Role::Embedding);
                // A module left no direction (all below --sv-epsilon) is no target: no tensors.
                if kept.rank > 0 {
                    written.extend(adapter_tensors(
                        &module,
                        &factors,
                        (embedding, shape[1]),
                        dtype,
                    ));
                }
                done.modules.push(Kept { module, ..kept });
            }
        }
    }
    let lora_bias = attach_biases(biases, (&mut written, dtype), &mut done);
    let tensors = (&written[..], &model);
    write_adapter(req, folder.path(), tensors, (dtype, lora_bias), &done)?;
    write_record(
        req,
        (&base, &model),
        folder.final_path(),
        folder.path(),
        &done,
    )?;
    base.check_unchanged()?;
    model.check_unchanged()?;
    folder.commit()?;
    Ok(done)
}

/// The model's tensor of base tensor `bt`: a model without it, or of another shape, is no
/// fine-tune of the base.
fn paired<'m>(req: &Request, model: &'m ModelFolder, bt: &ModelTensor) -> Result<&'m ModelTensor> {
    let name = &*bt.entry.name;
    let mt = model.get(name).with_context(|| {
        format!(
            "{} has no tensor '{name}', which the base {} has: is it a fine-tune of that base?",
            req.model.display(),
            req.base.display()
        )
    })?;
    if mt.entry.shape != bt.entry.shape {
        return Err(usage(format!(
            "tensor '{name}' is {:?} in {} and {:?} in the base {}: the model is not a fine-tune \
             of that base",
            mt.entry.shape,
            req.model.display(),
            bt.entry.shape,
            req.base.display()
        )));
    }
    Ok(mt)
}

/// What [`update`] found of a tensor's update.
struct Update {
    /// Whether any element changed.
    changed: bool,
    /// ‖Δ‖_F, its squares summed in element order in f64.
    norm: f64,
    /// Δ whole, where asked.
    delta: Option<Vec<f32>>,
}

/// The update Δ = θ − θ₀ of base tensor `bt` (the model's `mt`), in f32 chunk by chunk: whether
/// any element changed, its norm, and with `hold` the whole Δ (one matrix held, not three); a NaN or ±Inf
/// is refused.
fn update(
    (base, model): (&ModelFolder, &ModelFolder),
    (bt, mt): (&ModelTensor, &ModelTensor),
    hold: bool,
) -> Result<Update> {
    let mut held = hold.then(|| vec![0f32; bt.entry.numel]);
    let (mut bytes, mut base_values, mut changed) = (Vec::new(), Vec::new(), false);
    let mut squares = 0.0f64;
    each_chunk(model, mt, |start, x| {
        base_values.resize(x.len(), 0.0);
        read_values(base, bt, start, &mut bytes, &mut base_values)?;
        let mut chunk = held.as_mut().map(|h| &mut h[start..start + x.len()]);
        for (i, (&x, &b)) in x.iter().zip(&base_values).enumerate() {
            let d = x - b;
            if !d.is_finite() {
                anyhow::bail!(
                    "tensor '{}' holds a NaN or ±Inf at element {} (in the base or the model): \
                     no adapter can hold it",
                    bt.entry.name,
                    start + i
                );
            }
            changed |= d != 0.0;
            squares += f64::from(d) * f64::from(d);
            if let Some(h) = chunk.as_deref_mut() {
                h[i] = d;
            }
        }
        Ok(())
    })?;
    Ok(Update {
        changed,
        norm: squares.sqrt(),
        delta: held,
    })
}

/// A factored update: held in f32, or read from the base's and the model's files as needed.
enum Delta<'a> {
    Held(&'a [f32]),
    Files(
        (&'a ModelFolder, &'a ModelTensor),
        (&'a ModelFolder, &'a ModelTensor),
    ),
}

impl Delta<'_> {
    /// Its top `k` triplets: those of `top_k` for a held update; from the Gram matrix for one
    /// read from files, each run of elements read when it is needed, Δ in f32 as [`update`]
    /// takes it.
    fn top(&self, (m, n): (usize, usize), k: usize, what: &str) -> Result<TopK> {
        let ((base, bt), (model, mt)) = match *self {
            Delta::Held(delta) => return top_k(delta, (m, n), k, MAX_STEPS, what),
            Delta::Files(base, model) => (base, model),
        };
        let (mut bytes, mut b) = (Vec::new(), Vec::new());
        top_k_by_gram((m, n), k, what, |start, len, x| {
            x.resize(len, 0.0);
            b.resize(len, 0.0);
            read_values(model, mt, start, &mut bytes, x)?;
            read_values(base, bt, start, &mut bytes, &mut b)?;
            x.iter_mut().zip(&b).for_each(|(x, b)| *x -= b);
            Ok(())
        })
    }
}

/// The changed biases as lora_B's biases (PEFT's `lora_bias`: ΔW·x + Δb) where every factored
/// module has one — PEFT's `lora_bias` gives every target a bias, and a layer without one cannot
/// take it; else they are left out and listed (a module PEFT saves whole cannot also be a LoRA
/// target, and mergekit drops them unsaid). Whether they went in.
fn attach_biases(
    biases: Vec<(String, Vec<usize>, Vec<f32>)>,
    (written, dtype): (&mut Vec<Written>, DType),
    done: &mut Extraction,
) -> bool {
    let factored: Vec<&str> = done
        .modules
        .iter()
        .filter(|m| m.rank > 0)
        .map(|m| m.module.as_str())
        .collect();
    let every = !biases.is_empty()
        && !factored.is_empty()
        && factored
            .iter()
            .all(|f| biases.iter().any(|(module, _, _)| module == f));
    for (module, shape, delta) in biases {
        match every && factored.contains(&module.as_str()) {
            true => written.push(Written::new(
                format!("base_model.model.{module}.lora_B.bias"),
                shape,
                &delta,
                dtype,
            )),
            false => done.skipped.push(format!("{module}.bias")),
        }
    }
    every
}

/// Δ's top factors (m × n) at the request's rank (or the least rank that meets its error target),
/// with what they keep.
fn factor(
    req: &Request,
    delta: Delta<'_>,
    (m, n): (usize, usize),
    (name, norm): (&str, f64),
) -> Result<(Kept, Factors)> {
    let top = delta.top((m, n), req.rank, &format!("the update of '{name}'"))?;
    let energy: Vec<f64> = top
        .s
        .iter()
        .scan(0.0, |acc, s| {
            *acc += s * s;
            Some(*acc)
        })
        .collect();
    let all = norm * norm;
    // Singular values at most --sv-epsilon are none of the adapter's.
    let above = top.s.iter().take_while(|&&s| s > req.sv_epsilon).count();
    let rank = match req.rel_error {
        Some(target) => energy
            .iter()
            .position(|&e| (1.0 - e / all).max(0.0).sqrt() <= target)
            .map_or(top.s.len(), |k| k + 1),
        None => top.s.len(),
    }
    .min(above);
    let kept = match rank {
        0 => 0.0,
        r => (energy[r - 1] / all).min(1.0).sqrt(),
    };
    let factors = Factors::of(top, rank, req.distribute_scale);
    let kept = Kept {
        module: String::new(),
        rank,
        kept,
        norm,
    };
    Ok((kept, factors))
}

/// B (m × r, columns) and A (r × n, rows) of Δ_r = B·A.
struct Factors {
    b_cols: Vec<Vec<f64>>,
    a_rows: Vec<Vec<f64>>,
}

impl Factors {
    /// The first `rank` triplets of `top` as B and A: √s on each (`distribute`), else s on B.
    fn of(top: TopK, rank: usize, distribute: bool) -> Factors {
        let mut f = Factors {
            b_cols: Vec::new(),
            a_rows: Vec::new(),
        };
        for ((s, su), v) in top.s.into_iter().zip(top.su).zip(top.v).take(rank) {
            let (b_scale, a_scale) = match distribute {
                true => (1.0 / s.sqrt(), s.sqrt()),
                false => (1.0, 1.0),
            };
            f.b_cols.push(su.iter().map(|x| x * b_scale).collect());
            f.a_rows.push(v.iter().map(|x| x * a_scale).collect());
        }
        f
    }
}

/// What an extracted adapter's folder records (`rlmerge_record.json`, as a merge's): what it was
/// extracted from and how, what each module kept, and the checksums of every file read and
/// written — `rlmerge verify` checks them, and `--force` replaces only a folder it describes.
#[derive(serde::Serialize)]
struct AdapterRecord<'a> {
    tool: &'static str,
    version: &'static str,
    kind: &'static str,
    base: String,
    model: String,
    #[serde(flatten)]
    request: &'a Request,
    kept: f64,
    extraction: &'a Extraction,
    inputs: Vec<crate::record::InputChecksums>,
    outputs: Vec<crate::checkpoint::weight_file::FileChecksum>,
}

/// The record's `kind` for an extracted adapter.
const RECORD_KIND: &str = "extract-lora";

/// Writes the adapter's record into `dir` (the scratch of the folder that will be `out`).
fn write_record(
    req: &Request,
    (base, model): (&ModelFolder, &ModelFolder),
    out: &Path,
    dir: &Path,
    done: &Extraction,
) -> Result<()> {
    let outputs = [ADAPTER_WEIGHTS, ADAPTER_CONFIG]
        .iter()
        .map(|f| crate::checkpoint::weight_file::crc32_of_file(&dir.join(f)))
        .collect::<Result<Vec<_>>>()?;
    let shown = |p: &Path| crate::record::recorded_path(out, p).display().to_string();
    let record = AdapterRecord {
        tool: "rlmerge",
        version: env!("CARGO_PKG_VERSION"),
        kind: RECORD_KIND,
        base: shown(&req.base),
        model: shown(&req.model),
        request: req,
        kept: done.kept(),
        extraction: done,
        inputs: vec![
            crate::record::tool::input(out, base)?,
            crate::record::tool::input(out, model)?,
        ],
        outputs,
    };
    crate::record::tool::write(dir, &record)
}

/// The adapter's model card: what it was extracted from, at what rank, and what it keeps.
fn card(req: &Request, done: &Extraction) -> String {
    let code = |p: &Path| crate::escape::markdown_code(&p.display().to_string());
    format!(
        "---\nlibrary_name: peft\ntags:\n- rlmerge\n- lora\n- extracted\n---\n\n# LoRA extracted \
         with rlmerge\n\nThis adapter is {} as a rank-{} LoRA against its base {} (`rlmerge \
         extract-lora`, rlmerge {}): {} modules factored, keeping {:.1} % of the update's energy \
         (‖Δ_r‖/‖Δ‖ over them); {} saved whole; {} left out; {} tensors unchanged.\n",
        code(&req.model),
        req.rank,
        code(&req.base),
        env!("CARGO_PKG_VERSION"),
        done.modules.len(),
        100.0 * done.kept(),
        done.whole.len(),
        done.skipped.len(),
        done.unchanged,
    )
}
