//! Issue #45, the front door: what a newcomer sees — `rlmerge methods` with cost classes in 100
//! columns, SVC named wherever the method is, a model card and record that reproduce the merge
//! and say nothing of the machine, a warning for an agent that cannot be an RL agent of the
//! base, mistyped folders answered with the folder meant, progress lines without a terminal,
//! and `--device auto` keeping the bus-bound methods on the CPU.

mod common;
use common::*;
use safetensors::tensor::Dtype;
use std::path::{Path, PathBuf};

fn stdout_of(o: &std::process::Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

#[test]
fn methods_fit_100_columns_with_their_costs_and_each_has_its_page() {
    let o = rlmerge().arg("methods").output().unwrap();
    assert!(o.status.success());
    let text = stdout_of(&o);
    for line in text.lines() {
        assert!(
            line.chars().count() <= 100,
            "{} columns: {line}",
            line.chars().count()
        );
    }
    let json: serde_json::Value = serde_json::from_slice(
        &rlmerge()
            .args(["methods", "--json"])
            .output()
            .unwrap()
            .stdout,
    )
    .unwrap();
    let all = json.as_array().unwrap();
    assert_eq!(all.len(), 26, "25 methods and svc");
    assert!(text.contains("ramplus"), "the aliases are listed: {text}");
    for m in all {
        let name = m["name"].as_str().unwrap();
        let (cost, memory) = (m["cost"].as_str().unwrap(), m["memory"].as_str().unwrap());
        assert!(["stream", "scan", "spectral"].contains(&cost), "{m}");
        assert!(["tiles", "matrices"].contains(&memory), "{m}");
        // The table's row of the method names both classes.
        let row = text
            .lines()
            .find(|l| l.split_whitespace().next() == Some(name))
            .unwrap_or_else(|| panic!("no row for {name}:\n{text}"));
        assert!(row.contains(cost) && row.contains(memory), "{row}");
        // In its column: no description runs into it (tsv's did).
        let at: String = row.chars().skip(17 + 1 + 50 + 1).collect();
        assert!(at.starts_with(cost), "{row}");
        // Its own page: every parameter, the reference, in 100 columns.
        let page = rlmerge().args(["methods", name]).output().unwrap();
        assert!(page.status.success(), "{name}");
        let page = stdout_of(&page);
        assert!(page.contains(m["reference"].as_str().unwrap()), "{page}");
        for p in m["parameters"].as_array().unwrap() {
            assert!(page.contains(p["name"].as_str().unwrap()), "{name}: {page}");
        }
        for line in page.lines() {
            assert!(line.chars().count() <= 100, "{name}: {line}");
        }
    }
    let spectral: Vec<&str> = all
        .iter()
        .filter(|m| m["cost"] == "spectral")
        .map(|m| m["name"].as_str().unwrap())
        .collect();
    assert_eq!(spectral, ["iso_c", "tsv", "resmerge", "svc"]);
    assert!(text.contains("ram+ (default)"), "{text}");
    let o = rlmerge().args(["methods", "tie"]).output().unwrap();
    assert_eq!(o.status.code(), Some(2));
    assert!(err_of(&o).contains("did you mean 'ties'"), "{}", err_of(&o));
}

/// A recipe `name` in `f`'s folder: `method` over the base and agent 0, with `model_keys`
/// (`    key: value` lines) under the agent.
fn one_agent_recipe(f: &Fixture, name: &str, method: &str, model_keys: &str) -> PathBuf {
    let recipe = f.dir.path().join(name);
    std::fs::write(
        &recipe,
        format!(
            "merge_method: {method}\nbase_model: {}\nmodels:\n  - model: {}\n{model_keys}",
            f.base.display(),
            f.agents[0].display()
        ),
    )
    .unwrap();
    recipe
}

/// `rlmerge run RECIPE -o OUT` with `args`, its output.
fn run_recipe(recipe: &Path, out: &Path, args: &[&str]) -> std::process::Output {
    rlmerge()
        .arg("run")
        .arg(recipe)
        .args(args)
        .arg("-o")
        .arg(out)
        .output()
        .unwrap()
}

#[test]
fn svc_is_named_wherever_the_method_is() {
    let f = matrices(45);
    let out = f.dir.path().join("out");
    let o = merge_cmd(&f, &out, &["--method", "svc"]).output().unwrap();
    assert_eq!(o.status.code(), Some(2));
    assert!(err_of(&o).contains("add --svc ALPHA"), "{}", err_of(&o));
    let recipe = one_agent_recipe(&f, "svc.yml", "svc", "");
    let o = run_recipe(&recipe, &out, &[]);
    assert_eq!(o.status.code(), Some(2));
    assert!(err_of(&o).contains("`svc: ALPHA`"), "{}", err_of(&o));
    assert!(!out.exists());

    let o = merge_cmd(
        &f,
        &out,
        &["--method", "ties", "--param", "weight=1", "--svc", "0.1"],
    )
    .output()
    .unwrap();
    assert!(o.status.success(), "{}", err_of(&o));
    assert!(
        stdout_of(&o).contains("with ties then SVC (α = 0.1)"),
        "{}",
        stdout_of(&o)
    );
    let card = std::fs::read_to_string(out.join("README.md")).unwrap();
    let title = card.lines().find(|l| l.starts_with("# ")).unwrap();
    assert_eq!(title, "# Merged with ties then SVC (α = 0.1)");
    assert!(card.contains("Then **SVC** calibrated") && card.contains("arXiv:2602.05536"));
    // SVC is rlmerge's: mergekit would not take this recipe.
    assert!(!card.contains("mergekit-yaml"), "{card}");
}

/// Every merge's card gives the recipe that makes it again, byte for byte; methods mergekit has
/// not are not said to have its semantics; the record names inputs relative to the output, so
/// the folder says nothing of the machine and `verify --against` works after both moved.
#[test]
fn every_card_reproduces_its_merge_and_the_record_is_portable() {
    let f = matrices(45);
    let run_in = |dir: &Path, args: &[&str]| {
        let o = rlmerge().current_dir(dir).args(args).output().unwrap();
        assert!(o.status.success(), "{args:?}: {}", err_of(&o));
        o
    };
    let root = f.dir.path();
    run_in(
        root,
        &[
            "merge",
            "--base",
            "base",
            "--model",
            "agent0",
            "--model",
            "agent1",
            "--model",
            "agent2",
            "--method",
            "ram+",
            "--scope",
            "layer",
            "--epsilon",
            "2e-5",
            "-q",
            "-o",
            "out/ram",
        ],
    );
    let ram = root.join("out/ram");
    let card = std::fs::read_to_string(ram.join("README.md")).unwrap();
    assert!(card.contains("## Reproduce"), "{card}");
    let recipe = std::fs::read_to_string(ram.join("mergekit_config.yml")).unwrap();
    assert!(
        recipe.contains("scope: layer") && recipe.contains("epsilon"),
        "{recipe}"
    );
    run_in(
        root,
        &["run", "out/ram/mergekit_config.yml", "-q", "-o", "again"],
    );
    assert_eq!(
        std::fs::read(ram.join("model.safetensors")).unwrap(),
        std::fs::read(root.join("again/model.safetensors")).unwrap(),
        "the card's recipe makes another merge"
    );
    let record = std::fs::read_to_string(ram.join("rlmerge_record.json")).unwrap();
    let abs = std::fs::canonicalize(root).unwrap();
    assert!(!record.contains(&*abs.to_string_lossy()), "{record}");
    let json: serde_json::Value = serde_json::from_str(&record).unwrap();
    assert_eq!(json["base"], "../../base");
    assert_eq!(json["inputs"][1]["path"], "../../agent0");

    // The inputs and the output moved together: verify finds them.
    let moved = tempfile::tempdir().unwrap();
    let to = moved.path().join("elsewhere");
    std::fs::rename(root, &to).unwrap();
    let o = rlmerge()
        .arg("verify")
        .arg(to.join("out/ram"))
        .arg("--against")
        .output()
        .unwrap();
    std::fs::rename(&to, root).unwrap();
    assert!(o.status.success(), "{}{}", stdout_of(&o), err_of(&o));
    assert!(stdout_of(&o).contains("recomputed model.safetensors is identical"));

    run_in(
        root,
        &[
            "merge", "--base", "base", "--model", "agent0", "--model", "agent1", "--method",
            "resmerge", "-q", "-o", "out/res",
        ],
    );
    let card = std::fs::read_to_string(root.join("out/res/README.md")).unwrap();
    assert!(!card.contains("with mergekit's semantics"), "{card}");
    assert!(card.contains("mergekit has no such method") && !card.contains("mergekit-yaml"));
    assert!(!card.contains("in the configuration below"), "{card}");
    run_in(
        root,
        &[
            "merge", "--base", "base", "--model", "agent0", "--model", "agent1", "--method",
            "ties", "--param", "weight=1", "-q", "-o", "out/ties",
        ],
    );
    let card = std::fs::read_to_string(root.join("out/ties/README.md")).unwrap();
    assert!(
        card.contains("with mergekit's semantics")
            && card.contains(
                "`mergekit-yaml mergekit_config.yml OUT`, run in this folder, takes it too"
            ),
        "{card}"
    );
}

/// An agent that changed every element is not an RL agent of this base: a warning with the
/// figure, the merge still made; `--allow-dense-agents` silences it; sparse agents get none.
#[test]
fn an_agent_that_changed_everything_is_warned_about() {
    let shapes = [("model.layers.0.mlp.up_proj.weight", vec![64, 48])];
    let dense = fixture(7, Dtype::BF16, &shapes, &[0.1, 1.0], 1);
    let out = dense.dir.path().join("out");
    let o = merge_cmd(&dense, &out, &[]).output().unwrap();
    assert!(o.status.success(), "{}", err_of(&o));
    let err = err_of(&o);
    let agent = dense.agents[1].display().to_string();
    let line = err
        .lines()
        .find(|l| l.contains("changed") && l.contains("of the elements sampled"))
        .unwrap_or_else(|| panic!("no warning: {err}"));
    assert!(
        line.starts_with("warning: agent") && line.contains(&agent),
        "{line}"
    );
    assert!(line.contains("--allow-dense-agents"), "{line}");
    assert!(
        !err.contains(&format!("agent {} changed", dense.agents[0].display())),
        "{err}"
    );
    // In the card's notes too.
    let card = std::fs::read_to_string(out.join("README.md")).unwrap();
    assert!(card.contains("of the elements sampled"), "{card}");
    let quiet = dense.dir.path().join("quiet");
    let o = merge_cmd(&dense, &quiet, &["--allow-dense-agents"])
        .output()
        .unwrap();
    assert!(o.status.success());
    assert!(!err_of(&o).contains("elements sampled"), "{}", err_of(&o));
    // analyze says it as well.
    let o = rlmerge()
        .args(["analyze", "--base"])
        .arg(&dense.base)
        .arg("--model")
        .arg(&dense.agents[0])
        .arg("--model")
        .arg(&dense.agents[1])
        .output()
        .unwrap();
    assert!(err_of(&o).contains("elements sampled"), "{}", err_of(&o));

    let sparse = matrices(45);
    let o = merge_cmd(&sparse, &sparse.dir.path().join("out"), &[])
        .output()
        .unwrap();
    assert!(o.status.success());
    assert!(!err_of(&o).contains("elements sampled"), "{}", err_of(&o));
}

#[test]
fn a_mistyped_folder_is_a_usage_error_naming_the_folder_meant() {
    let f = matrices(45);
    let root = f.dir.path();
    for (typo, meant) in [("./agnt0", "./agent0"), ("sub/agnt0", "sub/agent0")] {
        if typo.starts_with("sub/") {
            std::fs::create_dir_all(root.join("sub")).unwrap();
            let _ = std::fs::rename(root.join("agent1"), root.join("sub/agent0"));
        }
        let out = root.join("out");
        let o = rlmerge()
            .current_dir(root)
            .args(["merge", "--base", "base", "--model", typo, "-o", "out"])
            .env("HF_HUB_OFFLINE", "1")
            .output()
            .unwrap();
        assert_eq!(o.status.code(), Some(2), "{typo}: {}", err_of(&o));
        assert!(
            err_of(&o).contains(&format!("did you mean '{meant}'")),
            "{typo}: {}",
            err_of(&o)
        );
        assert!(!out.exists());
    }
    // org/name shaped, its first part a local folder: not looked up on the Hub.
    let o = rlmerge()
        .current_dir(root)
        .args([
            "merge",
            "--base",
            "base",
            "--model",
            "sub/agnt0",
            "-o",
            "out",
        ])
        .output()
        .unwrap();
    assert!(
        err_of(&o).contains("neither a folder nor a Hub id in the cache"),
        "{}",
        err_of(&o)
    );
}

/// Without a terminal, progress comes as lines (every RLMERGE_PROGRESS_SECONDS), counted by the
/// work done — matrices decomposed included — and never past 100 %.
#[test]
fn progress_without_a_terminal_is_a_line_every_few_seconds() {
    let f = fixture(
        3,
        Dtype::BF16,
        &[
            ("model.layers.0.mlp.up_proj.weight", vec![160, 96]),
            ("model.layers.1.mlp.up_proj.weight", vec![160, 96]),
            ("model.layers.2.mlp.up_proj.weight", vec![160, 96]),
        ],
        &[0.1, 0.15, 0.2],
        1,
    );
    let out = f.dir.path().join("out");
    let o = merge_of(&f.base, &f.agents)
        .args(["--method", "tsv", "--device", "cpu", "-o"])
        .arg(&out)
        .env("RLMERGE_PROGRESS_SECONDS", "0.01")
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", err_of(&o));
    let err = err_of(&o);
    let lines: Vec<&str> = err.lines().filter(|l| l.starts_with("merge: ")).collect();
    assert!(!lines.is_empty(), "no progress line: {err}");
    for l in &lines {
        let share: f64 = l["merge: ".len()..]
            .split(' ')
            .next()
            .unwrap()
            .parse()
            .unwrap();
        assert!((0.0..=100.0).contains(&share), "{l}");
        assert!(l.contains("s elapsed"), "{l}");
    }
    assert!(lines.iter().any(|l| l.contains("(tsv ")), "{lines:?}");
    // --quiet: none.
    let o = merge_of(&f.base, &f.agents)
        .args(["--method", "tsv", "--device", "cpu", "--quiet", "-o"])
        .arg(f.dir.path().join("quiet"))
        .env("RLMERGE_PROGRESS_SECONDS", "0.01")
        .output()
        .unwrap();
    assert!(!err_of(&o).contains("merge: "), "{}", err_of(&o));
}

/// `--device auto` keeps the methods bound by reading on the CPU (the GPU stack not loaded) and
/// says why; a software adapter is marked by `devices` and warned about with `--device gpu`.
#[test]
fn auto_keeps_bus_bound_methods_on_the_cpu_and_software_adapters_are_marked() {
    let f = matrices(45);
    let o = merge_of(&f.base, &f.agents)
        .arg("-o")
        .arg(f.dir.path().join("out"))
        .output()
        .unwrap();
    assert!(o.status.success());
    let backend = err_of(&o)
        .lines()
        .find(|l| l.starts_with("backend: "))
        .map(str::to_string)
        .unwrap();
    assert!(
        backend.starts_with("backend: cpu") && backend.contains("bound by reading"),
        "{backend}"
    );
    if !gpu_available("the software-adapter half of this test") {
        return;
    }
    let devices = stdout_of(&rlmerge().arg("devices").output().unwrap());
    let software: Vec<&str> = devices.lines().filter(|l| l.contains(", Cpu, ")).collect();
    for l in &software {
        assert!(l.contains("SOFTWARE"), "{l}");
    }
    if !software.is_empty() && !devices.lines().any(|l| l.contains("Gpu, driver")) {
        let o = merge_of(&f.base, &f.agents)
            .args(["--device", "gpu", "-o"])
            .arg(f.dir.path().join("gpu"))
            .output()
            .unwrap();
        assert!(o.status.success(), "{}", err_of(&o));
        assert!(
            err_of(&o).contains("is a software adapter"),
            "{}",
            err_of(&o)
        );
    }
}

/// Three agents whose paths differ only in a middle component keep distinct labels in the
/// figures; `--name` (and a recipe's `name:`) names them in figures, tables, card and record.
#[test]
fn figures_and_cards_keep_agents_apart_and_take_their_names() {
    let f = matrices(45);
    let root = f.dir.path();
    let mut runs = Vec::new();
    for (t, role) in ["coder", "tool", "memory"].iter().enumerate() {
        let to = root.join(format!("runs/{role}-grpo/checkpoint-1200"));
        std::fs::create_dir_all(to.parent().unwrap()).unwrap();
        std::fs::rename(&f.agents[t], &to).unwrap();
        runs.push(to);
    }
    let analyze = |extra: &[&str], plot: &str| {
        let mut cmd = rlmerge();
        cmd.args(["analyze", "--base"]).arg(&f.base);
        for a in &runs {
            cmd.arg("--model").arg(a);
        }
        let o = cmd
            .args(extra)
            .arg("--plot")
            .arg(root.join(plot))
            .output()
            .unwrap();
        assert!(o.status.success(), "{}", err_of(&o));
        (
            stdout_of(&o),
            std::fs::read_to_string(root.join(plot).join("overlap.svg")).unwrap(),
        )
    };
    let (_, svg) = analyze(&[], "plain");
    for role in ["coder-grpo", "tool-grpo", "memory-grpo"] {
        assert!(
            svg.contains(&format!(">{role}<")),
            "{role} not in the figure"
        );
    }
    assert!(!svg.contains(">checkpoint-1200<"));
    let (table, svg) = analyze(
        &["--name", "coder", "--name", "tools", "--name", "memory"],
        "named",
    );
    assert!(
        svg.contains(">tools<") && table.contains("tools"),
        "{table}"
    );
    // Names are checked once, whatever front end gave them.
    let mut cmd = rlmerge();
    cmd.args(["analyze", "--base"]).arg(&f.base);
    for a in &runs {
        cmd.arg("--model").arg(a);
    }
    let o = cmd.args(["--name", "x", "--name", "x"]).output().unwrap();
    assert_eq!(o.status.code(), Some(2));
    assert!(err_of(&o).contains("given twice"), "{}", err_of(&o));

    let out = root.join("named-merge");
    let o = merge_of(&f.base, &runs)
        .args([
            "--name", "coder", "--name", "tools", "--name", "memory", "-q", "-o",
        ])
        .arg(&out)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", err_of(&o));
    assert!(stdout_of(&o).contains("tools ("), "{}", stdout_of(&o));
    let card = std::fs::read_to_string(out.join("README.md")).unwrap();
    assert!(card.contains("- agent 2 (`tools`)"), "{card}");
    let record: serde_json::Value =
        serde_json::from_slice(&std::fs::read(out.join("rlmerge_record.json")).unwrap()).unwrap();
    assert_eq!(record["agents"][2]["name"], "memory");
    // The card's recipe keeps the names: a recipe's `name:`.
    let recipe = std::fs::read_to_string(out.join("mergekit_config.yml")).unwrap();
    assert!(recipe.contains("name: tools"), "{recipe}");
    let again = root.join("again");
    let o = run_recipe(&out.join("mergekit_config.yml"), &again, &["-q"]);
    assert!(o.status.success(), "{}", err_of(&o));
    let record: serde_json::Value =
        serde_json::from_slice(&std::fs::read(again.join("rlmerge_record.json")).unwrap()).unwrap();
    assert_eq!(record["agents"][1]["name"], "tools");
}

/// Issue #44 item 6: an agent whose config differs from the base's in a key that changes how the
/// weights are used (a long-context agent's rope) is refused until the user says whose config the
/// output takes; the choice is recorded and remade by verify; other differences are named.
#[test]
fn config_differences_that_change_meaning_need_a_choice() {
    let f = matrices(45);
    let config = |rope: f64, eos: u32| {
        serde_json::json!({"model_type": "llama", "architectures": ["LlamaForCausalLM"],
            "hidden_size": 16, "rope_theta": rope, "eos_token_id": eos,
            "_name_or_path": "somewhere/else", "torch_dtype": "bfloat16"})
        .to_string()
    };
    std::fs::write(f.base.join("config.json"), config(10000.0, 2)).unwrap();
    std::fs::write(f.agents[0].join("config.json"), config(10000.0, 7)).unwrap();
    std::fs::write(f.agents[1].join("config.json"), config(1_000_000.0, 2)).unwrap();
    std::fs::write(f.agents[2].join("config.json"), config(10000.0, 2)).unwrap();
    let out = f.dir.path().join("out");
    let o = merge_cmd(&f, &out, &[]).output().unwrap();
    assert_eq!(o.status.code(), Some(2), "{}", err_of(&o));
    let err = err_of(&o);
    assert!(
        err.contains("'rope_theta' is 1000000.0 there and 10000.0 in the base"),
        "{err}"
    );
    assert!(err.contains("--config-from"), "{err}");
    assert!(!out.exists());

    let agent = f.agents[1].display().to_string();
    let o = merge_cmd(&f, &out, &["--config-from", &agent])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", err_of(&o));
    // The harmless difference goes unsaid; eos_token_id is named, with whose config was taken.
    let err = err_of(&o);
    assert!(!err.contains("_name_or_path"), "{err}");
    assert!(
        err.contains("differs from the base's in eos_token_id"),
        "{err}"
    );
    let merged: serde_json::Value =
        serde_json::from_slice(&std::fs::read(out.join("config.json")).unwrap()).unwrap();
    assert_eq!(merged["rope_theta"], 1_000_000.0);
    let record: serde_json::Value =
        serde_json::from_slice(&std::fs::read(out.join("rlmerge_record.json")).unwrap()).unwrap();
    assert_eq!(record["config_from"], "../agent1");
    let recipe = std::fs::read_to_string(out.join("mergekit_config.yml")).unwrap();
    assert!(recipe.contains("config_from:"), "{recipe}");
    let o = rlmerge()
        .args(["verify", "--against"])
        .arg(&out)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}{}", stdout_of(&o), err_of(&o));

    let base_config = f.dir.path().join("base-config");
    let o = merge_cmd(&f, &base_config, &["--config-from", "base"])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", err_of(&o));
    let merged: serde_json::Value =
        serde_json::from_slice(&std::fs::read(base_config.join("config.json")).unwrap()).unwrap();
    assert_eq!(merged["rope_theta"], 10000.0);
    let o = merge_cmd(&f, &f.dir.path().join("x"), &["--config-from", "nobody"])
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(2));
    assert!(
        err_of(&o).contains("neither base nor one of the agents"),
        "{}",
        err_of(&o)
    );
}

