//! `mlxcel embed` (sentence embeddings of texts, as JSON) and `mlxcel rerank` (documents ordered by a
//! cross-encoder's relevance to a query, as JSON).

use anyhow::{Context, Result};
use clap::Args;
use mlxcel_plugin_api::Task;
use serde_json::json;

use super::GlobalArgs;
use crate::checkpoint::sentence_transformers::PoolingFlag;
use crate::engine::embed::{check_dimensions, encode_all, relevance_score, shorten, EncoderOptions};
use crate::engine::{EmbeddingFlags, EncodedInput, EncoderTokenizer, ModelRunner, RunnerOptions};

/// Where the encoder model comes from and what runs it.
#[derive(Args, Debug, Clone)]
pub struct EncoderModelArgs {
    /// Model: a folder, a Hugging Face cache or mlxcel store name, or a hub name (owner/name).
    #[arg(short = 'm', long = "model")]
    pub model: String,
    /// Worker threads (default: all cores).
    #[arg(short = 't', long, value_parser = crate::cli::thread_count)]
    pub threads: Option<u32>,
    /// Backend plugin to use (default: the best-scoring one on this machine).
    #[arg(long)]
    pub backend: Option<String>,
    /// Hub revision (branch, tag or commit) when MODEL is a hub name.
    #[arg(long)]
    pub revision: Option<String>,
}

#[derive(Args, Debug, Clone)]
pub struct EmbedArgs {
    #[command(flatten)]
    pub model: EncoderModelArgs,
    /// Texts to embed (`-p A B` or `-p A -p B`).
    #[arg(short = 'p', long = "prompt", num_args = 1.., required = true)]
    pub prompts: Vec<String>,
    /// Keep the first N dimensions of each vector (Matryoshka), normalised again when the model
    /// normalises (OpenAI's `dimensions`).
    #[arg(long)]
    pub dimensions: Option<u64>,
    /// Embed with any decoder checkpoint (e.g. a Qwen3 one) pooled this way: mean, cls or last, then
    /// L2-normalised (default: the model's sentence-transformers config).
    #[arg(long, value_parser = PoolingFlag::parse)]
    pub pooling: Option<PoolingFlag>,
}

#[derive(Args, Debug, Clone)]
pub struct RerankArgs {
    #[command(flatten)]
    pub model: EncoderModelArgs,
    /// The query documents are scored against.
    #[arg(short = 'q', long = "query")]
    pub query: String,
    /// Documents to order (`-d A B` or `-d A -d B`).
    #[arg(short = 'd', long = "document", num_args = 1.., required = true)]
    pub documents: Vec<String>,
    /// Print only the N best.
    #[arg(long)]
    pub top_n: Option<usize>,
}

fn load(
    global: &GlobalArgs,
    a: &EncoderModelArgs,
    task: Task,
    pooling: Option<PoolingFlag>,
) -> Result<(ModelRunner, EncoderTokenizer)> {
    let dir = super::run::resolve_model(&a.model, a.revision.as_deref())?;
    let opts = RunnerOptions {
        backend: a.backend.clone(),
        threads: a.threads.unwrap_or(0),
        embedding: pooling.map(|p| EmbeddingFlags { pooling: Some(p) }),
        ..Default::default()
    };
    let runner = ModelRunner::load_for(&global.catalog(), &dir, &opts, &[task])?;
    let tok = EncoderTokenizer::load(
        &dir,
        &runner.checkpoint.config,
        runner.info.max_positions.min(runner.ctx_size),
        runner.info.vocab_size,
    )?;
    Ok((runner, tok))
}

fn run_inputs(runner: &mut ModelRunner, tok: &EncoderTokenizer, inputs: &[EncodedInput]) -> Result<Vec<Vec<f32>>> {
    let budget = EncoderOptions::default().max_batch_tokens.max(tok.max_tokens);
    encode_all(runner, inputs, budget)
}

pub fn embed(global: &GlobalArgs, a: &EmbedArgs) -> Result<()> {
    let (mut runner, tok) = load(global, &a.model, Task::Embed, a.pooling)?;
    let width = runner.info.output_dim;
    let dims = a
        .dimensions
        .map(|d| check_dimensions(d, width))
        .transpose()
        .map_err(|m| anyhow::anyhow!("--dimensions {m}"))?;
    let inputs: Vec<EncodedInput> = a
        .prompts
        .iter()
        .enumerate()
        .map(|(i, p)| tok.encode(p).with_context(|| format!("prompt {}", i + 1)))
        .collect::<Result<_>>()?;
    let mut vectors = run_inputs(&mut runner, &tok, &inputs)?;
    if let Some(dims) = dims {
        let normalized = crate::checkpoint::sentence_transformers::normalizes(&runner.checkpoint.config);
        vectors.iter_mut().for_each(|v| shorten(v, dims, normalized));
    }
    let data: Vec<_> = a
        .prompts
        .iter()
        .zip(&vectors)
        .enumerate()
        .map(|(i, (text, v))| json!({"index": i, "text": text, "embedding": v}))
        .collect();
    let tokens: usize = inputs.iter().map(|i| i.ids.len()).sum();
    let out = json!({"model": a.model.model, "dimensions": dims.unwrap_or(width), "data": data,
                     "usage": {"prompt_tokens": tokens}});
    print_json(&out)
}

