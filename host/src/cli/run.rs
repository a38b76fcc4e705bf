//! `mlxcel run` (chat REPL, or one answer with -p) and `mlxcel generate` (one answer).

use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use anyhow::{bail, Context, Result};
use clap::Args;
use serde_json::Value;

use super::cache_type::CacheTypeArgs;
use super::sampling_args::SamplingArgs;
use super::GlobalArgs;
use crate::engine::memory::MemoryEstimate;
use crate::engine::runner::warn_if_context_cut;
use crate::engine::{
    Engine, EngineError, EngineHandle, EngineOptions, FinishReason, GenerationEvent, GenerationRequest, ModelRunner,
    RequestStream, RunnerOptions, SamplingParams, Usage,
};
use crate::text::{ChatMessage, TextTokenizer};

#[derive(Args, Debug, Clone)]
pub struct RunArgs {
    /// Model folder (config.json + *.safetensors + tokenizer.json).
    #[arg(value_name = "MODEL")]
    pub model: String,
    /// Answer this prompt and exit (`run` without it opens a chat; `generate` needs it). A prompt may
    /// start with `-`.
    #[arg(short = 'p', long = "prompt", allow_hyphen_values = true)]
    pub prompt: Option<String>,
    /// Read the -p prompt from this file (`-`: standard input), as llama.cpp's `-f`; one final line
    /// break is dropped.
    #[arg(short = 'f', long = "file", value_name = "FILE", conflicts_with = "prompt")]
    pub file: Option<PathBuf>,
    /// System prompt for the chat template.
    #[arg(long, allow_hyphen_values = true)]
    pub system: Option<String>,
    /// A Jinja chat template (file) to use instead of the model's, as llama.cpp's.
    #[arg(long = "chat-template-file", value_name = "FILE", conflicts_with = "no_chat_template")]
    pub chat_template_file: Option<PathBuf>,
    /// Send the -p prompt as raw text, not through the chat template (not for the chat, whose turns
    /// the template frames).
    #[arg(long)]
    pub no_chat_template: bool,
    /// Most tokens to generate (default, or -1: until EOS or the context is full).
    #[arg(short = 'n', long = "max-tokens", visible_alias = "n-predict", allow_negative_numbers = true,
          value_parser = token_limit)]
    pub max_tokens: Option<usize>,
    #[command(flatten)]
    pub sampling: SamplingArgs,
    /// Keep going past end-of-sequence: those tokens are never sampled (as llama.cpp's
    /// `--ignore-eos` bans them).
    #[arg(long)]
    pub ignore_eos: bool,
    /// Stop when this text appears (repeatable).
    #[arg(long = "stop", value_parser = non_empty_stop)]
    pub stop: Vec<String>,
    /// Worker threads (default: all cores).
    #[arg(short = 't', long, value_parser = crate::cli::thread_count)]
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
    #[command(flatten)]
    pub cache_types: CacheTypeArgs,
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
fn sampling_params(args: &RunArgs, generation_config: Option<&Value>) -> Result<SamplingParams> {
    let p = args.sampling.overrides()?.resolve(generation_config);
    p.validate().map_err(|e| anyhow::anyhow!("invalid sampling flag: {e}"))?;
    Ok(p)
}

/// The model behind one batching engine (one sequence at a time: the CLI is one person), and how to
/// turn a prompt into a request.
struct Loaded {
    engine: EngineHandle,
    tokenizer: Arc<TextTokenizer>,
    sampling: SamplingParams,
    /// The context in tokens (prompt and answer together).
    ctx_size: usize,
}

/// A token count, or llama.cpp's -1 for no limit.
fn token_limit(v: &str) -> Result<usize, String> {
    match v.trim() {
        "-1" => Ok(usize::MAX),
        n => n.parse().map_err(|_| format!("expected a number of tokens, or -1 for no limit; got {n}")),
    }
}

/// A `--stop` string (clap value parser): an empty one would match everywhere, or nowhere.
fn non_empty_stop(s: &str) -> Result<String, String> {
    match s.is_empty() {
        true => Err("a stop string cannot be empty".into()),
        false => Ok(s.to_string()),
    }
}

