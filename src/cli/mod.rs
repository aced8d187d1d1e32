//! The command line, a front end of the library: argument definitions (the one module that uses
//! clap, behind the default `cli` feature) and the commands, which turn flags into library data —
//! method flags a [`crate::job::MethodFlags`], compute flags a [`crate::service::Compute`] —
//! call the merge service ([`crate::service`]) and print what it returns and says. The binary
//! (`src/main.rs`) and the command the Python package installs (`python/src/lib.rs`'s `call`)
//! run it through [`run_args`].
//!
//! Exit codes: 0 success, 1 the merge/analysis failed (bad input, I/O), 2 usage error, 130
//! interrupted.

mod commands;
mod mergekit_yaml;
mod methods;

use commands::run;

/// What a command's result means for the user: the exit code, and the one-line error to print
/// (`error: …`, names read from files escaped) unless it succeeded.
pub fn outcome(result: anyhow::Result<()>) -> (u8, Option<String>) {
    match result {
        Ok(()) => (0, None),
        // A closed pipe (`rlmerge analyze | head`) is the reader's choice, not a failure.
        Err(err)
            if err
                .chain()
                .filter_map(|e| e.downcast_ref::<std::io::Error>())
                .any(|e| e.kind() == std::io::ErrorKind::BrokenPipe) =>
        {
            (0, None)
        }
        Err(err) => {
            let message = format!("error: {}", crate::escape::terminal(&format!("{err:#}")));
            let code = if crate::cancel::is_interrupted(&err) {
                130
            } else if crate::error::is_usage(&err) {
                2
            } else {
                1
            };
            (code, Some(message))
        }
    }
}

/// Parses `args` (the program name first) and runs the command, its output into `out`: the exit
/// code and the error line, as [`outcome`]. Help and version requests print and succeed; bad
/// arguments give clap's message and exit code 2.
pub fn run_args<I, T>(args: I, out: &mut dyn std::io::Write) -> (u8, Option<String>)
where
    I: IntoIterator<Item = T>,
    T: Into<std::ffi::OsString> + Clone,
{
    use clap::Parser;
    match Cli::try_parse_from(args) {
        Ok(cli) => outcome(run(cli, out)),
        Err(e) if !e.use_stderr() => {
            let _ = write!(out, "{}", e.render());
            (0, None)
        }
        Err(e) => (2, Some(e.render().to_string().trim_end().to_string())),
    }
}

use crate::checkpoint::writer::parse_size;
use crate::checkpoint::DType;
use crate::job::{parse_dtype, parse_param, MethodFlags, ParamValue};
use crate::method::{BoostScope, Kind, SharedRule};
use clap::builder::{PossibleValue, PossibleValuesParser, TypedValueParser};
use clap::{Args, Parser, Subcommand, ValueEnum};
use std::path::PathBuf;

#[derive(Parser, Debug)]
#[command(
    name = "rlmerge",
    version,
    about = "Merge RL-trained LLM agents into one checkpoint with Reinforced Agent Merging (RAM / RAM+)"
)]
pub(crate) struct Cli {
    #[command(subcommand)]
    pub(crate) command: Command,
}

#[derive(Subcommand, Debug)]
pub(crate) enum Command {
    /// Merge agents fine-tuned from one base into a new Hugging Face folder.
    Merge(MergeArgs),
    /// Run a mergekit YAML recipe (models as folders or Hugging Face Hub ids).
    Run(RunArgs),
    /// The merge methods with their cost; `methods NAME` gives one's parameters and defaults.
    Methods(MethodsArgs),
    /// Probe the task vectors: what each agent changed, what is shared, ρ_t and λ_t.
    Analyze(AnalyzeArgs),
    /// Write a small built-in example (a base and three agents), analyze it and merge it with RAM+.
    Demo(DemoArgs),
    /// List the GPU adapters wgpu sees, with the limits that size rlmerge's tiles.
    Devices(DevicesArgs),
    /// Check a merged folder against the checksums its record holds (outputs and inputs).
    Verify(VerifyArgs),
    /// Convert a checkpoint as a trainer wrote it (verl FSDP shards, pytorch_model.bin,
    /// BASE+ADAPTER…) into a Hugging Face safetensors folder, streamed in bounded memory.
    Convert(ConvertArgs),
    /// Extract a PEFT LoRA adapter of a fine-tuned model against its base (mergekit's
    /// mergekit-extract-lora), and say what its rank keeps of the update.
    ExtractLora(ExtractLoraArgs),
    /// Build a mixture of experts from fine-tunes of one base (mergekit's mergekit-moe): the
    /// base's attention and embeddings, each expert's MLPs from one model, routers from prompts.
    Moe(MoeArgs),
}

