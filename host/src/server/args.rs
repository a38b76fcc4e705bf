//! The server's flags, named as llama-server names them (and read from the same `LLAMA_ARG_*`
//! environment variables), so an existing deployment's command line works unchanged. A llama-server
//! flag mlxcel does not implement is refused by name, never silently ignored, and so is a flag given
//! for a model whose task does not use it (a sampling flag for a Whisper model).

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use clap::parser::ValueSource;
use clap::{ArgMatches, Args};
use mlxcel_plugin_api::Task;

use super::reasoning::ReasoningFormat;
use crate::checkpoint::sentence_transformers::PoolingFlag;
use crate::cli::cache_type::CacheTypeArgs;
use crate::cli::sampling_args::SamplingArgs;
use crate::engine::{EmbeddingFlags, KvCacheTypes, SamplingOverrides};

#[derive(Args, Debug, Clone)]
pub struct ServerArgs {
    /// Model folder or hub name (owner/name), as for `mlxcel run`.
    #[arg(short = 'm', long = "model", env = "LLAMA_ARG_MODEL", value_name = "MODEL")]
    pub model: Option<String>,
    /// The model id clients see in /v1/models and answers (default: MODEL as given).
    #[arg(short = 'a', long = "alias", env = "LLAMA_ARG_ALIAS")]
    pub alias: Option<String>,
    /// Address to listen on: one, several comma-separated, or a Unix socket (a path ending `.sock`).
    #[arg(long, env = "LLAMA_ARG_HOST", default_value = "127.0.0.1")]
    pub host: String,
    /// Port to listen on (0: any free port; the log line says which).
    #[arg(long, env = "LLAMA_ARG_PORT", default_value_t = 8080)]
    pub port: u16,
    /// Context size per sequence in tokens (0: the model's maximum; default min(model maximum, 4096)).
    #[arg(short = 'c', long = "ctx-size", env = "LLAMA_ARG_CTX_SIZE")]
    pub ctx_size: Option<usize>,
    /// Sequences computed together, each with room for the full context (also `-np`; -1, the
    /// default: auto, 4 sharing one context's KV, as llama-server's default).
    #[arg(long = "parallel", env = "LLAMA_ARG_N_PARALLEL", default_value_t = -1, allow_negative_numbers = true)]
    pub parallel: i64,
    /// Worker threads (default: all cores).
    #[arg(short = 't', long = "threads", env = "LLAMA_ARG_THREADS", value_parser = crate::cli::thread_count)]
    pub threads: Option<u32>,
    /// Default most tokens to generate per request (-1: until EOS or the context is full).
    #[arg(
        short = 'n',
        long = "n-predict",
        visible_alias = "predict",
        env = "LLAMA_ARG_N_PREDICT",
        allow_negative_numbers = true
    )]
    pub n_predict: Option<i64>,
    /// Most prompt tokens computed in one step across sequences.
    #[arg(short = 'b', long = "batch-size", env = "LLAMA_ARG_BATCH", default_value_t = 2048)]
    pub batch_size: usize,
    /// Most prompt tokens of one sequence per prefill chunk (also `-ub`).
    #[arg(long = "ubatch-size", env = "LLAMA_ARG_UBATCH", default_value_t = 512)]
    pub ubatch_size: usize,
    /// Require this API key (repeatable, or comma-separated).
    #[arg(long = "api-key", env = "LLAMA_API_KEY", value_delimiter = ',')]
    pub api_key: Vec<String>,
    /// Read API keys from this file, one per line.
    #[arg(long = "api-key-file", env = "LLAMA_ARG_API_KEY_FILE", value_name = "FILE")]
    pub api_key_file: Option<PathBuf>,
    /// PEM private key for HTTPS (with --ssl-cert-file).
    #[arg(long = "ssl-key-file", env = "LLAMA_ARG_SSL_KEY_FILE", value_name = "FILE")]
    pub ssl_key_file: Option<PathBuf>,
    /// PEM certificate chain for HTTPS (with --ssl-key-file).
    #[arg(long = "ssl-cert-file", env = "LLAMA_ARG_SSL_CERT_FILE", value_name = "FILE")]
    pub ssl_cert_file: Option<PathBuf>,
    /// Seconds a request may run before it is cut short (also `-to`; 0: no limit), transcriptions
    /// included: raise it for long recordings on slow hardware.
    #[arg(long = "timeout", env = "LLAMA_ARG_TIMEOUT", default_value_t = 600)]
    pub timeout: u64,
    /// Origins browsers may call the server from: `*` (any), a comma-separated list, or `localhost`
    /// (an origin on this machine only).
    #[arg(long = "cors-origins", env = "LLAMA_ARG_CORS_ORIGINS", default_value = "*", value_name = "ORIGINS")]
    pub cors_origins: String,
    /// Methods allowed across origins (comma-separated, or `*`).
    #[arg(long = "cors-methods", env = "LLAMA_ARG_CORS_METHODS", default_value = super::cors::DEFAULT_METHODS,
          value_name = "METHODS")]
    pub cors_methods: String,
    /// Request headers allowed across origins (comma-separated, or `*`).
    #[arg(long = "cors-headers", env = "LLAMA_ARG_CORS_HEADERS", default_value = "*", value_name = "HEADERS")]
    pub cors_headers: String,
    /// Allow credentials (cookies, `Authorization`) across origins (the default; with `*` origins
    /// the request's origin is named back, as browsers require).
    #[arg(long = "cors-credentials", env = "LLAMA_ARG_CORS_CREDENTIALS", overrides_with = "no_cors_credentials",
          value_parser = truthy, num_args = 0..=1, default_missing_value = "true", value_name = "BOOL")]
    pub cors_credentials: Option<bool>,
    /// Refuse credentials across origins.
    #[arg(long = "no-cors-credentials", overrides_with = "cors_credentials")]
    pub no_cors_credentials: bool,
    /// Serve Prometheus metrics at /metrics.
    #[arg(long = "metrics", env = "LLAMA_ARG_ENDPOINT_METRICS", value_parser = truthy)]
    pub metrics: bool,
    /// Serve /slots (the default; `--slots false` or `LLAMA_ARG_ENDPOINT_SLOTS=0` as --no-slots).
    #[arg(long = "slots", env = "LLAMA_ARG_ENDPOINT_SLOTS", overrides_with = "no_slots", value_parser = truthy,
          num_args = 0..=1, default_missing_value = "true", value_name = "BOOL")]
    pub slots: Option<bool>,
    /// Answer /slots with 501.
    #[arg(long = "no-slots", env = "LLAMA_ARG_NO_ENDPOINT_SLOTS", overrides_with = "slots", value_parser = truthy)]
    pub no_slots: bool,
    /// Run one throwaway step after loading, before /health says ready (the default), so the first
    /// request does not pay the backend's one-time work.
    #[arg(long = "warmup", overrides_with = "no_warmup")]
    pub warmup: bool,
    /// Skip the warm-up step.
    #[arg(long = "no-warmup", overrides_with = "warmup")]
    pub no_warmup: bool,
    /// No web UI: what mlxcel-server does anyway (it serves none), so llama-server command lines
    /// that switch it off run as they are.
    #[arg(long = "no-webui", alias = "no-ui")]
    pub no_webui: bool,
    /// Reuse the KV of a shared prompt prefix across requests (the default; per request
    /// `cache_prompt`; `LLAMA_ARG_CACHE_PROMPT=0` as --no-cache-prompt).
    #[arg(long = "cache-prompt", env = "LLAMA_ARG_CACHE_PROMPT", overrides_with = "no_cache_prompt",
          value_parser = truthy, num_args = 0..=1, default_missing_value = "true", value_name = "BOOL")]
    pub cache_prompt: Option<bool>,
    /// Never reuse prompt KV across requests.
    #[arg(long = "no-cache-prompt", env = "LLAMA_ARG_NO_CACHE_PROMPT", overrides_with = "cache_prompt", value_parser = truthy)]
    pub no_cache_prompt: bool,
    /// Keep sliding-window layers' KV for the whole context (Gemma 2/3's local layers): more memory,
    /// and a prompt cache that works past the window, which without it is off for such models.
    #[arg(long = "swa-full", env = "LLAMA_ARG_SWA_FULL", value_parser = truthy, num_args = 0..=1,
          default_missing_value = "true", value_name = "BOOL")]
    pub swa_full: Option<bool>,
    /// A Jinja chat template (file) to use instead of the model's.
    #[arg(long = "chat-template-file", env = "LLAMA_ARG_CHAT_TEMPLATE_FILE", value_name = "FILE")]
    pub chat_template_file: Option<PathBuf>,
    /// A Jinja chat template (source text) to use instead of the model's.
    #[arg(long = "chat-template", env = "LLAMA_ARG_CHAT_TEMPLATE", conflicts_with = "chat_template_file")]
    pub chat_template: Option<String>,
    /// Extra chat-template variables for every request, as a JSON object (e.g. '{"enable_thinking":
    /// false}'); a request's `chat_template_kwargs` override them by name.
    #[arg(long = "chat-template-kwargs", env = "LLAMA_ARG_CHAT_TEMPLATE_KWARGS", value_name = "JSON")]
    pub chat_template_kwargs: Option<String>,
    /// How a reasoning model's thinking is returned: auto or deepseek (split out into
    /// `reasoning_content` and Anthropic `thinking` blocks), deepseek-legacy (split out and also left
    /// in the content), none (left in the content).
    #[arg(long = "reasoning-format", env = "LLAMA_ARG_THINK", default_value = "auto", value_parser = ReasoningFormat::parse)]
    pub reasoning_format: ReasoningFormat,
    /// Most tokens of thought per answer, after which the server ends the thought (`</think>`) and
    /// the model answers; -1: no limit; 0: no thinking (also the template's `enable_thinking: false`).
    #[arg(long = "reasoning-budget", env = "LLAMA_ARG_THINK_BUDGET", default_value_t = -1, allow_negative_numbers = true)]
    pub reasoning_budget: i64,
    /// Continuous batching (always on: accepted for llama-server command lines, refused if switched
    /// off).
    #[arg(long = "cont-batching", env = "LLAMA_ARG_CONT_BATCHING", value_parser = truthy, num_args = 0..=1,
          default_missing_value = "true", value_name = "BOOL")]
    pub cont_batching: Option<bool>,
    /// Use the Jinja chat template (mlxcel always does; accepted for llama-server command lines).
    #[arg(long = "jinja", env = "LLAMA_ARG_JINJA", value_parser = truthy)]
    pub jinja: bool,
    /// Backend plugin to use (default: the best-scoring one on this machine).
    #[arg(long)]
    pub backend: Option<String>,
    /// Hub revision (branch, tag or commit) when MODEL is a hub name.
    #[arg(long)]
    pub revision: Option<String>,
    /// Serve even when the memory estimate says the model does not fit.
    #[arg(long)]
    pub force: bool,
    /// Largest request body in bytes (larger: 413).
    #[arg(long = "max-body-bytes", default_value_t = 8 << 20)]
    pub max_body_bytes: usize,
    /// Largest upload to /v1/audio/* in bytes (larger: 413); OpenAI's limit by default.
    #[arg(long = "max-audio-bytes", default_value_t = 25 << 20)]
    pub max_audio_bytes: usize,
    #[command(flatten)]
    pub sampling: SamplingArgs,
    /// Serve MODEL as an embedding model even without sentence-transformers files (a decoder such as
    /// a Qwen3 checkpoint: last-token pooling, L2-normalised). Models with the files need no flag.
    #[arg(long = "embedding", visible_alias = "embeddings", env = "LLAMA_ARG_EMBEDDINGS", value_parser = truthy)]
    pub embedding: bool,
    /// How an embedding model pools its token rows: mean, cls or last (implies --embedding; default:
    /// the model's sentence-transformers config, else last for decoders, mean for encoders).
    #[arg(long = "pooling", env = "LLAMA_ARG_POOLING", value_parser = PoolingFlag::parse)]
    pub pooling: Option<PoolingFlag>,
    /// How embeddings are normalised where a request does not say (its `embd_normalize`): -1 none,
    /// 0 int16 range, 1 taxicab, 2 Euclidean, larger p-norms (default: as the model's pipeline does).
    #[arg(long = "embd-normalize", value_name = "N", allow_negative_numbers = true,
          value_parser = clap::value_parser!(i64).range(-1..))]
    pub embd_normalize: Option<i64>,
    /// `--cache-type-k/-v` (also `-ctk`/`-ctv`).
    #[command(flatten)]
    pub cache_types: CacheTypeArgs,
    /// The flags the command line or the environment gave ([`ServerArgs::note_given`]).
    #[arg(skip)]
    pub given: Vec<GivenFlag>,
}

