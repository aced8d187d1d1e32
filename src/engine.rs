//! The merge job: validate inputs against the base, cut every tensor into tiles, run the probe pass
//! (whole model for global RAM+, per tensor for tensor scope) and the merge pass through a
//! [`Backend`], and stream the merged bytes into the output checkpoint.

use crate::backend::{ranges, Backend, CombineParams, MergeParams, Tile, TileCounts};
use crate::checkpoint::dtype::{decode, decode_minus, decode_one, encode, first_nonfinite};
use crate::checkpoint::folder_files::{check_base_config, copy_base_files};
use crate::checkpoint::safetensors_file::{crc32_of_file, shape_text};
use crate::checkpoint::{
    CheckpointWriter, DType, ModelFolder, ModelTensor, OutputFolder, OutputTensor,
};
use crate::error::usage;
use crate::method::combine::{fisher_coefs, row_ranks, CombineSpec};
use crate::method::settings::{layer_index, layer_t, TensorPlace};
use crate::method::statistics;
use crate::method::{self, AgentCounts, BoostScope, Kind, Method, MethodConfig};
use crate::recipe::{self, AgentSummary, InputChecksums, Recipe};
use crate::report::{ProbeReport, TensorStats};
use crate::scans::{AgentChunk, AgentVisit, AnyOrderVisit, Scans, Values, Visit, SCAN_CHUNK};
use anyhow::{bail, ensure, Context, Result};
use indicatif::{ProgressBar, ProgressStyle};
use rayon::prelude::*;
use std::ops::ControlFlow;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Mutex;

/// The base and the agents, opened and checked against each other.
pub struct Inputs {
    pub base: ModelFolder,
    pub agents: Vec<ModelFolder>,
    /// Tensors to merge, in the base's storage order.
    pub tensors: Vec<TensorPlan>,
    /// Things the user should know (tensors missing in some agents, extra tensors ignored).
    pub warnings: Vec<String>,
}

/// One base tensor and where each agent keeps its counterpart: its index in that agent's
/// [`ModelFolder::tensors`] (`None`: that agent lacks it). Indices, not copies: a model may have
/// 10^5 tensors.
pub struct TensorPlan {
    pub base: ModelTensor,
    pub agents: Box<[Option<u32>]>,
}

impl TensorPlan {
    pub fn name(&self) -> &str {
        &self.base.entry.name
    }

    pub fn numel(&self) -> usize {
        self.base.entry.numel
    }

    /// Agent `t`'s counterpart, if it has one.
    pub fn agent<'a>(&self, inputs: &'a Inputs, t: usize) -> Option<&'a ModelTensor> {
        self.agents[t].map(|i| &inputs.agents[t].tensors[i as usize])
    }

    /// Global indices of the agents that have this tensor.
    pub fn present(&self) -> Vec<usize> {
        (0..self.agents.len())
            .filter(|&t| self.agents[t].is_some())
            .collect()
    }
}

impl Inputs {
    /// Opens every folder and checks each agent tensor's dtype and shape against the base's.
    pub fn open(base_dir: &Path, agent_dirs: &[PathBuf]) -> Result<Inputs> {
        ensure!(
            !agent_dirs.is_empty(),
            "at least one agent model is needed (--model DIR)"
        );
        if agent_dirs.len() > method::MAX_AGENTS {
            return Err(usage(format!(
                "at most {} agent models can be handled at once, got {}",
                method::MAX_AGENTS,
                agent_dirs.len()
            )));
        }
        refuse_repeated_agents(agent_dirs)?;
        // One copy of each tensor name and shape for all models.
        let mut interner = crate::checkpoint::safetensors_file::Interner::default();
        let base = ModelFolder::open_interned(base_dir, &mut interner)
            .context("cannot open the base model")?;
        ensure!(
            !base.tensors.is_empty(),
            "the base model {} has no tensors (its header is empty)",
            base_dir.display()
        );
        let agents = agent_dirs
            .iter()
            .map(|d| {
                ModelFolder::open_interned(d, &mut interner).context("cannot open an agent model")
            })
            .collect::<Result<Vec<_>>>()?;
        for agent in &agents {
            if !agent
                .tensors
                .iter()
                .any(|t| base.get(&t.entry.name).is_some())
            {
                bail!(
                    "{} has none of the base's tensor names (agent: '{}', base: '{}'); was it \
                     fine-tuned from {}, and saved with the same names?",
                    agent.dir.display(),
                    agent.tensors.first().map_or("", |t| &*t.entry.name),
                    base.tensors[0].entry.name,
                    base_dir.display()
                );
            }
        }
        let mut warnings = Vec::new();
        let mut tensors = Vec::with_capacity(base.tensors.len());
        for bt in &base.tensors {
            let mut found = Vec::with_capacity(agents.len());
            for agent in &agents {
                let Some(index) = agent.index_of(&bt.entry.name) else {
                    found.push(None);
                    continue;
                };
                let at = &agent.tensors[index];
                if at.entry.dtype != bt.entry.dtype || at.entry.shape != bt.entry.shape {
                    bail!(
                        "tensor '{}' in {} is {} {} but in the base ({}) it is {} {}",
                        bt.entry.name,
                        agent.file_of(at).display(),
                        at.entry.dtype,
                        shape_text(&at.entry.shape),
                        base.file_of(bt).display(),
                        bt.entry.dtype,
                        shape_text(&bt.entry.shape)
                    );
                }
                found.push(Some(index as u32));
            }
            let missing: Vec<String> = found
                .iter()
                .enumerate()
                .filter(|(_, f)| f.is_none())
                .map(|(t, _)| agents[t].dir.display().to_string())
                .collect();
            if !missing.is_empty() {
                let what = if missing.len() == agents.len() {
                    "kept from the base".to_string()
                } else {
                    "merged from the agents that have it".to_string()
                };
                warnings.push(format!(
                    "tensor '{}' is missing in {}; {what}",
                    bt.entry.name,
                    missing.join(", ")
                ));
            }
            tensors.push(TensorPlan {
                base: bt.clone(),
                agents: found.into(),
            });
        }
        for agent in &agents {
            let extra: Vec<&str> = agent
                .tensors
                .iter()
                .filter(|t| base.get(&t.entry.name).is_none())
                .map(|t| &*t.entry.name)
                .collect();
            if let Some(first) = extra.first() {
                warnings.push(format!(
                    "{} has {} tensor(s) the base lacks (first: '{first}'); they are ignored",
                    agent.dir.display(),
                    extra.len()
                ));
            }
        }
        Ok(Inputs {
            base,
            agents,
            tensors,
            warnings,
        })
    }

