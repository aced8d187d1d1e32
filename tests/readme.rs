//! README.md's examples run as written on the demo (issue #26): every `sh` block's `rlmerge`
//! commands and every `yaml` block that is a recipe (or a MoE config), in README order, in one folder holding
//! `rlmerge-demo/` (what `rlmerge demo` writes); and the sample `analyze` rows against the
//! command's own output. `text` blocks are synopses and are not run. Commands of other tools
//! (cargo, pip, sudo, scripts/) set up the machine; `python` lines and `python` blocks run in
//! `python/tests/test_readme.py`, with the installed package.

use std::path::Path;
use std::process::Command;

/// README's fenced blocks: (info string, body).
fn blocks(readme: &str) -> Vec<(String, String)> {
    let mut out = Vec::new();
    let mut open: Option<(String, String)> = None;
    for line in readme.lines() {
        match (&mut open, line.strip_prefix("```")) {
            (None, Some(info)) => open = Some((info.trim().to_string(), String::new())),
            (Some(_), Some(_)) => out.push(open.take().expect("open")),
            (Some((_, body)), None) => {
                body.push_str(line);
                body.push('\n');
            }
            (None, None) => {}
        }
    }
    out
}

/// A shell block's commands: continuation lines joined, trailing `  # comments` dropped.
fn commands(body: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut current = String::new();
    for line in body.lines() {
        let line = match line.find("  #") {
            Some(i) if !line[..i].contains('"') || line[..i].matches('"').count() % 2 == 0 => {
                &line[..i]
            }
            _ => line,
        };
        let line = line.trim_end();
        if let Some(head) = line.strip_suffix('\\') {
            current.push_str(head.trim_end());
            current.push(' ');
            continue;
        }
        current.push_str(line.trim_start());
        if !current.trim().is_empty() {
            out.push(current.trim().to_string());
        }
        current.clear();
    }
    out
}

/// The program a command runs, past `VAR=value` assignments.
fn program(command: &str) -> &str {
    command
        .split_whitespace()
        .find(|w| !w.contains('='))
        .unwrap_or("")
}

fn run(dir: &Path, command: &str) -> std::process::Output {
    let bin = Path::new(env!("CARGO_BIN_EXE_rlmerge"));
    let path = format!(
        "{}:{}",
        bin.parent().unwrap().display(),
        std::env::var("PATH").unwrap_or_default()
    );
    Command::new("sh")
        .arg("-c")
        .arg(command)
        .current_dir(dir)
        .env("PATH", path)
        .env("HF_HUB_OFFLINE", "1")
        .output()
        .unwrap()
}

/// README.md and every page under docs/, each with its text.
fn pages() -> Vec<(String, String)> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut docs: Vec<_> = std::fs::read_dir(root.join("docs"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "md"))
        .collect();
    docs.sort();
    std::iter::once(root.join("README.md"))
        .chain(docs)
        .map(|p| {
            let name = p.strip_prefix(root).unwrap().display().to_string();
            (name, std::fs::read_to_string(&p).unwrap())
        })
        .collect()
}

/// Issue #45: README and every docs/ page — each page's blocks in order, in its own folder
/// holding the demo.
#[test]
fn every_readme_example_runs_on_the_demo() {
    let (mut ran, mut recipes) = (0, 0);
    for (page, text) in pages() {
        let d = tempfile::tempdir().unwrap();
        let setup = run(d.path(), "rlmerge demo rlmerge-demo --write-only --quiet");
        assert!(setup.status.success(), "{setup:?}");
        for (n, (info, body)) in blocks(&text).into_iter().enumerate() {
            match info.as_str() {
                "sh" => {
                    for command in commands(&body) {
                        match program(&command) {
                            "rlmerge" => {}
                            "cargo" | "pip" | "sudo" | "apt-get" | "python" | "python3" => continue,
                            p if p.starts_with("scripts/") || p.starts_with("benches/") => continue,
                            other => panic!("{page} block {n}: `{command}` runs {other}, which this test does not know"),
                        }
                        let o = run(d.path(), &command);
                        assert!(
                            o.status.success(),
                            "{page} block {n}: `{command}` failed:\n{}",
                            String::from_utf8_lossy(&o.stderr)
                        );
                        ran += 1;
                    }
                }
                "yaml" if body.contains("merge_method:") => {
                    let file = format!("readme-{n}.yml");
                    std::fs::write(d.path().join(&file), &body).unwrap();
                    let o = run(
                        d.path(),
                        &format!("rlmerge run {file} -q -o readme-{n}-out"),
                    );
                    assert!(
                        o.status.success(),
                        "{page} block {n} (recipe) failed:\n{}",
                        String::from_utf8_lossy(&o.stderr)
                    );
                    recipes += 1;
                }
                "yaml" if body.contains("experts:") => {
                    let file = format!("readme-{n}-moe.yml");
                    std::fs::write(d.path().join(&file), &body).unwrap();
                    let o = run(d.path(), &format!("rlmerge moe {file} readme-{n}-moe-out"));
                    assert!(
                        o.status.success(),
                        "{page} block {n} (MoE config) failed:\n{}",
                        String::from_utf8_lossy(&o.stderr)
                    );
                    recipes += 1;
                }
                "yaml" => panic!("{page} block {n}: a yaml block that is not a whole recipe"),
                "text" | "python" | "" => {}
                other => panic!("{page} block {n}: unknown block kind {other:?}"),
            }
        }
    }
    assert!(
        ran >= 7 && recipes >= 1,
        "{ran} commands, {recipes} recipes ran"
    );
}