/// A flag the command line (or its environment variable) gave, not a default: clap's id, and the
/// name to quote in a message (`--n-predict`, or `LLAMA_ARG_N_PREDICT` where that set it).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GivenFlag {
    pub id: String,
    pub name: String,
}

impl ServerArgs {
    /// Notes which of the server's flags `matches` (the parse that made these arguments) holds from
    /// the command line or the environment, so that one the served model does not use can be refused.
    pub fn note_given(&mut self, matches: &ArgMatches) {
        let own = ServerArgs::augment_args(clap::Command::new("mlxcel-server"));
        self.given = own
            .get_arguments()
            .filter_map(|a| {
                let id = a.get_id().to_string();
                // Named as given: the flag, or the environment variable that set it.
                let name = match matches.value_source(&id)? {
                    ValueSource::CommandLine => a.get_long().map_or_else(|| id.clone(), |l| format!("--{l}")),
                    ValueSource::EnvVariable => a.get_env()?.to_string_lossy().into_owned(),
                    _ => return None,
                };
                Some(GivenFlag { id, name })
            })
            .collect();
    }
}

/// Slots when `-np` is not given (or negative): llama-server's auto.
pub const AUTO_PARALLEL: usize = 4;

/// Flags every served model acts on: listening, security, limits, the backend.
const EVERY_MODEL_FLAGS: &[&str] = &[
    "model",
    "alias",
    "host",
    "port",
    "threads",
    "api_key",
    "api_key_file",
    "ssl_key_file",
    "ssl_cert_file",
    "timeout",
    "cors_origins",
    "cors_methods",
    "cors_headers",
    "cors_credentials",
    "no_cors_credentials",
    "metrics",
    "slots",
    "no_slots",
    "cont_batching",
    "jinja",
    "backend",
    "revision",
    "max_body_bytes",
    "max_audio_bytes",
    "no_webui",
];

