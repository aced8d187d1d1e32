//! `rlmerge._rlmerge`, the native half of the Python package, over the library's merge service
//! (`rlmerge::service`), as the command line is: typed calls — `merge` and `run`, `analyze`,
//! `verify`, `methods` — that build the library's own requests (a recipe as a YAML value, never
//! text; a `Job`, a `Compute`, an `Analysis`), and `call`, the `rlmerge` command the package
//! installs (the library's command line, `rlmerge::cli`). Errors become exceptions here:
//! [`MergeError`], `UsageError` (also a `ValueError`) for a bad request, `KeyboardInterrupt`
//! when Ctrl-C stopped the call. Every call releases the GIL while it works and has its own
//! cancellation: Ctrl-C stops the call it interrupts, not those other threads run.

use pyo3::exceptions::{PyException, PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyBool, PyDict, PyFloat, PyInt, PyList, PyString, PyTuple, PyType};
use rlmerge::error::usage;
use rlmerge::job::{CommandLine, Job};
use rlmerge::service;
use std::path::PathBuf;
use std::time::Duration;

pyo3::create_exception!(
    rlmerge,
    MergeError,
    PyException,
    "A merge, analysis or check failed (bad input, I/O); the message says what and where."
);

/// `UsageError(MergeError, ValueError)`, made at import: the request itself is wrong.
static USAGE_ERROR: PyOnceLock<Py<PyType>> = PyOnceLock::new();

/// How often a running call lets Python look for signals (Ctrl-C).
const SIGNAL_POLL: Duration = Duration::from_millis(100);

/// A library error as the exception of its kind, its message in this API's keywords (the
/// library's messages name their settings for each front end: `rlmerge::error::Arg`).
fn exception(py: Python<'_>, err: &anyhow::Error) -> PyErr {
    let message = rlmerge::error::render(err, rlmerge::error::Dialect::Python);
    if rlmerge::error::is_usage(err) {
        match USAGE_ERROR.get(py) {
            Some(t) => PyErr::from_type(t.bind(py).clone(), message),
            None => PyValueError::new_err(message),
        }
    } else {
        MergeError::new_err(message)
    }
}

/// What a call says when Ctrl-C comes after its work has finished (or passed the point of
/// stopping: a merge committing its output).
enum Late {
    /// Raise `KeyboardInterrupt` with this message, which says what was done.
    Raise(String),
    /// Return what the work did, as the binary finishes a merge whose commit a signal reached.
    Finish,
}

/// Runs `work` on its own thread with its own cancellation token, the GIL released. A signal
/// whose Python handler raises (Ctrl-C: `KeyboardInterrupt`) requests the stop; once the work has
/// stopped the interrupt is raised with a message saying that nothing was written. Where the work
/// finished anyway — the signal came too late, while the output was being committed or after —
/// `late` says what happens, so a caller always learns which of the two it got.
fn cancellable<T: Send + 'static>(
    py: Python<'_>,
    late: Late,
    work: impl FnOnce() -> anyhow::Result<T> + Send + 'static,
) -> PyResult<T> {
    let token = rlmerge::cancel::Token::new();
    let job_token = token.clone();
    let worker = std::thread::spawn(move || {
        rlmerge::cancel::set_current(job_token);
        work()
    });
    let mut interrupted = None;
    loop {
        let finished = py.detach(|| {
            let until = std::time::Instant::now() + SIGNAL_POLL;
            while !worker.is_finished() && std::time::Instant::now() < until {
                std::thread::sleep(Duration::from_millis(5));
            }
            worker.is_finished()
        });
        // Checked once more after the work finished: a signal that came in the last instant is
        // handled here, not raised bare by the next line of Python.
        if let Err(signal) = py.check_signals() {
            token.request();
            interrupted = Some(signal);
            break;
        }
        if finished {
            break;
        }
    }
    let result = py
        .detach(|| worker.join())
        .map_err(|_| PyRuntimeError::new_err("rlmerge panicked; please report this as a bug"))?;
    let keyboard = |signal: Option<PyErr>, message: String| -> PyErr {
        match signal {
            Some(s) if !s.is_instance_of::<pyo3::exceptions::PyKeyboardInterrupt>(py) => s,
            _ => pyo3::exceptions::PyKeyboardInterrupt::new_err(message),
        }
    };
    match (result, late) {
        (Ok(value), _) if interrupted.is_none() => Ok(value),
        (Ok(value), Late::Finish) => Ok(value),
        (Ok(_), Late::Raise(done)) => Err(keyboard(interrupted, done)),
        (Err(err), _) if rlmerge::cancel::is_interrupted(&err) => {
            Err(keyboard(interrupted, format!("{err:#}")))
        }
        (Err(err), _) => Err(exception(py, &err)),
    }
}

