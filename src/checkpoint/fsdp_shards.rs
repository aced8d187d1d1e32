//! A trainer's sharded checkpoint as verl writes it (`global_step_N/actor/`): one `torch.save`
//! per rank, `model_world_size_W_rank_R.pt`, of a state dict of DTensors — each rank's rows of
//! every tensor (`Shard(0)` on a mesh named `("fsdp",)`, or `("ddp", "fsdp")` with replicas) —
//! beside `huggingface/` (config and tokenizer). Read as verl's own converter
//! (`verl.model_merger merge --backend fsdp`) reads it: a `Shard(0)` tensor is the pieces of the
//! FSDP group's ranks in their mesh order, a `Replicate` one rank 0's, a plain tensor the ranks'
//! pieces in rank order; every value shown as its bf16 rounding (`.bfloat16()`), unless the
//! fp32 masters are asked for as stored. Nothing is gathered: each tensor is its ranks' byte
//! ranges ([`Pieces`]), read tile by tile. A tensor saved under two names (tied embeddings) is
//! read under the first, as transformers saves it.

use super::dtype::DType;
use super::pieces::{Assembled, Piece, Pieces, Stored};
use super::torch_file::{self, dtensor::Placement, FileTensor};
use super::weight_file::{shape_text, Interner, TensorEntry};
use anyhow::{bail, ensure, Context, Result};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// The folder inside a verl checkpoint that holds the config and tokenizer.
pub const HF_FOLDER: &str = "huggingface";

/// The rank files of `dir` in rank order and the world size their names give; `None` where it
/// has none. Names that disagree on the world size, and a missing rank, are refused.
pub fn rank_files(dir: &Path) -> Result<Option<(usize, Vec<PathBuf>)>> {
    let mut found: Vec<(usize, usize, PathBuf)> = Vec::new();
    let listing =
        std::fs::read_dir(dir).with_context(|| format!("cannot list {}", dir.display()))?;
    for entry in listing {
        let entry = entry?;
        let name = entry.file_name().to_string_lossy().into_owned();
        if let Some((world, rank)) = parse_name(&name) {
            found.push((world, rank, entry.path()));
        }
    }
    found.sort();
    let Some(&(world, ..)) = found.first() else {
        return Ok(None);
    };
    if let Some((other, ..)) = found.iter().find(|f| f.0 != world) {
        bail!(
            "{}: rank files of world sizes {world} and {other} side by side: which run is meant \
             is ambiguous",
            dir.display()
        );
    }
    let ranks: Vec<usize> = found.iter().map(|f| f.1).collect();
    if let Some(missing) = (0..world).find(|r| !ranks.contains(r)) {
        bail!(
            "{}: model_world_size_{world}_rank_{missing}.pt is missing ({} of the {world} ranks' \
             files are here)",
            dir.display(),
            ranks.len()
        );
    }
    ensure!(
        ranks.len() == world,
        "{}: {} rank files for a world of {world}",
        dir.display(),
        ranks.len()
    );
    Ok(Some((world, found.into_iter().map(|f| f.2).collect())))
}

/// `model_world_size_W_rank_R.pt` → (W, R).
fn parse_name(name: &str) -> Option<(usize, usize)> {
    let rest = name
        .strip_prefix("model_world_size_")?
        .strip_suffix(".pt")?;
    let (world, rank) = rest.split_once("_rank_")?;
    let digits = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
    (digits(world) && digits(rank)).then(|| Some((world.parse().ok()?, rank.parse().ok()?)))?
}

