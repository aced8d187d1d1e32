//! Multi-stage recipes (issue #53 item 3), as mergekit-multi reads them: one YAML file of several
//! documents, each a merge recipe with a `name:`; a stage takes an earlier one as a model by its
//! name (`model: NAME`, `base_model: NAME`, anywhere a recipe names a model). The stages run in
//! the order their names require (file order where none does); the final one — the document
//! without a name, else the last — writes the output. A stage's name wins over a folder of the
//! same name, as in mergekit.

use super::recipe_yaml::{documents, is_moe_config};
use super::saved_recipe::references_mut;
use super::Job;
use crate::error::usage;
use anyhow::{Context, Result};
use std::path::{Path, PathBuf};

/// One stage: its name, its document's text and where it starts in the file, and the stages
/// (by index in run order) it takes as models.
#[derive(Debug)]
struct Stage {
    name: Option<String>,
    text: String,
    first_line: usize,
    needs: Vec<usize>,
    /// A mergekit-moe config (the final stage only).
    moe: bool,
}

/// A multi-stage recipe, its stages in the order they run, the final one last.
#[derive(Debug)]
pub struct Stages {
    path: PathBuf,
    stages: Vec<Stage>,
}

/// A stage's name as a folder name: letters, digits, `.`, `_` and `-`, not `.` or `..`.
fn check_name(name: &str, line: usize) -> Result<()> {
    let plain = name
        .chars()
        .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-'));
    if name.is_empty() || name == "." || name == ".." || !plain {
        return Err(usage(format!(
            "stage name '{}' (line {line}) must be a folder name: letters, digits, '.', '_' and \
             '-'",
            crate::escape::terminal(name)
        )));
    }
    Ok(())
}

