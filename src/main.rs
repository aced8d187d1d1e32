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
    // reports what it wrote. A signal the process started with ignored stays ignored.
    keeping_ignored(|| {
        let _ = ctrlc::set_handler(|| {
            if rlmerge::checkpoint::output_folder::remove_live_scratch() {
                eprintln!("error: interrupted; nothing was written at the output path");
                std::process::exit(130);
            }
        });
    });
    let (code, error) = rlmerge::cli::run_args(std::env::args_os(), &mut std::io::stdout().lock());
    if let Some(message) = error {
        eprintln!("{message}");
    }
    ExitCode::from(code)
}

/// Runs `install`, which takes SIGINT, SIGTERM and SIGHUP, then sets back to ignored those of them
/// this process started with ignored: `nohup` ignores SIGHUP, so a merge outlives its terminal,
/// and a shell's background job SIGINT, so Ctrl-C reaches only the foreground. They stay
/// ignored, as POSIX shells and Python keep them — the handler would otherwise end a `nohup`
/// merge when its terminal closes.
fn keeping_ignored(install: impl FnOnce()) {
    #[cfg(unix)]
    let ignored: Vec<libc::c_int> = [libc::SIGINT, libc::SIGTERM, libc::SIGHUP]
        .into_iter()
        .filter(|&signal| {
            // SAFETY: sigaction with no new action only reads the disposition into `old`, a
            // zeroed sigaction (a valid value of that plain C struct).
            let mut old: libc::sigaction = unsafe { std::mem::zeroed() };
            let read = unsafe { libc::sigaction(signal, std::ptr::null(), &mut old) };
            read == 0 && old.sa_sigaction == libc::SIG_IGN
        })
        .collect();
    install();
    #[cfg(unix)]
    for signal in ignored {
        // SAFETY: setting a signal's disposition to SIG_IGN installs no code and touches no
        // memory of this process.
        unsafe { libc::signal(signal, libc::SIG_IGN) };
    }
}
