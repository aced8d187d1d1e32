//! tokenizer.json, streamed: a model's vocabulary and added tokens read without a JSON tree,
//! the union of several, and the output's tokenizer.json written with only `added_tokens` (and
//! `model`, when stripping) parsed.

use super::*;

/// A token the tokenizer adds to its model's vocabulary, with its settings as tokenizer.json
/// keeps them (`special`, `normalized`, `lstrip`, …).
#[derive(Clone, Debug, Deserialize)]
pub(super) struct AddedToken {
    pub(super) id: u32,
    pub(super) content: String,
    /// The entry's other keys.
    #[serde(flatten)]
    pub(super) settings: Map<String, Value>,
}

/// The output's vocabulary while it is built: token → id (the added tokens among them, as
/// `get_vocab()` gives it), and its added tokens. The one whole vocabulary a merge holds (a
/// 150,000-token one is some 9 MB); every other model's tokenizer.json is streamed.
#[derive(Clone, Debug)]
pub(super) struct Tokenizer {
    /// The folder it was read from.
    pub(super) dir: PathBuf,
    pub(super) vocab: HashMap<String, u32>,
    pub(super) added: Vec<AddedToken>,
}

/// What streaming a tokenizer.json gives besides its vocabulary's entries.
pub(super) struct Scanned {
    pub(super) added: Vec<AddedToken>,
    /// Entries of `model.vocab`.
    pub(super) entries: usize,
}

mod streamed {
    use super::AddedToken;
    use super::Scanned;
    use serde::de::{DeserializeSeed, IgnoredAny, MapAccess, SeqAccess, Visitor};
    use std::fmt;

    /// serde seeds that stream tokenizer.json for [`super::scan`]: the top object, its `model`, and
    /// `model.vocab`, each token handed to the callback as it is read.
    pub(super) struct Top<'a>(
        pub(super) &'a mut dyn FnMut(&str, u32),
        pub(super) &'a mut Scanned,
    );
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
}

/// Calls `each(token, id)` for every entry of `model.vocab` of `dir`'s tokenizer.json (a map, or
/// Unigram's list of [piece, score]), holding none of them. `None` when it has no tokenizer.json.
pub(super) fn scan(dir: &Path, each: &mut dyn FnMut(&str, u32)) -> Result<Option<Scanned>> {
    use serde::de::DeserializeSeed;
    let path = dir.join("tokenizer.json");
    if !path.is_file() {
        return Ok(None);
    }
    let file =
        std::fs::File::open(&path).with_context(|| format!("cannot read {}", path.display()))?;
    let mut scanned = Scanned {
        added: Vec::new(),
        entries: 0,
    };
    let mut de = serde_json::Deserializer::from_reader(std::io::BufReader::new(file));
    streamed::Top(each, &mut scanned)
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
pub(super) fn vocab_size_of(dir: &Path, scanned: &Scanned) -> usize {
    crate::model_config::ModelConfig::read(dir)
        .ok()
        .and_then(|c| config_vocab_size(c.json()))
        .unwrap_or(scanned.entries + scanned.added.len())
}

/// The folder whose tokenizer is model `m`'s: its own, or — a LoRA agent, or a folder without
/// tokenizer.json — the base's.
pub(super) fn tokenizer_dir<'a>(m: &'a ModelFolder, base: &'a Path) -> &'a Path {
    if m.lora.is_none() && m.config_dir().join("tokenizer.json").is_file() {
        m.config_dir()
    } else {
        base
    }
}

impl Tokenizer {
    /// `dir`'s tokenizer, with `strip` its tokens at or past its vocab_size left out (they have
    /// no row: mergekit strips the base's so); whether any was.
    pub(super) fn read(dir: &Path, strip: bool) -> Result<Option<(Tokenizer, bool)>> {
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

    pub(super) fn is_added(&self, token: &str) -> bool {
        self.added.iter().any(|a| a.content == token)
    }

    /// Adds `content` as an added token: the next id, or its id when the vocabulary already has
    /// it (as the tokenizers library does). Returns whether it is new to the added tokens.
    pub(super) fn add(&mut self, content: &str, settings: Map<String, Value>) -> bool {
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
    pub(super) fn map_of(&self, dir: &Path, vocab_size: usize) -> Result<(Vec<u32>, Highest)> {
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

/// The settings of a token added as plain text (not special), as the tokenizers library gives
/// them.
pub(super) fn plain_settings() -> Map<String, Value> {
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
pub(super) fn union(
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
pub(super) fn added_entry(a: &AddedToken, with_id: bool) -> Value {
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
pub(super) fn write_tokenizer_json(
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
