//! The commands behind the arguments: each turns its flags into library calls and prints the
//! result.

pub use super::methods::run_methods;
use super::{
    AnalyzeArgs, Cli, Command, ComputeArgs, DemoArgs, DeviceChoice, InputArgs, MergeArgs,
    OutputArgs, RunArgs, VerifyArgs,
};
use anyhow::{Context, Result};
use rlmerge::backend::cpu::CpuBackend;
use rlmerge::backend::gpu::{list_adapters, AdapterChoice, GpuBackend, GpuContext};
use rlmerge::backend::Backend;
use rlmerge::checkpoint::output_folder;
use rlmerge::demo;
use rlmerge::engine::{self, MergeOptions, PassOptions};
use rlmerge::error::usage;
use rlmerge::escape::terminal;
use rlmerge::inputs::{Inputs, Layout};
use rlmerge::job::{Job, MERGEKIT_CONFIG_FILE};
use rlmerge::method::catalog::Cost;
use rlmerge::method::Method;
use std::io::{IsTerminal, Write};
use std::path::{Path, PathBuf};

impl InputArgs {
    /// The base and agent folders given with --base and --model.
    fn folders(&self) -> Result<(PathBuf, Vec<PathBuf>)> {
        match (&self.base, self.models.is_empty()) {
            // A name that is no path but a Hub id (org/name[@revision]): the cache's snapshot,
            // downloaded first unless HF_HUB_OFFLINE.
            (Some(b), false) => {
                let progress = std::io::stderr().is_terminal();
                // BASE+ADAPTER (a LoRA agent): each part found as a model is.
                let locate = |p: &PathBuf| match p
                    .to_str()
                    .and_then(rlmerge::checkpoint::lora::split_reference)
                {
                    Some((b, a)) => {
                        let b = rlmerge::hub::locate(Path::new(b), progress)?;
                        let a = rlmerge::hub::locate(Path::new(a), progress)?;
                        Ok(PathBuf::from(format!("{}+{}", b.display(), a.display())))
                    }
                    None => rlmerge::hub::locate(p, progress),
                };
                let models = self.models.iter().map(locate).collect::<Result<_>>()?;
                Ok((locate(b)?, models))
            }
            _ => Err(usage(
                "give the models with --base DIR and --model DIR (repeat for each agent), or a recipe with --config",
            )),
        }
    }

    /// `--tokenizer-source`: base, union, or a model (a folder or Hub id, as for --model).
    fn tokenizer(&self) -> Result<Option<rlmerge::vocabulary::TokenizerSettings>> {
        use rlmerge::vocabulary::{parse_source, TokenizerSettings};
        let Some(text) = &self.tokenizer_source else {
            return Ok(None);
        };
        let locate = |name: &str| -> Result<PathBuf> {
            let bad = |what: &str| {
                usage(format!(
                    "--tokenizer-source '{name}' {what}; give base, union or a model folder \
                     (or Hub id) with a tokenizer.json"
                ))
            };
            if name.trim().is_empty() {
                return Err(bad("is empty"));
            }
            let p = rlmerge::hub::locate(Path::new(name), std::io::stderr().is_terminal())
                .with_context(|| {
                    format!("--tokenizer-source {name}: use base, union or a model")
                })?;
            match std::fs::metadata(&p) {
                Ok(m) if m.is_dir() => Ok(p),
                Ok(_) => Err(bad("is not a folder")),
                Err(_) => Err(bad("does not exist")),
            }
        };
        Ok(Some(TokenizerSettings {
            source: parse_source(text, &locate)?,
            tokens: Vec::new(),
            pad_to_multiple_of: None,
        }))
    }
}

impl ComputeArgs {
    fn check(&self) -> Result<()> {
        if let Some(e) = self.epsilon {
            rlmerge::method::build::epsilon_value(e)
                .map_err(|e| usage(format!("--epsilon: {e:#}")))?;
        }
        if self.tile_elems == Some(0) {
            return Err(usage("--tile-elems must be ≥ 1"));
        }
        Ok(())
    }

    /// The backend to recompute the merge recorded in `dir` with (`verify --against`).
    #[allow(dead_code)] // the Python extension's verify (python/src/lib.rs)
    pub(crate) fn backend_for_record(&self, dir: &Path) -> Result<Box<dyn Backend>> {
        verify_backend(self.device, self.threads, dir)
    }

    /// The backend for a job of this cost (see [`make_backend`]).
    pub(crate) fn backend(&self, cost: Cost) -> Result<Box<dyn Backend>> {
        make_backend(self.device, self.threads, self.gpu_chunk_elems, cost)
    }

