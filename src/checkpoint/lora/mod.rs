//! PEFT LoRA adapters as agents: an adapter folder (`adapter_config.json` +
//! `adapter_model.safetensors`) on the merge's base is the agent θ₀ + s·B·A, computed tile by tile
//! as the merge reads it — never written out. s = lora_alpha / r (rsLoRA: / √r), per module from
//! `rank_pattern` / `alpha_pattern`; with `fan_in_fan_out` (and for embedding adapters) the update
//! is (B·A)ᵀ. Each element's update is Σ_k B[i,k]·A[k,j] in f32, k in order, times s, added to
//! θ₀ in f32: the agent's tiles are f32 (SPEC §5), so both backends see the same values. A DoRA
//! adapter (`use_dora`) also stores a magnitude m per output row: its agent is each row of
//! θ₀ + s·B·A times m_i / ‖row i‖ ([`LoraAdapter::magnitude`]; the rows are rescaled where the
//! tiles are read, `crate::inputs::source`).

use super::dtype::{decode_one, first_nonfinite};
use super::weight_file::{shape_text, Interner, TensorEntry, WeightFile};
use anyhow::{bail, ensure, Result};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

mod config;
mod update;

use super::files::{ADAPTER_TORCH_WEIGHTS, ADAPTER_WEIGHTS};
use config::Settings;
pub use config::{is_adapter, split_reference, trained_on};

/// A/B pairs kept at most this many bytes at once, the oldest dropped first (read again if
/// needed). The engine holds one tensor's pairs at a time — a tile loop starts a LoRA tensor once
/// the one before it is done, and drops its pairs as soon as its tiles are all merged
/// ([`LoraAdapter::forget_one`]); this bound is a backstop.
const CACHE_BYTES: usize = 32 << 20;

/// One base tensor's low-rank update.
pub struct LoraUpdate {
    a: TensorEntry,
    b: TensorEntry,
    rank: usize,
    scale: f32,
    /// DoRA's magnitude vector m (one value per row of the base tensor), if the adapter is DoRA.
    magnitude: Option<TensorEntry>,
    /// The update is (B·A)ᵀ (`fan_in_fan_out`, embedding adapters).
    transposed: bool,
    /// Its place in the adapter's [`Cache`].
    slot: usize,
}

impl LoraUpdate {
    /// Bytes its A and B hold as stored (what a tile of its tensor holds besides the tile).
    pub fn stored_bytes(&self) -> usize {
        let m = self.magnitude.as_ref().map_or(0, TensorEntry::byte_len);
        (self.a.byte_len() + self.b.byte_len() + m) as usize
    }

    /// Whether it is DoRA's (a magnitude per row rescales θ₀ + s·B·A).
    pub fn is_dora(&self) -> bool {
        self.magnitude.is_some()
    }
}

/// A and B of one update (and DoRA's m), their bytes as stored in the adapter (each in its own
/// dtype), decoded a run at a time as the tiles need them: the pair costs its file size, not
/// twice it in f32. One buffer, A then B then m, reused from pair to pair ([`Cache::spare`]).
struct Pair {
    bytes: Vec<u8>,
    a_len: usize,
    b_len: usize,
}

impl Pair {
    /// A [r, cols] row-major (plain), A [r, rows] (transposed).
    fn a(&self) -> &[u8] {
        &self.bytes[..self.a_len]
    }

    /// B [rows, r] (plain), B [cols, r] (transposed).
    fn b(&self) -> &[u8] {
        &self.bytes[self.a_len..self.a_len + self.b_len]
    }

    /// DoRA's m [rows] (empty for a plain LoRA update).
    fn m(&self) -> &[u8] {
        &self.bytes[self.a_len + self.b_len..]
    }
}

