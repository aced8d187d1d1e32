//! Cooperative cancellation, per job: a front end that cannot end the process on Ctrl-C (the
//! Python package: the interpreter lives on, and other threads may be merging) asks one running
//! job to stop through its [`Token`]; the tile loop checks between tiles and fails with
//! [`Interrupted`], so a merge unwinds like any failed merge — its scratch folder removed,
//! nothing at the output path. A job takes the token of the thread that opens its inputs
//! ([`current`]), so the caller sets it on the thread that runs the job ([`set_current`]). The CLI
//! binary exits from its signal handler instead and never requests one.

use std::cell::RefCell;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

/// The error a cancelled job fails with.
#[derive(Debug, thiserror::Error)]
#[error("interrupted; nothing was written at the output path")]
pub struct Interrupted;

/// One job's stop request, shared by the thread that may request it and the job's workers.
#[derive(Clone, Debug, Default)]
pub struct Token(Arc<AtomicBool>);

impl Token {
    /// A token nobody has requested a stop on.
    pub fn new() -> Token {
        Token::default()
    }

    /// Asks the jobs holding this token to stop at their next tile.
    pub fn request(&self) {
        self.0.store(true, Ordering::SeqCst);
    }

    /// Fails with [`Interrupted`] once a stop was requested.
    pub fn check(&self) -> Result<(), Interrupted> {
        if self.0.load(Ordering::Relaxed) {
            Err(Interrupted)
        } else {
            Ok(())
        }
    }
}

thread_local! {
    static CURRENT: RefCell<Token> = RefCell::new(Token::new());
}

/// Makes `token` the one jobs started on this thread take.
pub fn set_current(token: Token) {
    CURRENT.with(|c| *c.borrow_mut() = token);
}

/// The token of jobs started on this thread (a fresh one nobody requests, unless
/// [`set_current`] set another).
pub fn current() -> Token {
    CURRENT.with(|c| c.borrow().clone())
}

/// Whether `err` is (or wraps) a cancellation.
pub fn is_interrupted(err: &anyhow::Error) -> bool {
    err.chain().any(|e| e.is::<Interrupted>())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_request_stops_only_the_jobs_of_its_token() {
        let (a, b) = (Token::new(), Token::new());
        set_current(a.clone());
        let on_other_thread = std::thread::spawn(current).join().unwrap();
        a.request();
        assert!(current().check().is_err());
        assert!(b.check().is_ok());
        assert!(on_other_thread.check().is_ok());
    }
}