impl Loaded {
    fn request(&self, args: &RunArgs, prompt: Vec<u32>) -> GenerationRequest {
        let mut sampling = self.sampling.clone();
        if args.ignore_eos {
            sampling.logit_bias.extend(self.tokenizer.eos_ids.iter().map(|&id| (id, f32::NEG_INFINITY)));
        }
        let mut r = GenerationRequest::new(prompt, sampling, args.max_tokens.unwrap_or(usize::MAX));
        r.stop = args.stop.clone();
        r.ignore_eos = args.ignore_eos;
        r
    }
}

fn load(global: &GlobalArgs, args: &RunArgs) -> Result<Loaded> {
    let dir = resolve_model(&args.model, args.revision.as_deref())?;
    let catalog = global.catalog();
    let opts = RunnerOptions {
        backend: args.backend.clone(),
        threads: args.threads.unwrap_or(0),
        ctx_size: args.ctx_size.unwrap_or(4096),
        cache_types: args.cache_types.types(),
        ..Default::default()
    };
    let runner = ModelRunner::load(&catalog, &dir, &opts)?;
    warn_if_context_cut(args.ctx_size, runner.info.max_positions);
    let est = MemoryEstimate::new(
        &runner.info,
        runner.checkpoint.weight_bytes(),
        runner.ctx_size as u64,
        1,
        1,
        runner.device_free_memory,
        runner.cache_types(),
    )
    .with_tokenizer(&runner.checkpoint.dir);
    if !est.fits && !args.force {
        bail!("{} does not fit in memory: {}; lower --ctx-size or pass --force", dir.display(), est.summary());
    }
    let mut tokenizer =
        TextTokenizer::load(&dir, &runner.checkpoint.config, runner.checkpoint.generation_config.as_ref())?;
    if let Some(f) = &args.chat_template_file {
        let src =
            std::fs::read_to_string(f).with_context(|| format!("reading --chat-template-file {}", f.display()))?;
        tokenizer.replace_template(&src, &format!("--chat-template-file {}", f.display()))?;
    }
    let sampling = sampling_params(args, runner.checkpoint.generation_config.as_ref())?;
    sampling.validate().map_err(|e| anyhow::anyhow!("invalid sampling option: {e}"))?;
    tracing::info!(
        "loaded {} ({} via family `{}`) on backend `{}` [{}], context {}, KV cache {}",
        dir.display(),
        runner.info.architecture,
        runner.family_name,
        runner.backend_name,
        runner.backend_features,
        runner.ctx_size,
        runner.cache_types()
    );
    let tokenizer = Arc::new(tokenizer);
    let ctx_size = runner.ctx_size;
    let engine =
        Engine::start(runner, tokenizer.clone(), EngineOptions { parallel: 1, max_queue: 1, ..Default::default() })
            .context("cannot start the engine thread")?;
    Ok(Loaded { engine, tokenizer, sampling, ctx_size })
}

/// A refused request as one line a person can act on.
fn refused(e: EngineError) -> anyhow::Error {
    match e {
        EngineError::PromptTooLong { .. } => anyhow::anyhow!("{e}; shorten it or raise --ctx-size"),
        e => anyhow::anyhow!("{e}"),
    }
}

/// Streams one request's text to stdout; returns how it ended.
fn stream_answer(stream: &mut RequestStream) -> Result<(String, FinishReason, Usage)> {
    let mut out = std::io::stdout().lock();
    let mut text = String::new();
    while let Some(event) = stream.blocking_next() {
        match event {
            GenerationEvent::Text { text: piece, .. } => {
                // A failed write (a full disk; a closed pipe where SIGPIPE does not end the command
                // first, as it does on Unix) ends the answer: nothing would read the rest.
                if let Err(e) = out.write_all(piece.as_bytes()).and_then(|_| out.flush()) {
                    stream.cancel();
                    return Err(anyhow::Error::new(e).context("writing the answer to stdout"));
                }
                text.push_str(&piece);
            }
            GenerationEvent::Started { .. }
            | GenerationEvent::PromptProgress { .. }
            | GenerationEvent::PromptLogprobs(_)
            | GenerationEvent::EndToken(_) => {}
            GenerationEvent::Done { finish, usage } => return Ok((text, finish, usage)),
            GenerationEvent::Error(e) => bail!("{e}"),
        }
    }
    bail!("the engine stopped before the answer ended")
}

/// Ends the answer's line on stdout (an error where the write fails, where `println!` would panic).
fn end_line() -> Result<()> {
    writeln!(std::io::stdout()).context("writing the answer to stdout")
}

