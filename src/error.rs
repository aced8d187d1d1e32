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

/// `text` with control characters escaped (`\n`, `\u{1b}` …), for every message that shows a
/// name read from a file: a tensor name must not forge output lines or drive the terminal.
pub fn printable(text: &str) -> std::borrow::Cow<'_, str> {
    if text.chars().any(char::is_control) {
        text.chars()
            .map(|c| {
                if c.is_control() {
                    c.escape_default().to_string()
                } else {
                    c.to_string()
                }
            })
            .collect::<String>()
            .into()
    } else {
        text.into()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn control_characters_are_escaped_and_the_rest_kept() {
        assert_eq!(printable("model.λ.weight"), "model.λ.weight");
        assert_eq!(
            printable("a\nmerged 3 model(s)\u{1b}]0;title\u{7}"),
            "a\\nmerged 3 model(s)\\u{1b}]0;title\\u{7}"
        );
    }
}
