//! Command-line interface: argument definitions and the commands behind them.
//!
//! Exit codes: 0 success, 1 the merge/analysis failed (bad input, I/O), 2 usage error.

use crate::backend::cpu::CpuBackend;
use crate::backend::gpu::{list_adapters, AdapterChoice, GpuBackend, GpuContext};
use crate::backend::Backend;
use crate::checkpoint::writer::parse_size;
use crate::checkpoint::DType;
use crate::config::{cli_setting, parse_dtype_name, MERGEKIT_CONFIG_FILE};
use crate::demo;
use crate::engine::{self, MergeOptions, Pass};
use crate::inputs::Inputs;
use crate::method::build::MethodRequest;
use crate::method::settings::{Scalar, Setting, Settings};
use crate::method::{defaults, BoostRule, BoostScope, Kind, Method, DEFAULT_EPSILON};
use anyhow::{Context, Result};
use clap::{Args, Parser, Subcommand, ValueEnum};
use std::io::{IsTerminal, Write};
use std::path::PathBuf;

#[derive(Parser, Debug)]
#[command(
    name = "rlmerge",
    version,
    about = "Merge RL-trained LLM agents into one checkpoint with Reinforced Agent Merging (RAM / RAM+)"
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Subcommand, Debug)]
pub enum Command {
    /// Merge agents fine-tuned from one base into a new Hugging Face folder.
    Merge(MergeArgs),
    /// Run a mergekit YAML recipe (its model names must be local folders).
    Run(RunArgs),
    /// List every merge method with its parameters, defaults and reference.
    Methods,
    /// Probe the task vectors: what each agent changed, what is shared, ρ_t and λ_t.
    Analyze(AnalyzeArgs),
    /// Write a small built-in example (a base and three agents), analyze it and merge it with RAM+.
    Demo(DemoArgs),
    /// List the GPU adapters wgpu sees, with the limits that size rlmerge's tiles.
    Devices,
    /// Check a merged folder against the checksums its recipe recorded (outputs and inputs).
    Verify(VerifyArgs),
}

#[derive(Args, Debug)]
pub struct VerifyArgs {
    /// The merged folder.
    pub dir: PathBuf,
    /// Also recompute the merge from the recipe's inputs and compare the bytes.
    #[arg(long)]
    pub against: bool,
    /// Where to recompute with --against.
    #[arg(long, value_enum, default_value = "auto")]
    pub device: DeviceChoice,
    /// Worker threads of the CPU backend (0 = all cores).
    #[arg(long, default_value_t = 0)]
    pub threads: usize,
}

/// Where the probe and merge passes run.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum DeviceChoice {
    /// A hardware GPU if there is one, else the CPU backend.
    Auto,
    /// A GPU adapter, software ones (lavapipe) included; an error if there is none.
    Gpu,
    /// The native CPU backend.
    Cpu,
}

/// Inputs and compute options shared by `merge` and `analyze`.
#[derive(Args, Debug)]
pub struct InputArgs {
    /// The base model folder all agents were fine-tuned from.
    #[arg(long, value_name = "DIR")]
    pub base: Option<PathBuf>,
    /// An agent model folder (repeat for each agent).
    #[arg(long = "model", value_name = "DIR")]
    pub models: Vec<PathBuf>,
    #[command(flatten)]
    pub compute: ComputeArgs,
}

