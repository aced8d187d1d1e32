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
#[derive(Clone, Debug, Deserialize)]
struct AddedToken {
    id: u32,
    content: String,
    /// The entry's other keys.
    #[serde(flatten)]
    settings: Map<String, Value>,
}

/// A model's tokenizer as a merge needs it: its vocabulary (token → id, the added tokens among
/// them, as `get_vocab()` gives it) up to the model's vocab_size. Read from tokenizer.json
/// straight into the map (a 150,000-token vocabulary is some 10 MB here, far more as a JSON tree).
#[derive(Clone, Debug)]
struct Tokenizer {
    /// The folder it was read from.
    dir: PathBuf,
    vocab: HashMap<String, u32>,
    added: Vec<AddedToken>,
    /// Rows the model's embeddings hold for tokens: config.json's vocab_size, else the vocabulary's size.
    vocab_size: usize,
}

/// The parts of tokenizer.json a merge reads.
#[derive(Deserialize)]
struct TokenizerFile {
    model: ModelPart,
    #[serde(default)]
    added_tokens: Vec<AddedToken>,
}

#[derive(Deserialize)]
struct ModelPart {
    vocab: VocabPart,
}

/// `model.vocab`: a map (BPE, WordPiece, WordLevel) or Unigram's list of [piece, score].
struct VocabPart(HashMap<String, u32>);

impl<'de> Deserialize<'de> for VocabPart {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        struct Visit;
        impl<'de> serde::de::Visitor<'de> for Visit {
            type Value = VocabPart;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a map of token to id, or a list of [token, score]")
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(
                self,
                mut map: A,
            ) -> std::result::Result<VocabPart, A::Error> {
                let mut v = HashMap::with_capacity(map.size_hint().unwrap_or(0));
                while let Some((tok, id)) = map.next_entry::<String, u32>()? {
                    v.insert(tok, id);
                }
                Ok(VocabPart(v))
            }
            fn visit_seq<A: serde::de::SeqAccess<'de>>(
                self,
                mut seq: A,
            ) -> std::result::Result<VocabPart, A::Error> {
                let mut v = HashMap::with_capacity(seq.size_hint().unwrap_or(0));
                while let Some((tok, _score)) = seq.next_element::<(String, f64)>()? {
                    let id = v.len() as u32;
                    v.entry(tok).or_insert(id);
                }
                Ok(VocabPart(v))
            }
        }
        d.deserialize_any(Visit)
    }
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
    /// The tokenizer of `dir` (`None`: it has no tokenizer.json).
    fn read(dir: &Path) -> Result<Option<Tokenizer>> {
        let path = dir.join("tokenizer.json");
        if !path.is_file() {
            return Ok(None);
        }
        let file = std::fs::File::open(&path)
            .with_context(|| format!("cannot read {}", path.display()))?;
        let parsed: TokenizerFile = serde_json::from_reader(std::io::BufReader::new(file))
            .with_context(|| {
                format!("{}: not a tokenizer.json rlmerge can read", path.display())
            })?;
        let mut vocab = parsed.model.vocab.0;
        let mut added = parsed.added_tokens;
        for a in &added {
            vocab.insert(a.content.clone(), a.id);
        }
        added.sort_by_key(|a| a.id);
        let vocab_size = read_config(dir)
            .ok()
            .as_ref()
            .and_then(config_vocab_size)
            .unwrap_or(vocab.len());
        Ok(Some(Tokenizer {
            dir: dir.to_path_buf(),
            vocab,
            added,
            vocab_size,
        }))
    }

    /// Model `m`'s tokenizer: its own, or — a LoRA agent, or a folder without tokenizer.json —
    /// the base's (`None`).
    fn of_model(m: &ModelFolder) -> Result<Option<Tokenizer>> {
        if m.lora.is_some() {
            return Ok(None);
        }
        Tokenizer::read(&m.dir)
    }

    /// Tokens by id, lowest first (ties by text): a deterministic order over the vocabulary.
    fn by_id(&self) -> Vec<(&str, u32)> {
        let mut v: Vec<(&str, u32)> = self.vocab.iter().map(|(t, &i)| (t.as_str(), i)).collect();
        v.sort_unstable_by(|a, b| a.1.cmp(&b.1).then(a.0.cmp(b.0)));
        v
    }

    fn is_added(&self, token: &str) -> bool {
        self.added.iter().any(|a| a.content == token)
    }

    /// Removes the tokens at or past vocab_size (they have no row), as mergekit strips the
    /// base's tokenizer; whether any was.
    fn strip(&mut self) -> bool {
        let n = self.vocab_size;
        let before = self.vocab.len();
        self.vocab.retain(|_, i| (*i as usize) < n);
        self.added.retain(|a| (a.id as usize) < n);
        self.vocab.len() != before
    }

    /// Adds `content` as an added token: the next id, or its id when the vocabulary already has
    /// it (as the tokenizers library does). Returns whether it is new to the added tokens.
    fn add(&mut self, content: &str, settings: Map<String, Value>) -> bool {
        if content.is_empty() || self.is_added(content) {
            return false;
        }
        let id = match self.vocab.get(content) {
            Some(&id) => id,
            None => self.vocab.values().max().map_or(0, |m| m + 1),
        };
        self.vocab.insert(content.to_string(), id);
        self.added.push(AddedToken {
            id,
            content: content.to_string(),
            settings,
        });
        true
    }
}

