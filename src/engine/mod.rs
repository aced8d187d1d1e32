//! The merge job: validate inputs against the base, cut every tensor into tiles, run the probe pass
//! (whole model for global RAM+, per tensor for tensor scope) and the merge pass through a
//! [`Backend`], and stream the merged bytes into the output checkpoint.

use crate::backend::{Backend, TileCounts};
use crate::checkpoint::folder_files::check_base_config;
use crate::checkpoint::{CheckpointWriter, DType, ModelFolder, OutputFolder, OutputTensor};
use crate::inputs::{Inputs, TensorPlan};
use crate::method::settings::{layer_t, TensorPlace};
use crate::method::{BoostScope, Kind, Merging, Method};
use crate::record::MergeRecord;
use crate::report::{boost_group, ProbeReport, TensorStats};
use anyhow::{Context, Result};
use indicatif::ProgressBar;
pub(crate) use progress::progress_bar;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// How a pass walks the tensors (both passes share it).
#[derive(Clone, Debug)]
pub struct PassOptions {
    /// RAM's ε: an element is changed when |θ_t − θ₀| > ε (SPEC §1).
    pub epsilon: f32,
    /// Elements per tile (the backend's preference unless set; results do not depend on it).
    pub tile_elems: usize,
    /// Fail on NaN/±Inf in any input tile. Off when the user allows them (`--allow-nonfinite`:
    /// merged by IEEE rules), and in a merge pass after a probe pass already scanned every byte.
    pub scan_nonfinite: bool,
}

mod boost_rounding;
mod calibrate;
mod configs;
mod fisher;
mod output;
mod probe;
mod progress;
mod retention;
mod scans;
mod spectral;
mod tile_rule;
mod tile_size;
mod tiles;

use boost_rounding::{BoostRounding, RoundingScratch};
pub use configs::config_choice;
use fisher::FisherInputs;
use output::{check_finite_output, finish};
pub use probe::probe_all;
use probe::{probe_tensors, to_global};
pub use retention::{retention, RegionSums, Retention, REGIONS};
use scans::{combine_spec, ScanBuffers};
use spectral::spectral_update;
use tile_rule::{TileRule, TileScratch};
pub use tile_size::tile_elems;
use tiles::{batches, par_tiles, run_bytes, whole_rows, TensorTiles, TileLoop, WriteRun};

impl PassOptions {
    /// The defaults: ε = 1e-5 (SPEC §1), the backend's tile size, NaN/±Inf inputs refused.
    pub fn default_for(backend: &dyn Backend) -> PassOptions {
        PassOptions {
            epsilon: crate::method::DEFAULT_EPSILON,
            tile_elems: backend.preferred_tile_elems(),
            scan_nonfinite: true,
        }
    }
}

impl MergeOptions {
    /// `merging` with every other option at the command line's default: the [`PassOptions`]
    /// defaults, each tensor in the base's dtype, 5 GB shards, no replacing, no progress bar, no
    /// extra file.
    pub fn new(merging: Merging, backend: &dyn Backend) -> MergeOptions {
        MergeOptions {
            merging,
            pass: PassOptions::default_for(backend),
            out_dtype: None,
            shard_size: crate::checkpoint::writer::DEFAULT_SHARD_SIZE,
            force: false,
            show_progress: false,
            extra_files: Vec::new(),
            protect: Vec::new(),
            warnings: Vec::new(),
            config_from: None,
            stages: Vec::new(),
            scratch_stages: Vec::new(),
            chat_template: None,
        }
    }
}