#[derive(Args, Debug)]
pub(crate) struct MoeArgs {
    /// mergekit-moe's YAML config (base_model, experts with source_model and prompts, gate_mode
    /// cheap_embed or random, dtype, experts_per_token, shared_experts, architecture); or a
    /// multi-stage recipe of merges whose final stage is that config, naming them as experts.
    #[arg(value_name = "CONFIG.yml")]
    pub(crate) config: PathBuf,
    /// Output folder, as mergekit-moe takes it (or -o OUT_DIR).
    #[arg(value_name = "OUT_DIR")]
    pub(crate) out_dir: Option<PathBuf>,
    /// A multi-stage recipe's merges (the stages before its final MoE config) are written to
    /// DIR/NAME and kept [default: scratch beside the output, removed when the run ends].
    #[arg(long, short = 'I', value_name = "DIR")]
    pub(crate) intermediate_dir: Option<PathBuf>,
    /// Seed of random routers (gate_mode random, uniform_random) and of experts' noise_scale
    /// [default: the config's seed, else 0].
    #[arg(long)]
    pub(crate) seed: Option<u64>,
    /// No progress on stderr.
    #[arg(long, short)]
    pub(crate) quiet: bool,
    /// Let every expert be the same model (a MoE to train further).
    #[arg(long, alias = "i-understand-this-is-not-useful-without-training")]
    pub(crate) allow_all_same: bool,
    /// Copy NaN and ±Inf as they are instead of refusing inputs that hold them.
    #[arg(long)]
    pub(crate) allow_nonfinite: bool,
    /// Worker threads (0 = all cores).
    #[arg(long, default_value_t = 0)]
    pub(crate) threads: usize,
    #[arg(long, hide = true)]
    pub(crate) load_in_4bit: bool,
    #[arg(long, hide = true)]
    pub(crate) load_in_8bit: bool,
    #[command(flatten)]
    pub(crate) mergekit: MergekitYamlArgs,
    #[command(flatten)]
    pub(crate) output: OutputArgs,
}

