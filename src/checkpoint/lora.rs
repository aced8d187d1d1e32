//! PEFT LoRA adapters as agents: an adapter folder (`adapter_config.json` +
//! `adapter_model.safetensors`) on the merge's base is the agent θ₀ + s·B·A, computed tile by tile
//! as the merge reads it — never written out. s = lora_alpha / r (rsLoRA: / √r), per module from
//! `rank_pattern` / `alpha_pattern`; with `fan_in_fan_out` (and for embedding adapters) the update
//! is (B·A)ᵀ. Each element's update is Σ_k B[i,k]·A[k,j] in f32, k in order, times s, added to
//! θ₀ in f32: the agent's tiles are f32 (SPEC §5), so both backends see the same values.

use super::dtype::{decode, decode_one, first_nonfinite};
use super::safetensors_file::{shape_text, Interner, SafetensorsFile, TensorEntry};
use crate::simd::multiversion;
use anyhow::{bail, ensure, Context, Result};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use super::files::{ADAPTER_CONFIG, ADAPTER_WEIGHTS};

/// A/B pairs kept at most this many bytes at once, the oldest dropped first (read again if
/// needed). The engine holds one tensor's pairs at a time — a tile loop starts a LoRA tensor once
/// the one before it is done, and drops its pairs as soon as its tiles are all merged
/// ([`LoraAdapter::forget_one`]) — and takes each worker's share of them out of its tile budget
/// ([`crate::inputs::TensorPlan::tile_elems`]); this bound is a backstop.
const CACHE_BYTES: usize = 32 << 20;

/// One base tensor's low-rank update.
pub struct LoraUpdate {
    a: TensorEntry,
    b: TensorEntry,
    rank: usize,
    scale: f32,
    /// The update is (B·A)ᵀ (`fan_in_fan_out`, embedding adapters).
    transposed: bool,
    /// Its place in the adapter's [`Cache`].
    slot: usize,
}

impl LoraUpdate {
    /// Bytes its A and B hold as stored (what a tile of its tensor holds besides the tile).
    pub fn stored_bytes(&self) -> usize {
        (self.a.byte_len() + self.b.byte_len()) as usize
    }
}

/// A and B of one update, their bytes as stored in the adapter (each in its own dtype), decoded a
/// run at a time as the tiles need them: the pair costs its file size, not twice it in f32. One
/// buffer, A then B, reused from pair to pair ([`Cache::spare`]).
struct Pair {
    bytes: Vec<u8>,
    a_len: usize,
}

impl Pair {
    /// A [r, cols] row-major (plain), A [r, rows] (transposed).
    fn a(&self) -> &[u8] {
        &self.bytes[..self.a_len]
    }

    /// B [rows, r] (plain), B [cols, r] (transposed).
    fn b(&self) -> &[u8] {
        &self.bytes[self.a_len..]
    }
}

/// An opened adapter.
pub struct LoraAdapter {
    pub dir: PathBuf,
    pub file: SafetensorsFile,
    /// By base tensor name (`{module}.weight`).
    updates: HashMap<String, LoraUpdate>,
    cache: Mutex<Cache>,
    /// A/B pairs read from the adapter so far (one per updated tensor and pass).
    pairs_read: std::sync::atomic::AtomicUsize,
    /// The most pairs held at once so far.
    most_held: std::sync::atomic::AtomicUsize,
}

/// The pairs held, by update slot; the slots held in the order they were read; their bytes; the
/// buffer of the last pair dropped. Sized for every update when the adapter opens, so holding
/// and dropping a pair allocates nothing but the pair — and the next pair reuses the buffer of
/// the one before: the engine holds one tensor's pairs at a time, so a pass keeps one buffer
/// the size of its largest pair, wherever its workers run (a pair freed by one worker's thread
/// and the next allocated by another's would leave each thread's allocator arena holding one).
struct Cache {
    pairs: Vec<Option<Arc<Pair>>>,
    order: std::collections::VecDeque<usize>,
    bytes: usize,
    spare: Vec<u8>,
}