/// The folder's tensors as one model, and its rank files (every one, in rank order; the
/// tensors' pieces name them by index). `raw_f32`: values as stored, not as their bf16 rounding.
/// Also returns the names read under another (tied weights: the later name, and the one kept).
pub fn open(
    dir: &Path,
    paths: &[PathBuf],
    interner: &mut Interner,
    raw_f32: bool,
) -> Result<Assembled> {
    let mut files = Vec::with_capacity(paths.len());
    let mut ranks = Vec::with_capacity(paths.len());
    for path in paths {
        let (file, tensors) = torch_file::read(path, interner)?;
        files.push(file);
        ranks.push(tensors);
    }
    let group = fsdp_group(dir, &ranks)?;
    let by_name: Vec<HashMap<&str, &FileTensor>> = ranks
        .iter()
        .map(|r| r.iter().map(|t| (&*t.entry.name, t)).collect())
        .collect();
    let lead = group[0];
    for &r in &group[1..] {
        if let Some(t) = ranks[lead]
            .iter()
            .find(|t| !by_name[r].contains_key(&*t.entry.name))
        {
            bail!(
                "{}: rank {r}'s file lacks '{}', which rank {lead}'s holds",
                paths[r].display(),
                t.entry.name
            );
        }
        ensure!(
            ranks[r].len() == ranks[lead].len(),
            "{}: rank {r}'s file holds {} tensors, rank {lead}'s {}",
            paths[r].display(),
            ranks[r].len(),
            ranks[lead].len()
        );
    }
    let mut tensors = Vec::with_capacity(ranks[lead].len());
    let mut aliases = Vec::new();
    // Bytes, size and shape of each tensor read so far: a second name for them is an alias.
    let mut seen: HashMap<Bytes, Arc<str>> = HashMap::new();
    for t in &ranks[lead] {
        let key = (t.entry.offset, t.entry.numel, t.entry.shape.clone());
        if t.entry.numel > 0 {
            if let Some(first) = seen.get(&key) {
                aliases.push((t.entry.name.clone(), first.clone()));
                continue;
            }
            seen.insert(key, t.entry.name.clone());
        }
        let pieces: Vec<(usize, &FileTensor)> = group
            .iter()
            .map(|&r| (r, by_name[r][&*t.entry.name]))
            .collect();
        let tensor = assemble(&pieces, raw_f32, interner)
            .with_context(|| format!("{}: tensor '{}'", dir.display(), t.entry.name))?;
        tensors.push(tensor);
    }
    let hf = dir.join(HF_FOLDER);
    let world = paths.len();
    Ok(Assembled {
        files,
        tensors,
        aliases,
        skipped: Vec::new(),
        described: format!(
            "verl FSDP shards ({world} ranks' model_world_size_{world}_rank_*.pt, {} per tensor)",
            group.len()
        ),
        config_dir: if hf.is_dir() { hf } else { dir.to_path_buf() },
    })
}

/// Where a tensor's bytes are in a file: offset, element count, shape.
type Bytes = (u64, usize, Arc<[usize]>);

/// The ranks whose pieces make a tensor, in piece order: every rank on a `("fsdp",)` mesh, the
/// first replica's on a `("ddp", "fsdp")` one — by the mesh coordinate each file records, else
/// by rank.
fn fsdp_group(dir: &Path, ranks: &[Vec<FileTensor>]) -> Result<Vec<usize>> {
    let spec_of = |r: usize| ranks[r].iter().find_map(|t| t.dtensor.as_ref());
    let Some(spec) = spec_of(0) else {
        return Ok((0..ranks.len()).collect());
    };
    let dims: Vec<&str> = spec.mesh_dims.iter().map(String::as_str).collect();
    if dims != ["fsdp"] && dims != ["ddp", "fsdp"] {
        bail!(
            "{}: a device mesh of dimensions {dims:?}; rlmerge reads verl's FSDP meshes \
             [\"fsdp\"] and [\"ddp\", \"fsdp\"], as its converter does (tensor parallelism is \
             not read)",
            dir.display()
        );
    }
    let mut placed = Vec::with_capacity(ranks.len());
    for r in 0..ranks.len() {
        let coordinate = match spec_of(r).and_then(|s| s.coordinate.clone()) {
            Some(c) if c.len() == dims.len() => c,
            None if dims.len() == 1 => vec![r as i64],
            _ => bail!(
                "{}: rank {r}'s file does not record its place on the {dims:?} mesh",
                dir.display()
            ),
        };
        if dims.len() == 1 || coordinate[0] == 0 {
            placed.push((coordinate[dims.len() - 1], r));
        }
    }
    placed.sort_unstable();
    for (i, &(c, r)) in placed.iter().enumerate() {
        ensure!(
            c == i as i64,
            "{}: rank {r} is at fsdp coordinate {c}, where {i} was expected (ranks missing or \
             placed twice)",
            dir.display()
        );
    }
    Ok(placed.into_iter().map(|(_, r)| r).collect())
}

