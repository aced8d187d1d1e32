//! A bounded mutation fuzz run of the checkpoint reader on stable Rust: seeds from
//! `tests/fuzz_corpus/` are mutated and opened as model folders; every tensor is then read. Each
//! case must end in Ok or Err — never a panic, a hang or an allocation sized by a number in the file.
//!
//! `RLMERGE_FUZZ_ITERS` sets the mutations per seed (default 4000); the run also stops after
//! `RLMERGE_FUZZ_SECONDS` (default 20). It prints how many cases ran and how they ended.

mod common;
use common::Rng;
use rlmerge::checkpoint::ModelFolder;
use std::path::Path;
use std::time::{Duration, Instant};

fn mutate(rng: &mut Rng, seed: &[u8]) -> Vec<u8> {
    let mut b = seed.to_vec();
    for _ in 0..1 + rng.u64() % 4 {
        if b.is_empty() {
            b.push(rng.u64() as u8);
            continue;
        }
        let i = (rng.u64() % b.len() as u64) as usize;
        match rng.u64() % 8 {
            0 => b[i] ^= 1 << (rng.u64() % 8),
            1 => b[i] = rng.u64() as u8,
            2 => b.truncate(i),
            3 => {
                // Splice a copy of a random run somewhere else.
                let j = (rng.u64() % b.len() as u64) as usize;
                let run: Vec<u8> = b[i..(i + 1 + (rng.u64() % 16) as usize).min(b.len())].to_vec();
                b.splice(j..j, run);
            }
            4 if b[i].is_ascii_digit() => {
                // Grow a number in the header: huge shapes, offsets, lengths.
                let digits: Vec<u8> = (0..1 + rng.u64() % 20)
                    .map(|_| b'0' + (rng.u64() % 10) as u8)
                    .collect();
                b.splice(i..i, digits);
            }
            5 => {
                // A random header length.
                let n = 8.min(b.len());
                b[..n].copy_from_slice(&rng.u64().to_le_bytes()[..n]);
            }
            6 => {
                b[i] = *b"[]{},:\"-0123456789eE."
                    .get((rng.u64() % 21) as usize)
                    .unwrap()
            }
            _ => {
                let j = (rng.u64() % b.len() as u64) as usize;
                b.swap(i, j);
            }
        }
    }
    b
}

/// Opens the folder and reads every tensor in tiles of at most 64 KiB; Ok or Err, never a panic.
fn exercise(dir: &Path) -> Result<(), String> {
    let model = ModelFolder::open(dir).map_err(|e| format!("{e:#}"))?;
    let mut buf = vec![0u8; 64 << 10];
    for t in &model.tensors {
        let len = t.entry.byte_len();
        let mut at = 0;
        while at < len {
            let n = (len - at).min(buf.len() as u64) as usize;
            model
                .read(t, at, &mut buf[..n])
                .map_err(|e| format!("{e:#}"))?;
            at += n as u64;
        }
    }
    Ok(())
}

#[test]
fn reader_survives_mutated_files_and_indexes() {
    let iters: u64 = std::env::var("RLMERGE_FUZZ_ITERS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(4000);
    let budget = Duration::from_secs(
        std::env::var("RLMERGE_FUZZ_SECONDS")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(20),
    );
    let corpus = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fuzz_corpus");
    let mut seeds: Vec<(String, Vec<u8>)> = std::fs::read_dir(&corpus)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| {
            p.extension()
                .is_some_and(|e| e == "safetensors" || e == "json")
        })
        .map(|p| {
            (
                p.file_name().unwrap().to_string_lossy().to_string(),
                std::fs::read(&p).unwrap(),
            )
        })
        .collect();
    seeds.sort();
    assert!(seeds.len() >= 4, "fuzz corpus missing");
    let shard = seeds
        .iter()
        .find(|(n, _)| n.starts_with("bf16"))
        .unwrap()
        .1
        .clone();
    let dir = tempfile::tempdir().unwrap();
    let start = Instant::now();
    let (mut runs, mut rejected) = (0u64, 0u64);
    let mut rng = Rng(0x5eed);
    'seeds: for (name, seed) in &seeds {
        for _ in 0..iters {
            if start.elapsed() > budget {
                break 'seeds;
            }
            let case = dir.path().join(format!("case{runs}"));
            std::fs::create_dir(&case).unwrap();
            let bytes = mutate(&mut rng, seed);
            if name.ends_with(".json") {
                // A mutated index over two intact shards.
                std::fs::write(case.join("model.safetensors.index.json"), &bytes).unwrap();
                std::fs::write(case.join("model-00001-of-00002.safetensors"), &shard).unwrap();
                std::fs::write(case.join("model-00002-of-00002.safetensors"), &shard).unwrap();
            } else {
                std::fs::write(case.join("model.safetensors"), &bytes).unwrap();
            }
            let outcome = std::panic::catch_unwind(|| exercise(&case));
            match outcome {
                Ok(Ok(())) => {}
                Ok(Err(_)) => rejected += 1,
                Err(_) => {
                    let keep = std::env::temp_dir().join(format!("rlmerge-fuzz-crash-{runs}"));
                    let _ = std::fs::rename(&case, &keep);
                    panic!(
                        "reader panicked on a mutation of {name}; the case is kept in {}",
                        keep.display()
                    );
                }
            }
            std::fs::remove_dir_all(&case).unwrap();
            runs += 1;
        }
    }
    eprintln!(
        "fuzz: {runs} cases in {:.1} s, {rejected} rejected with an error, {} accepted, 0 panics",
        start.elapsed().as_secs_f64(),
        runs - rejected
    );
    assert!(runs >= 1000, "only {runs} fuzz cases ran");
}