/// Flags an embedding or reranking model acts on besides [`EVERY_MODEL_FLAGS`]: its input limit,
/// queue, batch, memory check and pooling (an embedding pass keeps no KV, decoders' included, so
/// the cache types are not among them).
const ENCODER_FLAGS: &[&str] =
    &["ctx_size", "parallel", "batch_size", "force", "embedding", "pooling", "embd_normalize"];

/// Flags only an embedding model acts on: a text model (served without `--embedding`) and a
/// reranker refuse them.
const EMBEDDING_ONLY_FLAGS: &[&str] = &["embd_normalize"];

/// An on/off value as llama.cpp reads its flags' environment variables: `true`, `1`, `on`,
/// `enabled` (and `yes`) or `false`, `0`, `off`, `disabled` (and `no`), in any case.
fn truthy(v: &str) -> Result<bool, String> {
    match v.trim().to_ascii_lowercase().as_str() {
        "true" | "1" | "on" | "enabled" | "yes" => Ok(true),
        "false" | "0" | "off" | "disabled" | "no" => Ok(false),
        _ => Err("expected true/false, 1/0, on/off or enabled/disabled".into()),
    }
}

/// llama-server's two-letter short flags that clap cannot spell (`-np`), rewritten to their long names
/// before parsing.
const SHORT_ALIASES: &[(&str, &str)] = &[
    ("-np", "--parallel"),
    ("-cb", "--cont-batching"),
    ("-ub", "--ubatch-size"),
    ("-to", "--timeout"),
    ("-ctk", "--cache-type-k"),
    ("-ctv", "--cache-type-v"),
];

/// llama-server flags mlxcel does not implement: (flags, environment variable, why).
const REFUSED: &[(&[&str], &str, &str)] = &[
    (
        &["-ngl", "--gpu-layers", "--n-gpu-layers"],
        "LLAMA_ARG_N_GPU_LAYERS",
        "layer offload: the backend plugin (--backend) holds the whole model",
    ),
    (&["-fa", "--flash-attn"], "LLAMA_ARG_FLASH_ATTN", "the attention kernel is the backend's choice"),
    (
        &["--mmproj", "-mm", "--mmproj-url", "-mmu", "--no-mmproj"],
        "LLAMA_ARG_MMPROJ",
        "multimodal projectors are not supported",
    ),
    (&["--lora", "--lora-scaled", "--lora-init-without-apply"], "LLAMA_ARG_LORA", "LoRA adapters are not supported"),
    (
        &["--control-vector", "--control-vector-scaled", "--control-vector-layer-range"],
        "",
        "control vectors are not supported",
    ),
    (
        &["--rope-scaling", "--rope-scale", "--rope-freq-base", "--rope-freq-scale"],
        "LLAMA_ARG_ROPE_SCALING_TYPE",
        "RoPE comes from the model's config.json",
    ),
    (
        &["--yarn-orig-ctx", "--yarn-ext-factor", "--yarn-attn-factor", "--yarn-beta-slow", "--yarn-beta-fast"],
        "",
        "RoPE comes from the model's config.json",
    ),
    (
        &["--grammar", "--grammar-file", "-j", "--json-schema", "-jf", "--json-schema-file"],
        "",
        "a server-wide grammar or JSON schema is not supported; send json_schema or response_format with each request",
    ),
    (
        &[
            "-md",
            "--model-draft",
            "--draft",
            "--draft-max",
            "--draft-n",
            "--draft-min",
            "--draft-p-min",
            "-cd",
            "--ctx-size-draft",
            "-devd",
            "--device-draft",
            "-ngld",
            "--gpu-layers-draft",
        ],
        "LLAMA_ARG_MODEL_DRAFT",
        "speculative decoding is not supported",
    ),
    (
        &["-sm", "--split-mode", "-ts", "--tensor-split", "-mg", "--main-gpu", "-dev", "--device"],
        "LLAMA_ARG_SPLIT_MODE",
        "multi-device splits are not supported; pick a backend with --backend",
    ),
    (
        &["-ot", "--override-tensor", "-cmoe", "--cpu-moe", "-ncmoe", "--n-cpu-moe"],
        "",
        "tensor placement overrides are not supported",
    ),
    (&["--mlock", "--no-mmap", "--numa", "--direct-io"], "LLAMA_ARG_MLOCK", "weights are always memory-mapped"),
    (
        &["-hf", "-hfr", "--hf-repo", "-hff", "--hf-file", "-hft", "--hf-token", "-mu", "--model-url"],
        "LLAMA_ARG_HF_REPO",
        "give the hub name to -m instead (mlxcel resolves owner/name itself)",
    ),
    (
        &["--reranking", "--rerank"],
        "LLAMA_ARG_RERANKING",
        "rerank routes need no flag: they are served when MODEL is a cross-encoder (a \
         *ForSequenceClassification checkpoint)",
    ),
    (&["-nocb", "--no-cont-batching"], "LLAMA_ARG_NO_CONT_BATCHING", "continuous batching is always on"),
    (&["-dt", "--defrag-thold"], "LLAMA_ARG_DEFRAG_THOLD", "the paged KV cache needs no defragmentation"),
    (&["--slot-save-path", "--slot-prompt-similarity", "-sps"], "", "saving slots is not supported"),
    (
        &[
            "--spm-infill",
            "--ctx-shift",
            "--no-context-shift",
            "-kvu",
            "--kv-unified",
            "-cram",
            "--cache-ram",
            "--cache-reuse",
        ],
        "",
        "not supported by mlxcel's engine",
    ),
    (&["--no-jinja"], "", "mlxcel only renders Jinja chat templates"),
    (&["--api-prefix", "--path", "--props", "--webui", "--ui"], "", "not supported by mlxcel-server"),
    (
        &[
            "-tb",
            "--threads-batch",
            "-C",
            "--cpu-mask",
            "-Cr",
            "--cpu-range",
            "--cpu-strict",
            "--prio",
            "--poll",
            "-Cb",
            "--cpu-mask-batch",
            "--prio-batch",
        ],
        "",
        "use -t/--threads; CPU affinity and priorities are not supported",
    ),
    (&["-sp", "--special", "--keep", "--override-kv", "--check-tensors"], "", "not supported by mlxcel-server"),
    (
        &[
            "--log-file",
            "--log-disable",
            "--log-colors",
            "-lv",
            "--verbosity",
            "--log-verbosity",
            "--log-prefix",
            "--no-log-prefix",
            "--log-timestamps",
            "--no-log-timestamps",
            "--log-jsonl",
            "--no-log-jsonl",
        ],
        "LLAMA_ARG_LOG_FILE",
        "mlxcel-server logs to stderr, one line per request; -v or RUST_LOG (e.g. RUST_LOG=warn) sets how much",
    ),
    (
        &["--threads-http", "--sleep-idle-seconds", "--sse-ping-interval", "--reuse-port", "--tags"],
        "LLAMA_ARG_THREADS_HTTP",
        "not supported by mlxcel-server",
    ),
];

