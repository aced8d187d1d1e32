//! The mergekit YAML recipe: read, checked key by key, and turned into a [`Job`].
//! Unknown keys and the parts rlmerge does not support yet are errors that name the key and line.

mod documents;
mod folders;
mod settings;
mod tokenizer;

use super::saved_recipe::Recipe;
use super::Job;
use crate::error::{usage, Arg};
use crate::method::build::{self, MethodRequest};
use crate::method::settings::{Scalar, Setting, Settings};
use crate::method::tensor_params::SliceSettings;
use crate::method::Kind;
use crate::slices::{self, Slice, Slices, Source};
use anyhow::{bail, Context, Result};
pub(super) use documents::{documents, is_moe_config};
pub(crate) use folders::local_folder;
use folders::{layer_count, Folders};
use serde::Deserialize;
use settings::{out_dtype, shard_size, svc_of};
use std::path::{Path, PathBuf};
use tokenizer::tokenizer_settings;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawConfig {
    merge_method: String,
    /// mergekit-multi's stage name, by which later stages of the file take this one as a model
    /// (`super::stages`); a one-document recipe may carry it too.
    #[serde(default)]
    #[allow(dead_code)]
    name: Option<String>,
    /// rlmerge's own key: whose config.json the output takes (`base`, or a model as listed).
    #[serde(default)]
    config_from: Option<String>,
    #[serde(default)]
    models: Option<Vec<ModelEntry>>,
    #[serde(default)]
    slices: Option<Vec<SliceEntry>>,
    #[serde(default)]
    modules: Option<serde_yaml::Value>,
    #[serde(default)]
    base_model: Option<String>,
    #[serde(default)]
    parameters: Option<Settings>,
    #[serde(default)]
    dtype: Option<String>,
    #[serde(default)]
    out_dtype: Option<String>,
    #[serde(default)]
    tokenizer_source: Option<serde_yaml::Value>,
    #[serde(default)]
    tokenizer: Option<serde_yaml::Value>,
    #[serde(default)]
    chat_template: Option<String>,
    /// SVC, the spectral calibration modifier: `svc: true`, `svc: ALPHA` or `svc: {alpha: ALPHA}`.
    #[serde(default)]
    svc: Option<serde_yaml::Value>,
    /// rlmerge's own key: the model whose tensor names, shapes, config and tokenizer the output
    /// takes, not merged — for a method whose `base_model` would be (karcher: a point).
    #[serde(default)]
    layout_model: Option<String>,
    /// rlmerge's own key: the seed of random masks (`--seed`).
    #[serde(default)]
    seed: Option<u64>,
    /// rlmerge's own key: the largest output shard (`--shard-size`: bytes, or `5GB`, `2GiB`).
    #[serde(default)]
    shard_size: Option<serde_yaml::Value>,
    /// rlmerge's own key: NaN and ±Inf inputs merged by IEEE rules (`--allow-nonfinite`).
    #[serde(default)]
    allow_nonfinite: Option<bool>,
    /// rlmerge's own key: tensors some models lack merged from those that have them
    /// (`--allow-missing-tensors`).
    #[serde(default)]
    allow_missing_tensors: Option<bool>,
    /// rlmerge's own key: agents' F32 weights read as stored (`--raw-f32-agents`).
    #[serde(default)]
    raw_f32_agents: Option<bool>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct ModelEntry {
    model: String,
    #[serde(default)]
    parameters: Option<Settings>,
    /// rlmerge's own key: the name tables, figures and the card give the agent.
    #[serde(default)]
    name: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct SliceEntry {
    sources: Vec<SliceSource>,
    #[serde(default)]
    base_model: Option<String>,
    #[serde(default)]
    residual_weight: Option<f64>,
    #[serde(default)]
    parameters: Option<Settings>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct SliceSource {
    model: String,
    layer_range: [usize; 2],
    #[serde(default)]
    parameters: Option<Settings>,
}

/// Reads a mergekit YAML recipe; `seed` (the command line's) overrides the recipe's `seed:`.
pub(super) fn read(path: &Path, seed: Option<u64>) -> Result<Job> {
    crate::checkpoint::files::check_regular_file(path)
        .with_context(|| format!("cannot read recipe {}", path.display()))?;
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("cannot read recipe {}", path.display()))?;
    let stages = documents(&text).len();
    if stages > 1 {
        return Err(usage(format!(
            "recipe {} has {stages} YAML documents, a multi-stage recipe: run it with \
             `rlmerge run {} OUT`",
            path.display(),
            path.display()
        )));
    }
    let mut job = parse(&text, path.parent().unwrap_or(Path::new(".")), seed)
        .with_context(|| format!("recipe {}", path.display()))?;
    job.recipe_path = Some(path.to_path_buf());
    Ok(job)
}

/// A recipe's text as error messages point into it: a file's by line; one made in memory (the
/// Python API's keywords, [`from_value`]) by key alone — its caller never saw its lines.
#[derive(Clone, Copy)]
pub(super) struct RecipeText<'a> {
    text: &'a str,
    numbered: bool,
    /// The file's line the text starts at (a stage's document starts below the file's first).
    first_line: usize,
}

impl RecipeText<'_> {
    /// " (line N)" where `key:` first appears in a file's recipe; nothing for one made in memory.
    pub(super) fn at(&self, key: &str) -> String {
        match self.numbered {
            true => format!(" (line {})", line_of(self.text, key, self.first_line)),
            false => String::new(),
        }
    }
}

