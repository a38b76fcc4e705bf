//! `mlxcel run` (chat REPL, or one answer with -p) and `mlxcel generate` (one answer).

use std::io::Write;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use anyhow::{bail, Context, Result};
use clap::Args;
use serde_json::Value;

use super::GlobalArgs;
use crate::engine::memory::MemoryEstimate;
use crate::engine::{FinishReason, GenerateOptions, Generation, ModelRunner, RunnerOptions, SamplingParams, Session};
use crate::text::{ChatMessage, TextTokenizer};

#[derive(Args, Debug, Clone)]
pub struct RunArgs {
    /// Model folder (config.json + *.safetensors + tokenizer.json).
    #[arg(value_name = "MODEL")]
    pub model: String,
    /// Answer this prompt and exit (without it, `run` opens a chat).
    #[arg(short = 'p', long = "prompt")]
    pub prompt: Option<String>,
    /// System prompt for the chat template.
    #[arg(long)]
    pub system: Option<String>,
    /// Send the prompt as raw text, not through the chat template.
    #[arg(long)]
    pub no_chat_template: bool,
    /// Most tokens to generate (default: until EOS or the context is full).
    #[arg(short = 'n', long = "max-tokens", visible_alias = "n-predict")]
    pub max_tokens: Option<usize>,
    /// Temperature; 0 = greedy.
    #[arg(long = "temp", visible_alias = "temperature")]
    pub temp: Option<f32>,
    /// Keep the K most likely tokens (0 = off).
    #[arg(long)]
    pub top_k: Option<usize>,
    /// Nucleus sampling threshold (1.0 = off).
    #[arg(long)]
    pub top_p: Option<f32>,
    /// Drop tokens less likely than min-p × the most likely (0 = off).
    #[arg(long)]
    pub min_p: Option<f32>,
    /// Penalise repeats of the last --repeat-last-n tokens (1.0 = off).
    #[arg(long)]
    pub repeat_penalty: Option<f32>,
    /// How many recent tokens the penalties consider.
    #[arg(long)]
    pub repeat_last_n: Option<usize>,
    #[arg(long)]
    pub presence_penalty: Option<f32>,
    #[arg(long)]
    pub frequency_penalty: Option<f32>,
    /// Random seed (same seed, same output).
    #[arg(short = 's', long)]
    pub seed: Option<u64>,
    /// Keep going past end-of-sequence tokens.
    #[arg(long)]
    pub ignore_eos: bool,
    /// Stop when this text appears (repeatable).
    #[arg(long = "stop")]
    pub stop: Vec<String>,
    /// Worker threads (default: all cores).
    #[arg(short = 't', long)]
    pub threads: Option<u32>,
    /// Context size in tokens (default: min(model maximum, 4096)).
    #[arg(short = 'c', long = "ctx-size")]
    pub ctx_size: Option<usize>,
    /// Backend plugin to use (default: the best-scoring one on this machine).
    #[arg(long)]
    pub backend: Option<String>,
    /// Hub revision (branch, tag or commit) when MODEL is a hub name.
    #[arg(long)]
    pub revision: Option<String>,
    /// Run even when the memory estimate says the model does not fit.
    #[arg(long)]
    pub force: bool,
}

/// A MODEL argument as a folder: local, Hugging Face cache, mlxcel store, or downloaded.
pub fn resolve_model(model: &str, revision: Option<&str>) -> Result<PathBuf> {
    let r = crate::store::resolve_model(
        model,
        &crate::store::ResolveOptions { revision: revision.map(str::to_string), offline: false },
    )?;
    Ok(r.path().to_path_buf())
}

