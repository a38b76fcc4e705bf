//! Loading the served model from the server's flags and starting what serves its task. [`start`] is
//! the one place that dispatches on the task: resolve MODEL (folder, HF cache, store or hub), ask the
//! family that claims it for its task, then a speech-recognition model goes to the transcription thread, a text model to the batching engine and
//! an embedding or reranking model to an encoder. [`load`] loads the runner sized for `--ctx-size` ×
//! `parallel`, checks the memory estimate, loads the tokenizer with the `--chat-template(-file)`
//! override and gathers the [`ModelFacts`] the routes report. It runs on the thread that will own the
//! runner.

use std::path::Path;

use anyhow::{bail, Context, Result};
use mlxcel_plugin_api::Task;
use mlxcel_plugins::{Catalog, PluginSearch};

use super::args::ServerConfig;
use super::generator::ModelFacts;
use super::state::AppState;
use super::{audio, batch_engine, embeddings};
use crate::checkpoint::Checkpoint;
use crate::engine::memory::MemoryEstimate;
use crate::engine::runner::warn_if_context_cut;
use crate::engine::{ModelRunner, RunnerOptions};
use crate::text::{ChatTemplate, TextTokenizer};

/// Loads MODEL, starts what serves its task and hands it to the routes (`state.speech` for a speech
/// model, `state.model` for the others); returns the line saying it is ready. A new task is one more
/// arm here.
pub fn start(state: &AppState) -> Result<String> {
    let config = &state.config;
    let dir = crate::cli::run::resolve_model(&config.model, config.revision.as_deref())?;
    let catalog = Catalog::load(&PluginSearch::from_env(&config.plugin_dirs));
    let checkpoint = Checkpoint::open(&dir)?;
    // The family that claims the model says what it is for, before its weights are bound.
    let task = ModelRunner::task_of(&catalog, &checkpoint)?;
    if task == Task::Asr {
        if config.embedding.is_some() {
            bail!(
                "{}: --embedding / --pooling: this is a speech-recognition (Whisper) model, served on \
                 /v1/audio/transcriptions without them",
                dir.display()
            );
        }
        if let Some(c) = config.ctx_size {
            bail!(
                "{}: -c/--ctx-size {c}: this is a speech-recognition (Whisper) model, whose context is its \
                 own (a 30 s window and the decoder's positions); start it without -c",
                dir.display()
            );
        }
        refuse_unused_flags(config, Task::Asr, &dir, "a speech-recognition (Whisper) model")?;
        let speech = audio::start(config, &catalog, checkpoint)?;
        let ready = format!("speech model {} ready (/v1/audio/transcriptions)", speech.id);
        let _ = state.speech.set(speech);
        return Ok(ready);
    }
    // A text model with --embedding / --pooling is served as an embedding model.
    match if config.embedding.is_some() { Task::Embed } else { task } {
        Task::Embed => refuse_unused_flags(config, Task::Embed, &dir, "an embedding model")?,
        Task::Rerank => refuse_unused_flags(config, Task::Rerank, &dir, "a reranking model")?,
        _ => refuse_unused_flags(config, Task::Text, &dir, "a text-generation model (served without --embedding)")?,
    }
    let parallel = config.parallel.max(1);
    let (mut runner, text, facts) = load(config, &catalog, checkpoint, parallel)?;
    let (model, ready) = match runner.info.task {
        Task::Text => {
            if config.warmup {
                let started = std::time::Instant::now();
                runner.warm_up().context("the warm-up step failed (--no-warmup skips it)")?;
                tracing::info!("warm-up step in {:.0} ms", started.elapsed().as_secs_f64() * 1e3);
            }
            let ready = format!("model {} ready (context {}, {} slot(s))", facts.id, facts.ctx_size, config.parallel);
            (batch_engine::start(config, runner, text, facts)?, ready)
        }
        Task::Embed | Task::Rerank => {
            let model = embeddings::start_encoder(config, runner, text, facts)?;
            let e = model.encoder.as_ref().expect("an encoder model has its encoder").info();
            let ready = format!(
                "{} model {} ready ({} tokens per input, {} outputs per input)",
                e.task.name(),
                model.facts.id,
                e.max_tokens,
                e.output_dim
            );
            (model, ready)
        }
        task => bail!("the server cannot serve a {} model", task.name()),
    };
    let _ = state.model.set(model);
    Ok(ready)
}

