//! `rlmerge._rlmerge`, the native half of the Python package: the rlmerge command line — the
//! same `src/cli` module the binary compiles, over the same library — run in-process, with the
//! GIL released while it works and Ctrl-C turned into a clean cancellation. The Python API
//! (`python/rlmerge/__init__.py`) is built on [`call`].

#[path = "../../src/cli/mod.rs"]
mod cli;

use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;
use std::time::Duration;

/// How often a running command lets Python look for signals (Ctrl-C).
const SIGNAL_POLL: Duration = Duration::from_millis(100);

/// Runs the rlmerge command line with `args` (without the program name) in this process: its
/// output is returned when `capture`, else written to stdout. Returns (exit code, output, error
/// line): 0 success, 1 failure, 2 usage error, 130 interrupted. The GIL is released while the
/// command runs; a signal whose Python handler raises (Ctrl-C: KeyboardInterrupt) stops the
/// command at its next tile — its scratch folder removed, nothing at the output path — and the
/// exception is raised here.
#[pyfunction]
#[pyo3(signature = (args, capture = true))]
fn call(
    py: Python<'_>,
    args: Vec<String>,
    capture: bool,
) -> PyResult<(u8, String, Option<String>)> {
    // This call's own stop request: Ctrl-C here stops this call's job, not those other threads
    // run at the same time.
    let token = rlmerge::cancel::Token::new();
    let job_token = token.clone();
    let worker = std::thread::spawn(move || {
        rlmerge::cancel::set_current(job_token);
        let argv = std::iter::once("rlmerge".to_string()).chain(args);
        let mut captured = Vec::new();
        let result = if capture {
            cli::run_args(argv, &mut captured)
        } else {
            cli::run_args(argv, &mut std::io::stdout().lock())
        };
        (result, captured)
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
        if finished {
            break;
        }
        if let Err(signal) = py.check_signals() {
            token.request();
            interrupted = Some(signal);
            break;
        }
    }
    let ((code, error), captured) = py
        .detach(|| worker.join())
        .map_err(|_| PyRuntimeError::new_err("rlmerge panicked; please report this as a bug"))?;
    // A signal that came once the job no longer looked at its token (its output being committed,
    // or done) is too late to stop it: what it did is reported as if the signal had not come.
    if let Some(signal) = interrupted {
        if code == 130 {
            return Err(signal);
        }
    }
    Ok((code, String::from_utf8_lossy(&captured).into_owned(), error))
}

#[pymodule]
fn _rlmerge(m: &Bound<'_, PyModule>) -> PyResult<()> {
    // As the binary does: Mesa's Vulkan drivers print an error without XDG_RUNTIME_DIR.
    if std::env::var_os("XDG_RUNTIME_DIR").is_none() {
        std::env::set_var("XDG_RUNTIME_DIR", std::env::temp_dir());
    }
    m.add_function(wrap_pyfunction!(call, m)?)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
