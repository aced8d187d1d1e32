//! The merge service: what every front end calls — the command line (`crate::cli`), the
//! Python extension, `verify --against` — to run a merge or an analysis. A front end turns its
//! arguments into a [`Job`] (or an [`Analysis`]) and a [`Compute`], calls here, and prints what
//! comes back and what is said along the way ([`Said`]): the path of one merge is front end →
//! [`merge`] → `engine::merge` → a `Backend` → the writer. The backend a job runs on is chosen
//! here too ([`backend_for`], the library's `--device`), and the engine's options are made here
//! alone ([`merge_options`]).

use crate::backend::cpu::CpuBackend;
use crate::backend::gpu::{AdapterChoice, GpuBackend, GpuContext};
use crate::backend::Backend;
use crate::checkpoint::output_folder::{self, MERGEKIT_CONFIG_FILE};
use crate::engine::{self, MergeOptions, MergeSummary, PassOptions};
use crate::error::{usage, Arg};
use crate::inputs::{Inputs, Layout};
use crate::job::Job;
use crate::method::cost::Cost;
use crate::record::{MergeRecord, StageRecord};
use crate::report::retention::Retention;
use crate::report::ProbeReport;
use crate::vocabulary::TokenizerSettings;
use anyhow::{Context, Result};
use std::path::{Path, PathBuf};

mod recipes;
mod tools;
pub use recipes::{moe_recipe, run_recipe, StageFolder};
pub use tools::{extract_lora, moe};

/// Where the passes run (`--device`, Python's `device=`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Device {
    /// The CPU backend, and a hardware GPU for the spectral methods where there is one.
    Auto,
    /// A GPU adapter, software ones (lavapipe) included; an error if there is none.
    Gpu,
    /// The native CPU backend.
    Cpu,
}

/// How and where a job computes: none of it changes the output's bytes.
#[derive(Clone, Debug)]
pub struct Compute {
    /// Where the passes run.
    pub device: Device,
    /// Worker threads of the CPU backend, its statistics scans included (0: every core).
    pub threads: usize,
    /// Elements per tile (`None`: the backend's preference).
    pub tile_elems: Option<usize>,
    /// Caps the elements of a GPU dispatch chunk.
    pub gpu_chunk_elems: Option<usize>,
    /// Progress on stderr: a bar on a terminal, a line every few seconds elsewhere.
    pub show_progress: bool,
    /// Warn of agents that changed nearly every element (`--allow-dense-agents` turns it off).
    pub warn_dense_agents: bool,
}

impl Compute {
    /// On `device`, with every other choice at its default: every core, the backend's tiles, no
    /// progress, dense agents warned of.
    pub fn on(device: Device) -> Compute {
        Compute {
            device,
            threads: 0,
            tile_elems: None,
            gpu_chunk_elems: None,
            show_progress: false,
            warn_dense_agents: true,
        }
    }

    /// Checks the choices no type can: a tile of at least one element.
    fn check(&self) -> Result<()> {
        if self.tile_elems == Some(0) {
            return Err(usage("--tile-elems must be ≥ 1"));
        }
        Ok(())
    }

    /// How the passes read, for a job of ε `epsilon` on `backend`.
    fn pass(&self, backend: &dyn Backend, epsilon: Option<f32>, finite_only: bool) -> PassOptions {
        PassOptions {
            epsilon: epsilon.unwrap_or(crate::method::DEFAULT_EPSILON),
            tile_elems: self
                .tile_elems
                .unwrap_or_else(|| backend.preferred_tile_elems()),
            scan_nonfinite: finite_only,
        }
    }
}

/// What a job says while it runs, for the front end to show (stderr, in both).
#[derive(Clone, Debug, PartialEq)]
pub enum Said {
    /// Something the user should act on or know of the inputs or the result.
    Warning(String),
    /// Something of the surroundings (scratch a killed run left), not of the merge.
    Note(String),
    /// The backend the job runs on, and why `--device auto` chose it.
    Backend(String),
    /// Where a device backend's time and bytes went.
    Traffic(String),
}

