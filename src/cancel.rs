//! Cooperative cancellation: a front end that cannot end the process on Ctrl-C (the Python
//! package: the interpreter lives on) asks the running job to stop; the tile loop checks between
//! tiles and fails with [`Interrupted`], so a merge unwinds like any failed merge — its scratch
//! folder removed, nothing at the output path. The CLI binary exits from its signal handler
//! instead and never sets this.

use std::sync::atomic::{AtomicBool, Ordering};

static REQUESTED: AtomicBool = AtomicBool::new(false);

/// The error a cancelled job fails with.
#[derive(Debug, thiserror::Error)]
#[error("interrupted; nothing was written at the output path")]
pub struct Interrupted;

/// Asks every running job of this process to stop at its next tile.
pub fn request() {
    REQUESTED.store(true, Ordering::SeqCst);
}

/// Clears a request, before the next job starts.
pub fn reset() {
    REQUESTED.store(false, Ordering::SeqCst);
}

/// Fails with [`Interrupted`] once a stop was requested.
pub fn check() -> Result<(), Interrupted> {
    if REQUESTED.load(Ordering::Relaxed) {
        Err(Interrupted)
    } else {
        Ok(())
    }
}

/// Whether `err` is (or wraps) a cancellation.
pub fn is_interrupted(err: &anyhow::Error) -> bool {
    err.chain().any(|e| e.is::<Interrupted>())
}