impl Cache {
    fn new(updates: usize) -> Cache {
        Cache {
            pairs: vec![None; updates],
            order: std::collections::VecDeque::with_capacity(updates),
            bytes: 0,
            spare: Vec::new(),
        }
    }

    fn drop_pair(&mut self, slot: usize) {
        if let Some(p) = self.pairs[slot].take() {
            self.bytes -= p.bytes.len();
            self.order.retain(|&s| s != slot);
            // Nobody else holds it once its tensor is done: its buffer is the next pair's.
            if let Ok(p) = Arc::try_unwrap(p) {
                if p.bytes.capacity() > self.spare.capacity() {
                    self.spare = p.bytes;
                }
            }
        }
    }
}

/// PEFT's default rank and alpha (`LoraConfig.r`, `LoraConfig.lora_alpha`): a config that omits
/// them means these.
const PEFT_DEFAULT_R: usize = 8;
const PEFT_DEFAULT_ALPHA: f64 = 8.0;

#[derive(serde::Deserialize)]
struct AdapterConfig {
    #[serde(default)]
    peft_type: Option<String>,
    #[serde(default = "default_r")]
    r: usize,
    #[serde(default = "default_alpha")]
    lora_alpha: f64,
    #[serde(default)]
    fan_in_fan_out: bool,
    #[serde(default)]
    use_rslora: bool,
    #[serde(default)]
    use_dora: bool,
    #[serde(default)]
    rank_pattern: Patterns<usize>,
    #[serde(default)]
    alpha_pattern: Patterns<f64>,
    #[serde(default)]
    modules_to_save: Option<serde_json::Value>,
    /// PEFT features that change what the adapter computes; refused when set (JSON null reads as
    /// `None`).
    #[serde(default)]
    lora_bias: bool,
    #[serde(default)]
    layer_replication: Option<serde_json::Value>,
    #[serde(default)]
    trainable_token_indices: Option<serde_json::Value>,
    #[serde(default)]
    target_parameters: Option<serde_json::Value>,
}

/// Whether `dir` is a PEFT adapter folder (an adapter config, and no full weights).
pub fn is_adapter(dir: &Path) -> bool {
    dir.join(ADAPTER_CONFIG).is_file()
        && !dir.join(super::files::SINGLE_FILE).exists()
        && !dir.join(super::files::INDEX_FILE).exists()
}

/// The model adapter folder `dir` says it was trained on: its config's `base_model_name_or_path`
/// (a local path or a Hub id), when it names one.
pub fn trained_on(dir: &Path) -> Option<String> {
    let path = dir.join(ADAPTER_CONFIG);
    super::files::check_regular_file(&path).ok()?;
    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(path).ok()?).ok()?;
    config
        .get("base_model_name_or_path")?
        .as_str()
        .filter(|s| !s.is_empty())
        .map(str::to_string)
}

/// mergekit's `BASE+ADAPTER` reference split in two, when `reference` is not itself a path.
pub fn split_reference(reference: &str) -> Option<(&str, &str)> {
    if Path::new(reference).exists() {
        return None;
    }
    reference
        .rsplit_once('+')
        .filter(|(b, a)| !b.is_empty() && !a.is_empty())
}

fn default_r() -> usize {
    PEFT_DEFAULT_R
}

fn default_alpha() -> f64 {
    PEFT_DEFAULT_ALPHA
}

/// `rank_pattern` / `alpha_pattern`: keys in the file's order (PEFT takes the first that matches),
/// each a regular expression.
struct Patterns<T>(Vec<(String, T)>);

impl<T> Default for Patterns<T> {
    fn default() -> Self {
        Patterns(Vec::new())
    }
}

