//! Tokenizer sources (mergekit's `tokenizer_source` and `tokenizer:` section; SPEC.md §5b): the
//! output's vocabulary — the base's, another model's, or the union of all — and, for every model,
//! which of its embedding rows each output token takes. A token a model lacks takes a default
//! row: the one model that has it (donor), else the base's row, else the mean over the models that
//! have it, else zeros; the recipe may name a token's source itself. Tensors indexed by token
//! (embeddings, lm_head) are then read row-remapped ([`VocabTensor::row_from`]), so models whose
//! vocabularies differ merge token by token.

use crate::checkpoint::folder_files::read_config;
use crate::checkpoint::ModelFolder;
use crate::slices::Source;
use anyhow::{bail, ensure, Context, Result};
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};
use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

/// What a recipe asks of the output's tokenizer.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TokenizerSettings {
    pub source: TokenizerSource,
    /// `tokenizer.tokens`: tokens the output must have, and where their rows come from.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tokens: Vec<TokenSetting>,
    /// `tokenizer.pad_to_multiple_of`: rows added after the last token, each the mean row.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pad_to_multiple_of: Option<usize>,
}

/// Whose tokenizer the output takes.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TokenizerSource {
    Base,
    /// Every model's tokens: the base's, then each model's others in order.
    Union,
    /// That model's tokenizer, as it is.
    Model(PathBuf),
}

/// One entry of `tokenizer.tokens`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TokenSetting {
    pub token: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub source: Option<EmbeddingSource>,
    /// The source's row even for models that have the token.
    #[serde(default)]
    pub force: bool,
}

/// Where a token's row comes from.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum EmbeddingSource {
    /// This model's row for the same token.
    Model(PathBuf),
    /// The row of another token of a model: by its text or by its id in that model.
    ModelToken {
        model: PathBuf,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        token: Option<String>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        token_id: Option<usize>,
    },
    Zero,
}

impl TokenizerSettings {
    /// The settings with every model folder made absolute (for the record: `verify --against`
    /// runs from anywhere).
    pub fn absolute(&self) -> TokenizerSettings {
        let abs = |p: &PathBuf| std::fs::canonicalize(p).unwrap_or_else(|_| p.clone());
        let mut s = self.clone();
        if let TokenizerSource::Model(p) = &mut s.source {
            *p = abs(p);
        }
        for t in &mut s.tokens {
            match &mut t.source {
                Some(EmbeddingSource::Model(p)) => *p = abs(p),
                Some(EmbeddingSource::ModelToken { model, .. }) => *model = abs(model),
                _ => {}
            }
        }
        s
    }

    /// Every folder the settings name (an output must not overwrite them).
    pub fn folders(&self) -> Vec<PathBuf> {
        let mut v = Vec::new();
        if let TokenizerSource::Model(p) = &self.source {
            v.push(p.clone());
        }
        for t in &self.tokens {
            match &t.source {
                Some(EmbeddingSource::Model(p)) => v.push(p.clone()),
                Some(EmbeddingSource::ModelToken { model, .. }) => v.push(model.clone()),
                _ => {}
            }
        }
        v
    }
}

/// A token the tokenizer adds to its model's vocabulary, with its settings as tokenizer.json
/// keeps them (`special`, `normalized`, `lstrip`, …).
#[derive(Clone, Debug)]
struct AddedToken {
    id: usize,
    content: String,
    /// The entry's other keys, in their order.
    settings: Map<String, Value>,
}

/// A model's tokenizer as a merge needs it: its vocabulary (token → id, the added tokens among
/// them, as `get_vocab()` gives it) up to the model's vocab_size.
#[derive(Clone, Debug)]
struct Tokenizer {
    /// The folder it was read from.
    dir: PathBuf,
    vocab: HashMap<String, usize>,
    added: Vec<AddedToken>,
    /// Rows the model's embeddings hold for tokens: config.json's vocab_size, else the vocabulary's size.
    vocab_size: usize,
}

/// The tokenizer.json of `dir` (`None` when it has none).
fn read_tokenizer_json(dir: &Path) -> Result<Option<Value>> {
    let path = dir.join("tokenizer.json");
    if !path.is_file() {
        return Ok(None);
    }
    let text = std::fs::read_to_string(&path)
        .with_context(|| format!("cannot read {}", path.display()))?;
    let json: Value =
        serde_json::from_str(&text).with_context(|| format!("{}: invalid JSON", path.display()))?;
    Ok(Some(json))
}

