//! A loaded model ready to step: the family's model, the backend context, the weights bound as device
//! buffers (zero-copy from the mmap on CPU) and the paged KV cache. `forward` runs one batch step:
//! host bookkeeping → family graph → backend compute → logits.

use std::path::Path;

use anyhow::{bail, Context, Result};
use mlxcel_plugin_api::{
    BlockCopy, BufferHandle, ComputeArgs, DType, HostTensor, KvBinding, KvCacheDesc, KvGroupTables, KvKind, Node,
    OpCode, StepBatch, StepDesc, Task, Versioned, NO_BLOCK, TOPK_INDICES, TOPK_VALUES,
};
use mlxcel_plugins::{
    BackendContext, BackendPlugin, Catalog, DeviceBuffer, FamilyModel, FamilyPlugin, ModelInfo, SelectError,
};

use super::kv_cache::{KvCache, SeqBlocks};
use super::kv_plan::{KvCacheType, KvCacheTypes, KvPlan};
use crate::checkpoint::sentence_transformers::PoolingFlag;
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
    /// Sequences that may be in flight together (the KV pool holds `ctx_size * parallel` tokens, and
    /// there are as many rows of recurrent state).
    pub parallel: usize,
    /// Full contexts the KV pool holds when fewer than `parallel` (shared by the sequences:
    /// llama-server's unified KV); `None`: `parallel`.
    pub kv_pool_seqs: Option<usize>,
    pub block_size: usize,
    /// Most tokens one sequence brings to a step (the prefill chunk): a sliding-window group holds
    /// the window plus one such chunk per sequence.
    pub max_step_tokens: usize,
    /// Serve the model as an embedding model whatever its files say (llama-server's `--embedding`),
    /// pooled as given or as its sentence-transformers files (else its family) say.
    pub embedding: Option<EmbeddingFlags>,
    /// What the K and V caches keep their values in; `None`: [`KvCacheTypes::DEFAULT`] where the
    /// backend keeps it, else f32.
    pub cache_types: Option<KvCacheTypes>,
    /// Keep the sliding-window layers' KV for the whole context, as full-attention layers keep it
    /// (llama-server's `--swa-full`): more memory, and a prefix cache that works past the window
    /// (pages a window would let go are what a later prompt reuses). The layers still attend only
    /// within their window.
    pub swa_full: bool,
}

/// llama-server's `--embedding` and `--pooling`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct EmbeddingFlags {
    pub pooling: Option<PoolingFlag>,
}

impl Default for RunnerOptions {
    fn default() -> Self {
        RunnerOptions {
            backend: None,
            threads: 0,
            ctx_size: 4096,
            parallel: 1,
            kv_pool_seqs: None,
            block_size: 16,
            max_step_tokens: 512,
            embedding: None,
            cache_types: None,
            swa_full: false,
        }
    }
}

/// Which logits a chunk wants.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Logits {
    None,
    Last,
    All,
}

/// What a step brings back of each wanted row.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RowsWanted {
    /// The whole row (`output_dim` values: logits, an embedding, scores).
    Full,
    /// Only the `k` largest logits and their token ids, selected on the backend (a text model's logits
    /// then never leave the device): what greedy decoding and top-k sampling need.
    Top(usize),
}

/// The rows a step brought back, in chunk order.
#[derive(Debug, Clone, PartialEq)]
pub enum StepRows {
    /// `[rows, output_dim]`.
    Full(Vec<f32>),
    /// `[rows, k]` each: per row the `k` largest logits, best first (equal values: the lower id first).
    Top { k: usize, ids: Vec<u32>, values: Vec<f32> },
}

impl StepRows {
    /// Number of rows.
    pub fn rows(&self, output_dim: usize) -> usize {
        match self {
            StepRows::Full(v) => v.len() / output_dim.max(1),
            StepRows::Top { k, ids, .. } => ids.len() / (*k).max(1),
        }
    }

    /// The whole rows, or an error saying that only a top-k came back.
    pub fn into_full(self) -> Result<Vec<f32>> {
        match self {
            StepRows::Full(v) => Ok(v),
            StepRows::Top { .. } => bail!("internal: a step asked for whole rows brought back a top-k"),
        }
    }

    /// `want` of whole rows computed on the host (what a backend's top-k gives, in the same order):
    /// for models that have no backend, such as the scheduler's test model.
    pub fn select(full: Vec<f32>, output_dim: usize, want: RowsWanted) -> StepRows {
        let RowsWanted::Top(k) = want else { return StepRows::Full(full) };
        let k = k.clamp(1, output_dim.max(1));
        let (mut ids, mut values) = (Vec::new(), Vec::new());
        for row in full.chunks_exact(output_dim) {
            let mut order: Vec<u32> = (0..output_dim as u32).collect();
            order.sort_by(|&a, &b| row[b as usize].total_cmp(&row[a as usize]).then(a.cmp(&b)));
            ids.extend_from_slice(&order[..k]);
            values.extend(order[..k].iter().map(|&i| row[i as usize]));
        }
        StepRows::Top { k, ids, values }
    }
}

/// One sequence's share of a step: `tokens` placed at positions `start_pos..`.
pub struct SeqChunk<'a> {
    pub blocks: &'a SeqBlocks,
    pub tokens: &'a [u32],
    pub start_pos: usize,
    pub logits: Logits,
}