/// One tensor from its pieces `(rank, piece)` in group order, checked against the whole
/// tensor's spec.
fn assemble(
    pieces: &[(usize, &FileTensor)],
    raw_f32: bool,
    interner: &mut Interner,
) -> Result<(TensorEntry, Arc<Pieces>, usize)> {
    let first = pieces[0].1;
    let stored = first.entry.dtype;
    let layout = |p: &FileTensor| {
        p.dtensor
            .as_ref()
            .map(|s| (s.shape.clone(), s.placements.clone()))
    };
    for (r, p) in pieces {
        ensure!(
            p.entry.dtype == stored,
            "rank {r} stores it as {}, rank {} as {stored}",
            p.entry.dtype,
            pieces[0].0
        );
        ensure!(
            layout(p) == layout(first),
            "rank {r} and rank {} disagree on its shape or placement",
            pieces[0].0
        );
    }
    let placement = match &first.dtensor {
        None => Placement::Shard(0),
        Some(spec) => match &spec.placements[..] {
            [p] => p.clone(),
            [Placement::Replicate, p] => p.clone(),
            other => bail!("placements {other:?} (verl's converter reads Shard and Replicate)"),
        },
    };
    let rows: usize = pieces
        .iter()
        .map(|(_, p)| p.entry.shape.first().copied().unwrap_or(1))
        .sum();
    let shape: Vec<usize> = match &first.dtensor {
        Some(spec) => spec.shape.clone(),
        None => {
            let mut s = first.entry.shape.to_vec();
            ensure!(!s.is_empty(), "a scalar cut over ranks");
            s[0] = rows;
            s
        }
    };
    let used: &[(usize, &FileTensor)] = match placement {
        Placement::Shard(0) => {
            check_rows(pieces, &shape, rows)?;
            pieces
        }
        Placement::Replicate => {
            ensure!(
                *first.entry.shape == shape[..],
                "a replicated piece of {}, not {}",
                shape_text(&first.entry.shape),
                shape_text(&shape)
            );
            &pieces[..1]
        }
        Placement::Shard(d) => bail!(
            "cut along dimension {d} (Shard({d})); FSDP cuts along dimension 0, the only cut \
             rlmerge reads"
        ),
        Placement::Other(class) => {
            bail!("placed as {class}; verl's converter reads Shard and Replicate")
        }
    };
    let numel: usize = shape.iter().product();
    let shown = if raw_f32 { stored } else { DType::BF16 };
    let parts: Box<[Piece]> = used
        .iter()
        .map(|&(r, p)| Piece {
            file: r,
            offset: p.entry.offset,
            numel: p.entry.numel as u64,
        })
        .collect();
    let entry = TensorEntry {
        name: first.entry.name.clone(),
        dtype: shown,
        shape: interner.shape(shape),
        offset: first.entry.offset,
        numel,
    };
    Ok((
        entry,
        Arc::new(Pieces {
            stored: Stored::Plain(stored),
            parts,
        }),
        used[0].0,
    ))
}

