//! Every writer follows the output rules (figures, the commit under a
//! signal, records read back), names are data in every medium (one escaping rule for cards,
//! terminals and figures), and README's table cites tests that exist.

mod common;
use common::*;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

fn analyze_plot(
    base: &Path,
    agents: &[PathBuf],
    plot: &Path,
    extra: &[&str],
) -> std::process::Output {
    let mut cmd = rlmerge();
    cmd.arg("analyze").arg("--base").arg(base);
    for a in agents {
        cmd.arg("--model").arg(a);
    }
    cmd.arg("--plot").arg(plot).args(["-q"]).args(extra);
    cmd.timeout(Duration::from_secs(60)).output().unwrap()
}

/// `analyze --plot` writes under the output rules: never through a symbolic link, never into a
/// FIFO (and never blocks on one), never into a merged folder (whose files verify checks), and
/// all figures at once; a figure a previous run wrote is replaced.
#[test]
fn figures_go_through_the_output_rules() {
    let d = tempfile::tempdir().unwrap();
    let (base, agents) = small(d.path(), &["a", "b"]);
    // A symbolic link named overlap.svg, to a file of the user's.
    let figs = d.path().join("figs");
    std::fs::create_dir(&figs).unwrap();
    let precious = d.path().join("precious.txt");
    std::fs::write(&precious, "keep").unwrap();
    std::os::unix::fs::symlink(&precious, figs.join("overlap.svg")).unwrap();
    let o = analyze_plot(&base, &agents, &figs, &[]);
    assert_eq!(o.status.code(), Some(2), "{}", err_of(&o));
    assert!(err_of(&o).contains("symbolic link"), "{}", err_of(&o));
    assert_eq!(std::fs::read_to_string(&precious).unwrap(), "keep");
    assert!(
        !figs.join("layers.svg").exists(),
        "nothing is written when one target is refused"
    );
    // A FIFO named layers.svg: refused at once, never opened.
    let fifo_dir = d.path().join("fifo");
    std::fs::create_dir(&fifo_dir).unwrap();
    assert!(std::process::Command::new("mkfifo")
        .arg(fifo_dir.join("layers.svg"))
        .status()
        .unwrap()
        .success());
    let start = Instant::now();
    let o = analyze_plot(&base, &agents, &fifo_dir, &[]);
    assert!(start.elapsed() < Duration::from_secs(50));
    assert_eq!(o.status.code(), Some(2), "{}", err_of(&o));
    assert!(err_of(&o).contains("FIFO"), "{}", err_of(&o));
    assert!(!fifo_dir.join("overlap.svg").exists());
    // A merged folder: its files are verify's.
    let merged = d.path().join("merged");
    let mut cmd = merge_of(&base, &agents);
    cmd.args(["-q", "--method", "ram", "-o"])
        .arg(&merged)
        .assert()
        .success();
    let o = analyze_plot(&base, &agents, &merged, &[]);
    assert_eq!(o.status.code(), Some(2), "{}", err_of(&o));
    assert!(err_of(&o).contains("merged folder"), "{}", err_of(&o));
    rlmerge().arg("verify").arg(&merged).assert().success();
    // A plain folder: written, no scratch left; again: replaced.
    let plain = d.path().join("plain");
    for _ in 0..2 {
        let o = analyze_plot(&base, &agents, &plain, &[]);
        assert!(o.status.success(), "{}", err_of(&o));
        let mut names: Vec<String> = std::fs::read_dir(&plain)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        assert_eq!(names, ["layers.svg", "overlap.svg"]);
    }
}