/// The state buffers of one layer and the KV group it reads its block tables from.
struct LayerState {
    k: Option<DeviceBuffer>,
    v: Option<DeviceBuffer>,
    /// How `k` and `v` were allocated (for copying their blocks).
    kv_desc: Option<(KvCacheDesc, KvCacheDesc)>,
    state: Option<DeviceBuffer>,
    group: u32,
    state_elems: usize,
}

/// The host memory of one step, which the backend reads (inputs, block tables, the graph when the host
/// extended it) and writes (outputs) until the step is waited for. Boxed, so the addresses handed to
/// the backend stay put.
#[derive(Default)]
struct StepBuffers {
    tokens: Vec<i32>,
    positions: Vec<i32>,
    rows: Vec<i32>,
    token_seq: Vec<u32>,
    token_seq_i32: Vec<i32>,
    types: Vec<i32>,
    feature_rows: Vec<f32>,
    seq_n_features: Vec<u32>,
    seq_n_tokens: Vec<u32>,
    seq_context: Vec<u32>,
    state_slots: Vec<u32>,
    slots: Vec<Vec<i64>>,
    tables: Vec<Vec<u32>>,
    inputs: Vec<HostTensor>,
    kv: Vec<KvBinding>,
    groups: Vec<KvGroupTables>,
    batch: Option<StepBatch>,
    /// The family's graph with the top-k nodes appended (empty when it runs as the family built it).
    nodes: Vec<Node>,
    graph_outputs: Vec<u32>,
    outputs: Vec<HostTensor>,
    /// Whole rows, or the top-k values.
    out: Vec<f32>,
    /// The top-k ids (as exact f32 integers, what `TopK` writes).
    top_ids: Vec<f32>,
    top_k: Option<usize>,
}

/// Everything that lives on the backend: its context, the weights bound to it and the caches.
struct DeviceState {
    // Field order is drop order: buffers go before the context.
    layers: Vec<LayerState>,
    /// Owns the device buffers behind `weight_handles` (freed on drop).
    #[allow(dead_code)]
    weights: Vec<Option<DeviceBuffer>>,
    /// `weights` as the raw handles `compute` takes (null where unused), built once.
    weight_handles: Vec<BufferHandle>,
    backend: BackendContext,
    kv_bytes: u64,
    cache_types: KvCacheTypes,
}

impl DeviceState {
    /// A fresh context with the weights bound (zero-copy where the device can) and the caches of `plan`.
    fn bind(
        plugin: &BackendPlugin,
        threads: u32,
        checkpoint: &Checkpoint,
        info: &ModelInfo,
        plan: &KvPlan,
        cache_types: Option<KvCacheTypes>,
    ) -> Result<DeviceState> {
        let mut backend = plugin.create(threads, 0)?;
        let cache_types = choose_cache_types(plugin, &mut backend, cache_types)?;
        let mut weights: Vec<Option<DeviceBuffer>> = (0..checkpoint.tensors.len()).map(|_| None).collect();
        for &i in &info.used_weights {
            let t = checkpoint
                .tensors
                .get(i as usize)
                .with_context(|| format!("family referenced weight {i}, which does not exist"))?;
            // SAFETY: the mapping lives in the runner's `checkpoint`, which outlives this state.
            let buf = unsafe { backend.buffer_from_host(checkpoint.bytes(t)) }?;
            weights[i as usize] = Some(buf);
        }
        let mut layers = Vec::with_capacity(info.kv_layers.len());
        let mut kv_bytes = 0u64;
        for (l, group) in info.kv_layers.iter().zip(&plan.layer_group) {
            let mut st =
                LayerState { k: None, v: None, kv_desc: None, state: None, group: 0, state_elems: l.state_elems };
            match (l.kind, group) {
                (KvKind::Full | KvKind::SlidingWindow, Some(group)) => {
                    st.group = *group;
                    let desc = |t: KvCacheType| KvCacheDesc {
                        num_blocks: plan.blocks_per_group[st.group as usize] as u32,
                        block_size: plan.block_size as u32,
                        n_kv_heads: l.n_kv_heads as u32,
                        head_dim: l.head_dim as u32,
                        dtype: t.dtype() as u32,
                        ..KvCacheDesc::zeroed()
                    };
                    let (dk, dv) = (desc(cache_types.k), desc(cache_types.v));
                    let (k, v) = (backend.kv_alloc(&dk)?, backend.kv_alloc(&dv)?);
                    kv_bytes += (k.len() + v.len()) as u64;
                    (st.k, st.v, st.kv_desc) = (Some(k), Some(v), Some((dk, dv)));
                }
                (KvKind::Recurrent, _) => {
                    let state = backend.alloc(plan.state_slots * l.state_elems * 4)?;
                    kv_bytes += state.len() as u64;
                    st.state = Some(state);
                }
                _ => {}
            }
            layers.push(st);
        }
        let weight_handles = weights.iter().map(|w| w.as_ref().map_or(std::ptr::null_mut(), |b| b.handle())).collect();
        Ok(DeviceState { layers, weights, weight_handles, backend, kv_bytes, cache_types })
    }
}

