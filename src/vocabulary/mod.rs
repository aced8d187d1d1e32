//! Tokenizer sources (mergekit's `tokenizer_source` and `tokenizer:` section; SPEC.md §5b): the
//! output's vocabulary — the base's, another model's, or the union of all — and, for every model,
//! which of its embedding rows each output token takes. A token a model lacks takes a default
//! row: the one model that has it (donor), else the base's row, else the mean over the models that
//! have it, else zeros; the recipe may name a token's source itself. Tensors indexed by token
//! (embeddings, lm_head) are then read row-remapped ([`VocabTensor::row_from`]), so models whose
//! vocabularies differ merge token by token.

use crate::checkpoint::ModelFolder;
use crate::slices::Source;
use anyhow::{bail, ensure, Context, Result};
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};
use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

pub mod chat_template;
mod prompts;
mod rows;
mod settings;
mod tokenizer_json;
mod write;

pub use prompts::PromptTokenizer;
pub use rows::{RowFrom, VocabTensor};
pub use settings::{
    parse_source, EmbeddingSource, TokenSetting, TokenizerSettings, TokenizerSource,
};
pub use tokenizer_json::config_vocab_size;
use tokenizer_json::*;
use write::TokenizerFiles;

/// The output's vocabulary and each model's place in it.
#[derive(Debug)]
pub struct Vocabulary {
    /// The settings it was built from.
    pub settings: TokenizerSettings,
    /// Tokens of the output vocabulary (ids 0..len).
    len: usize,
    /// Rows of the output's embeddings: the tokens, padded to `pad_to_multiple_of`.
    pub rows: usize,
    /// For the base (0) and each agent (t + 1): output row → its own row (`ABSENT`: it lacks
    /// the token).
    perms: Vec<Vec<u32>>,
    /// The text of the rows some model lacks or `tokens` names (for their defaults' messages).
    names: HashMap<u32, String>,
    /// Each model's highest own row and the output row it goes to (its embeddings must have
    /// more rows).
    highest: Vec<Highest>,
    /// The `tokenizer.tokens` settings by output row, sources resolved.
    configs: HashMap<u32, (Option<RowDefault>, bool)>,
    files: TokenizerFiles,
    /// The base's (0) and each agent's (t + 1) vocab_size: a model's tensors of that many rows
    /// that are embeddings or the output head are indexed by token.
    vocab_sizes: Vec<usize>,
    /// The base's and each agent's folder (for messages).
    dirs: Vec<PathBuf>,
    /// What the user should know (models without a tokenizer, added tokens set twice).
    pub warnings: Vec<String>,
}

const ABSENT: u32 = u32::MAX;

/// A model's highest own row and the output row it goes to (`None`: it has no row there).
type Highest = Option<(u32, u32)>;

/// A default row for a token.
#[derive(Clone, Debug, PartialEq)]
enum RowDefault {
    Zero,
    /// Row `row` of a model.
    Row(Source, u32),
    /// The same token's row of a model, wherever that model has it.
    SameToken(Source),
    /// The mean of these models' rows for the token (indices into [`VocabTensor::means`]).
    Mean(u32, u32),
}

fn slot(s: Source) -> usize {
    match s {
        Source::Base => 0,
        Source::Agent(t) => t + 1,
    }
}

fn real(p: &Path) -> PathBuf {
    std::fs::canonicalize(p).unwrap_or_else(|_| p.to_path_buf())
}

