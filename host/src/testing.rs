//! Helpers shared by the integration tests of the host and the plugins (not used by the binaries).

use std::path::PathBuf;

use mlxcel_plugins::{Catalog, PluginSearch};

pub mod golden;

/// The workspace root.
pub fn workspace_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).parent().unwrap().to_path_buf()
}

/// Where `cargo xtask build` stages the plugins (`target/lib/mlxcel/plugins`).
pub fn staged_plugin_dir() -> PathBuf {
    let target =
        std::env::var_os("CARGO_TARGET_DIR").map(PathBuf::from).unwrap_or_else(|| workspace_root().join("target"));
    let dir = target.join("lib").join("mlxcel").join("plugins");
    assert!(
        dir.join(format!("{}mlxcel_backend_cpu{}", std::env::consts::DLL_PREFIX, std::env::consts::DLL_SUFFIX))
            .is_file(),
        "plugins are not staged in {}: run `cargo xtask build` (or `cargo xtask test`) first",
        dir.display()
    );
    dir
}

/// A catalog of exactly the staged plugins (ignores MLXCEL_PLUGIN_PATH and user folders).
pub fn staged_catalog() -> Catalog {
    Catalog::load(&PluginSearch { dirs: vec![staged_plugin_dir()] })
}

/// The real test models folder, if `MLXCEL_TEST_MODELS` points at one (see ../shared/models/fetch.sh).
/// Without it, real-model tests skip with a message; with `MLXCEL_REQUIRE_TEST_MODELS=1` (CI) they fail.
pub fn test_models() -> Option<PathBuf> {
    match std::env::var_os("MLXCEL_TEST_MODELS").map(PathBuf::from) {
        Some(p) if p.is_dir() => Some(p),
        _ => {
            if std::env::var_os("MLXCEL_REQUIRE_TEST_MODELS").is_some() {
                panic!(
                    "MLXCEL_REQUIRE_TEST_MODELS is set but MLXCEL_TEST_MODELS does not name a folder of test models"
                );
            }
            eprintln!(
                "skipping: real-model test needs MLXCEL_TEST_MODELS (run ../shared/models/fetch.sh and export MLXCEL_TEST_MODELS=<the folder it prints>)"
            );
            None
        }
    }
}

/// Python of the venv with the packages pinned in `host/tests/sdk/requirements.txt` (`MLXCEL_SDK_VENV`,
/// else target/sdk-venv; made and filled here when its pins are not all installed).
pub fn sdk_venv_python() -> PathBuf {
    use std::process::Command;
    let venv = std::env::var_os("MLXCEL_SDK_VENV")
        .map(PathBuf::from)
        .unwrap_or_else(|| workspace_root().join("target/sdk-venv"));
    let py = venv.join("bin/python");
    let requirements = workspace_root().join("host/tests/sdk/requirements.txt");
    let pins: Vec<String> = std::fs::read_to_string(&requirements)
        .unwrap()
        .lines()
        .filter(|l| l.contains("=="))
        .map(|l| l.trim().replace("==", " "))
        .collect();
    let check = "import importlib.metadata as m, sys; sys.exit(0 if all(m.version(p.split()[0]) == p.split()[1] for p in sys.argv[1:]) else 1)";
    let ready =
        |py: &PathBuf| Command::new(py).args(["-c", check]).args(&pins).output().is_ok_and(|o| o.status.success());
    if ready(&py) {
        return py;
    }
    eprintln!("installing the packages of {} into {}", requirements.display(), venv.display());
    let ok = Command::new("python3").args(["-m", "venv"]).arg(&venv).status().is_ok_and(|s| s.success());
    assert!(ok, "python3 -m venv {} failed (python3 with venv is needed for these tests)", venv.display());
    let ok = Command::new(venv.join("bin/pip"))
        .args(["install", "-q", "-r"])
        .arg(&requirements)
        .status()
        .is_ok_and(|s| s.success());
    assert!(ok && ready(&py), "installing {} failed", requirements.display());
    py
}

/// `exe` (the test's `env!("CARGO_BIN_EXE_mlxcel-server")`) on the staged plugins, without the
/// environment variables that would change it (`MLXCEL_PLUGIN_PATH`, `RUST_LOG`, llama-server's).
pub fn server_command(exe: &str) -> std::process::Command {
    staged_plugin_dir();
    let mut c = std::process::Command::new(exe);
    c.env_remove("MLXCEL_PLUGIN_PATH").env_remove("RUST_BACKTRACE").env_remove("RUST_LOG");
    for (k, _) in std::env::vars() {
        if k.starts_with("LLAMA_ARG_") || k == "LLAMA_API_KEY" {
            c.env_remove(k);
        }
    }
    c
}

/// A running `mlxcel-server` under test, on an ephemeral port of 127.0.0.1; killed when dropped.
pub struct TestServer {
    pub child: std::process::Child,
    /// `http://127.0.0.1:PORT`.
    pub base: String,
}

impl TestServer {
    /// Starts [`server_command`] with `-m model --port 0` and `args`, and waits until `/health` answers 200 (the model is loaded; 503
    /// until then) for at most 120 s.
    pub fn start(exe: &str, model: &std::path::Path, args: &[&str]) -> TestServer {
        use std::io::{BufRead, BufReader};
        use std::process::Stdio;
        use std::time::{Duration, Instant};

        let mut c = server_command(exe);
        let mut child = c
            .arg("-m")
            .arg(model)
            .args(["--port", "0"])
            .args(args)
            .stderr(Stdio::piped())
            .stdout(Stdio::null())
            .spawn()
            .unwrap();
        let mut lines = BufReader::new(child.stderr.take().unwrap()).lines();
        let base = loop {
            let line = lines.next().expect("the server exited before listening").unwrap();
            if let Some(rest) = line.split("listening on ").nth(1) {
                break rest.split_whitespace().next().unwrap().to_string();
            }
        };
        // Keep draining stderr so the server never blocks on a full pipe.
        std::thread::spawn(move || for _ in lines {});
        let server = TestServer { child, base };
        let deadline = Instant::now() + Duration::from_secs(120);
        loop {
            match server.health() {
                Some(200) => return server,
                Some(status) => assert_eq!(status, 503, "/health while loading"),
                None => {}
            }
            assert!(Instant::now() < deadline, "the model did not load within 120 s");
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// The status of `GET /health` (plain HTTP/1.1 on a socket of its own), `None` when it cannot be read.
    pub fn health(&self) -> Option<u16> {
        use std::io::{Read, Write};
        let addr = self.base.strip_prefix("http://")?;
        let mut s = std::net::TcpStream::connect(addr).ok()?;
        s.write_all(format!("GET /health HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n").as_bytes()).ok()?;
        let mut head = [0u8; 12];
        s.read_exact(&mut head).ok()?;
        // "HTTP/1.1 200"
        std::str::from_utf8(&head[9..12]).ok()?.parse().ok()
    }
}

impl Drop for TestServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