#[derive(Args, Debug)]
pub(crate) struct ExtractLoraArgs {
    /// The base model (a folder or a Hugging Face Hub id).
    #[arg(long, alias = "base-model")]
    pub(crate) base: PathBuf,
    /// The fine-tuned model.
    #[arg(long)]
    pub(crate) model: PathBuf,
    /// Rank of every factored module (the most, with --rel-error).
    #[arg(long, alias = "max-rank", default_value_t = crate::extract_lora::DEFAULT_RANK)]
    pub(crate) rank: usize,
    /// Give each module the least rank whose relative error ‖Δ − Δ_r‖/‖Δ‖ is at most this
    /// (at most --rank).
    #[arg(long, value_name = "ERROR")]
    pub(crate) rel_error: Option<f64>,
    /// The singular values on B alone (B = U·S, A = Vᵀ) instead of √S on each.
    #[arg(long)]
    pub(crate) no_distribute_scale: bool,
    /// Factor the input embeddings too (lora_embedding_A/B) instead of saving them whole.
    #[arg(long)]
    pub(crate) embed_lora: bool,
    /// Leave changed vectors (norms, biases) out instead of saving them whole.
    #[arg(long)]
    pub(crate) skip_undecomposable: bool,
    /// Hold a matrix's update in memory (f32) for the Lanczos process only up to this many MiB;
    /// a larger one is factored from its Gram matrix as it is read from the files, as every
    /// update the Gram path factors (a rank over 32, a long thin matrix) is.
    #[arg(long, value_name = "MIB", default_value_t = crate::extract_lora::DEFAULT_MAX_HELD_MIB)]
    pub(crate) max_held_mib: usize,
    /// Drop singular values at most this (mergekit's --sv-epsilon).
    #[arg(long, value_name = "EPSILON", default_value_t = 0.0)]
    pub(crate) sv_epsilon: f64,
    /// Save this module whole (its name, or its last parts: `lm_head`); may be repeated.
    #[arg(long, value_name = "MODULE")]
    pub(crate) save_module: Vec<String>,
    /// Only modules whose name matches REGEX (mergekit's -i/--include-regex); may be repeated.
    #[arg(long, short = 'i', value_name = "REGEX", aliases = ["include-regex", "include-regexes"])]
    pub(crate) include: Vec<String>,
    /// No module whose name matches REGEX (mergekit's -e/--exclude-regex); may be repeated.
    #[arg(long, short = 'e', value_name = "REGEX", aliases = ["exclude-regex", "exclude-regexes"])]
    pub(crate) exclude: Vec<String>,
    /// Worker threads (0 = all cores).
    #[arg(long, default_value_t = 0)]
    pub(crate) threads: usize,
    /// Every module's rank and kept share on stdout, not only the summary.
    #[arg(long, short)]
    pub(crate) verbose: bool,
    /// Replace the output folder if it exists (only once the new one is complete).
    #[arg(long)]
    pub(crate) force: bool,
    /// The adapter folder.
    #[arg(
        short = 'o',
        long = "out",
        value_name = "ADAPTER_DIR",
        alias = "out-path"
    )]
    pub(crate) out: PathBuf,
}

#[derive(Args, Debug)]
pub(crate) struct DevicesArgs {
    /// Also measure the host→device and device→host copy rates of the adapter `--device gpu`
    /// would take (256 MiB each way, best of 3): the limit of an elementwise merge on it.
    #[arg(long)]
    pub(crate) copy_rate: bool,
}

#[derive(Args, Debug)]
pub(crate) struct MethodsArgs {
    /// One method (or svc, the modifier): its parameters, defaults, reference and an example.
    pub(crate) name: Option<String>,
    /// Print JSON on stdout instead of the table.
    #[arg(long)]
    pub(crate) json: bool,
}

#[derive(Args, Debug)]
pub(crate) struct VerifyArgs {
    /// The merged folder.
    pub(crate) dir: PathBuf,
    /// Also recompute the merge from the record's inputs and compare the bytes.
    #[arg(long)]
    pub(crate) against: bool,
    /// Where to recompute with --against.
    #[arg(long, value_enum, default_value = "auto")]
    pub(crate) device: DeviceChoice,
    /// Worker threads of the CPU backend (0 = all cores).
    #[arg(long, default_value_t = 0)]
    pub(crate) threads: usize,
    /// Print what was found as JSON on stdout ({"path", "ok", "checks", "skipped", "problems"});
    /// the exit code is still 1 when a check failed.
    #[arg(long)]
    pub(crate) json: bool,
}

/// Where the probe and merge passes run.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub(crate) enum DeviceChoice {
    /// The CPU backend, and a hardware GPU for the spectral methods where there is one.
    Auto,
    /// A GPU adapter, software ones (lavapipe) included; an error if there is none.
    Gpu,
    /// The native CPU backend.
    Cpu,
}