    /// ε as given, else the default.
    fn epsilon(&self) -> f32 {
        // Checked by `check` before any pass runs.
        self.epsilon
            .map_or(rlmerge::method::DEFAULT_EPSILON, |e| e as f32)
    }

    fn pass(&self, backend: &dyn Backend) -> PassOptions {
        PassOptions {
            epsilon: self.epsilon(),
            tile_elems: self
                .tile_elems
                .unwrap_or_else(|| backend.preferred_tile_elems()),
            scan_nonfinite: !self.allow_nonfinite,
        }
    }

    /// Warnings for agents that look dense (see `Inputs::dense_agent_warnings`), unless
    /// `--allow-dense-agents`; ε from the recipe when it sets one.
    fn dense_agent_warnings(&self, inputs: &Inputs, epsilon: Option<f32>) -> Result<Vec<String>> {
        if self.allow_dense_agents {
            return Ok(Vec::new());
        }
        inputs.dense_agent_warnings(epsilon.unwrap_or(self.epsilon()))
    }

    /// Progress on stderr: a bar on a terminal, a line every few seconds elsewhere.
    fn show_progress(&self) -> bool {
        !self.quiet
    }
}

/// The backend `device` asks for (see [`DeviceChoice`]) for a job of this `cost`. `auto` takes a
/// hardware GPU for the spectral methods only: the elementwise ones are bound by reading the
/// files, and on the one GPU measured (an H200, README's GPU figures) they ran 1.5–3.5× slower
/// than the CPU backend — so for them it does not load the GPU stack at all. A software adapter
/// (lavapipe) is used only when asked for, with a warning.
fn make_backend(
    device: DeviceChoice,
    threads: usize,
    gpu_chunk_elems: Option<usize>,
    cost: Cost,
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
            Some(ctx) => {
                if ctx.is_software() {
                    eprintln!(
                        "warning: {} is a software adapter (it runs on the CPU): merges on it \
                         run many times slower than --device cpu (16-40x measured on lavapipe)",
                        terminal(&ctx.describe())
                    );
                }
                Ok(gpu(ctx))
            }
            None => Err(anyhow::anyhow!(
                "--device gpu: wgpu found no GPU adapter (Vulkan, Metal or DX12). On Linux without a GPU, \
                 install Mesa's software Vulkan driver lavapipe (Debian/Ubuntu: apt-get install \
                 mesa-vulkan-drivers libvulkan1); or use --device cpu"
            )),
        },
        DeviceChoice::Auto if cost != Cost::Spectral => Ok(Box::new(CpuBackend::new(threads)?)),
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

/// What a merge's method costs, SVC included (it decomposes every matrix).
fn job_cost(method: &Method, svc: Option<f64>) -> Cost {
    match svc {
        Some(_) => Cost::Spectral,
        None => method.kind().cost(),
    }
}

fn warn_all(warnings: &[String]) {
    for w in warnings {
        eprintln!("warning: {}", terminal(w));
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
pub fn run(cli: Cli, mut out: &mut dyn Write) -> Result<()> {
    match cli.command {
        Command::Merge(args) => run_merge(&args, &mut out),
        Command::Run(args) => run_recipe(&args, &mut out),
        Command::Methods(args) => run_methods(&args, &mut out),
        Command::Analyze(args) => run_analyze(&args, &mut out),
        Command::Demo(args) => run_demo(&args, &mut out),
        Command::Devices(args) => run_devices(&args, &mut out),
        Command::Verify(args) => run_verify(&args, &mut out),
    }
}

/// The backend `verify --against` recomputes the merge recorded in `dir` on: the one `device`
/// names, where `auto` takes the backend the record says made it — the spectral methods' bytes
/// depend on it — a GPU where there is a hardware one, else the CPU (verify then compares within
/// their tolerance, and says so).
fn verify_backend(device: DeviceChoice, threads: usize, dir: &Path) -> Result<Box<dyn Backend>> {
    let record = rlmerge::record::MergeRecord::read(dir)?;
    let cost = job_cost(&record.method, record.svc);
    let device = match (device, record.backend.as_deref()) {
        (DeviceChoice::Auto, Some("cpu")) => DeviceChoice::Cpu,
        (DeviceChoice::Auto, Some("gpu")) => {
            return make_backend(DeviceChoice::Auto, threads, None, Cost::Spectral)
        }
        (device, _) => device,
    };
    make_backend(device, threads, None, cost)
}

fn run_verify(args: &VerifyArgs, out: &mut impl Write) -> Result<()> {
    let backend = match args.against {
        true => Some(verify_backend(args.device, args.threads, &args.dir)?),
        false => None,
    };
    let v = rlmerge::verify::verify(&args.dir, backend.as_deref())?;
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
    record: &rlmerge::record::MergeRecord,
    agents: &[PathBuf],
) -> Result<()> {
    let scope = record.method.scope().map_or("tensor", |s| s.name());
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
                rlmerge::record::RECORD_FILE,
            )?,
        }
    }
    Ok(())
}