/// config.json's vocabulary size: `vocab_size` at the top or in `text_config`.
pub fn config_vocab_size(config: &Value) -> Option<usize> {
    config
        .get("vocab_size")
        .or_else(|| config.get("text_config").and_then(|c| c.get("vocab_size")))
        .and_then(Value::as_u64)
        .map(|n| n as usize)
}

impl Tokenizer {
    fn from_json(dir: &Path, json: &Value) -> Result<Tokenizer> {
        let path = dir.join("tokenizer.json");
        let mut vocab = HashMap::new();
        match &json["model"]["vocab"] {
            Value::Object(m) => {
                for (tok, id) in m {
                    let id = id.as_u64().with_context(|| {
                        format!("{}: token {tok:?} has no integer id", path.display())
                    })?;
                    vocab.insert(tok.clone(), id as usize);
                }
            }
            Value::Array(pieces) => {
                for (id, p) in pieces.iter().enumerate() {
                    if let Some(tok) = p.get(0).and_then(Value::as_str) {
                        vocab.insert(tok.to_string(), id);
                    }
                }
            }
            _ => bail!("{}: no model.vocab", path.display()),
        }
        let mut added = Vec::new();
        for t in json["added_tokens"].as_array().into_iter().flatten() {
            let (Some(content), Some(id)) = (t["content"].as_str(), t["id"].as_u64()) else {
                bail!("{}: an added token lacks content or id", path.display());
            };
            let mut settings = t.as_object().cloned().unwrap_or_default();
            settings.remove("id");
            settings.remove("content");
            vocab.insert(content.to_string(), id as usize);
            added.push(AddedToken {
                id: id as usize,
                content: content.to_string(),
                settings,
            });
        }
        added.sort_by_key(|a| a.id);
        let config = read_config(dir).ok();
        let vocab_size = config
            .as_ref()
            .and_then(config_vocab_size)
            .unwrap_or(vocab.len());
        Ok(Tokenizer {
            dir: dir.to_path_buf(),
            vocab,
            added,
            vocab_size,
        })
    }

    /// Tokens by id, lowest first (ties by text): a deterministic order over the vocabulary.
    fn by_id(&self) -> Vec<(&str, usize)> {
        let mut v: Vec<(&str, usize)> = self.vocab.iter().map(|(t, &i)| (t.as_str(), i)).collect();
        v.sort_unstable_by(|a, b| a.1.cmp(&b.1).then(a.0.cmp(b.0)));
        v
    }

    fn is_added(&self, token: &str) -> bool {
        self.added.iter().any(|a| a.content == token)
    }
}

/// The output tokenizer's files: taken as they are from a folder, or written.
#[derive(Debug)]
pub enum TokenizerFiles {
    /// The tokenizer files of this folder, unchanged.
    CopyFrom(PathBuf),
    /// The tokenizer files of `from` with tokenizer.json (and tokenizer_config.json's
    /// `added_tokens_decoder`) rewritten.
    Rewrite {
        from: PathBuf,
        tokenizer_json: Value,
        added: Vec<(usize, String, Map<String, Value>)>,
    },
}

/// The output's vocabulary and each model's place in it.
#[derive(Debug)]
pub struct Vocabulary {
    pub settings: TokenizerSettings,
    /// Output tokens by id.
    tokens: Vec<String>,
    /// Rows of the output's embeddings: the tokens, padded to `pad_to_multiple_of`.
    pub rows: usize,
    /// For the base (0) and each agent (t + 1): output row → its own row (`ABSENT`: it lacks
    /// the token).
    perms: Vec<Vec<u32>>,
    /// The `tokenizer.tokens` settings by output row, sources resolved.
    configs: HashMap<u32, (Option<RowDefault>, bool)>,
    pub files: TokenizerFiles,
    /// The base's (0) and each agent's (t + 1) vocab_size: a model's tensors of that many rows
    /// that are embeddings or the output head are indexed by token.
    vocab_sizes: Vec<usize>,
    /// The base's and each agent's folder (for messages).
    dirs: Vec<PathBuf>,
    /// What the user should know (tokens only padding had, models without a tokenizer).
    pub warnings: Vec<String>,
}