/// Inputs and compute options shared by `merge` and `analyze`.
#[derive(Args, Debug)]
pub(crate) struct InputArgs {
    /// The base model all agents were fine-tuned from: a folder, or a Hugging Face Hub id
    /// (org/name or org/name@revision) taken from the HF cache or downloaded into it.
    #[arg(long, value_name = "DIR|ID")]
    pub(crate) base: Option<PathBuf>,
    /// An agent model, folder or Hub id (repeat for each agent).
    #[arg(long = "model", value_name = "DIR|ID")]
    pub(crate) models: Vec<PathBuf>,
    /// A name for the agents, in the order of --model (repeat): what tables, figures and the
    /// model card call them [default: the parts of their paths that tell them apart].
    #[arg(long = "name", value_name = "NAME")]
    pub(crate) names: Vec<String>,
    /// The output's vocabulary, as mergekit's tokenizer_source: base, union, or a model folder
    /// (model:DIR or DIR). Agents whose embeddings differ in rows (added tokens) then merge token
    /// by token (SPEC §5b) [default: the base's tokenizer, every model of the base's shape].
    #[arg(long, value_name = "base|union|MODEL")]
    pub(crate) tokenizer_source: Option<String>,
    #[command(flatten)]
    pub(crate) compute: ComputeArgs,
}

/// How and where the passes run.
#[derive(Args, Debug)]
pub(crate) struct ComputeArgs {
    /// Threshold: an element is changed when |θ_t − θ₀| > ε (absolute) [default: 1e-5, or a
    /// recipe's epsilon parameter].
    #[arg(long)]
    pub(crate) epsilon: Option<f64>,
    /// Worker threads of the CPU backend, its statistics scans included (0 = all cores).
    #[arg(long, default_value_t = 0)]
    pub(crate) threads: usize,
    /// No progress bars.
    #[arg(long, short)]
    pub(crate) quiet: bool,
    /// Where to compute.
    #[arg(long, value_enum, default_value = "auto")]
    pub(crate) device: DeviceChoice,
    /// Elements per tile [default: the backend's preference] (tuning and tests; the result does
    /// not depend on it).
    #[arg(long, hide = true)]
    pub(crate) tile_elems: Option<usize>,
    /// Take inputs that hold NaN or ±Inf (merged by IEEE rules) instead of refusing them.
    #[arg(long)]
    pub(crate) allow_nonfinite: bool,
    /// Take agents that lack a tensor (it comes from the models that have it) and ignore tensors
    /// the base lacks, with a warning, instead of refusing such agents.
    #[arg(long)]
    pub(crate) allow_missing_tensors: bool,
    /// No warning for agents that changed nearly every element they share with the base (RL
    /// agents change few; a dense one may come from another base).
    #[arg(long)]
    pub(crate) allow_dense_agents: bool,
    /// Read agents' F32 weights over a BF16/F16 base as stored: by default they are fp32 master
    /// weights, read as their rounding to the base's dtype (a change below its step is no change);
    /// a verl checkpoint's masters too (by default read as bf16, as verl's converter writes them).
    #[arg(long)]
    pub(crate) raw_f32_agents: bool,
    /// Caps elements per GPU dispatch chunk (tests; the result does not depend on it).
    #[arg(long, hide = true)]
    pub(crate) gpu_chunk_elems: Option<usize>,
}

