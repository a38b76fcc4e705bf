//! ModernBERT as an op graph: an encoder with pre-norm layers, rotary positions, a GeGLU feed-forward
//! and attention that alternates between global layers (every `global_attn_every_n_layers`-th, from
//! the first) and local ones, where a token sees the tokens within `local_attention / 2` on either
//! side. LayerNorms have no bias (`norm_bias: false`), linears none either (`attention_bias`,
//! `mlp_bias`); global and local layers rotate with their own RoPE base.
//!
//! `x = LayerNorm(tok_embeddings[id])`; per layer `x += Wo(attn(rope(q), rope(k), v))` over
//! `attn_norm(x)` (no norm in the first layer), `x += Wo(gelu(a) · g)` with `[a, g] = Wi(mlp_norm(x))`;
//! then `final_norm`, and sentence-transformers' pooling (mean for nomic's and most ModernBERT embedding
//! models, CLS for gte-modernbert).

use mlxcel_family_kit::embedding::{EmbeddingHead, Pooling};
use mlxcel_family_kit::{GraphWriter, Linear, UsedWeights, WeightRef, WeightTable};
use mlxcel_plugin_api::{
    DType, FamilyModel, Graph, ModelDescription, OpCode, OutputKind, PluginError, StepDesc, Task, TensorId,
    INPUT_POSITIONS, INPUT_TOKENS, INPUT_TOKEN_SEQ,
};
use serde::Deserialize;
use serde_json::Value;

#[derive(Debug, Clone, Deserialize)]
pub struct ModernBertConfig {
    pub model_type: String,
    #[serde(default)]
    pub architectures: Vec<String>,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub intermediate_size: usize,
    #[serde(default = "default_act")]
    pub hidden_activation: String,
    #[serde(default = "default_positions")]
    pub max_position_embeddings: usize,
    #[serde(default = "default_eps")]
    pub norm_eps: f32,
    #[serde(default)]
    pub norm_bias: bool,
    #[serde(default)]
    pub attention_bias: bool,
    #[serde(default)]
    pub mlp_bias: bool,
    #[serde(default = "default_every")]
    pub global_attn_every_n_layers: usize,
    #[serde(default = "default_local")]
    pub local_attention: usize,
    #[serde(default)]
    pub layer_types: Option<Vec<String>>,
    #[serde(default)]
    pub global_rope_theta: Option<f64>,
    #[serde(default)]
    pub local_rope_theta: Option<f64>,
    /// transformers 5: `{"full_attention": {"rope_theta": …}, "sliding_attention": {…}}`.
    #[serde(default)]
    pub rope_parameters: Option<Value>,
    #[serde(default)]
    pub quantization: Option<Value>,
    #[serde(default)]
    pub sentence_transformers: Option<Value>,
}

fn default_act() -> String {
    "gelu".into()
}
fn default_positions() -> usize {
    8192
}
fn default_eps() -> f32 {
    1e-5
}
fn default_every() -> usize {
    3
}
fn default_local() -> usize {
    128
}

impl ModernBertConfig {
    pub fn parse(json: &str) -> Result<ModernBertConfig, String> {
        let cfg: ModernBertConfig = serde_json::from_str(json).map_err(|e| format!("config.json: {e}"))?;
        if cfg.num_attention_heads == 0 || !cfg.hidden_size.is_multiple_of(cfg.num_attention_heads) {
            return Err(format!(
                "hidden_size {} is not a multiple of num_attention_heads {}",
                cfg.hidden_size, cfg.num_attention_heads
            ));
        }
        if cfg.architectures.iter().any(|a| a != "ModernBertModel" && a != "ModernBertForMaskedLM") {
            return Err(format!(
                "{}: only ModernBERT embedding models (ModernBertModel) are supported so far",
                cfg.architectures.join(", ")
            ));
        }
        cfg.activation()?;
        if let Some(lt) = &cfg.layer_types {
            if lt.len() != cfg.num_hidden_layers {
                return Err(format!("layer_types has {} entries for {} layers", lt.len(), cfg.num_hidden_layers));
            }
        }
        Ok(cfg)
    }

    pub fn head_dim(&self) -> usize {
        self.hidden_size / self.num_attention_heads
    }

    fn activation(&self) -> Result<OpCode, String> {
        Ok(match self.hidden_activation.as_str() {
            "gelu" => OpCode::Gelu,
            "gelu_new" | "gelu_pytorch_tanh" | "gelu_fast" => OpCode::GeluTanh,
            "silu" | "swish" => OpCode::Silu,
            "relu" => OpCode::Relu,
            other => return Err(format!("hidden_activation `{other}` is not supported")),
        })
    }

