//! Whisper as an op graph.
//!
//! Encoder, in the step that brings a sequence's log-mel frames `[F, n_mels]` (normally 3000 frames,
//! 30 s): `gelu(conv1)` (k3, pad 1), `gelu(conv2)` (k3, stride 2, pad 1), plus the positional
//! embedding, then pre-LayerNorm blocks `h += attn(ln(h))` (bidirectional), `h += fc2(gelu(fc1(ln(h))))`,
//! and a final LayerNorm. Each decoder layer's cross-attention keys and values of that output are stored
//! in the sequence's state row (`StoreCrossKv`), once per window.
//!
//! Decoder, every step: token embedding plus learned positions, then per layer `h += self_attn(ln(h))`
//! over the paged KV cache (causal), `h += cross_attn(ln(h))` over the stored encoder keys and values,
//! `h += fc2(gelu(fc1(ln(h))))`; a final LayerNorm and the logits through the tied token embedding.
//!
//! Hugging Face (`model.encoder.layers.N.self_attn.q_proj`, conv weights `[C_out, C_in, K]`) and
//! mlx-community (`encoder.blocks.N.attn.query`, conv weights `[C_out, K, C_in]`, encoder positions
//! computed as sinusoids, optional affine quantization) name the same tensors; [`Names`] maps them.

use mlxcel_family_kit::{GraphWriter, Linear, WeightRef, WeightTable, Weights};
use mlxcel_plugin_api::{
    cross_kv_state_elems, DType, FamilyModel, Graph, KvKind, KvLayerDesc, ModelDescription, OpCode, OutputKind,
    StepDesc, Task, TensorId, Versioned, CONV_WEIGHT_MLX, CONV_WEIGHT_TORCH, CONV_WHOLE, INPUT_FEATURES,
    INPUT_OUTPUT_ROWS, INPUT_POSITIONS, INPUT_TOKENS, INPUT_TOKEN_SEQ,
};

use crate::config::WhisperConfig;

const LN_EPS: f32 = 1e-5;

/// Tensor names of one checkpoint layout.
struct Names {
    hf: bool,
}

impl Names {
    fn encoder(&self) -> &'static str {
        if self.hf {
            "model.encoder"
        } else {
            "encoder"
        }
    }
    fn decoder(&self) -> &'static str {
        if self.hf {
            "model.decoder"
        } else {
            "decoder"
        }
    }
    fn layer(&self, side: &str, i: usize) -> String {
        if self.hf {
            format!("{side}.layers.{i}")
        } else {
            format!("{side}.blocks.{i}")
        }
    }
    /// (self-attention, cross-attention) module names inside a layer.
    fn attn(&self, cross: bool) -> &'static str {
        match (self.hf, cross) {
            (true, false) => "self_attn",
            (true, true) => "encoder_attn",
            (false, false) => "attn",
            (false, true) => "cross_attn",
        }
    }
    /// q, k, v, o inside an attention module.
    fn proj(&self) -> [&'static str; 4] {
        if self.hf {
            ["q_proj", "k_proj", "v_proj", "out_proj"]
        } else {
            ["query", "key", "value", "out"]
        }
    }
    fn attn_ln(&self, cross: bool) -> &'static str {
        match (self.hf, cross) {
            (true, false) => "self_attn_layer_norm",
            (true, true) => "encoder_attn_layer_norm",
            (false, false) => "attn_ln",
            (false, true) => "cross_attn_ln",
        }
    }
    fn mlp(&self) -> [&'static str; 3] {
        if self.hf {
            ["fc1", "fc2", "final_layer_norm"]
        } else {
            ["mlp1", "mlp2", "mlp_ln"]
        }
    }
    fn final_ln(&self, side: &str) -> String {
        match (self.hf, side == self.encoder()) {
            (true, _) => format!("{side}.layer_norm"),
            (false, true) => format!("{side}.ln_post"),
            (false, false) => format!("{side}.ln"),
        }
    }
}

struct LayerNorm {
    w: WeightRef,
    b: WeightRef,
}

