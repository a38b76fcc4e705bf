//! Speech to text: Whisper models loaded as an encoder-decoder runner, decoded into transcripts
//! ([`transcribe`]), rendered as text / JSON / SRT / WebVTT ([`format`]). The CLI's `transcribe` and
//! the server's `/v1/audio/*` routes both go through [`load_transcriber`] and [`Transcriber`].

pub mod format;
pub mod transcribe;
pub mod vocab;

use anyhow::Result;
use mlxcel_plugin_api::Task;
use mlxcel_plugins::Catalog;

pub use format::{render, render_json, timed_lines, ResponseFormat};
pub use transcribe::{Segment, SpeechTask, TranscribeOptions, Transcriber, Transcript};

use crate::checkpoint::Checkpoint;
use crate::engine::{ModelRunner, RunnerOptions};

/// Loads a Whisper model folder for transcription: the full text context, and `candidates` sequence
/// rows (at least one) for the `best_of` candidates of a window to decode together (each row holds
/// its own copy of the window's cross-attention keys and values; more candidates decode in groups).
pub fn load_transcriber(
    catalog: &Catalog,
    checkpoint: Checkpoint,
    backend: Option<String>,
    threads: u32,
    candidates: usize,
) -> Result<Transcriber> {
    let dir = checkpoint.dir.clone();
    let opts = RunnerOptions { backend, threads, ctx_size: 0, parallel: candidates.max(1), ..Default::default() };
    let runner = ModelRunner::from_checkpoint_for(catalog, checkpoint, &opts, &[Task::Asr])?;
    let tokenizer = vocab::load_tokenizer(&dir)?;
    Transcriber::new(runner, tokenizer)
}