impl Vocabulary {
    /// The output vocabulary `settings` ask for over these models, and every model's map to it.
    /// The output's vocabulary is the one held whole; every model's tokenizer.json is streamed
    /// (twice at most: for the union, then for its map).
    pub fn build(
        settings: &TokenizerSettings,
        base: &ModelFolder,
        agents: &[ModelFolder],
    ) -> Result<Vocabulary> {
        let mut warnings = Vec::new();
        let base_dir = base.config_dir();
        let vocab_sizes = vocab_sizes(base_dir, agents, &mut warnings)?;
        // The output tokenizer. From the base's (base, union), the base's tokens keep their ids.
        let from_base = !matches!(settings.source, TokenizerSource::Model(_));
        let (mut out, files_from, stripped) = match &settings.source {
            TokenizerSource::Model(p) => {
                let (t, _) = Tokenizer::read(p, false)?.with_context(|| {
                    format!("tokenizer source {} has no tokenizer.json", p.display())
                })?;
                (t, p.clone(), false)
            }
            _ => {
                let (t, stripped) = Tokenizer::read(base_dir, true)?.context("read just now")?;
                (t, base_dir.to_path_buf(), stripped)
            }
        };
        let base_len = out.vocab.len();
        let added_before = out.added.len();
        let mut rewrite = stripped;
        if matches!(settings.source, TokenizerSource::Union) {
            union(&mut out, agents, base_dir, &vocab_sizes, &mut warnings)?;
            rewrite = true;
        }
        for t in &settings.tokens {
            if !out.vocab.contains_key(&t.token) {
                rewrite |= out.add(&t.token, plain_settings());
            }
        }
        // Output ids must run 0..n without a gap.
        let n = out.vocab.len();
        if let Some((tok, id)) = out.vocab.iter().find(|(_, &id)| id as usize >= n) {
            bail!(
                "{}/tokenizer.json: token {tok:?} has id {id}, but the vocabulary has {n} tokens \
                 (ids with gaps cannot index embedding rows)",
                out.dir.display()
            );
        }
        let rows = match settings.pad_to_multiple_of {
            Some(m) if m > 0 => n.div_ceil(m) * m,
            _ => n,
        };
        let (perms, highest) =
            maps_to_output(&out, from_base, base_len, base_dir, agents, &vocab_sizes)?;
        let configs = token_configs(settings, &out, base_dir, agents)?;
        // Names of the rows that may need a default, and of each model's highest row.
        let named: HashSet<u32> = highest.iter().flatten().map(|&(_, id)| id).collect();
        let names = out
            .vocab
            .iter()
            .filter(|(_, &id)| {
                named.contains(&id)
                    || configs.contains_key(&id)
                    || perms.iter().any(|p| p[id as usize] == ABSENT)
            })
            .map(|(t, &id)| (id, t.clone()))
            .collect();
        let files = if rewrite {
            TokenizerFiles::Rewrite {
                from: files_from,
                strip_from: (stripped && from_base).then_some(vocab_sizes[0] as u32),
                appended: out.added[added_before..].to_vec(),
                added: std::mem::take(&mut out.added),
            }
        } else {
            TokenizerFiles::CopyFrom(files_from)
        };
        Ok(Vocabulary {
            settings: settings.clone(),
            len: n,
            rows,
            perms,
            names,
            highest,
            configs,
            files,
            vocab_sizes,
            dirs: std::iter::once(&base.dir)
                .chain(agents.iter().map(|a| &a.dir))
                .cloned()
                .collect(),
            warnings,
        })
    }

    /// Model `s`'s vocab_size (config.json's, else its tokenizer's size).
    pub fn vocab_size(&self, s: Source) -> usize {
        self.vocab_sizes[slot(s)]
    }

    /// Tokens of the output vocabulary.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the vocabulary has no tokens.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The text of output row `r` (rows some model lacks or `tokens` names).
    fn name(&self, r: usize) -> &str {
        self.names.get(&(r as u32)).map_or("?", String::as_str)
    }

    /// The highest own row model `s` takes (its embeddings must have more rows), with its token.
    pub fn highest_row(&self, s: Source) -> Option<(u32, &str)> {
        self.highest[slot(s)].map(|(r, id)| (r, self.name(id as usize)))
    }