/// Each piece is rows of the whole `shape`, and the pieces' `rows` are all of them.
fn check_rows(pieces: &[(usize, &FileTensor)], shape: &[usize], rows: usize) -> Result<()> {
    for (r, p) in pieces {
        ensure!(
            !p.entry.shape.is_empty() && p.entry.shape[1..] == shape[1..],
            "rank {r}'s piece is {}, not rows of {}",
            shape_text(&p.entry.shape),
            shape_text(shape)
        );
    }
    ensure!(
        rows == shape[0],
        "its ranks' pieces hold {rows} rows of the {} its shape {} has",
        shape[0],
        shape_text(shape)
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checkpoint::ModelFolder;

    fn fixture() -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/verl")
    }

    /// verl-style shards torch 2.15 wrote (FSDP2 over 2 gloo ranks, fp32 masters, 101 rows of
    /// embeddings cut 51 + 50) read as the folder verl's rule converts them to
    /// (`converted.safetensors`, written by python/tests/test_verl.py's `verls_rule`): every
    /// tensor's bf16 bytes equal; the tied head read once; the files' checksums those of the
    /// whole files.
    #[test]
    fn shards_read_as_verls_converter_writes_them() {
        let actor = fixture().join("actor");
        let m = ModelFolder::open(&actor).unwrap();
        let converted = fixture().join("converted.safetensors");
        let (file, want) =
            crate::checkpoint::safetensors_file::open(&converted, &mut Interner::default())
                .unwrap();
        assert_eq!(m.tensors.len(), want.len());
        assert_eq!(m.aliases.len(), 1);
        assert_eq!(
            (&*m.aliases[0].0, &*m.aliases[0].1),
            ("lm_head.weight", "model.embed_tokens.weight")
        );
        assert_eq!(m.config_dir(), actor.join(HF_FOLDER));
        for w in &want {
            let t = m.get(&w.name).unwrap();
            assert_eq!(
                (t.entry.dtype, &t.entry.shape),
                (DType::BF16, &w.shape),
                "{}",
                w.name
            );
            let mut got = vec![0u8; t.entry.byte_len() as usize];
            // In two reads across the ranks' boundary, as tiles read it.
            let cut = (got.len() / 2) & !1;
            let (a, b) = got.split_at_mut(cut);
            m.read(t, 0, a).unwrap();
            m.read(t, cut as u64, b).unwrap();
            let mut expect = vec![0u8; w.byte_len() as usize];
            file.read(w, 0, &mut expect).unwrap();
            assert!(got == expect, "{}", w.name);
        }
        let embed = m.get("model.embed_tokens.weight").unwrap();
        let rows: Vec<u64> = embed
            .pieces
            .as_ref()
            .unwrap()
            .parts
            .iter()
            .map(|p| p.numel / 32)
            .collect();
        assert_eq!(rows, [51, 50]);
        for (sum, path) in m.checksums().unwrap().iter().zip(&paths_of(&actor)) {
            assert_eq!(
                sum.crc32,
                crate::checkpoint::weight_file::crc32_of_file(path)
                    .unwrap()
                    .crc32
            );
        }
        // The masters as stored: f32, each piece's values.
        let raw = ModelFolder::open_with(&actor, &mut Interner::default(), true).unwrap();
        assert_eq!(
            raw.get("model.norm.weight").unwrap().entry.dtype,
            DType::F32
        );
    }

    fn paths_of(actor: &Path) -> Vec<PathBuf> {
        rank_files(actor).unwrap().unwrap().1
    }

    #[test]
    fn rank_file_names_are_read_strictly() {
        assert_eq!(parse_name("model_world_size_8_rank_3.pt"), Some((8, 3)));
        for bad in [
            "model_world_size_8_rank_3.pt.bak",
            "model_world_size__rank_3.pt",
            "model_world_size_8_rank_-1.pt",
            "optim_world_size_8_rank_3.pt",
            "model_world_size_8_rank_3x.pt",
        ] {
            assert_eq!(parse_name(bad), None, "{bad}");
        }
    }
}
