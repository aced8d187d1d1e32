//! A recipe's model references as folders: a local folder as written or beside the recipe (an
//! ambiguous one refused), `BASE+ADAPTER` part by part, else a Hub id from the cache; each found
//! once and remembered for the recipe the merge saves.

use crate::error::usage;
use anyhow::{bail, Context, Result};
use std::path::{Path, PathBuf};

/// A model reference as a local folder: as written (relative to the working directory), else
/// relative to the recipe's folder; where both name a folder and they are not the same one, the
/// reference is ambiguous and refused (a saved recipe's `../agent` run from elsewhere must not
/// take another folder of that name silently).
pub(crate) fn local_folder(reference: &str, recipe_dir: &Path) -> Result<PathBuf> {
    if reference.trim().is_empty() {
        bail!("a model reference is empty (`model:` needs a folder or a Hub id)");
    }
    // mergekit's BASE+ADAPTER: each part found as a model is.
    if let Some((base, adapter)) = crate::checkpoint::lora::split_reference(reference) {
        let (b, a) = (
            local_folder(base, recipe_dir)?,
            local_folder(adapter, recipe_dir)?,
        );
        return Ok(PathBuf::from(format!("{}+{}", b.display(), a.display())));
    }
    let direct = PathBuf::from(reference);
    let beside = recipe_dir.join(reference);
    match (direct.is_dir(), beside.is_dir()) {
        (true, true) if !same_folder(&direct, &beside) => {
            return Err(usage(format!(
                "model '{reference}' names two folders: {} (from the working directory) and {} \
                 (beside the recipe); run the recipe from its own folder, or write the path of \
                 the one you mean",
                std::path::absolute(&direct)
                    .unwrap_or(direct.clone())
                    .display(),
                beside.display()
            )))
        }
        (true, _) => return Ok(direct),
        (false, true) => return Ok(beside),
        (false, false) => {}
    }
    // A file is no model, though its path may look like a Hub id (org/name).
    if let Some(file) = [&direct, &beside].into_iter().find(|p| p.exists()) {
        bail!(
            "model '{reference}' is {}, which is not a folder (a model is a folder with config.json and safetensors weights)",
            file.display()
        );
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

/// Whether two existing paths are one folder.
fn same_folder(a: &Path, b: &Path) -> bool {
    match (std::fs::canonicalize(a), std::fs::canonicalize(b)) {
        (Ok(x), Ok(y)) => x == y,
        _ => false,
    }
}

/// The folders a recipe's model references name, found once each ([`local_folder`]) and
/// remembered for the recipe the merge saves (`saved_recipe`).
pub(super) struct Folders<'a> {
    dir: &'a Path,
    pub(super) found: std::cell::RefCell<Vec<(String, PathBuf)>>,
    /// A multi-stage recipe's earlier stages (name, output folder): a name wins over a folder.
    stages: &'a [(String, PathBuf)],
}

impl<'a> Folders<'a> {
    pub(super) fn new(dir: &'a Path) -> Self {
        Folders {
            dir,
            found: Default::default(),
            stages: &[],
        }
    }

    /// These folders, with the earlier stages of a multi-stage recipe taken by name.
    pub(super) fn with_stages(self, stages: &'a [(String, PathBuf)]) -> Self {
        Folders { stages, ..self }
    }

    /// The folder `reference` names.
    pub(super) fn folder(&self, reference: &str) -> Result<PathBuf> {
        if let Some((_, f)) = self.found.borrow().iter().find(|(r, _)| r == reference) {
            return Ok(f.clone());
        }
        if let Some((_, f)) = self.stages.iter().find(|(name, _)| name == reference) {
            self.found
                .borrow_mut()
                .push((reference.to_string(), f.clone()));
            return Ok(f.clone());
        }
        let folder = local_folder(reference, self.dir)?;
        self.found
            .borrow_mut()
            .push((reference.to_string(), folder.clone()));
        Ok(folder)
    }
}

/// Layers of a model, from its config.json (a LoRA agent `BASE+ADAPTER`: its base's).
pub(super) fn layer_count(dir: &Path) -> Result<usize> {
    let text = dir.to_string_lossy();
    let dir = match crate::checkpoint::lora::split_reference(&text) {
        Some((base, _)) => Path::new(base),
        None if crate::checkpoint::lora::is_adapter(dir) => {
            return Err(usage(format!(
                "{} is a LoRA adapter: in slices, write it as BASE+ADAPTER so its layers are \
                 the base's",
                dir.display()
            )))
        }
        None => dir,
    };
    let config =
        crate::model_config::ModelConfig::read(dir).context("slices need the layer count")?;
    config.layer_count().with_context(|| {
        format!(
            "{}: no num_hidden_layers",
            dir.join("config.json").display()
        )
    })
}
