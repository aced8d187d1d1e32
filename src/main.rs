mod cli;

use std::process::ExitCode;

fn main() -> ExitCode {
    // Headless: with XDG_RUNTIME_DIR unset, libwayland (loaded by Mesa's Vulkan drivers when wgpu
    // looks for adapters) prints "error: XDG_RUNTIME_DIR is invalid" on stderr. rlmerge never
    // presents, so any folder quiets it. Set here, before any thread exists, so it is race-free.
    if std::env::var_os("XDG_RUNTIME_DIR").is_none() {
        std::env::set_var("XDG_RUNTIME_DIR", std::env::temp_dir());
    }
    // Ctrl-C, SIGTERM, SIGHUP: remove this process's scratch folders, then exit as killed by it.
    // Once outputs are being renamed into place the signal is too late: the run finishes and
    // reports what it wrote.
    let _ = ctrlc::set_handler(|| {
        if rlmerge::checkpoint::output_folder::remove_live_scratch() {
            eprintln!("error: interrupted; nothing was written at the output path");
            std::process::exit(130);
        }
    });
    let (code, error) = cli::run_args(std::env::args_os(), &mut std::io::stdout().lock());
    if let Some(message) = error {
        eprintln!("{message}");
    }
    ExitCode::from(code)
}
