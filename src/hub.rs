//! Models named by Hugging Face Hub id (`org/name`, `org/name@revision`) wherever a model is
//! named. A path that exists is a folder; otherwise an id is looked up in the local Hugging Face
//! cache — `HF_HUB_CACHE`, else `HF_HOME/hub`, else `~/.cache/huggingface/hub`, in the layout the
//! official client writes (`models--org--name/refs/<rev>` → `snapshots/<commit>/`) — and, unless
//! `HF_HUB_OFFLINE` is set, downloaded into that same cache with the `hf-hub` crate: only the
//! files a merge needs, honouring `HF_TOKEN` and `HF_ENDPOINT`. A snapshot folder names its id
//! and commit ([`id_of_snapshot`]), which the merge record keeps.

use anyhow::{bail, Context, Result};
use std::path::{Path, PathBuf};

/// The Hub's address unless `HF_ENDPOINT` says otherwise.
pub const DEFAULT_ENDPOINT: &str = "https://huggingface.co";

/// A model id with the revision asked for (`main` when none).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ModelId {
    /// The user or organization (`Qwen` in `Qwen/Qwen2.5-7B`).
    pub org: String,
    /// The repository name.
    pub name: String,
    /// A branch, tag or commit (`main` when none was given).
    pub revision: String,
}

impl ModelId {
    /// `org/name` or `org/name@revision`; `None` for anything else (a path).
    pub fn parse(text: &str) -> Option<ModelId> {
        let (repo, revision) = match text.split_once('@') {
            Some((repo, rev)) => (repo, rev),
            None => (text, "main"),
        };
        let (org, name) = repo.split_once('/')?;
        let part = |p: &str| {
            !p.is_empty()
                && p != "."
                && p != ".."
                && !p.starts_with('-')
                && p.chars()
                    .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
        };
        let rev_ok = !revision.is_empty()
            && !revision.split('/').any(|s| s.is_empty() || s == "..")
            && revision
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.' | '/'));
        (part(org) && part(name) && rev_ok).then(|| ModelId {
            org: org.into(),
            name: name.into(),
            revision: revision.into(),
        })
    }

    /// `org/name`.
    pub fn repo(&self) -> String {
        format!("{}/{}", self.org, self.name)
    }

    /// The repository's folder in the cache.
    pub fn cache_folder(&self, cache: &Path) -> PathBuf {
        cache.join(format!("models--{}--{}", self.org, self.name))
    }
}

impl std::fmt::Display for ModelId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}@{}", self.org, self.name, self.revision)
    }
}

/// The Hugging Face cache: `HF_HUB_CACHE`, else `HF_HOME/hub`, else `~/.cache/huggingface/hub`.
pub fn cache_dir() -> PathBuf {
    let var = |k: &str| {
        std::env::var_os(k)
            .filter(|v| !v.is_empty())
            .map(PathBuf::from)
    };
    if let Some(dir) = var("HF_HUB_CACHE") {
        return dir;
    }
    if let Some(home) = var("HF_HOME") {
        return home.join("hub");
    }
    var("HOME")
        .unwrap_or_else(|| PathBuf::from("."))
        .join(".cache")
        .join("huggingface")
        .join("hub")
}

/// Whether `HF_HUB_OFFLINE` forbids downloads (1, true, yes, on — as the Python client reads it).
pub fn offline() -> bool {
    std::env::var("HF_HUB_OFFLINE").is_ok_and(|v| {
        matches!(
            v.trim().to_ascii_lowercase().as_str(),
            "1" | "true" | "yes" | "on"
        )
    })
}

fn is_commit(rev: &str) -> bool {
    rev.len() == 40 && rev.chars().all(|c| c.is_ascii_hexdigit())
}

/// Whether a snapshot folder holds weights (a download may have stopped before them).
fn has_weights(dir: &Path) -> bool {
    use crate::checkpoint::files::WeightFormat;
    WeightFormat::ALL
        .iter()
        .any(|f| dir.join(f.single_file()).is_file() || dir.join(f.index_file()).is_file())
}

/// The cached snapshot of `id` (its folder and commit), if the cache has one with weights.
pub fn cached(id: &ModelId, cache: &Path) -> Option<(PathBuf, String)> {
    let repo = id.cache_folder(cache);
    let commit = if is_commit(&id.revision) {
        id.revision.to_ascii_lowercase()
    } else {
        // A ref holds a commit, nothing else: not a path that would send the id elsewhere.
        let commit = std::fs::read_to_string(repo.join("refs").join(&id.revision))
            .ok()?
            .trim()
            .to_ascii_lowercase();
        if !is_commit(&commit) {
            return None;
        }
        commit
    };
    let dir = repo.join("snapshots").join(&commit);
    has_weights(&dir).then_some((dir, commit))
}

