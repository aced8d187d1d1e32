//! Test helpers, independent of the crate under test: models are written and read with the
//! reference `safetensors` crate and values converted with `half`, so rlmerge's own reader, writer
//! and codecs are checked against outside truth.
#![allow(dead_code)]

pub mod bad_case;
pub mod cases;
pub mod files;
pub mod gpu;
pub mod linalg;
pub mod models;
pub mod processes;
pub mod reference;

#[allow(unused_imports)] // each test binary uses what it needs
pub use bad_case::err_of;
#[allow(unused_imports)] // each test binary uses what it needs
pub use cases::*;
#[allow(unused_imports)] // each test binary uses what it needs
pub use files::*;
#[allow(unused_imports)] // each test binary uses what it needs
pub use gpu::{assert_gpu_close, assert_same, compare, devices, gpu_available};
#[allow(unused_imports)] // each test binary uses what it needs
pub use models::{f32_matrices, matrices};
#[allow(unused_imports)] // each test binary uses what it needs
pub use processes::*;
#[allow(unused_imports)] // each test binary uses what it needs
pub use reference::*;

use half::{bf16, f16};
use safetensors::tensor::{Dtype, SafeTensors, TensorView};
use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

/// The small models of the mergekit fixtures (`tests/fixtures/mergekit/models`).
pub fn models() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/mergekit/models")
}

/// A tensor for a test model; `values` are exactly representable in `dtype`.
#[derive(Clone, Debug)]
pub struct T {
    pub name: String,
    pub dtype: Dtype,
    pub shape: Vec<usize>,
    pub values: Vec<f32>,
}

pub fn size_of(dtype: Dtype) -> usize {
    match dtype {
        Dtype::BF16 | Dtype::F16 => 2,
        Dtype::F32 => 4,
        other => panic!("test helper: no size for {other:?}"),
    }
}

/// Rounds to the nearest value of `dtype` (ties to even).
pub fn round_to(dtype: Dtype, v: f32) -> f32 {
    match dtype {
        Dtype::BF16 => bf16::from_f32(v).to_f32(),
        Dtype::F16 => f16::from_f32(v).to_f32(),
        Dtype::F32 => v,
        other => panic!("test helper: {other:?}"),
    }
}

pub fn to_bytes(dtype: Dtype, values: &[f32]) -> Vec<u8> {
    match dtype {
        Dtype::BF16 => values
            .iter()
            .flat_map(|v| bf16::from_f32(*v).to_le_bytes())
            .collect(),
        Dtype::F16 => values
            .iter()
            .flat_map(|v| f16::from_f32(*v).to_le_bytes())
            .collect(),
        Dtype::F32 => values.iter().flat_map(|v| v.to_le_bytes()).collect(),
        other => panic!("test helper: {other:?}"),
    }
}

pub fn from_bytes(dtype: Dtype, bytes: &[u8]) -> Vec<f32> {
    match dtype {
        Dtype::BF16 => bytes
            .chunks_exact(2)
            .map(|b| bf16::from_le_bytes([b[0], b[1]]).to_f32())
            .collect(),
        Dtype::F16 => bytes
            .chunks_exact(2)
            .map(|b| f16::from_le_bytes([b[0], b[1]]).to_f32())
            .collect(),
        Dtype::F32 => bytes
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect(),
        other => panic!("test helper: {other:?}"),
    }
}

