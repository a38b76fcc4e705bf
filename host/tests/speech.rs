//! Speech to text on the real whisper-tiny.en (skipped without `MLXCEL_TEST_MODELS`):
//! `mlxcel transcribe` on `../shared/models/speech-en-16k.wav` prints the float32 reference transcript
//! (../shared/models/README.md), and the same audio as FLAC and MP3 (written by `soundfile` in the SDK
//! venv) gives the same words; bad files are one clear error line, never a panic; `mlxcel-server` on the
//! model serves `/v1/audio/*` to the official `openai` SDK (tests/sdk/test_audio.py) and answers chat
//! routes and bad uploads with 400s, takes and checks `best_of`, and stops a transcription whose client
//! went away; `mlxcel arch` lists the family (no model needed).

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

/// The server chooses its routes by the task the family that claims a model reports, before loading
/// it; a config that no family claims is one clear error.
#[test]
fn a_models_task_comes_from_the_family_that_claims_it() {
    use mlxcel::checkpoint::Checkpoint;
    use mlxcel::engine::ModelRunner;
    use mlxcel_plugin_api::Task;
    let Some(model) = whisper() else { return };
    let catalog = mlxcel::testing::staged_catalog();
    assert_eq!(ModelRunner::task_of(&catalog, &Checkpoint::open(&model).unwrap()).unwrap(), Task::Asr);
    let text = model.with_file_name("smollm2-135m-instruct-mlx-4bit");
    assert_eq!(ModelRunner::task_of(&catalog, &Checkpoint::open(&text).unwrap()).unwrap(), Task::Text);
    let dir = tempfile::tempdir().unwrap();
    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(model.join("config.json")).unwrap()).unwrap();
    config.as_object_mut().unwrap().remove("model_type");
    std::fs::write(dir.path().join("config.json"), config.to_string()).unwrap();
    std::fs::copy(model.join("model.safetensors"), dir.path().join("model.safetensors")).unwrap();
    let err = format!("{:#}", ModelRunner::task_of(&catalog, &Checkpoint::open(dir.path()).unwrap()).unwrap_err());
    assert!(err.contains("no `model_type`, and no installed family recognises its config"), "{err}");
}

#[test]
fn transcribe_prints_the_reference_transcript() {
    let Some(model) = whisper() else { return };
    let (ok, out, err) = transcribe(&model, &speech_wav(), &[]);
    assert!(ok, "{err}");
    assert!(out.contains(STABLE), "{out}");
    assert_eq!(out.trim(), REFERENCE);
    // From a pipe: `-` is standard input, and /dev/stdin (a size of 0) is read whole too.
    for file in ["-", "/dev/stdin"] {
        let out = mlxcel()
            .arg("transcribe")
            .arg("-m")
            .arg(&model)
            .arg(file)
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .and_then(|mut child| {
                use std::io::Write;
                let wav = std::fs::read(speech_wav()).unwrap();
                child.stdin.take().unwrap().write_all(&wav)?;
                child.wait_with_output()
            })
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success(), "{file}: {}", String::from_utf8_lossy(&out.stderr));
        assert_eq!(text.trim(), REFERENCE, "{file}");
    }
    // A directory is said to be one.
    let (ok, _, err) = transcribe(&model, &std::env::temp_dir(), &[]);
    assert!(!ok && err.contains("a directory"), "{err}");
}

