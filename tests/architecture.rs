//! The house's shape, checked (issues #25, #42): no file over 700 lines and no function over 100
//! — sources, the Python binding, tests and benches alike — and no import circle between the
//! crate's files. A file's dependencies are the crate-internal paths it names outside comments
//! and its unit tests (`use crate::…`, `super::…`, grouped and nested imports, inline
//! `crate::a::b::f()`), each resolved to the longest prefix that is a module file; a circle (a
//! strongly connected set of more than one file) fails the test with its edges, so a newcomer can
//! follow a concept from its home without going round in circles. The checkers are tested on
//! the shapes they once missed. And the SIMD levels' feature lists named in one place
//! (`src/simd.rs`).

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

/// Every crate-internal path `code` names, from `crate` or `super` (a leading `super` kept as a
/// segment): `crate::a::b::f`, and each leaf of a grouped import, nested groups included
/// (`use crate::{a::{b, c}, d as e}` names `a::b`, `a::c` and `d`; `self` in a group names the
/// module before it). A restricted visibility (`pub(in crate::a)`) names nothing.
fn named_paths(code: &str) -> Vec<Vec<String>> {
    let root = regex::Regex::new(r"\b(crate|super)\s*::").unwrap();
    let mut out = Vec::new();
    for m in root.find_iter(code) {
        if code[..m.start()].trim_end().ends_with("pub(in") {
            continue;
        }
        let first = if m.as_str().starts_with("crate") {
            Vec::new()
        } else {
            vec!["super".to_string()]
        };
        use_tree(code.as_bytes(), m.end(), first, &mut out);
    }
    out
}

/// Reads the path or use tree at `i` of `code` under `prefix`, pushing each leaf path to `out`;
/// returns where it ends.
fn use_tree(
    code: &[u8],
    mut i: usize,
    mut prefix: Vec<String>,
    out: &mut Vec<Vec<String>>,
) -> usize {
    let skip = |mut i: usize| {
        while i < code.len() && code[i].is_ascii_whitespace() {
            i += 1;
        }
        i
    };
    loop {
        i = skip(i);
        match code.get(i) {
            Some(b'{') => {
                i += 1;
                loop {
                    i = skip(i);
                    match code.get(i) {
                        None => return i,
                        Some(b'}') => return i + 1,
                        Some(b',') => i += 1,
                        Some(_) => {
                            let end = use_tree(code, i, prefix.clone(), out);
                            // A character the tree reader cannot take: step over it.
                            i = if end == i { i + 1 } else { end };
                        }
                    }
                }
            }
            Some(b'*') => {
                out.push(prefix);
                return i + 1;
            }
            _ => {}
        }
        let start = i;
        while i < code.len() && (code[i].is_ascii_alphanumeric() || code[i] == b'_') {
            i += 1;
        }
        if i == start {
            out.push(prefix);
            return i;
        }
        let segment = String::from_utf8_lossy(&code[start..i]).into_owned();
        let after = skip(i);
        if code[after..].starts_with(b"::") {
            prefix.push(segment);
            i = after + 2;
            continue;
        }
        if segment != "self" {
            prefix.push(segment);
        }
        out.push(prefix);
        return i;
    }
}

/// The module files `module`'s code names.
fn dependencies(module: &Module, code: &str, files: &BTreeMap<Module, String>) -> BTreeSet<Module> {
    let resolve = |parts: &[String]| -> Option<Module> {
        (1..=parts.len())
            .rev()
            .map(|i| parts[..i].to_vec())
            .find(|p| files.contains_key(p))
    };
    let mut deps = BTreeSet::new();
    for path in named_paths(code) {
        let mut segs = path.into_iter().peekable();
        let mut base: Module = Vec::new();
        if segs.peek().is_some_and(|s| s == "super") {
            base = module.clone();
            // A file's `super` is its parent module (a mod.rs's too: its module is the folder).
            while segs.peek().is_some_and(|s| s == "super") {
                base.pop();
                segs.next();
            }
        }
        let full: Module = base.into_iter().chain(segs).collect();
        if let Some(r) = resolve(&full) {
            if &r != module && !r.is_empty() {
                deps.insert(r);
            }
        }
    }
    deps
}

/// The circles among `files` (module → its code): sets of more than one module file that reach
/// each other, each named with the edges between its members.
fn circles(files: &BTreeMap<Module, String>) -> Vec<(Vec<String>, Vec<String>)> {
    let graph: BTreeMap<Module, BTreeSet<Module>> = files
        .iter()
        .map(|(m, text)| (m.clone(), dependencies(m, &code_of(text), files)))
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
    let mut found: Vec<(Vec<String>, Vec<String>)> = Vec::new();
    for (m, r) in &reaches {
        if !r.contains(*m) {
            continue;
        }
        let members: Vec<&Module> = reaches
            .iter()
            .filter(|(o, ro)| r.contains(**o) && ro.contains(*m))
            .map(|(o, _)| *o)
            .collect();
        let names: Vec<String> = members.iter().map(|o| o.join("::")).collect();
        if found.iter().any(|(n, _)| *n == names) {
            continue;
        }
        let edges = members
            .iter()
            .flat_map(|o| {
                graph[*o]
                    .iter()
                    .filter(|d| members.contains(d))
                    .map(move |d| format!("{} -> {}", o.join("::"), d.join("::")))
            })
            .collect();
        found.push((names, edges));
    }
    found
}

#[test]
fn no_import_circles_between_files() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let files = modules(root);
    let found = circles(&files);
    assert!(found.is_empty(), "import circles between files: {found:?}");
    // The checker sees the crate: a known dependency is found.
    let inputs = vec!["inputs".to_string()];
    let deps = dependencies(&inputs, &code_of(&files[&inputs]), &files);
    assert!(deps.contains(&vec!["names".to_string()]));
}

