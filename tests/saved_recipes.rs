//! The recipe a merge saves (`mergekit_config.yml`) is the merge (issue #50 item 3): `rlmerge run`
//! of it — from the output folder's parent, or from any other folder — writes the same model
//! files byte for byte, for every method family, with the output dtype, the shard size and the
//! seed it ran with, from the command line or from a recipe whose paths are relative to its own
//! folder; the card promises mergekit only what mergekit does.

mod common;
use common::*;
use safetensors::tensor::Dtype;
use std::path::{Path, PathBuf};

/// Matrices, vectors and an odd shape, with sparse agents: every method family has work.
fn models() -> Fixture {
    fixture(
        50,
        Dtype::BF16,
        &[
            ("model.embed_tokens.weight", vec![29, 16]),
            ("model.layers.0.self_attn.q_proj.weight", vec![24, 16]),
            ("model.layers.0.mlp.up_proj.weight", vec![32, 16]),
            ("model.layers.0.input_layernorm.weight", vec![16]),
            ("model.norm.weight", vec![16]),
        ],
        &[0.1, 0.15, 0.2],
        1,
    )
}

/// Every file of a merged folder that is the model: weights, index, config, tokenizer.
fn model_files(dir: &Path) -> Vec<(String, Vec<u8>)> {
    let mut files: Vec<(String, Vec<u8>)> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| {
            let name = p.file_name().unwrap().to_string_lossy();
            ![
                "README.md",
                "rlmerge_record.json",
                "mergekit_config.yml",
                "overlap.svg",
            ]
            .contains(&name.as_ref())
        })
        .map(|p| {
            let name = p.file_name().unwrap().to_string_lossy().into_owned();
            (name, std::fs::read(&p).unwrap())
        })
        .collect();
    files.sort();
    files
}

/// Runs `rlmerge ARGS` in `dir`, which must succeed.
fn run_in(dir: &Path, args: &[&str]) {
    let o = rlmerge().current_dir(dir).args(args).output().unwrap();
    assert!(o.status.success(), "{args:?}: {}", err_of(&o));
}

/// The saved recipe of `out` run from its parent folder and from an unrelated one: both write
/// `out`'s model files.
fn remade_from_anywhere(out: &Path, what: &str) {
    let want = model_files(out);
    let parent = out.parent().unwrap();
    let name = out.file_name().unwrap().to_string_lossy().into_owned();
    let recipe = format!("{name}/mergekit_config.yml");
    run_in(
        parent,
        &["run", &recipe, "-q", "-o", &format!("{name}-again")],
    );
    assert!(
        model_files(&parent.join(format!("{name}-again"))) == want,
        "{what}: run from the output's parent"
    );
    let elsewhere = tempfile::tempdir().unwrap();
    let recipe = out.join("mergekit_config.yml");
    run_in(
        elsewhere.path(),
        &["run", &recipe.to_string_lossy(), "-q", "-o", "again"],
    );
    assert!(
        model_files(&elsewhere.path().join("again")) == want,
        "{what}: run from elsewhere"
    );
}