#[test]
fn subtitle_formats_time_their_segments() {
    let Some(model) = whisper() else { return };
    let (ok, out, err) = transcribe(&model, &speech_wav(), &["--format", "verbose_json"]);
    assert!(ok, "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["text"], REFERENCE);
    // OpenAI's usage for whisper-1: the clip's 6.94 s as whole seconds, rounded up.
    assert_eq!(v["usage"], serde_json::json!({"type": "duration", "seconds": 7}), "{v}");
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

/// Several files: each JSON object on its own line naming its file, a bad file named on stderr while
/// the others are transcribed (exit status 1); `--timestamps` prints timed lines as whisper.cpp does
/// and is refused with `json`, which holds no times.
#[test]
fn several_files_go_on_past_a_bad_one_and_timestamps_show() {
    let Some(model) = whisper() else { return };
    let bad = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(bad.path(), b"not audio").unwrap();
    let out = mlxcel()
        .arg("transcribe")
        .arg("-m")
        .arg(&model)
        .args([speech_wav().as_path(), bad.path(), speech_wav().as_path()])
        .args(["--format", "json"])
        .output()
        .unwrap();
    let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(!out.status.success(), "{stderr}");
    let lines: Vec<serde_json::Value> = stdout.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert_eq!(lines.len(), 2, "{stdout}");
    for v in &lines {
        assert_eq!((v["text"].as_str(), v["file"].as_str()), (Some(REFERENCE), speech_wav().to_str()), "{v}");
    }
    assert!(stderr.contains(&format!("error: {}: not a WAV", bad.path().display())), "{stderr}");
    assert!(stderr.contains("1 of 3 files could not be transcribed"), "{stderr}");

    let (ok, out, err) = transcribe(&model, &speech_wav(), &["--timestamps"]);
    assert!(ok && out.starts_with("[00:00:00.000 --> ") && out.contains(STABLE), "{out}{err}");
    assert!(out.lines().all(|l| l.starts_with('[') && l.contains("]  ")), "{out}");
    let (ok, _, err) = transcribe(&model, &speech_wav(), &["--timestamps", "--format", "json"]);
    assert!(!ok && err.contains("the json format holds only the text"), "{err}");
}

/// The speech file's 16-bit PCM samples.
fn speech_pcm() -> Vec<u8> {
    let wav = std::fs::read(speech_wav()).unwrap();
    let at = wav.windows(4).position(|w| w == b"data").unwrap();
    wav[at + 8..].to_vec()
}

/// The speech file at 0 s and again at 32 s, in a 40 s 16-bit WAV: two 30 s windows.
fn two_windows_wav(path: &Path) {
    let pcm = speech_pcm();
    let mut data = pcm.clone();
    data.resize(32 * 16000 * 2, 0);
    data.extend_from_slice(&pcm);
    data.resize(40 * 16000 * 2, 0);
    std::fs::write(path, wav_bytes(data)).unwrap();
}

/// The speech file at the start of each of `n` 30 s windows, as one 16 kHz 16-bit WAV.
fn repeated_windows_wav(n: usize) -> Vec<u8> {
    let pcm = speech_pcm();
    let mut data = Vec::new();
    for i in 0..n {
        data.extend_from_slice(&pcm);
        data.resize((i + 1) * 30 * 16000 * 2, 0);
    }
    wav_bytes(data)
}

/// Mono 16 kHz 16-bit PCM as a WAV file.
fn wav_bytes(data: Vec<u8>) -> Vec<u8> {
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
    v
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
fn flac_mp3_and_m4a_copies_give_the_same_words() {
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
    // AAC in M4A, as phones record it (`ffmpeg -i speech-en-16k.wav -c:a aac -b:a 96k`: AAC's
    // priming, which the container's edit list drops, would otherwise shift the audio).
    let m4a = mlxcel::testing::workspace_root().join("host/tests/fixtures/speech-en-16k.m4a");
    let (ok, out, err) = transcribe(&model, &m4a, &[]);
    assert!(ok, "{err}");
    assert_eq!(out.trim(), REFERENCE, "M4A");
}

#[test]
fn bad_audio_files_are_one_clear_error_line() {
    let Some(model) = whisper() else { return };
    let dir = tempfile::tempdir().unwrap();
    let wav = std::fs::read(speech_wav()).unwrap();
    let cases: [(&str, Vec<u8>, &str); 4] = [
        ("empty.wav", vec![], "empty"),
        ("truncated.wav", wav[..1000].to_vec(), "truncated"),
        (
            "notes.mp3",
            b"this is a text file, not audio\n".repeat(10),
            "not a WAV, FLAC, MP3, Ogg, MP4/M4A or WebM audio file",
        ),
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
    // Values outside a flag's choices are usage errors (exit 2), which list the choices.
    for (flag, value, choices) in [("--format", "xml", "verbose_json"), ("--task", "bogus", "translate")] {
        let out = mlxcel().arg("transcribe").arg("-m").arg(&model).arg(speech_wav()).args([flag, value]).output();
        let out = out.expect("mlxcel runs");
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{flag} {value}: {err}");
        assert!(err.contains(value) && err.contains(choices), "{flag} {value}: {err}");
    }
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
        // best_of is 1..20, checked before the audio is read.
        for bad in ["0", "21", "five"] {
            let r = post(vec![("model", "whisper-1".into()), ("best_of", bad.into())]).await.unwrap();
            assert_eq!(r.status(), 400);
            let v: serde_json::Value = r.json().await.unwrap();
            assert_eq!(v["error"]["param"], "best_of", "{v}");
            assert!(v["error"]["message"].as_str().unwrap().contains(bad), "{v}");
        }
        let audio = std::fs::read(speech_wav()).unwrap();
        let with_file = |fields: &[(&str, &str)]| {
            client
                .post(format!("{}/v1/audio/transcriptions", server.base))
                .bearer_auth(KEY)
                .header("content-type", "multipart/form-data; boundary=XyZ")
                .body(multipart(fields, &audio))
                .send()
        };
        // Greedy (temperature 0) decodes one candidate whatever best_of says.
        let r = with_file(&[("best_of", "3"), ("response_format", "text")]).await.unwrap();
        assert_eq!(r.status(), 200);
        assert_eq!(r.text().await.unwrap().trim(), REFERENCE);
        // Sampled: two candidates, the likelier kept; the words are the model's, mostly the reference's.
        let r = with_file(&[("best_of", "2"), ("temperature", "0.4"), ("response_format", "text")]).await.unwrap();
        assert_eq!(r.status(), 200);
        let text = r.text().await.unwrap();
        assert!(words(&text).contains("recognition test"), "{text}");
        let r = post(vec![("response_format", "xml".into())]).await.unwrap();
        assert_eq!(r.status(), 400);
        // Segment granularity goes with any format (as OpenAI's API: these forms fail only for
        // their missing file); word timestamps are refused by name.
        for format in ["json", "text", "srt", "verbose_json"] {
            let form = vec![("timestamp_granularities[]", "segment".into()), ("response_format", format.into())];
            let v: serde_json::Value = post(form).await.unwrap().json().await.unwrap();
            assert_eq!(v["error"]["param"], "file", "{format}: {v}");
        }
        let v: serde_json::Value =
            post(vec![("timestamp_granularities[]", "word".into())]).await.unwrap().json().await.unwrap();
        assert_eq!(v["error"]["param"], "timestamp_granularities", "{v}");
        // An unknown field in OpenAI's words; a `stream` that is no boolean named as such.
        let v: serde_json::Value = post(vec![("foo", "1".into())]).await.unwrap().json().await.unwrap();
        assert_eq!(v["error"]["message"], "Unrecognized request argument supplied: foo", "{v}");
        let v: serde_json::Value = post(vec![("stream", "maybe".into())]).await.unwrap().json().await.unwrap();
        assert!(v["error"]["message"].as_str().unwrap().contains("true or false"), "{v}");
        // A field refused before the file is answered once the whole upload is read: the client gets
        // the 400 on a connection it can use again (this client pools its connections).
        for _ in 0..3 {
            let r = with_file(&[("stream", "true"), ("response_format", "text")]).await.unwrap();
            assert_eq!(r.status(), 400);
            let v: serde_json::Value = r.json().await.unwrap();
            assert_eq!(v["error"]["param"], "stream", "{v}");
        }
        // What this English-only model cannot do names the field that asked for it.
        let r = with_file(&[("language", "de")]).await.unwrap();
        assert_eq!(r.status(), 400);
        let v: serde_json::Value = r.json().await.unwrap();
        assert_eq!(v["error"]["param"], "language", "{v}");
        assert!(v["error"]["message"].as_str().unwrap().contains("English-only"), "{v}");
        // A code no Whisper model knows is named as such.
        let r = with_file(&[("language", "xx")]).await.unwrap();
        let v: serde_json::Value = r.json().await.unwrap();
        assert!(v["error"]["message"].as_str().unwrap().contains("not a Whisper language code"), "{v}");
        let r = client
            .post(format!("{}/v1/audio/translations", server.base))
            .bearer_auth(KEY)
            .header("content-type", "multipart/form-data; boundary=XyZ")
            .body(multipart(&[], &audio))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 400);
        let v: serde_json::Value = r.json().await.unwrap();
        assert_eq!(v["error"]["param"], "model", "{v}");
        assert!(v["error"]["message"].as_str().unwrap().contains("English-only"), "{v}");
        // A field given twice would have one value dropped: refused by name.
        let r = with_file(&[("response_format", "srt"), ("response_format", "text")]).await.unwrap();
        let v: serde_json::Value = r.json().await.unwrap();
        assert_eq!(v["error"]["param"], "response_format", "{v}");
        // A JSON body is no upload: the error says what is expected.
        let r = client
            .post(format!("{}/v1/audio/transcriptions", server.base))
            .bearer_auth(KEY)
            .json(&serde_json::json!({"file": "speech.wav"}))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 400);
        let v: serde_json::Value = r.json().await.unwrap();
        assert!(v["error"]["message"].as_str().unwrap().contains("multipart/form-data"), "{v}");
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
        // The limit is the file's: one of exactly 300000 bytes is read (and is not audio), one byte
        // more is a 413 naming the file.
        for (size, status) in [(300_000, 400), (300_001, 413)] {
            let r = client
                .post(format!("{}/v1/audio/transcriptions", server.base))
                .bearer_auth(KEY)
                .header("content-type", "multipart/form-data; boundary=XyZ")
                .body(multipart(&[("model", "whisper-1")], &vec![b'x'; size]))
                .send()
                .await
                .unwrap();
            assert_eq!(r.status(), status, "{size}");
            let v: serde_json::Value = r.json().await.unwrap();
            assert_eq!(v["error"]["param"], "file", "{v}");
        }
        let r = post(vec![("big", "x".repeat(400_000))]).await.unwrap();
        assert_eq!(r.status(), 413);
    });
}