/// How deep a recipe value may nest: a mergekit recipe is a handful of levels deep, and a value
/// nested deeper than this (or one that contains itself) is a mistake, refused before converting
/// it could exhaust the stack.
const MAX_RECIPE_DEPTH: usize = 64;

/// A Python value of a recipe (dict, list, str, number, bool, None) as YAML; a value nested more
/// than [`MAX_RECIPE_DEPTH`] deep, or containing itself, is a usage error naming where.
fn yaml_of(v: &Bound<'_, PyAny>) -> anyhow::Result<serde_yaml::Value> {
    yaml_at(v, &mut Vec::new(), &mut Vec::new())
}

/// [`yaml_of`] of the value at `path` (its keys and indexes from the recipe's top), inside the
/// containers `open` (their addresses, outermost first).
fn yaml_at(
    v: &Bound<'_, PyAny>,
    path: &mut Vec<String>,
    open: &mut Vec<usize>,
) -> anyhow::Result<serde_yaml::Value> {
    use serde_yaml::Value;
    let place = |path: &[String]| match path.len() {
        0 => "the recipe".to_string(),
        1..=8 => format!("recipe value {}", path.join(".")),
        n => format!("recipe value {}.… ({n} levels)", path[..6].join(".")),
    };
    if v.is_none() {
        return Ok(Value::Null);
    } else if let Ok(b) = v.cast::<PyBool>() {
        return Ok(Value::Bool(b.is_true()));
    } else if v.is_instance_of::<PyInt>() {
        let i: i64 = v
            .extract()
            .map_err(|_| usage(format!("{v} is too large for a recipe value")))?;
        return Ok(Value::Number(i.into()));
    } else if v.is_instance_of::<PyFloat>() {
        return Ok(Value::Number(v.extract::<f64>()?.into()));
    } else if v.is_instance_of::<PyString>() {
        return Ok(Value::String(v.extract()?));
    }
    let is_map = v.cast::<PyDict>().is_ok();
    if !is_map && !v.is_instance_of::<PyList>() && !v.is_instance_of::<PyTuple>() {
        let kind = v.get_type().name()?;
        return Err(usage(format!(
            "{}: {kind} {v} is not a recipe value",
            place(path)
        )));
    }
    let address = v.as_ptr() as usize;
    if open.contains(&address) {
        return Err(usage(format!(
            "{} contains itself; a recipe is plain data (dicts, lists, text, numbers)",
            place(path)
        )));
    }
    if open.len() >= MAX_RECIPE_DEPTH {
        return Err(usage(format!(
            "{} is nested more than {MAX_RECIPE_DEPTH} levels deep; a recipe is a few levels of \
             dicts and lists",
            place(path)
        )));
    }
    open.push(address);
    let value = if let Ok(d) = v.cast::<PyDict>() {
        let mut map = serde_yaml::Mapping::new();
        for (k, element) in d.iter() {
            let key: String = k
                .extract()
                .map_err(|_| usage(format!("{}: key {k} is not text", place(path))))?;
            let value = yaml_in(&element, key.clone(), path, open)?;
            map.insert(Value::String(key), value);
        }
        Value::Mapping(map)
    } else {
        let mut list = Vec::new();
        for (i, element) in v.try_iter()?.enumerate() {
            list.push(yaml_in(&element?, i.to_string(), path, open)?);
        }
        Value::Sequence(list)
    };
    open.pop();
    Ok(value)
}

/// [`yaml_at`] of `element`, the entry `key` of the container at `path`.
fn yaml_in(
    element: &Bound<'_, PyAny>,
    key: String,
    path: &mut Vec<String>,
    open: &mut Vec<usize>,
) -> anyhow::Result<serde_yaml::Value> {
    path.push(key);
    let value = yaml_at(element, path, open);
    path.pop();
    value
}

/// The keywords of a merge (`merge` and `run`), as the API passes them: a dict with every key.
#[derive(FromPyObject)]
#[pyo3(from_item_all)]
struct MergeKeywords {
    device: String,
    quiet: bool,
    force: bool,
    out_dtype: Option<String>,
    shard_size: Option<String>,
    threads: usize,
    allow_missing_tensors: bool,
    allow_nonfinite: bool,
    allow_dense_agents: bool,
    raw_f32_agents: bool,
    seed: Option<u64>,
}

