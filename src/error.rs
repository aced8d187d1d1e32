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

/// `" (did you mean 'X'?)"` for the candidate closest to `word` — by edit distance, at most a
/// third of the longer word's letters apart, or one that starts with it — else nothing: the
/// ending of a message about an unknown name.
pub fn did_you_mean<'a>(word: &str, candidates: impl IntoIterator<Item = &'a str>) -> String {
    let word_lower = word.to_lowercase();
    let best = candidates
        .into_iter()
        .map(|c| (edit_distance(&word_lower, &c.to_lowercase()), c))
        .filter(|&(d, c)| {
            let longest = word.chars().count().max(c.chars().count());
            d * 3 <= longest || (word.len() >= 3 && c.starts_with(&word_lower))
        })
        .min_by_key(|&(d, _)| d);
    match best {
        Some((_, c)) => format!(" (did you mean '{c}'?)"),
        None => String::new(),
    }
}

/// `" (did you mean 'DIR/SIBLING'?)"` for a missing `path` whose folder holds a folder of a
/// similar name (a typo in the last component), else nothing.
pub fn sibling_hint(path: &std::path::Path) -> String {
    let (Some(name), parent) = (path.file_name().and_then(|n| n.to_str()), path.parent()) else {
        return String::new();
    };
    let parent = parent.filter(|p| !p.as_os_str().is_empty());
    let Ok(entries) = std::fs::read_dir(parent.unwrap_or(std::path::Path::new("."))) else {
        return String::new();
    };
    let folders: Vec<String> = entries
        .flatten()
        .filter(|e| e.path().is_dir())
        .filter_map(|e| e.file_name().to_str().map(str::to_string))
        .filter(|n| !n.starts_with('.'))
        .collect();
    let hint = did_you_mean(name, folders.iter().map(String::as_str));
    match (hint.is_empty(), parent) {
        (true, _) | (_, None) => hint,
        (false, Some(p)) => {
            // The suggestion with the path's folder in front, as the user would write it.
            let found = hint
                .trim_start_matches(" (did you mean '")
                .trim_end_matches("'?)");
            format!(" (did you mean '{}'?)", p.join(found).display())
        }
    }
}

/// Levenshtein distance between `a` and `b`, by characters.
fn edit_distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut row: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut diagonal = row[0];
        row[0] = i + 1;
        for (j, &cb) in b.iter().enumerate() {
            let next = (diagonal + usize::from(ca != cb))
                .min(row[j] + 1)
                .min(row[j + 1] + 1);
            diagonal = row[j + 1];
            row[j + 1] = next;
        }
    }
    row[b.len()]
}

#[cfg(test)]
mod tests {
    use super::did_you_mean;

    #[test]
    fn suggestions_are_close_names_only() {
        let methods = ["ties", "dare_ties", "linear", "task_arithmetic", "ram+"];
        assert_eq!(did_you_mean("tie", methods), " (did you mean 'ties'?)");
        assert_eq!(
            did_you_mean("dare-ties", methods),
            " (did you mean 'dare_ties'?)"
        );
        assert_eq!(
            did_you_mean("task", methods),
            " (did you mean 'task_arithmetic'?)"
        );
        assert_eq!(did_you_mean("TIES", methods), " (did you mean 'ties'?)");
        assert_eq!(did_you_mean("slerpy", methods), "");
        assert_eq!(
            did_you_mean("densty", ["density", "weight"]),
            " (did you mean 'density'?)"
        );
    }
}
