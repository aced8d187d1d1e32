//! The commands behind the arguments: each turns its flags into library calls and prints the
//! result.

pub use super::methods::run_methods;
use super::{
    AnalyzeArgs, Cli, Command, ComputeArgs, ConvertArgs, DemoArgs, DeviceChoice, InputArgs,
    MergeArgs, OutputArgs, RunArgs, VerifyArgs,
};
use crate::backend::gpu::{list_adapters, AdapterChoice, GpuContext};
use crate::demo;
use crate::error::usage;
use crate::escape::terminal;
use crate::inputs::Inputs;
use crate::job::Job;
use crate::method::Method;
use crate::service;
use anyhow::{Context, Result};
use std::io::{IsTerminal, Write};
use std::path::{Path, PathBuf};

/// A model as given on the command line, as a local path ([`crate::hub::locate_model`]).
fn locate(model: &Path) -> Result<PathBuf> {
    crate::hub::locate_model(model, std::io::stderr().is_terminal())
}

impl InputArgs {
    /// The base and agent folders given with --base and --model.
    fn folders(&self) -> Result<(PathBuf, Vec<PathBuf>)> {
        match (&self.base, self.models.is_empty()) {
            (Some(b), false) => {
                let models = self.models.iter().map(|m| locate(m)).collect::<Result<_>>()?;
                Ok((locate(b)?, models))
            }
            _ => Err(usage(
                "give the models with --base DIR and --model DIR (repeat for each agent), or a recipe with --config",
            )),
        }
    }

    /// `--tokenizer-source`: base, union, or a model (a folder or Hub id, as for --model).
    fn tokenizer(&self) -> Result<Option<crate::vocabulary::TokenizerSettings>> {
        self.tokenizer_source
            .as_deref()
            .map(crate::vocabulary::TokenizerSettings::of_source)
            .transpose()
    }
}

impl ComputeArgs {
    /// The compute choices as the library takes them.
    pub(crate) fn compute(&self) -> service::Compute {
        service::Compute {
            device: self.device.into(),
            threads: self.threads,
            tile_elems: self.tile_elems,
            gpu_chunk_elems: self.gpu_chunk_elems,
            show_progress: !self.quiet,
            warn_dense_agents: !self.allow_dense_agents,
        }
    }

    /// What these flags set on top of a job's recipe or method flags.
    pub(crate) fn command_line(&self, output: &OutputArgs) -> crate::job::CommandLine {
        crate::job::CommandLine {
            epsilon: self.epsilon,
            out_dtype: output.out_dtype,
            shard_size: output.shard_size,
            allow_nonfinite: self.allow_nonfinite,
            allow_missing_tensors: self.allow_missing_tensors,
            raw_f32_agents: self.raw_f32_agents,
        }
    }
}

impl From<DeviceChoice> for service::Device {
    fn from(d: DeviceChoice) -> service::Device {
        match d {
            DeviceChoice::Auto => service::Device::Auto,
            DeviceChoice::Gpu => service::Device::Gpu,
            DeviceChoice::Cpu => service::Device::Cpu,
        }
    }
}

/// What a job says while it runs, on stderr: warnings and notes always, the backend and the GPU's
/// traffic unless `quiet`.
pub(crate) fn show(quiet: bool) -> impl FnMut(service::Said) {
    move |said| match said {
        service::Said::Warning(w) => eprintln!("warning: {}", terminal(&w)),
        service::Said::Note(n) => eprintln!("note: {}", terminal(&n)),
        service::Said::Backend(b) if !quiet => eprintln!("backend: {}", terminal(&b)),
        service::Said::Traffic(t) if !quiet => eprintln!("GPU: {t}"),
        _ => {}
    }
}

/// What a user should know about the folders around a command's (stale scratch), on stderr.
fn note_all(notes: &[String]) {
    for n in notes {
        eprintln!("note: {}", terminal(n));
    }
}

/// Runs the command, its output (tables, JSON, summaries) into `out`; warnings, progress and
/// notes go to stderr.
pub(crate) fn run(cli: Cli, mut out: &mut dyn Write) -> Result<()> {
    match cli.command {
        Command::Merge(args) => run_merge(&args, &mut out),
        Command::Run(args) => run_recipe(&args, &mut out),
        Command::Methods(args) => run_methods(&args, &mut out),
        Command::Analyze(args) => run_analyze(&args, &mut out),
        Command::Demo(args) => run_demo(&args, &mut out),
        Command::Devices(args) => run_devices(&args, &mut out),
        Command::Verify(args) => run_verify(&args, &mut out),
        Command::Convert(args) => run_convert(&args, &mut out),
        Command::ExtractLora(args) => run_extract_lora(&args, &mut out),
        Command::Moe(args) => run_moe(&args, &mut out),
    }
}