/// The methods of every family, with their flags; each merged from the command line (relative
/// folders, run in the fixture's folder) with a seed, an output dtype or a shard size of its
/// own, then remade from the recipe it saved.
#[test]
fn every_methods_saved_recipe_remakes_it_from_anywhere() {
    let f = models();
    let root = f.dir.path();
    std::fs::create_dir(root.join("out")).unwrap();
    let families: Vec<(&str, Vec<&str>)> = vec![
        ("ram+", vec!["--scope", "layer", "--epsilon", "2e-5"]),
        ("ram", vec!["--shared", "consensus"]),
        ("ramplus_tl", vec![]),
        ("task_arithmetic", vec!["--param", "weight=0.6"]),
        (
            "ties",
            vec!["--param", "weight=1", "--param", "density=0.4"],
        ),
        (
            "dare_ties",
            vec!["--param", "weight=1", "--param", "density=0.5"],
        ),
        (
            "della",
            vec!["--param", "weight=1", "--param", "density=0.5"],
        ),
        (
            "breadcrumbs",
            vec!["--param", "weight=1", "--param", "density=0.7"],
        ),
        ("linear", vec!["--param", "weight=0.5"]),
        ("karcher", vec![]),
        ("multislerp", vec!["--param", "weight=0.4"]),
        ("model_stock", vec![]),
        ("sce", vec![]),
        ("iso_c", vec![]),
        ("tsv", vec![]),
        ("resmerge", vec!["--param", "rank_topk=2"]),
        ("ties", vec!["--param", "weight=1", "--svc", "0.1"]),
    ];
    let outputs = [
        vec!["--seed", "5"],
        vec!["--out-dtype", "f32"],
        vec!["--shard-size", "1KB", "--seed", "9"],
    ];
    for (i, (method, flags)) in families.iter().enumerate() {
        let out = format!("out/{i}-{method}");
        let mut args = vec!["merge", "--base", "base", "-q", "-o", &out];
        for agent in ["agent0", "agent1", "agent2"] {
            args.extend(["--model", agent]);
        }
        args.extend(["--method", method]);
        args.extend(flags.iter().copied());
        args.extend(outputs[i % outputs.len()].iter().copied());
        run_in(root, &args);
        remade_from_anywhere(&root.join(&out), &format!("{method} {flags:?}"));
    }
    // The seed, dtype and shard size are in the recipe, not only in a comment.
    let dare = std::fs::read_to_string(root.join("out/5-dare_ties/mergekit_config.yml")).unwrap();
    assert!(dare.contains("\nseed: 9\n"), "{dare}");
    let ram = std::fs::read_to_string(root.join("out/1-ram/mergekit_config.yml")).unwrap();
    assert!(ram.contains("\nout_dtype: float32\n"), "{ram}");
    assert!(
        !ram.contains("seed:"),
        "only seeded methods save a seed: {ram}"
    );
    let shards: Vec<PathBuf> = std::fs::read_dir(root.join("out/2-ramplus_tl"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "safetensors"))
        .collect();
    assert!(shards.len() > 1, "1KB shards: {shards:?}");
}

/// The card says what mergekit makes of the recipe: nothing for rlmerge's methods and SVC; for
/// karcher from the command line (whose base gives only the layout) the recipe names the base
/// `layout_model`, not a `base_model` mergekit would average as one more point.
#[test]
fn the_card_promises_mergekit_only_what_it_does() {
    let f = models();
    let root = f.dir.path();
    let card = |out: &str| std::fs::read_to_string(root.join(out).join("README.md")).unwrap();
    let merge = |out: &str, flags: &[&str]| {
        let mut args = vec![
            "merge", "--base", "base", "--model", "agent0", "--model", "agent1",
        ];
        args.extend(["-q", "-o", out]);
        args.extend(flags);
        run_in(root, &args);
    };
    merge("plus", &["--method", "ram+"]);
    assert!(
        card("plus").contains("mergekit cannot run it: `ram+` is rlmerge's method"),
        "{}",
        card("plus")
    );
    merge(
        "svc",
        &["--method", "ties", "--param", "weight=1", "--svc", "0.1"],
    );
    assert!(card("svc").contains("mergekit cannot run it: SVC is rlmerge's"));
    merge("karcher", &["--method", "karcher"]);
    let recipe = std::fs::read_to_string(root.join("karcher/mergekit_config.yml")).unwrap();
    assert!(
        recipe.contains("layout_model: ../base") && !recipe.contains("base_model"),
        "{recipe}"
    );
    assert!(
        card("karcher").contains("ignoring rlmerge's own keys (`layout_model`)"),
        "{}",
        card("karcher")
    );
    // A recipe's karcher with base_model averages the base too (mergekit's rule): not the same
    // merge as the command line's.
    std::fs::write(
        root.join("k.yml"),
        "merge_method: karcher\nbase_model: base\nmodels:\n  - model: agent0\n  - model: agent1\n",
    )
    .unwrap();
    run_in(root, &["run", "k.yml", "-q", "-o", "karcher-recipe"]);
    assert_ne!(
        read_folder(&root.join("karcher")),
        read_folder(&root.join("karcher-recipe"))
    );
    merge("dare", &["--method", "dare_ties", "--param", "weight=1"]);
    assert!(
        card("dare").contains("with random masks of its own"),
        "{}",
        card("dare")
    );
}