/// The compute options on `device` ("auto", "cpu" or "gpu").
fn compute(device: &str, quiet: bool, threads: usize) -> anyhow::Result<service::Compute> {
    let device = match device {
        "auto" => service::Device::Auto,
        "cpu" => service::Device::Cpu,
        "gpu" => service::Device::Gpu,
        other => {
            return Err(usage(format!(
                "device must be 'auto', 'cpu' or 'gpu', got '{other}'"
            )))
        }
    };
    Ok(service::Compute {
        threads,
        show_progress: !quiet,
        ..service::Compute::on(device)
    })
}

/// A merge's options from its keywords: how it computes, what it sets on top of its recipe,
/// where it goes.
struct MergeRequest {
    compute: service::Compute,
    command_line: CommandLine,
    quiet: bool,
    out: PathBuf,
    force: bool,
}

impl MergeKeywords {
    /// The library's compute and command-line settings for a merge into `out`.
    fn options(self, out: PathBuf) -> anyhow::Result<MergeRequest> {
        let compute = service::Compute {
            warn_dense_agents: !self.allow_dense_agents,
            ..compute(&self.device, self.quiet, self.threads)?
        };
        let out_dtype = self
            .out_dtype
            .map(|d| rlmerge::job::parse_dtype(&d).map_err(|e| usage(format!("out_dtype: {e}"))))
            .transpose()?;
        let shard_size = self
            .shard_size
            .as_deref()
            .map(rlmerge::checkpoint::writer::parse_size)
            .transpose()
            .map_err(|e| usage(format!("shard_size: {e:#}")))?;
        let command_line = CommandLine {
            epsilon: None,
            out_dtype,
            shard_size,
            allow_nonfinite: self.allow_nonfinite,
            allow_missing_tensors: self.allow_missing_tensors,
            raw_f32_agents: self.raw_f32_agents,
        };
        Ok(MergeRequest {
            compute,
            command_line,
            quiet: self.quiet,
            out,
            force: self.force,
        })
    }
}

/// What a call says while it runs, on stderr as the command says it: warnings and notes
/// always, the backend and the GPU's traffic unless `quiet`.
fn show(quiet: bool) -> impl FnMut(service::Said) {
    move |said| match said {
        service::Said::Warning(w) => eprintln!("warning: {}", rlmerge::escape::terminal(&w)),
        service::Said::Note(n) => eprintln!("note: {}", rlmerge::escape::terminal(&n)),
        service::Said::Backend(b) if !quiet => {
            eprintln!("backend: {}", rlmerge::escape::terminal(&b))
        }
        service::Said::Traffic(t) if !quiet => eprintln!("GPU: {t}"),
        _ => {}
    }
}

/// Merges the job `job` makes into `options.out`, on its own cancellable thread; the merge's
/// record as JSON.
fn merge_into(
    py: Python<'_>,
    job: impl FnOnce() -> anyhow::Result<Job> + Send + 'static,
    options: MergeRequest,
) -> PyResult<String> {
    summarized(py, options, move |o| {
        let mut job = job()?;
        job.set_command_line(&o.command_line)?;
        service::merge(&job, &o.compute, (&o.out, o.force), &mut show(o.quiet))
    })
}

/// Runs `work` (a merge into `options.out`) on its own cancellable thread; the merge's record as
/// JSON, with what it noted of the output's surroundings.
fn summarized(
    py: Python<'_>,
    options: MergeRequest,
    work: impl FnOnce(&MergeRequest) -> anyhow::Result<rlmerge::engine::MergeSummary> + Send + 'static,
) -> PyResult<String> {
    let late = Late::Raise(format!(
        "interrupted after the merge had finished: the output at {} is complete",
        options.out.display()
    ));
    cancellable(py, late, move || {
        let summary = work(&options).map_err(|e| match rlmerge::cancel::is_interrupted(&e) {
            true => e.context(format!("merge into {}", options.out.display())),
            false => e,
        })?;
        // The record, and beside it what the merge noted of the output's surroundings. (Through
        // its text, as the file holds it: f32 numbers keep their shortest form, 1e-05.)
        let text = serde_json::to_string(&summary.record)?;
        let mut record: serde_json::Value = serde_json::from_str(&text)?;
        record["notes"] = summary.notes.into();
        Ok(record.to_string())
    })
}