/// `org/name@commit` of a folder inside a Hugging Face cache (`…/models--org--name/snapshots/
/// <commit>`), as the record keeps it.
pub fn id_of_snapshot(dir: &Path) -> Option<String> {
    let commit = dir.file_name()?.to_str()?;
    let snapshots = dir.parent()?;
    if snapshots.file_name()? != "snapshots" || !is_commit(commit) {
        return None;
    }
    let repo = snapshots.parent()?.file_name()?.to_str()?;
    let (org, name) = repo.strip_prefix("models--")?.split_once("--")?;
    Some(format!("{org}/{name}@{commit}"))
}

/// The files of a repository listing `files` that a merge needs: [`needed`], and where the
/// repository has no safetensors weights, its `torch.save` ones (`pytorch_model*.bin`, their
/// index, `adapter_model.bin`) — as transformers chooses.
pub fn wanted<'a>(files: &[&'a str]) -> Vec<&'a str> {
    let safetensors = files
        .iter()
        .any(|f| needed(f) && f.ends_with(".safetensors"));
    let torch = |f: &str| {
        !f.contains('/')
            && ((f.starts_with("pytorch_model") && f.ends_with(".bin"))
                || f == crate::checkpoint::files::TORCH_INDEX_FILE
                || f == crate::checkpoint::files::ADAPTER_TORCH_WEIGHTS)
    };
    files
        .iter()
        .copied()
        .filter(|f| needed(f) || (!safetensors && torch(f)))
        .collect()
}

/// Files of a repository a merge needs: safetensors weights, their index, config, tokenizer and
/// generation files (not other formats' weights, images or training state).
pub fn needed(file: &str) -> bool {
    if file.contains('/') {
        return false;
    }
    file.ends_with(".safetensors")
        || matches!(
            file,
            "model.safetensors.index.json"
                | "config.json"
                | "adapter_config.json"
                | "generation_config.json"
                | "special_tokens_map.json"
                | "added_tokens.json"
                | "vocab.json"
                | "vocab.txt"
                | "merges.txt"
                | "chat_template.jinja"
                | "chat_template.json"
        )
        || file.starts_with("tokenizer")
}

/// A model as a user names it — a folder, a Hub id (the cache's snapshot, downloaded first unless
/// HF_HUB_OFFLINE), or BASE+ADAPTER (a LoRA agent), each part found as a model is ([`locate`]) —
/// as a local path.
pub fn locate_model(model: &Path, progress: bool) -> Result<PathBuf> {
    match model
        .to_str()
        .and_then(crate::checkpoint::lora::split_reference)
    {
        Some((b, a)) => {
            let b = locate(Path::new(b), progress)?;
            let a = locate(Path::new(a), progress)?;
            Ok(PathBuf::from(format!("{}+{}", b.display(), a.display())))
        }
        None => locate(model, progress),
    }
}