/// The cache types to allocate: the ones asked for (refused with the backend's reason if it does not
/// keep them), or by default f16 where the backend keeps it and f32 where it does not. Types are tried
/// on a one-slot cache, so nothing large is allocated twice.
fn choose_cache_types(
    plugin: &BackendPlugin,
    backend: &mut BackendContext,
    asked: Option<KvCacheTypes>,
) -> Result<KvCacheTypes> {
    let keeps = |backend: &mut BackendContext, t: KvCacheType| {
        let desc = KvCacheDesc {
            num_blocks: 1,
            block_size: 1,
            n_kv_heads: 1,
            head_dim: 8,
            dtype: t.dtype() as u32,
            ..KvCacheDesc::zeroed()
        };
        backend.kv_alloc(&desc).map(drop)
    };
    let Some(types) = asked else {
        let default = KvCacheTypes::DEFAULT;
        return Ok(match keeps(backend, default.k).and_then(|()| keeps(backend, default.v)) {
            Ok(()) => default,
            Err(e) => {
                tracing::info!("backend `{}` keeps no {default} KV cache ({}): using f32", plugin.name(), e.message);
                KvCacheTypes::F32
            }
        });
    };
    if types.k != types.v && plugin.meta.abi_minor < 3 {
        bail!(
            "backend `{}` (ABI {}.{}) keeps K and V in one type; give --cache-type-k and --cache-type-v the same type",
            plugin.name(),
            plugin.meta.abi_major,
            plugin.meta.abi_minor
        );
    }
    for (which, t) in [("k", types.k), ("v", types.v)] {
        keeps(backend, t).map_err(|e| anyhow::anyhow!("--cache-type-{which} {t}: {}", e.message))?;
    }
    Ok(types)
}

pub struct ModelRunner {
    // Field order is drop order: device buffers go before the mapped files they view, and the context
    // (which waits for a graph in flight) before the host memory that graph reads and writes.
    device: DeviceState,
    /// The step `submit` started and `wait` has not collected: the host memory its graph reads and
    /// writes, kept here until it is done.
    in_flight: Option<Box<StepBuffers>>,
    model: FamilyModel,
    family: FamilyPlugin,
    backend_plugin: BackendPlugin,
    threads: u32,
    plan: KvPlan,
    /// Bumped whenever the device state was rebuilt (after a plugin panic): every cached KV page and
    /// state row of an older epoch is gone, and sequences holding them must start over.
    pub state_epoch: u64,
    pub checkpoint: Checkpoint,
    pub info: ModelInfo,
    /// Block accounting of every KV group and the recurrent-state rows.
    pub pool: KvCache,
    pub ctx_size: usize,
    max_blocks_per_seq: usize,
    /// Node kinds the backend said it runs (op, dtype, integer parameters). Looked up for every node
    /// of every step's graph: a fast hash (SipHash made this ~1% of a decode step).
    supported_ops: rustc_hash::FxHashSet<(u32, u32, [i64; mlxcel_plugin_api::MAX_IPARAMS])>,
    pub family_name: String,
    pub backend_name: String,
    pub backend_features: String,
    /// Free memory of the device when the model was loaded (the backend's report; 0 = unknown).
    pub device_free_memory: u64,
    /// State rows [`ModelRunner::copy_state_rows`] filled for the next step: not cleared when their
    /// sequence starts at position 0 in it.
    seeded_state: Vec<u32>,
}

/// The family that claims `checkpoint` (by its config; families also recognise configs without a
/// `model_type`, such as older Whisper conversions) and the model it makes of it, weights not bound.
pub(crate) fn family_model<'c>(
    catalog: &'c Catalog,
    checkpoint: &Checkpoint,
) -> Result<(&'c FamilyPlugin, FamilyModel)> {
    let family = match checkpoint.model_type() {
        Some(model_type) => catalog.select_family(&checkpoint.config_text, model_type)?,
        None => catalog.select_family(&checkpoint.config_text, "").map_err(|e| {
            let available = match e {
                SelectError::UnknownArchitecture { available, .. } => available,
                other => other.to_string(),
            };
            anyhow::anyhow!(
                "{}: config.json has no `model_type`, and no installed family recognises its config \
                 (installed architectures: {available})",
                checkpoint.dir.display()
            )
        })?,
    };
    let infos = checkpoint.weight_infos()?;
    let model = family
        .create_model(&checkpoint.config_text, &infos)
        .map_err(|e| anyhow::anyhow!("{}: {}", checkpoint.dir.display(), e.message))?;
    Ok((family, model))
}

/// The context a sequence gets for `requested` tokens (`-c`): 0 is the model's whole context
/// (`max_positions`), and no more than that is ever taken.
pub fn fitted_context(requested: usize, max_positions: usize) -> usize {
    match requested {
        0 => max_positions,
        n => n.min(max_positions.max(1)),
    }
}

/// Says so where an asked-for `-c` is over the model's maximum, which [`fitted_context`] cuts it to
/// (llama.cpp keeps such a context and warns of overflow; positions past the maximum were never
/// trained).
pub fn warn_if_context_cut(asked: Option<usize>, max_positions: usize) {
    if let Some(n) = asked.filter(|&n| n > max_positions) {
        tracing::warn!("-c {n} is over the model's maximum context ({max_positions} tokens); using {max_positions}");
    }
}

impl ModelRunner {
    /// Loads a text-generation model (anything else is refused by name).
    pub fn load(catalog: &Catalog, dir: &Path, opts: &RunnerOptions) -> Result<ModelRunner> {
        Self::load_for(catalog, dir, opts, &[Task::Text])
    }