/// A multipart form with text `fields` and `file` as `speech.wav`, boundary `XyZ`.
fn multipart(fields: &[(&str, &str)], file: &[u8]) -> Vec<u8> {
    let mut body = Vec::new();
    for (k, v) in fields {
        body.extend(format!("--XyZ\r\nContent-Disposition: form-data; name=\"{k}\"\r\n\r\n{v}\r\n").as_bytes());
    }
    body.extend(b"--XyZ\r\nContent-Disposition: form-data; name=\"file\"; filename=\"speech.wav\"\r\n");
    body.extend(b"Content-Type: audio/wav\r\n\r\n");
    body.extend(file);
    body.extend(b"\r\n--XyZ--\r\n");
    body
}

/// A value of the server's `/metrics`.
async fn metric(client: &reqwest::Client, base: &str, name: &str) -> f64 {
    let text = client.get(format!("{base}/metrics")).bearer_auth(KEY).send().await.unwrap().text().await.unwrap();
    let line = text.lines().find(|l| l.split(' ').next() == Some(name)).unwrap_or_else(|| panic!("no {name}: {text}"));
    line.rsplit(' ').next().unwrap().parse().unwrap()
}

/// A client that leaves mid-transcription stops it: a recording of many windows is posted, and once
/// the first window is done the request is dropped. The transcription thread stops before its next
/// model step (counted as cancelled, fewer windows than the recording has, no step after), and the
/// server then transcribes the next request.
#[test]
fn a_client_that_leaves_cancels_its_transcription() {
    let Some(model) = whisper() else { return };
    const WINDOWS: usize = 12;
    let server = TestServer::start(env!("CARGO_BIN_EXE_mlxcel-server"), &model, &["--api-key", KEY, "--metrics"]);
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    rt.block_on(async {
        let client = reqwest::Client::new();
        let base = server.base.clone();
        let long = multipart(&[("response_format", "text")], &repeated_windows_wav(WINDOWS));
        let leaving = reqwest::Client::new();
        let request = leaving
            .post(format!("{base}/v1/audio/transcriptions"))
            .bearer_auth(KEY)
            .header("content-type", "multipart/form-data; boundary=XyZ")
            .body(long)
            .send();
        let pending = tokio::spawn(request);
        // Bounded waits for events (a hung server fails here rather than hanging the suite).
        let wait_for = |name: &'static str, want: f64| {
            let (client, base) = (client.clone(), base.clone());
            async move {
                for _ in 0..6000 {
                    if metric(&client, &base, name).await >= want {
                        return;
                    }
                    tokio::time::sleep(std::time::Duration::from_millis(20)).await;
                }
                panic!("{name} never reached {want}");
            }
        };
        wait_for("mlxcel_transcription_windows_total", 1.0).await;
        pending.abort();
        let _ = pending.await;
        drop(leaving);
        wait_for("mlxcel_requests_cancelled_total", 1.0).await;
        let windows = metric(&client, &base, "mlxcel_transcription_windows_total").await;
        assert!(windows < WINDOWS as f64, "all {windows} windows were transcribed: nothing was cancelled");
        eprintln!("cancelled after {windows} of {WINDOWS} windows");
        assert_eq!(metric(&client, &base, "llamacpp:requests_processing").await, 0.0);
        assert_eq!(metric(&client, &base, "mlxcel_requests_total").await, 0.0);
        let steps = metric(&client, &base, "mlxcel_transcription_steps_total").await;

        // The server goes on: the next request is transcribed whole.
        let r = client
            .post(format!("{base}/v1/audio/transcriptions"))
            .bearer_auth(KEY)
            .header("content-type", "multipart/form-data; boundary=XyZ")
            .body(multipart(&[("response_format", "text")], &std::fs::read(speech_wav()).unwrap()))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        assert_eq!(r.text().await.unwrap().trim(), REFERENCE);
        assert_eq!(metric(&client, &base, "mlxcel_requests_total").await, 1.0);
        assert_eq!(metric(&client, &base, "mlxcel_requests_cancelled_total").await, 1.0);
        assert!(metric(&client, &base, "mlxcel_transcription_steps_total").await > steps);
    });
}