/// Parses recipe `text`; model paths resolve against the working directory, then `dir`.
pub(super) fn parse(text: &str, dir: &Path, seed: Option<u64>) -> Result<Job> {
    // Editors on Windows start files with a byte order mark; YAML allows it, serde_yaml does not.
    let text = text.strip_prefix('\u{feff}').unwrap_or(text);
    let (value, raw) = read_yaml(text)?;
    let text = RecipeText {
        text,
        numbered: true,
        first_line: 1,
    };
    parse_raw(raw, value, text, &Folders::new(dir), seed)
}

/// Parses one stage of a multi-stage recipe: its document's `text`, which starts at line
/// `first_line` of the file in `dir`, with the earlier stages' outputs `made` (name, folder)
/// taken for their names.
pub(super) fn parse_stage(
    text: &str,
    (dir, first_line): (&Path, usize),
    made: &[(String, PathBuf)],
    seed: Option<u64>,
) -> Result<Job> {
    let (value, raw) = read_yaml(text)?;
    let text = RecipeText {
        text,
        numbered: true,
        first_line,
    };
    parse_raw(raw, value, text, &Folders::new(dir).with_stages(made), seed)
}

/// A recipe made in memory as a YAML value (the Python API's keywords): the same reading and
/// checks as a file's, with messages naming keys, not lines. Model paths resolve against the
/// working directory.
pub(super) fn from_value(value: serde_yaml::Value, seed: Option<u64>) -> Result<Job> {
    let text = serde_yaml::to_string(&value)?;
    let raw = serde_yaml::from_value(value.clone()).map_err(|e| anyhow::anyhow!("{e}"))?;
    let text = RecipeText {
        text: &text,
        numbered: false,
        first_line: 1,
    };
    parse_raw(raw, value, text, &Folders::new(Path::new(".")), seed)
}