/// How and where the passes run.
#[derive(Args, Debug)]
pub struct ComputeArgs {
    /// Threshold: an element is changed when |θ_t − θ₀| > ε (absolute).
    #[arg(long, default_value_t = DEFAULT_EPSILON)]
    pub epsilon: f32,
    /// Worker threads of the CPU backend (0 = all cores).
    #[arg(long, default_value_t = 0)]
    pub threads: usize,
    /// No progress bars.
    #[arg(long, short)]
    pub quiet: bool,
    /// Where to compute.
    #[arg(long, value_enum, default_value = "auto")]
    pub device: DeviceChoice,
    /// Elements per tile [default: the backend's preference] (tuning and tests; the result does
    /// not depend on it).
    #[arg(long, hide = true)]
    pub tile_elems: Option<usize>,
    /// Merge NaN and ±Inf by IEEE rules instead of refusing inputs that hold them.
    #[arg(long)]
    pub allow_nonfinite: bool,
    /// Caps elements per GPU dispatch chunk (tests; the result does not depend on it).
    #[arg(long, hide = true)]
    pub gpu_chunk_elems: Option<usize>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum RuleName {
    /// λ = 1 + r·min(ρ, α) (the paper).
    Paper,
    /// λ = 1 + (R − 1)·min(ρ, 1) (the authors' released script).
    Official,
}

impl RuleName {
    fn name(self) -> &'static str {
        match self {
            RuleName::Paper => "paper",
            RuleName::Official => "official",
        }
    }
}

#[derive(Args, Debug)]
pub struct MergeArgs {
    #[command(flatten)]
    pub inputs: InputArgs,
    /// A mergekit YAML recipe giving the models, method and parameters (instead of --base,
    /// --model and --method).
    #[arg(long, value_name = "RECIPE.yml", conflicts_with_all = ["base", "models", "method"])]
    pub config: Option<PathBuf>,
    /// Merge method (`rlmerge methods` lists them with their parameters).
    #[arg(long, value_enum, hide_possible_values = true)]
    pub method: Option<Kind>,
    /// A method parameter for every model, as KEY=VALUE (repeat), e.g. --param density=0.5.
    #[arg(long = "param", value_name = "KEY=VALUE", value_parser = cli_setting)]
    pub params: Vec<(String, Setting)>,
    /// RAM+ boost rule.
    #[arg(long, value_enum)]
    pub rule: Option<RuleName>,
    /// RAM+ scope of ρ: one λ per agent (global) or per agent and tensor.
    #[arg(long, value_enum)]
    pub scope: Option<BoostScope>,
    /// RAM+ paper rule: r [default 0.1].
    #[arg(long)]
    pub r: Option<f64>,
    /// RAM+ paper rule: cap α on ρ [default 2.0 global, 0.2 tensor scope].
    #[arg(long)]
    pub alpha: Option<f64>,
    /// RAM+ official rule: R [default 1.2].
    #[arg(long)]
    pub rescale_factor: Option<f64>,
    #[command(flatten)]
    pub output: OutputArgs,
}

/// Where and how the merged folder is written.
#[derive(Args, Debug)]
pub struct OutputArgs {
    /// Output dtype [default: the recipe's out_dtype/dtype, else each tensor's dtype in the base].
    #[arg(long, value_parser = parse_dtype)]
    pub out_dtype: Option<DType>,
    /// Largest output shard (5GB = 5·10⁹ bytes, 5GiB = 5·2³⁰).
    #[arg(long, default_value = "5GB", value_parser = parse_size)]
    pub shard_size: u64,
    /// Replace the output folder if it exists (only once the new one is complete).
    #[arg(long)]
    pub force: bool,
    /// Seed of random masks (dare_linear, dare_ties): the same seed gives the same bytes on every
    /// backend and tiling.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Output folder.
    #[arg(short = 'o', long = "out", value_name = "OUT_DIR")]
    pub out: PathBuf,
}

#[derive(Args, Debug)]
pub struct RunArgs {
    /// The mergekit YAML recipe.
    #[arg(value_name = "RECIPE.yml")]
    pub recipe: PathBuf,
    #[command(flatten)]
    pub compute: ComputeArgs,
    #[command(flatten)]
    pub output: OutputArgs,
}

#[derive(Args, Debug)]
pub struct AnalyzeArgs {
    #[command(flatten)]
    pub inputs: InputArgs,
    /// Break the counts down by module and by tensor.
    #[arg(long)]
    pub per_tensor: bool,
    /// Print JSON on stdout instead of tables.
    #[arg(long)]
    pub json: bool,
}