#[derive(Args, Debug)]
pub(crate) struct MergeArgs {
    #[command(flatten)]
    pub(crate) inputs: InputArgs,
    /// A mergekit YAML recipe giving the models, method and parameters (instead of --base,
    /// --model and --method).
    #[arg(long, value_name = "RECIPE.yml", conflicts_with_all = ["base", "models", "names", "method", "tokenizer_source", "config_from"])]
    pub(crate) config: Option<PathBuf>,
    /// Merge method [default: ram+] (`rlmerge methods` lists them with their parameters).
    #[arg(long, value_parser = parse_method)]
    pub(crate) method: Option<Kind>,
    /// A method parameter as KEY=VALUE (repeat), e.g. --param density=0.5, for every model; or
    /// one value per model in --model order, comma-separated: --param weight=0.7,0.3.
    #[arg(long = "param", value_name = "KEY=VALUE", value_parser = parse_param)]
    pub(crate) params: Vec<(String, ParamValue)>,
    /// RAM+ boost rule [default: paper; ramplus_tl: paper].
    #[arg(long, value_parser = PossibleValuesParser::new([
        PossibleValue::new("paper").help("λ = 1 + r·min(ρ, α) (the paper)"),
        PossibleValue::new("official").help("λ = 1 + (R − 1)·min(ρ, 1) (the authors' released script)"),
    ]))]
    pub(crate) rule: Option<String>,
    /// RAM+ scope of ρ: one λ per agent (global), or per agent and tensor, layer or module kind
    /// [default: global; ramplus_tl: tensor].
    #[arg(long, value_parser = PossibleValuesParser::new(["global", "tensor", "layer", "module"])
        .map(|s| BoostScope::from_name(&s).expect("a listed scope")))]
    pub(crate) scope: Option<BoostScope>,
    /// RAM and RAM+: how the shared region (elements several agents changed) is merged
    /// [default: mean].
    #[arg(long, value_parser = PossibleValuesParser::new([
        PossibleValue::new("mean").help("the mean of the agents that changed the element (the paper)"),
        PossibleValue::new("consensus").help("the mean of those whose change has the sign of the changes' sum (SPEC §2b)"),
    ]).map(|s| SharedRule::from_name(&s).expect("a listed rule")))]
    pub(crate) shared: Option<SharedRule>,
    /// RAM+ paper rule: r [default 0.1].
    #[arg(long)]
    pub(crate) r: Option<f64>,
    /// RAM+ paper rule: cap α on ρ [default 2.0 global, 0.2 tensor scope].
    #[arg(long)]
    pub(crate) alpha: Option<f64>,
    /// RAM+ official rule: R [default 1.2].
    #[arg(long)]
    pub(crate) rescale_factor: Option<f64>,
    /// Whose config.json the merged model takes: base, or an agent (its folder as given to
    /// --model, or its --name). Needed where an agent's config differs from the base's in a key
    /// that changes how the weights are used (rope, context length, windows, activation, norms)
    /// [default: the base's].
    #[arg(long, value_name = "base|MODEL")]
    pub(crate) config_from: Option<String>,
    /// SVC, with any method: each merged matrix's singular values calibrated with this α (> 0,
    /// e.g. 0.1; SPEC §4e).
    #[arg(long, value_name = "ALPHA", allow_hyphen_values = true)]
    pub(crate) svc: Option<String>,
    #[command(flatten)]
    pub(crate) output: OutputArgs,
    #[command(flatten)]
    pub(crate) seed: SeedArg,
}

/// Where and how the merged folder is written.
#[derive(Args, Debug, Clone)]
pub(crate) struct OutputArgs {
    /// Output dtype [default: the recipe's out_dtype/dtype, else each tensor's dtype in the base].
    #[arg(long, value_parser = parse_dtype)]
    pub(crate) out_dtype: Option<DType>,
    /// Largest output shard (5GB = 5·10⁹ bytes, 5GiB = 5·2³⁰) [default: a recipe's
    /// shard_size, else 5GB].
    #[arg(long, value_parser = parse_size)]
    pub(crate) shard_size: Option<u64>,
    /// Replace the output folder if it exists (only once the new one is complete).
    #[arg(long)]
    pub(crate) force: bool,
    /// Output folder (also `--out-path`, as mergekit-multi names it).
    #[arg(short = 'o', long = "out", value_name = "OUT_DIR", alias = "out-path")]
    pub(crate) out: Option<PathBuf>,
}

/// The seed of a merge's random masks.
#[derive(Args, Debug)]
pub(crate) struct SeedArg {
    /// Seed of random masks (dare_linear, dare_ties, della, della_linear): the same seed gives the
    /// same bytes on every backend and tiling [default: a recipe's seed, else 0].
    #[arg(long)]
    pub(crate) seed: Option<u64>,
}

