//! The error kinds the command line maps to exit codes: [`UsageError`] (exit 2, the call was
//! wrong and nothing was touched) versus every other error (exit 1, the merge failed).

/// An error in how rlmerge was called — a flag, a parameter value, an output path that would
/// overwrite an input — as opposed to a merge that failed on its data. Exit code 2.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct UsageError(pub String);

/// A [`UsageError`] as an [`anyhow::Error`].
pub fn usage(msg: impl Into<String>) -> anyhow::Error {
    UsageError(msg.into()).into()
}

/// Whether `err` (or anything it wraps) is a [`UsageError`].
pub fn is_usage(err: &anyhow::Error) -> bool {
    err.chain()
        .any(|e| e.downcast_ref::<UsageError>().is_some())
}