/// Defaults from `generation_config.json`, then the command-line flags on top.
fn sampling_params(args: &RunArgs, generation_config: Option<&Value>) -> SamplingParams {
    let mut p = SamplingParams::default();
    if let Some(g) = generation_config {
        let f = |k: &str| g.get(k).and_then(Value::as_f64).map(|v| v as f32);
        if let Some(t) = f("temperature") {
            p.temperature = t;
        }
        if let Some(k) = g.get("top_k").and_then(Value::as_u64) {
            p.top_k = k as usize;
        }
        if let Some(v) = f("top_p") {
            p.top_p = v;
        }
        if let Some(v) = f("min_p") {
            p.min_p = v;
        }
        if let Some(v) = f("repetition_penalty") {
            p.repeat_penalty = v;
        }
        if g.get("do_sample") == Some(&Value::Bool(false)) {
            p.temperature = 0.0;
        }
    }
    if let Some(v) = args.temp {
        p.temperature = v;
    }
    if let Some(v) = args.top_k {
        p.top_k = v;
    }
    if let Some(v) = args.top_p {
        p.top_p = v;
    }
    if let Some(v) = args.min_p {
        p.min_p = v;
    }
    if let Some(v) = args.repeat_penalty {
        p.repeat_penalty = v;
    }
    if let Some(v) = args.repeat_last_n {
        p.penalty_last_n = v;
    }
    if let Some(v) = args.presence_penalty {
        p.presence_penalty = v;
    }
    if let Some(v) = args.frequency_penalty {
        p.frequency_penalty = v;
    }
    p.seed = args.seed;
    p
}

struct Loaded {
    runner: ModelRunner,
    tokenizer: TextTokenizer,
    options: GenerateOptions,
}

fn load(global: &GlobalArgs, args: &RunArgs) -> Result<Loaded> {
    let dir = resolve_model(&args.model, args.revision.as_deref())?;
    let catalog = global.catalog();
    let opts = RunnerOptions {
        backend: args.backend.clone(),
        threads: args.threads.unwrap_or(0),
        ctx_size: args.ctx_size.unwrap_or(4096),
        ..Default::default()
    };
    let runner = ModelRunner::load(&catalog, &dir, &opts)?;
    let est = MemoryEstimate::new(
        &runner.info,
        runner.checkpoint.weight_bytes(),
        runner.ctx_size as u64,
        1,
        runner.device_free_memory,
    );
    if !est.fits && !args.force {
        bail!("{} does not fit in memory: {}; lower --ctx-size or pass --force", dir.display(), est.summary());
    }
    let tokenizer = TextTokenizer::load(&dir, &runner.checkpoint.config, runner.checkpoint.generation_config.as_ref())?;
    let sampling = sampling_params(args, runner.checkpoint.generation_config.as_ref());
    sampling.validate().map_err(|e| anyhow::anyhow!("invalid sampling option: {e}"))?;
    tracing::info!(
        "loaded {} ({} via family `{}`) on backend `{}` [{}], context {}",
        dir.display(),
        runner.info.architecture,
        runner.family_name,
        runner.backend_name,
        runner.backend_features,
        runner.ctx_size
    );
    let options = GenerateOptions {
        sampling,
        max_tokens: args.max_tokens.unwrap_or(usize::MAX),
        stop: args.stop.clone(),
        ignore_eos: args.ignore_eos,
        ..Default::default()
    };
    Ok(Loaded { runner, tokenizer, options })
}

fn report(g: &Generation) {
    let s = &g.stats;
    let reused = if s.prompt_reused > 0 { format!(" (+{} cached)", s.prompt_reused) } else { String::new() };
    eprintln!(
        "[prompt: {} tokens{reused}, {:.1} tok/s | generation: {} tokens, {:.1} tok/s{}]",
        s.prompt_tokens,
        s.prompt_tps(),
        s.generated_tokens,
        s.generation_tps(),
        if g.finish == FinishReason::Cancelled { " | interrupted" } else { "" }
    );
}

fn messages_for(args: &RunArgs, history: &[ChatMessage], user: &str) -> Vec<ChatMessage> {
    let mut m = Vec::new();
    if let Some(s) = &args.system {
        m.push(ChatMessage::new("system", s));
    }
    m.extend_from_slice(history);
    m.push(ChatMessage::new("user", user));
    m
}

/// One prompt, streamed to stdout.
pub fn run_once(global: &GlobalArgs, args: &RunArgs, prompt: &str) -> Result<()> {
    let mut l = load(global, args)?;
    let ids = if args.no_chat_template {
        l.tokenizer.encode(prompt, true)?
    } else {
        l.tokenizer.chat_prompt(&messages_for(args, &[], prompt))?
    };
    let never = AtomicBool::new(false);
    let mut out = std::io::stdout().lock();
    let g = Session::new().generate(&mut l.runner, &l.tokenizer, &ids, &l.options, &never, &mut |s| {
        let _ = out.write_all(s.as_bytes());
        let _ = out.flush();
    })?;
    drop(out);
    println!();
    report(&g);
    Ok(())
}