fn run_merge(args: &MergeArgs, out: &mut impl Write) -> Result<()> {
    let job = match &args.config {
        Some(path) => Job::from_recipe(path, args.output.seed)?,
        None => {
            let (base, agents) = args.inputs.folders()?;
            let tokenizer = args.inputs.tokenizer()?;
            Job::from_flags(base, agents, &args.method_flags(), tokenizer)?
        }
    };
    merge_job(job, &args.inputs.compute, &args.output, out).map(drop)
}

fn run_recipe(args: &RunArgs, out: &mut impl Write) -> Result<()> {
    let job = Job::from_recipe(&args.recipe, args.output.seed)?;
    merge_job(job, &args.compute, &args.output, out).map(drop)
}

/// Runs a merge job with the compute and output options; the one path of `merge`, `run` and the
/// Python API's merges. Returns what was written (the record, the shards).
pub fn merge_job(
    mut job: Job,
    compute: &ComputeArgs,
    output: &OutputArgs,
    out: &mut impl Write,
) -> Result<rlmerge::engine::MergeSummary> {
    compute.check()?;
    job.set_command_line(&rlmerge::job::CommandLine {
        epsilon: compute.epsilon,
        out_dtype: output.out_dtype,
        shard_size: output.shard_size,
        allow_nonfinite: compute.allow_nonfinite,
        allow_missing_tensors: compute.allow_missing_tensors,
        raw_f32_agents: compute.raw_f32_agents,
    })?;
    let mut inputs = Inputs::open_with(
        &job.base,
        &job.agents,
        Layout {
            slices: job.slices.as_ref(),
            tokenizer: job.tokenizer.as_ref(),
            with_base: job.method.uses_base(),
            allow_missing_tensors: job.allow_missing_tensors,
            raw_f32_agents: job.raw_f32_agents,
        },
    )?;
    inputs.set_names(job.names.clone())?;
    warn_all(&inputs.warnings);
    let dense = compute.dense_agent_warnings(&inputs, job.epsilon)?;
    warn_all(&dense);
    let cost = job_cost(&job.method, job.svc);
    let backend = compute.backend(cost)?;
    if !compute.quiet {
        eprintln!(
            "backend: {}",
            backend_choice(compute.device, cost, backend.as_ref())
        );
    }
    let mut pass = compute.pass(backend.as_ref());
    if let Some(e) = job.epsilon {
        pass.epsilon = e;
    }
    pass.scan_nonfinite = !job.allow_nonfinite;
    let options = MergeOptions {
        method: job.method.clone(),
        pass,
        out_dtype: job.out_dtype,
        shard_size: job
            .shard_size
            .unwrap_or(rlmerge::checkpoint::writer::DEFAULT_SHARD_SIZE),
        force: output.force,
        show_progress: compute.show_progress(),
        extra_files: vec![(
            MERGEKIT_CONFIG_FILE.to_string(),
            job.saved_recipe(&output.out)?,
        )],
        protect: job
            .recipe_path
            .iter()
            .cloned()
            .chain(job.tokenizer.iter().flat_map(|t| t.folders()))
            .collect(),
        svc: job.svc,
        warnings: dense,
        config_from: job.config_source()?,
    };
    let summary = engine::merge(&inputs, &options, backend.as_ref(), &output.out).map_err(|e| {
        if rlmerge::error::is_usage(&e) {
            e // says itself that nothing was touched
        } else {
            e.context(format!(
                "merge into {} failed; nothing was written there",
                output.out.display()
            ))
        }
    })?;
    // Warnings found while merging (identical inputs), after those given before it.
    warn_all(&summary.record.warnings[inputs.warnings.len() + options.warnings.len()..]);
    if let Some(traffic) = backend.traffic().filter(|_| !compute.quiet) {
        eprintln!("GPU: {traffic}");
    }
    note_all(&summary.notes);
    writeln!(
        out,
        "merged {} model(s) into {} with {} ({} shard(s))",
        inputs.agents.len(),
        terminal(&output.out.display().to_string()),
        summary.record.method_text(),
        summary.shards.len()
    )?;
    if !matches!(job.method, Method::Combine(_)) {
        print_lambdas(out, &summary.record, &job.agents)?;
    }
    Ok(summary)
}

