//! A mergekit user's command lines (issue #53 item 2): `rlmerge run RECIPE OUT` as
//! `mergekit-yaml RECIPE OUT` takes them, and mergekit-yaml's options done the same way or
//! answered with rlmerge's equivalent — never clap's "unexpected argument".

mod common;
use common::*;
use std::path::Path;

fn run_in(dir: &Path, args: &[&str]) -> std::process::Output {
    rlmerge()
        .current_dir(dir)
        .arg("run")
        .args(args)
        .output()
        .unwrap()
}

/// `rlmerge merge -q --base base --model A …` of the demo's folders in `dir`, then `args`.
fn merge_in(dir: &Path, agents: &[&str], args: &[&str]) -> std::process::Output {
    let mut cmd = rlmerge();
    cmd.current_dir(dir).args(["merge", "-q", "--base", "base"]);
    for a in agents {
        cmd.args(["--model", a]);
    }
    cmd.args(args).output().unwrap()
}

fn shards(dir: &Path) -> Vec<(String, Vec<u8>)> {
    files_of(dir, |p| p.extension().is_some_and(|e| e == "safetensors"))
}

#[test]
fn the_output_folder_may_follow_the_recipe_as_mergekit_yaml_takes_it() {
    let d = demo_in_d();
    let dir = d.path().join("d");
    let o = run_in(&dir, &["recipe.yml", "positional", "-q"]);
    assert!(o.status.success(), "{}", err_of(&o));
    let o = run_in(&dir, &["recipe.yml", "-o", "flag", "-q"]);
    assert!(o.status.success(), "{}", err_of(&o));
    assert_eq!(shards(&dir.join("positional")), shards(&dir.join("flag")));
    let twice = run_in(&dir, &["recipe.yml", "a", "-o", "b"]);
    assert_eq!(twice.status.code(), Some(2));
    assert!(err_of(&twice).contains("given twice"), "{}", err_of(&twice));
    let none = run_in(&dir, &["recipe.yml"]);
    assert_eq!(none.status.code(), Some(2));
    assert!(err_of(&none).contains("-o OUT_DIR"), "{}", err_of(&none));
    assert!(!dir.join("a").exists() && !dir.join("b").exists());
}

#[test]
fn mergekit_yaml_options_are_done_or_answered() {
    let d = demo_in_d();
    let dir = d.path().join("d");
    let o = run_in(
        &dir,
        &[
            "recipe.yml",
            "answered",
            "-q",
            "--cuda",
            "--allow-crimes",
            "--copy-tokenizer",
            "--lazy-unpickle",
            "--low-cpu-memory",
            "--trust-remote-code",
            "--no-write-model-card",
            "--transformers-cache",
            "/tmp",
            "-v",
        ],
    );
    assert!(o.status.success(), "{}", err_of(&o));
    let err = err_of(&o);
    for said in [
        "--cuda: rlmerge chooses the device",
        "--allow-crimes:",
        "--copy-tokenizer:",
        "--lazy-unpickle:",
        "--low-cpu-memory:",
        "--trust-remote-code: rlmerge runs no model code",
        "--no-write-model-card:",
        "--transformers-cache: rlmerge takes Hub models from the Hugging Face cache; set HF_HUB_CACHE",
        "-v:",
    ] {
        assert!(err.contains(&format!("note: {said}")), "{said}: {err}");
    }
    // --random-seed is --seed; --out-shard-size counts parameters (bf16: 2 bytes each).
    let dare = std::fs::read_to_string(dir.join("recipe.yml"))
        .unwrap()
        .replace("merge_method: ties", "merge_method: dare_ties");
    std::fs::write(dir.join("dare.yml"), dare).unwrap();
    let a = run_in(
        &dir,
        &[
            "dare.yml",
            "seeded",
            "-q",
            "--random-seed",
            "9",
            "--out-shard-size",
            "100K",
        ],
    );
    assert!(a.status.success(), "{}", err_of(&a));
    let b = run_in(
        &dir,
        &[
            "dare.yml",
            "-o",
            "flags",
            "-q",
            "--seed",
            "9",
            "--shard-size",
            "200KB",
        ],
    );
    assert!(b.status.success(), "{}", err_of(&b));
    assert_eq!(shards(&dir.join("seeded")), shards(&dir.join("flags")));
    assert!(shards(&dir.join("seeded")).len() > 1);
    let clash = run_in(
        &dir,
        &["dare.yml", "x", "--seed", "1", "--random-seed", "2"],
    );
    assert_eq!(clash.status.code(), Some(2), "{}", err_of(&clash));
    assert!(err_of(&clash).contains("disagree"), "{}", err_of(&clash));
}