impl LayerNorm {
    fn load(table: &WeightTable, path: &str, d: usize) -> Result<LayerNorm, String> {
        Ok(LayerNorm {
            w: table.float(&format!("{path}.weight"), &[d as u64])?,
            b: table.float(&format!("{path}.bias"), &[d as u64])?,
        })
    }
    fn forward(&self, w: &mut GraphWriter, x: TensorId, rows: u64) -> TensorId {
        let (lw, lb) = (w.weight(&self.w), w.weight(&self.b));
        let d = self.w.shape[0];
        w.g.op_with(OpCode::LayerNorm, &[rows, d], &[x, lw, lb], &[], &[LN_EPS])
    }
    fn indices(&self) -> [u32; 2] {
        [self.w.index, self.b.index]
    }
}

/// q (bias), k (no bias), v (bias), o (bias), as every Whisper attention has them.
struct Attention {
    ln: LayerNorm,
    q: Linear,
    k: Linear,
    v: Linear,
    o: Linear,
}

impl Attention {
    fn load(
        table: &WeightTable,
        cfg: &WhisperConfig,
        n: &Names,
        layer: &str,
        cross: bool,
    ) -> Result<Attention, String> {
        let d = cfg.d_model;
        let quant = cfg.quantization.as_ref();
        let [q, k, v, o] = n.proj();
        let p = format!("{layer}.{}", n.attn(cross));
        Ok(Attention {
            ln: LayerNorm::load(table, &format!("{layer}.{}", n.attn_ln(cross)), d)?,
            q: Linear::load(table, quant, &format!("{p}.{q}"), d, d, true)?,
            k: Linear::load(table, quant, &format!("{p}.{k}"), d, d, false)?,
            v: Linear::load(table, quant, &format!("{p}.{v}"), d, d, true)?,
            o: Linear::load(table, quant, &format!("{p}.{o}"), d, d, true)?,
        })
    }
    fn indices(&self) -> Vec<u32> {
        let mut v = self.ln.indices().to_vec();
        for l in [&self.q, &self.k, &self.v, &self.o] {
            v.extend(l.indices());
        }
        v
    }
}

struct Mlp {
    ln: LayerNorm,
    fc1: Linear,
    fc2: Linear,
}

impl Mlp {
    fn load(table: &WeightTable, cfg: &WhisperConfig, n: &Names, layer: &str, ffn: usize) -> Result<Mlp, String> {
        let quant = cfg.quantization.as_ref();
        let [fc1, fc2, ln] = n.mlp();
        Ok(Mlp {
            ln: LayerNorm::load(table, &format!("{layer}.{ln}"), cfg.d_model)?,
            fc1: Linear::load(table, quant, &format!("{layer}.{fc1}"), cfg.d_model, ffn, true)?,
            fc2: Linear::load(table, quant, &format!("{layer}.{fc2}"), ffn, cfg.d_model, true)?,
        })
    }
    /// `h + fc2(gelu(fc1(ln(h))))`
    fn residual(&self, w: &mut GraphWriter, h: TensorId, rows: u64) -> TensorId {
        let x = self.ln.forward(w, h, rows);
        let x = w.linear(x, rows, &self.fc1);
        let x = w.g.op(OpCode::Gelu, &[rows, self.fc1.out_features], &[x]);
        let x = w.linear(x, rows, &self.fc2);
        w.g.op(OpCode::Add, &[rows, self.fc2.out_features], &[h, x])
    }
    fn indices(&self) -> Vec<u32> {
        let mut v = self.ln.indices().to_vec();
        v.extend(self.fc1.indices());
        v.extend(self.fc2.indices());
        v
    }
}

struct Conv {
    w: WeightRef,
    b: WeightRef,
}

struct EncoderLayer {
    attn: Attention,
    mlp: Mlp,
}

struct DecoderLayer {
    attn: Attention,
    cross: Attention,
    mlp: Mlp,
}

/// The encoder's positional embedding: a checkpoint tensor (Hugging Face stores the sinusoids) or the
/// sinusoids computed here (mlx-community checkpoints do not store them).
enum EncoderPositions {
    Weight(WeightRef),
    Sinusoids(Vec<f32>),
}

