//! Recipe files through the service: `rlmerge run` of a merge recipe, one document or a
//! multi-stage one (mergekit-multi's), and `rlmerge moe` of a MoE config, alone or as the final
//! stage after merges — the earlier stages made the same way for both.

use super::{merge, moe, Compute, Device, Said};
use crate::checkpoint::output_folder::Scratch;
use crate::checkpoint::OutputFolder;
use crate::engine::MergeSummary;
use crate::error::usage;
use crate::job::stages::Stages;
use crate::job::{CommandLine, DoneStage, Job};
use anyhow::{Context, Result};
use std::path::{Path, PathBuf};

/// Where a multi-stage recipe's earlier stages go: `None`, a scratch folder beside the output,
/// removed when the run ends; or a folder that keeps them, each stage in `DIR/NAME`
/// (`--intermediate-dir`, mergekit-multi's).
pub type StageFolder<'a> = Option<&'a Path>;

/// Runs the recipe file `recipe` into `out` — a one-document recipe as one merge, a multi-stage
/// one ([`Stages`]) stage by stage — with `given` set on top of every stage's recipe; `seed`
/// overrides the recipes' seeds. What the stages say is said, each under its name. Returns the
/// final merge's job and summary.
pub fn run_recipe(
    recipe: &Path,
    (seed, given): (Option<u64>, &CommandLine),
    compute: &Compute,
    (out, force, kept): (&Path, bool, StageFolder),
    say: &mut dyn FnMut(Said),
) -> Result<(Job, MergeSummary)> {
    let Some(stages) = Stages::read(recipe)? else {
        if kept.is_some() {
            return Err(usage(
                "--intermediate-dir is for a multi-stage recipe (several YAML documents); this \
                 one has one",
            ));
        }
        let mut job = Job::from_recipe(recipe, seed)?;
        job.set_command_line(given)?;
        let summary = merge(&job, compute, (out, force), say)?;
        return Ok((job, summary));
    };
    if stages.final_is_moe() {
        return Err(usage(format!(
            "the final stage of {} is a mergekit-moe config: `rlmerge moe {} OUT` makes the \
             merges before it and builds the MoE",
            recipe.display(),
            recipe.display()
        )));
    }
    compute.check()?;
    let (_scratch, made, done) =
        earlier_stages(&stages, (seed, given), compute, (out, force, kept), say)?;
    let last = stages.len() - 1;
    let mut job = stages.job(last, &made, seed)?;
    job.set_command_line(given)?;
    job.stages = done;
    say(Said::Note(format!(
        "stage {}/{}: {} into {}",
        last + 1,
        stages.len(),
        stages
            .name(last)
            .map_or("the final merge".into(), |n| format!("'{n}'")),
        out.display()
    )));
    let summary = merge(&job, compute, (out, force), say)?;
    Ok((job, summary))
}

/// The merges of a multi-stage recipe's stages before the final one, into the kept folder
/// `kept`, else a scratch folder beside `out` (returned: removed when it drops): each one's
/// name and folder, and what was done.
#[allow(clippy::type_complexity)]
fn earlier_stages(
    stages: &Stages,
    (seed, given): (Option<u64>, &CommandLine),
    compute: &Compute,
    (out, force, kept): (&Path, bool, StageFolder),
    say: &mut dyn FnMut(Said),
) -> Result<(Option<Scratch>, Vec<(String, PathBuf)>, Vec<DoneStage>)> {
    let resolved = OutputFolder::check(out, force)?;
    let last = stages.len() - 1;
    // Where the stages go: the kept folder, else a scratch folder beside the output (removed
    // when `scratch` drops).
    let (scratch, dir) = match kept {
        Some(k) => (None, k.to_path_buf()),
        None => {
            let name = resolved.file_name().unwrap_or_default().to_string_lossy();
            let parent = resolved.parent().unwrap_or(Path::new("."));
            let s = Scratch::create(parent, &format!(".{name}.rlmerge-stages"))?;
            let dir = s.path().to_path_buf();
            (Some(s), dir)
        }
    };
    let mut made: Vec<(String, PathBuf)> = Vec::new();
    let mut done = Vec::new();
    for i in 0..last {
        let name = stages
            .name(i)
            .expect("every stage but the final one is named");
        if scratch.is_some() && !stages.needed(i) {
            say(Said::Warning(format!(
                "stage '{name}' is skipped: the final stage does not take it, and only \
                 --intermediate-dir keeps a stage's output"
            )));
            continue;
        }
        let mut job = stages.job(i, &made, seed)?;
        job.set_command_line(given)?;
        let folder = dir.join(name);
        say(Said::Note(format!(
            "stage {}/{}: '{name}' into {}",
            i + 1,
            stages.len(),
            folder.display()
        )));
        let summary = merge(&job, compute, (&folder, force), say)
            .with_context(|| format!("stage '{name}' of {}", stages.path().display()))?;
        // A signal that came while the stage was put in place stops the run now.
        crate::checkpoint::output_folder::intermediate_commit_done()?;
        done.push(DoneStage {
            name: name.to_string(),
            settings: job.saved_settings(),
            recipe: job.recipe,
            folder: folder.clone(),
            scratch: scratch.is_some(),
            record: summary.record,
        });
        made.push((name.to_string(), folder));
    }
    Ok((scratch, made, done))
}

/// Builds a mixture of experts from the config file `path` (`rlmerge moe`, Python's `moe` of a
/// file): one document, or a multi-stage recipe whose final stage is the MoE config and whose
/// earlier stages are merges it takes by their names (into `kept/NAME`, else scratch beside
/// `out`); `seed` and `out_dtype` (the command line's) over the file's.
pub fn moe_recipe(
    path: &Path,
    (seed, allow_all_same, out_dtype): (Option<u64>, bool, Option<crate::checkpoint::DType>),
    (out, force, kept): (&Path, bool, StageFolder),
    (options, threads): (crate::moe::Options, usize),
    say: &mut dyn FnMut(Said),
) -> Result<(crate::moe::MoeConfig, crate::moe::Built)> {
    let Some(stages) = Stages::read(path)? else {
        if kept.is_some() {
            return Err(usage(
                "--intermediate-dir is for a multi-stage recipe (several YAML documents); this \
                 one has one",
            ));
        }
        let mut config = crate::moe::config::read(path, seed, allow_all_same)?;
        config.dtype = out_dtype.or(config.dtype);
        let built = moe(&config, (out, force), (options, threads), &[], say)?;
        return Ok((config, built));
    };
    if !stages.final_is_moe() {
        return Err(usage(format!(
            "the final stage of {} is a merge: `rlmerge run {} OUT` runs it (rlmerge moe builds \
             a recipe whose final stage is a mergekit-moe config)",
            path.display(),
            path.display()
        )));
    }
    let compute = Compute {
        threads,
        show_progress: options.show_progress,
        ..Compute::on(Device::Auto)
    };
    let given = CommandLine {
        allow_nonfinite: options.allow_nonfinite,
        ..CommandLine::default()
    };
    compute.check()?;
    let (_scratch, made, done) =
        earlier_stages(&stages, (seed, &given), &compute, (out, force, kept), say)?;
    let mut config = stages.moe_config(&made, (seed, allow_all_same))?;
    config.dtype = out_dtype.or(config.dtype);
    say(Said::Note(format!(
        "stage {}/{}: the MoE into {}",
        stages.len(),
        stages.len(),
        out.display()
    )));
    let built = moe(&config, (out, force), (options, threads), &done, say)?;
    Ok((config, built))
}