    /// Loads a model whose task is one of `tasks`.
    pub fn load_for(catalog: &Catalog, dir: &Path, opts: &RunnerOptions, tasks: &[Task]) -> Result<ModelRunner> {
        let checkpoint = Checkpoint::open(dir)?;
        Self::from_checkpoint_for(catalog, checkpoint, opts, tasks)
    }

    pub fn from_checkpoint(catalog: &Catalog, checkpoint: Checkpoint, opts: &RunnerOptions) -> Result<ModelRunner> {
        Self::from_checkpoint_for(catalog, checkpoint, opts, &[Task::Text])
    }

    /// What the model in `checkpoint` is for (text, embeddings, speech…), as the family that claims it
    /// says — without binding its weights, so a caller can choose how to serve it before loading it.
    pub fn task_of(catalog: &Catalog, checkpoint: &Checkpoint) -> Result<Task> {
        Ok(family_model(catalog, checkpoint)?.1.info().task)
    }

    pub fn from_checkpoint_for(
        catalog: &Catalog,
        mut checkpoint: Checkpoint,
        opts: &RunnerOptions,
        tasks: &[Task],
    ) -> Result<ModelRunner> {
        if let Some(e) = opts.embedding {
            checkpoint.serve_as_embedding(e.pooling);
        }
        let (family, model) = family_model(catalog, &checkpoint)?;
        let backend_plugin = catalog.select_backend(opts.backend.as_deref())?;
        let mut info = model.info().clone();
        if opts.swa_full {
            // Planned (and estimated) as full-attention KV; the graph's attention keeps its window.
            let mut windowed = info.kv_layers.iter_mut().filter(|l| l.kind == KvKind::SlidingWindow).peekable();
            if windowed.peek().is_none() {
                tracing::warn!("--swa-full: this model has no sliding-window layers; it changes nothing");
            }
            for l in windowed {
                l.kind = KvKind::Full;
            }
        }
        if opts.embedding.is_some() && info.task == Task::Rerank {
            bail!(
                "{}: this {} model is a cross-encoder (a reranker): it scores (query, document) pairs and has no \
                 embedding to give; serve it without --embedding / --pooling (/v1/rerank)",
                checkpoint.dir.display(),
                info.architecture
            );
        }
        if opts.embedding.is_some() && info.task != Task::Embed {
            bail!(
                "{}: the `{}` family cannot run this {} model as an embedding model (--embedding / --pooling \
                 work with the llama family's decoders and the bert family's encoders)",
                checkpoint.dir.display(),
                family.name(),
                info.architecture
            );
        }
        if !tasks.contains(&info.task) {
            bail!("{}", task_refusal(&checkpoint.dir, info.task, tasks));
        }
        let described = backend_plugin.describe();
        let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
        if cores > 0 && opts.threads as usize > cores {
            // A step's threads spin while it runs: more than the cores only take them from each other.
            tracing::warn!(
                "-t {} is more threads than this machine's {cores} cores; steps will be slower",
                opts.threads
            );
        }
        let ctx_size = fitted_context(opts.ctx_size, info.max_positions);
        let pool_seqs = opts.kv_pool_seqs.unwrap_or(opts.parallel);
        let plan = KvPlan::new(&info, ctx_size, opts.block_size, opts.parallel, opts.max_step_tokens, pool_seqs);
        let pool = KvCache::new(&plan.windows, &plan.blocks_per_group, plan.block_size, plan.state_slots);
        let device = DeviceState::bind(backend_plugin, opts.threads, &checkpoint, &info, &plan, opts.cache_types)?;
        Ok(ModelRunner {
            backend_name: device.backend.name().to_string(),
            device,
            in_flight: None,
            model,
            family: family.clone(),
            backend_plugin: backend_plugin.clone(),
            threads: opts.threads,
            max_blocks_per_seq: plan.max_blocks_per_seq,
            plan,
            state_epoch: 0,
            family_name: family.name().to_string(),
            device_free_memory: described.devices.first().map_or(0, |d| d.free_memory_bytes),
            seeded_state: Vec::new(),
            backend_features: described.features,
            checkpoint,
            info,
            pool,
            ctx_size,
            supported_ops: Default::default(),
        })
    }

    /// Bytes of KV and state memory the backend allocated for this model's caches.
    pub fn kv_bytes(&self) -> u64 {
        self.device.kv_bytes
    }

    /// After a panic inside a plugin the context (or the model) is poisoned: build fresh ones, bind the
    /// weights again and reallocate the caches. Cached KV and state are lost: the block accounting is
    /// reset and [`ModelRunner::state_epoch`] moves on, so sequences know to start over.
    pub fn rebuild_after_panic(&mut self) -> Result<()> {
        tracing::warn!("a plugin panicked: rebuilding the `{}` backend context and the model", self.backend_name);
        let infos = self.checkpoint.weight_infos()?;
        self.model = self.family.create_model(&self.checkpoint.config_text, &infos)?;
        let types = Some(self.device.cache_types);
        self.device =
            DeviceState::bind(&self.backend_plugin, self.threads, &self.checkpoint, &self.info, &self.plan, types)?;
        let p = &self.plan;
        self.pool = KvCache::new(&p.windows, &p.blocks_per_group, p.block_size, p.state_slots);
        self.supported_ops.clear();
        self.state_epoch += 1;
        Ok(())
    }