    /// How tensor `name` (indexed by token along its first dimension) is read for `models` —
    /// the inputs that hold it and enter the merge, base first when it does — each of whose
    /// copies has `rows_of(model)` rows of `row_len` elements.
    pub fn plan_tensor(
        self: &Arc<Self>,
        name: &str,
        models: &[Source],
        row_len: usize,
        rows_of: &dyn Fn(Source) -> usize,
    ) -> Result<VocabTensor> {
        let has = |m: Source, r: usize| self.perms[slot(m)][r] != ABSENT;
        let mut defaults = HashMap::new();
        let mut means = Vec::new();
        let mut warnings = Vec::new();
        for r in 0..self.len {
            let config = self.configs.get(&(r as u32));
            let all = models.iter().all(|&m| has(m, r));
            if all && !config.is_some_and(|c| c.1) {
                continue;
            }
            let tok = self.name(r);
            let default = match config {
                Some((Some(d), _)) => d.clone(),
                Some((None, _)) => {
                    bail!("tokenizer.tokens {tok:?}: some merged models lack it; give it a source")
                }
                None => {
                    let present: Vec<Source> =
                        models.iter().copied().filter(|&m| has(m, r)).collect();
                    match present.len() {
                        0 => {
                            warnings.push(tok.to_string());
                            RowDefault::Zero
                        }
                        1 => RowDefault::SameToken(present[0]),
                        _ if present.contains(&Source::Base) => RowDefault::SameToken(Source::Base),
                        _ => {
                            let at = means.len() as u32;
                            means.extend(present.iter().map(|&m| (m, self.perms[slot(m)][r])));
                            RowDefault::Mean(at, means.len() as u32)
                        }
                    }
                }
            };
            // A named model's row: that model must enter this tensor's merge and hold the row.
            let enters = |s: Source| -> Result<()> {
                ensure!(
                    models.contains(&s),
                    "token {tok:?} takes its row of '{name}' from {}, which does not enter that \
                     tensor's merge",
                    self.describe(s)
                );
                Ok(())
            };
            let resolved = match default {
                RowDefault::SameToken(s) => {
                    enters(s)?;
                    ensure!(
                        has(s, r),
                        "token {tok:?} takes its row from {}, whose vocabulary lacks it",
                        self.describe(s)
                    );
                    RowDefault::Row(s, self.perms[slot(s)][r])
                }
                RowDefault::Row(s, row) => {
                    enters(s)?;
                    ensure!(
                        (row as usize) < rows_of(s),
                        "token {tok:?} takes row {row} of '{name}' in {}, which has {} rows",
                        self.describe(s),
                        rows_of(s)
                    );
                    RowDefault::Row(s, row)
                }
                d => d,
            };
            defaults.insert(r as u32, resolved);
        }
        for &m in models {
            if let Some((row, tok)) = self.highest_row(m) {
                ensure!(
                    (row as usize) < rows_of(m),
                    "tensor '{name}' of {} has {} rows, but its tokenizer puts token {tok:?} at \
                     id {row}",
                    self.describe(m),
                    rows_of(m)
                );
            }
        }
        let pad_means = (0..self.perms.len()).map(|_| Mutex::new(None)).collect();
        Ok(VocabTensor {
            vocabulary: self.clone(),
            row_len,
            defaults,
            means,
            pad_means,
            missing_everywhere: warnings,
        })
    }

    /// Whether every model in `models` keeps its own rows in their order, `rows_of` each: the
    /// tensor is then read as it is.
    pub fn keeps_rows(
        &self,
        t: &VocabTensor,
        models: &[Source],
        rows_of: &dyn Fn(Source) -> usize,
    ) -> bool {
        t.defaults.is_empty()
            && self.rows == self.len
            && models.iter().all(|&m| {
                rows_of(m) == self.rows
                    && self.perms[slot(m)]
                        .iter()
                        .enumerate()
                        .all(|(i, &r)| r as usize == i)
            })
    }

    fn describe(&self, s: Source) -> String {
        let dir = self.dirs[slot(s)].display();
        match s {
            Source::Base => format!("the base {dir}"),
            Source::Agent(_) => dir.to_string(),
        }
    }
}