/// Environment variables of llama-server flags mlxcel does not implement, beyond [`REFUSED`]'s
/// first ones: (variable, flag, the on/off value that asks for what mlxcel does anyway). Set to
/// anything else, they are refused as the flags are (older llama.cpp builds read the `LLAMA_LOG_*`
/// names).
const REFUSED_VARIABLES: &[(&str, &str, Option<bool>)] = &[
    ("LLAMA_ARG_LOG_COLORS", "--log-colors", Some(false)),
    ("LLAMA_ARG_LOG_VERBOSITY", "--verbosity", None),
    ("LLAMA_ARG_LOG_PREFIX", "--log-prefix", None),
    ("LLAMA_ARG_LOG_TIMESTAMPS", "--log-timestamps", None),
    ("LLAMA_ARG_LOG_JSONL", "--log-jsonl", Some(false)),
    ("LLAMA_ARG_SLEEP_IDLE_SECONDS", "--sleep-idle-seconds", None),
    ("LLAMA_ARG_SSE_PING_INTERVAL", "--sse-ping-interval", None),
    ("LLAMA_ARG_REUSE_PORT", "--reuse-port", Some(false)),
    ("LLAMA_ARG_TAGS", "--tags", None),
    ("LLAMA_ARG_CACHE_REUSE", "--cache-reuse", None),
    ("LLAMA_ARG_CACHE_RAM", "--cache-ram", None),
    ("LLAMA_ARG_KV_UNIFIED", "--kv-unified", None),
    ("LLAMA_ARG_CONTEXT_SHIFT", "--context-shift", Some(false)),
    ("LLAMA_ARG_NO_CONTEXT_SHIFT", "--no-context-shift", Some(true)),
    ("LLAMA_ARG_ENDPOINT_PROPS", "--props", Some(false)),
    ("LLAMA_ARG_STATIC_PATH", "--path", None),
    ("LLAMA_ARG_API_PREFIX", "--api-prefix", None),
    ("LLAMA_ARG_UI", "--webui", Some(false)),
    ("LLAMA_ARG_NO_UI", "--no-webui", Some(true)),
    ("LLAMA_ARG_NO_WEBUI", "--no-webui", Some(true)),
    ("LLAMA_ARG_ROPE_SCALE", "--rope-scale", None),
    ("LLAMA_ARG_ROPE_FREQ_BASE", "--rope-freq-base", None),
    ("LLAMA_ARG_ROPE_FREQ_SCALE", "--rope-freq-scale", None),
    ("LLAMA_ARG_YARN_ORIG_CTX", "--yarn-orig-ctx", None),
    ("LLAMA_ARG_YARN_EXT_FACTOR", "--yarn-ext-factor", None),
    ("LLAMA_ARG_YARN_ATTN_FACTOR", "--yarn-attn-factor", None),
    ("LLAMA_ARG_YARN_BETA_SLOW", "--yarn-beta-slow", None),
    ("LLAMA_ARG_YARN_BETA_FAST", "--yarn-beta-fast", None),
    ("LLAMA_ARG_MMPROJ_URL", "--mmproj-url", None),
    ("LLAMA_ARG_NUMA", "--numa", None),
    ("LLAMA_ARG_DEVICE", "--device", None),
    ("LLAMA_ARG_OVERRIDE_TENSOR", "--override-tensor", None),
    ("LLAMA_ARG_CPU_MOE", "--cpu-moe", Some(false)),
    ("LLAMA_ARG_N_CPU_MOE", "--n-cpu-moe", None),
    ("LLAMA_ARG_TENSOR_SPLIT", "--tensor-split", None),
    ("LLAMA_ARG_MAIN_GPU", "--main-gpu", None),
    ("LLAMA_ARG_DRAFT_MAX", "--draft-max", None),
    ("LLAMA_ARG_DRAFT_MIN", "--draft-min", None),
    ("LLAMA_ARG_CTX_SIZE_DRAFT", "--ctx-size-draft", None),
    ("LLAMA_ARG_N_GPU_LAYERS_DRAFT", "--gpu-layers-draft", None),
    ("LLAMA_ARG_SPEC_DRAFT_MODEL", "--spec-draft-model", None),
    ("LLAMA_ARG_SPEC_TYPE", "--spec-type", None),
    ("LLAMA_LOG_VERBOSITY", "--verbosity", None),
    ("LLAMA_LOG_COLORS", "--log-colors", Some(false)),
    ("LLAMA_LOG_PREFIX", "--log-prefix", None),
    ("LLAMA_LOG_TIMESTAMPS", "--log-timestamps", None),
];