/// Everything a merge needs besides the inputs and the backend.
#[derive(Clone, Debug)]
pub struct MergeOptions {
    /// The method, validated, with its parameters, and SVC's calibration where asked.
    pub merging: Merging,
    /// How the passes read the inputs.
    pub pass: PassOptions,
    /// `None`: each tensor keeps the base's dtype.
    pub out_dtype: Option<DType>,
    /// Largest output shard in bytes.
    pub shard_size: u64,
    /// Replace an existing output folder (only one rlmerge wrote, or an empty one).
    pub force: bool,
    /// Progress bars on stderr.
    pub show_progress: bool,
    /// Files written beside the weights as given, e.g. the mergekit recipe: (name, text).
    pub extra_files: Vec<(String, String)>,
    /// Paths besides the input models that the output must stay clear of (the recipe file, a
    /// tokenizer source).
    pub protect: Vec<PathBuf>,
    /// Warnings the front end gave before the merge (an agent that looks dense), kept in the
    /// record after the inputs' own.
    pub warnings: Vec<String>,
    /// Whose config.json the output takes (`None`: the base's, refused where an agent's differs
    /// in a key that changes how the weights are used; see [`config_choice`]).
    pub config_from: Option<crate::slices::Source>,
    /// A multi-stage recipe's earlier stages, for the record.
    pub stages: Vec<crate::record::StageRecord>,
    /// Those of them made in scratch (name, folder), which the record names `stage:NAME`.
    pub scratch_stages: Vec<(String, PathBuf)>,
    /// The chat template the output's tokenizer_config.json takes (a recipe's `chat_template`).
    pub chat_template: Option<String>,
}

/// What a finished merge reports.
pub struct MergeSummary {
    /// The record written into the output folder (`rlmerge_record.json`).
    pub record: MergeRecord,
    /// The weight files written, in order.
    pub shards: Vec<String>,
    /// RAM's probe counts per agent and module, when a probe ran.
    pub report: Option<ProbeReport>,
    /// What a user should know about the output's surroundings, not the merge (scratch that
    /// killed runs left beside it): for stderr, not the record.
    pub notes: Vec<String>,
}

/// A tensor of the merge pass, its rule known, in its batch of tiles.
struct TensorJob<'a> {
    /// Index in the plan and the output.
    index: usize,
    plan: &'a TensorPlan,
    present: Vec<usize>,
    tile_elems: usize,
    rule: TileRule,
    /// Plain RAM with SVC: the counts its kernels gave while the tensor was captured
    /// (`calibrate`), reported instead of the calibrated rule's none.
    captured_counts: Option<TileCounts>,
}

/// Runs the merge into `out_dir`, which appears only when everything is written: the inputs
/// checked, the global probe when λ needs it, each batch of tensors given its rule and merged tile
/// by tile, then the record written and the folder committed.
pub fn merge(
    inputs: &Inputs,
    options: &MergeOptions,
    backend: &dyn Backend,
    out_dir: &Path,
) -> Result<MergeSummary> {
    if options.merging.method.uses_base() {
        inputs.refuse_base_as_agent()?;
    }
    check_base_config(inputs.base.config_dir())?;
    let config_warnings = config_choice(inputs, options.config_from)?;
    let fisher = match &options.merging.method {
        Method::Combine(c) if c.kind == Kind::Fisher => Some(FisherInputs::open(c, inputs)?),
        _ => None,
    };
    let mut protect = inputs.paths();
    if let Some(f) = &fisher {
        protect.extend(f.folders.iter().flat_map(ModelFolder::paths));
    }
    protect.extend(options.protect.iter().cloned());
    let folder = OutputFolder::create(out_dir, options.force, &protect)?;
    let mut global_report = if options.merging.method.needs_global_probe() {
        Some(probe_all(
            inputs,
            backend,
            &options.pass,
            options.show_progress,
        )?)
    } else {
        None
    };
    // Layer and module scope: λ per group, from the per-tensor counts.
    let group_lambdas = match (options.merging.method.scope(), &global_report) {
        (Some(scope), Some(report)) if scope != BoostScope::Global => {
            let ordered: Vec<(String, Vec<f64>)> = report
                .group_agent_counts(scope)
                .into_iter()
                .map(|(g, counts)| {
                    let l = counts
                        .iter()
                        .map(|&c| options.merging.method.lambda(c))
                        .collect();
                    (g, l)
                })
                .collect();
            let index = ordered
                .iter()
                .enumerate()
                .map(|(i, (g, _))| (g.clone(), i))
                .collect();
            Some(GroupLambdas { ordered, index })
        }
        _ => None,
    };
    // A merge reports totals and modules only: one entry per module, not per tensor.
    if let Some(report) = &mut global_report {
        report.compact();
    }
    let global_lambdas: Vec<f64> = match &global_report {
        Some(r) => r
            .total_agent_counts()
            .iter()
            .map(|&c| options.merging.method.lambda(c))
            .collect(),
        None => vec![1.0; inputs.agents.len()],
    };
    let out_tensors: Vec<OutputTensor> = inputs
        .tensors
        .iter()
        .map(|p| OutputTensor {
            name: p.out_name(),
            dtype: options.out_dtype.unwrap_or(p.base.entry.dtype),
            shape: p.shape().clone(),
        })
        .collect();
    let mut pass = MergePass::new(inputs, options, backend, fisher.as_ref(), global_lambdas);
    pass.group_lambdas = group_lambdas;
    let writer = CheckpointWriter::new(folder.path(), out_tensors, options.shard_size)?;
    for run in batches(&inputs.tensors, pass.tile_elems()) {
        let mut jobs = run
            .map(|index| pass.job(index))
            .collect::<Result<Vec<_>>>()?;
        let (counts, rounding) = pass.merge_tiles(&jobs, &writer)?;
        pass.rounding.add(&rounding);
        inputs.forget_lora_matrices();
        if let Some(scope) = &mut pass.counted {
            for (job, counts) in jobs.iter_mut().zip(counts) {
                let counts = job.captured_counts.take().unwrap_or(counts);
                scope.add(probe::tensor_stats(inputs, job.plan, counts));
            }
        }
    }
    pass.bar.finish_and_clear();
    let shards = writer.finish()?;
    let boost = pass.boost_report(global_report);
    let notes = folder.notes().to_vec();
    let made = (config_warnings, backend.kind());
    let summary = finish(inputs, options, boost, shards, folder, made)?;
    Ok(MergeSummary { notes, ..summary })
}

