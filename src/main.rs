use clap::Parser;
use std::process::ExitCode;

fn main() -> ExitCode {
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
