//! The `mlxcel` binary as users meet it: `arch`, an installed layout finding its plugins without
//! flags, and one clear line (no panic, no backtrace) for every kind of bad model folder.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn fixture(name: &str) -> PathBuf {
    mlxcel::testing::workspace_root().join("families/llama/tests/fixtures").join(name)
}

fn mlxcel() -> Command {
    mlxcel::testing::staged_plugin_dir();
    let mut c = Command::new(env!("CARGO_BIN_EXE_mlxcel"));
    c.env_remove("MLXCEL_PLUGIN_PATH").env_remove("RUST_BACKTRACE").env_remove("RUST_LOG");
    c
}

/// Exit code ≠ 0 and exactly one `error:` line on stderr that contains every `needle`.
fn assert_one_line_error(out: &Output, needles: &[&str]) {
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "expected failure, got success; stderr: {stderr}");
    assert_eq!(out.status.code(), Some(1), "exit code; stderr: {stderr}");
    let lines: Vec<&str> = stderr.lines().collect();
    assert_eq!(lines.len(), 1, "one line expected, got: {stderr}");
    assert!(lines[0].starts_with("error: "), "{stderr}");
    assert!(!stderr.contains("panicked") && !stderr.contains("backtrace"), "{stderr}");
    for n in needles {
        assert!(stderr.contains(n), "stderr should mention {n:?}: {stderr}");
    }
}

fn copy_dir(src: &Path, dst: &Path) {
    std::fs::create_dir_all(dst).unwrap();
    for e in std::fs::read_dir(src).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), dst.join(e.file_name())).unwrap();
    }
}

fn broken_copy(name: &str) -> (tempfile::TempDir, PathBuf) {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("model");
    copy_dir(&fixture(name), &dir);
    (tmp, dir)
}

fn run_prompt(dir: &Path) -> Output {
    mlxcel().arg("run").arg(dir).args(["-p", "hi", "-n", "2"]).output().unwrap()
}

#[test]
fn arch_json_lists_llama_and_moe_families_and_cpu_backend() {
    let out = mlxcel().args(["arch", "--json"]).output().unwrap();
    assert!(out.status.success());
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let fam = v["families"].as_array().unwrap().iter().find(|f| f["name"] == "llama").expect("llama family");
    let archs: Vec<&str> = fam["architectures"].as_array().unwrap().iter().map(|a| a.as_str().unwrap()).collect();
    assert_eq!(archs, ["llama", "mistral", "qwen2", "qwen3"]);
    let moe = v["families"].as_array().unwrap().iter().find(|f| f["name"] == "moe").expect("moe family");
    assert_eq!(moe["architectures"], serde_json::json!(["qwen2_moe", "qwen3_moe"]));
    let cpu = v["backends"].as_array().unwrap().iter().find(|b| b["name"] == "cpu").expect("cpu backend");
    assert!(cpu["score"].as_u64().unwrap() > 0);
    let paths = ["scalar", "avx2", "avxvnni", "avx512", "avx512vnni", "neon", "neondot"];
    assert!(paths.contains(&cpu["features"].as_str().unwrap()));
    assert_eq!(cpu["devices"][0]["kind"], "cpu");
    assert_eq!(v["selected_backend"], "cpu");
}

/// Every staged family's architectures are listed, each with the plugin that provides it, and no
/// plugin is refused.
#[test]
fn arch_json_lists_every_family_architecture_with_its_plugin() {
    let out = mlxcel().args(["arch", "--json"]).output().unwrap();
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["refused"].as_array().unwrap().len(), 0, "{v}");
    let all = v["architectures"].as_array().unwrap();
    let families = v["families"].as_array().unwrap();
    assert!(families.len() > 1, "{v}");
    for f in families {
        let archs = f["architectures"].as_array().unwrap();
        assert!(!archs.is_empty(), "family {} lists no architecture", f["name"]);
        for a in archs {
            assert!(all.contains(a), "{a} of {} missing from the list", f["name"]);
            let providers = families.iter().filter(|g| g["architectures"].as_array().unwrap().contains(a)).count();
            assert_eq!(providers, 1, "{a} is provided by {providers} families");
        }
    }
}

#[test]
fn arch_table_names_plugins() {
    let out = mlxcel().arg("arch").output().unwrap();
    let s = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success());
    assert!(s.contains("llama, mistral, qwen2, qwen3") && s.contains("cpu"), "{s}");
}

