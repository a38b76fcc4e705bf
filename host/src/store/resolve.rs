//! Where a model name lives on this machine, and when it must be downloaded.

use std::path::{Path, PathBuf};

use anyhow::{bail, Result};

use super::hub;

/// `owner/name` on the hub.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RepoId {
    pub owner: String,
    pub name: String,
}

impl RepoId {
    /// `owner/name`, or a bare `name` under `MLXCEL_DEFAULT_ORG` (default `mlx-community`).
    pub fn parse(s: &str) -> Result<RepoId> {
        let s = s.trim().trim_end_matches('/');
        let (owner, name) = match s.split_once('/') {
            Some((o, n)) => (o.to_string(), n.to_string()),
            None => (std::env::var("MLXCEL_DEFAULT_ORG").unwrap_or_else(|_| "mlx-community".into()), s.to_string()),
        };
        let ok = |p: &str| {
            !p.is_empty() && p.chars().all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c)) && p != "." && p != ".."
        };
        if !ok(&owner) || !ok(&name) {
            bail!("`{s}` is neither a model folder nor a hub name like owner/name");
        }
        Ok(RepoId { owner, name })
    }

    pub fn full(&self) -> String {
        format!("{}/{}", self.owner, self.name)
    }
}

/// Refuses a revision that is not a git ref name or commit (a branch, tag, commit or `refs/pr/N`):
/// revisions become paths in the store and the Hugging Face cache, so `..` could reach anywhere.
pub fn check_revision(rev: &str) -> Result<()> {
    let ok = rev.len() <= 255
        && rev.chars().all(|c| c.is_ascii_alphanumeric() || "-_./".contains(c))
        && rev.split('/').all(|part| !part.is_empty() && !part.starts_with('.') && !part.ends_with(".lock"))
        && !rev.contains("..");
    if !ok {
        bail!(
            "`{rev}` is not a revision: a branch, tag or commit (letters, digits and `-_./`, no `..` or empty parts)"
        );
    }
    Ok(())
}

#[derive(Debug, Clone, Default)]
pub struct ResolveOptions {
    pub revision: Option<String>,
    /// Never touch the network (also `HF_HUB_OFFLINE=1`).
    pub offline: bool,
}

/// Where a model was found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Resolved {
    Folder(PathBuf),
    HfCache(PathBuf),
    Store(PathBuf),
    Downloaded(PathBuf),
}

impl Resolved {
    pub fn path(&self) -> &Path {
        match self {
            Resolved::Folder(p) | Resolved::HfCache(p) | Resolved::Store(p) | Resolved::Downloaded(p) => p,
        }
    }
}

/// mlxcel's store: `MLXCEL_CACHE_DIR`, default `~/.cache/mlxcel`.
pub fn store_root() -> PathBuf {
    std::env::var_os("MLXCEL_CACHE_DIR").map(PathBuf::from).unwrap_or_else(|| home().join(".cache").join("mlxcel"))
}

fn home() -> PathBuf {
    std::env::var_os("HOME").map(PathBuf::from).unwrap_or_else(|| PathBuf::from("."))
}

/// The Hugging Face hub cache: `HF_HUB_CACHE`, `HF_HOME/hub`, `~/.cache/huggingface/hub`.
pub fn hf_cache_root() -> PathBuf {
    if let Some(p) = std::env::var_os("HF_HUB_CACHE") {
        return PathBuf::from(p);
    }
    if let Some(p) = std::env::var_os("HF_HOME") {
        return PathBuf::from(p).join("hub");
    }
    home().join(".cache").join("huggingface").join("hub")
}

/// A complete snapshot in the HF cache: `models--owner--name/snapshots/<commit>` via `refs/<revision>`
/// (or the revision itself when it is a commit hash).
fn hf_cache_snapshot(repo: &RepoId, revision: &str) -> Option<PathBuf> {
    let base = hf_cache_root().join(format!("models--{}--{}", repo.owner, repo.name));
    let commit = std::fs::read_to_string(base.join("refs").join(revision))
        .map(|s| s.trim().to_string())
        .unwrap_or_else(|_| revision.to_string());
    // A ref file names a commit: anything else (a path) is not followed.
    if !commit.chars().all(|c| c.is_ascii_alphanumeric()) || commit.is_empty() {
        return None;
    }
    let snap = base.join("snapshots").join(commit);
    is_model_folder(&snap).then_some(snap)
}

/// A folder with what a model needs (config and at least one weight file).
pub fn is_model_folder(p: &Path) -> bool {
    p.join("config.json").is_file()
        && std::fs::read_dir(p)
            .map(|d| d.flatten().any(|e| e.path().extension().is_some_and(|x| x == "safetensors")))
            .unwrap_or(false)
}

/// mlxcel's store folder for a repo: `<store>/models/<owner>/<name>` (revision `main`) or
/// `<store>/models/<owner>/<name>@<revision>`, a revision's slashes written `%2F` (`refs/pr/1`
/// stays one folder, which `mlxcel list` finds). The revision must have passed [`check_revision`].
pub fn store_folder(repo: &RepoId, revision: &str) -> PathBuf {
    let leaf =
        if revision == "main" { repo.name.clone() } else { format!("{}@{}", repo.name, revision.replace('/', "%2F")) };
    store_root().join("models").join(&repo.owner).join(leaf)
}