/// README stays the front door: at most 300 lines, the two set-up commands in its first block.
#[test]
fn readme_is_short_and_starts_with_the_two_commands() {
    let readme = &pages()[0].1;
    assert!(
        readme.lines().count() <= 300,
        "README has {} lines",
        readme.lines().count()
    );
    let (_, first) = blocks(readme).into_iter().next().unwrap();
    assert!(first.contains("cargo run --release -- demo") && first.contains("scripts/test-all"));
}

/// The sample table of docs/analyze.md is what `analyze` prints for the demo.
#[test]
fn readme_analyze_sample_is_the_demos() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let after = std::fs::read_to_string(root.join("docs/analyze.md")).unwrap();
    let (_, sample) = blocks(&after).into_iter().next().expect("its sample");
    let d = tempfile::tempdir().unwrap();
    assert!(
        run(d.path(), "rlmerge demo rlmerge-demo --write-only --quiet")
            .status
            .success()
    );
    let o = run(
        d.path(),
        "rlmerge analyze --base rlmerge-demo/base --model rlmerge-demo/coding-agent \
         --model rlmerge-demo/tool-agent --model rlmerge-demo/memory-agent",
    );
    assert!(o.status.success());
    let printed = String::from_utf8_lossy(&o.stdout);
    let printed: Vec<&str> = printed.lines().map(str::trim_end).collect();
    for line in sample.lines() {
        assert!(
            printed.contains(&line),
            "README's sample line is not printed: {line:?}"
        );
    }
}

#[test]
fn commands_are_read_as_a_shell_reads_them() {
    let body = "rlmerge a \\\n    --b c   # note\nFOO=1 rlmerge d\n\n";
    assert_eq!(commands(body), ["rlmerge a --b c", "FOO=1 rlmerge d"]);
    assert_eq!(program("FOO=1 rlmerge d"), "rlmerge");
}

/// Every figure of README's cost table traces to docs/benchmarks.md's 7B measurements (issue #53
/// item 1): each s/GB, time and memory figure in the table's cost column appears in the section
/// of benchmarks.md that the table's costs come from, or in its spectral section.
#[test]
fn readme_costs_trace_to_the_7b_benchmarks() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let readme = std::fs::read_to_string(root.join("README.md")).unwrap();
    let bench = std::fs::read_to_string(root.join("docs/benchmarks.md")).unwrap();
    let start = bench
        .find("### README's cost table, at 7B shapes")
        .expect("benchmarks.md has the section README's costs come from");
    let traced = &bench[start..];
    let table: Vec<&str> = readme
        .lines()
        .skip_while(|l| !l.starts_with("| family | methods |"))
        .take_while(|l| l.starts_with('|'))
        .skip(2)
        .collect();
    assert_eq!(table.len(), 5, "README's cost table has its five families");
    let mut figures = 0;
    for row in table {
        let cost = row.trim_end_matches('|').rsplit('|').next().unwrap();
        for word in cost.split(|c: char| !(c.is_ascii_digit() || c == '.' || c == '–')) {
            for figure in word.split('–').filter(|w| w.contains('.')) {
                let figure = figure.trim_matches('.');
                assert!(
                    traced.contains(figure),
                    "README's cost {figure} (row {row}) is not in docs/benchmarks.md's 7B tables"
                );
                figures += 1;
            }
        }
    }
    assert!(figures >= 12, "{figures} figures checked");
}
