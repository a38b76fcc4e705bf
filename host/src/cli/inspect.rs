//! `mlxcel inspect MODEL`: what a checkpoint is and whether it fits, without loading it: exact weight
//! bytes from the safetensors headers, the KV cache from the family plugin's layer description,
//! activations estimated.

use anyhow::Result;
use clap::Args;
use mlxcel_plugin_api::Task;
use serde_json::json;

use super::cache_type::CacheTypeArgs;
use super::run::resolve_model;
use super::GlobalArgs;
use crate::checkpoint::Checkpoint;
use crate::engine::memory::MemoryEstimate;
use crate::engine::runner::{family_model, fitted_context, warn_if_context_cut};
use crate::engine::KvCacheTypes;
use crate::text::ChatTemplate;

#[derive(Args, Debug)]
pub struct InspectArgs {
    /// Model folder, or a hub name (from the model store or the Hugging Face cache, else downloaded).
    pub model: String,
    /// Context size in tokens (default: min(model maximum, 4096), as `run` uses).
    #[arg(short = 'c', long = "ctx-size")]
    pub ctx_size: Option<usize>,
    /// Sequences served at once (each gets ctx-size tokens of KV cache in full-attention layers).
    #[arg(long, default_value_t = 1, value_parser = super::at_least_one)]
    pub parallel: u64,
    /// Backend whose device memory the fit check counts against (default: the best-scoring one).
    #[arg(long)]
    pub backend: Option<String>,
    /// Hub revision (branch, tag or commit) when MODEL is a hub name.
    #[arg(long)]
    pub revision: Option<String>,
    /// One JSON object on stdout.
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub cache_types: CacheTypeArgs,
}

pub fn run(global: &GlobalArgs, args: &InspectArgs) -> Result<()> {
    let dir = resolve_model(&args.model, args.revision.as_deref())?;
    let ck = Checkpoint::open(&dir)?;
    let catalog = global.catalog();
    // The family is found as loading finds it (by `model_type`, else by the families' own matching).
    let (family, model) = family_model(&catalog, &ck)?;
    let info = model.info();
    // As loading sizes it: 0 is the model's whole context, and no more than that is ever taken.
    warn_if_context_cut(args.ctx_size, info.max_positions);
    let ctx = fitted_context(args.ctx_size.unwrap_or(4096), info.max_positions) as u64;
    // The device the model would run on says how much memory is free (0 = unknown).
    // A backend asked for by name must be there (as `run` and the server check it).
    let backend = match &args.backend {
        Some(name) => Some(catalog.select_backend(Some(name))?),
        None => catalog.select_backend(None).ok(),
    };
    let free = backend.and_then(|b| b.describe().devices.first().map(|d| d.free_memory_bytes)).unwrap_or(0);
    let cache_types = args.cache_types.types().unwrap_or(KvCacheTypes::DEFAULT);
    let est = MemoryEstimate::new(info, ck.weight_bytes(), ctx, args.parallel, args.parallel, free, cache_types)
        .with_tokenizer(&ck.dir);
    let params: u64 = ck.tensors.iter().map(|t| t.shape.iter().product::<u64>()).sum();
    // Every task reads the Hugging Face tokenizer file; without it the model does not run, however
    // well it fits.
    let has_tokenizer = dir.join("tokenizer.json").is_file();
    // A text model's chat needs its template (run and the server's chat routes).
    let template = (info.task == Task::Text).then(|| {
        match ChatTemplate::source_in(&dir, crate::text::tokenizer_config(&dir).as_ref()) {
            None => Err("none: chat needs --chat-template-file (raw completion: --no-chat-template)".to_string()),
            Some(src) => ChatTemplate::new(&src, "", "").map(|_| ()),
        }
    });
    if args.json {
        let v = json!({
            "path": dir.display().to_string(),
            "architecture": info.architecture,
            "family": family.name(),
            "task": info.task.name(),
            "layers": info.n_layers,
            "hidden_size": info.hidden_size,
            "vocab_size": info.vocab_size,
            "max_positions": info.max_positions,
            "quantization": if info.quantization.is_empty() { None } else { Some(&info.quantization) },
            "tensors": ck.tensors.len(),
            "stored_elements": params,
            "files": ck.files.len(),
            "memory": est,
            "tokenizer": has_tokenizer,
            "chat_template": template.as_ref().map(|t| match t {
                Ok(()) => json!({"ok": true}),
                Err(e) => json!({"ok": false, "problem": e}),
            }),
        });
        println!("{}", serde_json::to_string_pretty(&v)?);
        return Ok(());
    }
    let mb = |b: u64| format!("{:.1} MB", b as f64 / 1e6);
    println!("{}", dir.display());
    println!("  architecture   {} (family `{}`), {}", info.architecture, family.name(), info.task.name());
    println!(
        "  shape          {} layers, hidden {}, vocabulary {}, context ≤ {}",
        info.n_layers, info.hidden_size, info.vocab_size, info.max_positions
    );
    println!("  quantization   {}", if info.quantization.is_empty() { "none" } else { &info.quantization });
    println!("  weights        {} in {} tensors, {} file(s)", mb(est.weight_bytes), ck.tensors.len(), ck.files.len());
    // Sliding-window layers keep only their window, and cross-attention its fixed source: the
    // total is then less than every layer holding every token.
    let full = est.kv_bytes_per_token as u64 * ctx * est.parallel;
    let held = if est.kv_bytes < full { ", windowed or cross-attention layers holding fewer" } else { "" };
    println!(
        "  KV cache       {} ({:.1} KB per token × {} tokens × {} sequence(s){held}; K {}, V {})",
        mb(est.kv_bytes),
        est.kv_bytes_per_token as f64 / 1e3,
        ctx,
        est.parallel,
        est.cache_type_k,
        est.cache_type_v
    );
    println!("  activations    {} (estimate)", mb(est.activation_bytes));
    match &template {
        Some(Ok(())) => println!("  chat template  yes"),
        Some(Err(e)) => println!("  chat template  {e}"),
        None => {}
    }
    if !has_tokenizer {
        println!("  tokenizer      MISSING: no tokenizer.json beside the weights, which every run needs");
    } else {
        println!("  tokenizer      {} (estimate, from its file)", mb(est.tokenizer_bytes));
    }
    if est.available_bytes == 0 {
        println!("  total          {} (the backend reports no free memory figure)", mb(est.total_bytes));
    } else {
        println!(
            "  total          {} of {} available: {}",
            mb(est.total_bytes),
            mb(est.available_bytes),
            match (est.fits, has_tokenizer) {
                (true, true) => "fits",
                (true, false) => "fits (but see the tokenizer line)",
                (false, _) => "does NOT fit",
            }
        );
    }
    Ok(())
}