    /// Refuses the base given as an agent too, for every use that takes task vectors against
    /// it (all but methods without a base, which merge the models themselves).
    pub fn refuse_base_as_agent(&self) -> Result<()> {
        let base = real_path(&self.base.dir);
        match self.agents.iter().find(|a| real_path(&a.dir) == base) {
            Some(a) => Err(usage(format!(
                "--model {} is the base model {}; its task vector is zero — give each agent \
                 once, and not the base",
                a.dir.display(),
                self.base.dir.display()
            ))),
            None => Ok(()),
        }
    }

    /// Bytes of tensor data one pass reads (base + every agent tensor).
    pub fn pass_bytes(&self) -> u64 {
        self.tensors
            .iter()
            .map(|t| t.base.entry.byte_len() * (1 + t.present().len() as u64))
            .sum()
    }

    /// Fails if any input file changed since it was opened.
    pub fn check_unchanged(&self) -> Result<()> {
        std::iter::once(&self.base)
            .chain(&self.agents)
            .try_for_each(|m| m.check_unchanged())
    }

    /// Every input folder and weight file (which may be links to elsewhere, as in the Hugging
    /// Face cache): what an output must never overlap.
    pub fn paths(&self) -> Vec<PathBuf> {
        std::iter::once(&self.base)
            .chain(&self.agents)
            .flat_map(ModelFolder::paths)
            .collect()
    }

    pub fn agent_labels(&self) -> Vec<String> {
        self.agents
            .iter()
            .map(|a| a.dir.display().to_string())
            .collect()
    }
}

fn real_path(p: &Path) -> PathBuf {
    std::fs::canonicalize(p).unwrap_or_else(|_| p.to_path_buf())
}

/// Warnings for inputs with identical weights (every weight file of the same size and CRC-32,
/// known for free from the checksums the merge computed): two copies of one agent count its
/// changes as shared by two; an agent equal to the base changes nothing.
fn identical_inputs(sums: &[InputChecksums], uses_base: bool) -> Vec<String> {
    fn key(i: &InputChecksums) -> Vec<(u64, &str)> {
        let mut k: Vec<(u64, &str)> = i.files.iter().map(|f| (f.size, f.crc32.as_str())).collect();
        k.sort_unstable();
        k
    }
    let mut warnings = Vec::new();
    let first = if uses_base { 0 } else { 1 };
    for a in first..sums.len() {
        for b in a + 1..sums.len() {
            if key(&sums[a]) == key(&sums[b]) {
                warnings.push(if a == 0 {
                    format!(
                        "agent {} holds the same weights as the base (every weight file has the \
                         same size and CRC-32): it changes nothing",
                        sums[b].path.display()
                    )
                } else {
                    format!(
                        "agents {} and {} hold the same weights (every weight file has the same \
                         size and CRC-32): their changes count as shared by two agents",
                        sums[a].path.display(),
                        sums[b].path.display()
                    )
                });
            }
        }
    }
    warnings
}

/// Refuses an agent folder given twice (after resolving links): it would count one agent's
/// changes as shared by two, and move every λ.
fn refuse_repeated_agents(agent_dirs: &[PathBuf]) -> Result<()> {
    let mut seen: Vec<(PathBuf, &Path)> = Vec::new();
    for dir in agent_dirs {
        let r = real_path(dir);
        if let Some((_, first)) = seen.iter().find(|(s, _)| *s == r) {
            return Err(usage(format!(
                "--model {} is given twice (also as {}); give each agent once",
                dir.display(),
                first.display()
            )));
        }
        seen.push((r, dir));
    }
    Ok(())
}

/// Reusable tile buffers: one for the base, one per agent.
struct TileBuffers {
    base: Vec<u8>,
    agents: Vec<Vec<u8>>,
}

impl TileBuffers {
    fn new(agents: usize) -> TileBuffers {
        TileBuffers {
            base: Vec::new(),
            agents: vec![Vec::new(); agents],
        }
    }

    /// Reads elements `start..start + len` of `plan` for the base and the `present` agents (one
    /// input per core when `spread`, else on the calling thread), and inspects each while its
    /// bytes are in cache: feeds the input's running checksum and, when `finite_only`, fails on
    /// the first NaN or ±Inf, naming tensor, file and element.
    fn load(
        &mut self,
        inputs: &Inputs,
        plan: &TensorPlan,
        present: &[usize],
        (start, len): (usize, usize),
        finite_only: bool,
        spread: bool,
    ) -> Result<()> {
        let dtype = plan.base.entry.dtype;
        let (offset, bytes) = ((start * dtype.size()) as u64, len * dtype.size());
        let sources = std::iter::once((&inputs.base, &plan.base)).chain(present.iter().map(|&t| {
            let at = plan
                .agent(inputs, t)
                .expect("present agents have the tensor");
            (&inputs.agents[t], at)
        }));
        let jobs: Vec<(&ModelFolder, &ModelTensor, &mut Vec<u8>)> = sources
            .zip(std::iter::once(&mut self.base).chain(self.agents.iter_mut()))
            .map(|((model, tensor), buf)| (model, tensor, buf))
            .collect();
        let load_one =
            |(model, tensor, buf): (&ModelFolder, &ModelTensor, &mut Vec<u8>)| -> Result<()> {
                buf.resize(bytes, 0);
                model.read(tensor, offset, buf)?;
                model.record_read(tensor, offset, buf);
                match finite_only.then(|| first_nonfinite(dtype, buf)).flatten() {
                    None => Ok(()),
                    Some(i) => bail!(
                        "tensor '{}' in {} has a non-finite value ({}) at element {}; \
                     rlmerge refuses NaN and infinity unless --allow-nonfinite",
                        plan.name(),
                        model.file_of(tensor).display(),
                        decode_one(dtype, buf, i),
                        start + i
                    ),
                }
            };
        // Spreading a small tile over threads costs more than reading it; results keep input order.
        let results: Vec<Result<()>> = if spread && bytes >= 1 << 17 {
            jobs.into_par_iter().map(load_one).collect()
        } else {
            jobs.into_iter().map(load_one).collect()
        };
        results.into_iter().collect()
    }