#[derive(Args, Debug)]
pub struct DemoArgs {
    /// Where to write the example.
    #[arg(default_value = "rlmerge-demo")]
    pub dir: PathBuf,
    /// No progress bars.
    #[arg(long, short)]
    pub quiet: bool,
    /// Size of each model (e.g. 1GiB) instead of the tiny default: a synthetic checkpoint for benchmarks.
    #[arg(long, value_parser = parse_size)]
    pub model_size: Option<u64>,
    /// Only write the models; skip the analysis and the merge.
    #[arg(long)]
    pub write_only: bool,
}

fn parse_dtype(s: &str) -> Result<DType, String> {
    parse_dtype_name(s).ok_or_else(|| format!("unknown dtype '{s}' (use bf16, f16 or f32)"))
}

use crate::error::usage;
pub use crate::error::UsageError;

impl MergeArgs {
    /// The method with its parameters for `agents` merged models: the flags and `--param`s turned
    /// into one request for [`crate::method::build`], which validates it as it does recipes.
    pub fn method(&self, agents: usize) -> Result<Method> {
        let kind = self.method.unwrap_or(Kind::RamPlus);
        let boost_flags = [
            (
                "--rule",
                "rule",
                self.rule.map(|r| Scalar::Text(r.name().into())),
            ),
            (
                "--scope",
                "scope",
                self.scope.map(|s| Scalar::Text(s.name().into())),
            ),
            ("--r", "r", self.r.map(Scalar::Number)),
            ("--alpha", "alpha", self.alpha.map(Scalar::Number)),
            (
                "--rescale-factor",
                "rescale_factor",
                self.rescale_factor.map(Scalar::Number),
            ),
        ];
        let set_flag = boost_flags.iter().find(|(_, _, v)| v.is_some());
        if let Some((flag, _, _)) = set_flag {
            if kind != Kind::RamPlus {
                return Err(usage(format!(
                    "{flag} applies to --method ram+ only{}",
                    if kind == Kind::RamplusTl {
                        " (ramplus_tl is the paper rule in tensor scope; use --method ram+ to choose)"
                    } else {
                        ""
                    }
                )));
            }
        }
        let mut shared = Settings::new();
        for (key, value) in &self.params {
            if shared.insert(key.clone(), value.clone()).is_some() {
                return Err(usage(format!(
                    "--param {key} is given twice; give each parameter once"
                )));
            }
        }
        for (flag, key, value) in boost_flags {
            if let Some(v) = value {
                if shared.insert(key.into(), Setting::Scalar(v)).is_some() {
                    return Err(usage(format!(
                        "{flag} and --param {key} both set {key}; give it once"
                    )));
                }
            }
        }
        let request = MethodRequest {
            kind,
            shared,
            models: vec![Default::default(); agents],
            seed: self.output.seed,
            with_base: true,
        };
        crate::method::build::build(request, agents)
    }
}

impl InputArgs {
    /// The base and agent folders given with --base and --model.
    fn folders(&self) -> Result<(PathBuf, Vec<PathBuf>)> {
        match (&self.base, self.models.is_empty()) {
            (Some(b), false) => Ok((b.clone(), self.models.clone())),
            _ => Err(usage(
                "give the models with --base DIR and --model DIR (repeat for each agent), or a recipe with --config",
            )),
        }
    }
}

impl ComputeArgs {
    fn check(&self) -> Result<()> {
        if !(self.epsilon.is_finite() && self.epsilon >= 0.0) {
            return Err(usage("--epsilon must be finite and ≥ 0"));
        }
        if self.tile_elems == Some(0) {
            return Err(usage("--tile-elems must be ≥ 1"));
        }
        Ok(())
    }

    fn backend(&self) -> Result<Box<dyn Backend>> {
        make_backend(self.device, self.threads, self.gpu_chunk_elems)
    }