/// Where a model named `name` is. The rule (README "Hub ids"): an existing local folder wins,
/// and when its name is also an id the cache holds a note on stderr says the folder was taken; otherwise an
/// id is taken from the cache, or downloaded into it (with a progress bar when `progress`); a
/// name that is neither gets an error saying both facts — no folder of that name here, and why
/// the id could not be had.
pub fn locate(name: &Path, progress: bool) -> Result<PathBuf> {
    let id = name.to_str().and_then(ModelId::parse);
    if name.exists() {
        // Said when the name is also an id the cache holds: the one case where the user may
        // have meant the other.
        if let Some(id) = id.as_ref().filter(|id| cached(id, &cache_dir()).is_some()) {
            eprintln!(
                "note: {} is a local folder, taken instead of the Hub id {} (write ./{} or an \
                 absolute path to say so)",
                crate::escape::terminal(&name.display().to_string()),
                id.repo(),
                id.repo()
            );
        }
        return Ok(name.to_path_buf());
    }
    let Some(id) = id else {
        return Ok(name.to_path_buf());
    };
    let no_folder = |why: String| {
        anyhow::anyhow!(
            "no folder {} here ({}), and the Hub id {id} could not be fetched: {why}",
            crate::escape::terminal(&name.display().to_string()),
            std::env::current_dir().map_or_else(|_| ".".into(), |d| d.display().to_string())
        )
    };
    let cache = cache_dir();
    if let Some((dir, _)) = cached(&id, &cache) {
        return Ok(dir);
    }
    // `org/` is a local folder: the name is most likely a mistyped path, not an id to download.
    if let Some(parent) = name.parent().filter(|p| p.is_dir()) {
        return Err(crate::error::usage(format!(
            "{} is neither a folder nor a Hub id in the cache{}: no folder of that name in {} \
             ({}); as {} is a local folder it is not looked up on the Hub (to use the Hub's \
             model, download it into the cache first: hf download {})",
            crate::escape::terminal(&name.display().to_string()),
            crate::error::sibling_hint(name),
            parent.display(),
            std::env::current_dir().map_or_else(|_| ".".into(), |d| d.display().to_string()),
            parent.display(),
            id.repo()
        )));
    }
    if offline() {
        return Err(no_folder(format!(
            "the Hugging Face cache has no snapshot of it with weights (looked in {}), and \
             HF_HUB_OFFLINE is set, so it is not downloaded",
            id.cache_folder(&cache).display()
        )));
    }
    download_watched(&id, &cache, progress).map_err(|e| {
        no_folder(format!(
            "downloading it into {} failed: {}",
            cache.display(),
            crate::escape::terminal(&format!("{e:#}"))
        ))
    })
}

/// Seconds without an answer after which a download gives up: `HF_HUB_DOWNLOAD_TIMEOUT`, as the
/// official client reads it, else its default of 10.
pub fn download_timeout() -> std::time::Duration {
    let secs = std::env::var("HF_HUB_DOWNLOAD_TIMEOUT")
        .ok()
        .and_then(|v| v.trim().parse::<f64>().ok())
        .filter(|s| s.is_finite() && *s > 0.0)
        .unwrap_or(10.0);
    std::time::Duration::from_secs_f64(secs.min(86_400.0))
}

/// [`download`] on a thread of its own, given up when the server stops answering: the hf-hub
/// client sets no socket timeouts, so a server that accepts and never answers would hang it.
/// Each new byte in the repository's cache folder counts as an answer; [`download_timeout`]
/// seconds without one — or a stop request of the job ([`crate::cancel`]) — end the wait with an
/// error (the stalled request is left to the process's exit).
fn download_watched(id: &ModelId, cache: &Path, progress: bool) -> Result<PathBuf> {
    let limit = download_timeout();
    let token = crate::cancel::current();
    let (tx, rx) = std::sync::mpsc::channel();
    {
        let (id, cache) = (id.clone(), cache.to_path_buf());
        std::thread::spawn(move || {
            let _ = tx.send(download(&id, &cache, progress));
        });
    }
    let folder = id.cache_folder(cache);
    let mut seen = bytes_under(&folder);
    let mut last = std::time::Instant::now();
    loop {
        match rx.recv_timeout(std::time::Duration::from_millis(100)) {
            Ok(result) => return result,
            Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => {
                bail!("the download stopped without a result")
            }
            Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {}
        }
        token.check()?;
        let now = bytes_under(&folder);
        if now != seen {
            (seen, last) = (now, std::time::Instant::now());
        } else if last.elapsed() >= limit {
            bail!(
                "{} did not answer for {:.0} s (HF_HUB_DOWNLOAD_TIMEOUT sets this limit)",
                endpoint(),
                limit.as_secs_f64()
            );
        }
    }
}

/// Bytes of the files under `dir` (a repository's cache folder: a few dozen files).
fn bytes_under(dir: &Path) -> u64 {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return 0;
    };
    entries
        .flatten()
        .map(|e| match e.file_type() {
            Ok(t) if t.is_dir() => bytes_under(&e.path()),
            Ok(t) if t.is_file() => e.metadata().map_or(0, |m| m.len()),
            _ => 0,
        })
        .sum()
}

/// `HF_ENDPOINT`, else the Hub.
fn endpoint() -> String {
    std::env::var("HF_ENDPOINT")
        .ok()
        .filter(|e| !e.is_empty())
        .unwrap_or_else(|| DEFAULT_ENDPOINT.into())
}

/// A client error as one line: the innermost cause (the network's own words), once — hf-hub's
/// errors repeat their source's text at each level.
fn network_error(e: hf_hub::api::sync::ApiError) -> anyhow::Error {
    let mut inner: &dyn std::error::Error = &e;
    while let Some(next) = inner.source() {
        inner = next;
    }
    anyhow::anyhow!("{inner}")
}