/// Merges the recipe `recipe` (a dict with a mergekit recipe's keys) into `out`: the same reading
/// and checks as a recipe file's, with messages that name keys, not lines. Returns the merge's
/// record as JSON.
#[pyfunction]
fn merge(
    py: Python<'_>,
    recipe: &Bound<'_, PyAny>,
    out: PathBuf,
    keywords: MergeKeywords,
) -> PyResult<String> {
    let value = yaml_of(recipe).map_err(|e| exception(py, &e))?;
    let seed = keywords.seed;
    let options = keywords.options(out).map_err(|e| exception(py, &e))?;
    merge_into(py, move || Job::from_base_and_models(value, seed), options)
}

/// Runs the mergekit YAML recipe file `recipe` into `out`, as `rlmerge run` (a multi-stage one
/// stage by stage, each kept in `intermediate_dir/NAME` where given); the record as JSON.
#[pyfunction]
#[pyo3(signature = (recipe, out, keywords, intermediate_dir=None))]
fn run(
    py: Python<'_>,
    recipe: PathBuf,
    out: PathBuf,
    keywords: MergeKeywords,
    intermediate_dir: Option<PathBuf>,
) -> PyResult<String> {
    let seed = keywords.seed;
    let options = keywords.options(out).map_err(|e| exception(py, &e))?;
    summarized(py, options, move |o| {
        let target = (o.out.as_path(), o.force, intermediate_dir.as_deref());
        let given = (seed, &o.command_line);
        service::run_recipe(&recipe, given, &o.compute, target, &mut show(o.quiet)).map(|r| r.1)
    })
}

/// Converts the checkpoint `source` (a folder, Hub id or BASE+ADAPTER) into `out`, as
/// `rlmerge convert`; the record as JSON.
#[pyfunction]
fn convert(
    py: Python<'_>,
    source: PathBuf,
    out: PathBuf,
    keywords: MergeKeywords,
) -> PyResult<String> {
    let options = keywords.options(out).map_err(|e| exception(py, &e))?;
    merge_into(
        py,
        move || Job::conversion(rlmerge::hub::locate_model(&source, false)?),
        options,
    )
}

/// Extracts a PEFT LoRA adapter of `model` against `base` into `out`, as `rlmerge extract-lora`;
/// what it kept as JSON (each module's rank and kept share, the modules saved whole or left out).
#[pyfunction]
#[pyo3(signature = (base, model, out, rank, rel_error, distribute_scale, embed_lora,
    skip_undecomposable, include, exclude, threads, force, sv_epsilon=0.0, save_modules=Vec::new(),
    max_held_mib=None))]
#[allow(clippy::too_many_arguments)]
fn extract_lora(
    py: Python<'_>,
    base: PathBuf,
    model: PathBuf,
    out: PathBuf,
    rank: Option<usize>,
    rel_error: Option<f64>,
    distribute_scale: bool,
    embed_lora: bool,
    skip_undecomposable: bool,
    include: Vec<String>,
    exclude: Vec<String>,
    threads: usize,
    force: bool,
    sv_epsilon: f64,
    save_modules: Vec<String>,
    max_held_mib: Option<usize>,
) -> PyResult<String> {
    let late = Late::Raise(format!(
        "interrupted after the extraction had finished: the adapter at {} is complete",
        out.display()
    ));
    cancellable(py, late, move || {
        let req = rlmerge::extract_lora::Request {
            base: rlmerge::hub::locate_model(&base, false)?,
            model: rlmerge::hub::locate_model(&model, false)?,
            rank: rank.unwrap_or(rlmerge::extract_lora::DEFAULT_RANK),
            rel_error,
            distribute_scale,
            embed_lora,
            skip_undecomposable,
            max_held_mib: max_held_mib.unwrap_or(rlmerge::extract_lora::DEFAULT_MAX_HELD_MIB),
            include: rlmerge::extract_lora::any_of(&include),
            exclude: rlmerge::extract_lora::any_of(&exclude),
            sv_epsilon,
            save_whole: save_modules,
        };
        let done = service::extract_lora(&req, (&out, force), threads, &mut show(true))?;
        let mut json = serde_json::to_value(&done)?;
        json["kept"] = done.kept().into();
        Ok(json.to_string())
    })
}