/// The backend a merge runs on, with why `--device auto` chose it.
fn backend_choice(device: DeviceChoice, cost: Cost, backend: &dyn Backend) -> String {
    let why = match (device, cost) {
        (DeviceChoice::Auto, Cost::Spectral) if backend.kind() == "cpu" => {
            " (--device auto: a spectral method, which runs on a hardware GPU; none here)"
        }
        (DeviceChoice::Auto, Cost::Spectral) => {
            " (--device auto: a spectral method runs on a hardware GPU)"
        }
        (DeviceChoice::Auto, _) => {
            " (--device auto: this method is bound by reading the files, where the CPU backend \
             is the faster; --device gpu to use a GPU)"
        }
        _ => "",
    };
    format!("{}{why}", backend.describe())
}

pub fn run_analyze(args: &AnalyzeArgs, out: &mut impl Write) -> Result<()> {
    let compute = &args.inputs.compute;
    compute.check()?;
    let (base, agents) = args.inputs.folders()?;
    let tokenizer = args.inputs.tokenizer()?;
    let layout = Layout {
        tokenizer: tokenizer.as_ref(),
        with_base: true,
        allow_missing_tensors: compute.allow_missing_tensors,
        raw_f32_agents: compute.raw_f32_agents,
        ..Layout::default()
    };
    let mut inputs = Inputs::open_with(&base, &agents, layout)?;
    inputs.set_names(args.inputs.names.iter().cloned().map(Some).collect())?;
    warn_all(&inputs.warnings);
    warn_all(&compute.dense_agent_warnings(&inputs, None)?);
    // Scratch that killed merges left beside the models analyzed, or where figures go.
    let near: Vec<std::path::PathBuf> = inputs
        .paths()
        .iter()
        .chain(args.merged.iter())
        .filter_map(|p| p.parent().map(Path::to_path_buf))
        .chain(args.plot.iter().cloned())
        .collect();
    note_all(&output_folder::stale_notes(&near));
    // Bad --merged or --plot paths fail before the probe reads anything.
    if let Some(dir) = &args.merged {
        let real = |p: &Path| std::fs::canonicalize(p).unwrap_or_else(|_| p.to_path_buf());
        let merged_real = real(dir);
        let input = std::iter::once(&inputs.base)
            .chain(&inputs.agents)
            .find(|m| {
                real(&m.dir) == merged_real
                    || real(m.config_dir()) == merged_real && m.lora.is_none()
            });
        if let Some(m) = input {
            return Err(usage(format!(
                "--merged {} is an input of this analysis ({}); give the folder the merge wrote",
                dir.display(),
                m.dir.display()
            )));
        }
    }
    let merged = match &args.merged {
        Some(dir) => Some(
            rlmerge::checkpoint::ModelFolder::open(dir)
                .with_context(|| format!("cannot open the merged folder {}", dir.display()))?,
        ),
        None => None,
    };
    // Figures go next to the models, never into them: the same rule as a merge's -o.
    let mut protect = inputs.paths();
    protect.extend(merged.iter().flat_map(|m| m.paths()));
    if let Some(dir) = &args.plot {
        let resolved = output_folder::resolve_output(dir)?;
        output_folder::refuse_inside(dir, &resolved, &protect)?;
    }
    let backend = compute.backend(Cost::Stream)?;
    let pass = compute.pass(backend.as_ref());
    let report = engine::probe_all(&inputs, backend.as_ref(), &pass, compute.show_progress())?;
    let retention = match &merged {
        Some(m) => Some(engine::retention(
            &inputs,
            m,
            &pass,
            compute.show_progress(),
        )?),
        None => None,
    };
    if let Some(dir) = &args.plot {
        let figures = rlmerge::figures::write_all(
            &report,
            retention.as_ref(),
            dir,
            args.per_tensor,
            &protect,
        )?;
        for path in figures {
            if !compute.quiet {
                eprintln!("wrote {}", path.display());
            }
        }
    }
    if args.json {
        let mut v = report.to_json(args.per_tensor);
        if let Some(r) = &retention {
            v["retention"] = r.to_json();
        }
        writeln!(out, "{}", serde_json::to_string_pretty(&v)?)?;
    } else {
        write!(out, "{}", report.render_text(args.per_tensor))?;
        if let Some(r) = &retention {
            write!(out, "{}", r.render_text())?;
        }
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
    let show = !args.quiet;
    // The demo replaces only its own earlier output (checked above).
    let options = MergeOptions {
        force: true,
        show_progress: show,
        ..MergeOptions::new(Method::default_ram_plus(), backend.as_ref())
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
    print_lambdas(out, &summary.record, &agents)?;
    writeln!(
        out,
        "\nmerged checkpoint: {} ({}; model card README.md, record {})",
        merged.display(),
        summary.shards.join(", "),
        rlmerge::record::RECORD_FILE
    )?;
    Ok(())
}