/// The recipe after YAML (`value` as written, `raw` typed): its keys checked, its models found,
/// its method built.
fn parse_raw(
    raw: RawConfig,
    value: serde_yaml::Value,
    text: RecipeText,
    folders: &Folders,
    seed: Option<u64>,
) -> Result<Job> {
    refuse_unsupported(&raw, text)?;
    let seed = seed.or(raw.seed).unwrap_or(0);
    let kind = method_kind(&raw, text)?;
    let Listed {
        mut entries,
        base_ref,
        method_wide,
        slices,
    } = listed_models(&raw, text, folders)?;
    let tokenizer = tokenizer_settings(&raw, text, folders)?;
    let svc = svc_of(&raw)?;
    let out_dtype = out_dtype(&raw)?;
    let shard_size = shard_size(&raw)?;
    let chat_template = raw
        .chat_template
        .as_deref()
        .map(crate::vocabulary::chat_template::ChatTemplate::parse)
        .transpose()
        .map_err(|e| usage(format!("{e}{}", text.at("chat_template"))))?;
    let implicit_base = base_ref.is_none() && raw.layout_model.is_none();
    let (base, base_ref, with_base) =
        choose_base(kind, &mut entries, base_ref, &raw.layout_model, folders)?;
    // The base is not merged as an agent when listed among the models (mergekit excludes it).
    if with_base {
        entries.retain(|(m, _)| *m != base_ref);
    }
    let agents = entries
        .iter()
        .map(|(m, _)| folders.folder(m))
        .collect::<Result<Vec<_>>>()?;
    let names = names_of(&raw, &entries);
    if implicit_base {
        refuse_bare_adapter(&agents, kind)?;
    }
    let (slices, slice_settings) = match slices {
        Some(read) => {
            let names: Vec<String> = entries.iter().map(|(m, _)| m.clone()).collect();
            let (slices, settings) = slices_of(read, &base_ref, with_base, &names)?;
            (Some(slices), settings)
        }
        None => (None, Vec::new()),
    };
    if slices.is_some() && kind == Kind::Fisher {
        return Err(usage(
            "fisher with slices is not supported; merge whole models",
        ));
    }
    let models = model_settings(entries, folders)?;
    let request = MethodRequest {
        kind,
        method_wide,
        models,
        seed,
        with_base,
        slices: slice_settings,
    };
    let epsilon = match kind {
        Kind::Ram | Kind::RamPlus | Kind::RamplusTl => {
            build::epsilon(&request).map_err(|e| at_line_of_parameter(e, text))?
        }
        _ => None,
    };
    let method = build::build(request, agents.len()).map_err(|e| at_line_of_parameter(e, text))?;
    let merging = build::merging(method, svc.as_ref())?;
    if let Some(slices) = &slices {
        check_slice_counts(slices, &merging.method)?;
    }
    Ok(Job {
        base,
        agents,
        merging,
        epsilon,
        out_dtype,
        shard_size,
        allow_nonfinite: raw.allow_nonfinite.unwrap_or(false),
        allow_missing_tensors: raw.allow_missing_tensors.unwrap_or(false),
        raw_f32_agents: raw.raw_f32_agents.unwrap_or(false),
        recipe: Recipe {
            value,
            folders: folders.found.take(),
        },
        recipe_path: None,
        slices,
        tokenizer,
        names,
        config_from: raw.config_from.clone(),
        stages: Vec::new(),
        chat_template,
    })
}

/// The recipe's `merge_method`, a usage error naming the closest method where it is none.
fn method_kind(raw: &RawConfig, text: RecipeText) -> Result<Kind> {
    Kind::from_name(&raw.merge_method).ok_or_else(|| {
        let svc = Arg::named(
            "`svc: ALPHA` beside merge_method (e.g. svc: 0.1)",
            "the keyword svc=ALPHA (e.g. svc=0.1)",
        );
        let mut message = crate::message![
            "unknown ",
            Arg::named("merge_method", "method"),
            format!(" '{}'{}", raw.merge_method, text.at("merge_method")),
        ];
        message
            .0
            .extend(Kind::unknown_hint(&raw.merge_method, svc).0);
        usage(message)
    })
}

/// Each merged model's `name:` (rlmerge's key), by model reference in `entries`' order.
fn names_of(raw: &RawConfig, entries: &[(String, Settings)]) -> Vec<Option<String>> {
    entries
        .iter()
        .map(|(m, _)| {
            raw.models
                .iter()
                .flatten()
                .find(|e| &e.model == m)
                .and_then(|e| e.name.clone())
        })
        .collect()
}