/// `--timeout` holds for transcriptions as for every route: a recording that takes longer is a 504
/// in OpenAI's shape, its transcription stops (counted as cancelled), and the server goes on;
/// `/props` and `/slots` answer in llama-server's shape.
#[test]
fn a_transcription_past_the_timeout_is_a_504_and_stops() {
    let Some(model) = whisper() else { return };
    let server = TestServer::start(
        env!("CARGO_BIN_EXE_mlxcel-server"),
        &model,
        &["--api-key", KEY, "--metrics", "--timeout", "1"],
    );
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    rt.block_on(async {
        let (client, base) = (reqwest::Client::new(), server.base.clone());
        let post = |wav: Vec<u8>| {
            client
                .post(format!("{base}/v1/audio/transcriptions"))
                .bearer_auth(KEY)
                .header("content-type", "multipart/form-data; boundary=XyZ")
                .body(multipart(&[("response_format", "json")], &wav))
                .send()
        };
        // Twenty windows of speech take far longer than a second on any CPU.
        let r = post(repeated_windows_wav(20)).await.unwrap();
        assert_eq!(r.status(), 504);
        let v: serde_json::Value = r.json().await.unwrap();
        assert!(v["error"]["message"].as_str().unwrap().contains("timeout"), "{v}");
        for _ in 0..3000 {
            if metric(&client, &base, "mlxcel_requests_cancelled_total").await >= 1.0 {
                break;
            }
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
        assert_eq!(metric(&client, &base, "mlxcel_requests_cancelled_total").await, 1.0);
        // The transcription thread goes on: it answers the next upload (an option this English-only
        // model refuses there, so that no timing is involved).
        let r = client
            .post(format!("{base}/v1/audio/translations"))
            .bearer_auth(KEY)
            .header("content-type", "multipart/form-data; boundary=XyZ")
            .body(multipart(&[], &std::fs::read(speech_wav()).unwrap()))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 400);
        let v: serde_json::Value = r.json().await.unwrap();
        assert!(v["error"]["message"].as_str().unwrap().contains("English-only"), "{v}");
        // llama-server's probes answer on a speech server too.
        let get = |path: &str| client.get(format!("{base}{path}")).bearer_auth(KEY).send();
        let props: serde_json::Value = get("/props").await.unwrap().json().await.unwrap();
        assert_eq!((props["total_slots"].as_u64(), props["modalities"]["audio"].as_bool()), (Some(1), Some(true)));
        // The decoder's context (whisper-tiny.en's max_target_positions), in /v1/models too.
        assert_eq!(props["default_generation_settings"]["n_ctx"], 448, "{props}");
        let models: serde_json::Value = get("/v1/models").await.unwrap().json().await.unwrap();
        assert_eq!(models["data"][0]["meta"]["n_ctx"], 448, "{models}");
        let slots: serde_json::Value = get("/slots").await.unwrap().json().await.unwrap();
        assert_eq!((&slots[0]["is_processing"], &slots[0]["n_ctx"]), (&false.into(), &448.into()), "{slots}");
    });
}