/// Names are data in every medium: a tensor name or folder name holding Markdown, HTML, escape
/// sequences, bidi overrides or characters XML forbids cannot forge card headings, images or
/// links, leave its code span, drive the terminal, or make an SVG invalid.
#[test]
fn hostile_names_are_escaped_in_cards_terminals_and_figures() {
    let d = tempfile::tempdir().unwrap();
    let names = [
        "coder`] ![x](http://e/x.png) <img src=x onerror=alert(1)>",
        "tools\u{1b}]0;pwned\u{7}\u{202e}gpj.exe",
        "mem\u{ffff}\u{fffe}\u{1}&<>\"'",
    ];
    let (base, agents) = small(d.path(), &names);
    // A base tensor one agent lacks, with a hostile name: it goes into the record's notes.
    let hostile_tensor = "x\n# Pwned heading\n<script>alert(1)</script>[link](http://e)\u{1b}[31m";
    let mut base_tensors = vec![t("model.layers.0.mlp.up_proj.weight", &[6, 4], 0.0)];
    base_tensors.push(t(hostile_tensor, &[3], 0.0));
    write_folder(&base, &base_tensors, 1);
    for a in &agents[..2] {
        let mut tensors = read_folder(a)
            .into_iter()
            .map(|(n, (dt, shape, b))| T {
                name: n,
                dtype: dt,
                shape,
                values: from_bytes(dt, &b),
            })
            .collect::<Vec<_>>();
        tensors.push(t(hostile_tensor, &[3], 0.25));
        write_folder(a, &tensors, 1);
    }
    let out = d.path().join("out");
    let mut cmd = merge_of(&base, &agents);
    let o = cmd
        .args(["--method", "ram+", "--allow-missing-tensors", "-o"])
        .arg(&out)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", err_of(&o));
    for (what, text) in [("stdout", &o.stdout), ("stderr", &o.stderr)] {
        let text = String::from_utf8_lossy(text);
        for bad in ['\u{1b}', '\u{7}', '\u{202e}', '\u{ffff}', '\u{1}'] {
            assert!(!text.contains(bad), "{what} holds {bad:?}: {text:?}");
        }
    }
    let card = std::fs::read_to_string(out.join("README.md")).unwrap();
    for bad in ['\u{1b}', '\u{7}', '\u{202e}', '\u{ffff}'] {
        assert!(!card.contains(bad), "card holds {bad:?}");
    }
    // Outside the front matter (YAML metadata, double-quoted) and outside code spans (literal
    // text), nothing of a name may be Markdown or HTML.
    assert_body_inert(&card);
    // Each agent's code span holds its whole name: its fence is longer than any backtick run.
    // (The card names the agent as the record does: relative to the output, issue #45.)
    assert!(
        card.contains(&format!(
            "``{}``",
            Path::new("..")
                .join(agents[0].strip_prefix(d.path()).unwrap())
                .components()
                .collect::<std::path::PathBuf>()
                .display()
        )),
        "{card}"
    );
    // A mergekit method's card shows its recipe (the names in it) in a fenced block that no
    // line of it can close: outside that block, the same rules hold.
    let out = d.path().join("out-ties");
    let mut cmd = merge_of(&base, &agents);
    let o = cmd
        .args(at_half_density("ties"))
        .args(["--allow-missing-tensors", "-o"])
        .arg(&out)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", err_of(&o));
    let card = std::fs::read_to_string(out.join("README.md")).unwrap();
    for bad in ['\u{1b}', '\u{7}', '\u{202e}', '\u{ffff}'] {
        assert!(!card.contains(bad), "card holds {bad:?}");
    }
    let body = card.splitn(3, "---\n").nth(2).unwrap();
    let fenced = inert_outside_fences(body);
    assert!(fenced > 5 && card.contains("merge_method: ties"), "{card}");
    // The figures are well-formed XML, with the names in them.
    let plot = d.path().join("plot");
    let o = analyze_plot(&base, &agents, &plot, &["--allow-missing-tensors"]);
    assert!(o.status.success(), "{}", err_of(&o));
    for f in ["overlap.svg", "layers.svg"] {
        let text = std::fs::read_to_string(plot.join(f)).unwrap();
        roxmltree::Document::parse(&text).unwrap_or_else(|e| panic!("{f}: {e}"));
        assert!(
            !text.contains('\u{202e}') && !text.contains('\u{ffff}'),
            "{f}"
        );
    }
}