/// Downloads the files a merge needs of `id` into the cache; returns the snapshot folder.
fn download(id: &ModelId, cache: &Path, progress: bool) -> Result<PathBuf> {
    use hf_hub::api::sync::ApiBuilder;
    use hf_hub::{Cache, Repo, RepoType};
    let endpoint = endpoint();
    let store = Cache::new(cache.to_path_buf());
    let token = std::env::var("HF_TOKEN")
        .ok()
        .filter(|t| !t.is_empty())
        .or_else(|| store.token());
    let api = ApiBuilder::from_cache(store)
        .with_endpoint(endpoint.trim_end_matches('/').to_string())
        .with_token(token)
        .with_progress(progress)
        .with_retries(2)
        .build()
        .map_err(network_error)?;
    let repo = api.repo(Repo::with_revision(
        id.repo(),
        RepoType::Model,
        id.revision.clone(),
    ));
    let info = repo
        .info()
        .map_err(network_error)
        .with_context(|| format!("cannot read {id}'s file list from {endpoint}"))?;
    let listed: Vec<&str> = info.siblings.iter().map(|s| s.rfilename.as_str()).collect();
    let files = wanted(&listed);
    if !files
        .iter()
        .any(|f| f.ends_with(".safetensors") || f.ends_with(".bin"))
    {
        bail!("{id} has no .safetensors or pytorch_model.bin weights on {endpoint}");
    }
    for file in &files {
        repo.download(file)
            .map_err(network_error)
            .with_context(|| format!("downloading {file} of {id}"))?;
    }
    let dir = id.cache_folder(cache).join("snapshots").join(&info.sha);
    if !has_weights(&dir) {
        bail!(
            "the download of {id} left no weights in {} (the server's commit headers do not match its listing)",
            dir.display()
        );
    }
    Ok(dir)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_parse_and_paths_do_not() {
        let id = ModelId::parse("org/model-1.5B@v2").unwrap();
        assert_eq!(
            (id.repo().as_str(), id.revision.as_str()),
            ("org/model-1.5B", "v2")
        );
        assert_eq!(ModelId::parse("org/m").unwrap().revision, "main");
        assert_eq!(
            ModelId::parse("org/m@refs/pr/3").unwrap().revision,
            "refs/pr/3"
        );
        for not_id in [
            "m",
            "/abs/path",
            "./a/b",
            "a/b/c",
            "../m",
            "org/",
            "org/m@",
            "a b/c",
            "org/m@x/../y",
        ] {
            assert_eq!(ModelId::parse(not_id), None, "{not_id}");
        }
    }

    #[test]
    fn snapshot_folders_name_their_id() {
        let c = "0123456789abcdef0123456789abcdef01234567";
        let dir = PathBuf::from(format!("/c/hub/models--org--m-1/snapshots/{c}"));
        assert_eq!(id_of_snapshot(&dir), Some(format!("org/m-1@{c}")));
        assert_eq!(
            id_of_snapshot(Path::new("/c/hub/models--org--m-1/snapshots/main")),
            None
        );
        assert_eq!(id_of_snapshot(Path::new("/tmp/base")), None);
    }

    #[test]
    fn a_merge_needs_weights_config_and_tokenizer_only() {
        for f in [
            "model.safetensors",
            "model-00001-of-00002.safetensors",
            "config.json",
            "tokenizer.json",
            "tokenizer_config.json",
            "generation_config.json",
        ] {
            assert!(needed(f), "{f}");
        }
        for f in [
            "pytorch_model.bin",
            "README.md",
            "onnx/model.onnx",
            "optimizer.pt",
            ".gitattributes",
        ] {
            assert!(!needed(f), "{f}");
        }
        // torch.save weights only where there are no safetensors ones, as transformers loads.
        let both = [
            "model.safetensors",
            "pytorch_model.bin",
            "config.json",
            "optimizer.bin",
        ];
        assert_eq!(wanted(&both), ["model.safetensors", "config.json"]);
        let bins = [
            "pytorch_model-00001-of-00002.bin",
            "pytorch_model-00002-of-00002.bin",
            "pytorch_model.bin.index.json",
            "training_args.bin",
            "config.json",
        ];
        assert_eq!(wanted(&bins), [bins[0], bins[1], bins[2], bins[4]]);
    }
}