/// Text-model flags a Whisper model cannot honour stop the server with a message naming them, from
/// the command line or from llama-server's environment variables.
#[test]
fn a_speech_server_refuses_text_model_flags() {
    let Some(model) = whisper() else { return };
    for (flag, value, named) in [
        ("-c", "1024", "-c"),
        ("--embedding", "", "--embedding"),
        ("-np", "4", "--parallel"),
        ("--temp", "0.5", "--temp"),
        ("--no-cache-prompt", "", "--no-cache-prompt"),
        ("--chat-template-kwargs", "{}", "--chat-template-kwargs"),
    ] {
        let mut c = mlxcel::testing::server_command(env!("CARGO_BIN_EXE_mlxcel-server"));
        c.arg("-m").arg(&model).args(["--port", "0", flag]);
        if !value.is_empty() {
            c.arg(value);
        }
        let out = c.output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{flag}: {err}");
        assert!(err.contains(named) && err.contains("speech-recognition"), "{flag}: {err}");
    }
    let mut c = mlxcel::testing::server_command(env!("CARGO_BIN_EXE_mlxcel-server"));
    let out = c.arg("-m").arg(&model).args(["--port", "0"]).env("LLAMA_ARG_N_PREDICT", "64").output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("LLAMA_ARG_N_PREDICT: ") && err.contains("does not use"), "{err}");
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
    // Sampling with best_of candidates decoded together, and best_of's bounds.
    let (ok, out, err) = transcribe(&fixture, &wav, &["--temperature", "0.8", "--best-of", "3", "--format", "json"]);
    assert!(ok, "{err}");
    assert!(serde_json::from_str::<serde_json::Value>(&out).unwrap()["text"].is_string(), "{out}");
    for bad in ["0", "21"] {
        let (ok, _, err) = transcribe(&fixture, &wav, &["--best-of", bad]);
        assert!(!ok && err.contains("--best-of"), "{err}");
    }

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
