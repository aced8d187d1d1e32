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

/// The output's vocabulary while it is built: token → id (the added tokens among them, as
/// `get_vocab()` gives it), and its added tokens. The one whole vocabulary a merge holds (a
/// 150,000-token one is some 9 MB); every other model's tokenizer.json is streamed.
#[derive(Clone, Debug)]
struct Tokenizer {
    /// The folder it was read from.
    dir: PathBuf,
    vocab: HashMap<String, u32>,
    added: Vec<AddedToken>,
}

/// What streaming a tokenizer.json gives besides its vocabulary's entries.
struct Scanned {
    added: Vec<AddedToken>,
    /// Entries of `model.vocab`.
    entries: usize,
}

/// Calls `each(token, id)` for every entry of `model.vocab` of `dir`'s tokenizer.json (a map, or
/// Unigram's list of [piece, score]), holding none of them. `None` when it has no tokenizer.json.
fn scan(dir: &Path, each: &mut dyn FnMut(&str, u32)) -> Result<Option<Scanned>> {
    use serde::de::{DeserializeSeed, IgnoredAny, MapAccess, SeqAccess, Visitor};
    use std::fmt;
    let path = dir.join("tokenizer.json");
    if !path.is_file() {
        return Ok(None);
    }
    struct Top<'a>(&'a mut dyn FnMut(&str, u32), &'a mut Scanned);
    struct Model<'a>(&'a mut dyn FnMut(&str, u32), &'a mut usize);
    struct Vocab<'a>(&'a mut dyn FnMut(&str, u32), &'a mut usize);
    impl<'de> DeserializeSeed<'de> for Top<'_> {
        type Value = ();
        fn deserialize<D: serde::Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
            d.deserialize_map(self)
        }
    }
    impl<'de> Visitor<'de> for Top<'_> {
        type Value = ();
        fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
            f.write_str("a tokenizer.json object")
        }
        fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
            let mut model = false;
            while let Some(key) = map.next_key::<String>()? {
                match key.as_str() {
                    "model" => {
                        map.next_value_seed(Model(self.0, &mut self.1.entries))?;
                        model = true;
                    }
                    "added_tokens" => {
                        self.1.added = map
                            .next_value::<Option<Vec<AddedToken>>>()?
                            .unwrap_or_default()
                    }
                    _ => {
                        map.next_value::<IgnoredAny>()?;
                    }
                }
            }
            if !model {
                return Err(serde::de::Error::missing_field("model"));
            }
            Ok(())
        }
    }
    impl<'de> DeserializeSeed<'de> for Model<'_> {
        type Value = ();
        fn deserialize<D: serde::Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
            d.deserialize_map(self)
        }
    }
    impl<'de> Visitor<'de> for Model<'_> {
        type Value = ();
        fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
            f.write_str("the tokenizer's model object")
        }
        fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
            let mut vocab = false;
            while let Some(key) = map.next_key::<String>()? {
                if key == "vocab" {
                    map.next_value_seed(Vocab(&mut *self.0, &mut *self.1))?;
                    vocab = true;
                } else {
                    map.next_value::<IgnoredAny>()?;
                }
            }
            if !vocab {
                return Err(serde::de::Error::missing_field("model.vocab"));
            }
            Ok(())
        }
    }
    impl<'de> DeserializeSeed<'de> for Vocab<'_> {
        type Value = ();
        fn deserialize<D: serde::Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
            d.deserialize_any(self)
        }
    }
    impl<'de> Visitor<'de> for Vocab<'_> {
        type Value = ();
        fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
            f.write_str("a map of token to id, or a list of [token, score]")
        }
        fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
            while let Some((tok, id)) = map.next_entry::<String, u32>()? {
                (self.0)(&tok, id);
                *self.1 += 1;
            }
            Ok(())
        }
        fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
            let mut id = 0u32;
            while let Some((tok, _score)) = seq.next_element::<(String, f64)>()? {
                (self.0)(&tok, id);
                id += 1;
                *self.1 += 1;
            }
            Ok(())
        }
    }
    let file =
        std::fs::File::open(&path).with_context(|| format!("cannot read {}", path.display()))?;
    let mut scanned = Scanned {
        added: Vec::new(),
        entries: 0,
    };
    let mut de = serde_json::Deserializer::from_reader(std::io::BufReader::new(file));
    Top(each, &mut scanned)
        .deserialize(&mut de)
        .and_then(|()| de.end())
        .with_context(|| format!("{}: not a tokenizer.json rlmerge can read", path.display()))?;
    scanned.added.sort_by_key(|a| a.id);
    Ok(Some(scanned))
}