/// `--param KEY=V1,V2` sets one value per model, in --model order (issue #53 item 6): the same
/// merge as a recipe's per-model `parameters:`, which the saved recipe writes.
#[test]
fn a_comma_list_sets_a_parameter_per_model() {
    let d = demo_in_d();
    let dir = d.path().join("d");
    let recipe = "merge_method: ties\nbase_model: base\nparameters:\n  density: 0.5\nmodels:\n\
                  - model: coding-agent\n  parameters:\n    weight: 0.7\n\
                  - model: tool-agent\n  parameters:\n    weight: 0.3\n";
    std::fs::write(dir.join("per-model.yml"), recipe).unwrap();
    let o = run_in(&dir, &["per-model.yml", "from-recipe", "-q"]);
    assert!(o.status.success(), "{}", err_of(&o));
    let merge = |out: &str, weight: &str| {
        merge_in(
            &dir,
            &["coding-agent", "tool-agent"],
            &[
                "--method",
                "ties",
                "--param",
                "density=0.5",
                "--param",
                weight,
                "-o",
                out,
            ],
        )
    };
    let o = merge("from-flags", "weight=0.7,0.3");
    assert!(o.status.success(), "{}", err_of(&o));
    assert_eq!(
        shards(&dir.join("from-flags")),
        shards(&dir.join("from-recipe"))
    );
    let saved = std::fs::read_to_string(dir.join("from-flags/mergekit_config.yml")).unwrap();
    assert!(saved.contains("  parameters:\n    weight: 0.7"), "{saved}");
    // The card says each agent's own value, in words (issue #53 item 7), tagged as the Hub tags
    // mergekit's merges.
    let card = std::fs::read_to_string(dir.join("from-flags/README.md")).unwrap();
    for said in [
        "- mergekit\n",
        "merges 2 models",
        "— `weight` = `0.7`",
        "— `weight` = `0.3`",
    ] {
        assert!(card.contains(said), "{said}: {card}");
    }
    assert!(
        !card.contains("model(s)") && !card.contains("the method's parameters"),
        "{card}"
    );
    let o = merge("wrong", "weight=0.7,0.3,0.1");
    assert_eq!(o.status.code(), Some(2));
    assert!(
        err_of(&o).contains("3 values for 2 model(s)"),
        "{}",
        err_of(&o)
    );
    assert!(!dir.join("wrong").exists());
}

/// A RAM merge of one agent writes that agent back: said on stderr and in the card (issue #53
/// item 7), not passed over in silence.
#[test]
fn a_one_agent_ram_merge_is_said() {
    let d = demo_in_d();
    let dir = d.path().join("d");
    let o = merge_in(&dir, &["coding-agent"], &["-o", "one"]);
    assert!(o.status.success(), "{}", err_of(&o));
    assert!(
        err_of(&o).contains("warning: one agent: ram+ merges nothing"),
        "{}",
        err_of(&o)
    );
    let card = std::fs::read_to_string(dir.join("one/README.md")).unwrap();
    assert!(
        card.contains("merges 1 reinforcement-learning-trained agent into"),
        "{card}"
    );
    assert!(
        card.contains("one agent\\: ram\\+ merges nothing"),
        "{card}"
    );
}

/// A card of a merge that set no parameter gives the defaults' values, not "the method's
/// defaults" alone (issue #53 item 7).
#[test]
fn a_card_names_the_default_values_it_merged_with() {
    let d = demo_in_d();
    let dir = d.path().join("d");
    let o = merge_in(
        &dir,
        &["coding-agent", "tool-agent"],
        &["--method", "iso_c", "--device", "cpu", "-o", "iso"],
    );
    assert!(o.status.success(), "{}", err_of(&o));
    let card = std::fs::read_to_string(dir.join("iso/README.md")).unwrap();
    assert!(
        card.contains("Parameters: the method's defaults, `scaling_factor` = `1.0`."),
        "{card}"
    );
}

/// An absurd `--out-shard-size` (mergekit's, in parameters) is refused by name before anything is
/// written.
#[test]
fn an_absurd_out_shard_size_is_refused() {
    let d = demo_in_d();
    let dir = d.path().join("d");
    for bad in ["0", "-5", "abc", "0.5", "inf"] {
        let o = run_in(&dir, &["recipe.yml", "out", "--out-shard-size", bad]);
        assert_eq!(o.status.code(), Some(2), "{bad}: {}", err_of(&o));
        assert!(
            err_of(&o).contains("--out-shard-size"),
            "{bad}: {}",
            err_of(&o)
        );
        assert!(!dir.join("out").exists());
    }
}