/// An opened adapter.
pub struct LoraAdapter {
    /// The adapter's folder.
    pub dir: PathBuf,
    /// Its weights file (`adapter_model.safetensors`), header parsed.
    pub file: WeightFile,
    /// By base tensor name (`{module}.weight`).
    updates: HashMap<String, LoraUpdate>,
    /// lora_B's biases (`lora_bias`) by the base's bias they add to (`{module}.bias`), with s.
    biases: HashMap<String, (TensorEntry, f32)>,
    /// Whole modules the adapter saves, by the base tensor each replaces (`modules_to_save`):
    /// the agent's tensor is the adapter's, read from its file ([`super::model`]).
    pub whole: Vec<(String, TensorEntry)>,
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

/// What an adapter file holds for one module: its A and B matrices and DoRA's magnitude vector
/// (each may be missing), and whether they adapt an embedding.
#[derive(Default)]
struct ModuleTensors {
    a: Option<TensorEntry>,
    b: Option<TensorEntry>,
    magnitude: Option<TensorEntry>,
    embedding: bool,
}

/// [`ModuleTensors`] by module name, in order: the same adapter always reports the same first
/// error.
type ModulePairs = std::collections::BTreeMap<String, ModuleTensors>;

/// The parts of a module's tensor names in an adapter file.
#[derive(Clone, Copy)]
enum Part {
    A,
    B,
    Magnitude,
}

/// What an adapter file holds besides its A/B pairs: whole modules (`modules_to_save`, or the
/// other modules a trainer saves beside the pairs), by the base tensor they replace, and lora_B's
/// biases, by module.
#[derive(Default)]
struct Extras {
    whole: Vec<(String, TensorEntry)>,
    biases: Vec<(String, TensorEntry)>,
}

/// Sorts the adapter file's tensors into [`ModulePairs`] and [`Extras`]; a LoRA name of no known
/// part is refused.
fn module_pairs(
    file: &WeightFile,
    entries: Vec<TensorEntry>,
    settings: &Settings,
) -> Result<(ModulePairs, Extras)> {
    let mut pairs = ModulePairs::new();
    let mut extras = Extras::default();
    for e in entries {
        // base_model.model.{module}.lora_A[.default].weight
        let name = e.name.strip_prefix("base_model.model.").unwrap_or(&e.name);
        let name = name
            .replace(".modules_to_save.", ".")
            .replace(".default.", ".");
        // A copy of the base's own layer (PEFT's save_embedding_layers): the adapter applies
        // to the merge's base, whose layer it is.
        if name.ends_with(".base_layer.weight") || name.ends_with(".base_layer.bias") {
            continue;
        }
        // DoRA's m: `{module}.lora_magnitude_vector` as PEFT saves it (`.weight` in its models).
        let found = [
            (".lora_A.weight", Part::A, false),
            (".lora_B.weight", Part::B, false),
            (".lora_embedding_A", Part::A, true),
            (".lora_embedding_B", Part::B, true),
            (".lora_magnitude_vector", Part::Magnitude, false),
            (".lora_magnitude_vector.default", Part::Magnitude, false),
            (".lora_magnitude_vector.weight", Part::Magnitude, false),
        ]
        .into_iter()
        .find_map(|(suffix, part, emb)| {
            name.strip_suffix(suffix)
                .map(|m| (m.to_string(), part, emb))
        });
        let Some((module, part, embedding)) = found else {
            if let Some(module) = name.strip_suffix(".lora_B.bias") {
                extras.biases.push((module.to_string(), e));
                continue;
            }
            if !name.contains("lora_") {
                // A whole module the adapter saves (`modules_to_save`: a trained head or
                // embeddings; a trainer's copy of the layers it did not adapt): the agent's own.
                extras.whole.push((name, e));
                continue;
            }
            bail!(
                "{}: tensor '{}' is not a LoRA A or B matrix, nor lora_B's bias",
                file.path.display(),
                e.name
            );
        };
        let slot = pairs.entry(module).or_default();
        slot.embedding |= embedding;
        match part {
            Part::A => slot.a = Some(e),
            Part::B => slot.b = Some(e),
            Part::Magnitude => slot.magnitude = Some(e),
        }
    }
    if !extras.biases.is_empty() && !settings.lora_bias {
        bail!(
            "{}: it holds lora_B biases ('{}'), but its config does not set lora_bias",
            file.path.display(),
            extras.biases[0].1.name
        );
    }
    Ok((pairs, extras))
}

impl LoraAdapter {
    /// Opens adapter folder `dir`: its config, and every lora_A/lora_B pair of its weights.
    pub fn open(dir: &Path, interner: &mut Interner) -> Result<LoraAdapter> {
        let settings = Settings::read(dir)?;
        // PEFT's safetensors weights, else the torch.save file older PEFT wrote (read as data).
        let torch = dir.join(ADAPTER_TORCH_WEIGHTS);
        let (file, entries) = if dir.join(ADAPTER_WEIGHTS).symlink_metadata().is_err()
            && torch.symlink_metadata().is_ok()
        {
            super::torch_file::open(&torch, interner)?
        } else {
            super::safetensors_file::open(&dir.join(ADAPTER_WEIGHTS), interner)?
        };
        let mut updates = HashMap::new();
        let (pairs, extras) = module_pairs(&file, entries, &settings)?;
        let mut biases = HashMap::new();
        for (module, b) in extras.biases {
            ensure!(
                b.shape.len() == 1,
                "{}: lora_B's bias of module '{module}' is {}, not a vector",
                file.path.display(),
                shape_text(&b.shape)
            );
            let (_, scale) = settings.rank_and_scale(&module)?;
            biases.insert(format!("{module}.bias"), (b, scale));
        }
        for (module, tensors) in pairs {
            let magnitude = settings.check_dora(&module, &tensors, &file.path)?;
            let ModuleTensors {
                a, b, embedding, ..
            } = tensors;
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
            let (rank, scale) = settings.rank_and_scale(&module)?;
            // Embedding adapters store A as [r, vocab] and B as [dim, r] too; both kinds [r, ·].
            ensure!(
                a.shape[0] == rank && b.shape[1] == rank,
                "{}: module '{module}': A is {} and B is {}, but the config's rank for it is {rank}",
                file.path.display(),
                shape_text(&a.shape),
                shape_text(&b.shape)
            );
            let update = LoraUpdate {
                a,
                b,
                rank,
                scale,
                magnitude,
                transposed: settings.fan_in_fan_out || embedding,
                slot: updates.len(),
            };
            updates.insert(format!("{module}.weight"), update);
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
            biases,
            whole: extras.whole,
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

    /// Whether the adapter holds no update pairs.
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

    /// Every base tensor name the adapter updates by s·B·A.
    pub fn targets(&self) -> impl Iterator<Item = &str> {
        self.updates.keys().map(String::as_str)
    }

    /// Whether the adapter adds to base tensor `name` (s·B·A, or a lora_B bias).
    pub fn adds_to(&self, name: &str) -> bool {
        self.updates.contains_key(name) || self.biases.contains_key(name)
    }

    /// Every base bias the adapter adds a lora_B bias to, with its length.
    pub fn bias_targets(&self) -> impl Iterator<Item = (&str, usize)> {
        self.biases
            .iter()
            .map(|(name, (b, _))| (name.as_str(), b.shape[0]))
    }

    /// Adds s·bias of `name`'s lora_B bias, elements `start..start + len`, through `add`.
    fn each_bias(
        &self,
        (b, s): &(TensorEntry, f32),
        start: u64,
        len: usize,
        add: impl FnOnce(usize, &[f32], f32),
    ) -> Result<()> {
        let size = b.dtype.size() as u64;
        let mut bytes = vec![0u8; len * size as usize];
        self.file.read(b, start * size, &mut bytes)?;
        self.file.record_read(b, start * size, &bytes);
        let mut values = vec![0f32; len];
        super::dtype::decode(b.dtype, &bytes, &mut values);
        add(0, &values, *s);
        Ok(())
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
        if let Some(mag) = &u.magnitude {
            ensure!(
                mag.shape[..] == [m] || mag.shape[..] == [m, 1] || mag.shape[..] == [1, m],
                "{}: DoRA's magnitude vector '{}' is {}, but the base tensor '{name}' has {m} rows",
                self.file.path.display(),
                crate::escape::terminal(&mag.name),
                shape_text(&mag.shape),
            );
        }
        Ok(())
    }

    /// A and B of update `u` as stored (read from the adapter once while cached). Read under
    /// the cache's lock: workers that need the same pair at once wait for one read.
    fn pair(&self, u: &LoraUpdate) -> Result<Arc<Pair>> {
        let mut cache = self.cache.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(p) = &cache.pairs[u.slot] {
            return Ok(p.clone());
        }
        let (a_len, b_len) = (u.a.byte_len() as usize, u.b.byte_len() as usize);
        let size = u.stored_bytes();
        let mut bytes = std::mem::take(&mut cache.spare);
        if bytes.capacity() < size {
            // Grown exactly, the old buffer freed first.
            bytes = Vec::new();
            bytes.reserve_exact(size);
        }
        bytes.clear();
        bytes.resize(size, 0);
        let (a, rest) = bytes.split_at_mut(a_len);
        let (b, m) = rest.split_at_mut(b_len);
        for (e, part) in [(Some(&u.a), a), (Some(&u.b), b), (u.magnitude.as_ref(), m)] {
            if let Some(e) = e {
                self.file.read(e, 0, part)?;
                self.file.record_read(e, 0, part);
            }
        }
        self.pairs_read
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let p = Arc::new(Pair {
            bytes,
            a_len,
            b_len,
        });
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
        let file = self.file.path.display();
        let Some(u) = self.updates.get(name) else {
            let what = self.biases.get(name).map_or("", |(b, _)| &*b.name);
            return crate::error::data(crate::message![
                format!(
                    "{file}: '{}' plus its lora_B bias '{}' is not finite ({value}) at element \
                     {element}; rlmerge refuses NaN and infinity unless ",
                    crate::escape::terminal(name),
                    crate::escape::terminal(what)
                ),
                crate::error::Arg::switch("allow-nonfinite"),
            ]);
        };
        if let Ok(p) = self.pair(u) {
            let parts = [(Some(&u.a), p.a()), (Some(&u.b), p.b())];
            let m = [(u.magnitude.as_ref(), p.m())];
            for (e, bytes) in parts.into_iter().chain(m) {
                let Some(e) = e else { continue };
                if let Some(k) = first_nonfinite(e.dtype, bytes) {
                    return crate::error::data(crate::message![
                        format!(
                            "tensor '{}' in {file} has a non-finite value ({}) at element {k}; \
                             rlmerge refuses NaN and infinity unless ",
                            crate::escape::terminal(&e.name),
                            decode_one(e.dtype, bytes, k)
                        ),
                        crate::error::Arg::switch("allow-nonfinite"),
                    ]);
                }
            }
        }
        crate::error::data(crate::message![
            format!(
                "{file}: the update s·B·A of '{}' is not finite ({value}) at element {element} \
                 (s = {}, rank {}): the adapter's values overflow 32-bit floats; rlmerge refuses \
                 NaN and infinity unless ",
                crate::escape::terminal(name),
                u.scale,
                u.rank
            ),
            crate::error::Arg::switch("allow-nonfinite"),
        ])
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checkpoint::files::ADAPTER_CONFIG;
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