/// The timing line on stderr; an answer the context cut short says so (not only `-n` ends one).
fn report(finish: FinishReason, u: &Usage, ctx_size: usize) {
    let computed = u.prompt_tokens - u.cached_tokens;
    let reused = if u.cached_tokens > 0 { format!(" (+{} cached)", u.cached_tokens) } else { String::new() };
    let per_s = |n: usize, t: std::time::Duration| n as f64 / t.as_secs_f64().max(1e-9);
    eprintln!(
        "[prompt: {computed} tokens{reused}, {:.1} tok/s | generation: {} tokens, {:.1} tok/s{}]",
        per_s(computed, u.prompt_time),
        u.completion_tokens,
        // The first generated token comes from the prefill; the rest each cost a decode step.
        per_s(u.completion_tokens.saturating_sub(1), u.generation_time),
        match finish {
            FinishReason::Cancelled => " | interrupted".to_string(),
            FinishReason::Length if u.prompt_tokens + u.completion_tokens >= ctx_size => {
                format!(" | context of {ctx_size} tokens full (--ctx-size)")
            }
            _ => String::new(),
        }
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
    let l = load(global, args)?;
    let ids = if args.no_chat_template {
        l.tokenizer.encode(prompt, true)?
    } else {
        l.tokenizer.chat_prompt(&messages_for(args, &[], prompt))?
    };
    let mut stream = l.engine.submit(l.request(args, ids)).map_err(refused)?;
    let (_, finish, usage) = stream_answer(&mut stream)?;
    end_line()?;
    report(finish, &usage, l.ctx_size);
    l.engine.shutdown();
    Ok(())
}

/// The prompt for `input` after `history`, and how many of the oldest exchanges (user and assistant
/// message) it left out. A conversation whose prompt leaves less than a quarter of the context (or -n
/// tokens, if fewer) for the answer loses its oldest exchanges, as Ollama truncates a chat to its
/// context; the system prompt and `input` stay. It is cut to half the context where it can be, as
/// llama.cpp's context shift discards half, so that the next turns find their start in the prefix
/// cache instead of each recomputing almost the whole prompt; else to what leaves the answer its
/// room, else to what fits at all. Where not even that fits, nothing is left out: the engine refuses
/// the prompt and the conversation stays as it was.
fn fit_conversation(
    l: &Loaded,
    args: &RunArgs,
    history: &mut Vec<ChatMessage>,
    input: &str,
) -> Result<(Vec<u32>, usize)> {
    let prompt = |h: &[ChatMessage]| l.tokenizer.chat_prompt(&messages_for(args, h, input));
    let ids = prompt(history)?;
    let room = args.max_tokens.unwrap_or(usize::MAX).min(l.ctx_size / 4).max(1);
    if ids.len() + room <= l.ctx_size {
        return Ok((ids, 0));
    }
    let exchanges = history.len() / 2;
    for most in [l.ctx_size / 2, l.ctx_size - room, l.ctx_size - 1] {
        for dropped in 1..=exchanges {
            let ids = prompt(&history[2 * dropped..])?;
            if ids.len() <= most {
                history.drain(..2 * dropped);
                return Ok((ids, dropped));
            }
        }
    }
    Ok((ids, 0))
}

/// The chat REPL: multi-turn through the template, `/clear`, `/exit`, Ctrl-C stops the answer. Earlier
/// turns are not recomputed: their KV pages come back from the engine's prefix cache. A conversation
/// over the context leaves its oldest exchanges out ([`fit_conversation`]).
pub fn repl(global: &GlobalArgs, args: &RunArgs) -> Result<()> {
    let l = load(global, args)?;
    if !args.no_chat_template {
        l.tokenizer.template().context("the chat needs a template (raw completion: -p with --no-chat-template)")?;
    }
    // Ctrl-C cancels the answer being streamed, if any.
    let answering: Arc<Mutex<Option<Arc<AtomicBool>>>> = Arc::default();
    {
        let a = answering.clone();
        ctrlc::set_handler(move || {
            if let Some(cancel) = a.lock().unwrap_or_else(|e| e.into_inner()).as_ref() {
                cancel.store(true, Ordering::SeqCst);
            }
        })
        .context("cannot install the Ctrl-C handler")?;
    }
    let mut editor = rustyline::DefaultEditor::new().context("cannot open the line editor")?;
    let mut history: Vec<ChatMessage> = Vec::new();
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
                l.engine.clear_prefix_cache();
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
        let (ids, dropped) = fit_conversation(&l, args, &mut history, input)?;
        if dropped > 0 {
            eprintln!("(context of {} tokens full: the oldest {dropped} exchange(s) left out)", l.ctx_size);
        }
        let result = l.engine.submit(l.request(args, ids)).map_err(refused).and_then(|mut stream| {
            *answering.lock().unwrap_or_else(|e| e.into_inner()) = Some(stream.cancel_flag());
            let r = stream_answer(&mut stream);
            *answering.lock().unwrap_or_else(|e| e.into_inner()) = None;
            r
        });
        end_line()?;
        match result {
            Ok((text, finish, usage)) => {
                report(finish, &usage, l.ctx_size);
                history.push(ChatMessage::new("user", input));
                history.push(ChatMessage::new("assistant", text.trim()));
            }
            Err(e) => eprintln!("error: {e:#} (/clear forgets the conversation)"),
        }
    }
    l.engine.shutdown();
    Ok(())
}