/// Writes a HF model folder with the reference safetensors crate: one file, or `shards` files plus
/// `model.safetensors.index.json`. Also writes a config.json and tokenizer files.
pub fn write_folder(dir: &Path, tensors: &[T], shards: usize) {
    std::fs::create_dir_all(dir).unwrap();
    let bytes: Vec<Vec<u8>> = tensors
        .iter()
        .map(|t| to_bytes(t.dtype, &t.values))
        .collect();
    let meta: HashMap<String, String> = [("format".to_string(), "pt".to_string())].into();
    if shards <= 1 {
        let views: Vec<(String, TensorView)> = tensors
            .iter()
            .zip(&bytes)
            .map(|(t, b)| {
                (
                    t.name.clone(),
                    TensorView::new(t.dtype, t.shape.clone(), b).unwrap(),
                )
            })
            .collect();
        safetensors::tensor::serialize_to_file(views, Some(meta), &dir.join("model.safetensors"))
            .unwrap();
    } else {
        let per = tensors.len().div_ceil(shards);
        let mut weight_map = BTreeMap::new();
        for s in 0..shards {
            let file = format!("model-{:05}-of-{:05}.safetensors", s + 1, shards);
            let views: Vec<(String, TensorView)> = tensors
                .iter()
                .zip(&bytes)
                .skip(s * per)
                .take(per)
                .map(|(t, b)| {
                    weight_map.insert(t.name.clone(), file.clone());
                    (
                        t.name.clone(),
                        TensorView::new(t.dtype, t.shape.clone(), b).unwrap(),
                    )
                })
                .collect();
            safetensors::tensor::serialize_to_file(views, Some(meta.clone()), &dir.join(&file))
                .unwrap();
        }
        let index = serde_json::json!({"metadata": {"total_size": 0}, "weight_map": weight_map});
        std::fs::write(dir.join("model.safetensors.index.json"), index.to_string()).unwrap();
    }
    std::fs::write(
        dir.join("config.json"),
        r#"{"model_type": "llama", "torch_dtype": "bfloat16"}"#,
    )
    .unwrap();
    std::fs::write(dir.join("tokenizer.json"), r#"{"version": "1.0"}"#).unwrap();
    std::fs::write(
        dir.join("generation_config.json"),
        r#"{"do_sample": false}"#,
    )
    .unwrap();
}

/// A read tensor: dtype, shape, raw bytes.
pub type Read = (Dtype, Vec<usize>, Vec<u8>);

/// Reads every tensor of a folder with the reference crate (following the index when present).
pub fn read_folder(dir: &Path) -> BTreeMap<String, Read> {
    let mut files = vec![];
    let index = dir.join("model.safetensors.index.json");
    if index.exists() {
        let v: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&index).unwrap()).unwrap();
        let mut names: Vec<String> = v["weight_map"]
            .as_object()
            .unwrap()
            .values()
            .map(|f| f.as_str().unwrap().to_string())
            .collect();
        names.sort();
        names.dedup();
        files.extend(names.into_iter().map(|n| dir.join(n)));
    } else {
        files.push(dir.join("model.safetensors"));
    }
    let mut out = BTreeMap::new();
    for f in files {
        out.append(&mut read_file(&f));
    }
    out
}

/// Every tensor of one safetensors file.
pub fn read_file(file: &Path) -> BTreeMap<String, Read> {
    let data = std::fs::read(file).unwrap();
    let st = SafeTensors::deserialize(&data).unwrap();
    st.tensors()
        .into_iter()
        .map(|(name, view)| {
            let read = (view.dtype(), view.shape().to_vec(), view.data().to_vec());
            (name, read)
        })
        .collect()
}

/// Writes `tensors` as one safetensors file with the reference crate, no metadata: the twin of
/// [`read_file`], for tests that edit a read file and write it back.
pub fn write_file<'a>(file: &Path, tensors: impl IntoIterator<Item = (&'a String, &'a Read)>) {
    let views: Vec<(String, TensorView)> = tensors
        .into_iter()
        .map(|(name, (dtype, shape, bytes))| {
            (
                name.clone(),
                TensorView::new(*dtype, shape.clone(), bytes).unwrap(),
            )
        })
        .collect();
    safetensors::serialize_to_file(views, None, file).unwrap();
}

/// splitmix64: deterministic test data.
pub struct Rng(pub u64);

impl Rng {
    pub fn u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    pub fn f32(&mut self) -> f32 {
        (self.u64() >> 40) as f32 / (1u64 << 24) as f32
    }
    pub fn chance(&mut self, p: f64) -> bool {
        ((self.u64() >> 11) as f64 / (1u64 << 53) as f64) < p
    }
}

