//! `cargo xtask bench --speech`: transcription speed as real-time factor (seconds of audio per second of
//! wall time) for whisper-tiny.en on `../shared/models/speech-en-16k.wav`, mlxcel beside whisper.cpp
//! (`pywhispercpp` in target/bench-whisper-venv, on the same checkpoint written as ggml by
//! `xtask/whisper_ggml.py`). Both time the transcription alone (model loaded, audio decoded), greedy,
//! without timestamps; medians of alternating runs. Prints a Markdown table for docs/benchmarks.md.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, Context, Result};

const PYWHISPERCPP: &str = "pywhispercpp==1.5.1";

/// A venv with pywhispercpp (a binary wheel of whisper.cpp) and numpy for the ggml conversion.
fn peer_python() -> Result<PathBuf> {
    let venv = crate::root().join("target/bench-whisper-venv");
    let py = venv.join("bin/python");
    let ready = |py: &Path| {
        Command::new(py).args(["-c", "import pywhispercpp.model, numpy"]).output().is_ok_and(|o| o.status.success())
    };
    if py.is_file() && ready(&py) {
        return Ok(py);
    }
    eprintln!("installing {PYWHISPERCPP} into {}", venv.display());
    let mut c = Command::new("python3");
    c.args(["-m", "venv"]).arg(&venv);
    crate::run(c)?;
    let mut c = Command::new(venv.join("bin/pip"));
    c.args(["install", "-q", "--only-binary=:all:", PYWHISPERCPP, "numpy"]);
    crate::run(c)?;
    if !ready(&py) {
        bail!("{PYWHISPERCPP} did not install into {}", venv.display());
    }
    Ok(py)
}

/// mlxcel's transcription seconds from its `-v` log line.
fn mlxcel_seconds(mlxcel: &Path, model: &Path, audio: &Path, threads: usize) -> Result<(f64, String)> {
    let out = Command::new(mlxcel)
        .args(["-v", "transcribe", "-m"])
        .arg(model)
        .arg(audio)
        .args(["-t", &threads.to_string()])
        .env_remove("RUST_LOG")
        .output()?;
    let err = String::from_utf8_lossy(&out.stderr);
    if !out.status.success() {
        bail!("mlxcel transcribe failed: {err}");
    }
    let line = err.lines().find(|l| l.contains("transcribed")).context("mlxcel printed no timing line")?;
    let seconds = line
        .split_whitespace()
        .find_map(|w| w.strip_prefix("seconds="))
        .and_then(|v| v.parse::<f64>().ok())
        .context("no seconds= in mlxcel's timing line")?;
    Ok((seconds, String::from_utf8_lossy(&out.stdout).trim().to_string()))
}

pub fn run(models: &Path, reps: usize, threads: &[usize], no_peer: bool) -> Result<()> {
    let model = models.join("whisper-tiny.en");
    let audio = crate::root().join("../shared/models/speech-en-16k.wav");
    if !model.is_dir() || !audio.is_file() {
        bail!("{} or {} is missing; run ../shared/models/fetch.sh", model.display(), audio.display());
    }
    let samples = (std::fs::metadata(&audio)?.len().saturating_sub(44) / 2) as f64;
    let audio_seconds = samples / 16000.0;
    let out = crate::build()?;
    let mlxcel = out.join("mlxcel");
    let peer = if no_peer { None } else { Some(peer_python()?) };
    let ggml = crate::root().join("target/bench-whisper/ggml-tiny.en.bin");
    if let Some(py) = &peer {
        if !ggml.is_file() {
            std::fs::create_dir_all(ggml.parent().unwrap())?;
            let mut c = Command::new(py);
            c.arg(crate::root().join("xtask/whisper_ggml.py")).arg(&model).arg(&ggml);
            crate::run(c)?;
        }
    }
    println!("| threads | mlxcel RTF | whisper.cpp RTF | ratio | mlxcel text | whisper.cpp text |");
    println!("|---|---|---|---|---|---|");
    for &t in threads {
        let mut ours = Vec::new();
        let mut theirs = Vec::new();
        let (mut our_text, mut their_text) = (String::new(), String::new());
        for _ in 0..reps.max(1) {
            let (s, text) = mlxcel_seconds(&mlxcel, &model, &audio, t)?;
            ours.push(s);
            our_text = text;
            if let Some(py) = &peer {
                let out = Command::new(py)
                    .arg(crate::root().join("xtask/bench_whisper_cpp.py"))
                    .arg(&ggml)
                    .arg(&audio)
                    .arg(t.to_string())
                    .output()?;
                let v = crate::bench::json_of(out, "whisper.cpp bench")?;
                theirs.push(v["seconds"].as_f64().context("seconds")?);
                their_text = v["text"].as_str().unwrap_or("").trim().to_string();
            }
        }
        let rtf = |s: f64| audio_seconds / s;
        let ours = rtf(crate::bench::median(ours));
        let (peer_rtf, ratio) = if theirs.is_empty() {
            ("-".to_string(), "-".to_string())
        } else {
            let p = rtf(crate::bench::median(theirs));
            (format!("{p:.1}"), format!("{:.2}", ours / p))
        };
        println!("| {t} | {ours:.1} | {peer_rtf} | {ratio} | {our_text} | {their_text} |");
    }
    Ok(())
}