/// Rewrites llama-server's multi-letter short flags and refuses the flags (and their environment
/// variables) mlxcel does not implement, naming the flag.
pub fn preprocess_argv(args: impl IntoIterator<Item = String>) -> Result<Vec<String>> {
    let mut out = Vec::new();
    for a in args {
        // llama.cpp reads `--ctx_size` as `--ctx-size`: underscores in a long flag's name are dashes.
        let a = match a.strip_prefix("--") {
            Some(rest) if rest.split('=').next().is_some_and(|n| n.contains('_')) => match rest.split_once('=') {
                Some((n, v)) => format!("--{}={v}", n.replace('_', "-")),
                None => format!("--{}", rest.replace('_', "-")),
            },
            _ => a,
        };
        let name = a.split('=').next().unwrap_or(&a);
        if let Some((_, long)) = SHORT_ALIASES.iter().find(|(s, _)| *s == name) {
            out.push(match a.split_once('=') {
                Some((_, v)) => format!("{long}={v}"),
                None => long.to_string(),
            });
            continue;
        }
        if name.starts_with('-') {
            if let Some((_, _, why)) = REFUSED.iter().find(|(flags, _, _)| flags.contains(&name)) {
                bail!("{name} is a llama-server flag mlxcel-server does not support: {why}");
            }
        }
        out.push(a);
    }
    for (flags, env, why) in REFUSED {
        if !env.is_empty() && std::env::var_os(env).is_some() {
            bail!("{env} (llama-server's {}) is set, but mlxcel-server does not support it: {why}", flags[0]);
        }
    }
    for (env, flag, matches) in REFUSED_VARIABLES {
        let Some(value) = std::env::var_os(env) else { continue };
        if matches.is_some() && truthy(&value.to_string_lossy()).ok() == *matches {
            continue;
        }
        bail!("{env} (llama-server's {flag}) is set to {value:?}, but mlxcel-server does not support it");
    }
    Ok(out)
}

/// The fewest requests that may wait for a slot (sixteen per slot where there are more slots): an
/// indexing client sends dozens at once and llama-server queues them all; a bound still answers a
/// flood with 503 before its prompts fill memory. (Four per slot, 16 at the default, refused a 32-way
/// embedding client.)
pub const QUEUE_LIMIT_MIN: usize = 128;

/// The settings the server and its engine run with, resolved from the flags.
#[derive(Debug, Clone)]
pub struct ServerConfig {
    pub model: String,
    pub revision: Option<String>,
    pub alias: Option<String>,
    pub host: String,
    pub port: u16,
    /// None: min(model maximum, 4096); Some(0): the model's maximum.
    pub ctx_size: Option<usize>,
    pub parallel: usize,
    /// Full contexts of KV the sequences share when fewer than `parallel` (auto: one, as
    /// llama-server's unified KV); `None`: one per sequence.
    pub kv_pool_seqs: Option<usize>,
    pub threads: u32,
    /// Default generation limit (None: until EOS or the context is full).
    pub n_predict: Option<usize>,
    pub batch_size: usize,
    pub ubatch_size: usize,
    pub api_keys: Vec<String>,
    /// (certificate chain, private key), PEM.
    pub tls: Option<(PathBuf, PathBuf)>,
    pub timeout: Option<Duration>,
    pub cors: super::cors::CorsConfig,
    pub metrics: bool,
    pub slots: bool,
    pub cache_prompt: bool,
    /// `--swa-full`: sliding-window layers keep the whole context's KV.
    pub swa_full: bool,
    /// Run a warm-up step after loading a text model.
    pub warmup: bool,
    /// Chat template source replacing the model's.
    pub chat_template: Option<String>,
    /// Chat-template variables every request starts from.
    pub chat_template_kwargs: serde_json::Map<String, serde_json::Value>,
    pub reasoning_format: ReasoningFormat,
    /// Most tokens of thought per answer (None: no limit).
    pub reasoning_budget: Option<usize>,
    pub backend: Option<String>,
    pub plugin_dirs: Vec<PathBuf>,
    pub force: bool,
    pub max_body_bytes: usize,
    pub max_audio_bytes: usize,
    /// KV cache types (None: f16 where the backend keeps it, else f32).
    pub cache_types: Option<KvCacheTypes>,
    /// Requests that may wait for a slot before new ones get 503 (see [`QUEUE_LIMIT_MIN`]).
    pub queue_limit: usize,
    /// Sampling flags applied over the model's generation_config.json.
    pub sampling: SamplingOverrides,
    /// `--embedding` / `--pooling`: serve the model as an embedding model.
    pub embedding: Option<EmbeddingFlags>,
    /// `--embd-normalize`: the `embd_normalize` of requests that send none.
    pub embd_normalize: Option<i64>,
    /// The flags the command line or the environment gave.
    pub given: Vec<GivenFlag>,
}

impl ServerConfig {
    /// The given flags (as named) that a model of `task` would not act on: a speech model acts only
    /// on [`EVERY_MODEL_FLAGS`], an encoder also on [`ENCODER_FLAGS`], a text model on all.
    pub fn flags_unused_by(&self, task: Task) -> Vec<&str> {
        let used = |id: &str| match task {
            // (--embedding turns a text model into an embedding model before this is asked.)
            Task::Text => !EMBEDDING_ONLY_FLAGS.contains(&id),
            Task::Rerank => {
                (EVERY_MODEL_FLAGS.contains(&id) || ENCODER_FLAGS.contains(&id)) && !EMBEDDING_ONLY_FLAGS.contains(&id)
            }
            Task::Embed => EVERY_MODEL_FLAGS.contains(&id) || ENCODER_FLAGS.contains(&id),
            _ => EVERY_MODEL_FLAGS.contains(&id),
        };
        self.given.iter().filter(|g| !used(&g.id)).map(|g| g.name.as_str()).collect()
    }
}

