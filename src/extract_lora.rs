//! LoRA extraction (`rlmerge extract-lora`, issue #54 item 1; mergekit's `mergekit-extract-lora`):
//! a fine-tuned model as a PEFT adapter of rank r against its base. Each changed matrix's update
//! Δ = θ − θ₀ is factored by its top r singular triplets (`linalg::top_k`: the Lanczos process for
//! r ≤ 32, else one eigendecomposition of Δ's Gram matrix on its short side — never a full SVD),
//! Δ_r = B·A with A = √s·Vᵀ and B = U·√s (`--no-distribute-scale`: A = Vᵀ, B = U·s), which PEFT
//! applies with scaling lora_alpha / r = 1. A changed embedding is saved whole
//! (`modules_to_save`), or factored as `lora_embedding_A/B` with `--embed-lora`; a changed vector
//! (a norm, a bias) is saved whole, or left out with `--skip-undecomposable`. One matrix is held
//! at a time (its Δ in f32 and the factors' work), the factors until the adapter is written.
//!
//! What rank r keeps of each update is measured and said: ‖Δ_r‖/‖Δ‖ = √(Σ_{k≤r} s_k²) / ‖Δ‖_F, the
//! share of its energy, by the Eckart–Young theorem the most any rank-r adapter keeps. An RL
//! agent's update is sparse and spread over every direction: a small r keeps little of it.

use crate::checkpoint::dtype::{decode, encode};
use crate::checkpoint::files::{ADAPTER_CONFIG, ADAPTER_WEIGHTS, SINGLE_FILE};
use crate::checkpoint::{
    CheckpointWriter, DType, ModelFolder, ModelTensor, OutputFolder, OutputTensor,
};
use crate::error::usage;
use crate::linalg::top_k::{top_k, TopK};
use crate::linalg::truncated_svd::MAX_STEPS;
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

/// The largest rank asked for: an adapter's factors are (m + n)·r values.
const MAX_RANK: usize = 4096;