/// A decomposed matrix's arithmetic in the progress bar's units (bytes read): its bytes over
/// every model times min(m, n) / 16 — the decompositions are O(m·n·min(m, n)), and this weight
/// matches their time against reading's on the 1 GiB demo (2 cores: Iso-C's 69 s to about 1 s
/// of reading).
fn decomposition_work(plan: &TensorPlan, agents: usize) -> u64 {
    let shape = plan.shape();
    let small = shape.iter().copied().min().unwrap_or(1) as u64;
    let bytes = (plan.numel() * plan.base.entry.dtype.size() * (1 + agents)) as u64;
    bytes * small.div_ceil(16)
}

/// The merge pass over every tensor: each one's rule, then its tiles through the backend.
struct MergePass<'a> {
    inputs: &'a Inputs,
    options: &'a MergeOptions,
    backend: &'a dyn Backend,
    fisher: Option<&'a FisherInputs>,
    /// How the merge pass reads: RAM+ probes every tensor before merging it (globally or just
    /// before), and inputs cannot change unnoticed, so it need not scan the same bytes for
    /// NaN/Inf again.
    pass: PassOptions,
    bar: ProgressBar,
    buffers: ScanBuffers,
    /// Layers of the model, for gradients over layers.
    layers: usize,
    /// λ of each agent in global scope (1 for RAM and the combine methods).
    global_lambdas: Vec<f64>,
    /// Layer and module scope: λ of each agent per group ([`crate::report::boost_group`]).
    group_lambdas: Option<GroupLambdas>,
    /// Tensor-scope RAM+: per tensor its λ, and the probe's counts (folded per module as they
    /// come: the report a merge gives is per module, see `ProbeReport::compact`).
    per_tensor: Option<TensorGathered>,
    /// Plain RAM: the counts its merge kernels gave with each tile (no probe pass), gathered as
    /// tensor scope gathers its probes'.
    counted: Option<TensorGathered>,
    /// The spectral methods and SVC: matrices decomposed so far, of how many (the progress
    /// bar's message, as the bytes stand still while a matrix is decomposed).
    matrices: (usize, usize),
    /// RAM+: what the output dtype kept of the boost, tallied tile by tile.
    rounding: BoostRounding,
}

/// Layer and module scope: λ per agent for each group, in the report's group order, with an index
/// by group name.
struct GroupLambdas {
    ordered: Vec<(String, Vec<f64>)>,
    index: BTreeMap<String, usize>,
}