    /// [`Self::load`]s elements `start..start + len` and hands them to `visit` as one [`Tile`].
    #[allow(clippy::too_many_arguments)]
    fn visit<R>(
        &mut self,
        inputs: &Inputs,
        plan: &TensorPlan,
        present: &[usize],
        (start, len): (usize, usize),
        finite_only: bool,
        spread: bool,
        visit: impl FnOnce(&Tile) -> Result<R>,
    ) -> Result<R> {
        self.load(inputs, plan, present, (start, len), finite_only, spread)?;
        let agents: Vec<&[u8]> = self.agents[..present.len()]
            .iter()
            .map(|v| v.as_slice())
            .collect();
        visit(&Tile {
            dtype: plan.base.entry.dtype,
            len,
            base: &self.base,
            agents: &agents,
        })
    }
}

/// How a pass walks the tensors (both passes share it).
#[derive(Clone, Debug)]
pub struct Pass {
    pub epsilon: f32,
    pub tile_elems: usize,
    /// Fail on NaN/±Inf in any input tile. Off when the user allows them (`--allow-nonfinite`:
    /// merged by IEEE rules), and in a merge pass after a probe pass already scanned every byte.
    pub scan_nonfinite: bool,
}

/// Reads `plan` tile by tile, in order, from the tile holding element `from`, for the base and the
/// `present` agents and hands each tile, with its index, to `visit`: the statistics scans that
/// need element order. The probe and merge passes run [`par_tiles`].
#[allow(clippy::too_many_arguments)]
fn for_each_tile(
    inputs: &Inputs,
    plan: &TensorPlan,
    present: &[usize],
    pass: &Pass,
    buffers: &mut TileBuffers,
    progress: &ProgressBar,
    from: u64,
    mut visit: impl FnMut(usize, u64, &Tile) -> Result<ControlFlow<()>>,
) -> Result<()> {
    let dtype = plan.base.entry.dtype;
    let tiles = ranges(plan.numel(), pass.tile_elems).enumerate();
    // From the tile holding element `from`: tiles keep their places whatever `from` is.
    for (i, (start, len)) in tiles.skip_while(|(_, (s, l))| (s + l) as u64 <= from) {
        let flow = buffers.visit(
            inputs,
            plan,
            present,
            (start, len),
            pass.scan_nonfinite,
            true,
            |tile| visit(i, start as u64, tile),
        )?;
        progress.inc((len * dtype.size() * (1 + present.len())) as u64);
        if flow.is_break() {
            break;
        }
    }
    Ok(())
}

/// One tensor's part in a tile loop ([`par_tiles`]): its plan, the agents read with the base,
/// and its tile size.
struct TensorTiles<'a> {
    plan: &'a TensorPlan,
    present: &'a [usize],
    tile_elems: usize,
}

impl TensorTiles<'_> {
    fn count(&self) -> usize {
        tile_count(self.plan, self.tile_elems)
    }
}

/// Tiles of `tile_elems` elements (at least one) that `plan` is cut into.
fn tile_count(plan: &TensorPlan, tile_elems: usize) -> usize {
    plan.numel().div_ceil(tile_elems.max(1))
}

/// Tiles a batch of tensors' tile loop should hold at least: the workers wait for each other
/// only at the end of a batch, so small tensors (norms, biases) go together.
const BATCH_TILES: usize = 256;

/// The tile loop of the probe and merge passes: every tile of `tensors`, one tensor after the
/// other, read for the base and the tensor's agents and handed to `visit` with (index in
/// `tensors`, tile index, first element) on the workers `run_workers` starts (the backend's,
/// [`Backend::run_workers`], or the CPU's for statistics); with `stride` > 1 only tiles 0,
/// `stride`, 2·`stride`, … (a sample). Each worker has its own tile buffers and a `state` from
/// `init`, and takes tile after tile, so reading, computing and writing a tile happen on one
/// core while its bytes are in cache, and the cores wait for each other only at the end. Tiles
/// start in order and finish in any order. Returns the workers' states; on failure, the error of
/// the earliest failing tile (the tiles before it all ran, so the same input always reports the
/// same error).
#[allow(clippy::too_many_arguments)]
fn par_tiles<S: Send>(
    inputs: &Inputs,
    tensors: &[TensorTiles],
    scan_nonfinite: bool,
    run_workers: &dyn Fn(&(dyn Fn() + Sync)),
    progress: &ProgressBar,
    stride: usize,
    init: impl Fn() -> S + Sync,
    visit: impl Fn(&mut S, usize, usize, u64, &Tile) -> Result<()> + Sync,
) -> Result<Vec<S>> {
    // The first tile of each tensor in the loop's numbering, then the end.
    let firsts: Vec<usize> = std::iter::once(0)
        .chain(tensors.iter().scan(0, |end, t| {
            *end += t.count();
            Some(*end)
        }))
        .collect();
    let count = *firsts.last().expect("one entry at least");
    let next = AtomicUsize::new(0);
    let failed = AtomicBool::new(false);
    let first_error: Mutex<Option<(usize, anyhow::Error)>> = Mutex::new(None);
    let states = Mutex::new(Vec::new());
    let worker = || {
        let mut buffers = TileBuffers::new(inputs.agents.len());
        let mut state = init();
        loop {
            let g = next.fetch_add(1, Ordering::Relaxed) * stride;
            if g >= count || failed.load(Ordering::Relaxed) {
                break;
            }
            let j = firsts.partition_point(|&f| f <= g) - 1;
            let TensorTiles {
                plan,
                present,
                tile_elems,
            } = tensors[j];
            let (i, step, numel) = (g - firsts[j], tile_elems.max(1), plan.numel());
            let (start, len) = (i * step, step.min(numel - i * step));
            let done = buffers.visit(
                inputs,
                plan,
                present,
                (start, len),
                scan_nonfinite,
                false,
                |tile| visit(&mut state, j, i, start as u64, tile),
            );
            match done {
                Ok(()) => {
                    progress.inc((len * plan.base.entry.dtype.size() * (1 + present.len())) as u64)
                }
                Err(e) => {
                    failed.store(true, Ordering::Relaxed);
                    let mut first = first_error.lock().unwrap_or_else(|p| p.into_inner());
                    if first.as_ref().is_none_or(|(h, _)| g < *h) {
                        *first = Some((g, e));
                    }
                }
            }
        }
        states.lock().unwrap_or_else(|p| p.into_inner()).push(state);
    };
    run_workers(&worker);
    if let Some((_, e)) = first_error.into_inner().unwrap_or_else(|p| p.into_inner()) {
        return Err(e);
    }
    Ok(states.into_inner().unwrap_or_else(|p| p.into_inner()))
}