    fn pass(&self, backend: &dyn Backend) -> Pass {
        Pass {
            epsilon: self.epsilon,
            tile_elems: self
                .tile_elems
                .unwrap_or_else(|| backend.preferred_tile_elems()),
            scan_nonfinite: !self.allow_nonfinite,
        }
    }

    fn show_progress(&self) -> bool {
        !self.quiet && std::io::stderr().is_terminal()
    }
}

/// The backend `device` asks for (see [`DeviceChoice`]).
fn make_backend(
    device: DeviceChoice,
    threads: usize,
    gpu_chunk_elems: Option<usize>,
) -> Result<Box<dyn Backend>> {
    let gpu = |ctx: GpuContext| -> Box<dyn Backend> {
        let backend = GpuBackend::new(ctx);
        Box::new(match gpu_chunk_elems {
            Some(n) => backend.with_chunk_elems(n),
            None => backend,
        })
    };
    match device {
        DeviceChoice::Cpu => Ok(Box::new(CpuBackend::new(threads)?)),
        DeviceChoice::Gpu => match GpuContext::open(AdapterChoice::Any)? {
            Some(ctx) => Ok(gpu(ctx)),
            None => Err(anyhow::anyhow!(
                "--device gpu: wgpu found no GPU adapter (Vulkan, Metal or DX12). On Linux without a GPU, \
                 install Mesa's software Vulkan driver lavapipe (Debian/Ubuntu: apt-get install \
                 mesa-vulkan-drivers libvulkan1); or use --device cpu"
            )),
        },
        DeviceChoice::Auto => match GpuContext::open(AdapterChoice::HardwareOnly) {
            Ok(Some(ctx)) => Ok(gpu(ctx)),
            Ok(None) => Ok(Box::new(CpuBackend::new(threads)?)),
            Err(e) => {
                eprintln!("warning: {e:#}; using the CPU backend");
                Ok(Box::new(CpuBackend::new(threads)?))
            }
        },
    }
}

fn warn_all(warnings: &[String]) {
    for w in warnings {
        eprintln!("warning: {}", crate::error::printable(w));
    }
}

pub fn run(cli: Cli) -> Result<()> {
    let mut out = std::io::stdout().lock();
    match cli.command {
        Command::Merge(args) => run_merge(&args, &mut out),
        Command::Run(args) => run_recipe(&args, &mut out),
        Command::Methods => run_methods(&mut out),
        Command::Analyze(args) => run_analyze(&args, &mut out),
        Command::Demo(args) => run_demo(&args, &mut out),
        Command::Devices => run_devices(&mut out),
        Command::Verify(args) => run_verify(&args, &mut out),
    }
}

fn run_verify(args: &VerifyArgs, out: &mut impl Write) -> Result<()> {
    let backend = if args.against {
        Some(make_backend(args.device, args.threads, None)?)
    } else {
        None
    };
    let v = crate::verify::verify(&args.dir, backend.as_deref())?;
    for line in &v.ok {
        writeln!(out, "ok    {line}")?;
    }
    for line in &v.skipped {
        writeln!(out, "skip  {line}")?;
    }
    for line in &v.problems {
        writeln!(out, "FAIL  {line}")?;
    }
    if v.problems.is_empty() {
        writeln!(
            out,
            "{} verified: {} checks passed",
            args.dir.display(),
            v.ok.len()
        )?;
        Ok(())
    } else {
        anyhow::bail!(
            "{}: {} problem(s) found (first: {})",
            args.dir.display(),
            v.problems.len(),
            v.problems[0]
        )
    }
}