impl<'de, T: serde::Deserialize<'de>> serde::Deserialize<'de> for Patterns<T> {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct InOrder<T>(std::marker::PhantomData<T>);
        impl<'de, T: serde::Deserialize<'de>> serde::de::Visitor<'de> for InOrder<T> {
            type Value = Patterns<T>;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("an object of module patterns")
            }
            fn visit_unit<E>(self) -> Result<Self::Value, E> {
                Ok(Patterns(Vec::new()))
            }
            fn visit_map<M: serde::de::MapAccess<'de>>(
                self,
                mut map: M,
            ) -> Result<Self::Value, M::Error> {
                let mut keys = Vec::new();
                while let Some(entry) = map.next_entry::<String, T>()? {
                    keys.push(entry);
                }
                Ok(Patterns(keys))
            }
        }
        d.deserialize_any(InOrder(std::marker::PhantomData))
    }
}

impl<T> Patterns<T> {
    /// Compiles every key as PEFT uses it: the whole of `(.*\.)?(KEY)$` must match a module name
    /// (so `q_proj` matches `model.layers.0.self_attn.q_proj`, and `layers\.0\..*` a module of
    /// layer 0).
    fn compile(self, which: &str) -> Result<Vec<(regex::Regex, T)>> {
        self.0
            .into_iter()
            .map(|(key, v)| {
                let re = regex::Regex::new(&format!("^(?:.*\\.)?(?:{key})$")).map_err(|e| {
                    anyhow::anyhow!(
                        "{which} key {}: not a regular expression rlmerge can read: {e}",
                        crate::escape::terminal(&key)
                    )
                })?;
                Ok((re, v))
            })
            .collect()
    }
}

/// The value of the first pattern (in the config file's order) matching module `name`, as PEFT's
/// `get_pattern_key` picks it.
fn pattern_for<'a, T>(patterns: &'a [(regex::Regex, T)], name: &str) -> Option<&'a T> {
    patterns
        .iter()
        .find(|(re, _)| re.is_match(name))
        .map(|(_, v)| v)
}