/// The backend `compute.device` asks for, for a job of this `cost`. `Auto` takes a hardware GPU
/// for the spectral methods only: the elementwise ones are bound by reading the files, and on
/// the one GPU measured (an H200, README's GPU figures) they ran 1.5–3.5× slower than the CPU
/// backend — so for them it does not load the GPU stack at all. A software adapter (lavapipe) is
/// used only when asked for, with a warning.
pub fn backend_for(
    compute: &Compute,
    cost: Cost,
    say: &mut dyn FnMut(Said),
) -> Result<Box<dyn Backend>> {
    let cpu = || -> Result<Box<dyn Backend>> { Ok(Box::new(CpuBackend::new(compute.threads)?)) };
    let gpu = |ctx: GpuContext| -> Box<dyn Backend> {
        let backend = GpuBackend::new(ctx);
        Box::new(match compute.gpu_chunk_elems {
            Some(n) => backend.with_chunk_elems(n),
            None => backend,
        })
    };
    match compute.device {
        Device::Cpu => cpu(),
        Device::Gpu => match GpuContext::open(AdapterChoice::Any)? {
            Some(ctx) => {
                if ctx.is_software() {
                    say(Said::Warning(format!(
                        "{} is a software adapter (it runs on the CPU): merges on it run many \
                         times slower than the CPU backend (16-40x measured on lavapipe)",
                        ctx.describe()
                    )));
                }
                Ok(gpu(ctx))
            }
            None => Err(crate::error::data(crate::message![
                Arg::option_value("device", "gpu"),
                ": wgpu found no GPU adapter (Vulkan, Metal or DX12). On Linux without a GPU, \
                 install Mesa's software Vulkan driver lavapipe (Debian/Ubuntu: apt-get install \
                 mesa-vulkan-drivers libvulkan1); or use ",
                Arg::option_value("device", "cpu"),
            ])),
        },
        Device::Auto if cost != Cost::Spectral => cpu(),
        Device::Auto => match GpuContext::open(AdapterChoice::HardwareOnly) {
            Ok(Some(ctx)) => Ok(gpu(ctx)),
            Ok(None) => cpu(),
            Err(e) => {
                say(Said::Warning(format!("{e:#}; using the CPU backend")));
                cpu()
            }
        },
    }
}

/// The backend a job of `cost` runs on, described with why `--device auto` chose it.
fn described(device: Device, cost: Cost, backend: &dyn Backend) -> String {
    let why = match (device, cost) {
        (Device::Auto, Cost::Spectral) if backend.kind() == "cpu" => {
            " (--device auto: a spectral method, which runs on a hardware GPU; none here)"
        }
        (Device::Auto, Cost::Spectral) => {
            " (--device auto: a spectral method runs on a hardware GPU)"
        }
        (Device::Auto, _) => {
            " (--device auto: this method is bound by reading the files, where the CPU backend \
             is the faster; --device gpu to use a GPU)"
        }
        _ => "",
    };
    format!("{}{why}", backend.describe())
}

/// The backend `verify --against` recomputes the merge `record` describes on: the one
/// `compute.device` names, where `Auto` takes the backend the record says made it — the
/// spectral methods' bytes depend on it — a GPU where there is a hardware one, else the CPU
/// (verify then compares within their tolerance, and says so).
pub fn backend_for_record(
    record: &MergeRecord,
    compute: &Compute,
    say: &mut dyn FnMut(Said),
) -> Result<Box<dyn Backend>> {
    let (device, cost) = match (compute.device, record.backend.as_deref()) {
        (Device::Auto, Some("cpu")) => (Device::Cpu, record.merging.cost()),
        (Device::Auto, Some("gpu")) => (Device::Auto, Cost::Spectral),
        (device, _) => (device, record.merging.cost()),
    };
    backend_for(
        &Compute {
            device,
            ..compute.clone()
        },
        cost,
        say,
    )
}