/// What tensor-scope RAM+ (and plain RAM, without λ) gathers tensor by tensor.
#[derive(Default)]
struct TensorGathered {
    lambdas: Vec<(std::sync::Arc<str>, Vec<f64>)>,
    stats: Vec<TensorStats>,
    count: usize,
}

impl TensorGathered {
    /// One more tensor's counts, folded per module every few thousand tensors.
    fn add(&mut self, stats: TensorStats) {
        self.stats.push(stats);
        self.count += 1;
        if self.stats.len() >= 4096 {
            self.stats = crate::report::compact(std::mem::take(&mut self.stats));
        }
    }

    /// The report of the tensors gathered.
    fn report(self, agents: Vec<String>, epsilon: f32) -> ProbeReport {
        ProbeReport {
            agents,
            epsilon,
            tensor_count: self.count,
            tensors: crate::report::compact(self.stats),
        }
    }
}

/// What a merge found about each agent's λ: the record's per-agent lines and the report.
struct BoostReport {
    report: Option<ProbeReport>,
    global_lambdas: Vec<f64>,
    tensor_lambdas: Option<Vec<(std::sync::Arc<str>, Vec<f64>)>>,
    /// Layer and module scope: λ per group.
    group_lambdas: Option<Vec<(String, Vec<f64>)>>,
    /// RAM+: the boosted elements the output dtype rounded back to plain RAM's value.
    rounding: Option<BoostRounding>,
}

impl<'a> MergePass<'a> {
    fn new(
        inputs: &'a Inputs,
        options: &'a MergeOptions,
        backend: &'a dyn Backend,
        fisher: Option<&'a FisherInputs>,
        global_lambdas: Vec<f64>,
    ) -> MergePass<'a> {
        let per_tensor = matches!(
            options.merging.method,
            Method::RamPlus {
                scope: BoostScope::Tensor,
                ..
            }
        );
        let scan_bytes = inputs.pass_bytes() * if per_tensor { 2 } else { 1 };