impl LoraAdapter {
    /// Opens adapter folder `dir`: its config, and every lora_A/lora_B pair of its weights.
    pub fn open(dir: &Path, interner: &mut Interner) -> Result<LoraAdapter> {
        let config_path = dir.join(ADAPTER_CONFIG);
        super::files::check_regular_file(&config_path)?;
        let text = std::fs::read_to_string(&config_path)
            .with_context(|| format!("cannot read {}", config_path.display()))?;
        let config: AdapterConfig = serde_json::from_str(&text)
            .with_context(|| format!("{}: not a LoRA adapter config", config_path.display()))?;
        let fail = |msg: String| anyhow::anyhow!("{}: {msg}", config_path.display());
        if let Some(t) = config.peft_type.as_deref().filter(|t| *t != "LORA") {
            return Err(fail(format!(
                "peft_type {t}: only LORA adapters are supported"
            )));
        }
        if config.use_dora {
            return Err(fail(
                "DoRA adapters (use_dora) are not supported yet".into(),
            ));
        }
        for (key, set) in [
            ("lora_bias", config.lora_bias),
            ("layer_replication", config.layer_replication.is_some()),
            (
                "trainable_token_indices",
                config.trainable_token_indices.is_some(),
            ),
            ("target_parameters", config.target_parameters.is_some()),
        ] {
            if set {
                return Err(fail(format!("adapters with {key} are not supported yet")));
            }
        }
        ensure!(config.r > 0, fail("r must be at least 1".into()));
        ensure!(
            config.lora_alpha.is_finite(),
            fail(format!(
                "lora_alpha must be finite, got {}",
                config.lora_alpha
            ))
        );
        let rank_pattern = config
            .rank_pattern
            .compile("rank_pattern")
            .map_err(|e| fail(e.to_string()))?;
        let alpha_pattern = config
            .alpha_pattern
            .compile("alpha_pattern")
            .map_err(|e| fail(e.to_string()))?;
        if dir.join(ADAPTER_WEIGHTS).symlink_metadata().is_err()
            && dir.join("adapter_model.bin").symlink_metadata().is_ok()
        {
            bail!(
                "{}: only adapter_model.bin is here, a PyTorch pickle, which rlmerge does not \
                 read (loading a pickle can run arbitrary code); save the adapter as \
                 {ADAPTER_WEIGHTS} (PEFT: save_pretrained(..., safe_serialization=True))",
                dir.display()
            );
        }
        let (file, entries) = SafetensorsFile::open_interned(&dir.join(ADAPTER_WEIGHTS), interner)?;
        // By module name, in order: the same adapter always reports the same first error.
        let mut pairs: std::collections::BTreeMap<
            String,
            (Option<TensorEntry>, Option<TensorEntry>, bool),
        > = Default::default();
        for e in entries {
            // base_model.model.{module}.lora_A[.default].weight
            let name = e.name.strip_prefix("base_model.model.").unwrap_or(&e.name);
            let name = name.replace(".default.", ".");
            // A copy of the base's own layer (PEFT's save_embedding_layers): the adapter applies
            // to the merge's base, whose layer it is.
            if name.ends_with(".base_layer.weight") {
                continue;
            }
            let found = [
                (".lora_A.weight", false, false),
                (".lora_B.weight", true, false),
                (".lora_embedding_A", false, true),
                (".lora_embedding_B", true, true),
            ]
            .into_iter()
            .find_map(|(suffix, is_b, emb)| {
                name.strip_suffix(suffix)
                    .map(|m| (m.to_string(), is_b, emb))
            });
            let Some((module, is_b, embedding)) = found else {
                if config.modules_to_save.is_some() || !name.contains("lora_") {
                    bail!(
                        "{}: tensor '{}' is a full copy of a module (modules_to_save); adapters \
                         that save whole modules are not supported yet",
                        file.path.display(),
                        e.name
                    );
                }
                bail!(
                    "{}: tensor '{}' is not a LoRA A or B matrix (lora biases are not supported)",
                    file.path.display(),
                    e.name
                );
            };
            let slot = pairs.entry(module).or_insert((None, None, embedding));
            if is_b {
                slot.1 = Some(e);
            } else {
                slot.0 = Some(e);
            }
        }
        let mut updates = HashMap::new();
        for (module, (a, b, embedding)) in pairs {
            let (Some(a), Some(b)) = (a, b) else {
                bail!(
                    "{}: module '{module}' has only one of its lora_A and lora_B matrices",
                    file.path.display()
                );
            };
            ensure!(
                a.shape.len() == 2 && b.shape.len() == 2,
                "{}: module '{module}': LoRA matrices must be 2-D, got A {} and B {}",
                file.path.display(),
                shape_text(&a.shape),
                shape_text(&b.shape)
            );
            let rank = *pattern_for(&rank_pattern, &module).unwrap_or(&config.r);
            ensure!(
                rank >= 1,
                "{}: module '{module}' has rank 0; a LoRA rank is at least 1",
                config_path.display()
            );
            let alpha = *pattern_for(&alpha_pattern, &module).unwrap_or(&config.lora_alpha);
            // Embedding adapters store A as [r, vocab] and B as [dim, r] too; both kinds [r, ·].
            ensure!(
                a.shape[0] == rank && b.shape[1] == rank,
                "{}: module '{module}': A is {} and B is {}, but the config's rank for it is {rank}",
                file.path.display(),
                shape_text(&a.shape),
                shape_text(&b.shape)
            );
            let scale = if config.use_rslora {
                alpha / (rank as f64).sqrt()
            } else {
                alpha / rank as f64
            };
            // The scale is a parameter of the merge: one that is not a finite f32 would turn every
            // element the update touches into ±Inf or NaN.
            ensure!(
                (scale as f32).is_finite(),
                "{}: module '{module}': the scale lora_alpha / r = {alpha} / {rank} is not a finite \
                 32-bit number",
                config_path.display()
            );
            updates.insert(
                format!("{module}.weight"),
                LoraUpdate {
                    a,
                    b,
                    rank,
                    scale: scale as f32,
                    transposed: config.fan_in_fan_out || embedding,
                    slot: updates.len(),
                },
            );
        }
        ensure!(
            !updates.is_empty(),
            "{}: the adapter has no lora_A/lora_B matrices",
            file.path.display()
        );
        let count = updates.len();
        Ok(LoraAdapter {
            dir: dir.to_path_buf(),
            file,
            updates,
            cache: Mutex::new(Cache::new(count)),
            pairs_read: Default::default(),
            most_held: Default::default(),
        })
    }