/// The job's inputs opened, checked against its base and planned, with the agents' names.
pub fn open_inputs(job: &Job) -> Result<Inputs> {
    let mut inputs = Inputs::open_with(
        &job.base,
        &job.agents,
        Layout {
            slices: job.slices.as_ref(),
            tokenizer: job.tokenizer.as_ref(),
            with_base: job.merging.method.uses_base(),
            allow_missing_tensors: job.allow_missing_tensors,
            raw_f32_agents: job.raw_f32_agents,
        },
    )?;
    inputs.set_names(job.names.clone())?;
    Ok(inputs)
}

/// The engine's options for `job` on `backend`, written into `out` (its final path): the one
/// place they are made. `save_recipe` writes the recipe that makes the merge again
/// ([`Job::saved_recipe`]); `warnings` are the front end's, kept in the record.
pub fn merge_options(
    job: &Job,
    (backend, compute): (&dyn Backend, &Compute),
    (out, force, save_recipe): (&Path, bool, bool),
    warnings: Vec<String>,
) -> Result<MergeOptions> {
    let mut options = MergeOptions::new(job.merging.clone(), backend);
    options.pass = compute.pass(backend, job.epsilon, !job.allow_nonfinite);
    options.out_dtype = job.out_dtype;
    if let Some(size) = job.shard_size {
        options.shard_size = size;
    }
    options.force = force;
    options.show_progress = compute.show_progress;
    if save_recipe {
        options.extra_files = vec![(MERGEKIT_CONFIG_FILE.to_string(), job.saved_recipe(out)?)];
    }
    options.protect = job
        .recipe_path
        .iter()
        .cloned()
        .chain(job.tokenizer.iter().flat_map(|t| t.folders()))
        .collect();
    options.warnings = warnings;
    options.config_from = job.config_source()?;
    let scratch: Vec<(String, PathBuf)> = job
        .stages
        .iter()
        .filter(|s| s.scratch)
        .map(|s| (s.name.clone(), s.folder.clone()))
        .collect();
    options.stages = job
        .stages
        .iter()
        .map(|s| StageRecord {
            name: s.name.clone(),
            record: Box::new(s.record.clone().rebased(&s.folder, out, &scratch)),
        })
        .collect();
    options.scratch_stages = scratch;
    if let Some(template) = &job.chat_template {
        let folders: Vec<PathBuf> = std::iter::once(&job.base)
            .chain(&job.agents)
            .map(|f| {
                let text = f.to_string_lossy();
                match crate::checkpoint::lora::split_reference(&text) {
                    Some((base, _)) => PathBuf::from(base),
                    None => f.clone(),
                }
            })
            .collect();
        let folders: Vec<&Path> = folders.iter().map(PathBuf::as_path).collect();
        options.chat_template = template.resolve(&folders)?;
        if options.chat_template.is_none() {
            options.warnings.push(
                "chat_template: auto found no chat template among the input models; the \
                 base's tokenizer files are written as they are"
                    .into(),
            );
        }
    }
    Ok(options)
}

/// Says what the user should know of inputs just opened — the formats they are read from, the
/// inputs' warnings, agents that look dense (where `compute` asks, at `epsilon`) — and returns
/// the dense agents' warnings (a merge keeps them in its record).
fn say_opened(
    inputs: &Inputs,
    compute: &Compute,
    epsilon: Option<f32>,
    say: &mut dyn FnMut(Said),
) -> Result<Vec<String>> {
    inputs
        .format_notes()
        .into_iter()
        .for_each(|n| say(Said::Note(n)));
    inputs
        .warnings
        .iter()
        .for_each(|w| say(Said::Warning(w.clone())));
    let dense = match compute.warn_dense_agents {
        true => inputs.dense_agent_warnings(epsilon.unwrap_or(crate::method::DEFAULT_EPSILON))?,
        false => Vec::new(),
    };
    dense.iter().for_each(|w| say(Said::Warning(w.clone())));
    Ok(dense)
}