impl ServerArgs {
    /// An on/off setting with a flag pair (`--slots [BOOL]` / `--no-slots`), each also set by its
    /// variable: a command-line flag beats a variable (the command line's last flag wins, as clap
    /// overrides), and between two variables the `NO_` one wins, as llama.cpp reads them. On by
    /// default.
    fn switch(&self, on_id: &str, on: Option<bool>, off_id: &str, off: bool) -> bool {
        let on_cli = self.given.iter().any(|g| g.id == on_id && g.name.starts_with('-'));
        let off_cli = self.given.iter().any(|g| g.id == off_id && g.name.starts_with('-'));
        match (on, off) {
            (Some(v), true) if on_cli && !off_cli => v,
            (_, true) => false,
            (Some(v), false) => v,
            (None, false) => true,
        }
    }

    pub fn config(&self, plugin_dirs: &[PathBuf]) -> Result<ServerConfig> {
        if self.cont_batching == Some(false) {
            bail!("continuous batching cannot be switched off (--cont-batching / LLAMA_ARG_CONT_BATCHING): it is always on");
        }
        let model = self.model.clone().context("no model: pass -m MODEL (a folder or a hub name)")?;
        let mut api_keys: Vec<String> =
            self.api_key.iter().map(|k| k.trim().to_string()).filter(|k| !k.is_empty()).collect();
        if let Some(f) = &self.api_key_file {
            let text = std::fs::read_to_string(f).with_context(|| format!("reading --api-key-file {}", f.display()))?;
            api_keys
                .extend(text.lines().map(str::trim).filter(|l| !l.is_empty() && !l.starts_with('#')).map(String::from));
            if api_keys.is_empty() {
                bail!("--api-key-file {} holds no key", f.display());
            }
        }
        let tls = match (&self.ssl_cert_file, &self.ssl_key_file) {
            (Some(c), Some(k)) => Some((c.clone(), k.clone())),
            (None, None) => None,
            _ => bail!("HTTPS needs both --ssl-cert-file and --ssl-key-file"),
        };
        let chat_template = match (&self.chat_template_file, &self.chat_template) {
            (Some(f), _) => Some(
                std::fs::read_to_string(f).with_context(|| format!("reading --chat-template-file {}", f.display()))?,
            ),
            (None, Some(s)) if s.contains("{{") || s.contains("{%") => Some(s.clone()),
            (None, Some(s)) => bail!(
                "--chat-template {s:?}: mlxcel takes the template's Jinja source here (or a file with --chat-template-file); llama-server's built-in template names are not supported"
            ),
            _ => None,
        };
        let mut chat_template_kwargs = match &self.chat_template_kwargs {
            None => serde_json::Map::new(),
            Some(s) => match serde_json::from_str(s) {
                Ok(serde_json::Value::Object(m)) => m,
                _ => bail!("--chat-template-kwargs must be a JSON object, got {s}"),
            },
        };
        let reasoning_budget = match self.reasoning_budget {
            -1 => None,
            0 => {
                chat_template_kwargs.insert("enable_thinking".into(), serde_json::Value::Bool(false));
                Some(0)
            }
            n if n > 0 => Some(n as usize),
            n => bail!("--reasoning-budget must be -1 (no limit) or at least 0, got {n}"),
        };
        // llama-server's auto (any negative value): four slots.
        let parallel = match self.parallel {
            0 => bail!("--parallel must be at least 1 (or -1: auto, 4)"),
            n if n < 0 => AUTO_PARALLEL,
            n => usize::try_from(n).context("--parallel is too large")?,
        };
        if self.batch_size == 0 || self.ubatch_size == 0 {
            bail!("--batch-size and --ubatch-size must be at least 1");
        }
        let sampling = self.sampling.overrides()?;
        sampling.resolve(None).validate().map_err(|e| anyhow::anyhow!("invalid sampling flag: {e}"))?;
        Ok(ServerConfig {
            model,
            revision: self.revision.clone(),
            alias: self.alias.clone(),
            host: self.host.clone(),
            port: self.port,
            ctx_size: self.ctx_size,
            parallel,
            kv_pool_seqs: (self.parallel < 0).then_some(1),
            threads: self.threads.unwrap_or(0),
            n_predict: self.n_predict.and_then(|n| usize::try_from(n).ok()),
            batch_size: self.batch_size,
            ubatch_size: self.ubatch_size.min(self.batch_size),
            api_keys,
            tls,
            timeout: (self.timeout > 0).then(|| Duration::from_secs(self.timeout)),
            cors: super::cors::CorsConfig::parse(
                &self.cors_origins,
                &self.cors_methods,
                &self.cors_headers,
                self.switch("cors_credentials", self.cors_credentials, "no_cors_credentials", self.no_cors_credentials),
            )?,
            metrics: self.metrics,
            slots: self.switch("slots", self.slots, "no_slots", self.no_slots),
            cache_prompt: self.switch("cache_prompt", self.cache_prompt, "no_cache_prompt", self.no_cache_prompt),
            swa_full: self.swa_full.unwrap_or(false),
            warmup: !self.no_warmup,
            chat_template,
            chat_template_kwargs,
            reasoning_format: self.reasoning_format,
            reasoning_budget,
            backend: self.backend.clone(),
            plugin_dirs: plugin_dirs.to_vec(),
            force: self.force,
            max_body_bytes: self.max_body_bytes,
            cache_types: self.cache_types.types(),
            max_audio_bytes: self.max_audio_bytes,
            queue_limit: parallel.saturating_mul(16).max(QUEUE_LIMIT_MIN),
            sampling,
            embedding: (self.embedding || self.pooling.is_some()).then_some(EmbeddingFlags { pooling: self.pooling }),
            embd_normalize: self.embd_normalize,
            given: self.given.clone(),
        })
    }
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;
    use crate::engine::KvCacheType;

    #[derive(Parser)]
    struct T {
        #[command(flatten)]
        a: ServerArgs,
    }

