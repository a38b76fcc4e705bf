//! `mlxcel transcribe -m MODEL FILE…`: speech to text with a Whisper model.

use std::io::{IsTerminal, Write};
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use clap::Args;

use super::GlobalArgs;
use crate::checkpoint::Checkpoint;
use crate::speech::transcribe::MAX_BEST_OF;
use crate::speech::{
    load_transcriber, render, render_json, timed_lines, ResponseFormat, SpeechTask, TranscribeOptions, Transcriber,
    Transcript,
};

#[derive(Args, Debug, Clone)]
pub struct TranscribeArgs {
    /// Whisper model: folder, hub name or mlxcel store name.
    #[arg(short = 'm', long = "model", value_name = "MODEL")]
    pub model: String,
    /// Audio files (WAV, FLAC, MP3, Ogg Vorbis, AAC/ALAC in M4A, WebM; any rate and channels); `-` reads
    /// standard input.
    #[arg(value_name = "FILE", required = true)]
    pub files: Vec<PathBuf>,
    /// Output format: text, json, verbose_json, srt, vtt (the last three carry segment timestamps).
    #[arg(long, default_value = "text", value_parser = ResponseFormat::parse)]
    pub format: ResponseFormat,
    /// Spoken language code (e.g. `en`, `de`); default: detected (multilingual models) or English.
    #[arg(long)]
    pub language: Option<String>,
    /// `transcribe`, or `translate` into English (multilingual models).
    #[arg(long, default_value = "transcribe", value_parser = SpeechTask::parse)]
    pub task: SpeechTask,
    /// Predict segment timestamps (always on for verbose_json, srt and vtt).
    #[arg(long)]
    pub timestamps: bool,
    /// Starting temperature; decoding falls back to higher ones when the result looks wrong.
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f32,
    /// Candidates sampled per window at temperatures above 0 (fallback included); the likeliest is kept.
    #[arg(long = "best-of", default_value_t = crate::speech::transcribe::DEFAULT_BEST_OF,
          value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..=MAX_BEST_OF as u64))]
    pub best_of: usize,
    /// Text to condition the first window on (names, spelling, style).
    #[arg(long)]
    pub prompt: Option<String>,
    /// Worker threads (default: all cores).
    #[arg(short = 't', long, value_parser = crate::cli::thread_count)]
    pub threads: Option<u32>,
    /// Backend plugin to use (default: the best-scoring one on this machine).
    #[arg(long)]
    pub backend: Option<String>,
    /// Hub revision when MODEL is a hub name.
    #[arg(long)]
    pub revision: Option<String>,
}

pub fn run(global: &GlobalArgs, args: &TranscribeArgs) -> Result<()> {
    let (format, task) = (args.format, args.task);
    if args.timestamps && format == ResponseFormat::Json {
        bail!("--timestamps: the json format holds only the text; verbose_json, srt and vtt give the segments' times");
    }
    if args.files.iter().filter(|f| f.as_os_str() == "-").count() > 1 {
        bail!("`-` (standard input) is named more than once; it can be read once");
    }
    let dir = super::run::resolve_model(&args.model, args.revision.as_deref())?;
    let catalog = global.catalog();
    let mut transcriber = Checkpoint::open(&dir)
        .map_err(anyhow::Error::from)
        .and_then(|ck| load_transcriber(&catalog, ck, args.backend.clone(), args.threads.unwrap_or(0), args.best_of))
        .with_context(|| format!("loading {}", dir.display()))?;
    let opts = TranscribeOptions {
        // (Codes are lower-case, as openai-whisper and the server read them.)
        language: args.language.as_deref().map(str::to_lowercase),
        task,
        timestamps: args.timestamps || format.needs_timestamps(),
        temperature: args.temperature,
        best_of: args.best_of,
        prompt: args.prompt.clone(),
        seed: 0,
    };
    // Options the model cannot honour are refused before any file is read.
    transcriber.check_options(&opts)?;
    let task_name = if task == SpeechTask::Translate { "translate" } else { "transcribe" };
    let several = args.files.len() > 1;
    let mut stdout = std::io::stdout().lock();
    let mut failed = 0;
    // Each file on its own: one that cannot be read or transcribed is named on stderr and the rest
    // go on (as whisper.cpp's command line goes on), the exit status saying some failed.
    for file in &args.files {
        let t = match transcribe_file(&mut transcriber, file, &opts) {
            Ok(t) => t,
            Err(e) if !several => return Err(e),
            Err(e) => {
                eprintln!("error: {e:#}");
                failed += 1;
                continue;
            }
        };
        let json = render_json(&t, format, task_name);
        if several && json.is_none() {
            writeln!(stdout, "==> {} <==", file.display())?;
        }
        let out = match json {
            // Several files' JSON: one object per line, each naming its file.
            Some(mut v) if several => {
                v["file"] = file.display().to_string().into();
                v.to_string()
            }
            Some(v) => v.to_string(),
            None if args.timestamps && format == ResponseFormat::Text => timed_lines(&t),
            None => render(&t, format, task_name),
        };
        stdout.write_all(out.as_bytes())?;
        if !out.ends_with('\n') {
            writeln!(stdout)?;
        }
        stdout.flush()?;
    }
    if failed > 0 {
        bail!("{failed} of {} files could not be transcribed", args.files.len());
    }
    Ok(())
}

/// One file's transcript, with a progress bar for a long one.
fn transcribe_file(transcriber: &mut Transcriber, file: &Path, opts: &TranscribeOptions) -> Result<Transcript> {
    let samples = mlxcel_audio::load_audio(file)?;
    let audio_seconds = samples.len() as f32 / mlxcel_audio::SAMPLE_RATE as f32;
    let bar = progress_bar(audio_seconds, file);
    let start = std::time::Instant::now();
    let t = transcriber.transcribe(
        &samples,
        opts,
        &mut |done, _| {
            if let Some(b) = &bar {
                b.set_position((done * 10.0) as u64);
            }
        },
        &|| false,
    );
    if let Some(b) = bar {
        b.finish_and_clear();
    }
    let t = t.with_context(|| format!("transcribing {}", file.display()))?;
    let seconds = start.elapsed().as_secs_f32();
    // `cargo xtask bench --speech` reads this line (-v) for the real-time factor.
    tracing::info!(audio_seconds, seconds, real_time_factor = audio_seconds / seconds.max(1e-9), "transcribed");
    Ok(t)
}

/// A bar over the audio's seconds on stderr, for recordings longer than one 30 s window.
fn progress_bar(seconds: f32, file: &Path) -> Option<indicatif::ProgressBar> {
    if seconds <= 30.0 || !std::io::stderr().is_terminal() {
        return None;
    }
    let bar = indicatif::ProgressBar::new((seconds * 10.0) as u64);
    bar.set_style(
        indicatif::ProgressStyle::with_template("{msg} [{bar:30}] {percent}% eta {eta}")
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    bar.set_message(file.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default());
    Some(bar)
}