#[derive(Args, Debug)]
pub(crate) struct ConvertArgs {
    /// The checkpoint: a folder (safetensors, pytorch_model.bin, a verl actor folder of FSDP rank
    /// shards), a Hugging Face Hub id, or BASE+ADAPTER (a PEFT adapter applied to its base).
    #[arg(value_name = "SOURCE")]
    pub(crate) source: PathBuf,
    /// Keep fp32 master weights (a verl checkpoint's) as stored instead of their rounding to
    /// bf16, which is what verl's own converter writes.
    #[arg(long)]
    pub(crate) raw_f32: bool,
    /// Convert NaN and ±Inf as they are instead of refusing a checkpoint that holds them.
    #[arg(long)]
    pub(crate) allow_nonfinite: bool,
    /// Worker threads (0 = all cores).
    #[arg(long, default_value_t = 0)]
    pub(crate) threads: usize,
    /// No progress bars.
    #[arg(long, short)]
    pub(crate) quiet: bool,
    /// Elements per tile (tests; the result does not depend on it).
    #[arg(long, hide = true)]
    pub(crate) tile_elems: Option<usize>,
    #[command(flatten)]
    pub(crate) output: OutputArgs,
}

#[derive(Args, Debug)]
pub(crate) struct RunArgs {
    /// The mergekit YAML recipe.
    #[arg(value_name = "RECIPE.yml")]
    pub(crate) recipe: PathBuf,
    /// Output folder, as mergekit-yaml takes it (or -o OUT_DIR).
    #[arg(value_name = "OUT_DIR")]
    pub(crate) out_dir: Option<PathBuf>,
    /// A multi-stage recipe's stages are written to DIR/NAME and kept (mergekit-multi's -I)
    /// [default: scratch beside the output, removed when the run ends].
    #[arg(long, short = 'I', value_name = "DIR")]
    pub(crate) intermediate_dir: Option<PathBuf>,
    #[command(flatten)]
    pub(crate) mergekit: MergekitYamlArgs,
    #[command(flatten)]
    pub(crate) compute: ComputeArgs,
    #[command(flatten)]
    pub(crate) output: OutputArgs,
    #[command(flatten)]
    pub(crate) seed: SeedArg,
}

/// mergekit-yaml's options, each done the same way or answered with rlmerge's equivalent
/// (`run`, [`crate::cli`]'s `mergekit_yaml` answers).
#[derive(Args, Debug, Default)]
pub(crate) struct MergekitYamlArgs {
    #[arg(long, hide = true)]
    pub(crate) cuda: bool,
    #[arg(long, hide = true)]
    pub(crate) no_cuda: bool,
    #[arg(long, hide = true)]
    pub(crate) allow_crimes: bool,
    #[arg(long, hide = true)]
    pub(crate) copy_tokenizer: bool,
    #[arg(long, hide = true)]
    pub(crate) no_copy_tokenizer: bool,
    #[arg(long, hide = true)]
    pub(crate) lazy_unpickle: bool,
    #[arg(long, hide = true)]
    pub(crate) low_cpu_memory: bool,
    #[arg(long, hide = true)]
    pub(crate) clone_tensors: bool,
    #[arg(long, hide = true)]
    pub(crate) trust_remote_code: bool,
    #[arg(long, hide = true)]
    pub(crate) write_model_card: bool,
    #[arg(long, hide = true)]
    pub(crate) no_write_model_card: bool,
    #[arg(long, hide = true)]
    pub(crate) safe_serialization: bool,
    #[arg(long, hide = true)]
    pub(crate) no_safe_serialization: bool,
    #[arg(long, hide = true, value_name = "N")]
    pub(crate) random_seed: Option<u64>,
    #[arg(long, hide = true, value_name = "PARAMETERS", value_parser = parse_parameter_count, allow_hyphen_values = true)]
    pub(crate) out_shard_size: Option<u64>,
    #[arg(long, hide = true, value_name = "DIR")]
    pub(crate) transformers_cache: Option<PathBuf>,
    #[arg(long, hide = true, value_name = "DIR")]
    pub(crate) lora_merge_cache: Option<PathBuf>,
    #[arg(short = 'v', long = "verbose", hide = true, action = clap::ArgAction::Count)]
    pub(crate) verbose: u8,
}

