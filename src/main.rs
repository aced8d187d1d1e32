use clap::Parser;
use std::process::ExitCode;

fn main() -> ExitCode {
    // Headless: with XDG_RUNTIME_DIR unset, libwayland (loaded by Mesa's Vulkan drivers when wgpu
    // looks for adapters) prints "error: XDG_RUNTIME_DIR is invalid" on stderr. rlmerge never
    // presents, so any folder quiets it. Set here, before any thread exists, so it is race-free.
    if std::env::var_os("XDG_RUNTIME_DIR").is_none() {
        std::env::set_var("XDG_RUNTIME_DIR", std::env::temp_dir());
    }
    let cli = rlmerge::cli::Cli::parse();
    match rlmerge::cli::run(cli) {
        Ok(()) => ExitCode::SUCCESS,
        // A closed pipe (`rlmerge analyze | head`) is the reader's choice, not a failure.
        Err(err)
            if err
                .chain()
                .filter_map(|e| e.downcast_ref::<std::io::Error>())
                .any(|e| e.kind() == std::io::ErrorKind::BrokenPipe) =>
        {
            ExitCode::SUCCESS
        }
        Err(err) => {
            eprintln!("error: {err:#}");
            if err.downcast_ref::<rlmerge::cli::UsageError>().is_some() {
                ExitCode::from(2)
            } else {
                ExitCode::from(1)
            }
        }
    }
}