/// What a RAM-family merge of one agent is: that agent, written back (RAM: its changes kept
/// whole; RAM+: λ = 1, as nothing is shared) — said, as the user may have meant more agents.
fn one_agent_warning(job: &Job) -> Option<String> {
    let kind = job.merging.method.kind();
    (job.agents.len() == 1 && kind.is_ram_family()).then(|| {
        format!(
            "one agent: {} merges nothing with one agent; the output is that agent's tensors \
             (its changes over the base kept whole); merging needs two or more agents",
            kind.name()
        )
    })
}

/// Merges `job` into `out` on the backend `compute` asks for, saying on the way what the user
/// should know: the inputs' warnings, agents that look dense, the backend, and after the merge
/// what it found (identical inputs, what a ResMerge kept) and the scratch it noticed.
pub fn merge(
    job: &Job,
    compute: &Compute,
    (out, force): (&Path, bool),
    say: &mut dyn FnMut(Said),
) -> Result<MergeSummary> {
    compute.check()?;
    let inputs = open_inputs(job)?;
    let mut dense = say_opened(&inputs, compute, job.epsilon, say)?;
    if let Some(w) = one_agent_warning(job) {
        say(Said::Warning(w.clone()));
        dense.push(w);
    }
    let cost = job.merging.cost();
    let backend = backend_for(compute, cost, say)?;
    say(Said::Backend(described(
        compute.device,
        cost,
        backend.as_ref(),
    )));
    let said_before = inputs.warnings.len() + dense.len();
    let options = merge_options(job, (backend.as_ref(), compute), (out, force, true), dense)?;
    let summary = engine::merge(&inputs, &options, backend.as_ref(), out).map_err(|e| {
        if crate::error::is_usage(&e) {
            e // says itself that nothing was touched
        } else {
            e.context(format!(
                "merge into {} failed; nothing was written there",
                out.display()
            ))
        }
    })?;
    // What the merge found (identical inputs, config differences, what it kept), after what was
    // said before it.
    for w in &summary.record.warnings[said_before..] {
        say(Said::Warning(w.clone()));
    }
    if let Some(traffic) = backend.traffic() {
        say(Said::Traffic(traffic));
    }
    summary
        .notes
        .iter()
        .for_each(|n| say(Said::Note(n.clone())));
    Ok(summary)
}

/// An analysis (`rlmerge analyze`): what each agent changed against the base, and with `merged`
/// what a merged folder kept of it; with `plot`, the figures.
#[derive(Clone, Debug, Default)]
pub struct Analysis {
    /// The base model's folder.
    pub base: PathBuf,
    /// The agents' folders, in order.
    pub agents: Vec<PathBuf>,
    /// The agents' names, by agent (`--name`).
    pub names: Vec<String>,
    /// The vocabulary agents that added tokens are compared by.
    pub tokenizer: Option<TokenizerSettings>,
    /// ε (`None`: the default).
    pub epsilon: Option<f64>,
    /// Tensors some models lack compared where present.
    pub allow_missing_tensors: bool,
    /// NaN/±Inf read by IEEE rules.
    pub allow_nonfinite: bool,
    /// Agents' F32 weights read as stored.
    pub raw_f32_agents: bool,
    /// A merged folder whose retention of each agent is reported.
    pub merged: Option<PathBuf>,
    /// Where the SVG figures go.
    pub plot: Option<PathBuf>,
    /// Figures per tensor too (`lambda.svg`).
    pub per_tensor: bool,
}

/// What an analysis found: the probe's report, the retention in the merged folder, the figures
/// written.
pub struct Analyzed {
    /// What each agent changed, by module and tensor.
    pub(crate) report: ProbeReport,
    /// What the merged folder kept of each agent.
    pub(crate) retention: Option<Retention>,
    /// The figures written.
    pub figures: Vec<PathBuf>,
}

impl Analyzed {
    /// The analysis as `analyze --json` prints it.
    pub fn to_json(&self, per_tensor: bool) -> serde_json::Value {
        let mut v = self.report.to_json(per_tensor);
        if let Some(r) = &self.retention {
            v["retention"] = r.to_json();
        }
        v
    }