const ABSENT: u32 = u32::MAX;

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
    pub fn build(
        settings: &TokenizerSettings,
        base: &ModelFolder,
        agents: &[ModelFolder],
    ) -> Result<Vocabulary> {
        let mut warnings = Vec::new();
        let base_json = read_tokenizer_json(&base.dir)?.with_context(|| {
            format!(
                "a tokenizer source needs the base's tokenizer.json, and {} has none",
                base.dir.display()
            )
        })?;
        let base_full = Tokenizer::from_json(&base.dir, &base_json)?;
        let (base_tok, stripped_json) = strip(&base_full, &base_json);
        // An agent without a tokenizer (a LoRA adapter, or none saved) has the base's.
        let mut models = vec![base_tok.clone()];
        for a in agents {
            let tok = match (a.lora.is_some(), read_tokenizer_json(&a.dir)?) {
                (false, Some(json)) => Tokenizer::from_json(&a.dir, &json)?,
                (lora, _) => {
                    if !lora {
                        warnings.push(format!(
                            "{} has no tokenizer.json; its vocabulary is taken to be the base's",
                            a.dir.display()
                        ));
                    }
                    Tokenizer {
                        dir: a.dir.clone(),
                        ..base_tok.clone()
                    }
                }
            };
            models.push(tok);
        }
        let source_of = |p: &Path, what: &str| -> Result<Source> {
            let r = real(p);
            if r == real(&base.dir) {
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
        };
        // The output tokenizer.
        let (mut out, files_from, mut rewrite, mut json) = match &settings.source {
            TokenizerSource::Base => (
                base_tok.clone(),
                base.dir.clone(),
                stripped_json.is_some(),
                stripped_json.unwrap_or(base_json),
            ),
            TokenizerSource::Model(p) => {
                let json = read_tokenizer_json(p)?.with_context(|| {
                    format!("tokenizer source {} has no tokenizer.json", p.display())
                })?;
                (Tokenizer::from_json(p, &json)?, p.clone(), false, json)
            }
            TokenizerSource::Union => {
                let mut json = stripped_json.unwrap_or(base_json);
                let mut out = base_tok.clone();
                union(&mut out, &mut json, &models, &mut warnings);
                (out, base.dir.clone(), true, json)
            }
        };
        for t in &settings.tokens {
            if !out.vocab.contains_key(&t.token) {
                add_token(&mut out, &mut json, &t.token, plain_settings());
                rewrite = true;
            }
        }
        // Output tokens by id, which must run 0..n without a gap.
        let n = out.vocab.len();
        let mut tokens = vec![String::new(); n];
        for (tok, &id) in &out.vocab {
            ensure!(
                id < n,
                "{}/tokenizer.json: token {tok:?} has id {id}, but the vocabulary has {n} tokens \
                 (ids with gaps cannot index embedding rows)",
                out.dir.display()
            );
            tokens[id] = tok.clone();
        }
        let rows = match settings.pad_to_multiple_of {
            Some(m) if m > 0 => n.div_ceil(m) * m,
            _ => n,
        };
        let perms = models
            .iter()
            .map(|m| {
                tokens
                    .iter()
                    .map(|tok| match m.vocab.get(tok) {
                        Some(&i) if i < m.vocab_size => i as u32,
                        _ => ABSENT,
                    })
                    .collect()
            })
            .collect();
        let mut configs = HashMap::new();
        for t in &settings.tokens {
            let what = format!("tokenizer.tokens {:?}", t.token);
            let default = match &t.source {
                None => None,
                Some(EmbeddingSource::Zero) => Some(RowDefault::Zero),
                Some(EmbeddingSource::Model(p)) => {
                    Some(RowDefault::SameToken(source_of(p, &what)?))
                }
                Some(EmbeddingSource::ModelToken {
                    model,
                    token,
                    token_id,
                }) => {
                    let s = source_of(model, &what)?;
                    let m = &models[slot(s)];
                    let row = match (token, token_id) {
                        (Some(tok), None) => *m.vocab.get(tok).with_context(|| {
                            format!(
                                "{what}: token {tok:?} is not in {}'s vocabulary",
                                m.dir.display()
                            )
                        })?,
                        (None, Some(id)) => *id,
                        _ => bail!("{what}: give the source's token or its token_id, one of them"),
                    };
                    Some(RowDefault::Row(s, row as u32))
                }
            };
            configs.insert(out.vocab[&t.token] as u32, (default, t.force));
        }
        let files = if rewrite {
            let added = out
                .added
                .iter()
                .map(|a| (a.id, a.content.clone(), a.settings.clone()))
                .collect();
            TokenizerFiles::Rewrite {
                from: files_from,
                tokenizer_json: json,
                added,
            }
        } else {
            TokenizerFiles::CopyFrom(files_from)
        };
        Ok(Vocabulary {
            settings: settings.clone(),
            tokens,
            rows,
            perms,
            configs,
            files,
            vocab_sizes: models.iter().map(|m| m.vocab_size).collect(),
            dirs: models.iter().map(|m| m.dir.clone()).collect(),
            warnings,
        })
    }

    /// Model `s`'s vocab_size (config.json's, else its tokenizer's size).
    pub fn vocab_size(&self, s: Source) -> usize {
        self.vocab_sizes[slot(s)]
    }

    /// Tokens of the output vocabulary.
    pub fn len(&self) -> usize {
        self.tokens.len()
    }

    pub fn is_empty(&self) -> bool {
        self.tokens.is_empty()
    }

    /// The highest own row model `s` takes (its embeddings must have more rows), with its token.
    pub fn highest_row(&self, s: Source) -> Option<(u32, &str)> {
        self.perms[slot(s)]
            .iter()
            .enumerate()
            .filter(|(_, &r)| r != ABSENT)
            .max_by_key(|(_, &r)| r)
            .map(|(i, &r)| (r, self.tokens[i].as_str()))
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
        for (r, tok) in self.tokens.iter().enumerate() {
            let config = self.configs.get(&(r as u32));
            let all = models.iter().all(|&m| has(m, r));
            if all && !config.is_some_and(|c| c.1) {
                continue;
            }
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
                            warnings.push(tok.clone());
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
            let resolved = match default {
                RowDefault::SameToken(s) => {
                    ensure!(
                        models.contains(&s),
                        "token {tok:?} takes its row of '{name}' from {}, which does not enter \
                         that tensor's merge",
                        self.describe(s)
                    );
                    ensure!(
                        has(s, r),
                        "token {tok:?} takes its row from {}, whose vocabulary lacks it",
                        self.describe(s)
                    );
                    RowDefault::Row(s, self.perms[slot(s)][r])
                }
                RowDefault::Row(s, row) => {
                    ensure!(
                        models.contains(&s),
                        "token {tok:?} takes its row of '{name}' from {}, which does not enter \
                         that tensor's merge",
                        self.describe(s)
                    );
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
            && self.rows == self.len()
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

    /// Writes the output tokenizer's files into `out` (those [`crate::checkpoint::folder_files`]
    /// copies from a model) and returns their names.
    pub fn write_files(&self, out: &Path) -> Result<Vec<String>> {
        let (from, rewrite) = match &self.files {
            TokenizerFiles::CopyFrom(d) => (d, None),
            TokenizerFiles::Rewrite {
                from,
                tokenizer_json,
                added,
            } => (from, Some((tokenizer_json, added))),
        };
        let mut written = Vec::new();
        for name in crate::checkpoint::folder_files::TOKENIZER_FILES {
            let src = from.join(name);
            let dst = out.join(name);
            match (rewrite, *name) {
                (Some((json, _)), "tokenizer.json") => {
                    std::fs::write(&dst, serde_json::to_string_pretty(json)? + "\n")
                        .with_context(|| format!("cannot write {}", dst.display()))?;
                }
                (Some((_, added)), "tokenizer_config.json") if src.is_file() => {
                    let text = std::fs::read_to_string(&src)
                        .with_context(|| format!("cannot read {}", src.display()))?;
                    let mut config: Value = serde_json::from_str(&text)
                        .with_context(|| format!("{}: invalid JSON", src.display()))?;
                    if let Some(obj) = config.as_object_mut() {
                        let decoder: Map<String, Value> = added
                            .iter()
                            .map(|(id, content, settings)| {
                                let mut e = Map::new();
                                e.insert("content".into(), content.clone().into());
                                for (k, v) in settings {
                                    e.insert(k.clone(), v.clone());
                                }
                                (id.to_string(), Value::Object(e))
                            })
                            .collect();
                        obj.insert("added_tokens_decoder".into(), Value::Object(decoder));
                    }
                    std::fs::write(&dst, serde_json::to_string_pretty(&config)? + "\n")
                        .with_context(|| format!("cannot write {}", dst.display()))?;
                }
                // Files that list the vocabulary themselves would contradict the new one.
                (
                    Some(_),
                    "vocab.json" | "merges.txt" | "added_tokens.json" | "tokenizer.model",
                ) => continue,
                _ => {
                    if !src.is_file() {
                        continue;
                    }
                    std::fs::copy(&src, &dst).with_context(|| {
                        format!("cannot copy {} to {}", src.display(), dst.display())
                    })?;
                }
            }
            written.push(name.to_string());
        }
        Ok(written)
    }

    /// Sets the vocabulary size of an output config.json to the output's rows.
    pub fn set_config_vocab_size(&self, config: &mut Value) {
        let rows = Value::from(self.rows as u64);
        let nested = config.get("vocab_size").is_none()
            && config
                .get("text_config")
                .is_some_and(|c| c.get("vocab_size").is_some());
        if nested {
            config["text_config"]["vocab_size"] = rows;
        } else if let Some(obj) = config.as_object_mut() {
            obj.insert("vocab_size".into(), rows);
        }
    }
}

/// The base tokenizer with the tokens at or past its vocab_size removed (they have no row), as
/// mergekit strips it; the rewritten tokenizer.json when any was.
fn strip(tok: &Tokenizer, json: &Value) -> (Tokenizer, Option<Value>) {
    let unused: HashSet<&str> = tok
        .vocab
        .iter()
        .filter(|(_, &i)| i >= tok.vocab_size)
        .map(|(t, _)| t.as_str())
        .collect();
    if unused.is_empty() {
        return (tok.clone(), None);
    }
    let mut json = json.clone();
    if let Some(vocab) = json["model"]["vocab"].as_object_mut() {
        vocab.retain(|t, _| !unused.contains(t.as_str()));
    }
    if let Some(added) = json["added_tokens"].as_array_mut() {
        added.retain(|e| {
            e["id"]
                .as_u64()
                .is_some_and(|i| (i as usize) < tok.vocab_size)
        });
    }
    if let Some(merges) = json["model"]["merges"].as_array_mut() {
        merges.retain(|m| {
            let parts: Vec<&str> = match m {
                Value::String(s) => s.split(' ').collect(),
                Value::Array(a) => a.iter().filter_map(Value::as_str).collect(),
                _ => Vec::new(),
            };
            !parts.iter().any(|p| unused.contains(p))
        });
    }
    let mut out = tok.clone();
    out.vocab.retain(|_, i| *i < tok.vocab_size);
    out.added.retain(|a| a.id < tok.vocab_size);
    (out, Some(json))
}

/// The settings of a token added as plain text (not special), as the tokenizers library gives
/// them.
fn plain_settings() -> Map<String, Value> {
    let mut m = Map::new();
    m.insert("single_word".into(), false.into());
    m.insert("lstrip".into(), false.into());
    m.insert("rstrip".into(), false.into());
    m.insert("normalized".into(), true.into());
    m.insert("special".into(), false.into());
    m
}

/// Adds `content` to `out` as an added token (the next id, or its id when the vocabulary
/// already has it) and to tokenizer.json's `added_tokens`.
fn add_token(out: &mut Tokenizer, json: &mut Value, content: &str, settings: Map<String, Value>) {
    if content.is_empty() || out.is_added(content) {
        return;
    }
    let id = match out.vocab.get(content) {
        Some(&id) => id,
        None => out.vocab.values().max().map_or(0, |m| m + 1),
    };
    out.vocab.insert(content.to_string(), id);
    out.added.push(AddedToken {
        id,
        content: content.to_string(),
        settings: settings.clone(),
    });
    let mut entry = Map::new();
    entry.insert("id".into(), id.into());
    entry.insert("content".into(), content.into());
    for (k, v) in settings {
        entry.insert(k, v);
    }
    if !json["added_tokens"].is_array() {
        json["added_tokens"] = Value::Array(Vec::new());
    }
    json["added_tokens"]
        .as_array_mut()
        .expect("just made an array")
        .push(Value::Object(entry));
}

/// mergekit's union: the base's tokens, then each model's other tokens in model order (regular
/// tokens by id, as plain added tokens), then every model's added tokens with the settings of
/// the first model that has them.
fn union(out: &mut Tokenizer, json: &mut Value, models: &[Tokenizer], warnings: &mut Vec<String>) {
    let mut regular: Vec<&str> = Vec::new();
    let mut seen: HashSet<&str> = HashSet::new();
    let mut added: Vec<&AddedToken> = Vec::new();
    let mut added_seen: HashMap<&str, &AddedToken> = HashMap::new();
    for m in models {
        for (tok, id) in m.by_id() {
            if id >= m.vocab_size || m.is_added(tok) {
                continue;
            }
            if seen.insert(tok) {
                regular.push(tok);
            }
        }
        for a in &m.added {
            if a.id >= m.vocab_size {
                continue;
            }
            match added_seen.get(a.content.as_str()) {
                Some(first) => {
                    if first.settings != a.settings {
                        warnings.push(format!(
                            "token {:?} is added with other settings by {}; the first model's are kept",
                            a.content,
                            m.dir.display()
                        ));
                    }
                }
                None => {
                    added_seen.insert(&a.content, a);
                    added.push(a);
                }
            }
        }
    }
    let base_vocab: HashSet<String> = out.vocab.keys().cloned().collect();
    for tok in regular {
        if added_seen.contains_key(tok) || base_vocab.contains(tok) {
            continue;
        }
        add_token(out, json, tok, plain_settings());
    }
    for a in added {
        add_token(out, json, &a.content, a.settings.clone());
    }
}

/// How a token-indexed tensor is read for each model (see [`Vocabulary::plan_tensor`]).
#[derive(Debug)]
pub struct VocabTensor {
    vocabulary: Arc<Vocabulary>,
    pub row_len: usize,
    /// Default rows by output row, for the tokens some model lacks (or forced).
    defaults: HashMap<u32, RowDefault>,
    /// The (model, row) lists that [`RowDefault::Mean`] ranges index.
    means: Vec<(Source, u32)>,
    /// Each input's mean row (base first), for padding rows; made on first use.
    pad_means: Vec<Mutex<Option<Arc<[f32]>>>>,
    /// Tokens no model entering this tensor has (zero rows).
    pub missing_everywhere: Vec<String>,
}

/// Where one output row of one model comes from.
#[derive(Debug, PartialEq)]
pub enum RowFrom<'a> {
    /// Row `row` of model `source`'s tensor.
    Row(Source, u32),
    Zero,
    /// The mean of these rows (an f32 sum in order, then one division, as mergekit does).
    Mean(&'a [(Source, u32)]),
    /// A padding row: the mean of the model's token rows.
    Pad,
}

impl VocabTensor {
    /// Output rows.
    pub fn rows(&self) -> usize {
        self.vocabulary.rows
    }

    /// Token rows (the rest are padding).
    pub fn token_rows(&self) -> usize {
        self.vocabulary.len()
    }

    /// Where model `m`'s output row `r` comes from.
    pub fn row_from(&self, m: Source, r: usize) -> RowFrom<'_> {
        if r >= self.vocabulary.len() {
            return RowFrom::Pad;
        }
        let own = self.vocabulary.perms[slot(m)][r];
        let forced = self
            .vocabulary
            .configs
            .get(&(r as u32))
            .is_some_and(|c| c.1);
        if own != ABSENT && !forced {
            return RowFrom::Row(m, own);
        }
        match self.defaults.get(&(r as u32)) {
            Some(RowDefault::Row(s, row)) => RowFrom::Row(*s, *row),
            Some(RowDefault::Mean(a, b)) => RowFrom::Mean(&self.means[*a as usize..*b as usize]),
            // Zero, or no default (the token only in models that are not merged here).
            _ => RowFrom::Zero,
        }
    }

    /// Model `m`'s padding row, computed by `compute` on first use.
    pub fn pad_mean(
        &self,
        m: Source,
        compute: impl FnOnce() -> Result<Vec<f32>>,
    ) -> Result<Arc<[f32]>> {
        let cell = &self.pad_means[slot(m)];
        let mut guard = cell.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(v) = guard.as_ref() {
            return Ok(v.clone());
        }
        let v: Arc<[f32]> = compute()?.into();
        *guard = Some(v.clone());
        Ok(v)
    }
}

/// Reads a `tokenizer_source` value or the `tokenizer:` section's `source` as a user writes it:
/// `base`, `union`, or a model (`model:NAME` or NAME), found by `folder`.
pub fn parse_source(
    text: &str,
    folder: &dyn Fn(&str) -> Result<PathBuf>,
) -> Result<TokenizerSource> {
    Ok(match text {
        "base" => TokenizerSource::Base,
        "union" => TokenizerSource::Union,
        name => TokenizerSource::Model(folder(name.strip_prefix("model:").unwrap_or(name))?),
    })
}