/// Each model's vocab_size, the base's first: its config's (a LoRA agent's is its base's), else
/// its tokenizer's size. An agent without tokenizer.json is taken to have the base's, with a warning.
fn vocab_sizes(
    base_dir: &Path,
    agents: &[ModelFolder],
    warnings: &mut Vec<String>,
) -> Result<Vec<usize>> {
    ensure!(
        base_dir.join("tokenizer.json").is_file(),
        "a tokenizer source needs the base's tokenizer.json, and {} has none",
        base_dir.display()
    );
    for a in agents {
        if a.lora.is_none() && tokenizer_dir(a, base_dir) == base_dir {
            warnings.push(format!(
                "{} has no tokenizer.json; its vocabulary is taken to be the base's",
                a.dir.display()
            ));
        }
    }
    let size_of = |config_dir: &Path, tok_dir: &Path| -> Result<usize> {
        let config = crate::model_config::ModelConfig::read(config_dir).ok();
        if let Some(n) = config.as_ref().and_then(|c| config_vocab_size(c.json())) {
            return Ok(n);
        }
        let s = scan(tok_dir, &mut |_, _| {})?.context("its tokenizer.json is gone")?;
        Ok(s.entries + s.added.len())
    };
    let mut sizes = vec![size_of(base_dir, base_dir)?];
    for a in agents {
        let config_dir = if a.lora.is_some() {
            base_dir
        } else {
            a.config_dir()
        };
        sizes.push(size_of(config_dir, tokenizer_dir(a, base_dir))?);
    }
    Ok(sizes)
}

/// Each model's map to the output's ids (the base's first) and its highest row: from the base's
/// tokenizer (`from_base`), the base's `base_len` tokens keep their ids; an agent with the base's
/// tokenizer and size shares its map.
#[allow(clippy::type_complexity)]
fn maps_to_output(
    out: &Tokenizer,
    from_base: bool,
    base_len: usize,
    base_dir: &Path,
    agents: &[ModelFolder],
    vocab_sizes: &[usize],
) -> Result<(Vec<Vec<u32>>, Vec<Option<(u32, u32)>>)> {
    let n = out.vocab.len();
    let (base_perm, base_highest) = if from_base {
        let mut perm = vec![ABSENT; n];
        perm.iter_mut()
            .take(base_len)
            .enumerate()
            .for_each(|(i, p)| *p = i as u32);
        let last = base_len.checked_sub(1).map(|l| (l as u32, l as u32));
        (perm, last)
    } else {
        out.map_of(base_dir, vocab_sizes[0])?
    };
    let mut perms = vec![base_perm];
    let mut highest = vec![base_highest];
    for (t, a) in agents.iter().enumerate() {
        let dir = tokenizer_dir(a, base_dir);
        if dir == base_dir && vocab_sizes[t + 1] == vocab_sizes[0] {
            perms.push(perms[0].clone());
            highest.push(highest[0]);
        } else {
            let (p, h) = out.map_of(dir, vocab_sizes[t + 1])?;
            perms.push(p);
            highest.push(h);
        }
    }
    Ok((perms, highest))
}

/// Each `tokenizer.tokens` entry's output id, with its default row and whether it is forced.
fn token_configs(
    settings: &TokenizerSettings,
    out: &Tokenizer,
    base_dir: &Path,
    agents: &[ModelFolder],
) -> Result<HashMap<u32, (Option<RowDefault>, bool)>> {
    let mut configs = HashMap::new();
    for t in &settings.tokens {
        let what = format!("tokenizer.tokens {:?}", t.token);
        let default = match &t.source {
            None => None,
            Some(source) => Some(row_default(source, base_dir, agents, &what)?),
        };
        let id = *out
            .vocab
            .get(&t.token)
            .with_context(|| format!("{what}: an empty token cannot be added"))?;
        configs.insert(id, (default, t.force));
    }
    Ok(configs)
}

/// Which merged model `p` is (`what` names the setting, for the message).
fn source_of(p: &Path, base_dir: &Path, agents: &[ModelFolder], what: &str) -> Result<Source> {
    let r = real(p);
    if r == real(base_dir) {
        return Ok(Source::Base);
    }
    agents
        .iter()
        .position(|a| real(&a.dir) == r)
        .map(Source::Agent)
        .with_context(|| {
            format!(
                "{what} names {}, which is not one of the merged models",
                p.display()
            )
        })
}