/// Probes `plans` over all their tiles in one tile loop; each one's counts are indexed by
/// global agent.
fn probe_tensors(
    inputs: &Inputs,
    plans: &[&TensorPlan],
    backend: &dyn Backend,
    pass: &Pass,
    progress: &ProgressBar,
) -> Result<Vec<TileCounts>> {
    let n = inputs.agents.len();
    let presents: Vec<Vec<usize>> = plans.iter().map(|p| p.present()).collect();
    let tensors: Vec<TensorTiles> = plans
        .iter()
        .zip(&presents)
        .map(|(&plan, present)| TensorTiles {
            plan,
            present,
            tile_elems: pass.tile_elems,
        })
        .collect();
    let zeros = || -> Vec<TileCounts> {
        presents
            .iter()
            .map(|p| TileCounts::zeros(p.len()))
            .collect()
    };
    let workers = par_tiles(
        inputs,
        &tensors,
        pass.scan_nonfinite,
        &|w| backend.run_workers(w),
        progress,
        1,
        zeros,
        |sums, j, i, _, tile| {
            let counts = backend.probe(tile, pass.epsilon).with_context(|| {
                format!("probe of tensor '{}' failed at tile {i}", plans[j].name())
            })?;
            sums[j].add(&counts);
            Ok(())
        },
    )?;
    let mut local = zeros();
    for sums in &workers {
        for (l, s) in local.iter_mut().zip(sums) {
            l.add(s);
        }
    }
    // Spread the present agents' rows into the N-wide global layout.
    Ok(local
        .iter()
        .zip(&presents)
        .map(|(local, present)| {
            let mut global = TileCounts::zeros(n);
            for (slot, &t) in present.iter().enumerate() {
                global.hist[t * n..t * n + present.len()].copy_from_slice(local.row(slot));
            }
            global
        })
        .collect())
}

/// Consecutive runs of `plans` of [`BATCH_TILES`] tiles or more (the last may hold fewer).
fn batches(plans: &[TensorPlan], tile_elems: usize) -> Vec<std::ops::Range<usize>> {
    let mut runs = Vec::new();
    let (mut from, mut tiles) = (0, 0);
    for (i, plan) in plans.iter().enumerate() {
        tiles += tile_count(plan, tile_elems);
        if tiles >= BATCH_TILES || i + 1 == plans.len() {
            runs.push(from..i + 1);
            (from, tiles) = (i + 1, 0);
        }
    }
    runs
}

fn progress_bar(total: u64, show: bool, message: &str) -> ProgressBar {
    if !show {
        return ProgressBar::hidden();
    }
    let bar = ProgressBar::new(total);
    bar.set_style(
        ProgressStyle::with_template(
            "{msg:>8} [{bar:40}] {bytes}/{total_bytes} {binary_bytes_per_sec} eta {eta}",
        )
        .expect("valid template")
        .progress_chars("=> "),
    );
    bar.set_message(message.to_string());
    bar
}

/// The whole-model probe (SPEC §1): counts per tensor, from which every report and λ derives.
pub fn probe_all(
    inputs: &Inputs,
    backend: &dyn Backend,
    pass: &Pass,
    show_progress: bool,
) -> Result<ProbeReport> {
    inputs.refuse_base_as_agent()?;
    let bar = progress_bar(inputs.pass_bytes(), show_progress, "probe");
    let mut tensors = Vec::with_capacity(inputs.tensors.len());
    for run in batches(&inputs.tensors, pass.tile_elems) {
        let plans: Vec<&TensorPlan> = inputs.tensors[run].iter().collect();
        let counts = probe_tensors(inputs, &plans, backend, pass, &bar)?;
        for (plan, counts) in plans.into_iter().zip(counts) {
            tensors.push(TensorStats::new(plan, counts));
        }
    }
    bar.finish_and_clear();
    inputs.check_unchanged()?;
    Ok(ProbeReport {
        agents: inputs.agent_labels(),
        epsilon: pass.epsilon,
        tensor_count: tensors.len(),
        tensors,
    })
}

/// Everything a merge needs besides the inputs and the backend.
#[derive(Clone, Debug)]
pub struct MergeOptions {
    pub method: Method,
    pub pass: Pass,
    /// `None`: each tensor keeps the base's dtype.
    pub out_dtype: Option<DType>,
    pub shard_size: u64,
    pub force: bool,
    pub show_progress: bool,
    /// Files written beside the weights as given, e.g. the mergekit recipe: (name, text).
    pub extra_files: Vec<(String, String)>,
    /// Paths besides the input models that the output must stay clear of (the recipe file).
    pub protect: Vec<PathBuf>,
}

/// What a finished merge reports.
pub struct MergeSummary {
    pub recipe: Recipe,
    pub shards: Vec<String>,
    pub report: Option<ProbeReport>,
}

/// Fisher merging's second input: each merged model's diagonal Fisher, a folder of safetensors
/// with the model's tensor names and shapes (any of bf16, f16, f32).
struct FisherInputs {
    folders: Vec<ModelFolder>,
}