/// The circle checker sees every way a file names another (issue #42 found circles written with
/// grouped imports it missed): inline paths, `use crate::{…}` and `super::{…}` groups, nested
/// groups, `self` in a group, and `super::super`.
#[test]
fn the_circle_checker_sees_grouped_and_nested_imports() {
    let files = |a: &str, b: &str| -> BTreeMap<Module, String> {
        [
            (vec!["x".to_string()], String::new()),
            (vec!["x".to_string(), "a".to_string()], a.to_string()),
            (vec!["x".to_string(), "b".to_string()], b.to_string()),
            (vec!["y".to_string()], String::new()),
        ]
        .into_iter()
        .collect()
    };
    let back = "use super::a::Thing;\n";
    for a in [
        "use crate::{x::b::Other, y};\n",
        "use super::{b::Other};\n",
        "use crate::{y, x::{b::{Other, More}}};\n",
        "use super::b::{self};\n",
        "use crate::x::{b};\n",
        "fn f() { super::b::go(); }\n",
        "use super::super::x::b::Other;\n",
    ] {
        let found = circles(&files(a, back));
        assert_eq!(found.len(), 1, "{a}: {found:?}");
        assert!(
            found[0].1.contains(&"x::a -> x::b".to_string()),
            "{a}: {found:?}"
        );
    }
    // No circle where nothing points back, or only a visibility names the module.
    assert!(circles(&files("use crate::{x::b::Other};\n", "")).is_empty());
    assert!(circles(&files("pub(in crate::x) fn f() {}\n", back)).is_empty());
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

/// `line` without a trailing `//` comment and trailing blanks.
fn without_comment(line: &str) -> &str {
    match line.find("//") {
        Some(i) => line[..i].trim_end(),
        None => line.trim_end(),
    }
}

/// The name of the function a line declares, with its indentation, if it declares one with a
/// body (rustfmt's layout: the body ends at a `}` line of the same indentation): any visibility
/// (`pub`, `pub(crate)`, `pub(in crate::a)`…) and qualifiers (`const`, `async`, `unsafe`,
/// `extern "C"`) before `fn`.
fn fn_declared(line: &str) -> Option<(&str, &str)> {
    let head = regex::Regex::new(
        r#"^(\s*)(?:pub(?:\s*\([^)]*\))?\s+)?(?:(?:const|async|unsafe|extern\s+"[^"]*")\s+)*fn\s+([A-Za-z_][A-Za-z0-9_]*)"#,
    )
    .unwrap();
    let c = head.captures(line)?;
    let (indent, name) = (c.get(1).unwrap().as_str(), c.get(2).unwrap().as_str());
    (!without_comment(line).ends_with(';')).then_some((indent, name))
}

/// The functions of `text` longer than [`FN_LINES`]: (line, name, lines spanned).
fn long_functions(text: &str) -> Vec<(usize, String, usize)> {
    let lines: Vec<&str> = text.lines().collect();
    let mut found = Vec::new();
    for (i, line) in lines.iter().enumerate() {
        let Some((indent, f)) = fn_declared(line) else {
            continue;
        };
        let close = format!("{indent}}}");
        let end = if without_comment(line).ends_with('}') {
            i
        } else {
            // The closing brace may carry a comment.
            (i..lines.len())
                .find(|&j| without_comment(lines[j]) == close)
                .unwrap_or(lines.len() - 1)
        };
        if end - i + 1 > FN_LINES {
            found.push((i + 1, f.to_string(), end - i + 1));
        }
    }
    found
}

/// The length checker finds the functions issue #42 found it missing: one whose closing brace
/// carries a comment, and one declared `pub(in crate)`.
#[test]
fn the_length_checker_sees_every_function() {
    let body = |head: &str, close: &str| {
        let mut text = format!("{head}\n");
        for i in 0..FN_LINES {
            text += &format!("    let x{i} = {i};\n");
        }
        text + close + "\n"
    };
    for (head, close) in [
        ("fn plain() {", "}"),
        ("fn commented() {", "} // end of commented"),
        ("pub(in crate) fn restricted() {", "}"),
        ("pub(in crate::engine) fn deeper() {", "}"),
        ("pub(crate) const unsafe fn qualified() {", "}"),
        ("pub(super) async fn awaited() -> u8 {", "}"),
    ] {
        let found = long_functions(&body(head, close));
        assert_eq!(found.len(), 1, "{head} … {close}: {found:?}");
        assert_eq!(found[0].2, FN_LINES + 2);
    }
    assert!(long_functions("fn short() {\n}\n").is_empty());
    assert!(fn_declared("    fn declared_in_a_trait(&self);").is_none());
}

#[test]
fn no_file_or_function_is_too_long() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut files = Vec::new();
    for dir in ["src", "python/src", "tests", "benches"] {
        rust_files(&root.join(dir), &mut files);
    }
    files.sort();
    let mut found = Vec::new();
    for path in &files {
        let text = std::fs::read_to_string(path).unwrap();
        let name = path.strip_prefix(root).unwrap().display();
        let lines = text.lines().count();
        if lines > FILE_LINES {
            found.push(format!("{name}: {lines} lines (at most {FILE_LINES})"));
        }
        for (line, f, span) in long_functions(&text) {
            found.push(format!(
                "{name}:{line}: fn {f} spans {span} lines (at most {FN_LINES})"
            ));
        }
    }
    assert!(files.len() > 80, "the walk found the sources and tests");
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
