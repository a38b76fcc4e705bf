//! Gemma 1, 2 and 3 (text) as an op graph, following mlx-lm's `gemma.py`, `gemma2.py` and
//! `gemma3_text.py`.
//!
//! `h = embed(tokens) * √hidden`; per layer `h += [post_attn_norm](attn(input_norm(h)))`, then
//! `h += [post_ff_norm](down(gelu(gate(x)) * up(x)))` over `x = pre_ff_norm(h)` (Gemma 1 names it
//! `post_attention_layernorm` and has no post norms). Every norm scales by `(1 + w)`. Gemma 2 soft-caps
//! attention scores and the final logits; Gemma 3 norms q and k per head and gives its local
//! (sliding-window) layers their own rope base. The differences are the flags of [`GemmaConfig`].

use mlxcel_family_kit::rope::step_inv_freq;
use mlxcel_family_kit::{
    rope_freqs, AttentionShape, GraphWriter, Linear, RopeFreqs, RopeInputs, SelfAttention, WeightRef, WeightTable,
};
use mlxcel_plugin_api::{
    DType, FamilyModel, Graph, KvKind, KvLayerDesc, ModelDescription, OpCode, OutputKind, PluginError, StepDesc, Task,
    Versioned, INPUT_OUTPUT_ROWS, INPUT_POSITIONS, INPUT_TOKENS,
};
use serde_json::Value;

use crate::config::{GemmaConfig, Generation};

struct Mlp {
    gate: Linear,
    up: Linear,
    down: Linear,
}

struct Layer {
    input_norm: WeightRef,
    attn: SelfAttention,
    /// Index into [`GemmaModel::ropes`].
    rope: usize,
    /// Gemma 2 / 3: norm of the attention output before the residual add.
    post_attention_norm: Option<WeightRef>,
    /// Norm before the MLP (Gemma 1's `post_attention_layernorm`, Gemma 2 / 3's
    /// `pre_feedforward_layernorm`).
    pre_ff_norm: WeightRef,
    mlp: Mlp,
    /// Gemma 2 / 3: norm of the MLP output before the residual add.
    post_ff_norm: Option<WeightRef>,
}

pub struct GemmaModel {
    pub cfg: GemmaConfig,
    embed: Linear,
    embed_scale: f32,
    layers: Vec<Layer>,
    norm: WeightRef,
    /// `None` when tied to the embedding (always for Gemma 1 and 2; Gemma 3 when `lm_head` is absent).
    lm_head: Option<Linear>,
    /// The distinct rope frequencies of the layers (Gemma 3: local and global).
    ropes: Vec<RopeFreqs>,
    kv_layers: Vec<KvLayerDesc>,
    used_weights: Vec<u32>,
    quantization: String,
    /// The most recent step's graph, owned here as the ABI requires.
    graph: Graph,
}