    /// Whether layer `i` attends globally (else within the local window).
    pub fn is_global(&self, i: usize) -> bool {
        match &self.layer_types {
            Some(lt) => lt[i] != "sliding_attention",
            None => i.is_multiple_of(self.global_attn_every_n_layers.max(1)),
        }
    }

    fn rope_theta(&self, global: bool) -> f64 {
        let kind = if global { "full_attention" } else { "sliding_attention" };
        let from_params = self.rope_parameters.as_ref().and_then(|p| p.get(kind)).and_then(|p| p.get("rope_theta"));
        from_params.and_then(Value::as_f64).unwrap_or_else(|| {
            if global {
                self.global_rope_theta.unwrap_or(160_000.0)
            } else {
                self.local_rope_theta.unwrap_or(10_000.0)
            }
        })
    }

    /// The sentence-transformers pooling, mean by default.
    pub fn head(&self) -> Result<EmbeddingHead, String> {
        match &self.sentence_transformers {
            Some(st) => EmbeddingHead::from_sentence_transformers(st, Pooling::Mean),
            None => Ok(EmbeddingHead { pooling: Pooling::Mean, normalize: false }),
        }
    }
}

struct Layer {
    /// `None` in the first layer, which has no attention norm.
    attn_norm: Option<WeightRef>,
    wqkv: Linear,
    wo: Linear,
    mlp_norm: WeightRef,
    wi: Linear,
    mlp_wo: Linear,
    global: bool,
}

pub struct ModernBertModel {
    pub cfg: ModernBertConfig,
    embed: Linear,
    embed_norm: WeightRef,
    layers: Vec<Layer>,
    final_norm: WeightRef,
    head: EmbeddingHead,
    used_weights: Vec<u32>,
    graph: Graph,
}

impl ModernBertModel {
    pub fn new(cfg: ModernBertConfig, table: &WeightTable) -> Result<ModernBertModel, String> {
        let (d, inter) = (cfg.hidden_size, cfg.intermediate_size);
        let q = cfg.quantization.as_ref();
        let p = ["", "model."]
            .into_iter()
            .find(|p| table.get(&format!("{p}embeddings.tok_embeddings.weight")).is_some())
            .ok_or("checkpoint has no `embeddings.tok_embeddings.weight` (with or without `model.`)")?;
        if cfg.norm_bias {
            return Err("norm_bias: true is not supported (ModernBERT's LayerNorms have no bias)".into());
        }
        let norm = |name: String| table.float(&name, &[d as u64]);
        let embed = Linear::load(table, q, &format!("{p}embeddings.tok_embeddings"), d, cfg.vocab_size, false)?;
        let embed_norm = norm(format!("{p}embeddings.norm.weight"))?;
        let mut layers = Vec::with_capacity(cfg.num_hidden_layers);
        for i in 0..cfg.num_hidden_layers {
            let l = format!("{p}layers.{i}");
            let lin =
                |name: &str, i: usize, o: usize, bias: bool| Linear::load(table, q, &format!("{l}.{name}"), i, o, bias);
            layers.push(Layer {
                attn_norm: if i == 0 { None } else { Some(norm(format!("{l}.attn_norm.weight"))?) },
                wqkv: lin("attn.Wqkv", d, 3 * d, cfg.attention_bias)?,
                wo: lin("attn.Wo", d, d, cfg.attention_bias)?,
                mlp_norm: norm(format!("{l}.mlp_norm.weight"))?,
                wi: lin("mlp.Wi", d, 2 * inter, cfg.mlp_bias)?,
                mlp_wo: lin("mlp.Wo", inter, d, cfg.mlp_bias)?,
                global: cfg.is_global(i),
            });
        }
        let final_norm = norm(format!("{p}final_norm.weight"))?;
        let head = cfg.head()?;
        let mut used = UsedWeights::default();
        used.add(&embed).add(&embed_norm).add(&final_norm);
        for l in &layers {
            used.add(&l.attn_norm).add(&l.mlp_norm).add(&l.wqkv).add(&l.wo).add(&l.wi).add(&l.mlp_wo);
        }
        Ok(ModernBertModel {
            cfg,
            embed,
            embed_norm,
            layers,
            final_norm,
            head,
            used_weights: used.finish(),
            graph: Graph::new(),
        })
    }

