//! Sentence embeddings on any body: how sentence-transformers pools a model's token rows into one
//! vector (read from the metadata the host adds to `config.json` under `"sentence_transformers"`:
//! `modules.json`'s module types and `1_Pooling/config.json`), the pooling and normalisation nodes,
//! and self-attention among a step's own tokens for decoders run as embedding models (Qwen3-Embedding:
//! a causal pass over whole sequences that keeps no KV, then the last token's row).

use mlxcel_plugin_api::{OpCode, StepDesc, TensorId, POOL_FIRST, POOL_LAST, POOL_MEAN};
use serde_json::Value;

use crate::attention::{RopeInputs, SelfAttention};
use crate::weights::GraphWriter;

/// How token rows become one sentence vector.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pooling {
    Mean,
    Cls,
    LastToken,
}

/// What follows the transformer: pooling, then L2 normalisation when asked.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EmbeddingHead {
    pub pooling: Pooling,
    pub normalize: bool,
}

impl EmbeddingHead {
    /// The head sentence-transformers' metadata `st` describes (`{"modules": [...], "pooling": {...}}`,
    /// see the host's `checkpoint::sentence_transformers`); `default` pools when it names no mode (the
    /// family's convention: mean for encoders, the last token for decoders). Modules other than
    /// Transformer, Pooling and Normalize, and pooling modes other than one of mean / CLS / last token,
    /// are refused by name.
    pub fn from_sentence_transformers(st: &Value, default: Pooling) -> Result<EmbeddingHead, String> {
        let mut normalize = false;
        for m in st.get("modules").and_then(Value::as_array).into_iter().flatten() {
            match m.as_str().unwrap_or("") {
                "Transformer" | "Pooling" => {}
                "Normalize" => normalize = true,
                other => {
                    return Err(format!(
                        "sentence-transformers module `{other}` (modules.json) is not supported; mlxcel runs \
                         Transformer, Pooling and Normalize"
                    ))
                }
            }
        }
        let pooling = match st.get("pooling").and_then(Value::as_object) {
            None => default,
            Some(p) => {
                // sentence-transformers 6 writes `pooling_mode` (a name, or a list of names); older
                // versions one boolean per mode.
                let named: Option<Vec<&str>> = match p.get("pooling_mode") {
                    Some(Value::String(m)) => Some(vec![m.as_str()]),
                    Some(Value::Array(list)) => Some(list.iter().map(|m| m.as_str().unwrap_or("?")).collect()),
                    _ => None,
                };
                if let Some(named) = named {
                    match named.as_slice() {
                        [one] => pooling_by_name(one)?,
                        many => {
                            return Err(format!(
                                "1_Pooling/config.json: pooling_mode {many:?} combines {} modes; mlxcel pools one way",
                                many.len()
                            ))
                        }
                    }
                } else {
                    let on = |k: &str| p.get(k).and_then(Value::as_bool).unwrap_or(false);
                    let modes: Vec<&str> = [
                        "pooling_mode_cls_token",
                        "pooling_mode_mean_tokens",
                        "pooling_mode_lasttoken",
                        "pooling_mode_max_tokens",
                        "pooling_mode_mean_sqrt_len_tokens",
                        "pooling_mode_weightedmean_tokens",
                    ]
                    .into_iter()
                    .filter(|k| on(k))
                    .collect();
                    match modes.as_slice() {
                        ["pooling_mode_cls_token"] => Pooling::Cls,
                        ["pooling_mode_mean_tokens"] => Pooling::Mean,
                        ["pooling_mode_lasttoken"] => Pooling::LastToken,
                        [] => return Err("1_Pooling/config.json turns no pooling mode on".into()),
                        [one] => return Err(format!("1_Pooling/config.json: `{one}` is not supported")),
                        many => {
                            return Err(format!(
                                "1_Pooling/config.json turns on {} pooling modes ({}); mlxcel pools one way",
                                many.len(),
                                many.join(", ")
                            ))
                        }
                    }
                }
            }
        };
        Ok(EmbeddingHead { pooling, normalize })
    }

    /// One row per sequence from the token rows `h [t, width]`: pooled over each sequence's rows
    /// (`seq`: each row's sequence, normally `INPUT_TOKEN_SEQ`), then L2-normalised when asked.
    pub fn forward(&self, w: &mut GraphWriter, h: TensorId, seq: TensorId, n_seqs: u64, width: u64) -> TensorId {
        let mode = match self.pooling {
            Pooling::Mean => POOL_MEAN,
            Pooling::Cls => POOL_FIRST,
            Pooling::LastToken => POOL_LAST,
        };
        let pooled = w.g.op_with(OpCode::SegmentPool, &[n_seqs, width], &[h, seq], &[mode], &[]);
        if self.normalize {
            w.g.op_with(OpCode::L2Normalize, &[n_seqs, width], &[pooled], &[], &[1e-12])
        } else {
            pooled
        }
    }
}

/// Refuses a step a model without KV cannot run: a sequence split over steps, or output rows other than
/// one per sequence.
pub fn check_whole_sequences(step: &StepDesc) -> Result<(), String> {
    if step.n_output_rows != step.n_seqs {
        return Err(format!(
            "an embedding model outputs one row per sequence: the step asks for {} rows from {} sequences",
            step.n_output_rows, step.n_seqs
        ));
    }
    // SAFETY: the host gives arrays of `n_seqs` entries (the ABI's contract for `StepDesc`).
    let (n, ctx) = unsafe { (step.seq_n_tokens(), step.seq_context()) };
    for (s, (&n, &ctx)) in n.iter().zip(ctx).enumerate() {
        if n == 0 || n != ctx {
            return Err(format!(
                "sequence {s} must be whole in its step (an embedding model keeps no KV): {n} tokens, context {ctx}"
            ));
        }
    }
    Ok(())
}