/// Checks that no line of a card's `body` outside its fenced blocks is Markdown or HTML, and that
/// no line inside a fence closes it early; returns the lines fenced.
fn inert_outside_fences(body: &str) -> usize {
    let mut fence: Option<String> = None;
    let mut fenced = 0;
    for line in body.lines() {
        let ticks: String = line.chars().take_while(|&c| c == '`').collect();
        match &fence {
            Some(f) if line == f => fence = None,
            Some(f) => {
                assert!(
                    !line.starts_with(f.as_str()),
                    "a line closes the fence: {line:?}"
                );
                fenced += 1;
                continue;
            }
            None if ticks.len() >= 3 => {
                fence = Some(ticks);
                continue;
            }
            None => {}
        }
        assert_inert(&without_code_spans(line));
    }
    assert!(fence.is_none(), "an unclosed fence");
    fenced
}

/// `line` with its Markdown code spans (a run of n backticks to the next run of exactly n) cut.
fn without_code_spans(line: &str) -> String {
    let b = line.as_bytes();
    let run = |at: usize| b[at..].iter().take_while(|&&c| c == b'`').count();
    let (mut out, mut i) = (String::new(), 0);
    while i < b.len() {
        if b[i] != b'`' {
            out.push(b[i] as char);
            i += 1;
            continue;
        }
        let n = run(i);
        let mut j = i + n;
        let close = loop {
            match b[j..].iter().position(|&c| c == b'`') {
                None => break None,
                Some(k) => {
                    let m = run(j + k);
                    if m == n {
                        break Some(j + k + m);
                    }
                    j += k + m;
                }
            }
        };
        match close {
            Some(end) => i = end,
            None => {
                out.push_str(&line[i..i + n]);
                i += n;
            }
        }
    }
    out
}

/// Every line of a card's body (after its front matter) outside code spans and fenced blocks is
/// inert ([`assert_inert`]). Fenced blocks (the recipe that reproduces the merge) are literal
/// text: their fence is longer than any run of backticks inside.
fn assert_body_inert(card: &str) {
    let body = card.splitn(3, "---\n").nth(2).unwrap();
    let mut fence: Option<String> = None;
    for line in body.lines() {
        match &fence {
            Some(f) if line == f => fence = None,
            Some(_) => {}
            None if line.starts_with("```") => {
                fence = Some(line.chars().take_while(|&c| c == '`').collect());
            }
            None => assert_inert(&without_code_spans(line)),
        }
    }
}

/// A model card's line outside code spans and blocks: nothing of a name in it may be Markdown or
/// HTML — no forged heading, raw HTML or live link.
fn assert_inert(line: &str) {
    assert!(
        // The title names the method, from rlmerge's own words only.
        !line.starts_with('#') || line.starts_with("# Merged with ") || line.starts_with("## "),
        "a forged heading: {line:?}"
    );
    assert!(
        !line.contains("<img") && !line.contains("<script"),
        "raw HTML: {line:?}"
    );
    assert!(!line.contains("](http://e"), "a live link: {line:?}");
}