/// Base and agent tensors with planted sparsity: each agent changes each element with its density
/// (so changes overlap partly), by an amount well above ε; a few elements get a sub-ε change that
/// must be reset to the base. Values are representable in `dtype`.
pub fn planted(
    rng: &mut Rng,
    name: &str,
    dtype: Dtype,
    shape: &[usize],
    densities: &[f64],
) -> (T, Vec<T>) {
    let numel: usize = shape.iter().product();
    let base: Vec<f32> = (0..numel)
        .map(|i| {
            if i % 17 == 5 {
                0.0
            } else {
                round_to(dtype, (rng.f32() - 0.5) * 0.2)
            }
        })
        .collect();
    let agents = densities
        .iter()
        .map(|&d| {
            let values = base
                .iter()
                .map(|&b| {
                    if rng.chance(d) {
                        let delta = (rng.f32() - 0.5) * 0.02;
                        let delta = if delta.abs() < 1e-3 { 1e-3 } else { delta };
                        round_to(dtype, b + delta)
                    } else if b == 0.0 && rng.chance(0.3) {
                        // Near ε: below it (every dtype), and in f32 exactly ε (strict ">": not
                        // changed) and the next float above it (changed).
                        let eps = 1e-5f32;
                        match (dtype, rng.u64() % 3) {
                            (Dtype::F32, 0) => eps,
                            (Dtype::F32, 1) => f32::from_bits(eps.to_bits() + 1),
                            _ => round_to(dtype, 4e-6),
                        }
                    } else {
                        b
                    }
                })
                .collect();
            T {
                name: name.into(),
                dtype,
                shape: shape.to_vec(),
                values,
            }
        })
        .collect();
    (
        T {
            name: name.into(),
            dtype,
            shape: shape.to_vec(),
            values: base,
        },
        agents,
    )
}

/// A base folder and agent folders from per-tensor planted data.
pub struct Fixture {
    pub dir: tempfile::TempDir,
    pub base: PathBuf,
    pub agents: Vec<PathBuf>,
    pub base_tensors: Vec<T>,
    pub agent_tensors: Vec<Vec<T>>,
}

pub fn fixture(
    seed: u64,
    dtype: Dtype,
    shapes: &[(&str, Vec<usize>)],
    densities: &[f64],
    base_shards: usize,
) -> Fixture {
    let mut rng = Rng(seed);
    let mut base_tensors = vec![];
    let mut agent_tensors = vec![vec![]; densities.len()];
    for (name, shape) in shapes {
        let (b, a) = planted(&mut rng, name, dtype, shape, densities);
        base_tensors.push(b);
        for (t, at) in a.into_iter().enumerate() {
            agent_tensors[t].push(at);
        }
    }
    // Alternate single-file and sharded agents.
    fixture_of(base_tensors, agent_tensors, base_shards, |t| {
        if t % 2 == 1 {
            2
        } else {
            1
        }
    })
}

/// A fixture of these tensors, written to a fresh folder: the base in `base_shards` shards,
/// agent t in `agent_shards(t)`.
pub fn fixture_of(
    base_tensors: Vec<T>,
    agent_tensors: Vec<Vec<T>>,
    base_shards: usize,
    agent_shards: impl Fn(usize) -> usize,
) -> Fixture {
    let dir = tempfile::tempdir().unwrap();
    let base = dir.path().join("base");
    write_folder(&base, &base_tensors, base_shards);
    let agents: Vec<PathBuf> = (0..agent_tensors.len())
        .map(|t| {
            let p = dir.path().join(format!("agent{t}"));
            write_folder(&p, &agent_tensors[t], agent_shards(t));
            p
        })
        .collect();
    Fixture {
        dir,
        base,
        agents,
        base_tensors,
        agent_tensors,
    }
}