/// The merge's base folder, its reference as the recipe wrote it, and whether θ₀ enters the
/// formula; without `base_model`, a method that does not need one takes its layout from
/// `layout_model` (rlmerge's key), else from the first model. Karcher's base joins `entries` (it
/// averages every input, as mergekit's group entries).
fn choose_base(
    kind: Kind,
    entries: &mut Vec<(String, Settings)>,
    base_ref: Option<String>,
    layout: &Option<String>,
    folders: &Folders,
) -> Result<(PathBuf, String, bool)> {
    // θ₀ enters the formula: always for most methods, for nuslerp/multislerp when named.
    let with_base = kind.uses_base() || (kind.base_optional() && base_ref.is_some());
    if let Some(layout) = layout {
        if base_ref.is_some() || with_base {
            return Err(usage(format!(
                "layout_model '{layout}' names a model that gives the output's layout without \
                 being merged, which {} cannot take{}; write base_model",
                kind.name(),
                match base_ref {
                    Some(_) => " beside base_model",
                    None => " (it merges against its base_model)",
                }
            )));
        }
    }
    // Karcher averages every input, the base_model among them (mergekit's group entries).
    if let (Kind::Karcher, Some(b)) = (kind, &base_ref) {
        if !entries.iter().any(|(m, _)| m == b) {
            entries.insert(0, (b.clone(), Settings::new()));
        }
    }
    let base_ref = match (base_ref.or_else(|| layout.clone()), with_base) {
        (Some(b), _) => b,
        (None, false) => entries
            .first()
            .map(|e| e.0.clone())
            .context("the recipe lists no models")?,
        (None, true) => bail!("merge_method {} needs base_model", kind.name()),
    };
    let base = folders.folder(&base_ref)?;
    // A LoRA agent first among models without a base: its base gives the layout.
    let base = match crate::checkpoint::lora::split_reference(&base.to_string_lossy()) {
        Some((b, _)) if !with_base => PathBuf::from(b),
        Some(_) => {
            return Err(usage(format!(
                "base_model '{base_ref}' is a LoRA reference; name the base model itself and \
                 list BASE+ADAPTER among the models"
            )))
        }
        None => base,
    };
    Ok((base, base_ref, with_base))
}

/// An adapter folder alone is applied to the merge's base; without `base_model` there is none the
/// user named (the first model only gives the layout), so it must say its own.
fn refuse_bare_adapter(agents: &[PathBuf], kind: Kind) -> Result<()> {
    if let Some(a) = agents.iter().find(|a| {
        crate::checkpoint::lora::split_reference(&a.to_string_lossy()).is_none()
            && crate::checkpoint::lora::is_adapter(a)
    }) {
        return Err(usage(format!(
            "model '{}' is a LoRA adapter, and merge_method {} has no base_model to apply it \
             to; write it as BASE+ADAPTER with the model it was trained on, or set base_model",
            a.display(),
            kind.name(),
        )));
    }
    Ok(())
}

/// Each slice gives the method as many models as it needs.
fn check_slice_counts(slices: &Slices, method: &crate::method::Method) -> Result<()> {
    if let crate::method::Method::Combine(config) = method {
        for (n, slice) in slices.0.iter().enumerate() {
            let models = slice
                .sources
                .iter()
                .filter(|s| s.model != Source::Base)
                .count();
            config
                .check(models)
                .map_err(|e| usage(format!("slice {}: {e}", n + 1)))?;
        }
    }
    Ok(())
}

/// The recipe as typed YAML, after the checks serde's typed maps would skip.
fn read_yaml(text: &str) -> Result<(serde_yaml::Value, RawConfig)> {
    if let Some(line) = text
        .lines()
        .position(|l| l.trim_start().trim_start_matches("- ").starts_with("<<:"))
    {
        bail!(
            "YAML merge keys (<<) are not supported (line {}); write the values out",
            line + 1
        );
    }
    // As a plain YAML value first: it refuses a key given twice in any mapping, which typed maps
    // (parameters) would take silently, the last one winning.
    let value =
        serde_yaml::from_str::<serde_yaml::Value>(text).map_err(|e| anyhow::anyhow!("{e}"))?;
    if documents::is_moe_config(&value) {
        return Err(usage(
            "this is a mergekit-moe config: `rlmerge moe CONFIG OUT` builds it",
        ));
    }
    let raw = serde_yaml::from_str(text).map_err(|e| anyhow::anyhow!("{e}"))?;
    Ok((value, raw))
}

/// mergekit keys rlmerge does not support yet: an error naming the key and its line.
fn refuse_unsupported(raw: &RawConfig, text: RecipeText) -> Result<()> {
    for (key, set) in [("modules", raw.modules.is_some())] {
        if set {
            bail!("'{key}' is not supported yet by rlmerge{}", text.at(key));
        }
    }
    Ok(())
}

