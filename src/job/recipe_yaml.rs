//! The mergekit YAML recipe: read, checked key by key, and turned into a [`Job`].
//! Unknown keys and the parts rlmerge does not support yet are errors that name the key and line.

use super::Job;
use crate::checkpoint::DType;
use crate::error::usage;
use crate::method::build::{self, MethodRequest};
use crate::method::settings::{Scalar, Setting, Settings};
use crate::method::Kind;
use anyhow::{bail, Context, Result};
use serde::Deserialize;
use std::path::{Path, PathBuf};

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawConfig {
    merge_method: String,
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
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct ModelEntry {
    model: String,
    #[serde(default)]
    parameters: Option<Settings>,
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

/// A model reference as a local folder: as written (relative to the working directory), else
/// relative to the recipe's folder.
fn local_folder(reference: &str, recipe_dir: &Path) -> Result<PathBuf> {
    if reference.trim().is_empty() {
        bail!("a model reference is empty (`model:` needs a folder or a Hub id)");
    }
    if reference.contains('+') && !Path::new(reference).exists() {
        bail!("model '{reference}': LoRA references (model+lora) are not supported yet");
    }
    let direct = PathBuf::from(reference);
    if direct.is_dir() {
        return Ok(direct);
    }
    let beside = recipe_dir.join(reference);
    if beside.is_dir() {
        return Ok(beside);
    }
    if crate::hub::ModelId::parse(reference).is_some() {
        return crate::hub::locate(
            &direct,
            std::io::IsTerminal::is_terminal(&std::io::stderr()),
        );
    }
    bail!(
        "model '{reference}' is not a local folder (looked in {} and {}) nor a Hub id (org/name)",
        std::env::current_dir().map_or_else(|_| ".".into(), |d| d.display().to_string()),
        recipe_dir.display()
    )
}

/// Layers of a model, from its config.json.
fn layer_count(dir: &Path) -> Result<usize> {
    let json =
        crate::checkpoint::folder_files::read_config(dir).context("slices need the layer count")?;
    let path = dir.join("config.json");
    ["num_hidden_layers", "n_layer", "num_layers"]
        .iter()
        .find_map(|k| json.get(k).and_then(|v| v.as_u64()))
        .map(|n| n as usize)
        .with_context(|| format!("{}: no num_hidden_layers", path.display()))
}

/// Reads a mergekit YAML recipe.
pub(super) fn read(path: &Path, seed: u64) -> Result<Job> {
    crate::checkpoint::model::check_regular_file(path)
        .with_context(|| format!("cannot read recipe {}", path.display()))?;
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("cannot read recipe {}", path.display()))?;
    let mut job = parse(&text, path.parent().unwrap_or(Path::new(".")), seed)
        .with_context(|| format!("recipe {}", path.display()))?;
    job.recipe_path = Some(path.to_path_buf());
    Ok(job)
}

/// Parses recipe `text`; model paths resolve against the working directory, then `dir`.
pub(super) fn parse(text: &str, dir: &Path, seed: u64) -> Result<Job> {
    // Editors on Windows start files with a byte order mark; YAML allows it, serde_yaml does not.
    let text = text.strip_prefix('\u{feff}').unwrap_or(text);
    let raw = read_yaml(text)?;
    refuse_unsupported(&raw, text)?;
    let kind = Kind::from_name(&raw.merge_method).ok_or_else(|| {
        usage(format!(
            "unknown merge_method '{}' (line {}); `rlmerge methods` lists them",
            raw.merge_method,
            line_of(text, "merge_method")
        ))
    })?;
    let Listed {
        mut entries,
        base_ref,
        shared,
    } = listed_models(&raw, text, dir)?;
    let out_dtype =
        match raw.out_dtype.as_ref().or(raw.dtype.as_ref()) {
            None => None,
            Some(d) => Some(DType::parse_user(d).with_context(|| {
                format!("unknown dtype '{d}' (use bfloat16, float16 or float32)")
            })?),
        };
    // θ₀ enters the formula: always for most methods, for nuslerp/multislerp when named.
    let with_base = kind.uses_base() || (kind.base_optional() && base_ref.is_some());
    // Karcher averages every input, the base_model among them (mergekit's group entries).
    if let (Kind::Karcher, Some(b)) = (kind, &base_ref) {
        if !entries.iter().any(|(m, _)| m == b) {
            entries.insert(0, (b.clone(), Settings::new()));
        }
    }
    let base_ref = match (base_ref, with_base) {
        (Some(b), _) => b,
        (None, false) => entries
            .first()
            .map(|e| e.0.clone())
            .context("the recipe lists no models")?,
        (None, true) => bail!("merge_method {} needs base_model", kind.name()),
    };
    let base = local_folder(&base_ref, dir)?;
    // The base is not merged as an agent when listed among the models (mergekit excludes it).
    if with_base {
        entries.retain(|(m, _)| *m != base_ref);
    }
    let agents = entries
        .iter()
        .map(|(m, _)| local_folder(m, dir))
        .collect::<Result<Vec<_>>>()?;
    let models = model_settings(entries, dir)?;
    let request = MethodRequest {
        kind,
        shared,
        models,
        seed,
        with_base,
    };
    let epsilon = match kind {
        Kind::Ram | Kind::RamPlus | Kind::RamplusTl => build::epsilon(&request)?,
        _ => None,
    };
    let method = build::build(request, agents.len()).map_err(|e| at_line_of_parameter(e, text))?;
    Ok(Job {
        base,
        agents,
        method,
        epsilon,
        out_dtype,
        recipe_text: text.to_string(),
        recipe_path: None,
    })
}

/// The recipe as typed YAML, after the checks serde's typed maps would skip.
fn read_yaml(text: &str) -> Result<RawConfig> {
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
    serde_yaml::from_str::<serde_yaml::Value>(text).map_err(|e| anyhow::anyhow!("{e}"))?;
    serde_yaml::from_str(text).map_err(|e| anyhow::anyhow!("{e}"))
}

/// mergekit keys rlmerge does not support yet: an error naming the key and its line.
fn refuse_unsupported(raw: &RawConfig, text: &str) -> Result<()> {
    for (key, set) in [
        ("modules", raw.modules.is_some()),
        ("tokenizer", raw.tokenizer.is_some()),
        ("chat_template", raw.chat_template.is_some()),
    ] {
        if set {
            bail!(
                "'{key}' is not supported yet by rlmerge (line {})",
                line_of(text, key)
            );
        }
    }
    match &raw.tokenizer_source {
        None => Ok(()),
        Some(serde_yaml::Value::String(s)) if s == "base" => Ok(()),
        Some(_) => bail!(
            "tokenizer_source: only 'base' is supported yet (line {}); the tokenizer is copied from the base model",
            line_of(text, "tokenizer_source")
        ),
    }
}

/// What `models` or a slice lists: (model, its parameters) in order, the base_model named, and
/// the method-wide parameters (a slice's merged in).
struct Listed {
    entries: Vec<(String, Settings)>,
    base_ref: Option<String>,
    shared: Settings,
}

/// The models of `models`, or of one slice over every layer (the only slicing supported yet).
fn listed_models(raw: &RawConfig, text: &str, dir: &Path) -> Result<Listed> {
    let mut listed = Listed {
        entries: Vec::new(),
        base_ref: raw.base_model.clone(),
        shared: raw.parameters.clone().unwrap_or_default(),
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
    let line = line_of(text, "slices");
    if slices.len() != 1 {
        bail!("'slices' with {} slices is not supported yet (line {line}); one slice over all layers is", slices.len());
    }
    let slice = &slices[0];
    if slice.residual_weight.is_some() {
        bail!(
            "'residual_weight' in a slice is not supported yet (line {})",
            line_of(text, "residual_weight")
        );
    }
    if let Some(b) = &slice.base_model {
        listed.base_ref = Some(b.clone());
    }
    for (k, v) in slice.parameters.clone().unwrap_or_default() {
        listed.shared.insert(k, v);
    }
    for s in &slice.sources {
        let layers = layer_count(&local_folder(&s.model, dir)?)?;
        if s.layer_range != [0, layers] {
            bail!(
                "slice source '{}' takes layers {:?} of {layers}; only slices over all layers are supported yet (line {line})",
                s.model, s.layer_range
            );
        }
        let settings = s.parameters.clone().unwrap_or_default();
        listed.entries.push((s.model.clone(), settings));
    }
    Ok(listed)
}

/// Each merged model's parameters; Fisher folders are local folders too, found the same way as
/// models.
fn model_settings(entries: Vec<(String, Settings)>, dir: &Path) -> Result<Vec<Settings>> {
    let mut models: Vec<Settings> = entries.into_iter().map(|(_, s)| s).collect();
    for s in models.iter_mut() {
        if let Some(Setting::Scalar(Scalar::Text(p))) = s.get("fisher") {
            let folder = local_folder(p, dir)?;
            s.insert(
                "fisher".into(),
                Setting::Scalar(Scalar::Text(folder.display().to_string())),
            );
        }
    }
    Ok(models)
}

/// An error that names a parameter, pointed at the parameter's line.
fn at_line_of_parameter(e: anyhow::Error, text: &str) -> anyhow::Error {
    let msg = e.to_string();
    match msg.split('\'').nth(1) {
        Some(key) if msg.contains("parameter") => {
            usage(format!("{msg} (line {})", line_of(text, key)))
        }
        _ => e,
    }
}

/// The 1-based line where `key:` first appears as a key, in block or flow style ("?" if it does not).
fn line_of(text: &str, key: &str) -> String {
    let is_key_at = |line: &str, at: usize| {
        let before = line[..at].chars().next_back();
        let after = line[at + key.len()..].trim_start();
        matches!(before, None | Some(' ' | '{' | ',' | '-' | '\t')) && after.starts_with(':')
    };
    text.lines()
        .position(|l| l.match_indices(key).any(|(at, _)| is_key_at(l, at)))
        .map_or_else(|| "?".into(), |i| (i + 1).to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unknown_keys_name_key_and_line() {
        let e = parse(
            "merge_method: ties\nbase_model: x\nfoo: 1\n",
            Path::new("."),
            0,
        )
        .unwrap_err();
        let msg = format!("{e:#}");
        assert!(msg.contains("foo") && msg.contains("line 3"), "{msg}");
        let e = parse("merge_method: ties\nmodules:\n  a: 1\n", Path::new("."), 0).unwrap_err();
        let msg = format!("{e:#}");
        assert!(
            msg.contains("modules") && msg.contains("not supported yet") && msg.contains("line 2"),
            "{msg}"
        );
    }
}