    fn forward(&mut self, step: &StepDesc) -> Result<(), String> {
        if step.n_tokens == 0 {
            return Err("a step needs at least one token".into());
        }
        mlxcel_family_kit::embedding::check_whole_sequences(step)?;
        let cfg = &self.cfg;
        let (t, n) = (step.n_tokens as u64, step.n_seqs as u64);
        let (d, inter, hd) = (cfg.hidden_size as u64, cfg.intermediate_size as u64, cfg.head_dim() as i64);
        let nh = cfg.num_attention_heads as i64;
        let eps = cfg.norm_eps;
        let act = cfg.activation()?;

        let mut graph = std::mem::take(&mut self.graph);
        graph.nodes.clear();
        graph.constants.clear();
        graph.outputs.clear();
        let mut w = GraphWriter::new(&mut graph);
        let tokens = w.g.input(INPUT_TOKENS, DType::I32, &[t]);
        let positions = w.g.input(INPUT_POSITIONS, DType::I32, &[t]);
        let seq = w.g.input(INPUT_TOKEN_SEQ, DType::I32, &[t]);
        // LayerNorm without bias: a zero bias.
        let zero = w.g.constant_f32(&vec![0.0; d as usize], &[d]);
        let freqs = |theta: f64| -> Vec<f32> {
            (0..hd as usize / 2).map(|i| (1.0 / theta.powf(2.0 * i as f64 / hd as f64)) as f32).collect()
        };
        let (gf, lf) = (freqs(cfg.rope_theta(true)), freqs(cfg.rope_theta(false)));
        let global_freq = w.g.constant_f32(&gf, &[1, gf.len() as u64]);
        let local_freq = w.g.constant_f32(&lf, &[1, lf.len() as u64]);
        let layer_norm = |w: &mut GraphWriter, x: TensorId, weight: &WeightRef| -> TensorId {
            let g = w.weight(weight);
            w.g.op_with(OpCode::LayerNorm, &[t, d], &[x, g, zero], &[], &[eps])
        };

        let e = w.embedding(tokens, t, &self.embed);
        let mut h = layer_norm(&mut w, e, &self.embed_norm);
        let scale = 1.0 / (hd as f32).sqrt();
        let window = (cfg.local_attention / 2) as i64;
        for l in &self.layers {
            let x = match &l.attn_norm {
                Some(nw) => layer_norm(&mut w, h, nw),
                None => h,
            };
            let qkv = w.linear(x, t, &l.wqkv);
            let part = |w: &mut GraphWriter, k: i64| {
                w.g.op_with(OpCode::Slice, &[t, d], &[qkv], &[k * d as i64, (k + 1) * d as i64], &[])
            };
            let (q, k, v) = (part(&mut w, 0), part(&mut w, 1), part(&mut w, 2));
            let inv_freq = if l.global { global_freq } else { local_freq };
            let rope = |w: &mut GraphWriter, x| {
                w.g.op_with(OpCode::Rope, &[t, d], &[x, positions, inv_freq], &[hd, hd, 0], &[1.0])
            };
            let (q, k) = (rope(&mut w, q), rope(&mut w, k));
            let win = if l.global { 0 } else { window };
            let a = w.g.op_with(OpCode::StepAttention, &[t, d], &[q, k, v, seq], &[nh, nh, hd, 0, win], &[scale, 0.0]);
            let o = w.linear(a, t, &l.wo);
            h = w.g.op(OpCode::Add, &[t, d], &[h, o]);

            let x = layer_norm(&mut w, h, &l.mlp_norm);
            let wi = w.linear(x, t, &l.wi);
            let input = w.g.op_with(OpCode::Slice, &[t, inter], &[wi], &[0, inter as i64], &[]);
            let gate = w.g.op_with(OpCode::Slice, &[t, inter], &[wi], &[inter as i64, 2 * inter as i64], &[]);
            let input = w.g.op(act, &[t, inter], &[input]);
            let m = w.g.op(OpCode::Mul, &[t, inter], &[input, gate]);
            let o = w.linear(m, t, &l.mlp_wo);
            h = w.g.op(OpCode::Add, &[t, d], &[h, o]);
        }
        let h = layer_norm(&mut w, h, &self.final_norm);
        let out = self.head.forward(&mut w, h, seq, n, d);
        w.g.mark_output(out);
        self.graph = graph;
        Ok(())
    }
}

impl FamilyModel for ModernBertModel {
    fn description(&self) -> ModelDescription {
        let c = &self.cfg;
        ModelDescription {
            task: Task::Embed,
            architecture: c.model_type.clone(),
            vocab_size: c.vocab_size as u64,
            hidden_size: c.hidden_size as u64,
            n_layers: c.num_hidden_layers as u32,
            max_positions: c.max_position_embeddings as u64,
            kv_layers: Vec::new(),
            used_weights: self.used_weights.clone(),
            activation_bytes_per_token: ((8 * c.hidden_size + 3 * c.intermediate_size) * 4) as u64,
            quantization: self
                .embed
                .describe_quant()
                .map_or_else(String::new, |s| format!("affine {}-bit g{}", s.bits, s.group_size)),
            output_kind: OutputKind::Embeddings,
            output_dim: c.hidden_size as u64,
        }
    }

    fn build_graph(&mut self, step: &StepDesc) -> Result<&Graph, PluginError> {
        self.forward(step).map_err(PluginError::invalid)?;
        Ok(&self.graph)
    }
}