impl GemmaModel {
    pub fn new(cfg: GemmaConfig, table: &WeightTable) -> Result<GemmaModel, String> {
        let (d, hd, inter) = (cfg.hidden_size, cfg.head_dim, cfg.intermediate_size);
        let (nh, nkv) = (cfg.num_attention_heads, cfg.num_key_value_heads);
        let q = cfg.quantization.as_ref();
        let pre = cfg.weight_prefix.clone();
        let norm = |name: String, n: usize| table.float(&format!("{pre}{name}"), &[n as u64]);
        let linear = |path: String, i: usize, o: usize| Linear::load(table, q, &format!("{pre}{path}"), i, o, false);
        let sandwich = cfg.sandwich_norms();

        let embed = linear("model.embed_tokens".into(), d, cfg.vocab_size)?;
        let mut ropes: Vec<(f64, Option<Value>, RopeFreqs)> = Vec::new();
        let mut layers = Vec::with_capacity(cfg.num_hidden_layers);
        for i in 0..cfg.num_hidden_layers {
            let p = format!("model.layers.{i}");
            let (base, scaling) = (cfg.layer_rope_base(i), cfg.layer_rope_scaling(i).cloned());
            let rope = match ropes.iter().position(|(b, s, _)| *b == base && *s == scaling) {
                Some(r) => r,
                None => {
                    ropes.push((base, scaling.clone(), rope_freqs(hd, base, scaling.as_ref(), cfg.max_positions())?));
                    ropes.len() - 1
                }
            };
            let shape = AttentionShape {
                hidden: d,
                n_heads: nh,
                n_kv_heads: nkv,
                head_dim: hd,
                qkv_bias: false,
                o_bias: false,
                qk_norm: cfg.qk_norm(),
                norm_plus_one: true,
                scale: Some(cfg.attention_scale()),
                softcap: cfg.attn_softcap().unwrap_or(0.0),
                window: cfg.layer_window(i),
            };
            let attn = SelfAttention::load(table, q, &format!("{pre}{p}.self_attn"), shape)?;
            let mlp = Mlp {
                gate: linear(format!("{p}.mlp.gate_proj"), d, inter)?,
                up: linear(format!("{p}.mlp.up_proj"), d, inter)?,
                down: linear(format!("{p}.mlp.down_proj"), inter, d)?,
            };
            let (post_attention_norm, pre_ff_norm, post_ff_norm) = if sandwich {
                (
                    Some(norm(format!("{p}.post_attention_layernorm.weight"), d)?),
                    norm(format!("{p}.pre_feedforward_layernorm.weight"), d)?,
                    Some(norm(format!("{p}.post_feedforward_layernorm.weight"), d)?),
                )
            } else {
                (None, norm(format!("{p}.post_attention_layernorm.weight"), d)?, None)
            };
            layers.push(Layer {
                input_norm: norm(format!("{p}.input_layernorm.weight"), d)?,
                attn,
                rope,
                post_attention_norm,
                pre_ff_norm,
                mlp,
                post_ff_norm,
            });
        }
        let final_norm = norm("model.norm.weight".into(), d)?;
        // mlx-lm's gemma3 ties the head when the checkpoint has no `lm_head`; Gemma 1 and 2 always tie.
        let has_head = table.get(&format!("{pre}lm_head.weight")).is_some();
        let lm_head = if cfg.generation() == Generation::Gemma3 && has_head {
            Some(linear("lm_head".into(), d, cfg.vocab_size)?)
        } else {
            None
        };

        let kv_layers = layers
            .iter()
            .map(|l| KvLayerDesc {
                kind: if l.attn.shape.window > 0 { KvKind::SlidingWindow } else { KvKind::Full } as u32,
                n_kv_heads: nkv as u32,
                head_dim: hd as u32,
                window: l.attn.shape.window as u32,
                ..KvLayerDesc::zeroed()
            })
            .collect();

        let mut used: Vec<u32> = embed.indices();
        for l in &layers {
            let norms =
                [Some(&l.input_norm), l.post_attention_norm.as_ref(), Some(&l.pre_ff_norm), l.post_ff_norm.as_ref()];
            used.extend(norms.into_iter().flatten().map(|w| w.index));
            used.extend(l.attn.indices());
            for lin in [&l.mlp.gate, &l.mlp.up, &l.mlp.down] {
                used.extend(lin.indices());
            }
        }
        used.push(final_norm.index);
        if let Some(h) = &lm_head {
            used.extend(h.indices());
        }
        used.sort_unstable();
        used.dedup();

        let first = layers.first().and_then(|l| l.mlp.down.describe_quant()).or_else(|| embed.describe_quant());
        let quantization = mlxcel_family_kit::quant::describe(first, cfg.quantization.as_ref());
        let embed_scale = cfg.embedding_scale(embed.compute_dtype());
        Ok(GemmaModel {
            cfg,
            embed,
            embed_scale,
            layers,
            norm: final_norm,
            lm_head,
            ropes: ropes.into_iter().map(|(_, _, f)| f).collect(),
            kv_layers,
            used_weights: used,
            quantization,
            graph: Graph::new(),
        })
    }

    /// Rough activation bytes per token in flight (f32 activations of one layer plus logits rows).
    pub fn activation_bytes_per_token(&self) -> u64 {
        let c = &self.cfg;
        let per = 5 * c.hidden_size
            + 3 * c.intermediate_size
            + (c.num_attention_heads + 2 * c.num_key_value_heads) * c.head_dim;
        (per * 4) as u64
    }

