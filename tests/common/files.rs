//! Folders a test makes or reads whole: the demo's models, a folder's files with their bytes.

use super::{err_of, rlmerge};
use std::path::Path;

/// The files of `dir` that `keep` takes, each with its bytes, sorted by name.
pub fn files_of(dir: &Path, keep: impl Fn(&Path) -> bool) -> Vec<(String, Vec<u8>)> {
    let mut found: Vec<_> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| keep(p))
        .map(|p| {
            (
                p.file_name().unwrap().to_string_lossy().into(),
                std::fs::read(&p).unwrap(),
            )
        })
        .collect();
    found.sort();
    found
}

/// A fresh folder holding the built-in example's models (and its recipe) in `d/`.
pub fn demo_in_d() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    let o = rlmerge()
        .current_dir(dir.path())
        .args(["demo", "d", "--write-only", "--quiet"])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", err_of(&o));
    dir
}
