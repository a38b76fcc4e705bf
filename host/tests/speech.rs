//! Speech to text on the real whisper-tiny.en (skipped without `MLXCEL_TEST_MODELS`):
//! `mlxcel transcribe` on `../shared/models/speech-en-16k.wav` prints the float32 reference transcript
//! (../shared/models/README.md), and the same audio as FLAC and MP3 (written by `soundfile` in the SDK
//! venv) gives the same words; bad files are one clear error line, never a panic; `mlxcel-server` on the
//! model serves `/v1/audio/*` to the official `openai` SDK (tests/sdk/test_audio.py) and answers chat
//! routes and bad uploads with 400s; `mlxcel arch` lists the family (no model needed).

use std::path::{Path, PathBuf};
use std::process::Command;

use mlxcel::testing::TestServer;

/// The reference's stable sentence and its whole greedy transcript.
const STABLE: &str = "This is a speech recognition test.";
const REFERENCE: &str =
    "The quick roundfark stump over the lazy nog. The low world. This is a speech recognition test.";

fn whisper() -> Option<PathBuf> {
    Some(mlxcel::testing::test_models()?.join("whisper-tiny.en"))
}

fn speech_wav() -> PathBuf {
    mlxcel::testing::workspace_root().join("../shared/models/speech-en-16k.wav")
}

fn mlxcel() -> Command {
    mlxcel::testing::staged_plugin_dir();
    let mut c = Command::new(env!("CARGO_BIN_EXE_mlxcel"));
    c.env_remove("MLXCEL_PLUGIN_PATH").env_remove("RUST_LOG").env_remove("RUST_BACKTRACE");
    c
}

fn transcribe(model: &Path, file: &Path, extra: &[&str]) -> (bool, String, String) {
    let out = mlxcel().arg("transcribe").arg("-m").arg(model).arg(file).args(extra).output().unwrap();
    (out.status.success(), String::from_utf8_lossy(&out.stdout).into(), String::from_utf8_lossy(&out.stderr).into())
}

/// Lower-case words without punctuation (an MP3's lossy audio may move a comma).
fn words(s: &str) -> String {
    s.to_lowercase()
        .chars()
        .filter(|c| c.is_alphanumeric() || c.is_whitespace())
        .collect::<String>()
        .split_whitespace()
        .collect::<Vec<_>>()
        .join(" ")
}

#[test]
fn transcribe_prints_the_reference_transcript() {
    let Some(model) = whisper() else { return };
    let (ok, out, err) = transcribe(&model, &speech_wav(), &[]);
    assert!(ok, "{err}");
    assert!(out.contains(STABLE), "{out}");
    assert_eq!(out.trim(), REFERENCE);
}

