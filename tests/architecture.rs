//! The house's shape, checked (issue #25): no source file over 700 lines, no function over 100,
//! and no import circle between the crate's files. A file's
//! dependencies are the crate-internal paths it names outside comments and its unit tests
//! (`use crate::…`, `super::…`, inline `crate::a::b::f()`), each resolved to the longest prefix
//! that is a module file; a circle (a strongly connected set of more than one file) fails the test
//! with its edges, so a newcomer can follow a concept from its home without going round in
//! circles. And the SIMD levels' feature lists named in one place (`src/simd.rs`).

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

type Module = Vec<String>;

/// Every module file under src/ by module path (`src/a/b.rs` and `src/a/b/mod.rs` are `a::b`;
/// lib.rs and main.rs the root).
fn modules(root: &Path) -> BTreeMap<Module, String> {
    let mut out = BTreeMap::new();
    let mut stack = vec![root.join("src")];
    while let Some(dir) = stack.pop() {
        for e in std::fs::read_dir(&dir).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                stack.push(p);
            } else if p.extension().is_some_and(|x| x == "rs") {
                let rel = p.strip_prefix(root.join("src")).unwrap().with_extension("");
                let mut parts: Module = rel
                    .components()
                    .map(|c| c.as_os_str().to_string_lossy().into_owned())
                    .collect();
                if parts.last().is_some_and(|l| l == "mod") {
                    parts.pop();
                }
                if parts == ["lib"] || parts == ["main"] {
                    parts.clear();
                }
                out.insert(parts, std::fs::read_to_string(&p).unwrap());
            }
        }
    }
    out
}