/// A store folder's name as `mlxcel list` shows it and `mlxcel rm` takes it (`name@refs/pr/1`).
pub fn store_leaf_name(leaf: &str) -> String {
    leaf.replace("%2F", "/")
}

pub fn offline_env() -> bool {
    std::env::var("HF_HUB_OFFLINE").is_ok_and(|v| v == "1" || v.eq_ignore_ascii_case("true"))
}

/// Resolves MODEL, downloading it if needed and allowed.
pub fn resolve_model(model: &str, opts: &ResolveOptions) -> Result<Resolved> {
    let p = PathBuf::from(model);
    if p.is_dir() {
        if let Some(rev) = &opts.revision {
            bail!("--revision {rev} applies to hub names, and {model} is a local folder");
        }
        return Ok(Resolved::Folder(p));
    }
    if p.exists() {
        let gguf = if p.extension().is_some_and(|e| e.eq_ignore_ascii_case("gguf")) {
            " (GGUF files are not read: mlxcel runs SafeTensors checkpoints)"
        } else {
            ""
        };
        bail!("{model} is a file{gguf}; MODEL must be a folder with config.json, *.safetensors and tokenizer.json, or a hub name");
    }
    let looks_like_path =
        model.starts_with('.') || model.starts_with('/') || model.starts_with('~') || model.matches('/').count() > 1;
    if looks_like_path {
        bail!("model folder `{model}` does not exist");
    }
    let repo = RepoId::parse(model)?;
    let revision = opts.revision.clone().unwrap_or_else(|| "main".into());
    check_revision(&revision)?;
    if let Some(snap) = hf_cache_snapshot(&repo, &revision) {
        return Ok(Resolved::HfCache(snap));
    }
    let stored = store_folder(&repo, &revision);
    if is_model_folder(&stored) {
        return Ok(Resolved::Store(stored));
    }
    if opts.offline || offline_env() {
        bail!(
            "model `{}` (revision {revision}) is not a local folder, not in the Hugging Face cache ({}) and not in the mlxcel store ({}), and HF_HUB_OFFLINE is set so it cannot be downloaded",
            repo.full(),
            hf_cache_root().display(),
            store_root().join("models").display()
        );
    }
    let dest = hub::download(&repo, &revision, &stored)?;
    Ok(Resolved::Downloaded(dest))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn revisions_are_ref_names_never_paths() {
        for good in ["main", "v2", "refs/pr/1", "0123abcd", "release-1.0_rc"] {
            check_revision(good).unwrap_or_else(|e| panic!("{good}: {e}"));
        }
        for bad in ["", "v2/../../x", "..", "../escaped", "/abs", "a//b", "a/", ".hidden", "a b", "x.lock", "a\\b"] {
            assert!(check_revision(bad).is_err(), "{bad:?} was taken");
        }
        let offline = ResolveOptions { revision: Some("../../x".into()), offline: true };
        let e = resolve_model("owner/m", &offline).unwrap_err().to_string();
        assert!(e.contains("is not a revision"), "{e}");
        let repo = RepoId::parse("t/pr").unwrap();
        let leaf = store_folder(&repo, "refs/pr/1").file_name().unwrap().to_string_lossy().to_string();
        assert_eq!((leaf.as_str(), store_leaf_name(&leaf).as_str()), ("pr@refs%2Fpr%2F1", "pr@refs/pr/1"));
    }

    #[test]
    fn bare_name_means_mlx_community() {
        if std::env::var_os("MLXCEL_DEFAULT_ORG").is_none() {
            assert_eq!(RepoId::parse("Qwen3-0.6B-4bit").unwrap().full(), "mlx-community/Qwen3-0.6B-4bit");
        }
        assert_eq!(RepoId::parse("owner/x").unwrap().full(), "owner/x");
        assert!(RepoId::parse("a/b c").is_err());
    }

    #[test]
    fn a_local_folder_takes_no_revision_and_a_gguf_file_is_named() {
        let dir = tempfile::tempdir().unwrap();
        let folder = dir.path().to_str().unwrap();
        let offline = |revision: Option<&str>| ResolveOptions { revision: revision.map(String::from), offline: true };
        assert!(matches!(resolve_model(folder, &offline(None)), Ok(Resolved::Folder(_))));
        let e = resolve_model(folder, &offline(Some("v2"))).unwrap_err().to_string();
        assert!(e.contains("--revision v2") && e.contains("local folder"), "{e}");
        let gguf = dir.path().join("m.Q4_1.gguf");
        std::fs::write(&gguf, b"GGUF").unwrap();
        let e = resolve_model(gguf.to_str().unwrap(), &offline(None)).unwrap_err().to_string();
        assert!(e.contains("GGUF files are not read"), "{e}");
    }
}
