//! Downloads from the Hugging Face hub's HTTP API (or any server speaking it: `HF_ENDPOINT`): only the
//! files a model needs, resumable (`Range`), checked against the sizes and sha256 the hub lists, and
//! atomic: files land in `<dest>.partial/` and the folder is renamed into place only when complete.

use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{bail, Context, Result};
use sha2::{Digest, Sha256};

use super::resolve::RepoId;

/// The hub's base URL: `HF_ENDPOINT`, default `https://huggingface.co`.
pub fn endpoint() -> String {
    std::env::var("HF_ENDPOINT").unwrap_or_else(|_| "https://huggingface.co".into()).trim_end_matches('/').to_string()
}

fn agent() -> ureq::Agent {
    ureq::AgentBuilder::new().timeout_connect(Duration::from_secs(15)).timeout_read(Duration::from_secs(60)).build()
}

fn with_auth(req: ureq::Request) -> ureq::Request {
    match std::env::var("HF_TOKEN").or_else(|_| std::env::var("HUGGING_FACE_HUB_TOKEN")) {
        Ok(t) if !t.is_empty() => req.set("Authorization", &format!("Bearer {t}")),
        _ => req,
    }
}

/// A downloaded file whose content is not what the hub lists: the download is discarded.
#[derive(Debug, thiserror::Error)]
#[error("{path}: sha256 {got} does not match the hub's {want}; the download was discarded")]
pub struct HashMismatch {
    pub path: String,
    pub got: String,
    pub want: String,
}

/// A file of the repo as the hub lists it.
#[derive(Debug, Clone)]
pub struct RemoteFile {
    pub path: String,
    pub size: u64,
    /// sha256 of the content for LFS files (weights); None for small git files.
    pub sha256: Option<String>,
}

/// Files a model folder needs; everything else in a repo (READMEs, images, other formats) is skipped.
/// sentence-transformers models also need their module list and pooling config (`1_Pooling/config.json`).
pub fn is_needed(path: &str) -> bool {
    if let Some((dir, file)) = path.split_once('/') {
        return dir.ends_with("_Pooling") && file == "config.json";
    }
    matches!(
        path,
        "config.json"
            | "generation_config.json"
            | "tokenizer.json"
            | "tokenizer_config.json"
            | "special_tokens_map.json"
            | "chat_template.jinja"
            | "chat_template.json"
            | "model.safetensors.index.json"
            | "modules.json"
            | "config_sentence_transformers.json"
            | "sentence_bert_config.json"
    ) || path.ends_with(".safetensors")
}

fn http_error(repo: &RepoId, what: &str, e: ureq::Error) -> anyhow::Error {
    match e {
        ureq::Error::Status(401 | 403, _) => anyhow::anyhow!(
            "{what}: the hub refused access to `{}` (gated or private): accept its licence on the hub and set HF_TOKEN",
            repo.full()
        ),
        ureq::Error::Status(404, _) => anyhow::anyhow!("{what}: `{}` was not found on {}", repo.full(), endpoint()),
        ureq::Error::Status(code, r) => {
            anyhow::anyhow!("{what}: {} answered HTTP {code} {}", endpoint(), r.status_text())
        }
        ureq::Error::Transport(t) => {
            anyhow::anyhow!("{what}: cannot reach {} ({t}); set HF_HUB_OFFLINE=1 to use only local models", endpoint())
        }
    }
}

/// A revision as one segment of a hub URL (`refs/pr/1` → `refs%2Fpr%2F1`, as huggingface_hub
/// quotes it); revisions hold no other character that needs quoting (see `check_revision`).
fn url_revision(revision: &str) -> String {
    revision.replace('/', "%2F")
}

/// The repo's files at `revision` (hub tree API).
pub fn list_files(repo: &RepoId, revision: &str) -> Result<Vec<RemoteFile>> {
    // Recursive: sentence-transformers keep their pooling config in a subfolder.
    let url = format!(
        "{}/api/models/{}/{}/tree/{}?recursive=true",
        endpoint(),
        repo.owner,
        repo.name,
        url_revision(revision)
    );
    let resp = with_auth(agent().get(&url)).call().map_err(|e| http_error(repo, "listing files", e))?;
    let text = resp.into_string().context("reading the hub's file list")?;
    let v: serde_json::Value = serde_json::from_str(&text).context("the hub's file list is not JSON")?;
    let entries = v.as_array().context("the hub's file list is not a JSON array")?;
    Ok(entries
        .iter()
        .filter(|e| e.get("type").and_then(|t| t.as_str()) == Some("file"))
        .filter_map(|e| {
            let path = e.get("path")?.as_str()?.to_string();
            let lfs = e.get("lfs");
            let size = lfs.and_then(|l| l.get("size")).or_else(|| e.get("size")).and_then(|s| s.as_u64()).unwrap_or(0);
            let sha256 = lfs.and_then(|l| l.get("oid")).and_then(|o| o.as_str()).map(str::to_string);
            Some(RemoteFile { path, size, sha256 })
        })
        .collect())
}

fn sha256_file(path: &Path) -> Result<String> {
    let mut f = std::fs::File::open(path)?;
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f.read(&mut buf)?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
    }
    Ok(h.finalize().iter().map(|b| format!("{b:02x}")).collect())
}