    /// The forward pass of one step.
    fn forward(&mut self, step: &StepDesc) -> Result<(), String> {
        let t = step.n_tokens as u64;
        let r = step.n_output_rows as u64;
        if t == 0 {
            return Err("a step needs at least one token".into());
        }
        let cfg = &self.cfg;
        let (d, hd) = (cfg.hidden_size as u64, cfg.head_dim as i64);
        let eps = cfg.rms_norm_eps;
        let act = if cfg.exact_gelu() { OpCode::Gelu } else { OpCode::GeluTanh };

        let mut graph = std::mem::take(&mut self.graph);
        graph.nodes.clear();
        graph.constants.clear();
        graph.outputs.clear();
        let mut w = GraphWriter::new(&mut graph);

        let tokens = w.g.input(INPUT_TOKENS, DType::I32, &[t]);
        let positions = w.g.input(INPUT_POSITIONS, DType::I32, &[t]);
        let ropes: Vec<RopeInputs> = self
            .ropes
            .iter()
            .map(|f| RopeInputs {
                positions,
                inv_freq: step_inv_freq(w.g, f, step),
                params: [hd, hd, cfg.rope_traditional() as i64],
                mscale: f.mscale,
            })
            .collect();

        let h = w.embedding(tokens, t, &self.embed);
        let mut h = w.g.op_with(OpCode::Scale, &[t, d], &[h], &[], &[self.embed_scale]);
        for (i, layer) in self.layers.iter().enumerate() {
            let x = w.rms_norm_plus_one(h, &[t, d], &layer.input_norm, eps);
            let mut o = layer.attn.forward(&mut w, x, t, i, &ropes[layer.rope], eps);
            if let Some(n) = &layer.post_attention_norm {
                o = w.rms_norm_plus_one(o, &[t, d], n, eps);
            }
            h = w.g.op(OpCode::Add, &[t, d], &[h, o]);

            let x = w.rms_norm_plus_one(h, &[t, d], &layer.pre_ff_norm, eps);
            let inter = layer.mlp.gate.out_features;
            let gate = w.linear(x, t, &layer.mlp.gate);
            let up = w.linear(x, t, &layer.mlp.up);
            let m = if act == OpCode::GeluTanh {
                w.g.op(OpCode::GeluTanhMul, &[t, inter], &[gate, up])
            } else {
                let g = w.g.op(act, &[t, inter], &[gate]);
                w.g.op(OpCode::Mul, &[t, inter], &[g, up])
            };
            let mut down = w.linear(m, t, &layer.mlp.down);
            if let Some(n) = &layer.post_ff_norm {
                down = w.rms_norm_plus_one(down, &[t, d], n, eps);
            }
            h = w.g.op(OpCode::Add, &[t, d], &[h, down]);
        }

        // Only the rows that need logits go through the final norm and the vocabulary projection.
        let rows = w.g.input(INPUT_OUTPUT_ROWS, DType::I32, &[r]);
        let h = w.g.op(OpCode::GetRows, &[r, d], &[h, rows]);
        let h = w.rms_norm_plus_one(h, &[r, d], &self.norm, eps);
        let mut logits = w.linear(h, r, self.lm_head.as_ref().unwrap_or(&self.embed));
        if let Some(cap) = cfg.final_softcap() {
            logits = w.g.op_with(OpCode::Softcap, &[r, cfg.vocab_size as u64], &[logits], &[], &[cap]);
        }
        w.g.mark_output(logits);
        self.graph = graph;
        Ok(())
    }
}

impl FamilyModel for GemmaModel {
    fn description(&self) -> ModelDescription {
        let c = &self.cfg;
        ModelDescription {
            task: Task::Text,
            architecture: c.model_type.clone(),
            vocab_size: c.vocab_size as u64,
            hidden_size: c.hidden_size as u64,
            n_layers: c.num_hidden_layers as u32,
            max_positions: c.max_positions() as u64,
            kv_layers: self.kv_layers.clone(),
            used_weights: self.used_weights.clone(),
            activation_bytes_per_token: self.activation_bytes_per_token(),
            quantization: self.quantization.clone(),
            output_kind: OutputKind::Logits,
            output_dim: c.vocab_size as u64,
        }
    }

    fn build_graph(&mut self, step: &StepDesc) -> Result<&Graph, PluginError> {
        self.forward(step).map_err(PluginError::invalid)?;
        Ok(&self.graph)
    }
}