pub fn rerank(global: &GlobalArgs, a: &RerankArgs) -> Result<()> {
    if a.top_n == Some(0) {
        anyhow::bail!("--top-n must be at least 1");
    }
    if a.query.is_empty() {
        anyhow::bail!("the query (-q) is an empty string");
    }
    let (mut runner, tok) = load(global, &a.model, Task::Rerank, None)?;
    let inputs: Vec<EncodedInput> = a
        .documents
        .iter()
        .enumerate()
        .map(|(i, d)| tok.encode_pair(&a.query, d).with_context(|| format!("document {}", i + 1)))
        .collect::<Result<_>>()?;
    let logits = run_inputs(&mut runner, &tok, &inputs)?;
    let mut order: Vec<(usize, f32)> = logits.iter().map(|r| relevance_score(r[0])).enumerate().collect();
    order.sort_by(|x, y| y.1.total_cmp(&x.1).then(x.0.cmp(&y.0)));
    order.truncate(a.top_n.unwrap_or(order.len()));
    let results: Vec<_> =
        order.iter().map(|&(i, s)| json!({"index": i, "relevance_score": s, "document": a.documents[i]})).collect();
    let out = json!({"model": a.model.model, "query": a.query, "results": results});
    print_json(&out)
}

/// One line of JSON on stdout; a reader that went away (`| head`) is not an error (on Unix SIGPIPE
/// ends the command before this sees it).
fn print_json(v: &serde_json::Value) -> Result<()> {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    match writeln!(out, "{v}") {
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => Ok(()),
        r => Ok(r?),
    }
}

#[derive(Args, Debug, Clone)]
pub struct BenchEmbedArgs {
    #[command(flatten)]
    pub model: EncoderModelArgs,
    /// A JSON file holding an object of named text sets, `{"short": ["…", …], "passages": ["…", …]}`:
    /// each set is embedded as one request (truncated as the model says), `--repetitions` times.
    #[arg(long, value_name = "FILE")]
    pub texts: std::path::PathBuf,
    /// Repetitions per set; the median is reported.
    #[arg(short = 'r', long, default_value_t = 3, value_parser = super::bench::repetitions)]
    pub repetitions: usize,
    /// One JSON object on stdout.
    #[arg(long)]
    pub json: bool,
}

/// `mlxcel bench-embed`: embeddings per second of an embedding model on given sets of texts (the first
/// run of each set is a warm-up and not counted).
pub fn bench(global: &GlobalArgs, a: &BenchEmbedArgs) -> Result<()> {
    let text = std::fs::read_to_string(&a.texts).with_context(|| format!("reading {}", a.texts.display()))?;
    let sets: serde_json::Map<String, serde_json::Value> = serde_json::from_str(&text)
        .with_context(|| format!("{}: expected an object of text lists", a.texts.display()))?;
    let (mut runner, tok) = load(global, &a.model, Task::Embed, None)?;
    let mut out = serde_json::Map::new();
    for (name, texts) in &sets {
        let texts: Vec<&str> = texts
            .as_array()
            .with_context(|| format!("{}: `{name}` is not a list", a.texts.display()))?
            .iter()
            .map(|t| t.as_str().with_context(|| format!("`{name}` holds a non-string")))
            .collect::<Result<_>>()?;
        let mut seconds = Vec::new();
        let mut tokens = 0;
        for rep in 0..=a.repetitions {
            let t0 = std::time::Instant::now();
            // Tokenizing is part of the work, as it is for a peer given the same texts.
            let inputs: Vec<EncodedInput> = texts.iter().map(|t| tok.encode(t)).collect::<Result<_, _>>()?;
            let rows = run_inputs(&mut runner, &tok, &inputs)?;
            std::hint::black_box(rows);
            if rep > 0 {
                seconds.push(t0.elapsed().as_secs_f64());
            }
            tokens = inputs.iter().map(|i| i.ids.len()).sum::<usize>();
        }
        seconds.sort_by(f64::total_cmp);
        let s = seconds[seconds.len() / 2];
        out.insert(
            name.clone(),
            json!({"texts": texts.len(), "tokens": tokens, "seconds": s, "embeddings_per_s": texts.len() as f64 / s}),
        );
        if !a.json {
            eprintln!("{name}: {} texts, {tokens} tokens: {:.1} embeddings/s", texts.len(), texts.len() as f64 / s);
        }
    }
    let v = json!({"sets": out, "peak_rss_bytes": super::bench::peak_rss(), "backend": runner.backend_name,
                   "features": runner.backend_features});
    if a.json {
        print_json(&v)?;
    }
    Ok(())
}