impl FisherInputs {
    /// Opens every model's Fisher folder and checks it has each tensor that model merges.
    fn open(config: &MethodConfig, inputs: &Inputs) -> Result<FisherInputs> {
        let folders = config
            .fisher_folders(inputs.agents.len())?
            .iter()
            .map(|d| ModelFolder::open(d).context("cannot open a Fisher folder"))
            .collect::<Result<Vec<_>>>()?;
        for plan in &inputs.tensors {
            for t in plan.present() {
                let f = &folders[t];
                let Some(ft) = f.get(plan.name()) else {
                    bail!(
                        "tensor '{}' is missing in the Fisher folder {} (model {})",
                        plan.name(),
                        f.dir.display(),
                        t + 1
                    );
                };
                ensure!(
                    ft.entry.shape == plan.base.entry.shape,
                    "tensor '{}' in {} has shape {}, but the model's is {}",
                    plan.name(),
                    f.file_of(ft).display(),
                    shape_text(&ft.entry.shape),
                    shape_text(&plan.base.entry.shape)
                );
            }
        }
        Ok(FisherInputs { folders })
    }

    /// The coefficient rows of elements `start..start + len` of `plan` (see
    /// [`crate::method::combine::fisher_coefs`]); λ is the spec's tensor row.
    fn tile_coefs(
        &self,
        plan: &TensorPlan,
        present: &[usize],
        spec: &CombineSpec,
        (start, len): (u64, usize),
        out: &mut Vec<f32>,
    ) -> Result<()> {
        let fisher = present
            .iter()
            .map(|&t| {
                let f = &self.folders[t];
                let ft = f.get(plan.name()).expect("checked at open");
                let size = ft.entry.dtype.size();
                let mut bytes = vec![0u8; len * size];
                f.read(ft, start * size as u64, &mut bytes)?;
                let mut values = vec![0.0f32; len];
                decode(ft.entry.dtype, &bytes, &mut values);
                Ok(values)
            })
            .collect::<Result<Vec<_>>>()?;
        let lambdas: Vec<f64> = spec.coefs[1..=present.len()]
            .iter()
            .map(|&l| l as f64)
            .collect();
        fisher_coefs(&lambdas, &fisher, len, out);
        Ok(())
    }
}

/// A tensor of the merge pass, its rule known, in its batch of tiles.
struct MergeJob<'a> {
    /// Index in the plan and the output.
    index: usize,
    plan: &'a TensorPlan,
    present: Vec<usize>,
    tile_elems: usize,
    rule: TileRule,
}

/// How one tensor's tiles are merged.
enum TileRule {
    /// RAM / RAM+ with these λ of the present agents.
    Ram(Vec<f32>),
    /// A mergekit-family method.
    Combine(CombineSpec),
    /// No merged model has the tensor: the base's values.
    Base,
}

/// The base's values in the output dtype (a tensor no merged model has); same dtype: its bits.
fn pass_base(tile: &Tile, out_dtype: DType, out: &mut [u8]) {
    if out_dtype == tile.dtype {
        out.copy_from_slice(tile.base);
    } else {
        let mut values = vec![0.0f32; tile.len];
        decode(tile.dtype, tile.base, &mut values);
        encode(out_dtype, &values, out);
    }
}

/// The output policy (README "Values"): a merged value that is NaN or ±Inf where every input of
/// that element is finite is an error naming the tensor and element — an overflow of the method's
/// arithmetic or of the output dtype, never silently written. Where an input is not finite itself
/// (`--allow-nonfinite`), IEEE rules decide and the value is kept.
fn check_finite_output(
    tile: &Tile,
    out_dtype: DType,
    out: &[u8],
    name: &str,
    start: u64,
    allow_nonfinite: bool,
) -> Result<()> {
    let size = out_dtype.size();
    let mut from = 0;
    while let Some(k) = first_nonfinite(out_dtype, &out[from * size..]) {
        let e = from + k;
        let inputs_finite = std::iter::once(tile.base)
            .chain(tile.agents.iter().copied())
            .all(|bytes| decode_one(tile.dtype, bytes, e).is_finite());
        if inputs_finite {
            let max = match out_dtype {
                DType::BF16 => "3.39e38",
                DType::F16 => "65504",
                DType::F32 => "3.40e38",
            };
            bail!(
                "merged tensor '{}' has a non-finite value ({}) at element {}, where every input is \
                 finite: the method's parameters overflow, or the result exceeds the output dtype \
                 {out_dtype} (largest finite value {max}){}",
                crate::error::printable(name),
                decode_one(out_dtype, out, e),
                start + e as u64,
                if allow_nonfinite {
                    ", or a NaN/Inf elsewhere in the tensor entered a statistic of the method \
                     (norms, angles)"
                } else {
                    ""
                }
            );
        }
        from = e + 1;
    }
    Ok(())
}

/// `tile_elems` rounded down to whole rows of `row_len` (at least one row; 0: no rows).
fn whole_rows(tile_elems: usize, row_len: u64) -> usize {
    match row_len as usize {
        0 => tile_elems,
        r => (tile_elems - tile_elems % r).max(r),
    }
}

/// Each present agent's DELLA row ranks over a tile of whole rows (empty when the rule needs none).
fn tile_ranks(tile: &Tile, spec: &CombineSpec) -> Vec<Vec<u32>> {
    if spec.rank_rows == 0 {
        return Vec::new();
    }
    let mut base = vec![0.0f32; tile.len];
    decode(tile.dtype, tile.base, &mut base);
    tile.agents
        .par_iter()
        .map(|bytes| {
            let mut v = vec![0.0f32; tile.len];
            decode(tile.dtype, bytes, &mut v);
            if spec.delta {
                v.iter_mut().zip(&base).for_each(|(x, b)| *x -= b);
            }
            let mut ranks = Vec::new();
            row_ranks(&v, spec.rank_rows as usize, &mut ranks);
            ranks
        })
        .collect()
}

/// Elements per tile of a statistics scan, at least.
const SCAN_TILE_ELEMS: usize = 1 << 20;

