//! The model store against a local stand-in for the Hugging Face hub (a small HTTP server in this
//! file serving the hub's tree and resolve routes for a fixture repo): download, resume after a cut
//! connection, hash mismatch rejected with nothing left behind, HF cache reuse, bare names, offline.

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;

use sha2::{Digest, Sha256};

fn fixture_dir() -> PathBuf {
    mlxcel::testing::workspace_root().join("families/llama/tests/fixtures/qwen2-q4")
}

#[derive(Default)]
struct Behaviour {
    /// Cut the first download of a weight file halfway.
    cut_once: AtomicBool,
    /// Report a wrong sha256 for weight files.
    wrong_hash: AtomicBool,
    range_requests: AtomicUsize,
}

/// Serves `repos` (name → folder) like the hub. Returns the base URL.
fn hub(repos: Vec<(&'static str, PathBuf)>, b: Arc<Behaviour>) -> String {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let repos: HashMap<String, PathBuf> = repos.into_iter().map(|(k, v)| (k.to_string(), v)).collect();
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(mut s) = stream else { continue };
            let mut reader = BufReader::new(s.try_clone().unwrap());
            let mut line = String::new();
            if reader.read_line(&mut line).is_err() {
                continue;
            }
            let path = line.split_whitespace().nth(1).unwrap_or("/").to_string();
            let mut range: Option<u64> = None;
            loop {
                let mut h = String::new();
                if reader.read_line(&mut h).is_err() || h.trim().is_empty() {
                    break;
                }
                if let Some(v) = h.to_ascii_lowercase().strip_prefix("range: bytes=") {
                    range = v.trim().trim_end_matches('-').parse().ok();
                }
            }
            let respond = |s: &mut std::net::TcpStream, status: &str, body: &[u8], extra: &str| {
                let _ = write!(
                    s,
                    "HTTP/1.1 {status}\r\nContent-Length: {}\r\nConnection: close\r\n{extra}\r\n",
                    body.len()
                );
                let _ = s.write_all(body);
            };
            let parts: Vec<&str> = path.trim_start_matches('/').split('/').collect();
            if parts.len() >= 6 && parts[0] == "api" && parts[1] == "models" && parts[4] == "tree" {
                let Some(dir) = repos.get(&format!("{}/{}", parts[2], parts[3])) else {
                    respond(&mut s, "404 Not Found", b"{\"error\":\"Repository not found\"}", "");
                    continue;
                };
                let mut entries = vec![serde_json::json!({"type": "file", "path": "README.md", "size": 5})];
                for e in std::fs::read_dir(dir).unwrap().flatten() {
                    let name = e.file_name().to_string_lossy().to_string();
                    let bytes = std::fs::read(e.path()).unwrap();
                    let mut entry = serde_json::json!({"type": "file", "path": name, "size": bytes.len()});
                    if name.ends_with(".safetensors") {
                        let mut sha: String = Sha256::digest(&bytes).iter().map(|b| format!("{b:02x}")).collect();
                        if b.wrong_hash.load(Ordering::SeqCst) {
                            sha = "0".repeat(64);
                        }
                        entry["lfs"] = serde_json::json!({"oid": sha, "size": bytes.len()});
                    }
                    entries.push(entry);
                }
                respond(
                    &mut s,
                    "200 OK",
                    serde_json::to_string(&entries).unwrap().as_bytes(),
                    "Content-Type: application/json\r\n",
                );
            } else if parts.len() >= 5 && parts[2] == "resolve" {
                let Some(dir) = repos.get(&format!("{}/{}", parts[0], parts[1])) else {
                    respond(&mut s, "404 Not Found", b"", "");
                    continue;
                };
                let file = dir.join(parts[4..].join("/"));
                let Ok(bytes) = std::fs::read(&file) else {
                    respond(&mut s, "404 Not Found", b"", "");
                    continue;
                };
                if let Some(start) = range {
                    b.range_requests.fetch_add(1, Ordering::SeqCst);
                    let body = &bytes[start as usize..];
                    let cr = format!("Content-Range: bytes {start}-{}/{}\r\n", bytes.len() - 1, bytes.len());
                    respond(&mut s, "206 Partial Content", body, &cr);
                } else if file.extension().is_some_and(|e| e == "safetensors")
                    && b.cut_once.swap(false, Ordering::SeqCst)
                {
                    // Promise the whole file, send half, hang up.
                    let _ =
                        write!(s, "HTTP/1.1 200 OK\r\nContent-Length: {}\r\nConnection: close\r\n\r\n", bytes.len());
                    let _ = s.write_all(&bytes[..bytes.len() / 2]);
                    let _ = s.flush();
                    let _ = s.shutdown(std::net::Shutdown::Both);
                } else {
                    respond(&mut s, "200 OK", &bytes, "");
                }
            } else {
                respond(&mut s, "404 Not Found", b"", "");
            }
            let mut sink = Vec::new();
            let _ = reader.read_to_end(&mut sink);
        }
    });
    url
}