fn run_devices(out: &mut impl Write) -> Result<()> {
    let adapters = list_adapters();
    if adapters.is_empty() {
        writeln!(
            out,
            "no GPU adapter found; merges run on the CPU backend (for lavapipe on Linux: apt-get install mesa-vulkan-drivers libvulkan1)"
        )?;
        return Ok(());
    }
    for a in adapters {
        let (i, l) = (&a.info, &a.limits);
        writeln!(
            out,
            "{} — {:?}, {:?}, driver {} {}",
            i.name, i.backend, i.device_type, i.driver, i.driver_info
        )?;
        writeln!(
            out,
            "    max storage binding {} B, max buffer {} B, {} storage buffers per stage, {} workgroups per dimension",
            l.max_storage_buffer_binding_size,
            l.max_buffer_size,
            l.max_storage_buffers_per_shader_stage,
            l.max_compute_workgroups_per_dimension
        )?;
    }
    writeln!(out, "--device auto uses a hardware GPU (discrete first) and otherwise the CPU backend; --device gpu also takes software adapters")?;
    Ok(())
}

/// Prints the λ of each agent after a merge.
fn print_lambdas(out: &mut impl Write, agents: &[crate::recipe::AgentSummary]) -> Result<()> {
    for a in agents {
        match a.lambda {
            Some(l) => writeln!(out, "  λ = {l:.6}  {}", a.path)?,
            None => writeln!(out, "  λ per tensor (see the recipe)  {}", a.path)?,
        }
    }
    Ok(())
}

fn run_merge(args: &MergeArgs, out: &mut impl Write) -> Result<()> {
    let job = match &args.config {
        Some(path) => crate::config::read(path, args.output.seed)?,
        None => {
            let (base, agents) = args.inputs.folders()?;
            // Methods without θ₀ (linear, passthrough) merge the --model folders; the base then
            // only gives the layout and the config files.
            let method = args.method(agents.len())?;
            crate::config::Job {
                base,
                agents,
                method,
                epsilon: None,
                out_dtype: None,
                text: String::new(),
                source: None,
            }
        }
    };
    merge_job(job, &args.inputs.compute, &args.output, out)
}

fn run_recipe(args: &RunArgs, out: &mut impl Write) -> Result<()> {
    let job = crate::config::read(&args.recipe, args.output.seed)?;
    merge_job(job, &args.compute, &args.output, out)
}

/// Runs a merge job with the compute and output options; the one path of `merge` and `run`.
fn merge_job(
    job: crate::config::Job,
    compute: &ComputeArgs,
    output: &OutputArgs,
    out: &mut impl Write,
) -> Result<()> {
    compute.check()?;
    let inputs = Inputs::open(&job.base, &job.agents)?;
    warn_all(&inputs.warnings);
    let backend = compute.backend()?;
    if !compute.quiet {
        eprintln!("backend: {}", backend.describe());
    }
    let mut pass = compute.pass(backend.as_ref());
    if let Some(e) = job.epsilon {
        pass.epsilon = e;
    }
    let options = MergeOptions {
        method: job.method.clone(),
        pass,
        out_dtype: output.out_dtype.or(job.out_dtype),
        shard_size: output.shard_size,
        force: output.force,
        show_progress: compute.show_progress(),
        extra_files: if job.text.is_empty() {
            Vec::new()
        } else {
            vec![(MERGEKIT_CONFIG_FILE.to_string(), job.text.clone())]
        },
        protect: job.source.iter().cloned().collect(),
    };
    let summary = engine::merge(&inputs, &options, backend.as_ref(), &output.out).map_err(|e| {
        if crate::error::is_usage(&e) {
            e // says itself that nothing was touched
        } else {
            e.context(format!(
                "merge into {} failed; nothing was written there",
                output.out.display()
            ))
        }
    })?;
    // Warnings found while merging (identical inputs), after those of opening the inputs.
    warn_all(&summary.recipe.warnings[inputs.warnings.len()..]);
    writeln!(
        out,
        "merged {} model(s) into {} with {} ({} shard(s))",
        inputs.agents.len(),
        output.out.display(),
        job.method,
        summary.shards.len()
    )?;
    if matches!(job.method, Method::Combine(_)) {
        return Ok(());
    }
    print_lambdas(out, &summary.recipe.agents)
}