    /// Drops every pair held (the engine calls this when the tensors in flight are done).
    pub fn forget(&self) {
        let mut cache = self.cache.lock().unwrap_or_else(|e| e.into_inner());
        while let Some(&slot) = cache.order.front() {
            cache.drop_pair(slot);
        }
    }

    /// How many A/B pairs were read from the adapter so far.
    pub fn pairs_read(&self) -> usize {
        self.pairs_read.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// The most A/B pairs held at once so far.
    pub fn most_pairs_held(&self) -> usize {
        self.most_held.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// How many tensors the adapter updates.
    pub fn len(&self) -> usize {
        self.updates.len()
    }

    pub fn is_empty(&self) -> bool {
        self.updates.is_empty()
    }

    /// Drops the A and B held for update `name` (its tensor's tiles are all merged).
    pub fn forget_one(&self, name: &str) {
        if let Some(u) = self.updates.get(name) {
            self.cache
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .drop_pair(u.slot);
        }
    }

    /// The update of base tensor `name`, if the adapter has one.
    pub fn update(&self, name: &str) -> Option<&LoraUpdate> {
        self.updates.get(name)
    }

    /// Every base tensor name the adapter updates.
    pub fn targets(&self) -> impl Iterator<Item = &str> {
        self.updates.keys().map(String::as_str)
    }

    /// Checks update `name` against the base tensor's shape.
    pub fn check_shape(&self, name: &str, shape: &[usize]) -> Result<()> {
        let u = &self.updates[name];
        let (m, n) = if u.transposed {
            (u.a.shape[1], u.b.shape[0])
        } else {
            (u.b.shape[0], u.a.shape[1])
        };
        ensure!(
            shape == [m, n],
            "{}: the update of '{name}' is {} (A {}, B {}{}), but the base tensor is {}",
            self.file.path.display(),
            shape_text(&[m, n]),
            shape_text(&u.a.shape),
            shape_text(&u.b.shape),
            if u.transposed { ", transposed" } else { "" },
            shape_text(shape)
        );
        Ok(())
    }

    /// A and B of update `u` as stored (read from the adapter once while cached). Read under
    /// the cache's lock: workers that need the same pair at once wait for one read.
    fn pair(&self, u: &LoraUpdate) -> Result<Arc<Pair>> {
        let mut cache = self.cache.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(p) = &cache.pairs[u.slot] {
            return Ok(p.clone());
        }
        let (a_len, size) = (u.a.byte_len() as usize, u.stored_bytes());
        let mut bytes = std::mem::take(&mut cache.spare);
        if bytes.capacity() < size {
            // Grown exactly, the old buffer freed first.
            bytes = Vec::new();
            bytes.reserve_exact(size);
        }
        bytes.clear();
        bytes.resize(size, 0);
        let (a, b) = bytes.split_at_mut(a_len);
        for (e, part) in [(&u.a, a), (&u.b, b)] {
            self.file.read(e, 0, part)?;
            self.file.record_read(e, 0, part);
        }
        self.pairs_read
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let p = Arc::new(Pair { bytes, a_len });
        while cache.bytes + size > CACHE_BYTES {
            let Some(old) = cache.order.pop_front() else {
                break;
            };
            cache.drop_pair(old);
        }
        cache.pairs[u.slot] = Some(p.clone());
        cache.bytes += size;
        cache.order.push_back(u.slot);
        self.most_held
            .fetch_max(cache.order.len(), std::sync::atomic::Ordering::Relaxed);
        Ok(p)
    }

    /// Why element `element` of agent tensor `name` (its stored base value finite) became `value`,
    /// not finite, once update `name` was added: a NaN or ±Inf stored in A or B, named with its
    /// element, or else an update s·B·A that overflows 32-bit floats. The finiteness gate
    /// ([`crate::engine`]'s tile reads) calls this to name what the user must fix.
    pub fn nonfinite_error(&self, name: &str, element: u64, value: f32) -> anyhow::Error {
        let u = &self.updates[name];
        let file = self.file.path.display();
        if let Ok(p) = self.pair(u) {
            for (e, bytes) in [(&u.a, p.a()), (&u.b, p.b())] {
                if let Some(k) = first_nonfinite(e.dtype, bytes) {
                    return anyhow::anyhow!(
                        "tensor '{}' in {file} has a non-finite value ({}) at element {k}; \
                         rlmerge refuses NaN and infinity unless --allow-nonfinite",
                        crate::escape::terminal(&e.name),
                        decode_one(e.dtype, bytes, k)
                    );
                }
            }
        }
        anyhow::anyhow!(
            "{file}: the update s·B·A of '{}' is not finite ({value}) at element {element} \
             (s = {}, rank {}): the adapter's values overflow 32-bit floats; rlmerge refuses NaN \
             and infinity unless --allow-nonfinite",
            crate::escape::terminal(name),
            u.scale,
            u.rank
        )
    }

    /// Adds update `name` to `values`, elements `start..start + values.len()` of the base tensor
    /// of `shape` ([m, n]) in f32: for element (i, j), s·Σ_k B[i,k]·A[k,j] (transposed:
    /// s·Σ_k B[j,k]·A[k,i]), k ascending from 0, no fused multiply-add.
    pub fn add_update(
        &self,
        name: &str,
        shape: &[usize],
        start: u64,
        values: &mut [f32],
    ) -> Result<()> {
        self.each_update(name, shape, start, values.len(), |at, update, s| {
            for (v, &x) in values[at..at + update.len()].iter_mut().zip(update) {
                *v += x * s;
            }
        })
    }

    /// [`Self::add_update`] into f32 values stored as little-endian bytes (a widened tile).
    pub fn add_update_bytes(
        &self,
        name: &str,
        shape: &[usize],
        start: u64,
        bytes: &mut [u8],
    ) -> Result<()> {
        self.each_update(name, shape, start, bytes.len() / 4, |at, update, s| {
            let out = bytes[at * 4..(at + update.len()) * 4].chunks_exact_mut(4);
            for (b, &x) in out.zip(update) {
                let v = f32::from_le_bytes([b[0], b[1], b[2], b[3]]) + x * s;
                b.copy_from_slice(&v.to_le_bytes());
            }
        })
    }

    /// Hands `add` each run of update `name` over elements `start..start + len`: its offset from
    /// `start`, Σ_k B·A over the run, and s. Column block by column block: a block's terms (A's
    /// rows over it; transposed, B's rows over it, turned) are decoded once for every row that
    /// crosses it, each row's coefficients (B's row; transposed, A's column) once per block.
    fn each_update(
        &self,
        name: &str,
        shape: &[usize],
        start: u64,
        len: usize,
        mut add: impl FnMut(usize, &[f32], f32),
    ) -> Result<()> {
        let u = &self.updates[name];
        let p = self.pair(u)?;
        let (r, m, n) = (u.rank, shape[0], shape[1]);
        let (ta, tb) = (u.a.dtype, u.b.dtype);
        let (sa, sb) = (ta.size(), tb.size());
        debug_assert!(r >= 1);
        if len == 0 {
            return Ok(());
        }
        // Columns per block: the block's r rows of terms take BLOCK_TERMS values (one column
        // at least), beside a row's r coefficients; sized for the call, not for the largest rank.
        let cols = (BLOCK_TERMS / r).clamp(1, BLOCK_COLS);
        let mut scratch = vec![0.0f32; r + r * cols];
        let (coef, terms) = scratch.split_at_mut(r);
        let mut acc = [0.0f32; BLOCK_COLS];
        let (first, end) = (start as usize, start as usize + len);
        let (row_lo, row_hi) = (first / n, (end - 1) / n);
        for c0 in (0..n).step_by(cols) {
            let c1 = (c0 + cols).min(n);
            let w = c1 - c0;
            // Rows whose part in the block is in the run (all but the first and last rows).
            let mut rows = (row_lo..=row_hi)
                .filter(|&i| i * n + c0 < end && i * n + c1 > first)
                .peekable();
            if rows.peek().is_none() {
                continue;
            }
            if u.transposed {
                // terms[k][j] = B[c0 + j, k]: B's rows over the block, turned.
                for j in 0..w {
                    let from = (c0 + j) * r * sb;
                    decode(tb, &p.b()[from..from + r * sb], coef);
                    for (k, &x) in coef.iter().enumerate() {
                        terms[k * w + j] = x;
                    }
                }
            } else {
                // terms[k][j] = A[k, c0 + j].
                for k in 0..r {
                    let from = (k * n + c0) * sa;
                    decode(
                        ta,
                        &p.a()[from..from + w * sa],
                        &mut terms[k * w..(k + 1) * w],
                    );
                }
            }
            for i in rows {
                if u.transposed {
                    for (k, c) in coef.iter_mut().enumerate() {
                        *c = decode_one(ta, p.a(), k * m + i);
                    }
                } else {
                    let from = i * r * sb;
                    decode(tb, &p.b()[from..from + r * sb], coef);
                }
                let lo = (i * n + c0).max(first);
                let hi = (i * n + c1).min(end);
                let acc = &mut acc[..hi - lo];
                rank_sums(coef, &terms[lo - (i * n + c0)..], w, acc);
                add(lo - first, acc, u.scale);
            }
        }
        Ok(())
    }
}

/// Values of a column block's terms in [`LoraAdapter::add_update`] (rank × columns), 16 KiB:
/// they stay in L1 while every row of a tile crosses the block.
const BLOCK_TERMS: usize = 4096;

/// Columns per block of [`LoraAdapter::add_update`] at most (rank ≤ 16 reaches it).
const BLOCK_COLS: usize = 256;

multiversion! {
    /// `acc[j] = Σ_k coef[k] · terms[k·stride + j]`, k ascending from 0, no fused multiply-add:
    /// one row's update over a run of a column block (compiled for the baseline, AVX2 and
    /// AVX-512; every build gives the same bits).
    fn rank_sums(coef: &[f32], terms: &[f32], stride: usize, acc: &mut [f32]) {
        // LANES columns at a time, their sums kept in registers over the whole rank.
        const LANES: usize = 64;
        let done = acc.len() - acc.len() % LANES;
        let mut lanes = acc.chunks_exact_mut(LANES);
        for (b, out) in lanes.by_ref().enumerate() {
            let mut sums = [0.0f32; LANES];
            for (k, &c) in coef.iter().enumerate() {
                let t = &terms[k * stride + b * LANES..][..LANES];
                for (x, &y) in sums.iter_mut().zip(t) {
                    *x += c * y;
                }
            }
            out.copy_from_slice(&sums);
        }
        for (j, out) in acc.iter_mut().enumerate().skip(done) {
            let mut x = 0.0f32;
            for (k, &c) in coef.iter().enumerate() {
                x += c * terms[k * stride + j];
            }
            *out = x;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use half::bf16;
    use safetensors::tensor::{Dtype, TensorView};

    /// An adapter of one update of `shape` at `rank`, A in bf16 and B in f32 (PEFT allows each its
    /// own dtype), in `dir`; returns A and B as f32.
    fn adapter(
        dir: &Path,
        shape: [usize; 2],
        rank: usize,
        transposed: bool,
    ) -> (Vec<f32>, Vec<f32>) {
        let [m, n] = shape;
        // Plain: A [r, n], B [m, r]; fan_in_fan_out: A [r, m], B [n, r].
        let (a_cols, b_rows) = if transposed { (m, n) } else { (n, m) };
        let value = |i: usize, salt: usize| ((i * 2654435761 + salt) % 1999) as f32 / 997.0 - 1.0;
        let a: Vec<f32> = (0..rank * a_cols)
            .map(|i| bf16::from_f32(value(i, 7)).to_f32())
            .collect();
        let b: Vec<f32> = (0..b_rows * rank).map(|i| value(i, 13) / 3.0).collect();
        let a_bytes: Vec<u8> = a
            .iter()
            .flat_map(|&x| bf16::from_f32(x).to_le_bytes())
            .collect();
        let b_bytes: Vec<u8> = b.iter().flat_map(|x| x.to_le_bytes()).collect();
        let tensors = [
            (
                "base_model.model.layer.lora_A.weight",
                TensorView::new(Dtype::BF16, vec![rank, a_cols], &a_bytes).unwrap(),
            ),
            (
                "base_model.model.layer.lora_B.weight",
                TensorView::new(Dtype::F32, vec![b_rows, rank], &b_bytes).unwrap(),
            ),
        ];
        safetensors::serialize_to_file(tensors, None, &dir.join(ADAPTER_WEIGHTS)).unwrap();
        let config = serde_json::json!({
            "peft_type": "LORA", "r": rank, "lora_alpha": 3.0, "fan_in_fan_out": transposed
        });
        std::fs::write(dir.join(ADAPTER_CONFIG), config.to_string()).unwrap();
        (a, b)
    }

    /// The update added run by run (runs across rows and column blocks, longer than a block)
    /// equals the definition element by element — Σ_k in order from 0, times s — at ranks from 1
    /// (the widest blocks) to above [`BLOCK_TERMS`] (one column per block), plain and transposed;
    /// and the pair is read once.
    #[test]
    fn the_update_is_the_definition_whatever_the_runs() {
        let shape = [7, 2100];
        for rank in [1, 3, 16, 300, 4100] {
            for transposed in [false, true] {
                let dir = tempfile::tempdir().unwrap();
                let (a, b) = adapter(dir.path(), shape, rank, transposed);
                let lora = LoraAdapter::open(dir.path(), &mut Interner::default()).unwrap();
                lora.check_shape("layer.weight", &shape).unwrap();
                let [m, n] = shape;
                let s = 3.0 / rank as f32;
                let expected: Vec<f32> = (0..m * n)
                    .map(|e| {
                        let (i, j) = (e / n, e % n);
                        let mut acc = 0.0f32;
                        for k in 0..rank {
                            acc += if transposed {
                                a[k * m + i] * b[j * rank + k]
                            } else {
                                b[i * rank + k] * a[k * n + j]
                            };
                        }
                        0.5 + acc * s
                    })
                    .collect();
                let mut got = vec![0.5f32; m * n];
                let mut at = 0;
                for len in [1, 1500, 2099, 4000].into_iter().cycle() {
                    if at == m * n {
                        break;
                    }
                    let len = len.min(m * n - at);
                    lora.add_update("layer.weight", &shape, at as u64, &mut got[at..at + len])
                        .unwrap();
                    at += len;
                }
                assert_eq!(got, expected, "rank {rank}, transposed {transposed}");
                // The same over f32 bytes (a widened tile), in tiles across rows.
                let mut bytes: Vec<u8> = (0..m * n).flat_map(|_| 0.5f32.to_le_bytes()).collect();
                for (k, tile) in bytes.chunks_mut(4 * 3001).enumerate() {
                    lora.add_update_bytes("layer.weight", &shape, (k * 3001) as u64, tile)
                        .unwrap();
                }
                let from_bytes: Vec<f32> = bytes
                    .chunks_exact(4)
                    .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
                    .collect();
                assert_eq!(
                    from_bytes, expected,
                    "bytes: rank {rank}, transposed {transposed}"
                );
                assert_eq!(lora.pairs_read(), 1);
            }
        }
    }
}