/// An installed layout (bin/ + lib/mlxcel/plugins/) finds its plugins with no flags; removing the
/// llama plugin removes its architectures (and only those) and the host still runs.
#[test]
fn installed_layout_finds_plugins_and_survives_a_removed_family() {
    let staged = mlxcel::testing::staged_plugin_dir();
    let prefix = tempfile::tempdir().unwrap();
    let bin = prefix.path().join("bin");
    let plugins = prefix.path().join("lib/mlxcel/plugins");
    std::fs::create_dir_all(&bin).unwrap();
    copy_dir(&staged, &plugins);
    std::fs::copy(env!("CARGO_BIN_EXE_mlxcel"), bin.join("mlxcel")).unwrap();
    let arch = || {
        let out = output_of_copied_binary(
            Command::new(bin.join("mlxcel"))
                .args(["arch", "--json"])
                .env_remove("MLXCEL_PLUGIN_PATH")
                .env("HOME", prefix.path())
                .env("XDG_DATA_HOME", prefix.path().join("data")),
        );
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        serde_json::from_slice::<serde_json::Value>(&out.stdout).unwrap()
    };
    let names = |v: &serde_json::Value| -> Vec<String> {
        v["architectures"].as_array().unwrap().iter().map(|a| a.as_str().unwrap().to_string()).collect()
    };
    let llama_archs = ["llama", "mistral", "qwen2", "qwen3"];
    let all = names(&arch());
    assert!(llama_archs.iter().all(|a| all.iter().any(|x| x == a)), "{all:?}");
    let llama = format!("{}mlxcel_family_llama{}", std::env::consts::DLL_PREFIX, std::env::consts::DLL_SUFFIX);
    std::fs::rename(plugins.join(&llama), prefix.path().join(&llama)).unwrap();
    let v = arch();
    // The other families' architectures remain.
    let left = names(&v);
    assert_eq!(left, all.iter().filter(|a| !llama_archs.contains(&a.as_str())).cloned().collect::<Vec<_>>(), "{v}");
    assert_eq!(v["backends"][0]["name"], "cpu");
    // --plugin-dir brings it back.
    let out = output_of_copied_binary(
        Command::new(bin.join("mlxcel"))
            .args(["arch", "--json", "--plugin-dir"])
            .arg(prefix.path())
            .env("HOME", prefix.path()),
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert!(llama_archs.iter().all(|a| names(&v).iter().any(|x| x == a)), "{v}");
}

/// Runs a binary this test just copied. A child that another test thread forked while the copy's file
/// was open for writing holds it until that child execs, and exec of a file open for writing fails
/// with ETXTBSY ("Text file busy"): retry for a while instead of failing.
fn output_of_copied_binary(cmd: &mut Command) -> std::process::Output {
    for _ in 0..100 {
        match cmd.output() {
            Err(e) if e.kind() == std::io::ErrorKind::ExecutableFileBusy => {
                std::thread::sleep(std::time::Duration::from_millis(50))
            }
            r => return r.unwrap(),
        }
    }
    panic!("{cmd:?}: the copied binary stayed busy (ETXTBSY) for 5 s");
}

#[test]
fn generate_runs_a_golden_fixture() {
    let out = mlxcel()
        .arg("generate")
        .arg(fixture("qwen2-f32"))
        .args(["-p", "Hello", "-n", "3", "--temp", "0", "--no-chat-template", "--ignore-eos"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("generation: 3 tokens") && !err.contains("full"), "{err}");
    // An answer that fills the context says so (-n -1: no limit of its own).
    let out = mlxcel()
        .arg("generate")
        .arg(fixture("qwen2-f32"))
        .args(["-p", "Hello", "-n", "-1", "-c", "16", "--temp", "0", "--no-chat-template", "--ignore-eos"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success() && err.contains("context of 16 tokens full"), "{err}");
}

#[cfg(unix)]
#[test]
fn an_answer_to_a_closed_stdout_ends_quietly_and_minus_one_means_no_limit() {
    use std::os::unix::process::ExitStatusExt;
    let mut child = mlxcel()
        .arg("generate")
        .arg(fixture("qwen2-f32"))
        .args(["-p", "Hello", "-n", "-1", "-c", "64", "--temp", "0", "--no-chat-template", "--ignore-eos"])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    // The reader goes away before the first token (as `| head -c 0` would): the command ends as `cat`
    // would, by SIGPIPE, rather than generating until the context is full.
    drop(child.stdout.take());
    let out = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.signal(), Some(libc::SIGPIPE), "{:?}: {stderr}", out.status);
    assert!(!stderr.contains("panicked"), "{stderr}");
}

#[test]
fn missing_folder_is_one_clear_line() {
    let out = run_prompt(Path::new("/nonexistent/model"));
    assert_one_line_error(&out, &["/nonexistent/model", "does not exist"]);
}

#[test]
fn folder_without_config_is_one_clear_line() {
    let tmp = tempfile::tempdir().unwrap();
    let out = run_prompt(tmp.path());
    assert_one_line_error(&out, &["config.json"]);
}

#[test]
fn unknown_model_type_names_it_and_lists_installed_architectures() {
    let (_t, dir) = broken_copy("qwen2-f32");
    let cfg = std::fs::read_to_string(dir.join("config.json")).unwrap().replace("\"qwen2\"", "\"mamba9\"");
    std::fs::write(dir.join("config.json"), cfg).unwrap();
    let out = run_prompt(&dir);
    assert_one_line_error(&out, &["`mamba9`", "installed architectures: ", "llama", "qwen3", "family plugin"]);
}

#[test]
fn truncated_safetensors_is_one_clear_line() {
    let (_t, dir) = broken_copy("qwen2-f32");
    let f = dir.join("model.safetensors");
    let len = std::fs::metadata(&f).unwrap().len();
    std::fs::OpenOptions::new().write(true).open(&f).unwrap().set_len(len / 2).unwrap();
    let out = run_prompt(&dir);
    assert_one_line_error(&out, &["model.safetensors", "truncated"]);
}

#[test]
fn header_longer_than_file_is_one_clear_line() {
    let (_t, dir) = broken_copy("qwen2-f32");
    let f = dir.join("model.safetensors");
    std::fs::write(&f, [0xff, 0xff, 0, 0, 0, 0, 0, 0, b'{', b'}']).unwrap();
    let out = run_prompt(&dir);
    assert_one_line_error(&out, &["model.safetensors", "header claims"]);
}

#[test]
fn bad_header_json_is_one_clear_line() {
    let (_t, dir) = broken_copy("qwen2-f32");
    let f = dir.join("model.safetensors");
    let mut bytes = std::fs::read(&f).unwrap();
    bytes[9] = b'#'; // inside the JSON header
    std::fs::write(&f, bytes).unwrap();
    let out = run_prompt(&dir);
    assert_one_line_error(&out, &["model.safetensors", "not valid"]);
}

#[test]
fn tensor_shape_not_matching_config_names_the_tensor() {
    let (_t, dir) = broken_copy("qwen2-f32");
    let cfg = std::fs::read_to_string(dir.join("config.json"))
        .unwrap()
        .replace("\"intermediate_size\": 128", "\"intermediate_size\": 96");
    std::fs::write(dir.join("config.json"), cfg).unwrap();
    let out = run_prompt(&dir);
    assert_one_line_error(&out, &["model.layers.0.mlp.gate_proj.weight", "shape"]);
}

#[test]
fn quantized_bits_not_matching_config_names_the_tensor() {
    let (_t, dir) = broken_copy("qwen2-q4");
    let cfg = std::fs::read_to_string(dir.join("config.json")).unwrap().replace("\"bits\": 4", "\"bits\": 8");
    std::fs::write(dir.join("config.json"), cfg).unwrap();
    let out = run_prompt(&dir);
    assert_one_line_error(&out, &["model.embed_tokens.weight", "4 bits", "8 bits"]);
}

#[test]
fn missing_tokenizer_is_one_clear_line() {
    let (_t, dir) = broken_copy("qwen2-f32");
    std::fs::remove_file(dir.join("tokenizer.json")).unwrap();
    let out = run_prompt(&dir);
    assert_one_line_error(&out, &["tokenizer.json"]);
}

#[test]
fn bad_sampling_option_is_refused() {
    let out = mlxcel().arg("run").arg(fixture("qwen2-f32")).args(["-p", "hi", "--top-p", "1.5"]).output().unwrap();
    assert_one_line_error(&out, &["top_p"]);
}

#[test]
fn unknown_backend_is_refused_by_name() {
    let out = mlxcel().arg("run").arg(fixture("qwen2-f32")).args(["-p", "hi", "--backend", "cuda"]).output().unwrap();
    assert_one_line_error(&out, &["`cuda`", "cpu"]);
}

#[test]
fn prompt_over_the_context_is_refused() {
    let long = "word ".repeat(400);
    let out = mlxcel()
        .arg("run")
        .arg(fixture("qwen2-f32"))
        .args(["-p", &long, "--no-chat-template", "-c", "64"])
        .output()
        .unwrap();
    assert_one_line_error(&out, &["context size is 64"]);
}

#[test]
fn forced_unsupported_isa_is_refused() {
    let isa = if cfg!(target_arch = "x86_64") { "neon" } else { "avx2" };
    let out =
        mlxcel().env("MLXCEL_CPU_ISA", isa).arg("run").arg(fixture("qwen2-f32")).args(["-p", "hi"]).output().unwrap();
    assert_one_line_error(&out, &["MLXCEL_CPU_ISA", "not supported"]);
}

/// Payload bytes of a safetensors file: its length minus the 8-byte length prefix and the header.
fn payload_bytes(path: &Path) -> u64 {
    let bytes = std::fs::read(path).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap());
    bytes.len() as u64 - 8 - n
}

#[test]
fn inspect_json_gives_exact_weight_bytes_and_a_kv_figure() {
    let dir = fixture("qwen2-q4");
    let out = mlxcel().arg("inspect").arg(&dir).args(["--json", "-c", "256", "--parallel", "2"]).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["memory"]["weight_bytes"].as_u64().unwrap(), payload_bytes(&dir.join("model.safetensors")));
    // The tokenizer counts too, at ten times its file (a loaded tokenizer holds 9–12 times).
    let tokenizer_file = std::fs::metadata(dir.join("tokenizer.json")).unwrap().len();
    assert_eq!(v["memory"]["tokenizer_bytes"].as_u64().unwrap(), 10 * tokenizer_file);
    let m = &v["memory"];
    let parts = ["weight_bytes", "kv_bytes", "activation_bytes", "tokenizer_bytes"].map(|k| m[k].as_u64().unwrap());
    assert_eq!(m["total_bytes"].as_u64().unwrap(), parts.iter().sum::<u64>());
    // 2 layers × K and V × 2 KV heads × head_dim 16 × 2 bytes (f16 by default), for 256 tokens × 2
    // sequences.
    assert_eq!(
        (v["memory"]["cache_type_k"].as_str(), v["memory"]["cache_type_v"].as_str()),
        (Some("f16"), Some("f16"))
    );
    assert_eq!(v["memory"]["kv_bytes_per_token"].as_u64().unwrap(), 2 * 2 * 2 * 16 * 2);
    assert_eq!(v["memory"]["kv_bytes"].as_u64().unwrap(), 2 * 2 * 2 * 16 * 2 * 256 * 2);
    assert_eq!(v["architecture"], "qwen2");
    assert_eq!(v["quantization"], "affine 4-bit g32");
    assert_eq!(v["tokenizer"], true);
    // Without its tokenizer a model does not run, however well it fits: inspect says so.
    let bare = tempfile::tempdir().unwrap();
    for f in ["config.json", "model.safetensors"] {
        std::fs::copy(dir.join(f), bare.path().join(f)).unwrap();
    }
    let out = mlxcel().arg("inspect").arg(bare.path()).args(["--json"]).output().unwrap();
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["tokenizer"], false);
    let out = mlxcel().arg("inspect").arg(bare.path()).output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("tokenizer      MISSING: no tokenizer.json"), "{text}");
    let out = mlxcel().arg("inspect").arg(&dir).output().unwrap();
    assert!(!String::from_utf8_lossy(&out.stdout).contains("MISSING"));
    // No sequences at all is no plan to check.
    let out = mlxcel().arg("inspect").arg(&dir).args(["--parallel", "0"]).output().unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("must be at least 1"));
    // -c 0 is the model's whole context (the fixture's 512 positions), as `run` and the server read it.
    let out = mlxcel().arg("inspect").arg(&dir).args(["--json", "-c", "0"]).output().unwrap();
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["memory"]["kv_bytes"].as_u64().unwrap(), 2 * 2 * 2 * 16 * 2 * 512);
    // Over the model's maximum, the context is cut to it, and the user is told.
    let out = mlxcel().arg("inspect").arg(&dir).args(["--json", "-c", "100000"]).output().unwrap();
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["memory"]["kv_bytes"].as_u64().unwrap(), 2 * 2 * 2 * 16 * 2 * 512);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("-c 100000 is over the model's maximum context (512 tokens); using 512"), "{err}");

    // An f32 K cache beside a bf16 V cache: 4 + 2 bytes per value pair.
    let out = mlxcel()
        .arg("inspect")
        .arg(&dir)
        .args(["--json", "-c", "256", "--cache-type-k", "f32", "--cache-type-v", "bf16"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["memory"]["kv_bytes_per_token"].as_u64().unwrap(), 2 * 2 * 16 * (4 + 2));

    // llama.cpp's spelling of the same flags.
    let out =
        mlxcel().arg("inspect").arg(&dir).args(["--json", "-c", "256", "-ctk", "f32", "-ctv=bf16"]).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["memory"]["kv_bytes_per_token"].as_u64().unwrap(), 2 * 2 * 16 * (4 + 2));
    // Its multi-letter flags mlxcel does not take are named, not read as `-n gl` or `-f a`.
    assert_one_line_error(&mlxcel().arg("inspect").arg(&dir).args(["-ngl", "99"]).output().unwrap(), &["-ngl"]);
    assert_one_line_error(&mlxcel().args(["generate"]).arg(&dir).args(["-fa", "-p", "x"]).output().unwrap(), &["-fa"]);

    // A type the engine does not keep is refused by clap with the reason.
    let out = mlxcel().arg("inspect").arg(&dir).args(["--cache-type-k", "q8_0"]).output().unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("quantized KV caches (q8_0) are not supported"), "{err}");
}