/// `text` without comments and without its `#[cfg(test)] mod tests` (tests may reach anywhere).
fn code_of(text: &str) -> String {
    let text = text.split("#[cfg(test)]\nmod tests").next().unwrap();
    text.lines()
        .map(|l| match l.find("//") {
            Some(i) => &l[..i],
            None => l,
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// The module files `module`'s code names.
fn dependencies(module: &Module, code: &str, files: &BTreeMap<Module, String>) -> BTreeSet<Module> {
    let path = regex::Regex::new(r"\b(crate|super)((?:::\w+)+)(?:::\{([^;]*?)\})?").unwrap();
    let resolve = |parts: &[String]| -> Option<Module> {
        (1..=parts.len())
            .rev()
            .map(|i| parts[..i].to_vec())
            .find(|p| files.contains_key(p))
    };
    let mut deps = BTreeSet::new();
    for c in path.captures_iter(code) {
        let mut segs: Vec<String> = c[2]
            .split("::")
            .filter(|s| !s.is_empty())
            .map(String::from)
            .collect();
        let mut base: Module = if &c[1] == "crate" {
            Vec::new()
        } else {
            module[..module.len().saturating_sub(1)].to_vec()
        };
        while segs.first().is_some_and(|s| s == "super") {
            base.pop();
            segs.remove(0);
        }
        let full: Module = base.into_iter().chain(segs).collect();
        let mut targets = vec![full.clone()];
        if let Some(group) = c.get(3) {
            for item in group.as_str().split(',') {
                let item = item
                    .split(" as ")
                    .next()
                    .unwrap()
                    .trim()
                    .trim_matches(|c| c == '{' || c == '}' || c == ' ');
                if !item.is_empty() && item != "self" {
                    targets.push(
                        full.iter()
                            .cloned()
                            .chain(item.split("::").map(String::from))
                            .collect(),
                    );
                }
            }
        }
        for t in targets {
            if let Some(r) = resolve(&t) {
                if &r != module && !r.is_empty() {
                    deps.insert(r);
                }
            }
        }
    }
    deps
}

#[test]
fn no_import_circles_between_files() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let files = modules(root);
    let graph: BTreeMap<Module, BTreeSet<Module>> = files
        .iter()
        .map(|(m, text)| (m.clone(), dependencies(m, &code_of(text), &files)))
        .collect();
    // Circles: files that reach each other (reachability by depth-first search).
    let reach = |from: &Module| -> BTreeSet<Module> {
        let (mut seen, mut todo) = (BTreeSet::new(), vec![from.clone()]);
        while let Some(m) = todo.pop() {
            for d in &graph[&m] {
                if seen.insert(d.clone()) {
                    todo.push(d.clone());
                }
            }
        }
        seen
    };
    let reaches: BTreeMap<&Module, BTreeSet<Module>> =
        graph.keys().map(|m| (m, reach(m))).collect();
    let mut circles = Vec::new();
    for (m, r) in &reaches {
        if r.contains(*m) {
            let circle: Vec<String> = reaches
                .iter()
                .filter(|(o, ro)| r.contains(**o) && ro.contains(*m))
                .map(|(o, _)| o.join("::"))
                .collect();
            if !circles.contains(&circle) {
                circles.push(circle);
            }
        }
    }
    assert!(
        circles.is_empty(),
        "import circles between files: {circles:?} (edges: {:?})",
        circles
            .iter()
            .flatten()
            .flat_map(|m| {
                let key: Module = m.split("::").map(String::from).collect();
                graph[&key]
                    .iter()
                    .filter(|d| circles.iter().any(|c| c.contains(&d.join("::"))))
                    .map(move |d| format!("{m} -> {}", d.join("::")))
                    .collect::<Vec<_>>()
            })
            .collect::<Vec<_>>()
    );
    // The checker sees the crate: a known dependency is found.
    assert!(graph[&vec!["inputs".to_string()]].contains(&vec!["names".to_string()]));
}

/// Lines a source file may have, and lines a function may span (its `fn` line to its closing
/// brace, doc comment not counted): past them a file holds more than one idea, a function more
/// than one step.
const FILE_LINES: usize = 700;
const FN_LINES: usize = 100;

/// Every `.rs` file under `dir`, recursively.
fn rust_files(dir: &Path, out: &mut Vec<std::path::PathBuf>) {
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            rust_files(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

/// The name of the function a line declares, with its indentation, if it declares one with a
/// body (rustfmt's layout: the body ends at a `}` line of the same indentation).
fn fn_declared(line: &str) -> Option<(&str, &str)> {
    let code = line.trim_start();
    let indent = &line[..line.len() - code.len()];
    let mut rest = code;
    for prefix in [
        "pub(crate) ",
        "pub(super) ",
        "pub ",
        "const ",
        "async ",
        "unsafe ",
    ] {
        rest = rest.strip_prefix(prefix).unwrap_or(rest);
    }
    let name = rest.strip_prefix("fn ")?;
    let name = &name[..name.find(|c: char| !(c.is_alphanumeric() || c == '_'))?];
    (!line.trim_end().ends_with(';')).then_some((indent, name))
}

#[test]
fn no_file_or_function_is_too_long() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut files = Vec::new();
    rust_files(&root.join("src"), &mut files);
    rust_files(&root.join("python/src"), &mut files);
    files.sort();
    let mut found = Vec::new();
    for path in &files {
        let text = std::fs::read_to_string(path).unwrap();
        let lines: Vec<&str> = text.lines().collect();
        let name = path.strip_prefix(root).unwrap().display();
        if lines.len() > FILE_LINES {
            found.push(format!(
                "{name}: {} lines (at most {FILE_LINES})",
                lines.len()
            ));
        }
        for (i, line) in lines.iter().enumerate() {
            let Some((indent, f)) = fn_declared(line) else {
                continue;
            };
            let close = format!("{indent}}}");
            let end = if line.trim_end().ends_with('}') {
                i
            } else {
                (i..lines.len()).find(|&j| lines[j] == close).unwrap_or(i)
            };
            if end - i + 1 > FN_LINES {
                found.push(format!(
                    "{name}:{}: fn {f} spans {} lines (at most {FN_LINES})",
                    i + 1,
                    end - i + 1
                ));
            }
        }
    }
    assert!(files.len() > 50, "the walk found the sources");
    assert!(found.is_empty(), "split these:\n{}", found.join("\n"));
}

/// Every `pub fn` of the crate is used somewhere — in the crate, the binary, the Python binding,
/// the tests or the benches: a public function nobody calls is dead code the compiler cannot
/// flag (it may be the library's API). A name used anywhere else counts as used, so this only
/// catches functions whose name appears nowhere but their definition.
#[test]
fn no_public_function_is_dead() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut files = Vec::new();
    for dir in ["src", "python/src", "tests", "benches"] {
        rust_files(&root.join(dir), &mut files);
    }
    let texts: Vec<(std::path::PathBuf, String)> = files
        .into_iter()
        .map(|f| {
            let t = std::fs::read_to_string(&f).unwrap();
            (f, t)
        })
        .collect();
    let words = |text: &str, name: &str| {
        text.match_indices(name)
            .filter(|&(i, _)| {
                let before = text[..i].chars().next_back();
                let after = text[i + name.len()..].chars().next();
                let word = |c: Option<char>| c.is_some_and(|c| c.is_alphanumeric() || c == '_');
                !word(before) && !word(after)
            })
            .count()
    };
    let mut dead = Vec::new();
    for (path, text) in texts
        .iter()
        .filter(|(p, _)| p.starts_with(root.join("src")))
    {
        for line in text.lines() {
            let code = line.trim_start();
            let Some(rest) = ["pub fn ", "pub(crate) fn ", "pub(super) fn "]
                .iter()
                .find_map(|p| code.strip_prefix(p))
            else {
                continue;
            };
            let name: String = rest
                .chars()
                .take_while(|c| c.is_alphanumeric() || *c == '_')
                .collect();
            let uses: usize = texts.iter().map(|(_, t)| words(t, &name)).sum();
            if uses <= 1 {
                dead.push(format!(
                    "{}: {name}",
                    path.strip_prefix(root).unwrap().display()
                ));
            }
        }
    }
    assert!(
        dead.is_empty(),
        "public functions nothing uses:\n{}",
        dead.join("\n")
    );
}

/// The SIMD levels' features are named once, in `src/simd.rs`'s `multiversion!` (one list per
/// level); a hand-written kernel called at a level (`select::key_window`, `select::ranks`,
/// `method::statistics::l1`) must enable exactly that level's list, or it would run code the
/// detection never checked for, or miss instructions the level's builds have. Every
/// `target_feature(enable = "…")` under src/ is one of the macro's lists.
#[test]
fn hand_written_kernels_enable_a_levels_features() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let enable = regex::Regex::new(r#"target_feature\(enable = "([^"]+)"\)"#).unwrap();
    let simd = std::fs::read_to_string(root.join("src/simd.rs")).unwrap();
    let levels: BTreeSet<&str> = enable
        .captures_iter(&simd)
        .map(|c| c.get(1).unwrap().as_str())
        .collect();
    assert_eq!(
        levels.len(),
        2,
        "simd.rs names the AVX2 and AVX-512 lists: {levels:?}"
    );
    let mut files = Vec::new();
    rust_files(&root.join("src"), &mut files);
    let mut stray = Vec::new();
    for file in files {
        let text = std::fs::read_to_string(&file).unwrap();
        for c in enable.captures_iter(&text) {
            let list = c.get(1).unwrap().as_str();
            if !levels.contains(list) {
                stray.push(format!("{}: \"{list}\"", file.display()));
            }
        }
    }
    assert!(
        stray.is_empty(),
        "feature lists that are not a level's ({levels:?}):\n{}",
        stray.join("\n")
    );
}