/// The default row a `tokenizer.tokens` entry asks for its token (`what` names the entry).
fn row_default(
    source: &EmbeddingSource,
    base_dir: &Path,
    agents: &[ModelFolder],
    what: &str,
) -> Result<RowDefault> {
    Ok(match source {
        EmbeddingSource::Zero => RowDefault::Zero,
        EmbeddingSource::Model(p) => RowDefault::SameToken(source_of(p, base_dir, agents, what)?),
        EmbeddingSource::ModelToken {
            model,
            token,
            token_id,
        } => {
            let s = source_of(model, base_dir, agents, what)?;
            let row = match (token, token_id) {
                (Some(tok), None) => {
                    let dir = match s {
                        Source::Base => base_dir,
                        Source::Agent(t) => tokenizer_dir(&agents[t], base_dir),
                    };
                    token_id_in(dir, tok, what)?
                }
                (None, Some(id)) => *id,
                _ => bail!("{what}: give the source's token or its token_id, one of them"),
            };
            RowDefault::Row(s, row as u32)
        }
    })
}

/// Token `tok`'s id in the tokenizer.json of `dir` (an added token's over the vocabulary's).
fn token_id_in(dir: &Path, tok: &str, what: &str) -> Result<usize> {
    let mut found = None;
    let scanned = scan(dir, &mut |t, id| {
        if t == tok {
            found = Some(id);
        }
    })?
    .context("its tokenizer.json is gone")?;
    if let Some(a) = scanned.added.iter().find(|a| a.content == *tok) {
        found = Some(a.id);
    }
    Ok(found.with_context(|| {
        format!(
            "{what}: token {tok:?} is not in {}'s vocabulary",
            dir.display()
        )
    })? as usize)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn folder(json: &serde_json::Value, config: Option<serde_json::Value>) -> tempfile::TempDir {
        let d = tempfile::tempdir().unwrap();
        std::fs::write(d.path().join("tokenizer.json"), json.to_string()).unwrap();
        if let Some(c) = config {
            std::fs::write(d.path().join("config.json"), c.to_string()).unwrap();
        }
        d
    }

    /// Unigram's list of [piece, score] numbers pieces by position; added tokens come with their
    /// settings; other keys are skipped unread.
    #[test]
    fn scan_reads_a_unigram_list_and_the_added_tokens() {
        let d = folder(
            &serde_json::json!({
                "version": "1.0", "normalizer": {"type": "NFKC"},
                "added_tokens": [{"id": 3, "content": "<x>", "special": true, "normalized": false}],
                "model": {"type": "Unigram", "unk_id": 0,
                          "vocab": [["<unk>", 0.0], ["▁a", -1.5], ["b", -2.0]]}
            }),
            None,
        );
        let mut seen = Vec::new();
        let s = scan(d.path(), &mut |t, id| seen.push((t.to_string(), id)))
            .unwrap()
            .unwrap();
        assert_eq!(
            seen,
            [("<unk>".into(), 0), ("▁a".into(), 1), ("b".into(), 2)]
        );
        assert_eq!((s.entries, s.added.len(), s.added[0].id), (3, 1, 3));
        assert_eq!(s.added[0].settings["special"], true);
        // Without a config, the vocabulary's size is the tokenizer's.
        assert_eq!(vocab_size_of(d.path(), &s), 4);
        assert!(scan(&d.path().join("nowhere"), &mut |_, _| {})
            .unwrap()
            .is_none());
    }

    /// The base's tokens past its config's vocab_size are stripped (they have no row); a token
    /// added with the text of a vocabulary token keeps that id; a new one takes the next.
    #[test]
    fn strip_and_add_number_tokens_as_the_tokenizers_library() {
        let d = folder(
            &serde_json::json!({
                "added_tokens": [{"id": 3, "content": "<pad>", "special": true}],
                "model": {"vocab": {"a": 0, "b": 1, "ab": 2}, "merges": ["a b"]}
            }),
            Some(serde_json::json!({"vocab_size": 3})),
        );
        let (mut t, stripped) = Tokenizer::read(d.path(), true).unwrap().unwrap();
        assert!(stripped);
        assert_eq!(t.vocab.len(), 3);
        assert!(t.added.is_empty());
        assert!(t.add("b", plain_settings()));
        assert_eq!(t.vocab["b"], 1);
        assert!(t.add("<tool>", plain_settings()));
        assert_eq!(t.vocab["<tool>"], 3);
        assert!(!t.add("<tool>", plain_settings()), "added once");
    }
}
