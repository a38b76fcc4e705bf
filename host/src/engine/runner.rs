//! A loaded model ready to step: the family's model, the backend context, the weights bound as device
//! buffers (zero-copy from the mmap on CPU) and the paged KV cache. `forward` runs one batch step:
//! host bookkeeping → family graph → backend compute → logits.

use std::path::Path;

use anyhow::{bail, Context, Result};
use mlxcel_plugin_api::{
    AttentionBatch, BufferHandle, ComputeArgs, DType, HostTensor, KvBinding, KvKind, StepShape, Task,
};
use mlxcel_plugins::{BackendContext, Catalog, DeviceBuffer, FamilyModel, ModelInfo};

use super::kv_cache::{KvBlockPool, SeqBlocks};
use crate::checkpoint::Checkpoint;

/// How to load a model.
#[derive(Debug, Clone)]
pub struct RunnerOptions {
    /// Backend by name; `None` picks the best-scoring one.
    pub backend: Option<String>,
    /// Worker threads (0 = backend default).
    pub threads: u32,
    /// Longest context one sequence may reach (0 = the model's maximum).
    pub ctx_size: usize,
    /// Sequences that may be in flight together (the KV pool holds `ctx_size * parallel` tokens).
    pub parallel: usize,
    pub block_size: usize,
}

impl Default for RunnerOptions {
    fn default() -> Self {
        RunnerOptions { backend: None, threads: 0, ctx_size: 4096, parallel: 1, block_size: 16 }
    }
}

/// Which logits a chunk wants.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Logits {
    None,
    Last,
    All,
}

/// One sequence's share of a step: `tokens` placed at positions `start_pos..`.
pub struct SeqChunk<'a> {
    pub blocks: &'a SeqBlocks,
    pub tokens: &'a [u32],
    pub start_pos: usize,
    pub logits: Logits,
}

pub struct ModelRunner {
    // Field order is drop order: buffers go before the context and the mapped files they view.
    kv: Vec<(DeviceBuffer, DeviceBuffer)>,
    /// Owns the device buffers behind `weight_handles` (freed on drop).
    #[allow(dead_code)]
    weights: Vec<Option<DeviceBuffer>>,
    /// `weights` as the raw handles `compute` takes (null where unused), built once.
    weight_handles: Vec<BufferHandle>,
    model: FamilyModel,
    backend: BackendContext,
    pub checkpoint: Checkpoint,
    pub info: ModelInfo,
    pub pool: KvBlockPool,
    pub ctx_size: usize,
    max_blocks_per_seq: usize,
    pub family_name: String,
    pub backend_name: String,
    pub backend_features: String,
}

impl ModelRunner {
    pub fn load(catalog: &Catalog, dir: &Path, opts: &RunnerOptions) -> Result<ModelRunner> {
        let checkpoint = Checkpoint::open(dir)?;
        Self::from_checkpoint(catalog, checkpoint, opts)
    }

    pub fn from_checkpoint(catalog: &Catalog, checkpoint: Checkpoint, opts: &RunnerOptions) -> Result<ModelRunner> {
        let model_type = checkpoint
            .model_type()
            .with_context(|| format!("{}: config.json has no `model_type`", checkpoint.dir.display()))?
            .to_string();
        let family = catalog.select_family(&checkpoint.config_text, &model_type)?;
        let backend_plugin = catalog.select_backend(opts.backend.as_deref())?;

        let infos = checkpoint.weight_infos()?;
        let model = family
            .create_model(&checkpoint.config_text, &infos)
            .map_err(|e| anyhow::anyhow!("{}: {}", checkpoint.dir.display(), e.message))?;
        let info = model.info().clone();
        if info.task != Task::Text {
            bail!(
                "{} is a {} model; `run`/`generate` need a text-generation model",
                checkpoint.dir.display(),
                info.task.name()
            );
        }
        let described = backend_plugin.describe();
        let backend = backend_plugin.create(opts.threads, 0)?;

        let mut weights: Vec<Option<DeviceBuffer>> = (0..checkpoint.tensors.len()).map(|_| None).collect();
        for &i in &info.used_weights {
            let t = checkpoint
                .tensors
                .get(i as usize)
                .with_context(|| format!("family referenced weight {i}, which does not exist"))?;
            // SAFETY: the mapping lives in `checkpoint`, which outlives `weights` (field order).
            let buf = unsafe { backend.buffer_from_host(checkpoint.bytes(t)) }?;
            weights[i as usize] = Some(buf);
        }

        let ctx_size = match opts.ctx_size {
            0 => info.max_positions,
            n => n.min(info.max_positions.max(1)),
        };
        let block_size = opts.block_size.max(1);
        let max_blocks_per_seq = ctx_size.div_ceil(block_size);
        let num_blocks = max_blocks_per_seq * opts.parallel.max(1);
        let mut kv = Vec::with_capacity(info.kv_layers.len());
        for (i, l) in info.kv_layers.iter().enumerate() {
            if !matches!(l.kind, KvKind::Full | KvKind::SlidingWindow) {
                bail!("layer {i}: KV kind {:?} is not supported by this engine yet", l.kind);
            }
            let bytes = num_blocks * block_size * l.n_kv_heads * l.head_dim * 4;
            kv.push((backend.alloc(bytes)?, backend.alloc(bytes)?));
        }
        let weight_handles = weights.iter().map(|w| w.as_ref().map_or(std::ptr::null_mut(), |b| b.handle())).collect();
        Ok(ModelRunner {
            kv,
            weights,
            weight_handles,
            model,
            backend_name: backend.name().to_string(),
            backend,
            family_name: family.name().to_string(),
            backend_features: described.features,
            checkpoint,
            info,
            pool: KvBlockPool::new(num_blocks, block_size),
            ctx_size,
            max_blocks_per_seq,
        })
    }

