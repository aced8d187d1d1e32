use clap::Parser;
use std::process::ExitCode;

fn main() -> ExitCode {
    let cli = rlmerge::cli::Cli::parse();
    match rlmerge::cli::run(cli) {
        Ok(()) => ExitCode::SUCCESS,
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