    /// Bytes of KV cache per token of context (all layers, K and V, in the caches' types).
    pub fn kv_bytes_per_token(&self) -> usize {
        let types = self.device.cache_types;
        self.info
            .kv_layers
            .iter()
            .filter(|l| matches!(l.kind, KvKind::Full | KvKind::SlidingWindow))
            .map(|l| types.bytes_per_token(l.n_kv_heads, l.head_dim))
            .sum()
    }

    /// What the K and V caches keep their values in.
    pub fn cache_types(&self) -> KvCacheTypes {
        self.device.cache_types
    }

    /// One throwaway step — token 0 at position 0 of a sequence of its own, whose pages (and state
    /// row) are released after it — so that what a backend does once, on the first step that reads
    /// each weight (the CPU backend's panel copies, the first touch of the mapped checkpoint), is not
    /// paid by the first request: llama-server's warm-up.
    pub fn warm_up(&mut self) -> Result<()> {
        let mut seq = SeqBlocks::default();
        self.pool.reserve(&mut seq, 1).map_err(|e| anyhow::anyhow!("warm-up step: {e}"))?;
        let result = self.forward(&[SeqChunk { blocks: &seq, tokens: &[0], start_pos: 0, logits: Logits::Last }]);
        self.pool.release(&mut seq);
        result.map(drop)
    }

    /// Runs one step over `chunks` (each chunk's blocks must already cover its positions, see
    /// [`KvCache::reserve`]) and returns the requested output rows, `[rows, output_dim]`, in chunk order.
    pub fn forward(&mut self, chunks: &[SeqChunk]) -> Result<Vec<f32>> {
        self.forward_with_inputs(chunks, &[], &[], 0)
    }

    /// [`ModelRunner::forward`] with each chunk's token types (BERT's segment ids, the
    /// `INPUT_TOKEN_TYPES` input): `token_types[i]` has one entry per token of `chunks[i]`; chunks
    /// past its end (all of them when it is empty) have type 0 throughout.
    pub fn forward_with_types(&mut self, chunks: &[SeqChunk], token_types: &[&[u32]]) -> Result<Vec<f32>> {
        self.forward_with_inputs(chunks, token_types, &[], 0)
    }

    /// [`ModelRunner::forward`] where chunk `i` also brings `features[i]` (rows of `feature_dim`
    /// floats, e.g. log-mel frames for an encoder; empty or absent for none), bound as the
    /// `INPUT_FEATURES` input.
    pub fn forward_with_features(
        &mut self,
        chunks: &[SeqChunk],
        features: &[&[f32]],
        feature_dim: usize,
    ) -> Result<Vec<f32>> {
        self.forward_with_inputs(chunks, &[], features, feature_dim)
    }

    /// One step with every per-token and per-sequence input: token types and feature rows as in
    /// [`ModelRunner::forward_with_types`] and [`ModelRunner::forward_with_features`].
    fn forward_with_inputs(
        &mut self,
        chunks: &[SeqChunk],
        token_types: &[&[u32]],
        features: &[&[f32]],
        feature_dim: usize,
    ) -> Result<Vec<f32>> {
        self.submit_with_inputs(chunks, token_types, features, feature_dim, RowsWanted::Full)?;
        self.wait()?.into_full()
    }

    /// Starts one step over `chunks` on the backend and returns without waiting for it where the
    /// backend runs asynchronously (ABI 2.4); [`ModelRunner::wait`] collects `want` of each wanted row.
    /// The host may do work of its own in between that does not need the step's results.
    pub fn submit(&mut self, chunks: &[SeqChunk], want: RowsWanted) -> Result<()> {
        self.submit_with_inputs(chunks, &[], &[], 0, want)
    }

    /// The rows of the step [`ModelRunner::submit`] started, in chunk order.
    pub fn wait(&mut self) -> Result<StepRows> {
        let Some(step) = self.in_flight.take() else { bail!("internal: no step in flight") };
        if let Err(e) = self.device.backend.wait() {
            return Err(self.after_plugin_error(e));
        }
        let StepBuffers { out, top_ids, top_k, .. } = *step;
        Ok(match top_k {
            Some(k) => StepRows::Top { k, ids: top_ids.iter().map(|&i| i as u32).collect(), values: out },
            None => StepRows::Full(out),
        })
    }