/// One tensor's combine rule: its settings resolved, then the statistics it needs gathered by
/// scans over its tiles (on the CPU, in element order, so every backend merges with the same rule).
fn combine_spec(
    inputs: &Inputs,
    plan: &TensorPlan,
    config: &MethodConfig,
    at: TensorPlace,
    present: &[usize],
    pass: &Pass,
    buffers: &mut TileBuffers,
) -> Result<CombineSpec> {
    let numel = plan.numel() as u64;
    let recipe = config
        .tensor_recipe(at, numel, present)
        .with_context(|| format!("tensor '{}'", plan.name()))?;
    ensure!(
        numel <= u32::MAX as u64,
        "tensor '{}' has {numel} elements; {} indexes elements with 32 bits",
        plan.name(),
        config.kind.name()
    );
    let rank_rows = statistics::rank_rows(&recipe, numel, &plan.base.entry.shape)
        .with_context(|| format!("tensor '{}'", plan.name()))?;
    let mut scans = TensorScans {
        inputs,
        plan,
        present,
        // Larger tiles than the merge's: fewer parallel steps (the merge pass scans for NaN/Inf).
        pass: Pass {
            scan_nonfinite: false,
            tile_elems: whole_rows(pass.tile_elems.max(SCAN_TILE_ELEMS), rank_rows),
            ..pass.clone()
        },
        buffers,
    };
    statistics::build_spec(
        &recipe,
        numel,
        &plan.base.entry.shape,
        config.seed,
        plan.name(),
        present,
        &mut scans,
    )
    .with_context(|| format!("statistics of tensor '{}'", plan.name()))
}

/// The statistics scans of one tensor, over the same tile reads as the merge pass.
struct TensorScans<'a> {
    inputs: &'a Inputs,
    plan: &'a TensorPlan,
    present: &'a [usize],
    pass: Pass,
    buffers: &'a mut TileBuffers,
}

impl TensorScans<'_> {
    /// The tensor's tiles in order, read as the merge pass reads them (no progress shown).
    fn each_tile(
        &mut self,
        from: u64,
        visit: impl FnMut(usize, u64, &Tile) -> Result<ControlFlow<()>>,
    ) -> Result<()> {
        let hidden = ProgressBar::hidden();
        // A scan from within the tensor looks for something near `from`: chunk-sized tiles.
        let pass = Pass {
            tile_elems: if from > 0 {
                SCAN_CHUNK
            } else {
                self.pass.tile_elems
            },
            ..self.pass.clone()
        };
        for_each_tile(
            self.inputs,
            self.plan,
            self.present,
            &pass,
            self.buffers,
            &hidden,
            from,
            visit,
        )
    }
}

/// The f32 rows of one scan chunk: the base's, then one agent's values and task vector.
struct ScanRows {
    base: [f32; SCAN_CHUNK],
    x: [f32; SCAN_CHUNK],
    tau: [f32; SCAN_CHUNK],
}

impl ScanRows {
    fn new() -> Box<ScanRows> {
        Box::new(ScanRows {
            base: [0.0; SCAN_CHUNK],
            x: [0.0; SCAN_CHUNK],
            tau: [0.0; SCAN_CHUNK],
        })
    }

    /// Decodes the base's elements `cs..cs + cl` of the tile.
    fn load_base(&mut self, tile: &Tile, (cs, cl): (usize, usize)) {
        let size = tile.dtype.size();
        decode(
            tile.dtype,
            &tile.base[cs * size..(cs + cl) * size],
            &mut self.base[..cl],
        );
    }

    /// Agent `t`'s values over the same elements: τ (after [`Self::load_base`]) with `delta`,
    /// else θ.
    fn values(&mut self, tile: &Tile, t: usize, (cs, cl): (usize, usize), delta: bool) -> &[f32] {
        let size = tile.dtype.size();
        let bytes = &tile.agents[t][cs * size..(cs + cl) * size];
        if delta {
            decode_minus(tile.dtype, bytes, &self.base[..cl], &mut self.tau[..cl]);
            &self.tau[..cl]
        } else {
            decode(tile.dtype, bytes, &mut self.x[..cl]);
            &self.x[..cl]
        }
    }

    /// Agent `t`'s chunk over the same elements (after [`Self::load_base`]); the tile starts at
    /// element `start` of the tensor.
    fn agent(
        &mut self,
        tile: &Tile,
        t: usize,
        start: u64,
        (cs, cl): (usize, usize),
    ) -> AgentChunk<'_> {
        let size = tile.dtype.size();
        let bytes = &tile.agents[t][cs * size..(cs + cl) * size];
        decode(tile.dtype, bytes, &mut self.x[..cl]);
        decode_minus(tile.dtype, bytes, &self.base[..cl], &mut self.tau[..cl]);
        AgentChunk {
            start: start + cs as u64,
            base: &self.base[..cl],
            x: &self.x[..cl],
            tau: &self.tau[..cl],
        }
    }
}

/// Elements per tile of an any-order statistics scan: a multiple of [`SCAN_CHUNK`], small enough
/// that a worker's tile stays in its core's cache from the read to the last agent's chunk.
const ANY_ORDER_TILE_ELEMS: usize = 1 << 16;