impl Stages {
    /// The stages of the recipe at `path`; `None` where it holds one document (a plain recipe).
    pub fn read(path: &Path) -> Result<Option<Stages>> {
        crate::checkpoint::files::check_regular_file(path)
            .with_context(|| format!("cannot read recipe {}", path.display()))?;
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("cannot read recipe {}", path.display()))?;
        let text = text.strip_prefix('\u{feff}').unwrap_or(&text);
        let docs = documents(text);
        if docs.len() < 2 {
            return Ok(None);
        }
        Self::order(path, docs)
            .map(Some)
            .with_context(|| format!("recipe {}", path.display()))
    }

    /// The documents as stages in the order they run.
    fn order(path: &Path, docs: Vec<(String, usize)>) -> Result<Stages> {
        let mut names: Vec<Option<String>> = Vec::new();
        let mut values = Vec::new();
        // Which documents are mergekit-moe configs (a final stage only), with their lines.
        let mut moe = Vec::new();
        for (text, line) in &docs {
            let mut value: serde_yaml::Value = serde_yaml::from_str(text)
                .map_err(|e| anyhow::anyhow!("the document at line {line}: {e}"))?;
            moe.push((is_moe_config(&value), *line));
            let name = match value.get("name") {
                None => None,
                Some(serde_yaml::Value::String(n)) => Some(n.clone()),
                Some(_) => {
                    return Err(usage(format!(
                        "the document at line {line}: name must be a string"
                    )))
                }
            };
            if let Some(n) = &name {
                check_name(n, *line)?;
                if names.contains(&name) {
                    return Err(usage(format!("two stages are named '{n}'")));
                }
            } else if names.contains(&None) {
                return Err(usage(
                    "more than one document has no name: every stage but the final one needs a \
                     `name:`, by which later stages take it as a model",
                ));
            }
            let refs: Vec<String> = references_mut(&mut value)
                .into_iter()
                .map(|r| r.clone())
                .collect();
            names.push(name);
            values.push(refs);
        }
        // Who needs whom, by document index.
        let needs: Vec<Vec<usize>> = values
            .iter()
            .map(|refs| {
                let mut n: Vec<usize> = (0..names.len())
                    .filter(|&j| names[j].as_ref().is_some_and(|name| refs.contains(name)))
                    .collect();
                n.dedup();
                n
            })
            .collect();
        let last = names
            .iter()
            .position(Option::is_none)
            .unwrap_or(names.len() - 1);
        if let Some((_, line)) = moe
            .iter()
            .enumerate()
            .find(|(i, m)| m.0 && *i != last)
            .map(|(_, m)| *m)
        {
            return Err(usage(format!(
                "the document at line {line} is a mergekit-moe config: a MoE is only the final \
                 stage (the one without a name, else the last), built from the merges before it"
            )));
        }
        if let Some(user) = (0..names.len()).find(|&i| needs[i].contains(&last)) {
            return Err(usage(format!(
                "stage {} takes the final stage ({}) as a model; the final stage (the one \
                 without a name, else the last document) must come after every other",
                shown(&names[user], user),
                shown(&names[last], last),
            )));
        }
        let order = run_order(&names, &needs, last)?;
        let at: Vec<usize> = (0..names.len())
            .map(|d| order.iter().position(|&o| o == d).unwrap_or(usize::MAX))
            .collect();
        let mut docs: Vec<Option<(String, usize)>> = docs.into_iter().map(Some).collect();
        let stages = order
            .iter()
            .map(|&d| {
                let (text, first_line) = docs[d].take().expect("each document once");
                Stage {
                    name: names[d].clone(),
                    text,
                    first_line,
                    needs: needs[d].iter().map(|&n| at[n]).collect(),
                    moe: moe[d].0,
                }
            })
            .collect();
        Ok(Stages {
            path: path.to_path_buf(),
            stages,
        })
    }

    /// The recipe file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// How many stages, the final one included.
    pub fn len(&self) -> usize {
        self.stages.len()
    }

    /// Whether there are none (never: a multi-stage recipe has two or more).
    pub fn is_empty(&self) -> bool {
        self.stages.is_empty()
    }

    /// Stage `i`'s name (the final one's may have none).
    pub fn name(&self, i: usize) -> Option<&str> {
        self.stages[i].name.as_deref()
    }

    /// Whether the final stage takes stage `i`'s output, itself or through other stages.
    pub fn needed(&self, i: usize) -> bool {
        let last = self.stages.len() - 1;
        let mut wanted = vec![false; self.stages.len()];
        wanted[last] = true;
        for j in (0..self.stages.len()).rev() {
            if wanted[j] {
                for &n in &self.stages[j].needs {
                    wanted[n] = true;
                }
            }
        }
        wanted[i]
    }

    /// Whether the final stage is a mergekit-moe config (`rlmerge moe` builds it).
    pub fn final_is_moe(&self) -> bool {
        self.stages.last().is_some_and(|s| s.moe)
    }

    /// The final stage as a MoE config, the earlier stages' outputs in `made` (name, folder)
    /// taken by their names.
    pub fn moe_config(
        &self,
        made: &[(String, PathBuf)],
        (seed, allow_all_same): (Option<u64>, bool),
    ) -> Result<crate::moe::MoeConfig> {
        let i = self.stages.len() - 1;
        let stage = &self.stages[i];
        let dir = self.path.parent().unwrap_or(Path::new("."));
        let value: serde_yaml::Value = serde_yaml::from_str(&stage.text)?;
        crate::moe::config::from_value(value, dir, (seed, allow_all_same), made).with_context(
            || {
                format!(
                    "recipe {}, stage {}",
                    self.path.display(),
                    shown(&stage.name, i)
                )
            },
        )
    }

    /// Stage `i`'s job, the outputs of the stages before it in `made` (name, folder); `seed` (the
    /// command line's) overrides the recipe's. The stages it names stay names in the recipe it
    /// saves.
    pub fn job(&self, i: usize, made: &[(String, PathBuf)], seed: Option<u64>) -> Result<Job> {
        let stage = &self.stages[i];
        let dir = self.path.parent().unwrap_or(Path::new("."));
        let mut job =
            super::recipe_yaml::parse_stage(&stage.text, (dir, stage.first_line), made, seed)
                .with_context(|| {
                    format!(
                        "recipe {}, stage {}",
                        self.path.display(),
                        shown(&stage.name, i)
                    )
                })?;
        job.recipe_path = Some(self.path.clone());
        job.recipe
            .folders
            .retain(|(reference, _)| !made.iter().any(|(name, _)| name == reference));
        Ok(job)
    }
}