/// Builds a mixture of experts into `out`, as `rlmerge moe`: the config from the YAML file
/// `config_path`, or `config` (a dict; paths from the working directory); what was built as JSON.
#[pyfunction]
#[pyo3(signature = (config_path, config, out, keywords, allow_all_same, intermediate_dir=None))]
fn moe(
    py: Python<'_>,
    config_path: Option<PathBuf>,
    config: Option<Bound<'_, PyDict>>,
    out: PathBuf,
    keywords: MergeKeywords,
    allow_all_same: bool,
    intermediate_dir: Option<PathBuf>,
) -> PyResult<String> {
    let seed = keywords.seed;
    let options = keywords.options(out).map_err(|e| exception(py, &e))?;
    let value = config
        .map(|c| yaml_of(c.as_any()))
        .transpose()
        .map_err(|e| exception(py, &e))?;
    let late = Late::Raise(format!(
        "interrupted after the MoE had been written: {} is complete",
        options.out.display()
    ));
    cancellable(py, late, move || {
        let moe_options = rlmerge::moe::Options {
            shard_bytes: options
                .command_line
                .shard_size
                .unwrap_or(rlmerge::checkpoint::writer::DEFAULT_SHARD_SIZE),
            allow_nonfinite: options.command_line.allow_nonfinite,
            show_progress: !options.quiet,
        };
        let out_dtype = options.command_line.out_dtype;
        let work = (moe_options, options.compute.threads);
        let mut say = show(options.quiet);
        let (config, built) = match (config_path, value) {
            (Some(path), _) => service::moe_recipe(
                &path,
                (seed, allow_all_same, out_dtype),
                (&options.out, options.force, intermediate_dir.as_deref()),
                work,
                &mut say,
            )?,
            (None, Some(value)) => {
                let here = std::path::Path::new(".");
                let mut config =
                    rlmerge::moe::config::from_value(value, here, (seed, allow_all_same), &[])?;
                config.dtype = out_dtype.or(config.dtype);
                let built =
                    service::moe(&config, (&options.out, options.force), work, &[], &mut say)?;
                (config, built)
            }
            (None, None) => anyhow::bail!("internal: no MoE config"),
        };
        Ok(serde_json::json!({
            "architecture": built.layout.class(),
            "experts": config.experts.len(),
            "experts_per_token": config.experts_per_token,
            "gate_mode": config.gate_mode.name(),
            "layers": built.layers,
            "tensors": built.tensors,
            "bytes": built.bytes,
            "dtype": built.dtype.torch_name(),
            "degenerate_layers": built.degenerate,
            "zero_biases": built.zero_biases,
        })
        .to_string())
    })
}

/// What `verify` found, one line each: (checks passed, checks skipped, problems, notes).
type VerifyLines = (Vec<String>, Vec<String>, Vec<String>, Vec<String>);

/// Checks the merged folder `dir` against its record; with `against`, recomputes the merge on
/// `device` and compares the bytes. Returns (checks passed, checks skipped, problems found,
/// notes on scratch that killed runs left in or beside it).
#[pyfunction]
#[pyo3(signature = (dir, against = false, device = "auto"))]
fn verify(py: Python<'_>, dir: PathBuf, against: bool, device: &str) -> PyResult<VerifyLines> {
    let compute = compute(device, true, 0).map_err(|e| exception(py, &e))?;
    let late = Late::Raise("interrupted after verify had finished".into());
    cancellable(py, late, move || {
        let v = rlmerge::verify::verify_folder(&dir, against, &compute, &mut show(true))?;
        Ok((v.ok, v.skipped, v.problems, v.notes))
    })
}

/// The keywords of `analyze`, as the API passes them: a dict with every key (paths resolved).
#[derive(FromPyObject)]
#[pyo3(from_item_all)]
struct AnalyzeKeywords {
    base: PathBuf,
    models: Vec<PathBuf>,
    per_tensor: bool,
    merged: Option<PathBuf>,
    plot: Option<PathBuf>,
    epsilon: Option<f64>,
    device: String,
    quiet: bool,
    threads: usize,
    tokenizer_source: Option<String>,
    allow_missing_tensors: bool,
    allow_nonfinite: bool,
    allow_dense_agents: bool,
    raw_f32_agents: bool,
    names: Vec<String>,
}