fn run_methods(out: &mut impl Write) -> Result<()> {
    for kind in Kind::ALL {
        writeln!(
            out,
            "{:<17} {} ({})",
            kind.name(),
            kind.about(),
            kind.reference()
        )?;
        for p in kind.params() {
            let scope = match p.scope {
                crate::method::catalog::Scope::Shared => "shared",
                crate::method::catalog::Scope::PerModel => "per model",
            };
            writeln!(
                out,
                "    {:<16} {:<10} default {:<16} {:<16} {}",
                p.name,
                scope,
                p.default.text(p.range),
                p.range.text(),
                p.about
            )?;
        }
    }
    writeln!(
        out,
        "\nSet parameters in a mergekit recipe (rlmerge run RECIPE.yml -o OUT) or with --param KEY=VALUE."
    )?;
    Ok(())
}

fn run_analyze(args: &AnalyzeArgs, out: &mut impl Write) -> Result<()> {
    let compute = &args.inputs.compute;
    compute.check()?;
    let (base, agents) = args.inputs.folders()?;
    let inputs = Inputs::open(&base, &agents)?;
    warn_all(&inputs.warnings);
    let backend = compute.backend()?;
    let report = engine::probe_all(
        &inputs,
        backend.as_ref(),
        &compute.pass(backend.as_ref()),
        compute.show_progress(),
    )?;
    if args.json {
        writeln!(
            out,
            "{}",
            serde_json::to_string_pretty(&report.to_json(args.per_tensor))?
        )?;
    } else {
        write!(out, "{}", report.render_text(args.per_tensor))?;
    }
    Ok(())
}

fn run_demo(args: &DemoArgs, out: &mut impl Write) -> Result<()> {
    std::fs::create_dir_all(&args.dir)
        .with_context(|| format!("cannot create {}", args.dir.display()))?;
    let shape = args
        .model_size
        .map_or_else(demo::ModelShape::tiny, demo::ModelShape::of_bf16_bytes);
    let merged = args.dir.join("merged-ram-plus");
    demo::check_replaceable(&merged)?;
    let (base, agents) = demo::write_example(&args.dir, &shape, 2026)?;
    let inputs = Inputs::open(&base, &agents)?;
    writeln!(
        out,
        "wrote a bf16 base and 3 RL-like agents of {} bytes each under {}\n",
        inputs.base.data_bytes(),
        args.dir.display()
    )?;
    if args.write_only {
        return Ok(());
    }
    let backend: Box<dyn Backend> = Box::new(CpuBackend::new(0)?);
    let show = !args.quiet && std::io::stderr().is_terminal();
    let options = MergeOptions {
        method: Method::RamPlus {
            rule: BoostRule::Paper {
                r: defaults::R,
                alpha: defaults::ALPHA_GLOBAL,
            },
            scope: BoostScope::Global,
        },
        pass: Pass {
            epsilon: DEFAULT_EPSILON,
            tile_elems: backend.preferred_tile_elems(),
            scan_nonfinite: true,
        },
        out_dtype: None,
        shard_size: 5_000_000_000,
        force: true,
        show_progress: show,
        extra_files: Vec::new(),
        protect: Vec::new(),
    };
    // Global RAM+ probes the whole model first; its report is the analysis to show.
    let summary = engine::merge(&inputs, &options, backend.as_ref(), &merged)?;
    let report = summary
        .report
        .as_ref()
        .context("internal: ram+ produced no probe report")?;
    writeln!(
        out,
        "$ rlmerge analyze --base {} --model … (3 agents)\n",
        base.display()
    )?;
    write!(out, "{}", report.render_text(false))?;
    writeln!(
        out,
        "\n$ rlmerge merge --method ram+ … -o {}\n",
        merged.display()
    )?;
    print_lambdas(out, &summary.recipe.agents)?;
    writeln!(
        out,
        "\nmerged checkpoint: {} ({}; model card README.md, recipe {})",
        merged.display(),
        summary.shards.join(", "),
        crate::recipe::RECIPE_FILE
    )?;
    Ok(())
}