pub struct WhisperModel {
    pub cfg: WhisperConfig,
    conv1: Conv,
    conv2: Conv,
    conv_layout: i64,
    enc_positions: EncoderPositions,
    encoder: Vec<EncoderLayer>,
    enc_ln: LayerNorm,
    embed: Linear,
    dec_positions: WeightRef,
    decoder: Vec<DecoderLayer>,
    dec_ln: LayerNorm,
    /// `None` when the logits come from the token embedding (tied, as in every Whisper checkpoint).
    proj_out: Option<Linear>,
    kv_layers: Vec<KvLayerDesc>,
    used_weights: Vec<u32>,
    quantization: String,
    /// The most recent step's graph, owned here as the ABI requires.
    graph: Graph,
}

impl WhisperModel {
    pub fn new(cfg: WhisperConfig, table: &WeightTable) -> Result<WhisperModel, String> {
        let n = if table.get("model.encoder.conv1.weight").is_some() {
            Names { hf: true }
        } else if table.get("encoder.conv1.weight").is_some() {
            Names { hf: false }
        } else {
            return Err("checkpoint has neither `model.encoder.conv1.weight` (Hugging Face layout) nor \
                        `encoder.conv1.weight` (MLX layout): not a Whisper checkpoint"
                .into());
        };
        let (d, mels) = (cfg.d_model as u64, cfg.num_mel_bins as u64);
        let quant = cfg.quantization.as_ref();
        let (enc, dec) = (n.encoder(), n.decoder());
        // Hugging Face keeps PyTorch's [C_out, C_in, K]; MLX conversions store [C_out, K, C_in].
        let conv_shape = |c_in: u64| if n.hf { vec![d, c_in, 3] } else { vec![d, 3, c_in] };
        let conv = |name: &str, c_in: u64| -> Result<Conv, String> {
            Ok(Conv {
                w: table.float(&format!("{enc}.{name}.weight"), &conv_shape(c_in))?,
                b: table.float(&format!("{enc}.{name}.bias"), &[d])?,
            })
        };
        let conv1 = conv("conv1", mels)?;
        let conv2 = conv("conv2", d)?;
        let src = cfg.max_source_positions;
        let enc_positions = match table.get(&format!("{enc}.embed_positions.weight")) {
            Some(_) => {
                EncoderPositions::Weight(table.float(&format!("{enc}.embed_positions.weight"), &[src as u64, d])?)
            }
            None => EncoderPositions::Sinusoids(sinusoids(src, cfg.d_model)),
        };
        let mut encoder = Vec::with_capacity(cfg.encoder_layers);
        for i in 0..cfg.encoder_layers {
            let l = n.layer(enc, i);
            encoder.push(EncoderLayer {
                attn: Attention::load(table, &cfg, &n, &l, false)?,
                mlp: Mlp::load(table, &cfg, &n, &l, cfg.encoder_ffn())?,
            });
        }
        let enc_ln = LayerNorm::load(table, &n.final_ln(enc), cfg.d_model)?;

        let embed_name = if n.hf { format!("{dec}.embed_tokens") } else { format!("{dec}.token_embedding") };
        let embed = Linear::load(table, quant, &embed_name, cfg.d_model, cfg.vocab_size, false)?;
        let pos_name =
            if n.hf { format!("{dec}.embed_positions.weight") } else { format!("{dec}.positional_embedding") };
        let dec_positions = table.float(&pos_name, &[cfg.max_target_positions as u64, d])?;
        let mut decoder = Vec::with_capacity(cfg.decoder_layers);
        for i in 0..cfg.decoder_layers {
            let l = n.layer(dec, i);
            decoder.push(DecoderLayer {
                attn: Attention::load(table, &cfg, &n, &l, false)?,
                cross: Attention::load(table, &cfg, &n, &l, true)?,
                mlp: Mlp::load(table, &cfg, &n, &l, cfg.decoder_ffn())?,
            });
        }
        let dec_ln = LayerNorm::load(table, &n.final_ln(dec), cfg.d_model)?;
        let proj_out = match (cfg.tie_word_embeddings, table.get("proj_out.weight")) {
            (Some(false), Some(_)) => Some(Linear::load(table, quant, "proj_out", cfg.d_model, cfg.vocab_size, false)?),
            (Some(false), None) => {
                return Err("config.json says tie_word_embeddings = false but there is no `proj_out.weight`".into())
            }
            _ => None,
        };

        let heads = cfg.decoder_attention_heads;
        let hd = cfg.d_model / heads;
        // Layers 0..L: each decoder layer's self-attention KV; L..2L: its cross-attention K/V rows.
        let mut kv_layers: Vec<KvLayerDesc> = (0..cfg.decoder_layers)
            .map(|_| KvLayerDesc {
                kind: KvKind::Full as u32,
                n_kv_heads: heads as u32,
                head_dim: hd as u32,
                ..KvLayerDesc::zeroed()
            })
            .collect();
        kv_layers.extend((0..cfg.decoder_layers).map(|_| KvLayerDesc {
            kind: KvKind::Recurrent as u32,
            n_kv_heads: heads as u32,
            head_dim: hd as u32,
            state_elems: cross_kv_state_elems(src as u64, heads as u64, hd as u64),
            ..KvLayerDesc::zeroed()
        }));

        let mut used = vec![conv1.w.index, conv1.b.index, conv2.w.index, conv2.b.index];
        if let EncoderPositions::Weight(w) = &enc_positions {
            used.push(w.index);
        }
        for l in &encoder {
            used.extend(l.attn.indices());
            used.extend(l.mlp.indices());
        }
        used.extend(enc_ln.indices());
        used.extend(embed.indices());
        used.push(dec_positions.index);
        for l in &decoder {
            used.extend(l.attn.indices());
            used.extend(l.cross.indices());
            used.extend(l.mlp.indices());
        }
        used.extend(dec_ln.indices());
        if let Some(p) = &proj_out {
            used.extend(p.indices());
        }
        used.sort_unstable();
        used.dedup();

        let quantization = decoder
            .first()
            .and_then(|l| l.mlp.fc1.describe_quant())
            .or_else(|| embed.describe_quant())
            .map_or(String::new(), |s| format!("affine {}-bit g{}", s.bits, s.group_size));
        Ok(WhisperModel {
            conv_layout: if n.hf { CONV_WEIGHT_TORCH } else { CONV_WEIGHT_MLX },
            cfg,
            conv1,
            conv2,
            enc_positions,
            encoder,
            enc_ln,
            embed,
            dec_positions,
            decoder,
            dec_ln,
            proj_out,
            kv_layers,
            used_weights: used,
            quantization,
            graph: Graph::new(),
        })
    }

