//! Loading the served model from the server's flags: resolve MODEL (folder, HF cache, store or hub),
//! load the runner sized for `--ctx-size` × `parallel`, check the memory estimate, load the tokenizer
//! with the `--chat-template(-file)` override, and gather the [`ModelFacts`] the routes report.
//! Whatever engine runs the model calls this on the thread that will own the runner.

use anyhow::{bail, Result};
use mlxcel_plugin_api::Task;
use mlxcel_plugins::{Catalog, PluginSearch};

use super::args::ServerConfig;
use super::generator::ModelFacts;
use crate::engine::memory::MemoryEstimate;
use crate::engine::{ModelRunner, RunnerOptions};
use crate::text::{ChatTemplate, TextTokenizer};

/// Loads the model with KV room for `parallel` sequences of the context size.
pub fn load(config: &ServerConfig, parallel: usize) -> Result<(ModelRunner, TextTokenizer, ModelFacts)> {
    let dir = crate::cli::run::resolve_model(&config.model, config.revision.as_deref())?;
    let catalog = Catalog::load(&PluginSearch::from_env(&config.plugin_dirs));
    let opts = RunnerOptions {
        backend: config.backend.clone(),
        threads: config.threads,
        ctx_size: config.ctx_size.unwrap_or(4096),
        parallel: parallel.max(1),
        embedding: config.embedding,
        ..Default::default()
    };
    // Text generation, or an encoder (embeddings, reranking) that `embeddings::start_model` runs.
    let runner = ModelRunner::load_for(&catalog, &dir, &opts, &[Task::Text, Task::Embed, Task::Rerank])?;
    let est = MemoryEstimate::new(
        &runner.info,
        runner.checkpoint.weight_bytes(),
        runner.ctx_size as u64,
        parallel.max(1) as u64,
        runner.device_free_memory,
    );
    if !est.fits && !config.force {
        bail!("{} does not fit in memory: {}; lower --ctx-size or pass --force", dir.display(), est.summary());
    }
    let mut tokenizer =
        TextTokenizer::load(&dir, &runner.checkpoint.config, runner.checkpoint.generation_config.as_ref())?;
    let mut template_source = ChatTemplate::source_in(&dir, tokenizer_config(&dir).as_ref());
    if let Some(src) = &config.chat_template {
        let t = ChatTemplate::new(
            src,
            tokenizer.bos_token.as_deref().unwrap_or(""),
            tokenizer.eos_token.as_deref().unwrap_or(""),
        )
        .map_err(|e| anyhow::anyhow!("--chat-template: {e}"))?;
        tokenizer.chat_template = Some(t);
        template_source = Some(src.clone());
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
    tracing::info!(
        "loaded {} ({} via family `{}`) on backend `{}` [{}], context {}",
        dir.display(),
        runner.info.architecture,
        runner.family_name,
        runner.backend_name,
        runner.backend_features,
        runner.ctx_size
    );
    Ok((runner, tokenizer, facts))
}

fn tokenizer_config(dir: &std::path::Path) -> Option<serde_json::Value> {
    let text = std::fs::read_to_string(dir.join("tokenizer_config.json")).ok()?;
    serde_json::from_str(&text).ok()
}