struct Env {
    _tmp: tempfile::TempDir,
    store: PathBuf,
    hf: PathBuf,
}

fn env() -> Env {
    let tmp = tempfile::tempdir().unwrap();
    let store = tmp.path().join("mlxcel");
    let hf = tmp.path().join("hf");
    std::fs::create_dir_all(&hf).unwrap();
    Env { store, hf, _tmp: tmp }
}

fn mlxcel(e: &Env, endpoint: &str) -> Command {
    mlxcel::testing::staged_plugin_dir();
    let mut c = Command::new(env!("CARGO_BIN_EXE_mlxcel"));
    c.env("MLXCEL_CACHE_DIR", &e.store)
        .env("HF_HUB_CACHE", &e.hf)
        .env("HF_ENDPOINT", endpoint)
        .env_remove("HF_HUB_OFFLINE")
        .env_remove("MLXCEL_DEFAULT_ORG")
        .env_remove("MLXCEL_PLUGIN_PATH")
        .env_remove("RUST_BACKTRACE");
    c
}

fn ok(out: &Output) -> String {
    assert!(out.status.success(), "failed: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).to_string()
}

#[test]
fn download_fetches_only_model_files_and_then_runs_offline() {
    let e = env();
    let url = hub(vec![("someone/tiny", fixture_dir())], Arc::default());
    ok(&mlxcel(&e, &url).args(["download", "someone/tiny"]).output().unwrap());
    let dir = e.store.join("models/someone/tiny");
    assert!(dir.join("model.safetensors").is_file() && dir.join("config.json").is_file());
    assert!(!dir.join("README.md").exists(), "only model files are downloaded");
    assert!(!e.store.join("models/someone/tiny.partial").exists());
    // From the store, with the network off.
    let out = mlxcel(&e, "http://127.0.0.1:9")
        .env("HF_HUB_OFFLINE", "1")
        .args(["run", "someone/tiny", "-p", "hi", "-n", "2", "--no-chat-template"])
        .output()
        .unwrap();
    ok(&out);
    let list = ok(&mlxcel(&e, &url).args(["list", "--json"]).output().unwrap());
    let v: serde_json::Value = serde_json::from_str(&list).unwrap();
    assert!(v.as_array().unwrap().iter().any(|m| m["name"] == "someone/tiny" && m["architecture"] == "qwen2"));
    ok(&mlxcel(&e, &url).args(["rm", "someone/tiny", "--yes"]).output().unwrap());
    assert!(!dir.exists());
}

#[test]
fn cut_connection_resumes_with_a_range_request() {
    let e = env();
    let b = Arc::new(Behaviour::default());
    b.cut_once.store(true, Ordering::SeqCst);
    let url = hub(vec![("someone/tiny", fixture_dir())], b.clone());
    let first = mlxcel(&e, &url).args(["download", "someone/tiny"]).output().unwrap();
    assert!(!first.status.success(), "the cut download must fail");
    let err = String::from_utf8_lossy(&first.stderr);
    assert!(err.contains("again to resume"), "{err}");
    assert!(!e.store.join("models/someone/tiny").exists(), "a half download is never visible as a model");
    assert!(e.store.join("models/someone/tiny.partial/model.safetensors.part").is_file());
    ok(&mlxcel(&e, &url).args(["download", "someone/tiny"]).output().unwrap());
    assert!(b.range_requests.load(Ordering::SeqCst) >= 1, "the second attempt resumes with Range");
    let got = std::fs::read(e.store.join("models/someone/tiny/model.safetensors")).unwrap();
    assert_eq!(got, std::fs::read(fixture_dir().join("model.safetensors")).unwrap());
}

#[test]
fn hash_mismatch_is_rejected_and_nothing_is_left_behind() {
    let e = env();
    let b = Arc::new(Behaviour::default());
    b.wrong_hash.store(true, Ordering::SeqCst);
    let url = hub(vec![("someone/tiny", fixture_dir())], b);
    let out = mlxcel(&e, &url).args(["download", "someone/tiny"]).output().unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("does not match"));
    assert!(!e.store.join("models/someone/tiny").exists());
    assert!(!e.store.join("models/someone/tiny.partial").exists());
}