impl Scans for TensorScans<'_> {
    fn workers(&self) -> usize {
        rayon::current_num_threads()
    }

    fn any_order(&mut self, every: usize, delta: bool, visit: &AnyOrderVisit) -> Result<()> {
        let workers = self.workers();
        let ids = AtomicUsize::new(0);
        let tensor = TensorTiles {
            plan: self.plan,
            present: self.present,
            tile_elems: ANY_ORDER_TILE_ELEMS,
        };
        par_tiles(
            self.inputs,
            &[tensor],
            self.pass.scan_nonfinite,
            &|w| {
                rayon::broadcast(|_| w());
            },
            &ProgressBar::hidden(),
            every.max(1),
            || {
                let id = ids.fetch_add(1, Ordering::Relaxed);
                debug_assert!(id < workers);
                (id, ScanRows::new())
            },
            |(id, rows), _, _, start, tile| {
                for chunk in ranges(tile.len, SCAN_CHUNK) {
                    if delta {
                        rows.load_base(tile, chunk);
                    }
                    for t in 0..tile.agents.len() {
                        let v = rows.values(tile, t, chunk, delta);
                        visit(*id, t, start + chunk.0 as u64, v);
                    }
                }
                Ok(())
            },
        )?;
        Ok(())
    }

    fn tiles(&mut self, visit: &mut Visit) -> Result<()> {
        let n = self.present.len();
        let (mut base, mut x, mut tau) = (Vec::new(), vec![Vec::new(); n], vec![Vec::new(); n]);
        self.each_tile(0, |_, start, tile| {
            base.resize(tile.len, 0.0);
            decode(tile.dtype, tile.base, &mut base);
            let base_values = &base;
            x.par_iter_mut()
                .zip(tau.par_iter_mut())
                .zip(tile.agents.par_iter())
                .for_each(|((x, tau), bytes)| {
                    x.resize(tile.len, 0.0);
                    decode(tile.dtype, bytes, x);
                    tau.clear();
                    tau.extend(x.iter().zip(base_values).map(|(a, b)| a - b));
                });
            visit(&Values {
                start,
                base: &base,
                x: &x,
                tau: &tau,
            })
        })
    }

    fn per_agent(&mut self, from: u64, visit: &AgentVisit) -> Result<()> {
        let mut done = vec![false; self.present.len()];
        self.each_tile(from, |_, start, tile| {
            let flows: Vec<bool> = (0..done.len())
                .into_par_iter()
                .map(|t| {
                    if done[t] {
                        return true;
                    }
                    let mut rows = ScanRows::new();
                    let chunks = ranges(tile.len, SCAN_CHUNK);
                    for chunk in chunks.skip_while(|(cs, cl)| start + ((cs + cl) as u64) <= from) {
                        rows.load_base(tile, chunk);
                        if visit(t, &rows.agent(tile, t, start, chunk)).is_break() {
                            return true;
                        }
                    }
                    false
                })
                .collect();
            for (d, f) in done.iter_mut().zip(flows) {
                *d |= f;
            }
            Ok(if done.iter().all(|&d| d) {
                ControlFlow::Break(())
            } else {
                ControlFlow::Continue(())
            })
        })
    }
}