/// Tensor shapes that are not a multiple of anything: odd lengths, tiny vectors, 2-D matrices.
pub fn odd_shapes() -> Vec<(&'static str, Vec<usize>)> {
    vec![
        ("model.embed_tokens.weight", vec![37, 29]),
        ("model.layers.0.self_attn.q_proj.weight", vec![31, 17]),
        ("model.layers.0.mlp.up_proj.weight", vec![1013]),
        ("model.layers.0.input_layernorm.weight", vec![3]),
        ("lm_head.weight", vec![1]),
    ]
}

/// Agent densities for up to 8 agents: sparse, dense and in between, so changes partly overlap.
pub const DENSITIES: [f64; 8] = [0.03, 0.46, 0.54, 0.2, 0.7, 0.1, 0.9, 0.33];

/// Panics with the first differing element (decoded) unless `got` equals `want`.
pub fn assert_same_bytes(what: &str, dtype: Dtype, got: &[u8], want: &[u8]) {
    if got == want {
        return;
    }
    assert_eq!(got.len(), want.len(), "{what}: byte lengths differ");
    let s = size_of(dtype);
    let e = (0..got.len() / s)
        .find(|&e| got[e * s..(e + 1) * s] != want[e * s..(e + 1) * s])
        .expect("unequal slices of equal length differ somewhere");
    panic!(
        "{what} differs first at element {e}: got {:?} want {:?}",
        from_bytes(dtype, &got[e * s..(e + 1) * s]),
        from_bytes(dtype, &want[e * s..(e + 1) * s])
    );
}

pub fn rlmerge() -> assert_cmd::Command {
    assert_cmd::Command::cargo_bin("rlmerge").unwrap()
}

/// `rlmerge merge --base BASE --model A …`, for the caller to add the rest.
pub fn merge_of<P: AsRef<std::ffi::OsStr>>(
    base: impl AsRef<std::ffi::OsStr>,
    agents: impl IntoIterator<Item = P>,
) -> assert_cmd::Command {
    let mut cmd = rlmerge();
    cmd.arg("merge").arg("--base").arg(base);
    for a in agents {
        cmd.arg("--model").arg(a);
    }
    cmd
}

/// Runs `rlmerge merge` with the fixture's inputs plus `extra` args into `out`.
pub fn merge_cmd(f: &Fixture, out: &Path, extra: &[&str]) -> assert_cmd::Command {
    let mut cmd = merge_of(&f.base, &f.agents);
    cmd.arg("--quiet").arg("-o").arg(out).args(extra);
    cmd
}

/// The methods with CLI parameters that exercise each part of the core (tests/recipes.rs,
/// tests/gpu_methods.rs, tests/spectral_scale.rs).
pub const METHODS: [(&str, &[&str]); 16] = [
    ("linear", &["weight=0.7"]),
    ("task_arithmetic", &["weight=0.6", "lambda=1.3"]),
    ("ties", &["weight=1", "density=0.4"]),
    ("dare_linear", &["weight=0.8", "density=0.5"]),
    ("dare_ties", &["weight=1", "density=0.6"]),
    ("breadcrumbs", &["weight=1", "density=0.7", "gamma=0.05"]),
    (
        "breadcrumbs_ties",
        &["weight=0.9", "density=0.5", "gamma=0.1", "normalize=true"],
    ),
    ("model_stock", &[]),
    ("model_stock", &["filter_wise=true"]),
    (
        "ties",
        &[
            "weight=0.5",
            "density=0.3",
            "rescale=true",
            "normalize=false",
        ],
    ),
    ("multislerp", &["weight=0.4"]),
    ("karcher", &[]),
    ("sce", &["select_topk=0.4"]),
    ("sce", &[]),
    ("della", &["weight=1", "density=0.5", "epsilon=0.2"]),
    ("della_linear", &["weight=0.7", "density=0.4"]),
];

pub fn method_args(method: &str, params: &[&str]) -> Vec<String> {
    let mut v = vec![
        "--method".to_string(),
        method.to_string(),
        "--seed".into(),
        "3".into(),
    ];
    for p in params {
        v.push("--param".into());
        v.push(p.to_string());
    }
    v
}