    fn heads_and_dim(&self, heads: usize) -> (i64, i64, f32) {
        let hd = self.cfg.d_model / heads;
        (heads as i64, hd as i64, (hd as f32).powf(-0.5))
    }

    /// The encoder over every sequence's feature rows, then each decoder layer's cross K/V stored:
    /// returns the `StoreCrossKv` node of each decoder layer.
    fn encode(&self, w: &mut GraphWriter, step: &StepDesc, seq_features: &[u32]) -> Result<Vec<TensorId>, String> {
        let cfg = &self.cfg;
        let d = cfg.d_model as u64;
        let max_src = cfg.max_source_positions;
        let total: u32 = seq_features.iter().sum();
        if total != step.n_feature_rows {
            return Err(format!("step has {} feature rows but its sequences bring {total}", step.n_feature_rows));
        }
        // Per feature row and per encoder row: its sequence; per encoder row: its position.
        let (mut feat_seq, mut enc_seq, mut enc_pos) = (Vec::new(), Vec::new(), Vec::new());
        for (s, &f) in seq_features.iter().enumerate() {
            if f == 0 {
                continue;
            }
            if f % 2 != 0 || f as usize > 2 * max_src {
                return Err(format!(
                    "sequence {s} brings {f} feature frames; the encoder takes an even number up to {}",
                    2 * max_src
                ));
            }
            feat_seq.extend(std::iter::repeat_n(s as i32, f as usize));
            enc_seq.extend(std::iter::repeat_n(s as i32, f as usize / 2));
            enc_pos.extend(0..(f / 2) as i32);
        }
        let (f, rows) = (feat_seq.len() as u64, enc_seq.len() as u64);
        let x = w.g.input(INPUT_FEATURES, DType::F32, &[f, cfg.num_mel_bins as u64]);
        let feat_seq = w.g.constant_i32(&feat_seq, &[f]);
        let enc_seq = w.g.constant_i32(&enc_seq, &[rows]);

        let conv = |w: &mut GraphWriter, x: TensorId, seq: TensorId, c: &Conv, rows: u64, stride: i64| {
            let (cw, cb) = (w.weight(&c.w), w.weight(&c.b));
            let iparams = [CONV_WHOLE, stride, 1, 1, 0, self.conv_layout];
            let y = w.g.op_with(OpCode::Conv1d, &[rows, d], &[x, cw, seq, cb], &iparams, &[]);
            w.g.op(OpCode::Gelu, &[rows, d], &[y])
        };
        let x = conv(w, x, feat_seq, &self.conv1, f, 1);
        let x = conv(w, x, feat_seq, &self.conv2, rows, 2);
        let pos = match &self.enc_positions {
            EncoderPositions::Weight(table) => {
                let ids = w.g.constant_i32(&enc_pos, &[rows]);
                let t = w.weight(table);
                w.g.op(OpCode::Embedding, &[rows, d], &[ids, t])
            }
            EncoderPositions::Sinusoids(table) => {
                let vals: Vec<f32> =
                    enc_pos.iter().flat_map(|&p| &table[p as usize * d as usize..][..d as usize]).copied().collect();
                w.g.constant_f32(&vals, &[rows, d])
            }
        };
        let mut h = w.g.op(OpCode::Add, &[rows, d], &[x, pos]);

        let (nh, hd, scale) = self.heads_and_dim(cfg.encoder_attention_heads);
        for layer in &self.encoder {
            let a = &layer.attn;
            let x = a.ln.forward(w, h, rows);
            let (q, k, v) = (w.linear(x, rows, &a.q), w.linear(x, rows, &a.k), w.linear(x, rows, &a.v));
            let o = w.g.op_with(OpCode::StepAttention, &[rows, d], &[q, k, v, enc_seq], &[nh, nh, hd, 0, 0], &[scale]);
            let o = w.linear(o, rows, &a.o);
            h = w.g.op(OpCode::Add, &[rows, d], &[h, o]);
            h = layer.mlp.residual(w, h, rows);
        }
        let enc_out = self.enc_ln.forward(w, h, rows);

        let (nh, hd, _) = self.heads_and_dim(cfg.decoder_attention_heads);
        let n_dec = self.decoder.len() as i64;
        let mut stores = Vec::with_capacity(self.decoder.len());
        for (i, layer) in self.decoder.iter().enumerate() {
            let k = w.linear(enc_out, rows, &layer.cross.k);
            let v = w.linear(enc_out, rows, &layer.cross.v);
            let store = w.g.op_with(
                OpCode::StoreCrossKv,
                &[1],
                &[k, v, enc_seq],
                &[n_dec + i as i64, nh, hd, max_src as i64],
                &[],
            );
            stores.push(store);
        }
        Ok(stores)
    }

