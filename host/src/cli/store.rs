//! `mlxcel list`, `mlxcel download`, `mlxcel rm`: the models on this machine.

use std::io::Write;
use std::path::{Path, PathBuf};

use anyhow::{bail, Result};
use clap::Args;
use serde_json::{json, Value};

use crate::store::resolve::{check_revision, hf_cache_root, is_model_folder, store_folder, store_leaf_name};
use crate::store::{resolve_model, store_root, RepoId, ResolveOptions, Resolved};

#[derive(Args, Debug)]
pub struct ListArgs {
    /// One JSON array on stdout.
    #[arg(long)]
    pub json: bool,
}

#[derive(Args, Debug)]
pub struct DownloadArgs {
    /// `owner/name`, or a bare name for `mlx-community/<name>` (MLXCEL_DEFAULT_ORG changes the owner).
    pub name: String,
    /// Branch, tag or commit.
    #[arg(long)]
    pub revision: Option<String>,
}

#[derive(Args, Debug)]
pub struct RmArgs {
    /// A model in the store, by its hub name (as `mlxcel list` shows it: `owner/name`, or
    /// `owner/name@revision` for another revision than main).
    pub name: String,
    /// The revision to remove (branch, tag or commit; default: main).
    #[arg(long)]
    pub revision: Option<String>,
    /// Do not ask.
    #[arg(short = 'y', long)]
    pub yes: bool,
}

fn folder_size(p: &Path) -> u64 {
    std::fs::read_dir(p)
        .map(|d| {
            d.flatten().filter_map(|e| std::fs::metadata(e.path()).ok()).filter(|m| m.is_file()).map(|m| m.len()).sum()
        })
        .unwrap_or(0)
}

fn describe(name: String, source: &str, path: PathBuf) -> Value {
    let cfg: Value = std::fs::read_to_string(path.join("config.json"))
        .ok()
        .and_then(|s| serde_json::from_str(&s).ok())
        .unwrap_or(Value::Null);
    let arch = cfg
        .get("text_config")
        .and_then(|t| t.get("model_type"))
        .or_else(|| cfg.get("model_type"))
        .cloned()
        .unwrap_or(Value::Null);
    let quant = cfg.get("quantization").map(|q| {
        format!(
            "{}-bit g{}",
            q.get("bits").and_then(Value::as_u64).unwrap_or(0),
            q.get("group_size").and_then(Value::as_u64).unwrap_or(0)
        )
    });
    json!({"name": name, "source": source, "architecture": arch, "quantization": quant, "size_bytes": folder_size(&path), "path": path.display().to_string()})
}

/// Every model in the mlxcel store and the Hugging Face cache.
pub fn installed() -> Vec<Value> {
    let mut out = Vec::new();
    let models = store_root().join("models");
    for owner in std::fs::read_dir(&models).into_iter().flatten().flatten() {
        for m in std::fs::read_dir(owner.path()).into_iter().flatten().flatten() {
            let name = m.file_name().to_string_lossy().to_string();
            if name.ends_with(".partial") || !is_model_folder(&m.path()) {
                continue;
            }
            let name = format!("{}/{}", owner.file_name().to_string_lossy(), store_leaf_name(&name));
            out.push(describe(name, "mlxcel", m.path()));
        }
    }
    for repo in std::fs::read_dir(hf_cache_root()).into_iter().flatten().flatten() {
        let dir = repo.file_name().to_string_lossy().to_string();
        let Some(rest) = dir.strip_prefix("models--") else { continue };
        let name = rest.replacen("--", "/", 1);
        for snap in std::fs::read_dir(repo.path().join("snapshots")).into_iter().flatten().flatten() {
            if is_model_folder(&snap.path()) {
                out.push(describe(name.clone(), "huggingface-cache", snap.path()));
            }
        }
    }
    out
}

pub fn list(args: &ListArgs) -> Result<()> {
    let models = installed();
    if args.json {
        println!("{}", serde_json::to_string_pretty(&models)?);
        return Ok(());
    }
    if models.is_empty() {
        println!("no models yet: `mlxcel download NAME` or `mlxcel run NAME`");
        return Ok(());
    }
    println!("{:<45} {:>9} {:<12} {:<10} PATH", "NAME", "SIZE", "QUANT", "ARCH");
    for m in models {
        println!(
            "{:<45} {:>7.0}MB {:<12} {:<10} {}",
            m["name"].as_str().unwrap_or(""),
            m["size_bytes"].as_u64().unwrap_or(0) as f64 / 1e6,
            m["quantization"].as_str().unwrap_or("-"),
            m["architecture"].as_str().unwrap_or("?"),
            m["path"].as_str().unwrap_or("")
        );
    }
    Ok(())
}

pub fn download(args: &DownloadArgs) -> Result<()> {
    let r = resolve_model(&args.name, &ResolveOptions { revision: args.revision.clone(), offline: false })?;
    let how = match &r {
        Resolved::Folder(_) => "local folder",
        Resolved::HfCache(_) => "already in the Hugging Face cache",
        Resolved::Store(_) => "already downloaded",
        Resolved::Downloaded(_) => "downloaded",
    };
    println!("{} ({how})", r.path().display());
    if !r.path().join("tokenizer.json").is_file() {
        // Every command needs it; a repo that ships only the older tokenizer files cannot run here.
        eprintln!("warning: {} has no tokenizer.json, which mlxcel needs to run it", r.path().display());
    }
    Ok(())
}

pub fn rm(args: &RmArgs) -> Result<()> {
    // `owner/name@revision`, as `list` shows it.
    let (name, revision) = match (args.name.split_once('@'), &args.revision) {
        (Some(_), Some(r)) => bail!("`{}` names a revision and so does --revision {r}: give one", args.name),
        (Some((n, r)), None) => (n, r),
        (None, r) => (args.name.as_str(), r.as_deref().unwrap_or("main")),
    };
    let repo = RepoId::parse(name)?;
    check_revision(revision)?;
    let shown = if revision == "main" { repo.full() } else { format!("{}@{revision}", repo.full()) };
    let dir = store_folder(&repo, revision);
    if !dir.is_dir() {
        bail!(
            "`{shown}` is not in the mlxcel store ({}); models in the Hugging Face cache are managed by Hugging Face tools",
            store_root().join("models").display()
        );
    }
    if !args.yes {
        eprint!("remove {shown} ({:.0} MB) at {}? [y/N] ", folder_size(&dir) as f64 / 1e6, dir.display());
        std::io::stderr().flush().ok();
        let mut answer = String::new();
        if std::io::stdin().read_line(&mut answer)? == 0 {
            eprintln!();
            anyhow::bail!("no answer (stdin is closed); pass --yes to remove without asking");
        }
        if !matches!(answer.trim(), "y" | "Y" | "yes") {
            eprintln!("kept");
            return Ok(());
        }
    }
    std::fs::remove_dir_all(&dir)?;
    println!("removed {shown}");
    Ok(())
}
