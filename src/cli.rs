//! Command-line interface: argument definitions and the commands behind them.
//!
//! Exit codes: 0 success, 1 the merge/analysis failed (bad input, I/O), 2 usage error.

use crate::backend::cpu::CpuBackend;
use crate::backend::gpu::{list_adapters, AdapterChoice, GpuBackend, GpuContext};
use crate::backend::Backend;
use crate::checkpoint::writer::parse_size;
use crate::checkpoint::DType;
use crate::demo;
use crate::engine::{self, Inputs, MergeOptions, Pass};
use crate::method::{defaults, BoostRule, BoostScope, Method, DEFAULT_EPSILON};
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
    pub base: PathBuf,
    /// An agent model folder (repeat for each agent).
    #[arg(long = "model", value_name = "DIR", required = true)]
    pub models: Vec<PathBuf>,
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
pub enum MethodName {
    /// Reinforced Agent Merging: mean over active agents on shared elements, unique kept.
    #[value(name = "ram")]
    Ram,
    /// RAM+: unique elements boosted by λ_t from the overlap-unique ratio.
    #[value(name = "ram+", alias = "ramplus", alias = "ram_plus")]
    RamPlus,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum RuleName {
    /// λ = 1 + r·min(ρ, α) (the paper).
    Paper,
    /// λ = 1 + (R − 1)·min(ρ, 1) (the authors' released script).
    Official,
}

#[derive(Args, Debug)]
pub struct MergeArgs {
    #[command(flatten)]
    pub inputs: InputArgs,
    /// Merge method.
    #[arg(long, value_enum, default_value = "ram+")]
    pub method: MethodName,
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
    /// Output dtype [default: each tensor's dtype in the base].
    #[arg(long, value_parser = parse_dtype)]
    pub out_dtype: Option<DType>,
    /// Largest output shard (5GB = 5·10⁹ bytes, 5GiB = 5·2³⁰).
    #[arg(long, default_value = "5GB", value_parser = parse_size)]
    pub shard_size: u64,
    /// Replace the output folder if it exists (only once the new one is complete).
    #[arg(long)]
    pub force: bool,
    /// Output folder.
    #[arg(short = 'o', long = "out", value_name = "OUT_DIR")]
    pub out: PathBuf,
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
    DType::parse_user(s).ok_or_else(|| format!("unknown dtype '{s}' (use bf16, f16 or f32)"))
}

/// An error in how the command was called (exit code 2), as opposed to a failed merge (1).
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct UsageError(pub String);

fn usage(msg: impl Into<String>) -> anyhow::Error {
    UsageError(msg.into()).into()
}

impl MergeArgs {
    /// The method with its parameters, after checking they fit together.
    pub fn method(&self) -> Result<Method> {
        let boost_flags = [
            ("--rule", self.rule.is_some()),
            ("--scope", self.scope.is_some()),
            ("--r", self.r.is_some()),
            ("--alpha", self.alpha.is_some()),
            ("--rescale-factor", self.rescale_factor.is_some()),
        ];
        if self.method == MethodName::Ram {
            if let Some((flag, _)) = boost_flags.iter().find(|(_, set)| *set) {
                return Err(usage(format!("{flag} applies to --method ram+ only")));
            }
            return Ok(Method::Ram);
        }
        let scope = self.scope.unwrap_or(BoostScope::Global);
        let rule = match self.rule.unwrap_or(RuleName::Paper) {
            RuleName::Paper => {
                if self.rescale_factor.is_some() {
                    return Err(usage("--rescale-factor applies to --rule official only"));
                }
                let r = self.r.unwrap_or(defaults::R);
                let alpha = self.alpha.unwrap_or(match scope {
                    BoostScope::Global => defaults::ALPHA_GLOBAL,
                    BoostScope::Tensor => defaults::ALPHA_TENSOR,
                });
                if !(r.is_finite() && r >= 0.0 && alpha.is_finite() && alpha >= 0.0) {
                    return Err(usage("--r and --alpha must be finite and ≥ 0"));
                }
                BoostRule::Paper { r, alpha }
            }
            RuleName::Official => {
                if self.r.is_some() || self.alpha.is_some() {
                    return Err(usage("--r and --alpha apply to --rule paper only"));
                }
                let rescale_factor = self.rescale_factor.unwrap_or(defaults::RESCALE_FACTOR);
                if !rescale_factor.is_finite() {
                    return Err(usage("--rescale-factor must be finite"));
                }
                BoostRule::Official { rescale_factor }
            }
        };
        Ok(Method::RamPlus { rule, scope })
    }
}

impl InputArgs {
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
        eprintln!("warning: {w}");
    }
}

pub fn run(cli: Cli) -> Result<()> {
    let mut out = std::io::stdout().lock();
    match cli.command {
        Command::Merge(args) => run_merge(&args, &mut out),
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
    args.inputs.check()?;
    let method = args.method()?;
    let inputs = Inputs::open(&args.inputs.base, &args.inputs.models)?;
    warn_all(&inputs.warnings);
    let backend = args.inputs.backend()?;
    if !args.inputs.quiet {
        eprintln!("backend: {}", backend.describe());
    }
    let options = MergeOptions {
        method,
        pass: args.inputs.pass(backend.as_ref()),
        out_dtype: args.out_dtype,
        shard_size: args.shard_size,
        force: args.force,
        show_progress: args.inputs.show_progress(),
    };
    let summary =
        engine::merge(&inputs, &options, backend.as_ref(), &args.out).with_context(|| {
            format!(
                "merge into {} failed; nothing was written there",
                args.out.display()
            )
        })?;
    writeln!(
        out,
        "merged {} agent(s) into {} with {} ({} shard(s))",
        inputs.agents.len(),
        args.out.display(),
        method,
        summary.shards.len()
    )?;
    print_lambdas(out, &summary.recipe.agents)
}

fn run_analyze(args: &AnalyzeArgs, out: &mut impl Write) -> Result<()> {
    args.inputs.check()?;
    let inputs = Inputs::open(&args.inputs.base, &args.inputs.models)?;
    warn_all(&inputs.warnings);
    let backend = args.inputs.backend()?;
    let report = engine::probe_all(
        &inputs,
        backend.as_ref(),
        &args.inputs.pass(backend.as_ref()),
        args.inputs.show_progress(),
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
    let merged = args.dir.join("merged-ram-plus");
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
