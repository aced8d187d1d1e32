mod cli;

use clap::Parser;
use std::process::ExitCode;

fn main() -> ExitCode {
    // Headless: with XDG_RUNTIME_DIR unset, libwayland (loaded by Mesa's Vulkan drivers when wgpu
    // looks for adapters) prints "error: XDG_RUNTIME_DIR is invalid" on stderr. rlmerge never
    // presents, so any folder quiets it. Set here, before any thread exists, so it is race-free.
    if std::env::var_os("XDG_RUNTIME_DIR").is_none() {
        std::env::set_var("XDG_RUNTIME_DIR", std::env::temp_dir());
    }
    // Ctrl-C, SIGTERM, SIGHUP: remove this process's scratch folders, then exit as killed by it.
    let _ = ctrlc::set_handler(|| {
        rlmerge::checkpoint::output_folder::remove_live_scratch();
        eprintln!("error: interrupted; nothing was written at the output path");
        std::process::exit(130);
    });
    let cli = cli::Cli::parse();
    match cli::run(cli) {
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
            // Names read from files may hold control characters: they are shown escaped.
            eprintln!("error: {}", rlmerge::error::printable(&format!("{err:#}")));
            if rlmerge::error::is_usage(&err) {
                ExitCode::from(2)
            } else {
                ExitCode::from(1)
            }
        }
    }
}