/// A config without `model_type` reaches the families' own matching, as loading does: the whisper
/// family claims OpenAI's names for its dimensions (older conversions have no `model_type`) and checks
/// the weights against them — OpenAI's configs imply feed-forward layers 4 × wide, which this random
/// fixture's are not; a config no family recognises is one clear line.
#[test]
fn inspect_finds_the_family_of_a_config_without_model_type() {
    let whisper = mlxcel::testing::workspace_root().join("families/whisper/tests/fixtures/whisper-tiny-random");
    let dir = tempfile::tempdir().unwrap();
    std::fs::copy(whisper.join("model.safetensors"), dir.path().join("model.safetensors")).unwrap();
    let openai = serde_json::json!({
        "n_mels": 80, "n_audio_ctx": 50, "n_audio_state": 64, "n_audio_head": 4, "n_audio_layer": 2,
        "n_vocab": 309, "n_text_ctx": 64, "n_text_state": 64, "n_text_head": 4, "n_text_layer": 2
    });
    std::fs::write(dir.path().join("config.json"), openai.to_string()).unwrap();
    let out = mlxcel().arg("inspect").arg(dir.path()).output().unwrap();
    assert_one_line_error(
        &out,
        &["model.encoder.layers.0.fc1.weight", "has shape [128, 64], config implies [256, 64]"],
    );

    std::fs::write(dir.path().join("config.json"), r#"{"hidden_size": 64}"#).unwrap();
    let out = mlxcel().arg("inspect").arg(dir.path()).output().unwrap();
    assert_one_line_error(&out, &["no `model_type`", "no installed family recognises its config"]);
}

fn generate_text(dir: &Path) -> String {
    let out = mlxcel()
        .arg("generate")
        .arg(dir)
        .args(["-p", "Hello world", "-n", "6", "--temp", "0", "--no-chat-template", "--ignore-eos"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).to_string()
}

/// The same weights split into two shards with `model.safetensors.index.json` give the same output.
#[test]
fn sharded_checkpoint_matches_single_file() {
    let (_t, dir) = broken_copy("qwen2-q4");
    let bytes = std::fs::read(dir.join("model.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut names: Vec<String> = st.names().into_iter().cloned().collect();
    names.sort();
    let mut map = serde_json::Map::new();
    for (i, part) in [0usize, 1].iter().enumerate() {
        let file = format!("model-0000{}-of-00002.safetensors", i + 1);
        let tensors: Vec<(String, safetensors::tensor::TensorView)> =
            names.iter().skip(*part).step_by(2).map(|n| (n.clone(), st.tensor(n).unwrap())).collect();
        for (n, _) in &tensors {
            map.insert(n.clone(), serde_json::Value::String(file.clone()));
        }
        safetensors::serialize_to_file(tensors, &None, &dir.join(&file)).unwrap();
    }
    std::fs::remove_file(dir.join("model.safetensors")).unwrap();
    std::fs::write(
        dir.join("model.safetensors.index.json"),
        serde_json::json!({"metadata": {}, "weight_map": map}).to_string(),
    )
    .unwrap();
    assert_eq!(generate_text(&dir), generate_text(&fixture("qwen2-q4")));
}

/// A per-module entry in config's `quantization` overrides the default for that module.
#[test]
fn per_module_quantization_override_is_honoured() {
    let (_t, dir) = broken_copy("qwen2-q4");
    let mut cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap();
    cfg["quantization"]["model.layers.1.mlp.down_proj"] = serde_json::json!({"group_size": 32, "bits": 8});
    std::fs::write(dir.join("config.json"), cfg.to_string()).unwrap();
    let out = run_prompt(&dir);
    assert_one_line_error(&out, &["model.layers.1.mlp.down_proj.weight", "4 bits", "8 bits"]);
}

/// A wrapper config with the model in `text_config` loads like the plain one.
#[test]
fn nested_text_config_is_read() {
    let (_t, dir) = broken_copy("qwen2-q4");
    let cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap();
    let mut inner = cfg.clone();
    inner.as_object_mut().unwrap().remove("quantization");
    let wrapped =
        serde_json::json!({"model_type": "wrapper-vl", "text_config": inner, "quantization": cfg["quantization"]});
    std::fs::write(dir.join("config.json"), wrapped.to_string()).unwrap();
    assert_eq!(generate_text(&dir), generate_text(&fixture("qwen2-q4")));
}

/// `bench` runs on the tiny fixture, and refuses what it cannot measure: no repetition, or tests
/// deeper than the model's context (the fixture's 512 positions), named before anything runs.
#[test]
fn bench_measures_and_refuses_what_it_cannot_measure() {
    let dir = fixture("qwen2-q4");
    let out = mlxcel().arg("bench").arg(&dir).args(["-p", "16", "-n", "4", "-r", "1", "--json"]).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert!(v["pp_tps"].as_f64().unwrap() > 0.0 && v["tg_tps"].as_f64().unwrap() > 0.0, "{v}");
    // The prompt test and the generation test each fit on their own (-p 500 and -n 16 in 512).
    let out = mlxcel().arg("bench").arg(&dir).args(["-p", "500", "-n", "16", "-r", "1"]).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    // A test of 0 tokens is not run (as llama-bench skips it): no `pp0 0.0 tok/s`.
    let out = mlxcel().arg("bench").arg(&dir).args(["-p", "0", "-n", "4", "-r", "1"]).output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success() && text.contains("tg4 ") && !text.contains("pp0"), "{text}");
    let out = mlxcel().arg("bench").arg(&dir).args(["-p", "8", "-n", "0", "-r", "1", "--json"]).output().unwrap();
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert!(v["pp_tps"].as_f64().unwrap() > 0.0 && v["tg_tps"].is_null(), "{v}");
    for (args, says) in [
        (&["-p", "0", "-n", "0"][..], "nothing to measure"),
        (&["-n", "0", "-d", "16"][..], "-d measures generation at a depth, so it needs -n above 0"),
        (&["-r", "0"][..], "at least one repetition is needed"),
        (
            &["-p", "600"][..],
            "the tests need 600 tokens of context (-p, or -d + -n), more than the model's maximum (512 tokens)",
        ),
        (&["-p", "8", "-n", "16", "-d", "500"][..], "the tests need 516 tokens"),
    ] {
        let out = mlxcel().arg("bench").arg(&dir).args(args).output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success() && err.contains(says), "{args:?}: {err}");
    }
}

/// `mlxcel arch | head` and the like: a reader that went away ends the command as it ends `ls`
/// (SIGPIPE), without a panic's message; an argument that is not UTF-8 is an error, not a panic.
#[cfg(unix)]
#[test]
fn a_closed_output_pipe_ends_a_command_quietly_and_non_utf8_arguments_are_refused() {
    use std::os::fd::FromRawFd;
    use std::os::unix::ffi::OsStrExt;
    use std::os::unix::process::ExitStatusExt;
    let mut fds = [0; 2];
    // SAFETY: a fresh pipe; its read end is closed at once, its write end given to the child.
    let write_end = unsafe {
        assert_eq!(libc::pipe(fds.as_mut_ptr()), 0);
        libc::close(fds[0]);
        std::process::Stdio::from_raw_fd(fds[1])
    };
    let out = mlxcel().args(["arch", "--json"]).stdout(write_end).output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.signal(), Some(libc::SIGPIPE), "{:?}: {stderr}", out.status);
    assert!(!stderr.contains("panicked"), "{stderr}");
    let out =
        mlxcel().args(["generate", "m", "-p"]).arg(std::ffi::OsStr::from_bytes(b"\xff\xfe bad")).output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("not valid UTF-8") && !stderr.contains("panicked"), "{stderr}");
}