    /// The analysis as `analyze` prints it: tables.
    pub fn render_text(&self, per_tensor: bool) -> String {
        let mut text = self.report.render_text(per_tensor);
        if let Some(r) = &self.retention {
            text.push_str(&r.render_text());
        }
        text
    }
}

/// Runs `analysis` on the CPU backend (or the device asked), saying the inputs' warnings, dense
/// agents and scratch near the folders read; a `merged` or `plot` path that is an input, or
/// inside one, is refused before anything is read.
pub fn analyze(
    analysis: &Analysis,
    compute: &Compute,
    say: &mut dyn FnMut(Said),
) -> Result<Analyzed> {
    compute.check()?;
    let epsilon = analysis
        .epsilon
        .map(crate::method::build::epsilon_value)
        .transpose()
        .map_err(|e| {
            usage(crate::message![
                crate::error::Arg::named("--epsilon", "epsilon"),
                format!(": {e:#}")
            ])
        })?;
    let layout = Layout {
        tokenizer: analysis.tokenizer.as_ref(),
        with_base: true,
        allow_missing_tensors: analysis.allow_missing_tensors,
        raw_f32_agents: analysis.raw_f32_agents,
        ..Layout::default()
    };
    let mut inputs = Inputs::open_with(&analysis.base, &analysis.agents, layout)?;
    inputs.set_names(analysis.names.iter().cloned().map(Some).collect())?;
    say_opened(&inputs, compute, epsilon, say)?;
    // Scratch that killed merges left beside the models analyzed, or where figures go.
    let near: Vec<PathBuf> = inputs
        .paths()
        .iter()
        .chain(analysis.merged.iter())
        .filter_map(|p| p.parent().map(Path::to_path_buf))
        .chain(analysis.plot.iter().cloned())
        .collect();
    for n in output_folder::stale_notes(&near) {
        say(Said::Note(n));
    }
    let merged = open_merged(&inputs, analysis.merged.as_deref())?;
    // Figures go next to the models, never into them: the same rule as a merge's -o.
    let mut protect = inputs.paths();
    protect.extend(merged.iter().flat_map(|m| m.paths()));
    if let Some(dir) = &analysis.plot {
        let resolved = output_folder::resolve_output(dir)?;
        output_folder::refuse_inside(dir, &resolved, &protect)?;
    }
    let backend = backend_for(compute, Cost::Stream, say)?;
    let pass = compute.pass(backend.as_ref(), epsilon, !analysis.allow_nonfinite);
    let show = compute.show_progress;
    let report = engine::probe_all(&inputs, backend.as_ref(), &pass, show)?;
    let retention = match &merged {
        Some(m) => Some(engine::retention(&inputs, m, &pass, show)?),
        None => None,
    };
    let figures = match &analysis.plot {
        Some(dir) => crate::figures::write_all(
            &report,
            retention.as_ref(),
            dir,
            analysis.per_tensor,
            &protect,
        )?,
        None => Vec::new(),
    };
    Ok(Analyzed {
        report,
        retention,
        figures,
    })
}

/// The merged folder `analyze --merged` reads, opened; one that is an input of the analysis
/// is refused before the probe reads anything.
fn open_merged(
    inputs: &Inputs,
    dir: Option<&Path>,
) -> Result<Option<crate::checkpoint::ModelFolder>> {
    let Some(dir) = dir else {
        return Ok(None);
    };
    let real = |p: &Path| std::fs::canonicalize(p).unwrap_or_else(|_| p.to_path_buf());
    let merged_real = real(dir);
    let input = std::iter::once(&inputs.base)
        .chain(&inputs.agents)
        .find(|m| {
            real(&m.dir) == merged_real || real(m.config_dir()) == merged_real && m.lora.is_none()
        });
    if let Some(m) = input {
        return Err(usage(format!(
            "--merged {} is an input of this analysis ({}); give the folder the merge wrote",
            dir.display(),
            m.dir.display()
        )));
    }
    crate::checkpoint::ModelFolder::open(dir)
        .map(Some)
        .with_context(|| format!("cannot open the merged folder {}", dir.display()))
}