/// What `models` or the slices list: (model, its parameters) in order, the base_model named, the
/// method-wide parameters (a lone slice's merged in), and the slices when they select layers.
struct Listed {
    entries: Vec<(String, Settings)>,
    base_ref: Option<String>,
    method_wide: Settings,
    slices: Option<Vec<RawSlice>>,
}

/// One slice of the recipe: its sources (model, first layer, parameters), its length and its own
/// parameters.
struct RawSlice {
    sources: Vec<(String, usize, Settings)>,
    len: usize,
    parameters: Settings,
    /// Every source takes all its model's layers.
    whole: bool,
}

/// The models of `models`, or of the slices: one slice over every layer of each model reads as
/// `models` (mergekit's slerp examples write it so); any other slicing selects layers.
fn listed_models(raw: &RawConfig, text: RecipeText, folders: &Folders) -> Result<Listed> {
    let mut listed = Listed {
        entries: Vec::new(),
        base_ref: raw.base_model.clone(),
        method_wide: raw.parameters.clone().unwrap_or_default(),
        slices: None,
    };
    let slices = match (&raw.models, &raw.slices) {
        (Some(_), Some(_)) => bail!("a recipe has either 'models' or 'slices', not both"),
        (None, None) => bail!("the recipe lists no models ('models' or 'slices')"),
        (Some(models), None) => {
            for m in models {
                let settings = m.parameters.clone().unwrap_or_default();
                listed.entries.push((m.model.clone(), settings));
            }
            return Ok(listed);
        }
        (None, Some(slices)) => slices,
    };
    let line = text.at("slices");
    if slices.is_empty() {
        return Err(usage(format!("'slices' is empty{line}")));
    }
    let mut read = Vec::new();
    for (n, slice) in slices.iter().enumerate() {
        if slice.residual_weight.is_some() {
            bail!(
                "'residual_weight' in a slice is not supported yet{}",
                text.at("residual_weight")
            );
        }
        if let Some(b) = &slice.base_model {
            match &listed.base_ref {
                Some(global) if global != b => {
                    return Err(usage(format!(
                        "slice {} names base_model '{b}' but the recipe's is '{global}'; one base \
                         for every slice is supported",
                        n + 1
                    )))
                }
                _ => listed.base_ref = Some(b.clone()),
            }
        }
        if slice.sources.is_empty() {
            return Err(usage(format!("slice {} has no sources{line}", n + 1)));
        }
        read.push(read_slice(n, slice, folders, &line)?);
    }
    // One slice over every layer of each model: the models, as `models` lists them.
    if read.len() == 1 && read[0].whole {
        let slice = read.remove(0);
        listed.method_wide.extend(slice.parameters);
        listed.entries = slice.sources.into_iter().map(|(m, _, s)| (m, s)).collect();
        return Ok(listed);
    }
    // Models in the order they first appear; their parameters are the slices' own.
    for slice in &read {
        for (m, _, _) in &slice.sources {
            if !listed.entries.iter().any(|(e, _)| e == m) {
                listed.entries.push((m.clone(), Settings::new()));
            }
        }
    }
    listed.slices = Some(read);
    Ok(listed)
}

/// Slice `n` (from 0) of the recipe, its sources checked against their models' layer counts.
fn read_slice(n: usize, slice: &SliceEntry, folders: &Folders, line: &str) -> Result<RawSlice> {
    let mut sources = Vec::new();
    let mut len = None;
    let mut whole = true;
    for s in &slice.sources {
        let [start, end] = s.layer_range;
        let layers = layer_count(&folders.folder(&s.model)?)?;
        if start >= end || end > layers {
            return Err(usage(format!(
                "slice {} takes layer_range [{start}, {end}] of '{}', which has {layers} \
                 layers; a range is [first, last + 1] with first < last + 1 ≤ {layers}{line}",
                n + 1,
                s.model
            )));
        }
        if *len.get_or_insert(end - start) != end - start {
            return Err(usage(format!(
                "slice {}: every source must take as many layers (got {} and {}){line}",
                n + 1,
                len.unwrap_or(0),
                end - start
            )));
        }
        if sources.iter().any(|(m, _, _)| *m == s.model) {
            return Err(usage(format!(
                "slice {} lists model '{}' twice{line}",
                n + 1,
                s.model
            )));
        }
        whole &= start == 0 && end == layers;
        let settings = s.parameters.clone().unwrap_or_default();
        sources.push((s.model.clone(), start, settings));
    }
    Ok(RawSlice {
        sources,
        len: len.unwrap_or(0),
        parameters: slice.parameters.clone().unwrap_or_default(),
        whole,
    })
}