/// A pooling mode by the name sentence-transformers' `pooling_mode` (and llama-server's `--pooling`)
/// gives it.
pub fn pooling_by_name(mode: &str) -> Result<Pooling, String> {
    Ok(match mode {
        "mean" => Pooling::Mean,
        "cls" => Pooling::Cls,
        "lasttoken" | "last" => Pooling::LastToken,
        other => return Err(format!("pooling mode `{other}` is not supported (mean, cls, lasttoken)")),
    })
}

impl SelfAttention {
    /// q, k and v for `t` tokens of `x`: projected, q/k-normed when the model has it, q and k rotated.
    pub(crate) fn project(
        &self,
        w: &mut GraphWriter,
        x: TensorId,
        t: u64,
        rope: &RopeInputs,
        eps: f32,
    ) -> (TensorId, TensorId, TensorId) {
        let s = self.shape;
        let (nh, nkv, hd) = (s.n_heads as u64, s.n_kv_heads as u64, s.head_dim as u64);
        let mut q = w.linear(x, t, &self.q);
        let mut k = w.linear(x, t, &self.k);
        let v = w.linear(x, t, &self.v);
        if let (Some(qn), Some(kn)) = (&self.q_norm, &self.k_norm) {
            if s.norm_plus_one {
                q = w.rms_norm_plus_one(q, &[t, nh * hd], qn, eps);
                k = w.rms_norm_plus_one(k, &[t, nkv * hd], kn, eps);
            } else {
                q = w.rms_norm(q, &[t, nh * hd], qn, eps);
                k = w.rms_norm(k, &[t, nkv * hd], kn, eps);
            }
        }
        let src = |x| [x, rope.positions, rope.inv_freq];
        let q = w.g.op_with(OpCode::Rope, &[t, nh * hd], &src(q), &rope.params, &[rope.mscale]);
        let k = w.g.op_with(OpCode::Rope, &[t, nkv * hd], &src(k), &rope.params, &[rope.mscale]);
        (q, k, v)
    }

    /// [`SelfAttention::forward`] for a pass that keeps no KV: causal attention among the step's own
    /// tokens of each sequence (`seq`: each row's sequence, rows of one sequence contiguous and whole
    /// in the step), with the layer's sliding window. A decoder run as an embedding model uses it.
    pub fn forward_in_step(
        &self,
        w: &mut GraphWriter,
        x: TensorId,
        t: u64,
        seq: TensorId,
        rope: &RopeInputs,
        eps: f32,
    ) -> TensorId {
        let s = self.shape;
        let (nh, nkv, hd) = (s.n_heads as u64, s.n_kv_heads as u64, s.head_dim as u64);
        let (q, k, v) = self.project(w, x, t, rope, eps);
        let attn = w.g.op_with(
            OpCode::StepAttention,
            &[t, nh * hd],
            &[q, k, v, seq],
            &[nh as i64, nkv as i64, hd as i64, 1, s.window as i64],
            &[s.scale.unwrap_or(1.0 / (hd as f32).sqrt()), s.softcap],
        );
        w.linear(attn, t, &self.o)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn sentence_transformers_pooling_and_normalize_are_read() {
        let st = json!({"modules": ["Transformer", "Pooling", "Normalize"],
                        "pooling": {"pooling_mode_lasttoken": true, "pooling_mode_mean_tokens": false}});
        let head = EmbeddingHead::from_sentence_transformers(&st, Pooling::Mean).unwrap();
        assert_eq!(head, EmbeddingHead { pooling: Pooling::LastToken, normalize: true });
        let st = json!({"modules": ["Transformer", "Pooling"], "pooling": {"pooling_mode": "cls"}});
        let head = EmbeddingHead::from_sentence_transformers(&st, Pooling::Mean).unwrap();
        assert_eq!(head, EmbeddingHead { pooling: Pooling::Cls, normalize: false });
        let st = json!({"pooling": {"pooling_mode": ["lasttoken"], "embedding_dimension": 8}});
        let head = EmbeddingHead::from_sentence_transformers(&st, Pooling::Mean).unwrap();
        assert_eq!(head.pooling, Pooling::LastToken);
        // No pooling config: the family's default.
        let st = json!({"modules": ["Transformer", "Pooling", "Normalize"], "pooling": null});
        let head = EmbeddingHead::from_sentence_transformers(&st, Pooling::LastToken).unwrap();
        assert_eq!(head.pooling, Pooling::LastToken);
    }

    #[test]
    fn unsupported_modules_and_pooling_modes_are_refused_by_name() {
        let e = EmbeddingHead::from_sentence_transformers(&json!({"modules": ["Transformer", "Dense"]}), Pooling::Mean)
            .unwrap_err();
        assert!(e.contains("`Dense`"), "{e}");
        let st = json!({"modules": [], "pooling": {"pooling_mode_max_tokens": true}});
        let e = EmbeddingHead::from_sentence_transformers(&st, Pooling::Mean).unwrap_err();
        assert!(e.contains("pooling_mode_max_tokens"), "{e}");
        let st = json!({"pooling": {"pooling_mode_cls_token": true, "pooling_mode_mean_tokens": true}});
        let e = EmbeddingHead::from_sentence_transformers(&st, Pooling::Mean).unwrap_err();
        assert!(e.contains("2 pooling modes"), "{e}");
        assert!(pooling_by_name("max").unwrap_err().contains("`max`"));
        let st = json!({"pooling": {"pooling_mode": ["mean", "max"]}});
        let e = EmbeddingHead::from_sentence_transformers(&st, Pooling::Mean).unwrap_err();
        assert!(e.contains("2 modes"), "{e}");
    }
}