/// A tampered record cannot send verify outside the folder: file names must be plain names.
#[test]
fn verify_refuses_records_that_name_files_outside_the_folder() {
    let d = tempfile::tempdir().unwrap();
    let (base, agents) = small(d.path(), &["a", "b"]);
    let out = d.path().join("out");
    let mut cmd = merge_of(&base, &agents);
    cmd.args(["-q", "--method", "ram", "-o"])
        .arg(&out)
        .assert()
        .success();
    let record_path = out.join("rlmerge_record.json");
    let good = std::fs::read_to_string(&record_path).unwrap();
    for name in [
        "../../etc/passwd",
        "/etc/passwd",
        "..",
        "sub/x.safetensors",
        "a\u{1b}[2J",
    ] {
        let plain = !name.contains(['/', '.']);
        for (key, pointer) in [
            ("outputs", "/outputs/0/file"),
            ("inputs", "/inputs/0/files/0/file"),
        ] {
            let mut r: serde_json::Value = serde_json::from_str(&good).unwrap();
            *r.pointer_mut(pointer).unwrap() = name.into();
            std::fs::write(&record_path, r.to_string()).unwrap();
            let o = rlmerge().arg("verify").arg(&out).output().unwrap();
            assert_eq!(o.status.code(), Some(1), "{key} {name:?}: {}", err_of(&o));
            // A plain name is looked for in the folder, and shown escaped.
            assert_eq!(
                err_of(&o).contains("not a plain file name"),
                !plain,
                "{}",
                err_of(&o)
            );
            assert!(!err_of(&o).contains('\u{1b}'));
        }
    }
    std::fs::write(&record_path, good).unwrap();
    rlmerge().arg("verify").arg(&out).assert().success();
}

/// A signal that lands while the merge commits (or just after) never leaves a complete output
/// beside "nothing was written": either the run was interrupted and nothing is at the output
/// path (exit 130), or the output is complete, verifies, and the run says so (exit 0).
#[test]
fn a_signal_at_the_commit_never_misreports_the_output() {
    let d = tempfile::tempdir().unwrap();
    let (base, agents) = small(d.path(), &["a", "b"]);
    // How long one merge takes here, to aim signals at its end.
    let time_one = || {
        let start = Instant::now();
        let out = d.path().join("timing");
        let _ = std::fs::remove_dir_all(&out);
        let mut cmd = merge_of(&base, &agents);
        cmd.args(["-q", "--device", "cpu", "--method", "ram", "-o"])
            .arg(&out)
            .assert()
            .success();
        start.elapsed()
    };
    let typical = (0..3).map(|_| time_one()).min().unwrap();
    let (mut interrupted, mut completed) = (0, 0);
    for k in 0..30u32 {
        let out = d.path().join(format!("out{k}"));
        let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_rlmerge"));
        cmd.arg("merge").arg("--base").arg(&base);
        for a in &agents {
            cmd.arg("--model").arg(a);
        }
        let child = cmd
            .args(["-q", "--device", "cpu", "--method", "ram", "-o"])
            .arg(&out)
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        // From 40 % to 120 % of a typical run, spread over the tries.
        std::thread::sleep(typical * (40 + 80 * k / 29) / 100);
        unsafe { libc::kill(child.id() as i32, libc::SIGINT) };
        let o = child.wait_with_output().unwrap();
        let err = err_of(&o);
        match o.status.code() {
            Some(130) => {
                interrupted += 1;
                assert!(
                    !out.exists(),
                    "exit 130 said nothing was written, but {out:?} exists"
                );
                assert!(err.contains("nothing was written"), "{err}");
            }
            Some(0) => {
                completed += 1;
                assert!(String::from_utf8_lossy(&o.stdout).contains("merged 2 models"));
                rlmerge().arg("verify").arg(&out).assert().success();
            }
            // Killed by the signal itself: it landed before main installed the handler (a
            // loaded machine can take that long to start the process), so before anything was
            // written — no scratch folder either (checked below).
            None if std::os::unix::process::ExitStatusExt::signal(&o.status)
                == Some(libc::SIGINT) =>
            {
                interrupted += 1;
                assert!(!out.exists(), "killed at start, yet {out:?} exists");
            }
            other => panic!("exit {other:?}: {err}"),
        }
        let left: Vec<String> = std::fs::read_dir(d.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|n| n.contains(".rlmerge-"))
            .collect();
        assert!(left.is_empty(), "{left:?}");
    }
    eprintln!("{interrupted} interrupted, {completed} completed");
}