        let decomposed: Vec<&TensorPlan> = inputs
            .tensors
            .iter()
            .filter(|p| spectral::is_decomposed(&options.merging, p))
            .collect();
        let arithmetic: u64 = decomposed
            .iter()
            .map(|p| decomposition_work(p, inputs.agents.len()))
            .sum();
        MergePass {
            inputs,
            options,
            backend,
            fisher,
            pass: PassOptions {
                scan_nonfinite: options.pass.scan_nonfinite
                    && options.merging.method.boost().is_none(),
                ..options.pass.clone()
            },
            bar: progress_bar(scan_bytes + arithmetic, options.show_progress, "merge"),
            buffers: ScanBuffers::new(inputs.agents.len()),
            // Gradients run over the decoder's layers (not a tower's blocks, not MTP layers).
            layers: inputs
                .structure
                .decoder_layers(inputs.tensors.iter().map(|t| t.name())),
            global_lambdas,
            group_lambdas: None,
            per_tensor: per_tensor.then(TensorGathered::default),
            counted: matches!(options.merging.method, Method::Ram { .. })
                .then(TensorGathered::default),
            matrices: (0, decomposed.len()),
            rounding: BoostRounding::zeros(inputs.agents.len()),
        }
    }

    fn tile_elems(&self) -> usize {
        self.pass.tile_elems
    }

    /// Tensor `index` with its rule and tile size.
    fn job(&mut self, index: usize) -> Result<TensorJob<'a>> {
        let plan = &self.inputs.tensors[index];
        let present = plan.present();
        let decomposed = spectral::is_decomposed(&self.options.merging, plan);
        if decomposed {
            self.matrices.0 += 1;
            let (done, total) = self.matrices;
            let what = match self.options.merging.svc {
                Some(_) => "svc",
                None => self.options.merging.method.name(),
            };
            self.bar.set_message(format!("{what} {done}/{total}"));
        }
        let rule = self.rule_of(plan, &present)?;
        // Widened tiles: a tile's bytes stay what the pass chose.
        let elems = tile_elems(plan, self.inputs, self.pass.tile_elems);
        // DELLA ranks whole rows: its tiles hold whole rows; a row map's are its blocks of rows.
        let tile_elems = match &rule {
            TileRule::Combine(spec, _) if spec.rank_rows > 0 => whole_rows(elems, spec.rank_rows),
            TileRule::RowMap { .. } => spectral::row_block_elems(plan.shape()),
            _ => elems,
        };
        let mut job = TensorJob {
            index,
            plan,
            present,
            tile_elems,
            rule,
            captured_counts: None,
        };
        if let Some(alpha) = self.options.merging.svc {
            self.calibrate(&mut job, alpha)?;
        }
        if decomposed {
            self.bar
                .inc(decomposition_work(plan, self.inputs.agents.len()));
        }
        Ok(job)
    }

    /// What each tile of a tensor goes through, with the scans its statistics take.
    fn rule_of(&mut self, plan: &TensorPlan, present: &[usize]) -> Result<TileRule> {
        let method = &self.options.merging.method;
        Ok(match method {
            Method::Combine(_) if present.is_empty() => TileRule::Base,
            Method::Combine(config) => {
                let at = match &plan.sliced {
                    Some(s) => TensorPlace {
                        name: plan.name(),
                        t: s.placement.t,
                        slice: Some(s.placement.slice),
                    },
                    None => TensorPlace {
                        name: plan.name(),
                        t: layer_t(
                            self.inputs.structure.part(plan.name()).decoder_layer(),
                            self.layers,
                        ),
                        slice: None,
                    },
                };
                let (inputs, pass, buffers) = (self.inputs, &self.options.pass, &mut self.buffers);
                let backend = self.backend;
                if spectral::decomposes(config.kind) {
                    let mut update = None;
                    self.backend.run_cpu_work(&mut || {
                        update = Some(spectral_update(
                            inputs,
                            plan,
                            config,
                            (at, present),
                            (pass, backend),
                            buffers,
                        ));
                    });
                    match update.expect("the scan ran")? {
                        Some(spectral::Decomposed::Whole(update)) => {
                            return Ok(TileRule::Update(update))
                        }
                        Some(spectral::Decomposed::Rows(map)) => {
                            return Ok(TileRule::RowMap { map, inner: None })
                        }
                        None => {}
                    }
                }
                let mut spec = None;
                self.backend.run_cpu_work(&mut || {
                    spec = Some(combine_spec(
                        inputs, plan, config, at, present, pass, buffers,
                    ));
                });
                let (spec, kept) = spec.expect("the scans ran")?;
                TileRule::Combine(spec, kept)
            }
            _ => {
                let lambdas = if self.per_tensor.is_some() {
                    self.tensor_lambdas(plan)?
                } else if let Some(groups) = &self.group_lambdas {
                    let scope = self.options.merging.method.scope().expect("a boost scope");
                    let part = self.inputs.structure.part(plan.name());
                    let module = crate::names::Module::of(plan.name());
                    let group = boost_group(scope, part, module).expect("a group scope");
                    let i = groups
                        .index
                        .get(&group)
                        .with_context(|| format!("internal: no λ for group {group}"))?;
                    groups.ordered[*i].1.clone()
                } else {
                    self.global_lambdas.clone()
                };
                TileRule::Ram(present.iter().map(|&t| lambdas[t] as f32).collect())
            }
        })
    }

    /// Tensor-scope RAM+: the tensor's probe and the λ of each agent from its counts.
    fn tensor_lambdas(&mut self, plan: &TensorPlan) -> Result<Vec<f64>> {
        let (inputs, pass) = (self.inputs, &self.options.pass);
        let counts = probe_tensors(inputs, &[plan], self.backend, pass, &self.bar)?.remove(0);
        let stats = probe::tensor_stats(inputs, plan, counts);
        let lambdas: Vec<f64> = stats
            .agent_counts()
            .iter()
            .map(|&c| self.options.merging.method.lambda(c))
            .collect();
        let scope = self.per_tensor.as_mut().expect("tensor scope");
        scope.lambdas.push((plan.out_name(), lambdas.clone()));
        scope.add(stats);
        Ok(lambdas)
    }

    /// One batch's tiles in one tile loop, so the workers wait for each other once per batch.
    /// Plain RAM: returns each job's counts (global layout) from its merge kernels.
    fn merge_tiles(
        &self,
        jobs: &[TensorJob],
        writer: &CheckpointWriter,
    ) -> Result<(Vec<TileCounts>, BoostRounding)> {
        let tensors: Vec<TensorTiles> = jobs
            .iter()
            .map(|job| TensorTiles {
                plan: job.plan,
                // A host-computed update needs only the base: the agents were read (and gated)
                // by the scan that computed it.
                present: match job.rule {
                    TileRule::Update(_) => &[],
                    _ => &job.present,
                },
                tile_elems: job.tile_elems,
            })
            .collect();
        let how = TileLoop {
            inputs: self.inputs,
            scan_nonfinite: self.pass.scan_nonfinite,
            run_workers: &|w| self.backend.run_workers(w),
            progress: &self.bar,
            stride: 1,
            last_read: true,
        };
        let limit = run_bytes(how.stride);
        let counting = self.counted.is_some();
        let n = self.inputs.agents.len();
        let zeros = || -> Vec<TileCounts> {
            jobs.iter()
                .map(|job| TileCounts::zeros(if counting { job.present.len() } else { 0 }))
                .collect()
        };
        let mut workers = par_tiles(
            &how,
            &tensors,
            || {
                let rounding = (BoostRounding::zeros(n), RoundingScratch::default());
                (
                    WriteRun::new(limit),
                    zeros(),
                    TileScratch::default(),
                    rounding,
                )
            },
            |(run, counts, scratch, (rounding, rounding_scratch)), j, i, start, tile| {
                let job = &jobs[j];
                let out_dtype = writer.dtype(job.index);
                let len = tile.len * out_dtype.size();
                let at = (job.index, start * out_dtype.size() as u64);
                let out = run.room(writer, at, len)?;
                self.merge_tile(job, tile, start, (out_dtype, out), &mut counts[j], scratch)
                    .with_context(|| {
                        format!("merge of tensor '{}' failed at tile {i}", job.plan.name())
                    })?;
                check_finite_output(
                    tile,
                    out_dtype,
                    out,
                    job.plan.name(),
                    start,
                    !self.options.pass.scan_nonfinite,
                )?;
                if let TileRule::Ram(lambdas) = &job.rule {
                    if BoostRounding::applies(lambdas, out_dtype) {
                        let how = (
                            lambdas.as_slice(),
                            self.pass.epsilon,
                            job.present.as_slice(),
                        );
                        rounding.tally(tile, how, (out_dtype, out), rounding_scratch);
                    }
                }
                run.tile_done(writer, len)
            },
        )?;
        let mut rounding = BoostRounding::zeros(n);
        for (run, _, _, (r, _)) in &mut workers {
            run.flush(writer)?;
            rounding.add(r);
        }
        if !counting {
            return Ok((Vec::new(), rounding));
        }
        let mut local = zeros();
        for (_, counts, _, _) in &workers {
            for (l, c) in local.iter_mut().zip(counts) {
                l.add(c);
            }
        }
        let counts = local
            .iter()
            .zip(jobs)
            .map(|(local, job)| to_global(local, &job.present, n))
            .collect();
        Ok((counts, rounding))
    }

    /// The probe report (global, tensor scope's folded one, or plain RAM's counted one) and the
    /// λ found.
    fn boost_report(self, global: Option<ProbeReport>) -> BoostReport {
        let agents = self.inputs.agent_labels();
        let epsilon = self.options.pass.epsilon;
        let rounding = Some(self.rounding).filter(|r| r.boosted.iter().any(|&b| b > 0));
        match (self.per_tensor, self.counted) {
            (Some(mut scope), _) => BoostReport {
                tensor_lambdas: Some(std::mem::take(&mut scope.lambdas)),
                report: Some(scope.report(agents, epsilon)),
                global_lambdas: self.global_lambdas,
                group_lambdas: None,
                rounding,
            },
            (None, counted) => BoostReport {
                report: global.or_else(|| counted.map(|c| c.report(agents, epsilon))),
                global_lambdas: self.global_lambdas,
                tensor_lambdas: None,
                group_lambdas: self.group_lambdas.map(|g| g.ordered),
                rounding,
            },
        }
    }
}
