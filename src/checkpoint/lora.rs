//! PEFT LoRA adapters as agents: an adapter folder (`adapter_config.json` +
//! `adapter_model.safetensors`) on the merge's base is the agent θ₀ + s·B·A, computed tile by tile
//! as the merge reads it — never written out. s = lora_alpha / r (rsLoRA: / √r), per module from
//! `rank_pattern` / `alpha_pattern`; with `fan_in_fan_out` (and for embedding adapters) the update
//! is (B·A)ᵀ. Each element's update is Σ_k B[i,k]·A[k,j] in f32, k in order, times s, added to
//! θ₀ in f32: the agent's tiles are f32 (SPEC §5), so both backends see the same values.

use super::dtype::decode;
use super::safetensors_file::{shape_text, Interner, SafetensorsFile, TensorEntry};
use anyhow::{bail, ensure, Context, Result};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

pub const ADAPTER_CONFIG: &str = "adapter_config.json";
pub const ADAPTER_WEIGHTS: &str = "adapter_model.safetensors";

/// Decoded A and B matrices kept at most this many bytes at once, the oldest dropped first (read
/// again if needed). The engine drops a tensor's pair as soon as its tiles are all merged
/// ([`LoraAdapter::forget_one`]), so the cache holds the pairs of the tensors in flight — one per
/// worker at most (a 4096-wide rank-16 pair is 0.5 MiB; 8192 × 28672 at rank 16, 2.3 MiB); this
/// bound only stops many cores on very wide tensors from holding more.
const CACHE_BYTES: usize = 32 << 20;

/// One base tensor's low-rank update.
pub struct LoraUpdate {
    a: TensorEntry,
    b: TensorEntry,
    rank: usize,
    scale: f32,
    /// The update is (B·A)ᵀ (`fan_in_fan_out`, embedding adapters).
    transposed: bool,
}

/// A's rows (r × cols of the update before any transpose) and B as the loops want them: for a
/// plain update B as stored (rows × r), for a transposed one A's columns and B transposed.
struct Decoded {
    /// Plain: A [r, n] row-major. Transposed: A [r, m] row-major.
    a: Vec<f32>,
    /// Plain: B [m, r] row-major. Transposed: Bᵀ [r, n] row-major.
    b: Vec<f32>,
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
}

/// Decoded pairs by tensor name, in the order they were decoded, and their bytes; plus the
/// buffers of pairs dropped, reused for the next ones (the adapter's matrices come in a few
/// shapes), and the raw bytes read, so decoding a pair does not churn the allocator.
#[derive(Default)]
struct Cache {
    pairs: HashMap<String, Arc<Decoded>>,
    order: std::collections::VecDeque<String>,
    bytes: usize,
    spare: Vec<Vec<f32>>,
    raw: Vec<u8>,
}

/// Spare buffers kept at most.
const SPARE: usize = 8;

impl Cache {
    /// A buffer of `len` zeros: the smallest spare that holds it, else a new one.
    fn buffer(&mut self, len: usize) -> Vec<f32> {
        let fit = (0..self.spare.len())
            .filter(|&i| self.spare[i].capacity() >= len)
            .min_by_key(|&i| self.spare[i].capacity());
        let mut v = match fit {
            Some(i) => self.spare.swap_remove(i),
            None => Vec::with_capacity(len),
        };
        v.clear();
        v.resize(len, 0.0);
        v
    }

    /// Removes pair `name`, keeping its buffers when no tile holds it any more.
    fn drop_pair(&mut self, name: &str) {
        let Some(d) = self.pairs.remove(name) else {
            return;
        };
        self.bytes -= (d.a.len() + d.b.len()) * 4;
        if let Ok(d) = Arc::try_unwrap(d) {
            for v in [d.a, d.b] {
                if self.spare.len() < SPARE {
                    self.spare.push(v);
                }
            }
        }
    }
}

#[derive(serde::Deserialize)]
struct AdapterConfig {
    #[serde(default)]
    peft_type: Option<String>,
    r: usize,
    lora_alpha: f64,
    #[serde(default)]
    fan_in_fan_out: bool,
    #[serde(default)]
    use_rslora: bool,
    #[serde(default)]
    use_dora: bool,
    #[serde(default)]
    rank_pattern: HashMap<String, usize>,
    #[serde(default)]
    alpha_pattern: HashMap<String, f64>,
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
        && !dir.join(super::model::SINGLE_FILE).exists()
        && !dir.join(super::model::INDEX_FILE).exists()
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

/// The pattern of `patterns` matching module `name` as PEFT matches them (`(.*\.)?{key}$`; keys
/// are taken literally).
fn pattern_for<'a, T>(patterns: &'a HashMap<String, T>, name: &str) -> Option<&'a T> {
    let mut keys: Vec<&String> = patterns.keys().collect();
    keys.sort();
    keys.into_iter()
        .find(|k| name == k.as_str() || name.ends_with(&format!(".{k}")))
        .map(|k| &patterns[k])
}