/// retention.svg reads λ from the merged folder's record: a record that is a FIFO is never
/// opened (analyze finishes, without λ), and a record of other agents gives none for them — only
/// the record of a merge of these very agents gives theirs.
#[test]
fn retention_reads_lambda_only_from_a_regular_record_of_these_agents() {
    let d = tempfile::tempdir().unwrap();
    let (base, agents) = small(d.path(), &["a", "b"]);
    let merged = d.path().join("merged");
    let mut cmd = merge_of(&base, &agents);
    let o = cmd
        .args(["-q", "--method", "ram+", "-o"])
        .arg(&merged)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", err_of(&o));
    let has_lambda = |case: &str| {
        let plot = d.path().join(format!("plot-{case}"));
        let o = analyze_plot(
            &base,
            &agents,
            &plot,
            &["--merged", merged.to_str().unwrap()],
        );
        assert!(o.status.success(), "{case}: {}", err_of(&o));
        std::fs::read_to_string(plot.join("retention.svg"))
            .unwrap()
            .contains("λ = ")
    };
    assert!(has_lambda("record"), "a merge of these agents gives its λ");
    // The same weights with another merge's record: its agents are not these.
    let record = merged.join("rlmerge_record.json");
    let text = std::fs::read_to_string(&record).unwrap();
    // The record names agent a relative to the merged folder: another merge's names another a.
    let a = format!(
        "\"../{}\"",
        agents[0].file_name().unwrap().to_string_lossy()
    );
    assert!(text.contains(&a), "{text}");
    let other = text.replace(&a, "\"/elsewhere/a\"");
    std::fs::write(&record, other).unwrap();
    let a_lambda = {
        let plot = d.path().join("plot-other");
        let o = analyze_plot(
            &base,
            &agents,
            &plot,
            &["--merged", merged.to_str().unwrap()],
        );
        assert!(o.status.success(), "{}", err_of(&o));
        std::fs::read_to_string(plot.join("retention.svg")).unwrap()
    };
    assert_eq!(
        a_lambda.matches("λ = ").count(),
        1,
        "only agent b is this merge's"
    );
    std::fs::remove_file(&record).unwrap();
    assert!(std::process::Command::new("mkfifo")
        .arg(&record)
        .status()
        .unwrap()
        .success());
    let start = Instant::now();
    assert!(!has_lambda("fifo"), "a FIFO record gives no λ");
    assert!(
        start.elapsed() < Duration::from_secs(30),
        "the FIFO was opened"
    );
}

/// Every test docs/guarantees.md's table cites exists, under the name it gives (a name ending in
/// "…" is a prefix).
#[test]
fn every_test_readme_cites_exists() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let table = std::fs::read_to_string(root.join("docs/guarantees.md")).unwrap();
    let table = table.as_str();
    let cite =
        regex::Regex::new(r"`((?:tests|python/tests)/[\w/]+\.(?:rs|py))` \(([^)]*)\)").unwrap();
    let name = regex::Regex::new(r"`([A-Za-z_][\w]*(?:…)?)`").unwrap();
    let mut checked = 0;
    for c in cite.captures_iter(table) {
        let file = root.join(&c[1]);
        let text = std::fs::read_to_string(&file)
            .unwrap_or_else(|_| panic!("README cites {}, which does not exist", &c[1]));
        for n in name.captures_iter(&c[2]) {
            let n = &n[1];
            let (prefix, whole) = match n.strip_suffix('…') {
                Some(p) => (p, false),
                None => (n, true),
            };
            let found = text.lines().any(|l| {
                let l = l.trim_start();
                let def = l
                    .strip_prefix("fn ")
                    .or_else(|| l.strip_prefix("def "))
                    .or_else(|| l.strip_prefix("async fn "));
                def.is_some_and(|rest| {
                    rest.starts_with(prefix) && (!whole || rest[prefix.len()..].starts_with('('))
                })
            });
            assert!(
                found,
                "README cites {n} in {}, which has no such test",
                &c[1]
            );
            checked += 1;
        }
    }
    assert!(
        checked >= 20,
        "only {checked} cited tests found: is the table's format the same?"
    );
}