    fn submit_with_inputs(
        &mut self,
        chunks: &[SeqChunk],
        token_types: &[&[u32]],
        features: &[&[f32]],
        feature_dim: usize,
        want: RowsWanted,
    ) -> Result<()> {
        if self.in_flight.is_some() {
            bail!("internal: a step was submitted before the last one was waited for");
        }
        // Seeded rows hold for this step only, whatever becomes of it.
        let seeded = std::mem::take(&mut self.seeded_state);
        let mut b = Box::new(StepBuffers::default());
        b.seq_n_features = vec![0u32; chunks.len()];
        for (i, f) in features.iter().enumerate().filter(|(_, f)| !f.is_empty()) {
            if i >= chunks.len() || feature_dim == 0 || f.len() % feature_dim != 0 {
                bail!("internal: {} feature values for sequence {i} are not rows of {feature_dim}", f.len());
            }
            b.seq_n_features[i] = (f.len() / feature_dim) as u32;
            b.feature_rows.extend_from_slice(f);
        }
        let bs = self.pool.block_size;
        let n_groups = self.pool.groups().len();
        let mut slots: Vec<Vec<i64>> = vec![Vec::new(); n_groups];
        let mut tables = vec![vec![NO_BLOCK; chunks.len() * self.max_blocks_per_seq]; n_groups];
        for (s, c) in chunks.iter().enumerate() {
            let end = c.start_pos + c.tokens.len();
            if end > self.ctx_size {
                bail!("context of {end} tokens exceeds the context size {}", self.ctx_size);
            }
            for (g, table) in tables.iter_mut().enumerate() {
                let held = self.pool.table(c.blocks, g);
                if held.len() * bs < end || held.len() > self.max_blocks_per_seq {
                    bail!("internal: sequence blocks do not cover position {end}");
                }
                table[s * self.max_blocks_per_seq..][..held.len()].copy_from_slice(held);
            }
            if self.pool.state_slots > 0 {
                let slot = c.blocks.state_slot().context("internal: sequence has no recurrent state row")?;
                if c.start_pos == 0 && !seeded.contains(&slot) {
                    self.clear_state_row(slot)?;
                }
                b.state_slots.push(slot);
            } else {
                b.state_slots.push(0);
            }
            match token_types.get(s) {
                Some(types) if types.len() != c.tokens.len() => {
                    bail!("internal: {} token types for {} tokens", types.len(), c.tokens.len())
                }
                Some(types) => b.types.extend(types.iter().map(|&t| t as i32)),
                None => b.types.resize(b.types.len() + c.tokens.len(), 0),
            }
            b.seq_n_tokens.push(c.tokens.len() as u32);
            b.seq_context.push(end as u32);
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
                    b.rows.push(b.tokens.len() as i32);
                }
                b.tokens.push(tok as i32);
                b.positions.push(pos as i32);
                b.token_seq.push(s as u32);
                for (g, slot) in slots.iter_mut().enumerate() {
                    let block = self.pool.table(c.blocks, g)[pos / bs];
                    if block == NO_BLOCK {
                        bail!("internal: position {pos} falls in a released page");
                    }
                    slot.push((block as usize * bs + pos % bs) as i64);
                }
            }
        }
        b.slots = slots;
        b.tables = tables;
        if b.tokens.is_empty() {
            // Nothing to compute: an empty step that `wait` hands back as it is.
            b.top_k = match want {
                RowsWanted::Top(k) => Some(k),
                RowsWanted::Full => None,
            };
            self.in_flight = Some(b);
            return Ok(());
        }
        let step = StepDesc {
            n_tokens: b.tokens.len() as u32,
            n_seqs: chunks.len() as u32,
            n_output_rows: b.rows.len() as u32,
            seq_n_tokens: b.seq_n_tokens.as_ptr(),
            seq_context: b.seq_context.as_ptr(),
            n_feature_rows: b.seq_n_features.iter().sum(),
            seq_n_features: b.seq_n_features.as_ptr(),
            ..StepDesc::zeroed()
        };
        let family_graph = match self.model.build_graph(&step) {
            Ok(g) => g,
            Err(e) => return Err(self.after_plugin_error(e)),
        };
        self.check_supported(&family_graph)?;
        let n_rows = b.rows.len();
        let graph = match want {
            RowsWanted::Top(k) => self.with_top_k(&family_graph, n_rows, k, &mut b),
            RowsWanted::Full => None,
        };
        let graph = match graph {
            Some(g) => g,
            None => {
                b.out = vec![0f32; n_rows * self.info.output_dim];
                family_graph
            }
        };
        b.outputs = vec![HostTensor { ptr: b.out.as_mut_ptr() as *mut u8, len: b.out.len() * 4 }];
        if b.top_k.is_some() {
            b.outputs.push(HostTensor { ptr: b.top_ids.as_mut_ptr() as *mut u8, len: b.top_ids.len() * 4 });
        }

        let host = |p: *const u8, len: usize| HostTensor { ptr: p as *mut u8, len };
        b.token_seq_i32 = b.token_seq.iter().map(|&s| s as i32).collect();
        b.inputs = vec![
            host(b.tokens.as_ptr() as *const u8, b.tokens.len() * 4),
            host(b.positions.as_ptr() as *const u8, b.positions.len() * 4),
            host(b.rows.as_ptr() as *const u8, b.rows.len() * 4),
            host(b.token_seq_i32.as_ptr() as *const u8, b.token_seq_i32.len() * 4),
            host(b.types.as_ptr() as *const u8, b.types.len() * 4),
            host(b.feature_rows.as_ptr() as *const u8, b.feature_rows.len() * 4),
        ];
        let handle = |b: &Option<DeviceBuffer>| b.as_ref().map_or(std::ptr::null_mut(), |b| b.handle());
        let types = self.device.cache_types;
        b.kv = self
            .device
            .layers
            .iter()
            .map(|l| KvBinding {
                k: handle(&l.k),
                v: handle(&l.v),
                dtype: types.k.dtype() as u32,
                v_dtype: types.v.dtype() as u32,
                group: l.group,
                state: handle(&l.state),
                ..KvBinding::zeroed()
            })
            .collect();
        b.groups = self
            .pool
            .groups()
            .iter()
            .enumerate()
            .map(|(g, grp)| KvGroupTables {
                slot_mapping: b.slots[g].as_ptr(),
                block_tables: b.tables[g].as_ptr(),
                max_blocks_per_seq: self.max_blocks_per_seq as u32,
                block_size: bs as u32,
                num_blocks: grp.pool.num_blocks as u32,
                ..KvGroupTables::zeroed()
            })
            .collect();
        b.batch = Some(StepBatch {
            n_tokens: b.tokens.len() as u32,
            n_seqs: chunks.len() as u32,
            token_seq: b.token_seq.as_ptr(),
            positions: b.positions.as_ptr(),
            seq_state_slots: b.state_slots.as_ptr(),
            groups: b.groups.as_ptr(),
            n_groups: b.groups.len() as u32,
            seq_n_tokens: b.seq_n_tokens.as_ptr(),
            ..StepBatch::zeroed()
        });
        let args = ComputeArgs {
            graph,
            inputs: b.inputs.as_ptr(),
            n_inputs: b.inputs.len(),
            weights: self.device.weight_handles.as_ptr(),
            n_weights: self.device.weight_handles.len(),
            kv: b.kv.as_ptr(),
            n_kv: b.kv.len(),
            batch: b.batch.as_ref().map_or(std::ptr::null(), |batch| batch as *const StepBatch),
            outputs: b.outputs.as_ptr(),
            n_outputs: b.outputs.len(),
            ..ComputeArgs::zeroed()
        };
        // SAFETY: every pointer above is into `b` (boxed: the batch keeps its address) or this runner's
        // device state and family model, all of which stay put until `wait` (or the context's drop,
        // which waits) — `b` is kept in `in_flight` meanwhile; sizes match the step; every buffer
        // belongs to this runner's context.
        if let Err(e) = unsafe { self.device.backend.submit(&args) } {
            return Err(self.after_plugin_error(e));
        }
        self.in_flight = Some(b);
        Ok(())
    }

    /// `graph` with its logits output replaced by their top `k` (values and ids, two outputs), selected
    /// on the backend; `None` (whole rows, then) when the graph's output is not a logits row or the
    /// backend cannot select. Sizes `b`'s outputs for the top-k.
    fn with_top_k(
        &mut self,
        graph: &mlxcel_plugin_api::GraphRef,
        n_rows: usize,
        k: usize,
        b: &mut StepBuffers,
    ) -> Option<mlxcel_plugin_api::GraphRef> {
        if self.info.task != Task::Text || graph.n_outputs != 1 {
            return None;
        }
        // SAFETY: the graph lives until the next `build_graph` on this model.
        let (nodes, outputs) = unsafe { (graph.nodes().into_owned(), graph.outputs().to_vec()) };
        let logits = outputs[0];
        let vocab = nodes.get(logits as usize)?.cols();
        if vocab != self.info.output_dim {
            return None;
        }
        let k = k.clamp(1, vocab);
        let top = |which: i64| {
            let mut n = Node::new(OpCode::TopK, DType::F32, &[n_rows as u64, k as u64], &[logits]);
            n.iparams[0] = k as i64;
            n.iparams[1] = which;
            n
        };
        let (values, ids) = (top(TOPK_VALUES), top(TOPK_INDICES));
        if !self.device.backend.supports(&values) || !self.device.backend.supports(&ids) {
            return None;
        }
        b.nodes = nodes;
        b.nodes.push(values);
        b.nodes.push(ids);
        let n = b.nodes.len() as u32;
        b.graph_outputs = vec![n - 2, n - 1];
        b.out = vec![0f32; n_rows * k];
        b.top_ids = vec![0f32; n_rows * k];
        b.top_k = Some(k);
        Some(mlxcel_plugin_api::GraphRef {
            nodes: b.nodes.as_ptr(),
            n_nodes: b.nodes.len(),
            node_size: std::mem::size_of::<Node>(),
            outputs: b.graph_outputs.as_ptr(),
            n_outputs: b.graph_outputs.len(),
            ..*graph
        })
    }

    /// A plugin call failed: after a panic, rebuild what it may have left half-written (the error is
    /// still returned, saying what happened to the cached state).
    fn after_plugin_error(&mut self, e: mlxcel_plugins::CallError) -> anyhow::Error {
        if e.status != mlxcel_plugin_api::Status::PANIC.0 {
            return e.into();
        }
        match self.rebuild_after_panic() {
            Ok(()) => anyhow::anyhow!("{e} (the backend context and model were rebuilt; cached context was dropped)"),
            Err(r) => anyhow::anyhow!("{e}; rebuilding after it failed too: {r:#}"),
        }
    }

    /// Asks the backend about every kind of node the family emits (once per op, dtype and integer
    /// parameters), so a graph the backend cannot run fails with the op's name before it runs.
    fn check_supported(&mut self, graph: &mlxcel_plugin_api::GraphRef) -> Result<()> {
        // SAFETY: the graph lives until the next `build_graph` on this model.
        let nodes = unsafe { graph.nodes() };
        for n in nodes.iter() {
            let key = (n.op, n.dtype, n.iparams);
            if self.supported_ops.contains(&key) {
                continue;
            }
            if !self.device.backend.supports(n) {
                let op = n.opcode().map_or_else(|| format!("op {}", n.op), |o| format!("{o:?}"));
                bail!(
                    "backend `{}` cannot run {op} ({}, parameters {:?}) that the `{}` family needs; try another \
                     --backend",
                    self.backend_name,
                    n.dtype().name(),
                    n.iparams,
                    self.family_name
                );
            }
            self.supported_ops.insert(key);
        }
        Ok(())
    }

    /// Zeroes one sequence's row of every recurrent state buffer (a new sequence starts from zero).
    fn clear_state_row(&mut self, slot: u32) -> Result<()> {
        let dev = &mut self.device;
        for l in &mut dev.layers {
            if let Some(state) = &mut l.state {
                let row = l.state_elems * 4;
                dev.backend.write(state, slot as usize * row, &vec![0u8; row])?;
            }
        }
        Ok(())
    }

    /// State row `slot` of KV layer `layer` (a [`KvKind::Recurrent`] layer: recurrent state, or the
    /// cross-attention keys and values an encoder stored for a sequence), read back from the device as
    /// f32 values. For tests and inspection; decoding never reads state on the host.
    pub fn read_state_row(&mut self, layer: usize, slot: u32) -> Result<Vec<f32>> {
        let DeviceState { layers, backend, .. } = &mut self.device;
        let l = layers.get(layer).with_context(|| format!("the model has no KV layer {layer}"))?;
        let state = l.state.as_ref().with_context(|| format!("KV layer {layer} keeps no state rows"))?;
        let row = l.state_elems * 4;
        let mut bytes = vec![0u8; row];
        backend.read(state, slot as usize * row, &mut bytes)?;
        Ok(bytes.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect())
    }

    /// Whether [`ModelRunner::copy_page`] can copy: the backend lays out its KV caches and copies their
    /// blocks (ABI 2.1).
    pub fn copies_pages(&self) -> bool {
        self.backend_plugin.owns_kv_layout() && self.backend_plugin.copies_kv_blocks()
    }

    /// Copies KV page `src` into page `dst` in every layer's K and V (a sequence taking the head of a
    /// cached page). Only between steps, and only where [`ModelRunner::copies_pages`].
    pub fn copy_page(&mut self, src: u32, dst: u32) -> Result<()> {
        anyhow::ensure!(self.copies_pages(), "backend `{}` cannot copy KV blocks", self.backend_plugin.name());
        anyhow::ensure!(self.in_flight.is_none(), "internal: a KV page copy while a step is in flight");
        let DeviceState { layers, backend, .. } = &mut self.device;
        let copy = [BlockCopy { src, dst }];
        for l in layers.iter_mut() {
            if let (Some(k), Some(v), Some((dk, dv))) = (&mut l.k, &mut l.v, &l.kv_desc) {
                backend.copy_blocks(k, dk, &copy)?;
                backend.copy_blocks(v, dv, &copy)?;
            }
        }
        Ok(())
    }

    /// Copies `from`'s state row into `to`'s in every layer that keeps state (both sequences hold a
    /// row, see [`KvCache::reserve`]): `to` starts where `from` is, e.g. several decoder sequences over
    /// the cross-attention keys and values one encoder pass stored. The copy is kept when `to` starts
    /// at position 0 in the next [`ModelRunner::forward`] (which otherwise clears its row), so that
    /// step must be the next one; after it, position 0 clears again.
    pub fn copy_state_rows(&mut self, from: &SeqBlocks, to: &SeqBlocks) -> Result<()> {
        let a = from.state_slot().context("internal: the source sequence has no state row")? as usize;
        let b = to.state_slot().context("internal: the target sequence has no state row")?;
        let DeviceState { layers, backend, .. } = &mut self.device;
        for l in layers.iter_mut() {
            if let Some(state) = &mut l.state {
                let row = l.state_elems * 4;
                let mut bytes = vec![0u8; row];
                backend.read(state, a * row, &mut bytes)?;
                backend.write(state, b as usize * row, &bytes)?;
            }
        }
        self.seeded_state.push(b);
        Ok(())
    }
}