impl LoraAdapter {
    /// Opens adapter folder `dir`: its config, and every lora_A/lora_B pair of its weights.
    pub fn open(dir: &Path, interner: &mut Interner) -> Result<LoraAdapter> {
        let config_path = dir.join(ADAPTER_CONFIG);
        super::model::check_regular_file(&config_path)?;
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
        let (file, entries) = SafetensorsFile::open_interned(&dir.join(ADAPTER_WEIGHTS), interner)?;
        let mut pairs: HashMap<String, (Option<TensorEntry>, Option<TensorEntry>, bool)> =
            HashMap::new();
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
            let rank = *pattern_for(&config.rank_pattern, &module).unwrap_or(&config.r);
            let alpha = *pattern_for(&config.alpha_pattern, &module).unwrap_or(&config.lora_alpha);
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
            updates.insert(
                format!("{module}.weight"),
                LoraUpdate {
                    a,
                    b,
                    rank,
                    scale: scale as f32,
                    transposed: config.fan_in_fan_out || embedding,
                },
            );
        }
        ensure!(
            !updates.is_empty(),
            "{}: the adapter has no lora_A/lora_B matrices",
            file.path.display()
        );
        Ok(LoraAdapter {
            dir: dir.to_path_buf(),
            file,
            updates,
            cache: Mutex::new(Cache::default()),
            pairs_read: Default::default(),
        })
    }

    /// Drops every decoded pair (the engine calls this when the tensors in flight are done).
    pub fn forget(&self) {
        *self.cache.lock().unwrap_or_else(|e| e.into_inner()) = Cache::default();
    }

    /// How many A/B pairs were read from the adapter so far.
    pub fn pairs_read(&self) -> usize {
        self.pairs_read.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// How many tensors the adapter updates.
    pub fn len(&self) -> usize {
        self.updates.len()
    }

    pub fn is_empty(&self) -> bool {
        self.updates.is_empty()
    }

    /// Drops the decoded A and B of update `name` (its tensor's tiles are all merged).
    pub fn forget_one(&self, name: &str) {
        let mut cache = self.cache.lock().unwrap_or_else(|e| e.into_inner());
        if cache.pairs.contains_key(name) {
            cache.drop_pair(name);
            cache.order.retain(|n| n != name);
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

    /// A and B of update `name`, decoded (read from the adapter once while cached). Decoded
    /// under the cache's lock: workers that need the same pair at once wait for one read.
    fn decoded(&self, name: &str, u: &LoraUpdate) -> Result<Arc<Decoded>> {
        let mut cache = self.cache.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(d) = cache.pairs.get(name) {
            return Ok(d.clone());
        }
        let read = |cache: &mut Cache, e: &TensorEntry| -> Result<Vec<f32>> {
            let mut raw = std::mem::take(&mut cache.raw);
            raw.resize(e.byte_len() as usize, 0);
            self.file.read(e, 0, &mut raw)?;
            self.file.record_read(e, 0, &raw);
            let mut v = cache.buffer(e.numel);
            decode(e.dtype, &raw, &mut v);
            cache.raw = raw;
            Ok(v)
        };
        self.pairs_read
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let a = read(&mut cache, &u.a)?;
        let mut b = read(&mut cache, &u.b)?;
        if u.transposed {
            // Bᵀ [r, n] from B [n, r].
            let n = u.b.shape[0];
            let mut t = cache.buffer(b.len());
            for j in 0..n {
                for k in 0..u.rank {
                    t[k * n + j] = b[j * u.rank + k];
                }
            }
            let b_stored = std::mem::replace(&mut b, t);
            if cache.spare.len() < SPARE {
                cache.spare.push(b_stored);
            }
        }
        let d = Arc::new(Decoded { a, b });
        let size = |d: &Decoded| (d.a.len() + d.b.len()) * 4;
        while cache.bytes + size(&d) > CACHE_BYTES {
            let Some(old) = cache.order.pop_front() else {
                break;
            };
            cache.drop_pair(&old);
        }
        if cache.pairs.insert(name.to_string(), d.clone()).is_none() {
            cache.bytes += size(&d);
            cache.order.push_back(name.to_string());
        }
        Ok(d)
    }

    /// Adds update `name` to `values`, elements `start..start + values.len()` of the base tensor
    /// of `shape` ([m, n]) in f32: for element (i, j), s·Σ_k B[i,k]·A[k,j] (transposed:
    /// s·Σ_k B[j,k]·A[k,i]), k ascending, no fused multiply-add.
    pub fn add_update(
        &self,
        name: &str,
        shape: &[usize],
        start: u64,
        values: &mut [f32],
    ) -> Result<()> {
        let u = &self.updates[name];
        let d = self.decoded(name, u)?;
        let (r, n) = (u.rank, shape[1]);
        // Runs of one row's columns, at most ACC long (no allocation per call).
        const ACC: usize = 1024;
        let mut acc = [0.0f32; ACC];
        let mut at = 0usize;
        while at < values.len() {
            let e = start as usize + at;
            let (i, j0) = (e / n, e % n);
            let len = (n - j0).min(values.len() - at).min(ACC);
            let acc = &mut acc[..len];
            acc.iter_mut().for_each(|x| *x = 0.0);
            // One output row: Σ_k c_k · row_k[j] over the row's columns, k in order.
            for k in 0..r {
                let (c, row) = if u.transposed {
                    // (B·A)ᵀ[i, j] = Σ_k A[k, i] · Bᵀ[k, j].
                    (d.a[k * shape[0] + i], &d.b[k * n + j0..k * n + j0 + len])
                } else {
                    (d.b[i * r + k], &d.a[k * n + j0..k * n + j0 + len])
                };
                for (x, &y) in acc.iter_mut().zip(row) {
                    *x += c * y;
                }
            }
            for (v, &x) in values[at..at + len].iter_mut().zip(acc.iter()) {
                *v += x * u.scale;
            }
            at += len;
        }
        Ok(())
    }
}