/// Refuses the flags given that a model of `task` (described as `what`) would not act on, by name.
fn refuse_unused_flags(config: &ServerConfig, task: Task, dir: &Path, what: &str) -> Result<()> {
    let unused = config.flags_unused_by(task);
    if !unused.is_empty() {
        bail!(
            "{}: {}: {what} does not use {}; start it without {}",
            dir.display(),
            unused.join(", "),
            if unused.len() == 1 { "this flag" } else { "these flags" },
            if unused.len() == 1 { "it" } else { "them" }
        );
    }
    Ok(())
}

/// Loads the model of `checkpoint` with KV room for `parallel` sequences of the context size.
pub fn load(
    config: &ServerConfig,
    catalog: &Catalog,
    checkpoint: Checkpoint,
    parallel: usize,
) -> Result<(ModelRunner, TextTokenizer, ModelFacts)> {
    let dir_buf = checkpoint.dir.clone();
    let dir = dir_buf.as_path();
    let opts = RunnerOptions {
        backend: config.backend.clone(),
        threads: config.threads,
        ctx_size: config.ctx_size.unwrap_or(4096),
        parallel: parallel.max(1),
        kv_pool_seqs: config.kv_pool_seqs,
        embedding: config.embedding,
        cache_types: config.cache_types,
        swa_full: config.swa_full,
        ..Default::default()
    };
    let runner =
        ModelRunner::from_checkpoint_for(catalog, checkpoint, &opts, &[Task::Text, Task::Embed, Task::Rerank])?;
    warn_if_context_cut(config.ctx_size, runner.info.max_positions);
    let est = MemoryEstimate::new(
        &runner.info,
        runner.checkpoint.weight_bytes(),
        runner.ctx_size as u64,
        parallel.max(1) as u64,
        config.kv_pool_seqs.unwrap_or(parallel).max(1) as u64,
        runner.device_free_memory,
        runner.cache_types(),
    )
    .with_tokenizer(&runner.checkpoint.dir);
    if !est.fits && !config.force {
        bail!(
            "{} does not fit in memory: {}; lower --ctx-size{}, or pass --force",
            dir.display(),
            est.summary(),
            if config.kv_pool_seqs.is_some() { "" } else { " or --parallel" }
        );
    }
    let mut tokenizer =
        TextTokenizer::load(dir, &runner.checkpoint.config, runner.checkpoint.generation_config.as_ref())?;
    let tokenizer_config = crate::text::tokenizer_config(dir);
    let mut template_source = ChatTemplate::source_in(dir, tokenizer_config.as_ref());
    if let Some(src) = &config.chat_template {
        tokenizer.replace_template(src, "--chat-template")?;
        template_source = Some(src.clone());
    }
    if let Some(e) = &tokenizer.chat_template_error {
        // Every chat route would fail on it: said at start (a replacement template is the way out).
        bail!("{e}; pass another with --chat-template-file");
    }
    let facts = ModelFacts {
        id: config.alias.clone().unwrap_or_else(|| config.model.clone()),
        path: dir.display().to_string(),
        architecture: runner.info.architecture.clone(),
        family: runner.family_name.clone(),
        backend: runner.backend_name.clone(),
        ctx_size: runner.ctx_size,
        ctx_train: runner.info.max_positions,
        vocab_size: runner.info.vocab_size,
        weight_bytes: runner.checkpoint.weight_bytes(),
        kv_bytes_per_token: runner.kv_bytes_per_token(),
        chat_template: template_source,
        default_sampling: config.sampling.resolve(runner.checkpoint.generation_config.as_ref()),
    };
    // An encoder's input limit is its tokenizer's (the ready line says it), not these positions.
    let room = match runner.info.task {
        Task::Text => format!("context {}", runner.ctx_size),
        _ => format!("{} positions", runner.ctx_size),
    };
    tracing::info!(
        "loaded {} ({} via family `{}`) on backend `{}` [{}], {room}",
        dir.display(),
        runner.info.architecture,
        runner.family_name,
        runner.backend_name,
        runner.backend_features,
    );
    Ok((runner, tokenizer, facts))
}