/// How messages name stage `i` (a document index or run position): `'NAME'`, or "the unnamed".
fn shown(name: &Option<String>, i: usize) -> String {
    match name {
        Some(n) => format!("'{n}'"),
        None => format!("{} (no name)", i + 1),
    }
}

/// The documents in an order where each comes after those it needs, file order where free, the
/// final one (`last`) at the end; a cycle is refused by its stages' names.
fn run_order(names: &[Option<String>], needs: &[Vec<usize>], last: usize) -> Result<Vec<usize>> {
    let n = names.len();
    let mut order = Vec::with_capacity(n);
    let mut placed = vec![false; n];
    while order.len() < n {
        let ready = (0..n).find(|&d| {
            !placed[d] && (d != last || order.len() == n - 1) && needs[d].iter().all(|&m| placed[m])
        });
        match ready {
            Some(d) => {
                placed[d] = true;
                order.push(d);
            }
            None => {
                let stuck: Vec<String> = (0..n)
                    .filter(|&d| !placed[d])
                    .map(|d| shown(&names[d], d))
                    .collect();
                return Err(usage(format!(
                    "the stages {} take each other as models in a circle; a stage can take only \
                     stages that do not take it",
                    stuck.join(", ")
                )));
            }
        }
    }
    Ok(order)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn order_of(text: &str) -> Result<Vec<Option<String>>> {
        let s = Stages::order(Path::new("r.yml"), documents(text))?;
        Ok(s.stages.into_iter().map(|s| s.name).collect())
    }

    #[test]
    fn documents_split_at_markers_and_skip_empty_ones() {
        let docs = documents("# head\n---\nname: a\n--- # c\nname: b\n---\n\n...\n");
        assert_eq!(
            docs,
            vec![("\nname: a\n".into(), 2), ("# c\nname: b\n".into(), 4)]
        );
    }

    #[test]
    fn stages_run_after_the_stages_they_name_and_the_final_last() {
        let text = "name: c\nmerge_method: linear\nmodels: [{model: a}, {model: b}]\n---\n\
                    merge_method: linear\nmodels: [{model: c}, {model: x}]\n---\n\
                    name: a\nmerge_method: linear\nmodels: [{model: x}]\n---\n\
                    name: b\nmerge_method: linear\nmodels: [{model: a}]\n";
        assert_eq!(
            order_of(text).unwrap(),
            [Some("a"), Some("b"), Some("c"), None].map(|n| n.map(String::from))
        );
        let circle = "name: a\nmodels: [{model: b}]\n---\nname: b\nmodels: [{model: a}]\n---\n\
                      models: [{model: a}]\n";
        let e = order_of(circle).unwrap_err().to_string();
        assert!(e.contains("'a', 'b'") && e.contains("circle"), "{e}");
        let twice = "name: a\nmodels: []\n---\nname: a\nmodels: []\n";
        assert!(order_of(twice)
            .unwrap_err()
            .to_string()
            .contains("two stages"));
        let unnamed = "models: []\n---\nmodels: []\n";
        assert!(order_of(unnamed)
            .unwrap_err()
            .to_string()
            .contains("no name"));
        let final_used = "models: [{model: b}]\n---\nname: b\nmodels: []\n---\nname: c\n\
                          models: []\n";
        assert!(order_of(final_used).is_ok());
        let uses_final = "name: a\nmodels: [{model: z}]\n---\nname: z\nmodels: []\n";
        assert!(order_of(uses_final)
            .unwrap_err()
            .to_string()
            .contains("final stage"));
        let bad = "name: ../x\nmodels: []\n---\nmodels: []\n";
        assert!(order_of(bad)
            .unwrap_err()
            .to_string()
            .contains("folder name"));
    }
}