    /// Bytes of KV cache per token of context (all layers, K and V).
    pub fn kv_bytes_per_token(&self) -> usize {
        self.info.kv_layers.iter().map(|l| 2 * l.n_kv_heads * l.head_dim * 4).sum()
    }

    /// Runs one step over `chunks` (each chunk's blocks must already cover its positions) and returns
    /// the requested logits rows, `[rows, vocab]`, in chunk order.
    pub fn forward(&mut self, chunks: &[SeqChunk]) -> Result<Vec<f32>> {
        let bs = self.pool.block_size;
        let mut tokens: Vec<i32> = Vec::new();
        let mut positions: Vec<i32> = Vec::new();
        let mut token_seq: Vec<u32> = Vec::new();
        let mut slots: Vec<i64> = Vec::new();
        let mut rows: Vec<i32> = Vec::new();
        let mut tables = vec![0u32; chunks.len() * self.max_blocks_per_seq];
        let mut max_context = 0usize;
        for (s, c) in chunks.iter().enumerate() {
            let end = c.start_pos + c.tokens.len();
            if end > self.ctx_size {
                bail!("context of {end} tokens exceeds the context size {}", self.ctx_size);
            }
            if c.blocks.blocks.len() * bs < end {
                bail!("internal: sequence blocks do not cover position {end}");
            }
            tables[s * self.max_blocks_per_seq..][..c.blocks.blocks.len()].copy_from_slice(&c.blocks.blocks);
            max_context = max_context.max(end);
            for (j, &tok) in c.tokens.iter().enumerate() {
                let pos = c.start_pos + j;
                if tok as usize >= self.info.vocab_size {
                    bail!("token id {tok} is outside the vocabulary ({})", self.info.vocab_size);
                }
                let wanted = match c.logits {
                    Logits::All => true,
                    Logits::Last => j + 1 == c.tokens.len(),
                    Logits::None => false,
                };
                if wanted {
                    rows.push(tokens.len() as i32);
                }
                tokens.push(tok as i32);
                positions.push(pos as i32);
                token_seq.push(s as u32);
                slots.push((c.blocks.blocks[pos / bs] as usize * bs + pos % bs) as i64);
            }
        }
        if tokens.is_empty() {
            return Ok(Vec::new());
        }
        let step = StepShape {
            n_tokens: tokens.len() as u32,
            n_seqs: chunks.len() as u32,
            n_logit_rows: rows.len() as u32,
            max_context: max_context as u32,
        };
        let graph = self.model.build_graph(step)?;
        let mut logits = vec![0f32; rows.len() * self.info.vocab_size];

        let host = |p: *const u8, len: usize| HostTensor { ptr: p as *mut u8, len };
        let inputs = [
            host(tokens.as_ptr() as *const u8, tokens.len() * 4),
            host(positions.as_ptr() as *const u8, positions.len() * 4),
            host(rows.as_ptr() as *const u8, rows.len() * 4),
        ];
        let kv: Vec<KvBinding> =
            self.kv.iter().map(|(k, v)| KvBinding { k: k.handle(), v: v.handle(), dtype: DType::F32 as u32 }).collect();
        let batch = AttentionBatch {
            n_tokens: tokens.len() as u32,
            n_seqs: chunks.len() as u32,
            token_seq: token_seq.as_ptr(),
            positions: positions.as_ptr(),
            slot_mapping: slots.as_ptr(),
            block_tables: tables.as_ptr(),
            max_blocks_per_seq: self.max_blocks_per_seq as u32,
            block_size: bs as u32,
            num_blocks: self.pool.num_blocks as u32,
        };
        let outputs = [HostTensor { ptr: logits.as_mut_ptr() as *mut u8, len: logits.len() * 4 }];
        let args = ComputeArgs {
            graph,
            inputs: inputs.as_ptr(),
            n_inputs: inputs.len(),
            weights: self.weight_handles.as_ptr(),
            n_weights: self.weight_handles.len(),
            kv: kv.as_ptr(),
            n_kv: kv.len(),
            batch: &batch,
            outputs: outputs.as_ptr(),
            n_outputs: outputs.len(),
        };
        // SAFETY: every pointer above lives until compute returns; sizes match the step shape.
        unsafe { self.backend.compute(&args) }?;
        Ok(logits)
    }
}

// SAFETY: the only fields that are not `Send` are the raw handles in `weight_handles`, copies of the
// handles owned by `weights` (`DeviceBuffer`, which is `Send`); they move with their owners and are used
// only through `&mut self`. The batching engine moves the runner onto its own thread.
unsafe impl Send for ModelRunner {}