/// A count of parameters as mergekit writes one (`5B`, `500M`, `1000K`, or a number).
fn parse_parameter_count(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let (digits, scale) = match t.chars().last().map(|c| c.to_ascii_uppercase()) {
        Some('K') => (&t[..t.len() - 1], 1e3),
        Some('M') => (&t[..t.len() - 1], 1e6),
        Some('B') => (&t[..t.len() - 1], 1e9),
        _ => (t, 1.0),
    };
    match digits.trim().parse::<f64>() {
        Ok(v) if v.is_finite() && v >= 1.0 => Ok((v * scale) as u64),
        _ => Err(format!(
            "'{s}': expected a parameter count such as 5B, 500M or 1000000"
        )),
    }
}

#[derive(Args, Debug)]
pub(crate) struct AnalyzeArgs {
    #[command(flatten)]
    pub(crate) inputs: InputArgs,
    /// Break the counts down by module and by tensor.
    #[arg(long)]
    pub(crate) per_tensor: bool,
    /// Print JSON on stdout instead of tables.
    #[arg(long)]
    pub(crate) json: bool,
    /// A merged folder (any method, any tool): also report how much of each agent's change it
    /// kept, on its unique and its shared elements.
    #[arg(long, value_name = "DIR")]
    pub(crate) merged: Option<PathBuf>,
    /// Write SVG figures into DIR: overlap.svg (each agent's changes by how many others made them
    /// too, the paper's Figure 1) and layers.svg (density and unique share per layer); with
    /// --per-tensor also lambda.svg (λ per layer under ram+ --scope layer); with --merged also
    /// retention.svg (how much of each agent the merge kept, per region).
    #[arg(long, value_name = "DIR")]
    pub(crate) plot: Option<PathBuf>,
}

#[derive(Args, Debug)]
pub(crate) struct DemoArgs {
    /// Where to write the example.
    #[arg(default_value = "rlmerge-demo")]
    pub(crate) dir: PathBuf,
    /// No progress bars.
    #[arg(long, short)]
    pub(crate) quiet: bool,
    /// Size of each model (e.g. 1GiB) instead of the tiny default: a synthetic checkpoint for benchmarks.
    #[arg(long, value_parser = parse_size)]
    pub(crate) model_size: Option<u64>,
    /// Only write the models; skip the analysis and the merge.
    #[arg(long)]
    pub(crate) write_only: bool,
}

/// A `--method` name (mergekit's, and `ram+`'s aliases).
fn parse_method(s: &str) -> Result<Kind, String> {
    Kind::from_name(s).ok_or_else(|| {
        format!(
            "unknown method '{s}'{}",
            Kind::unknown_hint(
                s,
                crate::error::Arg::named("--svc ALPHA (e.g. --method ram+ --svc 0.1)", "svc=ALPHA")
            )
        )
    })
}

impl MergeArgs {
    /// The method flags as library data.
    pub(crate) fn method_flags(&self) -> MethodFlags {
        MethodFlags {
            method: self.method,
            params: self.params.clone(),
            rule: self.rule.clone(),
            scope: self.scope,
            r: self.r,
            alpha: self.alpha,
            rescale_factor: self.rescale_factor,
            shared: self.shared,
            seed: self.seed.seed.unwrap_or(0),
            svc: self.svc.as_deref().map(crate::job::parse_scalar),
            tokenizer_source: self.inputs.tokenizer_source.clone(),
            names: self.inputs.names.clone(),
            config_from: self.config_from.clone(),
        }
    }
}