    fn parse(args: &[&str]) -> Result<ServerConfig> {
        let argv = preprocess_argv(std::iter::once("x").chain(args.iter().copied()).map(String::from))?;
        T::try_parse_from(argv)?.a.config(&[])
    }

    #[test]
    fn llama_server_command_line_parses_with_two_letter_short_flags() {
        let c = parse(&[
            "-m",
            "m",
            "-a",
            "smol",
            "--port",
            "9000",
            "-c",
            "2048",
            "-np",
            "4",
            "-ub",
            "256",
            "-b",
            "1024",
            "-n",
            "64",
            "--api-key",
            "k1,k2",
            "--api-key",
            "k3",
            "--metrics",
            "--no-slots",
            "-to",
            "30",
            "--jinja",
            "-ctk",
            "bf16",
            "-ctv",
            "f32",
        ])
        .unwrap();
        assert_eq!(c.cache_types, Some(KvCacheTypes { k: KvCacheType::Bf16, v: KvCacheType::F32 }));
        assert_eq!(parse(&["-m", "m"]).unwrap().cache_types, None);
        let e = parse(&["-m", "m", "--cache-type-k", "q4_0"]).unwrap_err().to_string();
        assert!(e.contains("quantized KV caches (q4_0) are not supported"), "{e}");
        assert_eq!((c.port, c.ctx_size, c.parallel, c.ubatch_size, c.batch_size), (9000, Some(2048), 4, 256, 1024));
        assert_eq!(c.n_predict, Some(64));
        assert_eq!(c.api_keys, ["k1", "k2", "k3"]);
        assert!(c.metrics && !c.slots && c.cache_prompt);
        assert_eq!(c.timeout, Some(Duration::from_secs(30)));
        assert_eq!(c.alias.as_deref(), Some("smol"));
    }

    #[test]
    fn on_off_values_read_as_llama_cpp_reads_them() {
        for v in ["true", "1", "on", "enabled", "ON"] {
            assert_eq!(truthy(v), Ok(true), "{v}");
        }
        for v in ["false", "0", "off", "disabled"] {
            assert_eq!(truthy(v), Ok(false), "{v}");
        }
        assert!(truthy("maybe").is_err());
        assert!(parse(&["-m", "m", "-cb"]).is_ok());
        assert!(parse(&["-m", "m", "--cont-batching"]).is_ok());
        let e = parse(&["-m", "m", "--cont-batching", "off"]).unwrap_err().to_string();
        assert!(e.contains("always on"), "{e}");
    }

    #[test]
    fn unsupported_llama_server_flags_are_refused_by_name() {
        for flag in ["-ngl", "--n-gpu-layers", "--mmproj", "--lora", "-fa", "--flash-attn", "--grammar", "-md"] {
            let e = parse(&["-m", "m", flag, "1"]).unwrap_err().to_string();
            assert!(e.starts_with(&format!("{flag} is a llama-server flag")), "{flag}: {e}");
        }
        let e = parse(&["-m", "m", "--flash-attn=on"]).unwrap_err().to_string();
        assert!(e.contains("--flash-attn"), "{e}");
        // Switching off the web UI mlxcel-server does not have is what it does anyway.
        assert!(parse(&["-m", "m", "--no-webui"]).is_ok() && parse(&["-m", "m", "--no-ui"]).is_ok());
        assert!(parse(&["-m", "m", "--webui"]).unwrap_err().to_string().contains("--webui"));
    }

    #[test]
    fn reasoning_flags_set_the_format_and_the_template_variables() {
        let c = parse(&["-m", "m"]).unwrap();
        assert_eq!((c.reasoning_format, c.chat_template_kwargs.len()), (ReasoningFormat::Split, 0));
        let c = parse(&[
            "-m",
            "m",
            "--reasoning-format",
            "none",
            "--reasoning-budget",
            "0",
            "--chat-template-kwargs",
            r#"{"tone": "dry"}"#,
        ])
        .unwrap();
        assert_eq!(c.reasoning_format, ReasoningFormat::None);
        assert_eq!(
            serde_json::Value::Object(c.chat_template_kwargs),
            serde_json::json!({"tone": "dry", "enable_thinking": false})
        );
        assert_eq!(parse(&["-m", "m", "--reasoning-budget", "512"]).unwrap().reasoning_budget, Some(512));
        let e = parse(&["-m", "m", "--reasoning-budget", "-2"]).unwrap_err().to_string();
        assert!(e.contains("-1 (no limit) or at least 0"), "{e}");
        assert!(parse(&["-m", "m", "--chat-template-kwargs", "[1]"]).is_err());
        assert!(parse(&["-m", "m", "--reasoning-format", "bogus"]).is_err());
    }

    #[test]
    fn on_off_pairs_take_a_value_and_the_last_flag_wins() {
        let c = parse(&["-m", "m"]).unwrap();
        assert!(c.slots && c.cache_prompt);
        let c = parse(&["-m", "m", "--slots", "false", "--cache-prompt=off"]).unwrap();
        assert!(!c.slots && !c.cache_prompt);
        assert!(!parse(&["-m", "m", "--slots", "--no-slots"]).unwrap().slots);
        assert!(parse(&["-m", "m", "--no-slots", "--slots"]).unwrap().slots);
        assert!(parse(&["-m", "m", "--no-cache-prompt", "--cache-prompt", "1"]).unwrap().cache_prompt);
        assert!(parse(&["-m", "m", "--slots", "maybe"]).is_err());
    }