    /// The graph of one step: the encoder for the sequences that bring features, the decoder for every
    /// token.
    fn forward(&mut self, step: &StepDesc) -> Result<(), String> {
        let t = step.n_tokens as u64;
        let r = step.n_output_rows as u64;
        if t == 0 {
            return Err("a step needs at least one token".into());
        }
        // SAFETY: the host passes arrays of `n_seqs` elements (ABI contract of `build_graph`).
        let (seq_features, seq_context) = unsafe { (step.seq_n_features(), step.seq_context()) };
        if let Some(&c) = seq_context.iter().find(|&&c| c as usize > self.cfg.max_target_positions) {
            return Err(format!(
                "a decoder sequence of {c} tokens exceeds Whisper's {} text positions",
                self.cfg.max_target_positions
            ));
        }
        let d = self.cfg.d_model as u64;
        let mut graph = std::mem::take(&mut self.graph);
        graph.nodes.clear();
        graph.constants.clear();
        graph.outputs.clear();
        let mut w = GraphWriter::new(&mut graph);

        let result = (|| {
            let stores =
                if seq_features.iter().any(|&f| f > 0) { self.encode(&mut w, step, seq_features)? } else { Vec::new() };

            let tokens = w.g.input(INPUT_TOKENS, DType::I32, &[t]);
            let positions = w.g.input(INPUT_POSITIONS, DType::I32, &[t]);
            let token_seq = w.g.input(INPUT_TOKEN_SEQ, DType::I32, &[t]);
            let tok = w.embedding(tokens, t, &self.embed);
            let pos_table = w.weight(&self.dec_positions);
            let pos = w.g.op(OpCode::Embedding, &[t, d], &[positions, pos_table]);
            let mut h = w.g.op(OpCode::Add, &[t, d], &[tok, pos]);

            let (nh, hd, scale) = self.heads_and_dim(self.cfg.decoder_attention_heads);
            let (n_dec, max_src) = (self.decoder.len() as i64, self.cfg.max_source_positions as i64);
            for (i, layer) in self.decoder.iter().enumerate() {
                let a = &layer.attn;
                let x = a.ln.forward(&mut w, h, t);
                let (q, k, v) = (w.linear(x, t, &a.q), w.linear(x, t, &a.k), w.linear(x, t, &a.v));
                let o = w.g.op_with(OpCode::Attention, &[t, d], &[q, k, v], &[i as i64, nh, nh, hd, 0], &[scale]);
                let o = w.linear(o, t, &a.o);
                h = w.g.op(OpCode::Add, &[t, d], &[h, o]);

                let c = &layer.cross;
                let x = c.ln.forward(&mut w, h, t);
                let q = w.linear(x, t, &c.q);
                let mut src = vec![q, token_seq];
                src.extend(stores.get(i));
                let o = w.g.op_with(
                    OpCode::CrossAttention,
                    &[t, d],
                    &src,
                    &[n_dec + i as i64, nh, nh, hd, max_src],
                    &[scale],
                );
                let o = w.linear(o, t, &c.o);
                h = w.g.op(OpCode::Add, &[t, d], &[h, o]);
                h = layer.mlp.residual(&mut w, h, t);
            }

            let rows = w.g.input(INPUT_OUTPUT_ROWS, DType::I32, &[r]);
            let h = w.g.op(OpCode::GetRows, &[r, d], &[h, rows]);
            let h = self.dec_ln.forward(&mut w, h, r);
            let logits = w.linear(h, r, self.proj_out.as_ref().unwrap_or(&self.embed));
            w.g.mark_output(logits);
            Ok(())
        })();
        self.graph = graph;
        result
    }
}