/// The slices of a recipe over the merge's base and agents (`agents`: the model references in
/// agent order), with each slice's parameters per agent.
fn slices_of(
    read: Vec<RawSlice>,
    base_ref: &str,
    with_base: bool,
    agents: &[String],
) -> Result<(Slices, Vec<SliceSettings>)> {
    let mut slices = Vec::new();
    let mut settings = Vec::new();
    for (n, slice) in read.into_iter().enumerate() {
        let mut models = vec![Settings::new(); agents.len()];
        let mut sources = Vec::new();
        for (m, start, params) in slice.sources {
            let model = if with_base && m == base_ref {
                Source::Base
            } else {
                let t = agents
                    .iter()
                    .position(|a| *a == m)
                    .expect("every source is listed");
                models[t] = params;
                Source::Agent(t)
            };
            sources.push(slices::SliceSource { model, start });
        }
        if with_base && !sources.iter().any(|s| s.model == Source::Base) {
            return Err(usage(format!(
                "slice {} has no source from the base_model '{base_ref}', which this method \
                 needs in every slice (as θ₀)",
                n + 1
            )));
        }
        slices.push(Slice {
            sources,
            len: slice.len,
        });
        settings.push(SliceSettings {
            parameters: slice.parameters,
            models,
        });
    }
    Ok((Slices(slices), settings))
}

/// Each merged model's parameters; Fisher folders are local folders too, found the same way as
/// models.
fn model_settings(entries: Vec<(String, Settings)>, folders: &Folders) -> Result<Vec<Settings>> {
    let mut models: Vec<Settings> = entries.into_iter().map(|(_, s)| s).collect();
    for s in models.iter_mut() {
        if let Some(Setting::Scalar(Scalar::Text(p))) = s.get("fisher") {
            let folder = folders.folder(p)?;
            s.insert(
                "fisher".into(),
                Setting::Scalar(Scalar::Text(folder.display().to_string())),
            );
        }
    }
    Ok(models)
}

/// An error that names a parameter, pointed at the parameter's line.
fn at_line_of_parameter(e: anyhow::Error, text: RecipeText) -> anyhow::Error {
    let msg = e.to_string();
    match msg.split('\'').nth(1) {
        // A parameter the recipe does not write (a required one left out) has no line to name.
        Some(key) if msg.contains("parameter") && text.numbered && !text.at(key).contains('?') => {
            usage(format!("{msg}{}", text.at(key)))
        }
        _ => e,
    }
}

/// The line where `key:` first appears as a key, in block or flow style, counting `text`'s first
/// line as `first` ("?" if it does not).
fn line_of(text: &str, key: &str, first: usize) -> String {
    let is_key_at = |line: &str, at: usize| {
        let before = line[..at].chars().next_back();
        let after = line[at + key.len()..].trim_start();
        matches!(before, None | Some(' ' | '{' | ',' | '-' | '\t')) && after.starts_with(':')
    };
    text.lines()
        .position(|l| l.match_indices(key).any(|(at, _)| is_key_at(l, at)))
        .map_or_else(|| "?".into(), |i| (i + first).to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unknown_keys_name_key_and_line() {
        let e = parse(
            "merge_method: ties\nbase_model: x\nfoo: 1\n",
            Path::new("."),
            None,
        )
        .unwrap_err();
        let msg = format!("{e:#}");
        assert!(msg.contains("foo") && msg.contains("line 3"), "{msg}");
        let e = parse(
            "merge_method: ties\nmodules:\n  a: 1\n",
            Path::new("."),
            None,
        )
        .unwrap_err();
        let msg = format!("{e:#}");
        assert!(
            msg.contains("modules") && msg.contains("not supported yet") && msg.contains("line 2"),
            "{msg}"
        );
    }
}