/// `-t` takes 0 (one per core) to 512 threads, as llama.cpp: more is a usage error naming the limit,
/// on every command that takes it and on the server.
#[test]
fn thread_counts_past_512_are_usage_errors() {
    for args in [
        &["run", "model", "-p", "hi", "-t", "513"][..],
        &["bench", "model", "-t", "100000"],
        &["transcribe", "-m", "model", "a.wav", "-t", "600"],
    ] {
        let out = mlxcel().args(args).output().unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {stderr}");
        assert!(stderr.contains("at most 512 threads"), "{args:?}: {stderr}");
    }
    let out = Command::new(env!("CARGO_BIN_EXE_mlxcel-server")).args(["-m", "model", "-t", "1000"]).output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.code() == Some(2) && stderr.contains("at most 512 threads"), "{stderr}");
}

/// `-f FILE` (and `-f -`, standard input) gives the prompt as `-p` does, less one final line break,
/// as llama.cpp's `-f`; with `-p` it is a usage error.
#[test]
fn a_prompt_read_from_a_file_or_stdin_answers_as_the_same_prompt_given_with_p() {
    use std::io::Write;
    let model = fixture("qwen2-f32");
    let common = ["-n", "6", "--temp", "0", "--no-chat-template"];
    let answer = |extra: &[&str], stdin: Option<&str>| {
        let mut c = mlxcel();
        c.arg("generate").arg(&model).args(common).args(extra);
        c.stdin(std::process::Stdio::piped()).stdout(std::process::Stdio::piped()).stderr(std::process::Stdio::piped());
        let mut child = c.spawn().unwrap();
        let mut input = child.stdin.take().unwrap();
        input.write_all(stdin.unwrap_or("").as_bytes()).unwrap();
        drop(input);
        let out = child.wait_with_output().unwrap();
        assert!(out.status.success(), "{extra:?}: {}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8(out.stdout).unwrap()
    };
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("prompt.txt");
    std::fs::write(&file, "Hello there\n").unwrap();
    let given = answer(&["-p", "Hello there"], None);
    assert_eq!(answer(&["-f", file.to_str().unwrap()], None), given);
    assert_eq!(answer(&["-f", "-"], Some("Hello there\r\n")), given);
    let out = mlxcel().arg("generate").arg(&model).args(["-p", "x", "-f", "-"]).output().unwrap();
    assert_eq!(out.status.code(), Some(2), "{}", String::from_utf8_lossy(&out.stderr));
    let out = mlxcel().arg("generate").arg(&model).args(["-f", "/nonexistent/prompt.txt"]).output().unwrap();
    assert_one_line_error(&out, &["/nonexistent/prompt.txt"]);
}

/// A chat template that does not parse stops only what needs it: raw completion runs, the chat names
/// the error, and `--chat-template-file` replaces it.
#[test]
fn a_broken_chat_template_stops_only_the_chat() {
    let (tmp, dir) = broken_copy("qwen3-q4");
    std::fs::write(dir.join("chat_template.jinja"), "{% if %}").unwrap();
    let raw = mlxcel().arg("run").arg(&dir).args(["-p", "hi", "-n", "2", "--no-chat-template"]).output().unwrap();
    assert!(raw.status.success(), "{}", String::from_utf8_lossy(&raw.stderr));
    assert_one_line_error(&run_prompt(&dir), &["does not parse", "--chat-template-file"]);
    // inspect says so before anything runs.
    let out = mlxcel().arg("inspect").arg(&dir).arg("--json").output().unwrap();
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["chat_template"]["ok"], false, "{v}");
    assert!(v["chat_template"]["problem"].as_str().unwrap().contains("does not parse"), "{v}");
    let good = tmp.path().join("good.jinja");
    std::fs::write(&good, "{% for m in messages %}{{ m.content }}{% endfor %}").unwrap();
    let out = mlxcel()
        .arg("run")
        .arg(&dir)
        .args(["-p", "hi", "-n", "2", "--chat-template-file"])
        .arg(&good)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
}