#[test]
fn subtitle_formats_time_their_segments() {
    let Some(model) = whisper() else { return };
    let (ok, out, err) = transcribe(&model, &speech_wav(), &["--format", "verbose_json"]);
    assert!(ok, "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["text"], REFERENCE);
    let segs = v["segments"].as_array().unwrap();
    assert!(!segs.is_empty());
    let mut last = 0.0;
    for s in segs {
        let (a, b) = (s["start"].as_f64().unwrap(), s["end"].as_f64().unwrap());
        assert!(last <= a && a < b && b <= 7.5, "{s}");
        last = b;
    }
    let (ok, vtt, err) = transcribe(&model, &speech_wav(), &["--format", "vtt"]);
    assert!(ok && vtt.starts_with("WEBVTT\n\n00:00:00.000 --> ") && vtt.contains(STABLE), "{vtt}{err}");
}

/// The speech file at 0 s and again at 32 s, in a 40 s 16-bit WAV: two 30 s windows.
fn two_windows_wav(path: &Path) {
    let wav = std::fs::read(speech_wav()).unwrap();
    let at = wav.windows(4).position(|w| w == b"data").unwrap();
    let pcm = &wav[at + 8..];
    let mut data = pcm.to_vec();
    data.resize(32 * 16000 * 2, 0);
    data.extend_from_slice(pcm);
    data.resize(40 * 16000 * 2, 0);
    let mut v = Vec::new();
    v.extend(b"RIFF");
    v.extend(((36 + data.len()) as u32).to_le_bytes());
    v.extend(b"WAVEfmt ");
    for x in [16u32.to_le_bytes(), [1, 0, 1, 0], 16000u32.to_le_bytes(), 32000u32.to_le_bytes(), [2, 0, 16, 0]] {
        v.extend(x);
    }
    v.extend(b"data");
    v.extend((data.len() as u32).to_le_bytes());
    v.extend(data);
    std::fs::write(path, v).unwrap();
}

#[test]
fn long_audio_is_transcribed_window_by_window() {
    let Some(model) = whisper() else { return };
    let dir = tempfile::tempdir().unwrap();
    let long = dir.path().join("long.wav");
    two_windows_wav(&long);
    let (ok, out, err) = transcribe(&model, &long, &[]);
    assert!(ok, "{err}");
    assert_eq!(out.matches(STABLE).count(), 2, "{out}");
    let (ok, out, err) = transcribe(&model, &long, &["--format", "verbose_json"]);
    assert!(ok, "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    let starts: Vec<f64> = v["segments"].as_array().unwrap().iter().map(|s| s["start"].as_f64().unwrap()).collect();
    assert!(starts.iter().any(|&s| s < 1.0) && starts.iter().any(|&s| s >= 30.0), "{starts:?}");
    assert!(starts.windows(2).all(|w| w[0] <= w[1]), "{starts:?}");
    assert!((v["duration"].as_f64().unwrap() - 40.0).abs() < 0.01);
}

#[test]
fn flac_and_mp3_copies_give_the_same_words() {
    let Some(model) = whisper() else { return };
    let py = mlxcel::testing::sdk_venv_python();
    let dir = tempfile::tempdir().unwrap();
    let script =
        "import soundfile as sf, sys; x, sr = sf.read(sys.argv[1]); [sf.write(p, x, sr) for p in sys.argv[2:]]";
    let (flac, mp3) = (dir.path().join("speech.flac"), dir.path().join("speech.mp3"));
    let ok = Command::new(py).args(["-c", script]).arg(speech_wav()).arg(&flac).arg(&mp3).status().unwrap();
    assert!(ok.success(), "soundfile could not write FLAC and MP3");
    let (ok, out, err) = transcribe(&model, &flac, &[]);
    assert!(ok, "{err}");
    assert_eq!(out.trim(), REFERENCE, "FLAC");
    let (ok, out, err) = transcribe(&model, &mp3, &[]);
    assert!(ok, "{err}");
    assert!(out.contains("speech recognition test"), "MP3: {out}");
    assert_eq!(words(&out), words(REFERENCE), "MP3");
}

#[test]
fn bad_audio_files_are_one_clear_error_line() {
    let Some(model) = whisper() else { return };
    let dir = tempfile::tempdir().unwrap();
    let wav = std::fs::read(speech_wav()).unwrap();
    let cases: [(&str, Vec<u8>, &str); 4] = [
        ("empty.wav", vec![], "empty"),
        ("truncated.wav", wav[..1000].to_vec(), "truncated"),
        ("notes.mp3", b"this is a text file, not audio\n".repeat(10), "not a WAV, FLAC, MP3 or Ogg Vorbis file"),
        // 8-bit mu-law WAV: a sample format the decoder does not take.
        ("mulaw.wav", mulaw_wav(), "notes"),
    ];
    for (name, bytes, want) in cases {
        let path = dir.path().join(name);
        std::fs::write(&path, bytes).unwrap();
        let (ok, _, err) = transcribe(&model, &path, &[]);
        assert!(!ok, "{name} was accepted");
        let lines: Vec<&str> = err.lines().collect();
        assert_eq!(lines.len(), 1, "{name}: {err}");
        assert!(lines[0].starts_with("error: ") && lines[0].contains(name), "{name}: {err}");
        assert!(!err.contains("panic") && !err.contains("internal error"), "{name}: {err}");
        if want != "notes" {
            assert!(err.contains(want), "{name}: {err}");
        }
    }
    // Options the model cannot honour are refused by name.
    let (ok, _, err) = transcribe(&model, &speech_wav(), &["--task", "translate"]);
    assert!(!ok && err.contains("English-only"), "{err}");
    let (ok, _, err) = transcribe(&model, &speech_wav(), &["--format", "xml"]);
    assert!(!ok && err.contains("xml"), "{err}");
}

/// A WAV header announcing 8-bit mu-law (format 7) with a little data.
fn mulaw_wav() -> Vec<u8> {
    let data = vec![0x7fu8; 1600];
    let mut v = Vec::new();
    v.extend(b"RIFF");
    v.extend(((36 + data.len()) as u32).to_le_bytes());
    v.extend(b"WAVEfmt ");
    v.extend(16u32.to_le_bytes());
    v.extend(7u16.to_le_bytes()); // mu-law
    v.extend(1u16.to_le_bytes());
    v.extend(8000u32.to_le_bytes());
    v.extend(8000u32.to_le_bytes());
    v.extend(1u16.to_le_bytes());
    v.extend(8u16.to_le_bytes());
    v.extend(b"data");
    v.extend((data.len() as u32).to_le_bytes());
    v.extend(data);
    v
}

const KEY: &str = "test-key";

fn start_server(model: &Path) -> TestServer {
    // The speech file is 222 kB; a small audio limit keeps the 413 check's body small.
    let args = ["--api-key", KEY, "-a", "whisper-tiny.en", "--max-audio-bytes", "300000"];
    TestServer::start(env!("CARGO_BIN_EXE_mlxcel-server"), model, &args)
}

#[test]
fn openai_sdk_transcribes_through_the_server() {
    let Some(model) = whisper() else { return };
    let py = mlxcel::testing::sdk_venv_python();
    let server = start_server(&model);
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/sdk/test_audio.py");
    let out =
        Command::new(py).arg(script).args([&server.base, KEY, "whisper-tiny.en"]).arg(speech_wav()).output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    println!("{stdout}");
    assert!(out.status.success(), "SDK checks failed:\n{stdout}\n{}", String::from_utf8_lossy(&out.stderr));

    // Raw HTTP: a form without a file, an unknown field, and a body over --max-audio-bytes are 400 / 413.
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    rt.block_on(async {
        let client = reqwest::Client::new();
        let post = |form: Vec<(&'static str, String)>| {
            let mut body = String::new();
            for (k, v) in &form {
                body += &format!("--XyZ\r\nContent-Disposition: form-data; name=\"{k}\"\r\n\r\n{v}\r\n");
            }
            body += "--XyZ--\r\n";
            client
                .post(format!("{}/v1/audio/transcriptions", server.base))
                .bearer_auth(KEY)
                .header("content-type", "multipart/form-data; boundary=XyZ")
                .body(body)
                .send()
        };
        let r = post(vec![("model", "whisper-1".into())]).await.unwrap();
        assert_eq!(r.status(), 400);
        let v: serde_json::Value = r.json().await.unwrap();
        assert_eq!(v["error"]["param"], "file", "{v}");
        let r = post(vec![("model", "whisper-1".into()), ("best_of", "5".into())]).await.unwrap();
        assert_eq!(r.status(), 400);
        let v: serde_json::Value = r.json().await.unwrap();
        assert!(v["error"]["message"].as_str().unwrap().contains("best_of"), "{v}");
        let r = post(vec![("response_format", "xml".into())]).await.unwrap();
        assert_eq!(r.status(), 400);
        // The llama-server dialect's chat route answers in its own shape.
        let r = client
            .post(format!("{}/completion", server.base))
            .bearer_auth(KEY)
            .json(&serde_json::json!({"prompt": "hi"}))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 400);
        let v: serde_json::Value = r.json().await.unwrap();
        assert!(v["error"]["message"].as_str().unwrap().contains("speech-recognition"), "{v}");
        // Last: a body over the limit is refused before it is read, and the server then closes that
        // connection, so a pooled client must not send another request on it.
        let r = post(vec![("big", "x".repeat(400_000))]).await.unwrap();
        assert_eq!(r.status(), 413);
    });
}

#[test]
fn arch_lists_the_whisper_family() {
    let out = mlxcel().args(["arch", "--json"]).output().unwrap();
    assert!(out.status.success());
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let fam = v["families"].as_array().unwrap().iter().find(|f| f["name"] == "whisper").expect("whisper family");
    assert_eq!(fam["architectures"], serde_json::json!(["whisper"]));
}

/// The tiny random Whisper of the family's golden tests (1 s windows, no timestamp tokens), end to end
/// through the CLI without real models: its words are noise, but every path runs and options it cannot
/// honour are refused; a copy marked multilingual detects its language and accepts translation.
#[test]
fn the_tiny_fixture_runs_end_to_end_and_refuses_what_it_cannot_do() {
    let fixture = mlxcel::testing::workspace_root().join("families/whisper/tests/fixtures/whisper-tiny-random");
    let wav = fixture.join("input.wav");
    let (ok, out, err) = transcribe(&fixture, &wav, &["--format", "json", "-t", "2"]);
    assert!(ok, "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert!(v["text"].is_string(), "{v}");
    let (ok, _, err) = transcribe(&fixture, &wav, &["--timestamps"]);
    assert!(!ok && err.contains("no timestamp tokens"), "{err}");
    let (ok, _, err) = transcribe(&fixture, &wav, &["--task", "translate"]);
    assert!(!ok && err.contains("English-only"), "{err}");

    let dir = tempfile::tempdir().unwrap();
    for f in std::fs::read_dir(&fixture).unwrap() {
        let f = f.unwrap().path();
        std::fs::copy(&f, dir.path().join(f.file_name().unwrap())).unwrap();
    }
    let gen_path = dir.path().join("generation_config.json");
    let mut gen: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&gen_path).unwrap()).unwrap();
    gen["is_multilingual"] = true.into();
    std::fs::write(&gen_path, gen.to_string()).unwrap();
    let (ok, out, err) = transcribe(dir.path(), &wav, &["--task", "translate", "--format", "text"]);
    assert!(ok && out.ends_with('\n'), "{err}");
    let (ok, _, err) = transcribe(dir.path(), &wav, &["--language", "de"]);
    assert!(!ok && err.contains("language `de`"), "{err}");
}