/// The chat REPL: multi-turn through the template, `/clear`, `/exit`, Ctrl-C stops the answer.
pub fn repl(global: &GlobalArgs, args: &RunArgs) -> Result<()> {
    let mut l = load(global, args)?;
    if l.tokenizer.chat_template.is_none() && !args.no_chat_template {
        bail!("this model has no chat template; use -p with --no-chat-template for raw completion");
    }
    let cancel = Arc::new(AtomicBool::new(false));
    {
        let c = cancel.clone();
        ctrlc::set_handler(move || c.store(true, Ordering::SeqCst)).context("cannot install the Ctrl-C handler")?;
    }
    let mut editor = rustyline::DefaultEditor::new().context("cannot open the line editor")?;
    let mut history: Vec<ChatMessage> = Vec::new();
    let mut session = Session::new();
    eprintln!(
        "mlxcel chat with {} — /clear forgets the conversation, /exit quits, Ctrl-C stops an answer.",
        args.model
    );
    loop {
        let line = match editor.readline(">>> ") {
            Ok(l) => l,
            Err(rustyline::error::ReadlineError::Interrupted) => continue,
            Err(rustyline::error::ReadlineError::Eof) => break,
            Err(e) => bail!("reading input failed: {e}"),
        };
        let input = line.trim();
        if input.is_empty() {
            continue;
        }
        let _ = editor.add_history_entry(input);
        match input {
            "/exit" | "/quit" | "/bye" => break,
            "/clear" => {
                history.clear();
                session.clear(&mut l.runner);
                eprintln!("(conversation cleared)");
                continue;
            }
            "/help" | "/?" => {
                eprintln!("/clear  forget the conversation\n/exit   quit\nCtrl-C  stop the current answer");
                continue;
            }
            s if s.starts_with('/') => {
                eprintln!("unknown command {s}; /help lists them");
                continue;
            }
            _ => {}
        }
        let messages = messages_for(args, &history, input);
        let ids = l.tokenizer.chat_prompt(&messages)?;
        cancel.store(false, Ordering::SeqCst);
        let mut out = std::io::stdout().lock();
        let result = session.generate(&mut l.runner, &l.tokenizer, &ids, &l.options, &cancel, &mut |s| {
            let _ = out.write_all(s.as_bytes());
            let _ = out.flush();
        });
        drop(out);
        println!();
        match result {
            Ok(g) => {
                report(&g);
                history.push(ChatMessage::new("user", input));
                history.push(ChatMessage::new("assistant", g.text.trim()));
            }
            Err(e) => eprintln!("error: {e:#}"),
        }
    }
    Ok(())
}

pub fn run(global: &GlobalArgs, args: &RunArgs, one_shot: bool) -> Result<()> {
    match (&args.prompt, one_shot) {
        (Some(p), _) => run_once(global, args, p),
        (None, true) => bail!("`generate` needs a prompt: -p TEXT"),
        (None, false) => repl(global, args),
    }
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;
    use crate::cli::{Cli, Command};

    fn args(extra: &[&str]) -> RunArgs {
        let mut v = vec!["mlxcel", "run", "m"];
        v.extend_from_slice(extra);
        match Cli::parse_from(v).command {
            Command::Run(a) => a,
            _ => unreachable!(),
        }
    }

    #[test]
    fn generation_config_supplies_defaults_and_flags_override_them() {
        let g = serde_json::json!({"temperature": 0.6, "top_k": 20, "top_p": 0.9, "repetition_penalty": 1.1});
        let p = sampling_params(&args(&[]), Some(&g));
        assert_eq!((p.temperature, p.top_k, p.top_p, p.repeat_penalty), (0.6, 20, 0.9, 1.1));
        let p = sampling_params(&args(&["--temp", "0", "--top-k", "5"]), Some(&g));
        assert_eq!((p.temperature, p.top_k, p.top_p), (0.0, 5, 0.9));
    }

    #[test]
    fn do_sample_false_means_greedy_unless_a_temperature_is_given() {
        let g = serde_json::json!({"do_sample": false, "temperature": 0.7});
        assert_eq!(sampling_params(&args(&[]), Some(&g)).temperature, 0.0);
        assert_eq!(sampling_params(&args(&["--temp", "0.5"]), Some(&g)).temperature, 0.5);
    }
}