pub fn run(global: &GlobalArgs, args: &RunArgs, one_shot: bool) -> Result<()> {
    if args.no_chat_template && args.system.is_some() {
        bail!("--system goes through the chat template, which --no-chat-template leaves out");
    }
    let from_file = args.file.as_deref().map(read_prompt_file).transpose()?;
    let prompt = args.prompt.as_deref().or(from_file.as_deref());
    if args.no_chat_template && prompt.is_none() && !one_shot {
        bail!("--no-chat-template needs -p (or -f): the chat frames its turns with the template");
    }
    match (prompt, one_shot) {
        (Some(p), _) => run_once(global, args, p),
        (None, true) => bail!("`generate` needs a prompt: -p TEXT or -f FILE"),
        (None, false) => repl(global, args),
    }
}

/// The prompt in `path` (`-`: standard input), less one final line break.
fn read_prompt_file(path: &Path) -> Result<String> {
    let mut text = String::new();
    if path == Path::new("-") {
        std::io::stdin().read_to_string(&mut text).context("reading the prompt from standard input")?;
    } else {
        text = std::fs::read_to_string(path).with_context(|| format!("reading the prompt from {}", path.display()))?;
    }
    let end = text.strip_suffix("\r\n").or_else(|| text.strip_suffix('\n')).map_or(text.len(), str::len);
    text.truncate(end);
    Ok(text)
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
        let p = sampling_params(&args(&[]), Some(&g)).unwrap();
        assert_eq!((p.temperature, p.top_k, p.top_p, p.repeat_penalty), (0.6, 20, 0.9, 1.1));
        let p = sampling_params(&args(&["--temp", "0", "--top-k", "5"]), Some(&g)).unwrap();
        assert_eq!((p.temperature, p.top_k, p.top_p), (0.0, 5, 0.9));
    }

    #[test]
    fn prompts_may_start_with_a_hyphen_and_raw_mode_refuses_what_it_would_ignore() {
        let a = args(&["-p", "-5 plus 3 equals?", "--system", "- be terse"]);
        assert_eq!((a.prompt.as_deref(), a.system.as_deref()), (Some("-5 plus 3 equals?"), Some("- be terse")));
        // Refused before the model (here a folder that does not exist) is read.
        let global = GlobalArgs { plugin_dirs: vec![], verbose: 0 };
        let e = run(&global, &args(&["--no-chat-template"]), false).unwrap_err().to_string();
        assert!(e.contains("--no-chat-template needs -p"), "{e}");
        let e = run(&global, &args(&["-p", "x", "--no-chat-template", "--system", "s"]), true).unwrap_err().to_string();
        assert!(e.contains("--system"), "{e}");
    }

    #[test]
    fn do_sample_false_means_greedy_unless_a_temperature_is_given() {
        let g = serde_json::json!({"do_sample": false, "temperature": 0.7});
        assert_eq!(sampling_params(&args(&[]), Some(&g)).unwrap().temperature, 0.0);
        assert_eq!(sampling_params(&args(&["--temp", "0.5"]), Some(&g)).unwrap().temperature, 0.5);
    }
}