/// Runs the merge into `out_dir`, which appears only when everything is written.
pub fn merge(
    inputs: &Inputs,
    options: &MergeOptions,
    backend: &dyn Backend,
    out_dir: &Path,
) -> Result<MergeSummary> {
    let n = inputs.agents.len();
    if options.method.uses_base() {
        inputs.refuse_base_as_agent()?;
    }
    check_base_config(&inputs.base.dir)?;
    let fisher = match &options.method {
        Method::Combine(c) if c.kind == Kind::Fisher => Some(FisherInputs::open(c, inputs)?),
        _ => None,
    };
    let mut protect = inputs.paths();
    if let Some(f) = &fisher {
        protect.extend(f.folders.iter().flat_map(ModelFolder::paths));
    }
    protect.extend(options.protect.iter().cloned());
    let folder = OutputFolder::create(out_dir, options.force, &protect)?;
    let global_report = if options.method.needs_global_probe() {
        let mut report = probe_all(inputs, backend, &options.pass, options.show_progress)?;
        // A merge reports totals and modules only: one entry per module, not per tensor.
        report.compact();
        Some(report)
    } else {
        None
    };
    let global_counts: Option<Vec<AgentCounts>> =
        global_report.as_ref().map(|r| r.total_agent_counts());
    let global_lambdas: Vec<f64> = match &global_counts {
        Some(counts) => counts.iter().map(|&c| options.method.lambda(c)).collect(),
        None => vec![1.0; n],
    };

    let out_tensors: Vec<OutputTensor> = inputs
        .tensors
        .iter()
        .map(|p| OutputTensor {
            name: p.base.entry.name.clone(),
            dtype: options.out_dtype.unwrap_or(p.base.entry.dtype),
            shape: p.base.entry.shape.clone(),
        })
        .collect();
    let out_dtypes: Vec<DType> = out_tensors.iter().map(|t| t.dtype).collect();
    let writer = CheckpointWriter::new(folder.path(), out_tensors, options.shard_size)?;
    let per_tensor_scope = matches!(
        options.method,
        Method::RamPlus {
            scope: BoostScope::Tensor,
            ..
        }
    );
    let scan_bytes = inputs.pass_bytes() * if per_tensor_scope { 2 } else { 1 };
    // RAM+ probes every tensor before merging it (globally or just before), and inputs cannot
    // change unnoticed, so the merge pass need not scan the same bytes for NaN/Inf again.
    let merge_pass = Pass {
        scan_nonfinite: options.pass.scan_nonfinite && options.method.boost().is_none(),
        ..options.pass.clone()
    };
    let bar = progress_bar(scan_bytes, options.show_progress, "merge");
    let mut buffers = TileBuffers::new(n);
    let mut tensor_lambdas = Vec::new();
    // Tensor scope: the report a merge gives is per module (see `ProbeReport::compact`), so the
    // probed tensors' counts are folded in as they come.
    let (mut tensor_stats, mut tensor_count) = (Vec::new(), 0usize);
    let layers = inputs
        .tensors
        .iter()
        .filter_map(|t| layer_index(t.name()))
        .max()
        .map_or(0, |m| m + 1);
    // Tensors go in batches: each one's rule first (with the scans its statistics take), then
    // the batch's tiles in one loop, so the workers wait for each other once per batch.
    let merge_tiles = |jobs: &[MergeJob]| -> Result<()> {
        let tensors: Vec<TensorTiles> = jobs
            .iter()
            .map(|job| TensorTiles {
                plan: job.plan,
                present: &job.present,
                tile_elems: job.tile_elems,
            })
            .collect();
        par_tiles(
            inputs,
            &tensors,
            merge_pass.scan_nonfinite,
            &|w| backend.run_workers(w),
            &bar,
            1,
            Vec::new,
            |out, j, i, start, tile| {
                let MergeJob {
                    index,
                    plan,
                    present,
                    rule,
                    ..
                } = &jobs[j];
                let out_dtype = out_dtypes[*index];
                out.resize(tile.len * out_dtype.size(), 0);
                let out = &mut out[..tile.len * out_dtype.size()];
                match rule {
                    TileRule::Base => {
                        pass_base(tile, out_dtype, out);
                        Ok(())
                    }
                    TileRule::Ram(lambdas) => {
                        let params = MergeParams {
                            epsilon: options.pass.epsilon,
                            lambdas,
                            out_dtype,
                        };
                        backend.merge(tile, &params, out)
                    }
                    TileRule::Combine(spec) => {
                        let ranks = tile_ranks(tile, spec);
                        let mut coefs = Vec::new();
                        if let Some(f) = &fisher {
                            f.tile_coefs(plan, present, spec, (start, tile.len), &mut coefs)?;
                        }
                        let params = CombineParams {
                            spec,
                            start,
                            out_dtype,
                            ranks: &ranks,
                            coefs: &coefs,
                        };
                        backend.combine(tile, &params, out)
                    }
                }
                .with_context(|| format!("merge of tensor '{}' failed at tile {i}", plan.name()))?;
                check_finite_output(
                    tile,
                    out_dtype,
                    out,
                    plan.name(),
                    start,
                    !options.pass.scan_nonfinite,
                )?;
                writer.write_at(*index, start * out_dtype.size() as u64, out)
            },
        )?;
        Ok(())
    };
    // What each tile of a tensor goes through, with the scans its statistics take.
    let mut rule_of = |plan: &TensorPlan, present: &[usize]| -> Result<TileRule> {
        Ok(match &options.method {
            Method::Combine(_) if present.is_empty() => TileRule::Base,
            Method::Combine(config) => {
                let at = TensorPlace {
                    name: plan.name(),
                    t: layer_t(layer_index(plan.name()), layers),
                };
                TileRule::Combine(combine_spec(
                    inputs,
                    plan,
                    config,
                    at,
                    present,
                    &options.pass,
                    &mut buffers,
                )?)
            }
            _ => {
                let lambdas: Vec<f64> = if per_tensor_scope {
                    let counts =
                        probe_tensors(inputs, &[plan], backend, &options.pass, &bar)?.remove(0);
                    let stats = TensorStats::new(plan, counts);
                    let lambdas: Vec<f64> = stats
                        .agent_counts()
                        .iter()
                        .map(|&c| options.method.lambda(c))
                        .collect();
                    tensor_lambdas.push((plan.base.entry.name.clone(), lambdas.clone()));
                    tensor_stats.push(stats);
                    tensor_count += 1;
                    if tensor_stats.len() >= 4096 {
                        tensor_stats = crate::report::compact(std::mem::take(&mut tensor_stats));
                    }
                    lambdas
                } else {
                    global_lambdas.clone()
                };
                TileRule::Ram(present.iter().map(|&t| lambdas[t] as f32).collect())
            }
        })
    };
    for run in batches(&inputs.tensors, merge_pass.tile_elems) {
        let mut jobs = Vec::with_capacity(run.len());
        for index in run {
            let plan = &inputs.tensors[index];
            let present = plan.present();
            let rule = rule_of(plan, &present)?;
            // DELLA ranks whole rows: its tiles hold whole rows.
            let tile_elems = match &rule {
                TileRule::Combine(spec) if spec.rank_rows > 0 => {
                    whole_rows(merge_pass.tile_elems, spec.rank_rows)
                }
                _ => merge_pass.tile_elems,
            };
            jobs.push(MergeJob {
                index,
                plan,
                present,
                tile_elems,
                rule,
            });
        }
        merge_tiles(&jobs)?;
    }
    bar.finish_and_clear();
    let shards = writer.finish()?;

    let report = match global_report {
        Some(r) => Some(r),
        None if per_tensor_scope => Some(ProbeReport {
            agents: inputs.agent_labels(),
            epsilon: options.pass.epsilon,
            tensor_count,
            tensors: crate::report::compact(tensor_stats),
        }),
        None => None,
    };
    let agent_counts = report.as_ref().map(|r| r.total_agent_counts());
    let agents = inputs
        .agents
        .iter()
        .enumerate()
        .map(|(t, a)| AgentSummary {
            path: a.dir.display().to_string(),
            lambda: if per_tensor_scope {
                None
            } else {
                Some(global_lambdas[t])
            },
            counts: agent_counts.as_ref().map(|c| c[t]),
        })
        .collect();
    let out_dtype = options
        .out_dtype
        .or_else(|| inputs.base.main_dtype())
        .unwrap_or(DType::F32);
    let mut outputs = shards;
    for name in copy_base_files(&inputs.base.dir, folder.path(), out_dtype)? {
        outputs.push(crc32_of_file(&folder.path().join(name))?);
    }
    for (name, text) in &options.extra_files {
        let path = folder.path().join(name);
        std::fs::write(&path, text).with_context(|| format!("cannot write {}", path.display()))?;
        outputs.push(crc32_of_file(&path)?);
    }
    // Tensors were hashed as they were read; only what the merge never read is read now.
    let input_sums = std::iter::once(&inputs.base)
        .chain(&inputs.agents)
        .map(|m| {
            Ok(InputChecksums {
                path: std::fs::canonicalize(&m.dir).unwrap_or_else(|_| m.dir.clone()),
                files: m.checksums()?,
            })
        })
        .collect::<Result<Vec<_>>>()?;
    let recipe = Recipe {
        tool: "rlmerge".into(),
        version: env!("CARGO_PKG_VERSION").into(),
        method: options.method.clone(),
        epsilon: options.pass.epsilon,
        allow_nonfinite: !options.pass.scan_nonfinite,
        base: inputs.base.dir.display().to_string(),
        agents,
        tensor_lambdas,
        out_dtype: options.out_dtype.map(|d| d.to_string()),
        shard_size: options.shard_size,
        warnings: inputs
            .warnings
            .iter()
            .cloned()
            .chain(identical_inputs(&input_sums, options.method.uses_base()))
            .collect(),
        inputs: input_sums,
        outputs,
    };
    recipe::write(folder.path(), &recipe)?;
    inputs.check_unchanged()?;
    folder.commit()?;
    Ok(MergeSummary {
        shards: recipe.shards().map(|f| f.file.clone()).collect(),
        recipe,
        report,
    })
}