    #[test]
    fn long_flags_read_underscores_as_dashes_and_logging_flags_are_refused_by_name() {
        let c = parse(&["-m", "m", "--ctx_size", "2048", "--n_predict=64", "--chat_template_kwargs", r#"{"a_b": 1}"#])
            .unwrap();
        assert_eq!((c.ctx_size, c.n_predict), (Some(2048), Some(64)));
        // Values keep their underscores.
        assert_eq!(serde_json::Value::Object(c.chat_template_kwargs), serde_json::json!({"a_b": 1}));
        let c = parse(&["-m", "m", "--api_key=k_1"]).unwrap();
        assert_eq!(c.api_keys, ["k_1"]);
        for flag in ["-lv", "--log-disable", "--log_file", "--verbosity", "--threads-http"] {
            let e = parse(&["-m", "m", flag, "3"]).unwrap_err().to_string();
            assert!(e.starts_with(&format!("{} is a llama-server flag", flag.replace('_', "-"))), "{flag}: {e}");
        }
    }

    #[test]
    fn a_command_line_switch_beats_a_variable_and_between_variables_no_wins() {
        let mut a = T::try_parse_from(["x", "-m", "m"]).unwrap().a;
        let given = |id: &str, name: &str| GivenFlag { id: id.into(), name: name.into() };
        // `--slots` on the command line, LLAMA_ARG_NO_ENDPOINT_SLOTS set.
        a.given = vec![given("slots", "--slots"), given("no_slots", "LLAMA_ARG_NO_ENDPOINT_SLOTS")];
        assert!(a.switch("slots", Some(true), "no_slots", true));
        // LLAMA_ARG_ENDPOINT_SLOTS=1 set, `--no-slots` on the command line.
        a.given = vec![given("slots", "LLAMA_ARG_ENDPOINT_SLOTS"), given("no_slots", "--no-slots")];
        assert!(!a.switch("slots", Some(true), "no_slots", true));
        // Both variables: the `NO_` one wins, as llama.cpp reads them.
        a.given = vec![given("slots", "LLAMA_ARG_ENDPOINT_SLOTS"), given("no_slots", "LLAMA_ARG_NO_ENDPOINT_SLOTS")];
        assert!(!a.switch("slots", Some(true), "no_slots", true));
        a.given.clear();
        assert!(a.switch("slots", None, "no_slots", false) && !a.switch("slots", Some(false), "no_slots", false));
    }

    #[test]
    fn parallel_defaults_to_llama_servers_auto() {
        let auto = parse(&["-m", "m"]).unwrap();
        assert_eq!((auto.parallel, auto.kv_pool_seqs), (AUTO_PARALLEL, Some(1)));
        assert_eq!(parse(&["-m", "m", "-np", "4"]).unwrap().kv_pool_seqs, None);
        assert_eq!(parse(&["-m", "m", "-np", "-1"]).unwrap().parallel, AUTO_PARALLEL);
        assert_eq!(parse(&["-m", "m", "-np", "1"]).unwrap().parallel, 1);
        let e = parse(&["-m", "m", "-np", "0"]).unwrap_err().to_string();
        assert!(e.contains("at least 1"), "{e}");
    }

    #[test]
    fn the_warm_up_step_is_on_unless_no_warmup() {
        assert!(parse(&["-m", "m"]).unwrap().warmup);
        assert!(!parse(&["-m", "m", "--no-warmup"]).unwrap().warmup);
        assert!(parse(&["-m", "m", "--no-warmup", "--warmup"]).unwrap().warmup);
    }

    #[test]
    fn embedding_and_pooling_flags_serve_a_model_as_an_embedding_model() {
        assert_eq!(parse(&["-m", "m"]).unwrap().embedding, None);
        assert_eq!(parse(&["-m", "m", "--embedding"]).unwrap().embedding, Some(EmbeddingFlags { pooling: None }));
        let c = parse(&["-m", "m", "--embeddings", "--pooling", "mean"]).unwrap();
        assert_eq!(c.embedding, Some(EmbeddingFlags { pooling: Some(PoolingFlag::Mean) }));
        // --pooling alone implies --embedding, as serving embeddings is the only thing it changes.
        let c = parse(&["-m", "m", "--pooling", "last"]).unwrap();
        assert_eq!(c.embedding, Some(EmbeddingFlags { pooling: Some(PoolingFlag::Last) }));
        let e = parse(&["-m", "m", "--pooling", "none"]).unwrap_err().to_string();
        assert!(e.contains("per-token embeddings"), "{e}");
        let e = parse(&["-m", "m", "--reranking"]).unwrap_err().to_string();
        assert!(e.starts_with("--reranking is a llama-server flag"), "{e}");
    }

    /// [`parse`], noting the given flags as the binaries do.
    /// (The environment's flags are tested on the binaries: setting one here would reach the other
    /// tests' parses.)
    fn parse_noting(args: &[&str]) -> ServerConfig {
        let argv = preprocess_argv(std::iter::once("x").chain(args.iter().copied()).map(String::from)).unwrap();
        let matches = <T as clap::CommandFactory>::command().try_get_matches_from(argv).unwrap();
        let mut t = <T as clap::FromArgMatches>::from_arg_matches(&matches).unwrap();
        t.a.note_given(&matches);
        t.a.config(&[]).unwrap()
    }

    #[test]
    fn flags_a_task_does_not_use_are_named_and_defaults_are_not_given() {
        let c = parse_noting(&["-m", "m", "-np", "2", "--temp", "0.3", "--metrics", "-ub", "64", "--top-k", "7"]);
        let given: Vec<&str> = c.given.iter().map(|g| g.name.as_str()).collect();
        assert_eq!(given, ["--model", "--parallel", "--ubatch-size", "--metrics", "--temp", "--top-k"]);
        assert!(c.flags_unused_by(Task::Text).is_empty());
        assert_eq!(c.flags_unused_by(Task::Embed), ["--ubatch-size", "--temp", "--top-k"]);
        assert_eq!(c.flags_unused_by(Task::Rerank), ["--ubatch-size", "--temp", "--top-k"]);
        assert_eq!(c.flags_unused_by(Task::Asr), ["--parallel", "--ubatch-size", "--temp", "--top-k"]);
        // --embd-normalize is an embedding model's alone.
        let c = parse_noting(&["-m", "m", "--embd-normalize", "1"]);
        assert_eq!(
            (c.flags_unused_by(Task::Text), c.flags_unused_by(Task::Rerank)),
            (vec!["--embd-normalize"], vec!["--embd-normalize"])
        );
        assert!(c.flags_unused_by(Task::Embed).is_empty());
        // A default (here -b's 2048, --port's 8080) is not given.
        assert!(parse_noting(&["-m", "m"]).flags_unused_by(Task::Asr).is_empty());
    }

    #[test]
    fn n_predict_minus_one_means_no_limit_and_half_a_tls_pair_is_an_error() {
        assert_eq!(parse(&["-m", "m", "-n", "-1"]).unwrap().n_predict, None);
        let e = parse(&["-m", "m", "--ssl-key-file", "k.pem"]).unwrap_err().to_string();
        assert!(e.contains("--ssl-cert-file"), "{e}");
        assert!(parse(&[]).unwrap_err().to_string().contains("-m MODEL"));
    }
}