/// RAM+'s boost that bf16 rounds away is said — on stderr, in the card, per agent in the record —
/// and its count is the truth: the boosted elements it calls moved are exactly the elements where
/// the ram+ and ram outputs differ (issue #53 item 4). In f32 every boost stays, and nothing is said.
#[test]
fn a_boost_that_bf16_rounds_away_is_said() {
    let d = demo_in_d();
    let dir = d.path().join("d");
    let agents = ["coding-agent", "tool-agent", "memory-agent"];
    let plus = merge_in(&dir, &agents, &["-o", "plus"]);
    assert!(plus.status.success(), "{}", err_of(&plus));
    let o = merge_in(&dir, &agents, &["--method", "ram", "-o", "plain"]);
    assert!(o.status.success(), "{}", err_of(&o));
    assert_eq!(err_of(&plus).matches("ram+ boost rounded away").count(), 3);
    let card = std::fs::read_to_string(dir.join("plus/README.md")).unwrap();
    assert!(card.contains("rounded away"), "{card}");
    let record: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(dir.join("plus/rlmerge_record.json")).unwrap(),
    )
    .unwrap();
    // Global scope boosts every unique element: moved = unique × (1 − the share unmoved).
    let moved: f64 = record["agents"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| {
            let unique = a["counts"]["unique"].as_f64().unwrap();
            let share = a["boost_rounded_away"].as_f64().unwrap();
            assert!(share > 0.0 && share < 1.0, "{a}");
            (unique * (1.0 - share)).round()
        })
        .sum();
    let (p, r) = (
        read_folder(&dir.join("plus")),
        read_folder(&dir.join("plain")),
    );
    let differ: usize = p
        .iter()
        .map(|(name, (_, _, bytes))| {
            let other = &r[name].2;
            bytes
                .chunks(2)
                .zip(other.chunks(2))
                .filter(|(a, b)| a != b)
                .count()
        })
        .sum();
    assert!(differ > 0);
    assert_eq!(moved as usize, differ);
    let wide = merge_in(&dir, &agents, &["--out-dtype", "float32", "-o", "wide"]);
    assert!(wide.status.success(), "{}", err_of(&wide));
    assert!(!err_of(&wide).contains("rounded away"), "{}", err_of(&wide));
    let record = std::fs::read_to_string(dir.join("wide/rlmerge_record.json")).unwrap();
    assert!(!record.contains("boost_rounded_away"), "{record}");
}

/// A recipe's `chat_template` — a name mergekit knows, a Jinja template, or `auto` — goes into the
/// output's tokenizer_config.json, and the record's checksums cover it (issue #53 item 2).
#[test]
fn a_chat_template_goes_into_tokenizer_config() {
    let d = demo_in_d();
    let dir = d.path().join("d");
    let recipe = std::fs::read_to_string(dir.join("recipe.yml")).unwrap();
    let template_of = |out: &str| -> serde_json::Value {
        let text = std::fs::read_to_string(dir.join(out).join("tokenizer_config.json")).unwrap();
        serde_json::from_str::<serde_json::Value>(&text).unwrap()["chat_template"].clone()
    };
    let own = "{% for m in messages %}{{ m['content'] }}{% endfor %}";
    for (value, out) in [("chatml", "named"), (own, "jinja"), ("auto", "auto")] {
        let with = format!("{recipe}chat_template: \"{value}\"\n");
        std::fs::write(dir.join(format!("{out}.yml")), with).unwrap();
        let o = run_in(&dir, &[&format!("{out}.yml"), out, "-q"]);
        assert!(o.status.success(), "{value}: {}", err_of(&o));
        let v = rlmerge()
            .current_dir(&dir)
            .args(["verify", out])
            .output()
            .unwrap();
        assert!(v.status.success(), "{value}: {}", err_of(&v));
        match out {
            "named" => assert!(template_of(out).as_str().unwrap().contains("<|im_start|>")),
            "jinja" => assert_eq!(template_of(out), own),
            // The demo's models carry no template: auto writes none, and says so.
            _ => {
                assert!(template_of(out).is_null());
                assert!(
                    err_of(&o).contains("auto found no chat template"),
                    "{}",
                    err_of(&o)
                );
            }
        }
    }
    // The output of `named` carries chatml: auto over it and the base takes it.
    let auto = "merge_method: linear\nparameters: {weight: 0.5}\nmodels: [{model: named}, {model: base}]\nchat_template: auto\n";
    std::fs::write(dir.join("auto2.yml"), auto).unwrap();
    let o = run_in(&dir, &["auto2.yml", "auto2", "-q"]);
    assert!(o.status.success(), "{}", err_of(&o));
    assert_eq!(template_of("auto2"), template_of("named"));
    std::fs::write(
        dir.join("bad.yml"),
        format!("{recipe}chat_template: vicuna\n"),
    )
    .unwrap();
    let o = run_in(&dir, &["bad.yml", "bad"]);
    assert_eq!(o.status.code(), Some(2), "{}", err_of(&o));
    assert!(
        err_of(&o).contains("chatml") && err_of(&o).contains("line 12"),
        "{}",
        err_of(&o)
    );
    assert!(!dir.join("bad").exists());
}
