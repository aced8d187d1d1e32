//! The error kinds the command line maps to exit codes: [`UsageError`] (exit 2, the call was
//! wrong and nothing was touched) versus every other error (exit 1, the merge failed) — among
//! them [`DataError`], a refusal of the inputs that names a setting that would let them through.
//! A message names the settings it is about as [`Arg`]s, which each front end spells its own
//! way ([`Dialect`]): the command line `--param weight=VALUE`, Python the keyword `weight=VALUE`
//! — from the same value, no front end rewrites another's words.

use std::fmt;

/// A setting of a call, as each front end names it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Arg {
    command_line: String,
    python: String,
}

impl Arg {
    /// A switch: `--allow-nonfinite`, Python's `allow_nonfinite=True`.
    pub fn switch(flag: &str) -> Arg {
        Arg {
            command_line: format!("--{flag}"),
            python: format!("{}=True", flag.replace('-', "_")),
        }
    }

    /// An option that takes a value: `--config-from`, Python's `config_from=`.
    pub fn option(flag: &str) -> Arg {
        Arg {
            command_line: format!("--{flag}"),
            python: format!("{}=", flag.replace('-', "_")),
        }
    }

    /// An option with its value: `--device cpu`, Python's `device="cpu"`.
    pub fn option_value(flag: &str, value: &str) -> Arg {
        Arg {
            command_line: format!("--{flag} {value}"),
            python: format!("{}=\"{value}\"", flag.replace('-', "_")),
        }
    }

    /// A method parameter with a value: `--param weight=VALUE`, Python's `weight=VALUE`.
    pub fn param(name: &str) -> Arg {
        Arg {
            command_line: format!("--param {name}=VALUE"),
            python: format!("{name}=VALUE"),
        }
    }

    /// How to give a method parameter the method needs: as a flag or a recipe key, or as a
    /// keyword of Python's `merge`.
    pub fn give_param(name: &str) -> Arg {
        Arg {
            command_line: format!(
                "give it with --param {name}=VALUE, or `{name}:` under the recipe's parameters"
            ),
            python: format!(
                "give it as the keyword {name}=VALUE of rlmerge.merge (one value for every \
                 model, a list with one per model, or a dict by model)"
            ),
        }
    }

    /// A setting named otherwise in each: a recipe key and a keyword (`merge_method`, `method`).
    pub fn named(command_line: &str, python: &str) -> Arg {
        Arg {
            command_line: command_line.into(),
            python: python.into(),
        }
    }

    /// The setting as `dialect` names it.
    pub fn in_dialect(&self, dialect: Dialect) -> &str {
        match dialect {
            Dialect::CommandLine => &self.command_line,
            Dialect::Python => &self.python,
        }
    }
}

/// Which front end a message is shown by.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Dialect {
    /// The command line, its flags and recipe keys.
    CommandLine,
    /// The Python API, its keywords.
    Python,
}

/// A piece of a [`Message`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Part {
    /// Words every front end shows alike.
    Text(String),
    /// A setting, named as the front end names it.
    Arg(Arg),
}

impl From<&str> for Part {
    fn from(text: &str) -> Part {
        Part::Text(text.into())
    }
}

impl From<String> for Part {
    fn from(text: String) -> Part {
        Part::Text(text)
    }
}

impl From<Arg> for Part {
    fn from(arg: Arg) -> Part {
        Part::Arg(arg)
    }
}

/// A message that names settings ([`Arg`]): shown by each front end in its own words
/// ([`Message::render`]), on the command line's by `Display`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Message(pub Vec<Part>);

impl Message {
    /// The message as `dialect` says it.
    pub fn render(&self, dialect: Dialect) -> String {
        self.0
            .iter()
            .map(|p| match p {
                Part::Text(t) => t.as_str(),
                Part::Arg(a) => a.in_dialect(dialect),
            })
            .collect()
    }
}

impl fmt::Display for Message {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.render(Dialect::CommandLine))
    }
}

impl From<String> for Message {
    fn from(text: String) -> Message {
        Message(vec![Part::Text(text)])
    }
}

impl From<&str> for Message {
    fn from(text: &str) -> Message {
        Message(vec![Part::Text(text.into())])
    }
}

/// A [`Message`] of text and [`Arg`]s: `message!["unless ", Arg::switch("allow-nonfinite")]`.
#[macro_export]
macro_rules! message {
    ($($part:expr),* $(,)?) => {
        $crate::error::Message(vec![$($crate::error::Part::from($part)),*])
    };
}

/// An error in how rlmerge was called — a flag, a parameter value, an output path that would
/// overwrite an input — as opposed to a merge that failed on its data. Exit code 2.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct UsageError(pub Message);

/// Inputs refused for what they hold (a NaN, a tensor some model lacks), where a setting would
/// let them through: a merge that failed on its data, exit code 1, naming that setting.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct DataError(pub Message);

/// A [`UsageError`] as an [`anyhow::Error`].
pub fn usage(msg: impl Into<Message>) -> anyhow::Error {
    UsageError(msg.into()).into()
}

/// A [`DataError`] as an [`anyhow::Error`].
pub fn data(msg: impl Into<Message>) -> anyhow::Error {
    DataError(msg.into()).into()
}

/// `err` and what it wraps, `: `-joined as `{err:#}` shows them, each message said as
/// `dialect` names its settings.
pub fn render(err: &anyhow::Error, dialect: Dialect) -> String {
    err.chain()
        .map(|e| {
            if let Some(u) = e.downcast_ref::<UsageError>() {
                u.0.render(dialect)
            } else if let Some(d) = e.downcast_ref::<DataError>() {
                d.0.render(dialect)
            } else {
                e.to_string()
            }
        })
        .collect::<Vec<_>>()
        .join(": ")
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