/// A hash of the names and bytes of the files in `dir` (faults and safety tests).
pub fn digest(dir: &Path) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    files.sort();
    let mut h = std::hash::DefaultHasher::new();
    for f in files {
        f.file_name().hash(&mut h);
        std::fs::read(&f).unwrap().hash(&mut h);
    }
    h.finish()
}

pub fn input_digests(f: &Fixture) -> Vec<u64> {
    std::iter::once(&f.base)
        .chain(&f.agents)
        .map(|d| digest(d))
        .collect()
}

/// A tokenizer.json's vocabulary (the model's and the added tokens) by token.
pub fn tokenizer_vocab(file: &Path) -> HashMap<String, usize> {
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(file).unwrap()).unwrap();
    let mut v: HashMap<String, usize> = json["model"]["vocab"]
        .as_object()
        .unwrap()
        .iter()
        .map(|(t, i)| (t.clone(), i.as_u64().unwrap() as usize))
        .collect();
    for a in json["added_tokens"].as_array().unwrap() {
        v.insert(
            a["content"].as_str().unwrap().into(),
            a["id"].as_u64().unwrap() as usize,
        );
    }
    v
}

/// Base folder `base` with the PEFT adapter in `adapter` merged into it by hand, as PEFT defines
/// it and in the f32 order rlmerge promises (SPEC §5): element (i, j) += s·Σ_k B[i,k]·A[k,j]
/// (embedding adapters: (B·A)ᵀ), k ascending, no fused multiply-add, with s = `scale(module, r)`;
/// for a DoRA module (a `lora_magnitude_vector` m), then each row i times m_i / ‖row i‖, the norm
/// the square root of the row's squares summed in f64, rounded to f32, the factor and product in
/// f32. Written to `out` in f32, one shard, with the base's config — the independent reference of
/// the LoRA tests (merged with `--raw-f32-agents`: its f32 values are the update, not fp32
/// master weights to round to the base's dtype).
pub fn lora_merged_by_hand(
    base: &Path,
    adapter: &Path,
    out: &Path,
    scale: &dyn Fn(&str, usize) -> f32,
) {
    let lora = read_file(&adapter.join("adapter_model.safetensors"));
    let mut tensors = Vec::new();
    for (name, (dt, shape, bytes)) in &read_folder(base) {
        let mut w = from_bytes(*dt, bytes);
        let module = name.strip_suffix(".weight").unwrap_or(name);
        let key = |m: &str| format!("base_model.model.{module}.{m}");
        let pair = match (
            lora.get(&key("lora_A.weight")),
            lora.get(&key("lora_embedding_A")),
        ) {
            (Some(a), _) => Some((a, &lora[&key("lora_B.weight")], false)),
            (None, Some(a)) => Some((a, &lora[&key("lora_embedding_B")], true)),
            (None, None) => None,
        };
        if let Some((a, b, transposed)) = pair {
            let (av, bv) = (from_bytes(a.0, &a.2), from_bytes(b.0, &b.2));
            let (m, n, r) = (shape[0], shape[1], a.1[0]);
            let s = scale(module, r);
            for i in 0..m {
                for j in 0..n {
                    let mut acc = 0.0f32;
                    for k in 0..r {
                        acc += if transposed {
                            av[k * m + i] * bv[j * r + k]
                        } else {
                            bv[i * r + k] * av[k * n + j]
                        };
                    }
                    w[i * n + j] += acc * s;
                }
            }
            if let Some(mag) = lora.get(&key("lora_magnitude_vector")) {
                let mag = from_bytes(mag.0, &mag.2);
                for (row, &m) in w.chunks_mut(n).zip(&mag) {
                    let sq: f64 = row.iter().map(|&x| x as f64 * x as f64).sum();
                    let factor = m / (sq.sqrt() as f32);
                    row.iter_mut().for_each(|x| *x *= factor);
                }
            }
        }
        tensors.push(T {
            name: name.clone(),
            dtype: Dtype::F32,
            shape: shape.clone(),
            values: w,
        });
    }
    write_folder(out, &tensors, 1);
    // The agent PEFT builds runs with its base's config.
    std::fs::copy(base.join("config.json"), out.join("config.json")).unwrap();
}