fn run_verify(args: &VerifyArgs, out: &mut impl Write) -> Result<()> {
    let compute = service::Compute {
        threads: args.threads,
        ..service::Compute::on(args.device.into())
    };
    let v = crate::verify::verify_folder(&args.dir, args.against, &compute, &mut show(false))?;
    note_all(&v.notes);
    if args.json {
        let found = serde_json::json!({
            "path": args.dir.display().to_string(),
            "ok": v.problems.is_empty(),
            "checks": v.ok,
            "skipped": v.skipped,
            "problems": v.problems,
        });
        writeln!(out, "{}", serde_json::to_string_pretty(&found)?)?;
    } else {
        for line in &v.ok {
            writeln!(out, "ok    {line}")?;
        }
        for line in &v.skipped {
            writeln!(out, "skip  {line}")?;
        }
        for line in &v.problems {
            writeln!(out, "FAIL  {line}")?;
        }
    }
    if v.problems.is_empty() {
        if !args.json {
            writeln!(
                out,
                "{} verified: {} checks passed",
                args.dir.display(),
                v.ok.len()
            )?;
        }
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

fn run_devices(args: &super::DevicesArgs, out: &mut impl Write) -> Result<()> {
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
        let software = match a.is_software() {
            true => " — SOFTWARE (runs on the CPU; slower than --device cpu)",
            false => "",
        };
        writeln!(
            out,
            "{} — {:?}, {:?}, driver {} {}{software}",
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
    writeln!(
        out,
        "--device auto uses the CPU backend, and a hardware GPU (discrete first) for the spectral \
         methods only;\n--device gpu takes any adapter, software ones included"
    )?;
    if args.copy_rate {
        if let Some(ctx) = GpuContext::open(AdapterChoice::Any)? {
            let (up, down) = ctx.copy_rates(256 << 20, 3)?;
            writeln!(
                out,
                "copy rate on {}: {:.2} GB/s host to device, {:.2} GB/s device to host",
                terminal(&ctx.info.name),
                up / 1e9,
                down / 1e9
            )?;
        }
    }
    Ok(())
}

/// Prints the λ of each agent after a merge, each named as `agents` gives it.
fn print_lambdas(
    out: &mut impl Write,
    record: &crate::record::MergeRecord,
    agents: &[PathBuf],
) -> Result<()> {
    let scope = record.merging.method.scope().map_or("tensor", |s| s.name());
    for (a, name) in record.agents.iter().zip(agents) {
        let shown = match &a.name {
            Some(n) => format!("{n} ({})", name.display()),
            None => name.display().to_string(),
        };
        let name = terminal(&shown);
        match a.lambda {
            Some(l) => writeln!(out, "  λ = {l:.6}  {name}")?,
            None => writeln!(
                out,
                "  λ per {scope} (see {})  {name}",
                crate::record::RECORD_FILE,
            )?,
        }
    }
    Ok(())
}

fn run_merge(args: &MergeArgs, out: &mut impl Write) -> Result<()> {
    let job = match &args.config {
        Some(path) => Job::from_recipe(path, args.seed.seed)?,
        None => {
            let (base, agents) = args.inputs.folders()?;
            let tokenizer = args.inputs.tokenizer()?;
            Job::from_flags(base, agents, &args.method_flags(), tokenizer)?
        }
    };
    merge_job(job, &args.inputs.compute, &args.output, out)
}

/// `rlmerge run RECIPE [OUT]`: mergekit-yaml's command line, its options done the same way or
/// answered on stderr with rlmerge's equivalent.
fn run_recipe(args: &RunArgs, out: &mut impl Write) -> Result<()> {
    let mut output = args.output.clone();
    output.out = Some(OutputArgs::one_out(&args.output, args.out_dir.as_ref())?);
    let seed = super::mergekit_yaml::apply(&args.mergekit, &mut output, args.seed.seed)?;
    for note in super::mergekit_yaml::notes(&args.mergekit) {
        eprintln!("note: {note}");
    }
    let out_dir = output.one_out(None)?;
    let (job, summary) = service::run_recipe(
        &args.recipe,
        (seed, &args.compute.command_line(&output)),
        &args.compute.compute(),
        (&out_dir, output.force, args.intermediate_dir.as_deref()),
        &mut show(args.compute.quiet),
    )?;
    print_merged(out, &job, &out_dir, &summary)
}

impl OutputArgs {
    /// The output folder: `-o OUT_DIR`, or `positional` (`run`'s, as mergekit-yaml takes it).
    pub(crate) fn one_out(&self, positional: Option<&PathBuf>) -> Result<PathBuf> {
        match (&self.out, positional) {
            (Some(o), None) | (None, Some(o)) => Ok(o.clone()),
            (Some(_), Some(_)) => Err(usage(
                "the output folder is given twice (a second argument and -o): give it once",
            )),
            (None, None) => Err(usage("give the output folder with -o OUT_DIR")),
        }
    }
}

/// Runs a merge job with the compute and output flags through the merge service, and prints
/// what it merged (and each agent's λ).
fn merge_job(
    mut job: Job,
    compute: &ComputeArgs,
    output: &OutputArgs,
    out: &mut impl Write,
) -> Result<()> {
    job.set_command_line(&compute.command_line(output))?;
    let out_dir = output.one_out(None)?;
    let summary = service::merge(
        &job,
        &compute.compute(),
        (&out_dir, output.force),
        &mut show(compute.quiet),
    )?;
    print_merged(out, &job, &out_dir, &summary)
}

/// What a merge of `job` into `out_dir` made: its models, method and shards, and each agent's λ.
fn print_merged(
    out: &mut impl Write,
    job: &Job,
    out_dir: &Path,
    summary: &crate::engine::MergeSummary,
) -> Result<()> {
    let count = |n: usize, what: &str| match n {
        1 => format!("1 {what}"),
        n => format!("{n} {what}s"),
    };
    let stages = match job.stages.len() {
        0 => String::new(),
        n => format!(", the last of {} stages", n + 1),
    };
    writeln!(
        out,
        "merged {} into {} with {} ({}){stages}",
        count(job.agents.len(), "model"),
        terminal(&out_dir.display().to_string()),
        summary.record.merging.text(),
        count(summary.shards.len(), "shard"),
    )?;
    if !matches!(job.merging.method, Method::Combine(_)) {
        print_lambdas(out, &summary.record, &job.agents)?;
    }
    Ok(())
}

/// `rlmerge extract-lora`: the adapter through the service, then what it kept.
fn run_extract_lora(args: &super::ExtractLoraArgs, out: &mut impl Write) -> Result<()> {
    let req = crate::extract_lora::Request {
        base: locate(&args.base)?,
        model: locate(&args.model)?,
        rank: args.rank,
        rel_error: args.rel_error,
        distribute_scale: !args.no_distribute_scale,
        embed_lora: args.embed_lora,
        skip_undecomposable: args.skip_undecomposable,
        max_held_mib: args.max_held_mib,
        include: crate::extract_lora::any_of(&args.include),
        exclude: crate::extract_lora::any_of(&args.exclude),
        sv_epsilon: args.sv_epsilon,
        save_whole: args.save_module.clone(),
    };
    let done = service::extract_lora(
        &req,
        (&args.out, args.force),
        args.threads,
        &mut show(false),
    )?;
    writeln!(
        out,
        "extracted a rank-{} LoRA of {} into {}: {} modules factored, keeping {:.1} % of the \
         update's energy (‖Δ_r‖/‖Δ‖); {} saved whole, {} left out, {} unchanged",
        args.rank,
        terminal(&args.model.display().to_string()),
        terminal(&args.out.display().to_string()),
        done.modules.len(),
        100.0 * done.kept(),
        done.whole.len(),
        done.skipped.len(),
        done.unchanged
    )?;
    let mut modules: Vec<&crate::extract_lora::Kept> = done.modules.iter().collect();
    if !args.verbose {
        modules.sort_by(|a, b| a.kept.total_cmp(&b.kept));
        modules.truncate(5);
        if !modules.is_empty() {
            writeln!(out, "least kept (-v lists every module):")?;
        }
    }
    for m in modules {
        writeln!(
            out,
            "  rank {:>4}  kept {:>6.2} %  {}",
            m.rank,
            100.0 * m.kept,
            terminal(&m.module)
        )?;
    }
    Ok(())
}

/// `rlmerge moe CONFIG [OUT]`: mergekit-moe's command line, its merge options done the same way
/// or answered on stderr; the MoE through the service.
fn run_moe(args: &super::MoeArgs, out: &mut impl Write) -> Result<()> {
    let mut output = args.output.clone();
    output.out = Some(OutputArgs::one_out(&args.output, args.out_dir.as_ref())?);
    let seed = super::mergekit_yaml::apply(&args.mergekit, &mut output, args.seed)?;
    let mut notes = super::mergekit_yaml::notes(&args.mergekit);
    if args.load_in_4bit || args.load_in_8bit {
        notes.push(
            "--load-in-4bit/--load-in-8bit: they load the model for gate_mode hidden's forward \
             pass, which rlmerge does not run"
                .into(),
        );
    }
    for note in notes {
        eprintln!("note: {}", terminal(&note));
    }
    let out_dir = output.one_out(None)?;
    let options = crate::moe::Options {
        shard_bytes: output
            .shard_size
            .unwrap_or(crate::checkpoint::writer::DEFAULT_SHARD_SIZE),
        allow_nonfinite: args.allow_nonfinite,
        show_progress: !args.quiet,
    };
    let (config, built) = service::moe_recipe(
        &args.config,
        (seed, args.allow_all_same, output.out_dtype),
        (&out_dir, output.force, args.intermediate_dir.as_deref()),
        (options, args.threads),
        &mut show(args.quiet),
    )?;
    writeln!(
        out,
        "built a {} of {} experts ({} per token, routers by {}) into {}: {} tensors, {} in {}",
        built.layout.class(),
        config.experts.len(),
        config.experts_per_token,
        config.gate_mode.name(),
        terminal(&out_dir.display().to_string()),
        built.tensors,
        crate::checkpoint::writer::size_text(built.bytes),
        built.dtype.torch_name()
    )?;
    Ok(())
}

/// `rlmerge convert`: the source as one model through the merge service (a passthrough of it,
/// which its record and saved recipe say), on the CPU.
fn run_convert(args: &ConvertArgs, out: &mut impl Write) -> Result<()> {
    let source = locate(&args.source)?;
    let mut job = Job::conversion(source.clone())?;
    let compute = ComputeArgs {
        epsilon: None,
        threads: args.threads,
        quiet: args.quiet,
        device: DeviceChoice::Cpu,
        tile_elems: args.tile_elems,
        allow_nonfinite: args.allow_nonfinite,
        allow_missing_tensors: false,
        allow_dense_agents: true,
        raw_f32_agents: args.raw_f32,
        gpu_chunk_elems: None,
    };
    job.set_command_line(&compute.command_line(&args.output))?;
    let out_dir = args.output.one_out(None)?;
    let summary = service::merge(
        &job,
        &compute.compute(),
        (&out_dir, args.output.force),
        &mut show(args.quiet),
    )?;
    writeln!(
        out,
        "converted {} into {} ({} shard(s))",
        terminal(&args.source.display().to_string()),
        terminal(&out_dir.display().to_string()),
        summary.shards.len()
    )?;
    Ok(())
}

fn run_analyze(args: &AnalyzeArgs, out: &mut impl Write) -> Result<()> {
    let compute = &args.inputs.compute;
    let (base, agents) = args.inputs.folders()?;
    let analysis = service::Analysis {
        base,
        agents,
        names: args.inputs.names.clone(),
        tokenizer: args.inputs.tokenizer()?,
        epsilon: compute.epsilon,
        allow_missing_tensors: compute.allow_missing_tensors,
        allow_nonfinite: compute.allow_nonfinite,
        raw_f32_agents: compute.raw_f32_agents,
        merged: args.merged.clone(),
        plot: args.plot.clone(),
        per_tensor: args.per_tensor,
    };
    let found = service::analyze(&analysis, &compute.compute(), &mut show(true))?;
    for path in &found.figures {
        if !compute.quiet {
            eprintln!("wrote {}", path.display());
        }
    }
    if args.json {
        let v = found.to_json(args.per_tensor);
        writeln!(out, "{}", serde_json::to_string_pretty(&v)?)?;
    } else {
        write!(out, "{}", found.render_text(args.per_tensor))?;
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
    // RAM+ from the command line's defaults, on the CPU; the demo replaces only its own earlier
    // output (checked above).
    let job = Job::from_flags(base.clone(), agents.clone(), &Default::default(), None)?;
    let compute = service::Compute {
        show_progress: !args.quiet,
        ..service::Compute::on(service::Device::Cpu)
    };
    // Global RAM+ probes the whole model first; its report is the analysis to show.
    let summary = service::merge(&job, &compute, (&merged, true), &mut show(true))?;
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
    print_lambdas(out, &summary.record, &agents)?;
    writeln!(
        out,
        "\nmerged checkpoint: {} ({}; model card README.md, record {})",
        merged.display(),
        summary.shards.join(", "),
        crate::record::RECORD_FILE
    )?;
    Ok(())
}