/// A recipe whose model paths are relative to its own folder, run from another folder, with the
/// command line's seed, dtype and shard size: the saved recipe holds them and names the models
/// relative to the output, so it makes the same merge again from anywhere. A path that names a
/// folder both from the working directory and beside the recipe is refused, not guessed.
#[test]
fn recipes_relative_to_their_folder_and_command_line_settings_are_saved() {
    let f = models();
    let root = f.dir.path();
    std::fs::create_dir_all(root.join("recipes")).unwrap();
    std::fs::create_dir_all(root.join("work")).unwrap();
    std::fs::write(
        root.join("recipes/dare.yml"),
        "merge_method: dare_linear\nbase_model: ../base\nparameters:\n  weight: 0.5\n  \
         density: 0.5\nmodels:\n  - model: ../agent0\n  - model: ../agent1\n",
    )
    .unwrap();
    let work = root.join("work");
    run_in(
        &work,
        &[
            "run",
            "../recipes/dare.yml",
            "--seed",
            "11",
            "--out-dtype",
            "f16",
            "--shard-size",
            "2KB",
            "-q",
            "-o",
            "m",
        ],
    );
    let saved = std::fs::read_to_string(work.join("m/mergekit_config.yml")).unwrap();
    for want in [
        "base_model: ../../base",
        "- model: ../../agent0",
        "seed: 11",
        "out_dtype: float16",
        "shard_size: 2000",
    ] {
        assert!(saved.contains(want), "{want}: {saved}");
    }
    remade_from_anywhere(&work.join("m"), "dare_linear from a recipe");
    // The recipe's own seed is used when the command line gives none; a given one wins.
    // The saved recipe's paths are relative to m; beside recipes/ they are one level up less.
    let seeded = saved
        .replace("../../", "../")
        .replace("seed: 11", "seed: 12");
    std::fs::write(root.join("recipes/seeded.yml"), seeded).unwrap();
    run_in(&work, &["run", "../recipes/seeded.yml", "-q", "-o", "s12"]);
    run_in(
        &work,
        &[
            "run",
            "../recipes/seeded.yml",
            "--seed",
            "11",
            "-q",
            "-o",
            "s11",
        ],
    );
    assert_eq!(model_files(&work.join("s11")), model_files(&work.join("m")));
    assert_ne!(model_files(&work.join("s12")), model_files(&work.join("m")));

    // Ambiguous: `../agent0` from work/ and from recipes/ are two folders.
    std::fs::create_dir_all(root.join("work/sub")).unwrap();
    copy_folder(&root.join("agent1"), &root.join("work/agent0"));
    let o = rlmerge()
        .current_dir(root.join("work/sub"))
        .args(["run", "../../recipes/dare.yml", "-q", "-o", "x"])
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(2), "{}", err_of(&o));
    assert!(err_of(&o).contains("names two folders"), "{}", err_of(&o));
    assert!(!root.join("work/sub/x").exists());
}

fn copy_folder(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let p = e.unwrap().path();
        std::fs::copy(&p, to.join(p.file_name().unwrap())).unwrap();
    }
}

/// A record names inputs relative to the output even when `-o` is a bare name (its parent is
/// the working directory).
#[test]
fn a_bare_output_name_records_relative_paths() {
    let f = models();
    let root = f.dir.path();
    run_in(
        root,
        &[
            "merge", "--base", "base", "--model", "agent0", "-q", "-o", "bare",
        ],
    );
    let record = std::fs::read_to_string(root.join("bare/rlmerge_record.json")).unwrap();
    let abs = std::fs::canonicalize(root).unwrap();
    assert!(!record.contains(&*abs.to_string_lossy()), "{record}");
    let recipe = std::fs::read_to_string(root.join("bare/mergekit_config.yml")).unwrap();
    assert!(recipe.contains("base_model: ../base"), "{recipe}");
}