/// Whisper's encoder positions: `[sin(p·f_i) …, cos(p·f_i) …]` with `f_i = 10000^(-i/(d/2 − 1))`
/// (`whisper/model.py: sinusoids`), `[length, d]` row-major.
pub fn sinusoids(length: usize, d: usize) -> Vec<f32> {
    let half = d / 2;
    let step = (10000f64).ln() / (half as f64 - 1.0).max(1.0);
    let mut out = vec![0f32; length * d];
    for p in 0..length {
        for i in 0..half {
            let a = p as f64 * (-step * i as f64).exp();
            out[p * d + i] = a.sin() as f32;
            out[p * d + half + i] = a.cos() as f32;
        }
    }
    out
}

impl FamilyModel for WhisperModel {
    fn description(&self) -> ModelDescription {
        let c = &self.cfg;
        let d = c.d_model as u64;
        ModelDescription {
            task: Task::Asr,
            architecture: "whisper".into(),
            vocab_size: c.vocab_size as u64,
            hidden_size: d,
            n_layers: c.decoder_layers as u32,
            max_positions: c.max_target_positions as u64,
            kv_layers: self.kv_layers.clone(),
            used_weights: self.used_weights.clone(),
            // Per token in flight: a layer's activations and the MLP; the encoder's 1500 rows are
            // counted the same way, per row.
            activation_bytes_per_token: (8 * d + 2 * c.decoder_ffn().max(c.encoder_ffn()) as u64) * 4,
            quantization: self.quantization.clone(),
            output_kind: OutputKind::Logits,
            output_dim: c.vocab_size as u64,
        }
    }

    fn build_graph(&mut self, step: &StepDesc) -> Result<&Graph, mlxcel_plugin_api::PluginError> {
        self.forward(step).map_err(mlxcel_plugin_api::PluginError::invalid)?;
        Ok(&self.graph)
    }
}