#[test]
fn bare_name_means_mlx_community() {
    let e = env();
    let url = hub(vec![("mlx-community/tiny", fixture_dir())], Arc::default());
    ok(&mlxcel(&e, &url).args(["download", "tiny"]).output().unwrap());
    assert!(e.store.join("models/mlx-community/tiny/config.json").is_file());
}

#[test]
fn hugging_face_cache_is_reused_without_network() {
    let e = env();
    let snap = e.hf.join("models--someone--cached/snapshots/0123abc");
    std::fs::create_dir_all(&snap).unwrap();
    for f in std::fs::read_dir(fixture_dir()).unwrap().flatten() {
        std::fs::copy(f.path(), snap.join(f.file_name())).unwrap();
    }
    std::fs::create_dir_all(e.hf.join("models--someone--cached/refs")).unwrap();
    std::fs::write(e.hf.join("models--someone--cached/refs/main"), "0123abc").unwrap();
    let out = mlxcel(&e, "http://127.0.0.1:9")
        .env("HF_HUB_OFFLINE", "1")
        .args(["inspect", "someone/cached", "--json"])
        .output()
        .unwrap();
    let v: serde_json::Value = serde_json::from_str(&ok(&out)).unwrap();
    assert!(Path::new(v["path"].as_str().unwrap()).starts_with(&e.hf));
}

#[test]
fn offline_bare_name_fails_with_one_line_naming_the_repo() {
    let e = env();
    let out = mlxcel(&e, "http://127.0.0.1:9")
        .env("HF_HUB_OFFLINE", "1")
        .args(["run", "Qwen3-0.6B-4bit", "-p", "hi"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(err.contains("mlx-community/Qwen3-0.6B-4bit") && err.contains("HF_HUB_OFFLINE"), "{err}");
}

#[test]
fn unknown_repo_is_a_clear_error() {
    let e = env();
    let url = hub(vec![], Arc::default());
    let out = mlxcel(&e, &url).args(["download", "someone/missing"]).output().unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("someone/missing` was not found"));
}

#[test]
fn a_revision_is_a_name_in_the_store_never_a_path() {
    let e = env();
    let url = hub(vec![("someone/tiny", fixture_dir())], Arc::default());
    // A download at another revision is listed as owner/name@revision and removed by that name.
    ok(&mlxcel(&e, &url).args(["download", "someone/tiny", "--revision", "refs/pr/1"]).output().unwrap());
    let list = ok(&mlxcel(&e, &url).args(["list"]).output().unwrap());
    assert!(list.contains("someone/tiny@refs/pr/1"), "{list}");
    let removed = ok(&mlxcel(&e, &url).args(["rm", "someone/tiny@refs/pr/1", "--yes"]).output().unwrap());
    assert!(removed.contains("removed someone/tiny@refs/pr/1"), "{removed}");
    assert_eq!(std::fs::read_dir(e.store.join("models/someone")).unwrap().count(), 0);
    // A revision that climbs out of the store is refused before anything is touched.
    let victim = e.store.parent().unwrap().join("victim");
    std::fs::create_dir_all(&victim).unwrap();
    for args in [
        &["rm", "someone/tiny", "--revision", "v2/../../../../victim", "--yes"][..],
        &["download", "someone/tiny", "--revision", "../../../victim"][..],
    ] {
        let out = mlxcel(&e, &url).args(args).output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success() && err.contains("is not a revision"), "{args:?}: {err}");
    }
    assert!(victim.is_dir());
}