/// Downloads one file into `dir`, resuming a `.part` left by an earlier attempt.
fn fetch_file(
    repo: &RepoId,
    revision: &str,
    file: &RemoteFile,
    dir: &Path,
    bar: &indicatif::ProgressBar,
) -> Result<()> {
    let dest = dir.join(&file.path);
    if let Some(parent) = dest.parent() {
        std::fs::create_dir_all(parent).with_context(|| format!("creating {}", parent.display()))?;
    }
    if dest.is_file() && std::fs::metadata(&dest)?.len() == file.size {
        bar.inc(file.size);
        return Ok(());
    }
    let part = dir.join(format!("{}.part", file.path));
    let have = std::fs::metadata(&part).map(|m| m.len()).unwrap_or(0);
    let url = format!("{}/{}/{}/resolve/{}/{}", endpoint(), repo.owner, repo.name, url_revision(revision), file.path);
    let mut req = with_auth(agent().get(&url));
    if have > 0 && have < file.size {
        req = req.set("Range", &format!("bytes={have}-"));
    }
    let resp = req.call().map_err(|e| http_error(repo, &format!("downloading {}", file.path), e))?;
    let resumed = resp.status() == 206;
    let mut out = std::fs::OpenOptions::new()
        .create(true)
        .write(true)
        .append(resumed)
        .truncate(!resumed)
        .open(&part)
        .with_context(|| format!("writing {}", part.display()))?;
    bar.inc(if resumed { have } else { 0 });
    let mut reader = resp.into_reader();
    let mut buf = vec![0u8; 1 << 16];
    loop {
        let n = reader.read(&mut buf).with_context(|| {
            format!("downloading {}: the connection broke; run the command again to resume", file.path)
        })?;
        if n == 0 {
            break;
        }
        out.write_all(&buf[..n])?;
        bar.inc(n as u64);
    }
    out.flush()?;
    drop(out);
    let got = std::fs::metadata(&part)?.len();
    if got != file.size {
        bail!("downloading {}: got {got} of {} bytes; run the command again to resume", file.path, file.size);
    }
    if let Some(want) = &file.sha256 {
        let have = sha256_file(&part)?;
        if &have != want {
            std::fs::remove_file(&part).ok();
            return Err(HashMismatch { path: file.path.clone(), got: have, want: want.clone() }.into());
        }
    }
    std::fs::rename(&part, &dest)?;
    Ok(())
}

/// Downloads `repo` at `revision` into `dest` (atomically) and returns `dest`.
pub fn download(repo: &RepoId, revision: &str, dest: &Path) -> Result<PathBuf> {
    let files: Vec<RemoteFile> = list_files(repo, revision)?.into_iter().filter(|f| is_needed(&f.path)).collect();
    if !files.iter().any(|f| f.path == "config.json") || !files.iter().any(|f| f.path.ends_with(".safetensors")) {
        bail!("`{}` has no config.json + *.safetensors; it is not a model mlxcel can run", repo.full());
    }
    let partial =
        dest.with_file_name(format!("{}.partial", dest.file_name().and_then(|n| n.to_str()).unwrap_or("model")));
    std::fs::create_dir_all(&partial).with_context(|| format!("creating {}", partial.display()))?;
    let total: u64 = files.iter().map(|f| f.size).sum();
    let bar = indicatif::ProgressBar::new(total);
    bar.set_style(
        indicatif::ProgressStyle::with_template("{msg} [{bar:30}] {bytes}/{total_bytes} {bytes_per_sec} eta {eta}")
            .unwrap()
            .progress_chars("=> "),
    );
    bar.set_message(format!("downloading {}", repo.full()));
    for f in &files {
        if let Err(e) = fetch_file(repo, revision, f, &partial, &bar) {
            bar.abandon();
            // A corrupt download leaves nothing behind; a broken connection keeps its .part to resume.
            if e.downcast_ref::<HashMismatch>().is_some() {
                std::fs::remove_dir_all(&partial).ok();
            }
            return Err(e);
        }
    }
    bar.finish_and_clear();
    let meta = serde_json::json!({"repo": repo.full(), "revision": revision, "endpoint": endpoint(), "files": files.iter().map(|f| &f.path).collect::<Vec<_>>()});
    std::fs::write(partial.join(".mlxcel-source.json"), serde_json::to_vec_pretty(&meta)?)?;
    if let Some(parent) = dest.parent() {
        std::fs::create_dir_all(parent)?;
    }
    std::fs::rename(&partial, dest).with_context(|| format!("moving {} into place", dest.display()))?;
    Ok(dest.to_path_buf())
}

#[cfg(test)]
mod tests {
    use super::is_needed;

    #[test]
    fn sentence_transformers_side_files_are_downloaded_and_other_folders_skipped() {
        for p in [
            "config.json",
            "model.safetensors",
            "modules.json",
            "sentence_bert_config.json",
            "config_sentence_transformers.json",
            "1_Pooling/config.json",
        ] {
            assert!(is_needed(p), "{p}");
        }
        for p in ["README.md", "onnx/model.onnx", "onnx/config.json", "1_Pooling/other.json", "a/1_Pooling/config.json"]
        {
            assert!(!is_needed(p), "{p}");
        }
    }
}