/// What each agent changed, as `rlmerge analyze --json` prints it (figures written with `plot`).
#[pyfunction]
fn analyze(py: Python<'_>, keywords: AnalyzeKeywords) -> PyResult<String> {
    let k = keywords;
    let compute = service::Compute {
        warn_dense_agents: !k.allow_dense_agents,
        ..compute(&k.device, k.quiet, k.threads).map_err(|e| exception(py, &e))?
    };
    let late = Late::Raise("interrupted after analyze had finished".into());
    cancellable(py, late, move || {
        let analysis = service::Analysis {
            base: k.base,
            agents: k.models,
            names: k.names,
            tokenizer: k
                .tokenizer_source
                .as_deref()
                .map(rlmerge::vocabulary::TokenizerSettings::of_source)
                .transpose()?,
            epsilon: k.epsilon,
            allow_missing_tensors: k.allow_missing_tensors,
            allow_nonfinite: k.allow_nonfinite,
            raw_f32_agents: k.raw_f32_agents,
            merged: k.merged,
            plot: k.plot,
            per_tensor: k.per_tensor,
        };
        let found = service::analyze(&analysis, &compute, &mut show(k.quiet))?;
        Ok(serde_json::to_string_pretty(&found.to_json(k.per_tensor))?)
    })
}

/// Every merge method with its parameters, as `rlmerge methods --json` prints them.
#[pyfunction]
fn methods() -> PyResult<String> {
    Ok(
        serde_json::to_string_pretty(&rlmerge::method::listing::all_json())
            .expect("JSON values serialize"),
    )
}

/// The `rlmerge` command pip installs (`rlmerge.cli`): the command line with `args` (without the
/// program name) in this process: its output is returned when `capture`, else written to stdout. Returns (exit code, output, error
/// line) as the command gives them: 0 success, 1 failure, 2 usage error; a Ctrl-C raises
/// KeyboardInterrupt once the command has stopped (its scratch folder removed).
#[pyfunction]
#[pyo3(signature = (args, capture = true))]
fn call(
    py: Python<'_>,
    args: Vec<String>,
    capture: bool,
) -> PyResult<(u8, String, Option<String>)> {
    cancellable(py, Late::Finish, move || {
        let argv = std::iter::once("rlmerge".to_string()).chain(args);
        let mut captured = Vec::new();
        let (code, error) = if capture {
            rlmerge::cli::run_args(argv, &mut captured)
        } else {
            rlmerge::cli::run_args(argv, &mut std::io::stdout().lock())
        };
        if code == 130 {
            return Err(anyhow::Error::new(rlmerge::cancel::Interrupted));
        }
        Ok((code, String::from_utf8_lossy(&captured).into_owned(), error))
    })
}

/// `" (did you mean 'DIR/NAME'?)"` for a folder beside `path` with a similar name (the command's
/// own suggestion, `rlmerge::error::sibling_hint`), or `""`.
#[pyfunction]
fn sibling_hint(path: PathBuf) -> String {
    rlmerge::error::sibling_hint(&path)
}

#[pymodule]
fn _rlmerge(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    // No environment change here: other threads of the importing process may read it while it
    // changes. The pip-installed command sets what the binary sets before it imports this.
    let merge_error = py.get_type::<MergeError>();
    let bases = PyTuple::new(
        py,
        [merge_error.as_any(), py.get_type::<PyValueError>().as_any()],
    )?;
    let body = PyDict::new(py);
    body.set_item(
        "__doc__",
        "The request itself is wrong (unknown method or parameter, bad path, value out of range).",
    )?;
    body.set_item("__module__", "rlmerge")?;
    let usage_error = py
        .get_type::<PyType>()
        .call1(("UsageError", bases, body))?
        .cast_into::<PyType>()?;
    m.add("MergeError", merge_error)?;
    m.add("UsageError", &usage_error)?;
    let _ = USAGE_ERROR.set(py, usage_error.unbind());
    m.add_function(wrap_pyfunction!(merge, m)?)?;
    m.add_function(wrap_pyfunction!(run, m)?)?;
    m.add_function(wrap_pyfunction!(convert, m)?)?;
    m.add_function(wrap_pyfunction!(extract_lora, m)?)?;
    m.add_function(wrap_pyfunction!(moe, m)?)?;
    m.add_function(wrap_pyfunction!(verify, m)?)?;
    m.add_function(wrap_pyfunction!(analyze, m)?)?;
    m.add_function(wrap_pyfunction!(methods, m)?)?;
    m.add_function(wrap_pyfunction!(call, m)?)?;
    m.add_function(wrap_pyfunction!(sibling_hint, m)?)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