/// config.json's vocabulary size: `vocab_size` at the top or in `text_config`.
pub fn config_vocab_size(config: &Value) -> Option<usize> {
    config
        .get("vocab_size")
        .or_else(|| config.get("text_config").and_then(|c| c.get("vocab_size")))
        .and_then(Value::as_u64)
        .map(|n| n as usize)
}

/// A model's vocab_size: config.json's, else its tokenizer's size (`scanned`).
fn vocab_size_of(dir: &Path, scanned: &Scanned) -> usize {
    read_config(dir)
        .ok()
        .as_ref()
        .and_then(config_vocab_size)
        .unwrap_or(scanned.entries + scanned.added.len())
}

/// The folder whose tokenizer is model `m`'s: its own, or — a LoRA agent, or a folder without
/// tokenizer.json — the base's.
fn tokenizer_dir<'a>(m: &'a ModelFolder, base: &'a Path) -> &'a Path {
    if m.lora.is_none() && m.dir.join("tokenizer.json").is_file() {
        &m.dir
    } else {
        base
    }
}

impl Tokenizer {
    /// `dir`'s tokenizer, with `strip` its tokens at or past its vocab_size left out (they have
    /// no row: mergekit strips the base's so); whether any was.
    fn read(dir: &Path, strip: bool) -> Result<Option<(Tokenizer, bool)>> {
        let mut vocab = HashMap::new();
        let Some(scanned) = scan(dir, &mut |tok, id| {
            vocab.insert(tok.to_string(), id);
        })?
        else {
            return Ok(None);
        };
        let vocab_size = vocab_size_of(dir, &scanned);
        let mut added = scanned.added;
        for a in &added {
            vocab.insert(a.content.clone(), a.id);
        }
        let mut stripped = false;
        if strip {
            let n = vocab_size;
            let before = vocab.len();
            vocab.retain(|_, i| (*i as usize) < n);
            added.retain(|a| (a.id as usize) < n);
            stripped = vocab.len() != before;
        }
        Ok(Some((
            Tokenizer {
                dir: dir.to_path_buf(),
                vocab,
                added,
            },
            stripped,
        )))
    }