/// Why a model of `task` cannot be loaded where `wanted` tasks are, and what to do instead.
fn task_refusal(dir: &Path, task: Task, wanted: &[Task]) -> String {
    let words = |t: &Task| match t {
        Task::Text => "a text-generation",
        Task::Embed => "an embedding",
        Task::Rerank => "a reranking (cross-encoder)",
        Task::Asr => "a speech-recognition",
        Task::Tts => "a text-to-speech",
    };
    let wanted: Vec<&str> = wanted.iter().map(words).collect();
    let instead = match task {
        Task::Embed => "; use `mlxcel embed` or serve it (`mlxcel serve`: /v1/embeddings)",
        Task::Rerank => "; use `mlxcel rerank` or serve it (`mlxcel serve`: /v1/rerank)",
        Task::Asr => "; use `mlxcel transcribe` or serve it (`mlxcel serve`: /v1/audio/transcriptions)",
        _ => "",
    };
    format!("{} is {} model; this needs {} model{instead}", dir.display(), words(&task), wanted.join(" or "))
}

// SAFETY: the only fields that are not `Send` are the raw handles in `weight_handles`, copies of the
// handles owned by `weights` (`DeviceBuffer`, which is `Send`); they move with their owners and are used
// only through `&mut self`. The batching engine moves the runner onto its own thread.
unsafe impl Send for ModelRunner {}