/// The output tokenizer's files: taken as they are from a folder, or that folder's with
/// tokenizer.json and tokenizer_config.json rewritten (written when the merge is done, from the
/// source's files, so no JSON tree is held during the merge).
#[derive(Debug)]
enum TokenizerFiles {
    CopyFrom(PathBuf),
    Rewrite {
        from: PathBuf,
        /// Tokens at or past this id are dropped (the base's vocab_size, when it strips any).
        strip_from: Option<u32>,
        /// Added tokens appended to tokenizer.json's, in order.
        appended: Vec<AddedToken>,
        /// Every added token of the output (tokenizer_config.json's `added_tokens_decoder`).
        added: Vec<AddedToken>,
    },
}

/// The output's vocabulary and each model's place in it.
#[derive(Debug)]
pub struct Vocabulary {
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
    /// Each model's highest own row and its token (its embeddings must have more rows).
    highest: Vec<Option<(u32, String)>>,
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
    /// One model's vocabulary is held at a time beside the output's (each tokenizer.json is read
    /// twice at most).
    pub fn build(
        settings: &TokenizerSettings,
        base: &ModelFolder,
        agents: &[ModelFolder],
    ) -> Result<Vocabulary> {
        let mut warnings = Vec::new();
        let mut base_tok = Tokenizer::read(&base.dir)?.with_context(|| {
            format!(
                "a tokenizer source needs the base's tokenizer.json, and {} has none",
                base.dir.display()
            )
        })?;
        let base_strips = base_tok.strip();
        let mut vocab_sizes = vec![base_tok.vocab_size];
        for a in agents {
            let own = Tokenizer::of_model(a)?;
            if own.is_none() && a.lora.is_none() {
                warnings.push(format!(
                    "{} has no tokenizer.json; its vocabulary is taken to be the base's",
                    a.dir.display()
                ));
            }
            vocab_sizes.push(own.map_or(base_tok.vocab_size, |t| t.vocab_size));
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
        // The output tokenizer, and the added tokens its tokenizer.json gains. From the base's,
        // the base's tokens keep their ids; from another model's, the base's map is kept.
        let base_len = base_tok.vocab.len();
        let base_vocab_size = base_tok.vocab_size;
        let added_before;
        let (mut out, files_from, mut rewrite, base_map) = match &settings.source {
            TokenizerSource::Base => {
                added_before = base_tok.added.len();
                (base_tok, base.dir.clone(), base_strips, None)
            }
            TokenizerSource::Model(p) => {
                let t = Tokenizer::read(p)?.with_context(|| {
                    format!("tokenizer source {} has no tokenizer.json", p.display())
                })?;
                added_before = t.added.len();
                (t, p.clone(), false, Some(base_tok))
            }
            TokenizerSource::Union => {
                added_before = base_tok.added.len();
                let mut out = base_tok;
                union(&mut out, agents, &mut warnings)?;
                (out, base.dir.clone(), true, None)
            }
        };
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
        // Each model's map to the output, its vocabulary read again (the base's once for all
        // models that share it).
        let perm_of = |m: &Tokenizer| -> (Vec<u32>, Option<(u32, String)>) {
            let mut perm = vec![ABSENT; n];
            let mut highest: Option<(u32, &str)> = None;
            for (tok, &id) in &out.vocab {
                if let Some(&own) = m.vocab.get(tok) {
                    if (own as usize) < m.vocab_size {
                        perm[id as usize] = own;
                        if highest.is_none_or(|(h, _)| own > h) {
                            highest = Some((own, tok));
                        }
                    }
                }
            }
            (perm, highest.map(|(r, t)| (r, t.to_string())))
        };
        let (base_perm, base_highest) = match &base_map {
            Some(b) => perm_of(b),
            None => {
                // The base's tokens at their own ids.
                let mut perm = vec![ABSENT; n];
                perm.iter_mut()
                    .take(base_len)
                    .enumerate()
                    .for_each(|(i, p)| *p = i as u32);
                let last = base_len.checked_sub(1).and_then(|l| {
                    let tok = out.vocab.iter().find(|(_, &id)| id as usize == l)?.0;
                    Some((l as u32, tok.clone()))
                });
                (perm, last)
            }
        };
        drop(base_map);
        let mut perms = vec![base_perm];
        let mut highest = vec![base_highest];
        for a in agents {
            match Tokenizer::of_model(a)? {
                Some(t) => {
                    let (p, h) = perm_of(&t);
                    perms.push(p);
                    highest.push(h);
                }
                None => {
                    perms.push(perms[0].clone());
                    highest.push(highest[0].clone());
                }
            }
        }
        // The base's vocabulary, read again where a token names a row by its text.
        let base_again = || -> Result<Tokenizer> {
            let mut t = Tokenizer::read(&base.dir)?.context("the base's tokenizer.json is gone")?;
            t.strip();
            Ok(t)
        };
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
                    let row = match (token, token_id) {
                        (Some(tok), None) => {
                            let m = match s {
                                Source::Base => None,
                                Source::Agent(t) => Tokenizer::of_model(&agents[t])?,
                            };
                            let m = match m {
                                Some(m) => m,
                                None => base_again()?,
                            };
                            *m.vocab.get(tok).with_context(|| {
                                format!(
                                    "{what}: token {tok:?} is not in {}'s vocabulary",
                                    m.dir.display()
                                )
                            })? as usize
                        }
                        (None, Some(id)) => *id,
                        _ => bail!("{what}: give the source's token or its token_id, one of them"),
                    };
                    Some(RowDefault::Row(s, row as u32))
                }
            };
            configs.insert(out.vocab[&t.token], (default, t.force));
        }
        // Names of the rows that may need a default.
        let names = out
            .vocab
            .iter()
            .filter(|(_, &id)| {
                configs.contains_key(&id) || perms.iter().any(|p| p[id as usize] == ABSENT)
            })
            .map(|(t, &id)| (id, t.clone()))
            .collect();
        let files = if rewrite {
            TokenizerFiles::Rewrite {
                from: files_from,
                strip_from: (base_strips && !matches!(settings.source, TokenizerSource::Model(_)))
                    .then_some(base_vocab_size as u32),
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

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The text of output row `r` (rows some model lacks or `tokens` names).
    fn name(&self, r: usize) -> &str {
        self.names.get(&(r as u32)).map_or("?", String::as_str)
    }

    /// The highest own row model `s` takes (its embeddings must have more rows), with its token.
    pub fn highest_row(&self, s: Source) -> Option<(u32, &str)> {
        self.highest[slot(s)]
            .as_ref()
            .map(|(r, t)| (*r, t.as_str()))
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

    /// Writes the output tokenizer's files into `out` (those [`crate::checkpoint::folder_files`]
    /// copies from a model) and returns their names.
    pub fn write_files(&self, out: &Path) -> Result<Vec<String>> {
        let (from, rewrite) = match &self.files {
            TokenizerFiles::CopyFrom(d) => (d, None),
            TokenizerFiles::Rewrite {
                from,
                strip_from,
                appended,
                added,
            } => (from, Some((strip_from, appended, added))),
        };
        let mut written = Vec::new();
        for name in crate::checkpoint::folder_files::TOKENIZER_FILES {
            let src = from.join(name);
            let dst = out.join(name);
            match (rewrite, *name) {
                (Some((strip, appended, _)), "tokenizer.json") => {
                    write_tokenizer_json(&src, &dst, *strip, appended)?
                }
                (Some((_, _, added)), "tokenizer_config.json") if src.is_file() => {
                    let text = std::fs::read_to_string(&src)
                        .with_context(|| format!("cannot read {}", src.display()))?;
                    let mut config: Value = serde_json::from_str(&text)
                        .with_context(|| format!("{}: invalid JSON", src.display()))?;
                    if let Some(obj) = config.as_object_mut() {
                        let decoder: Map<String, Value> = added
                            .iter()
                            .map(|a| (a.id.to_string(), added_entry(a, false)))
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

/// mergekit's union, into `out` (the base's): every agent's regular tokens the base lacks, in
/// model order (each by id), as plain added tokens; then every model's added tokens (the base's
/// first), with the settings of the first model that adds each. Agents are read one at a
/// time; one without a tokenizer (LoRA) has the base's and adds nothing.
fn union(out: &mut Tokenizer, agents: &[ModelFolder], warnings: &mut Vec<String>) -> Result<()> {
    let mut regular: Vec<String> = Vec::new();
    let mut regular_seen: HashSet<String> = HashSet::new();
    // The base's added tokens first (its regular ones are in `out` already).
    let mut added: Vec<AddedToken> = out.added.clone();
    let mut added_seen: HashMap<String, usize> = added
        .iter()
        .enumerate()
        .map(|(i, a)| (a.content.clone(), i))
        .collect();
    let mut take = |m: &Tokenizer| {
        let own_added: HashSet<&str> = m.added.iter().map(|a| a.content.as_str()).collect();
        for (tok, id) in m.by_id() {
            if id as usize >= m.vocab_size || own_added.contains(tok) || out.vocab.contains_key(tok)
            {
                continue;
            }
            if regular_seen.insert(tok.to_string()) {
                regular.push(tok.to_string());
            }
        }
        for a in &m.added {
            if a.id as usize >= m.vocab_size {
                continue;
            }
            match added_seen.get(&a.content) {
                Some(&first) if added[first].settings != a.settings => warnings.push(format!(
                    "token {:?} is added with other settings by {}; the first model's are kept",
                    a.content,
                    m.dir.display()
                )),
                Some(_) => {}
                None => {
                    added_seen.insert(a.content.clone(), added.len());
                    added.push(a.clone());
                }
            }
        }
    };
    for a in agents {
        if let Some(t) = Tokenizer::of_model(a)? {
            take(&t);
        }
    }
    for tok in regular {
        if !added_seen.contains_key(&tok) {
            out.add(&tok, plain_settings());
        }
    }
    for a in added {
        out.add(&a.content, a.settings);
    }
    Ok(())
}

/// An added token as tokenizer.json and tokenizer_config.json list it.
fn added_entry(a: &AddedToken, with_id: bool) -> Value {
    let mut e = Map::new();
    if with_id {
        e.insert("id".into(), a.id.into());
    }
    e.insert("content".into(), a.content.clone().into());
    for (k, v) in &a.settings {
        e.insert(k.clone(), v.clone());
    }
    Value::Object(e)
}

/// Writes `src` (a tokenizer.json) to `dst` with the tokens at or past `strip_from` dropped and
/// `appended` added. Only `added_tokens` (and, when stripping, `model`) is parsed; every other
/// part is copied as it is.
fn write_tokenizer_json(
    src: &Path,
    dst: &Path,
    strip_from: Option<u32>,
    appended: &[AddedToken],
) -> Result<()> {
    use serde_json::value::RawValue;
    let text =
        std::fs::read_to_string(src).with_context(|| format!("cannot read {}", src.display()))?;
    let mut top: std::collections::BTreeMap<String, Box<RawValue>> =
        serde_json::from_str(&text).with_context(|| format!("{}: invalid JSON", src.display()))?;
    let mut added: Vec<Value> = match top.get("added_tokens") {
        Some(raw) => serde_json::from_str(raw.get())?,
        None => Vec::new(),
    };
    if let Some(n) = strip_from {
        added.retain(|e| e["id"].as_u64().is_some_and(|i| i < n as u64));
        if let Some(raw) = top.get("model") {
            let mut model: Value = serde_json::from_str(raw.get())?;
            let unused: HashSet<String> = model["vocab"]
                .as_object()
                .map(|v| {
                    v.iter()
                        .filter(|(_, i)| i.as_u64().is_some_and(|i| i >= n as u64))
                        .map(|(t, _)| t.clone())
                        .collect()
                })
                .unwrap_or_default();
            if let Some(vocab) = model["vocab"].as_object_mut() {
                vocab.retain(|t, _| !unused.contains(t));
            }
            if let Some(merges) = model["merges"].as_array_mut() {
                merges.retain(|m| {
                    let parts: Vec<&str> = match m {
                        Value::String(s) => s.split(' ').collect(),
                        Value::Array(a) => a.iter().filter_map(Value::as_str).collect(),
                        _ => Vec::new(),
                    };
                    !parts.iter().any(|p| unused.contains(*p))
                });
            }
            top.insert(
                "model".into(),
                RawValue::from_string(serde_json::to_string(&model)?)?,
            );
        }
    }
    added.extend(appended.iter().map(|a| added_entry(a, true)));
    top.insert(
        "added_tokens".into(),
        RawValue::from_string(serde_json::to_string(&added)?)?,
    );
    std::fs::write(dst, serde_json::to_string(&top)? + "\n")
        .with_context(|| format!("cannot write {}", dst.display()))
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