/// `rlmerge run` on the CPU, into `out`, of a recipe over the fixture's base and agents: `head`
/// (YAML: `merge_method` and the method's own keys) followed by `base_model` and `models`.
pub fn run_recipe(f: &Fixture, head: &str, out: &Path) {
    let models: String = f
        .agents
        .iter()
        .map(|a| format!("  - model: {}\n", a.display()))
        .collect();
    let recipe = out.with_extension("yml");
    let text = format!("{head}base_model: {}\nmodels:\n{models}", f.base.display());
    std::fs::write(&recipe, text).unwrap();
    rlmerge()
        .args(["run", "-q", "--device", "cpu"])
        .arg(&recipe)
        .arg("-o")
        .arg(out)
        .assert()
        .success();
}

/// θ₀ + Δ for an update computed in f64 by a reference: Δ rounded once to f32, then added in
/// f32 (as the merge adds a host-computed update).
pub fn base_plus(base: &[f32], delta: &[f64]) -> Vec<f32> {
    base.iter().zip(delta).map(|(b, d)| b + *d as f32).collect()
}

/// Each agent's τ = θ_t − θ₀ of the fixture's tensor `i`, in f64.
pub fn taus_of(f: &Fixture, i: usize) -> Vec<Vec<f64>> {
    let base = &f.base_tensors[i].values;
    f.agent_tensors
        .iter()
        .map(|a| {
            a[i].values
                .iter()
                .zip(base)
                .map(|(x, b)| f64::from(x - b))
                .collect()
        })
        .collect()
}

/// Every value of `got` within `rel` of the reference's, relative to max(|want|, 10⁻²) (an SVD
/// method against a reference without an SVD library: both f64, rounded to f32 once).
pub fn assert_close(what: &str, got: &[f32], want: &[f32], rel: f32) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    for (e, (g, w)) in got.iter().zip(want).enumerate() {
        let tol = rel * w.abs().max(1e-2);
        assert!(
            (g - w).abs() <= tol,
            "{what} element {e}: got {g}, the reference {w}"
        );
    }
}

/// A model folder with `tensors` and config `config` (JSON text), at `dir`.
pub fn model_with(dir: &Path, tensors: &[T], config: &str) -> PathBuf {
    write_folder(dir, tensors, 1);
    std::fs::write(dir.join("config.json"), config).unwrap();
    dir.to_path_buf()
}

pub fn t(name: &str, shape: &[usize], v: f32) -> T {
    T {
        name: name.into(),
        dtype: Dtype::BF16,
        shape: shape.to_vec(),
        values: vec![v; shape.iter().product()],
    }
}

/// A bare fixture: base and two agents with a tensor of a hostile name, for analyze and merge.
pub fn small(dir: &Path, agent_names: &[&str]) -> (PathBuf, Vec<PathBuf>) {
    let base = dir.join("base");
    write_folder(
        &base,
        &[t("model.layers.0.mlp.up_proj.weight", &[6, 4], 0.0)],
        1,
    );
    let agents = agent_names
        .iter()
        .enumerate()
        .map(|(i, n)| {
            let a = dir.join(n);
            let mut v = vec![0.0; 24];
            v[i] = 1.0;
            v[10] = 0.5 + i as f32;
            write_folder(
                &a,
                &[T {
                    name: "model.layers.0.mlp.up_proj.weight".into(),
                    dtype: Dtype::BF16,
                    shape: vec![6, 4],
                    values: v,
                }],
                1,
            );
            a
        })
        .collect();
    (base, agents)
}

/// `rlmerge merge` of `agents` onto the mergekit fixtures' base, quiet, into `out`.
pub fn merge_with(agents: &[&Path], out: &Path, args: &[&str]) -> std::process::Output {
    let mut cmd = merge_of(models().join("base"), agents);
    cmd.args(["-q", "-o"]).arg(out).args(args).output().unwrap()
}