impl Request {
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

/// One tensor of the adapter file, in the base's dtype.
struct Written {
    name: String,
    shape: Vec<usize>,
    /// Its values in the adapter's dtype (held until the file is written: half of f32's bytes).
    bytes: Vec<u8>,
}

impl Written {
    fn new(name: String, shape: Vec<usize>, values: &[f32], dtype: DType) -> Written {
        let mut bytes = vec![0u8; values.len() * dtype.size()];
        encode(dtype, values, &mut bytes);
        Written { name, shape, bytes }
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

/// Reads tensor `t` of `folder` whole as f32, in chunks (no copy of its bytes held whole).
fn values_of(folder: &ModelFolder, t: &ModelTensor) -> Result<Vec<f32>> {
    let mut values = vec![0f32; t.entry.numel];
    with_base(folder, t, &mut values, |v, x| *v = x)?;
    Ok(values)
}

/// Elements read at a time by [`with_base`].
const CHUNK: usize = 1 << 20;

/// `op(v, x)` for each element v of `values` and x of tensor `t` of `folder` (the base's, to
/// subtract, or the model's, to read), `t` read in chunks of [`CHUNK`] elements.
fn with_base(
    folder: &ModelFolder,
    t: &ModelTensor,
    values: &mut [f32],
    op: impl Fn(&mut f32, f32),
) -> Result<()> {
    let size = t.entry.dtype.size();
    let (mut bytes, mut base) = (Vec::new(), Vec::new());
    for (c, chunk) in values.chunks_mut(CHUNK).enumerate() {
        let start = (c * CHUNK * size) as u64;
        bytes.resize(chunk.len() * size, 0);
        base.resize(chunk.len(), 0.0);
        folder.read(t, start, &mut bytes).with_context(|| {
            format!("cannot read '{}' of {}", t.entry.name, folder.dir.display())
        })?;
        folder.record_read(t, start, &bytes);
        decode(t.entry.dtype, &bytes, &mut base);
        chunk.iter_mut().zip(&base).for_each(|(v, &b)| op(v, b));
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
    let mut written: Vec<Written> = Vec::new();
    // Changed biases, by module: lora_B's bias where the module is factored.
    let mut biases: Vec<(String, Vec<usize>, Vec<f32>)> = Vec::new();
    for bt in &base.tensors {
        crate::cancel::current().check()?;
        let name = bt.entry.name.to_string();
        let (mt, delta) = update_of(req, (&base, &model), bt)?;
        if delta.iter().all(|&d| d == 0.0) {
            done.unchanged += 1;
            continue;
        }
        let module = name.strip_suffix(".weight").unwrap_or(&name).to_string();
        if !filters.wanted(&module) {
            done.skipped.push(name);
            continue;
        }
        let shape = bt.entry.shape.to_vec();
        if let Some(owner) = name.strip_suffix(".bias") {
            biases.push((owner.to_string(), shape, delta));
            continue;
        }
        let saved = req
            .save_whole
            .iter()
            .any(|m| module == *m || module.ends_with(&format!(".{m}")));
        let role = match saved {
            true => Role::Whole,
            false => role(&name, &shape, req.embed_lora),
        };
        match role {
            Role::Whole if req.skip_undecomposable && shape.len() != 2 && !saved => {
                done.skipped.push(name)
            }
            Role::Whole => {
                // The model's own values, read again (θ₀ + Δ need not give them back in f32).
                let theta = values_of(&model, mt)?;
                let name = format!("base_model.model.{name}");
                written.push(Written::new(name, shape, &theta, dtype));
                done.whole.push(module);
            }
            role => {
                let (kept, factors) = factor(req, &delta, (shape[0], shape[1]), &name)?;
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
    write_adapter(req, folder.path(), &written, (dtype, lora_bias), &done)?;
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

/// The model's tensor of base tensor `bt` and its update Δ = θ − θ₀ in f32 (the model's values
/// read, the base's subtracted in chunks: one matrix held, not three); a model without it, or of
/// another shape, is no fine-tune of the base, and a NaN or ±Inf is refused.
fn update_of<'m>(
    req: &Request,
    (base, model): (&ModelFolder, &'m ModelFolder),
    bt: &ModelTensor,
) -> Result<(&'m ModelTensor, Vec<f32>)> {
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
    let mut delta = values_of(model, mt)?;
    with_base(base, bt, &mut delta, |d, b| *d -= b)?;
    if let Some(at) = delta.iter().position(|d| !d.is_finite()) {
        anyhow::bail!(
            "tensor '{name}' holds a NaN or ±Inf at element {at} (in the base or the model): no \
             adapter can hold it"
        );
    }
    Ok((mt, delta))
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
    delta: &[f32],
    (m, n): (usize, usize),
    name: &str,
) -> Result<(Kept, Factors)> {
    let norm = delta
        .iter()
        .map(|&d| f64::from(d) * f64::from(d))
        .sum::<f64>()
        .sqrt();
    let top = top_k(
        delta,
        (m, n),
        req.rank,
        MAX_STEPS,
        &format!("the update of '{name}'"),
    )?;
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

/// PEFT's tensors of a factored module: `lora_A.weight` (r × n) and `lora_B.weight` (m × r) of a
/// linear layer; of an embedding (Δ of vocab × hidden), `lora_embedding_A` (r × vocab) and
/// `lora_embedding_B` (hidden × r), PEFT's ΔW = (B·A)ᵀ.
fn adapter_tensors(
    module: &str,
    f: &Factors,
    (embedding, n): (bool, usize),
    dtype: DType,
) -> Vec<Written> {
    let r = f.a_rows.len();
    let m = f.b_cols.first().map_or(0, Vec::len);
    // Row-major r × n from rows, and m × r from columns.
    let rows = |rows: &[Vec<f64>]| {
        rows.iter()
            .flatten()
            .map(|&x| x as f32)
            .collect::<Vec<f32>>()
    };
    let cols = |cols: &[Vec<f64>], len: usize| {
        (0..len)
            .flat_map(|i| cols.iter().map(move |c| c[i] as f32))
            .collect::<Vec<f32>>()
    };
    let p = format!("base_model.model.{module}");
    match embedding {
        false => vec![
            Written::new(
                format!("{p}.lora_A.weight"),
                vec![r, n],
                &rows(&f.a_rows),
                dtype,
            ),
            Written::new(
                format!("{p}.lora_B.weight"),
                vec![m, r],
                &cols(&f.b_cols, m),
                dtype,
            ),
        ],
        // Δᵀ = A_rowsᵀ·B_colsᵀ: B' = the A rows as columns (hidden × r), A' = the B columns as
        // rows (r × vocab).
        true => vec![
            Written::new(
                format!("{p}.lora_embedding_A"),
                vec![r, m],
                &rows(&f.b_cols),
                dtype,
            ),
            Written::new(
                format!("{p}.lora_embedding_B"),
                vec![n, r],
                &cols(&f.a_rows, n),
                dtype,
            ),
        ],
    }
}

/// Writes `adapter_model.safetensors` (every tensor in `dtype`), `adapter_config.json` (rank,
/// alpha = rank so PEFT's scaling is 1, per-module ranks where they differ, the target modules and
/// the modules saved whole) and a model card into `dir`.
fn write_adapter(
    req: &Request,
    dir: &Path,
    tensors: &[Written],
    (dtype, lora_bias): (DType, bool),
    done: &Extraction,
) -> Result<()> {
    let plan: Vec<OutputTensor> = tensors
        .iter()
        .map(|t| OutputTensor {
            name: t.name.as_str().into(),
            dtype,
            shape: t.shape.clone().into(),
        })
        .collect();
    let mut writer = CheckpointWriter::new(dir, plan, u64::MAX)?;
    for t in tensors {
        writer.write(&t.name, &t.bytes)?;
    }
    writer.finish()?;
    let (from, to) = (dir.join(SINGLE_FILE), dir.join(ADAPTER_WEIGHTS));
    std::fs::rename(&from, &to).with_context(|| format!("cannot write {}", to.display()))?;
    let rank = done
        .modules
        .iter()
        .map(|m| m.rank)
        .max()
        .unwrap_or(req.rank)
        .max(1);
    let pattern: serde_json::Map<String, serde_json::Value> = done
        .modules
        .iter()
        .filter(|m| m.rank != rank && m.rank > 0)
        .map(|m| (regex::escape(&m.module) + "$", m.rank.into()))
        .collect();
    let config = serde_json::json!({
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": req.base.display().to_string(),
        "r": rank,
        "lora_alpha": rank,
        "rank_pattern": pattern,
        "alpha_pattern": pattern,
        "target_modules": done.modules.iter().filter(|m| m.rank > 0).map(|m| m.module.clone()).collect::<Vec<_>>(),
        "modules_to_save": done.whole,
        "lora_dropout": 0.0,
        "bias": "none",
        "fan_in_fan_out": false,
        "inference_mode": true,
        "init_lora_weights": true,
        "use_rslora": false,
        "use_dora": false,
        "lora_bias": lora_bias,
    });
    let path = dir.join(ADAPTER_CONFIG);
    std::fs::write(&path, serde_json::to_string_pretty(&config)? + "\n")
        .with_context(|| format!("cannot write {}", path.display()))?;
    std::fs::write(dir.join("README.md"), card(req, done))
        .with_context(|| format!("cannot write {}", dir.join("README.md").display()))?;
    Ok(())
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