    fn is_added(&self, token: &str) -> bool {
        self.added.iter().any(|a| a.content == token)
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

    /// Model `dir`'s map to this vocabulary (output id → its own id, `ABSENT` where it lacks the
    /// token or its id is ≥ `vocab_size`) and its highest own id with the output id there,
    /// streaming its tokenizer.json.
    fn map_of(&self, dir: &Path, vocab_size: usize) -> Result<(Vec<u32>, Highest)> {
        let n = self.vocab.len();
        let mut perm = vec![ABSENT; n];
        let set = |tok: &str, own: u32, perm: &mut Vec<u32>| {
            if (own as usize) < vocab_size {
                if let Some(&id) = self.vocab.get(tok) {
                    perm[id as usize] = own;
                }
            }
        };
        let scanned = scan(dir, &mut |tok, own| set(tok, own, &mut perm))?
            .with_context(|| format!("{}: its tokenizer.json is gone", dir.display()))?;
        // Added tokens override the model's entry of the same text, as in get_vocab().
        for a in &scanned.added {
            set(&a.content, a.id, &mut perm);
        }
        let highest = perm
            .iter()
            .enumerate()
            .filter(|(_, &r)| r != ABSENT)
            .max_by_key(|(_, &r)| r)
            .map(|(i, &r)| (r, i as u32));
        Ok((perm, highest))
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
        let base_dir = &base.dir;
        ensure!(
            base_dir.join("tokenizer.json").is_file(),
            "a tokenizer source needs the base's tokenizer.json, and {} has none",
            base_dir.display()
        );
        for a in agents {
            if a.lora.is_none() && tokenizer_dir(a, base_dir) == base_dir.as_path() {
                warnings.push(format!(
                    "{} has no tokenizer.json; its vocabulary is taken to be the base's",
                    a.dir.display()
                ));
            }
        }
        // Each model's vocab_size: its config's (a LoRA agent's is its base's), else its
        // tokenizer's size.
        let size_of = |config_dir: &Path, tok_dir: &Path| -> Result<usize> {
            if let Some(n) = read_config(config_dir)
                .ok()
                .as_ref()
                .and_then(config_vocab_size)
            {
                return Ok(n);
            }
            let s = scan(tok_dir, &mut |_, _| {})?.context("its tokenizer.json is gone")?;
            Ok(s.entries + s.added.len())
        };
        let mut vocab_sizes = vec![size_of(base_dir, base_dir)?];
        for a in agents {
            let config_dir = if a.lora.is_some() { base_dir } else { &a.dir };
            vocab_sizes.push(size_of(config_dir, tokenizer_dir(a, base_dir))?);
        }
        let source_of = |p: &Path, what: &str| -> Result<Source> {
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
        };
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
                (t, base_dir.clone(), stripped)
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
        // Each model's map to the output.
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
            if dir == base_dir.as_path() && vocab_sizes[t + 1] == vocab_sizes[0] {
                perms.push(perms[0].clone());
                highest.push(highest[0]);
            } else {
                let (p, h) = out.map_of(dir, vocab_sizes[t + 1])?;
                perms.push(p);
                highest.push(h);
            }
        }
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
                            let dir = match s {
                                Source::Base => base_dir.as_path(),
                                Source::Agent(t) => tokenizer_dir(&agents[t], base_dir),
                            };
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
                            found.with_context(|| {
                                format!(
                                    "{what}: token {tok:?} is not in {}'s vocabulary",
                                    dir.display()
                                )
                            })? as usize
                        }
                        (None, Some(id)) => *id,
                        _ => bail!("{what}: give the source's token or its token_id, one of them"),
                    };
                    Some(RowDefault::Row(s, row as u32))
                }
            };
            let id = *out
                .vocab
                .get(&t.token)
                .with_context(|| format!("{what}: an empty token cannot be added"))?;
            configs.insert(id, (default, t.force));
        }
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
            dirs: std::iter::once(base_dir)
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
                    if !crate::checkpoint::folder_files::copy_if_present(from, name, out)? {
                        continue;
                    }
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
/// first), with the settings of the first model that adds each. Agents' tokenizer.json are
/// streamed; one without its own (LoRA) has the base's and adds nothing.
fn union(
    out: &mut Tokenizer,
    agents: &[ModelFolder],
    base_dir: &Path,
    vocab_sizes: &[usize],
    warnings: &mut Vec<String>,
) -> Result<()> {
    let mut regular: Vec<String> = Vec::new();
    let mut regular_seen: HashSet<String> = HashSet::new();
    let mut added: Vec<AddedToken> = out.added.clone();
    let mut added_seen: HashMap<String, usize> = added
        .iter()
        .enumerate()
        .map(|(i, a)| (a.content.clone(), i))
        .collect();
    for (t, a) in agents.iter().enumerate() {
        let dir = tokenizer_dir(a, base_dir);
        if dir == base_dir {
            continue;
        }
        let vs = vocab_sizes[t + 1];
        let mut new: Vec<(u32, String)> = Vec::new();
        let scanned = scan(dir, &mut |tok, id| {
            if (id as usize) < vs && !out.vocab.contains_key(tok) {
                new.push((id, tok.to_string()));
            }
        })?
        .context("its tokenizer.json is gone")?;
        let own_added: HashSet<&str> = scanned.added.iter().map(|a| a.content.as_str()).collect();
        new.retain(|(_, tok)| !own_added.contains(tok.as_str()));
        new.sort();
        for (_, tok) in new {
            if regular_seen.insert(tok.clone()) {
                regular.push(tok);
            }
        }
        for a in &scanned.added {
            if a.id as usize >= vs {
                continue;
            }
            match added_seen.get(&a.content) {
                Some(&first) if added[first].settings != a.settings => warnings.push(format!(
                    "token {:?} is added with other settings by {}; the first model's are kept",
                    a.content,
                    dir.display()
                )),
                Some(_) => {}
                None => {
                    added_seen.insert(a.content.clone(), added.len());
                    added.push(a.clone());
                }
            }
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
