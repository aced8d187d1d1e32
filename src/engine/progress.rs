//! Progress on stderr: a bar on a terminal, a line every few seconds elsewhere, counted by the
//! work done (bytes read and merged, and the arithmetic of decomposed matrices).

use indicatif::{ProgressBar, ProgressStyle};

/// How often progress is written as a line where stderr is not a terminal (a log, CI):
/// `RLMERGE_PROGRESS_SECONDS`, else 10 s; a value that is no number of seconds in
/// [0.01, 10⁶] is said once on stderr, not dropped silently.
fn progress_line_every() -> std::time::Duration {
    static SAID: std::sync::Once = std::sync::Once::new();
    let given = std::env::var("RLMERGE_PROGRESS_SECONDS").ok();
    let secs = given
        .as_deref()
        .and_then(|v| v.trim().parse::<f64>().ok())
        .filter(|s| s.is_finite() && *s >= 0.01 && *s <= 1e6);
    if let (Some(v), None) = (&given, secs) {
        SAID.call_once(|| {
            eprintln!(
                "warning: RLMERGE_PROGRESS_SECONDS={} is not a number of seconds in [0.01, 1e6]; \
                 a progress line every 10 s",
                crate::escape::terminal(&format!("{v:?}"))
            )
        });
    }
    std::time::Duration::from_secs_f64(secs.unwrap_or(10.0))
}

/// A pass's progress over `total` units of work (bytes read, and for decomposed matrices a
/// share standing for their arithmetic): a bar where stderr is a terminal; elsewhere, unless
/// hidden, a line every [`progress_line_every`] — done share, the message, elapsed and left —
/// from a thread that ends with the bar.
pub(crate) fn progress_bar(total: u64, show: bool, message: &str) -> ProgressBar {
    use std::io::IsTerminal;
    if !show {
        return ProgressBar::hidden();
    }
    if !std::io::stderr().is_terminal() {
        let bar = ProgressBar::hidden();
        bar.set_length(total);
        bar.set_prefix(message.to_string());
        let weak = bar.downgrade();
        let every = progress_line_every();
        std::thread::spawn(move || {
            let tick = every.min(std::time::Duration::from_millis(250));
            let mut since = std::time::Duration::ZERO;
            loop {
                std::thread::sleep(tick);
                since += tick;
                let Some(bar) = weak.upgrade() else { return };
                if bar.is_finished() {
                    return;
                }
                if since >= every {
                    since = std::time::Duration::ZERO;
                    eprintln!("{}", progress_line(&bar));
                }
            }
        });
        return bar;
    }
    let bar = ProgressBar::new(total);
    bar.set_style(
        ProgressStyle::with_template(
            "{prefix:>9} [{bar:40}] {percent:>3}% {msg} {elapsed} elapsed, eta {eta}",
        )
        .expect("valid template")
        .progress_chars("=> "),
    );
    bar.set_prefix(message.to_string());
    bar
}

/// One progress line: `merge: 37 % (iso_c 12/196), 21 s elapsed, about 35 s left` (the bar's
/// prefix, its share done, its message).
fn progress_line(bar: &ProgressBar) -> String {
    let (done, total) = (bar.position(), bar.length().unwrap_or(0).max(1));
    let share = (done as f64 / total as f64).min(1.0);
    let elapsed = bar.elapsed().as_secs_f64();
    let left = match share > 0.0 {
        true => format!(", about {:.0} s left", elapsed * (1.0 - share) / share),
        false => String::new(),
    };
    let detail = match bar.message() {
        m if m.is_empty() => String::new(),
        m => format!(" ({m})"),
    };
    format!(
        "{}: {:.0} %{detail}, {elapsed:.0} s elapsed{left}",
        bar.prefix(),
        100.0 * share
    )
}