/// Agent names and `--config-from` are checked once, whichever front end gave them: a name
/// that is empty or holds a control character, more names than agents, and a `--config-from`
/// that is a file or a FIFO rather than the base or an agent are usage errors (exit 2) that
/// name the mistake, never block, and write nothing.
#[test]
fn hostile_names_and_config_choices_are_refused() {
    let f = matrices(45);
    let out = f.dir.path().join("out");
    let refused = |args: &[&str], want: &str| {
        let o = merge_cmd(&f, &out, args).output().unwrap();
        assert_eq!(o.status.code(), Some(2), "{args:?}: {}", err_of(&o));
        assert!(err_of(&o).contains(want), "{args:?}: {}", err_of(&o));
        assert!(!out.exists(), "{args:?} wrote {}", out.display());
    };
    refused(&["--name", "cod\u{1b}[31mer"], "control character");
    refused(&["--name", " "], "is empty");
    refused(
        &["--name", "a", "--name", "b", "--name", "c", "--name", "d"],
        "4 agent names for 3 agents",
    );
    // A recipe's `name:` passes the same check.
    let recipe = one_agent_recipe(&f, "named.yml", "ram", "    name: \"tab\\there\"\n");
    let o = run_recipe(&recipe, &out, &[]);
    assert_eq!(o.status.code(), Some(2), "{}", err_of(&o));
    assert!(err_of(&o).contains("control character"), "{}", err_of(&o));
    // A config.json file, and a FIFO nobody writes to: neither is read.
    let file = f.base.join("config.json");
    std::fs::write(&file, "{}").unwrap();
    refused(
        &["--config-from", &file.display().to_string()],
        "neither base nor one of the agents",
    );
    #[cfg(unix)]
    {
        let fifo = f.dir.path().join("fifo");
        let made = std::process::Command::new("mkfifo").arg(&fifo).status();
        if made.is_ok_and(|s| s.success()) {
            refused(
                &["--config-from", &fifo.display().to_string()],
                "neither base nor one of the agents",
            );
        }
    }
}
