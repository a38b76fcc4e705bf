//! Rotary frequencies for the scaling types a config can name, computed the way mlx-lm does
//! (`mlx_lm/models/rope_utils.py`). The backend only sees the final inverse frequencies.

use mlxcel_plugin_api::{Graph, StepDesc, TensorId};
use serde_json::Value;

/// Inverse frequencies `[dims/2]` and the cos/sin scale (YaRN's attention factor, else 1).
#[derive(Debug, Clone)]
pub struct RopeFreqs {
    pub inv_freq: Vec<f32>,
    pub mscale: f32,
    /// Dynamic NTK: the frequencies depend on the context length; recompute with [`dynamic_inv_freq`].
    pub dynamic: Option<DynamicNtk>,
}

#[derive(Debug, Clone, Copy)]
pub struct DynamicNtk {
    pub base: f64,
    pub factor: f64,
    pub max_positions: f64,
    pub dims: usize,
}

fn base_freqs(dims: usize, base: f64) -> Vec<f64> {
    // freqs[i] = base^(2i/dims) (a period multiplier); inv_freq = 1 / freqs.
    (0..dims / 2).map(|i| base.powf((2 * i) as f64 / dims as f64)).collect()
}

fn inv(freqs: &[f64]) -> Vec<f32> {
    freqs.iter().map(|f| (1.0 / f) as f32).collect()
}

fn num(v: &Value, key: &str) -> Option<f64> {
    v.get(key).and_then(Value::as_f64)
}

/// Frequencies for `dims` rotary dims with `base`, `scaling` (config's `rope_scaling`) and
/// `max_positions` (config's `max_position_embeddings`).
pub fn rope_freqs(dims: usize, base: f64, scaling: Option<&Value>, max_positions: usize) -> Result<RopeFreqs, String> {
    let plain = |scale: f64| RopeFreqs {
        inv_freq: base_freqs(dims, base).iter().map(|f| (scale / f) as f32).collect(),
        mscale: 1.0,
        dynamic: None,
    };
    let Some(s) = scaling else { return Ok(plain(1.0)) };
    let kind = s.get("type").or_else(|| s.get("rope_type")).and_then(Value::as_str).unwrap_or("default");
    let factor = || num(s, "factor").ok_or_else(|| format!("rope_scaling type `{kind}` needs `factor`"));
    match kind {
        "default" => Ok(plain(1.0)),
        // Linear scaling divides positions by the factor, i.e. the frequencies.
        "linear" => Ok(plain(1.0 / factor()?)),
        "dynamic" => {
            let d = DynamicNtk { base, factor: factor()?, max_positions: max_positions as f64, dims };
            Ok(RopeFreqs { inv_freq: dynamic_inv_freq(&d, max_positions), mscale: 1.0, dynamic: Some(d) })
        }
        "llama3" => {
            let factor = factor()?;
            let low = num(s, "low_freq_factor").unwrap_or(1.0);
            let high = num(s, "high_freq_factor").unwrap_or(4.0);
            let old = num(s, "original_max_position_embeddings").unwrap_or(8192.0);
            let (low_wl, high_wl) = (old / low, old / high);
            let freqs: Vec<f64> = base_freqs(dims, base)
                .into_iter()
                .map(|f| {
                    let wl = 2.0 * std::f64::consts::PI * f;
                    let f2 = if wl > low_wl { f * factor } else { f };
                    if wl > high_wl && wl < low_wl {
                        let smooth = (old / wl - low) / (high - low);
                        f2 / ((1.0 - smooth) / factor + smooth)
                    } else {
                        f2
                    }
                })
                .collect();
            Ok(RopeFreqs { inv_freq: inv(&freqs), mscale: 1.0, dynamic: None })
        }
        "yarn" => {
            let factor = factor()?;
            let orig = num(s, "original_max_position_embeddings").unwrap_or(4096.0);
            let beta_fast = num(s, "beta_fast").unwrap_or(32.0);
            let beta_slow = num(s, "beta_slow").unwrap_or(1.0);
            let mscale = num(s, "mscale").unwrap_or(1.0);
            let mscale_all = num(s, "mscale_all_dim").unwrap_or(0.0);
            let d = dims as f64;
            let corr = |rot: f64| d * (orig / (rot * 2.0 * std::f64::consts::PI)).ln() / (2.0 * base.ln());
            let lo = corr(beta_fast).floor().max(0.0);
            let hi = corr(beta_slow).ceil().min(d - 1.0);
            let hi = if lo == hi { hi + 0.001 } else { hi };
            let get_mscale = |m: f64| if factor <= 1.0 { 1.0 } else { 0.1 * m * factor.ln() + 1.0 };
            let extra = base_freqs(dims, base);
            let freqs: Vec<f64> = extra
                .iter()
                .enumerate()
                .map(|(i, &fe)| {
                    let ramp = ((i as f64 - lo) / (hi - lo)).clamp(0.0, 1.0);
                    let mask = 1.0 - ramp;
                    let fi = factor * fe;
                    (fi * fe) / (fi * mask + fe * (1.0 - mask))
                })
                .collect();
            Ok(RopeFreqs {
                inv_freq: inv(&freqs),
                mscale: (get_mscale(mscale) / get_mscale(mscale_all)) as f32,
                dynamic: None,
            })
        }
        "longrope" | "su" => {
            let long = factors(s, "long_factor", dims)?;
            let orig = num(s, "original_max_position_embeddings")
                .ok_or_else(|| format!("rope_scaling type `{kind}` needs `original_max_position_embeddings`"))?;
            Ok(su_scaled(dims, base, &long, max_positions, orig as usize))
        }
        other => Err(format!(
            "rope_scaling type `{other}` is not supported (default, linear, dynamic, llama3, yarn, longrope)"
        )),
    }
}

/// `rope_scaling[key]`: one factor per frequency (`dims / 2` of them).
pub fn factors(scaling: &Value, key: &str, dims: usize) -> Result<Vec<f64>, String> {
    let v: Vec<f64> = scaling
        .get(key)
        .and_then(Value::as_array)
        .ok_or_else(|| format!("rope_scaling needs a list `{key}`"))?
        .iter()
        .map(|f| f.as_f64().ok_or_else(|| format!("rope_scaling `{key}` holds a non-number")))
        .collect::<Result<_, _>>()?;
    if v.len() != dims / 2 {
        return Err(format!(
            "rope_scaling `{key}` has {} factors for {dims} rotary dims (needs {})",
            v.len(),
            dims / 2
        ));
    }
    Ok(v)
}

/// LongRoPE ("su") as mlx-lm's `SuScaledRoPE` runs it: every period stretched by its `long_factor`
/// (at every context length: mlx-lm never uses `short_factor`), and the rotated dims scaled by
/// `sqrt(1 + ln(max / original) / ln(original))` when the context was extended.
pub fn su_scaled(dims: usize, base: f64, long_factor: &[f64], max_positions: usize, original: usize) -> RopeFreqs {
    let freqs: Vec<f64> = base_freqs(dims, base).iter().zip(long_factor).map(|(f, l)| f * l).collect();
    let factor = max_positions as f64 / original as f64;
    let mscale = if factor <= 1.0 { 1.0 } else { (1.0 + factor.ln() / (original as f64).ln()).sqrt() };
    RopeFreqs { inv_freq: inv(&freqs), mscale: mscale as f32, dynamic: None }
}

/// Dynamic NTK: the base grows once the context exceeds the trained length.
pub fn dynamic_inv_freq(d: &DynamicNtk, context_len: usize) -> Vec<f32> {
    let seq = (context_len as f64).max(d.max_positions);
    let dims = d.dims as f64;
    let base = d.base * ((d.factor * seq / d.max_positions) - (d.factor - 1.0)).powf(dims / (dims - 2.0));
    inv(&base_freqs(d.dims, base))
}

/// The frequencies of one step as a graph constant: one row `[1, dims/2]` shared by every token, or,
/// for context-dependent scaling (dynamic NTK), one row per token computed from that token's own
/// sequence length, so a sequence's result never depends on what it is batched with.
pub fn step_inv_freq(g: &mut Graph, freqs: &RopeFreqs, step: &StepDesc) -> TensorId {
    let Some(dy) = &freqs.dynamic else {
        return g.constant_f32(&freqs.inv_freq, &[1, freqs.inv_freq.len() as u64]);
    };
    // SAFETY: the host gives `n_seqs` entries in each per-sequence array.
    let (counts, contexts) = unsafe { (step.seq_n_tokens(), step.seq_context()) };
    let half = dy.dims / 2;
    let mut rows = Vec::with_capacity(step.n_tokens as usize * half);
    for (&n, &ctx) in counts.iter().zip(contexts) {
        let f = dynamic_inv_freq(dy, ctx as usize);
        for _ in 0..n {
            rows.extend_from_slice(&f);
        }
    }
    let n_rows = (rows.len() / half.max(1)) as u64;
    g.constant_f32(&rows, &[n_rows, half as u64])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dynamic_frequencies_follow_each_sequence_not_the_batch() {
        let s: Value = serde_json::json!({"type": "dynamic", "factor": 2.0});
        let f = rope_freqs(8, 10000.0, Some(&s), 16).unwrap();
        let counts = [2u32, 1];
        let contexts = [40u32, 5];
        let step = StepDesc {
            n_tokens: 3,
            n_seqs: 2,
            n_output_rows: 2,
            seq_n_tokens: counts.as_ptr(),
            seq_context: contexts.as_ptr(),
            ..mlxcel_plugin_api::Versioned::zeroed()
        };
        let mut g = Graph::new();
        let id = step_inv_freq(&mut g, &f, &step);
        assert_eq!(g.node(id).dims(), &[3, 4]);
        let vals: Vec<f32> =
            g.constants.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect();
        assert_eq!(&vals[0..4], &dynamic_inv_freq(f.dynamic.as_ref().unwrap(), 40)[..]);
        assert_eq!(&vals[4..8], &vals[0..4]);
        // The short sequence is below the trained length: plain frequencies, whatever its batch-mate.
        assert_eq!(&vals[8..12], &rope_freqs(8, 10000.0, None, 16).unwrap().inv_freq[..]);
    }

    #[test]
    fn default_rope_matches_the_textbook_formula() {
        let f = rope_freqs(8, 10000.0, None, 2048).unwrap();
        assert_eq!(f.inv_freq.len(), 4);
        assert!((f.inv_freq[1] - 10000f32.powf(-2.0 / 8.0)).abs() < 1e-7);
    }

    #[test]
    fn linear_scaling_divides_frequencies() {
        let s: Value = serde_json::json!({"type": "linear", "factor": 4.0});
        let f = rope_freqs(8, 10000.0, Some(&s), 2048).unwrap();
        let p = rope_freqs(8, 10000.0, None, 2048).unwrap();
        assert!((f.inv_freq[2] * 4.0 - p.inv_freq[2]).abs() < 1e-7);
    }

    #[test]
    fn longrope_stretches_periods_by_the_long_factors() {
        let s: Value = serde_json::json!({"type": "longrope", "long_factor": [1.0, 2.0], "short_factor": [1.0, 1.0],
                                          "original_max_position_embeddings": 32});
        let f = rope_freqs(4, 10000.0, Some(&s), 512).unwrap();
        assert_eq!(f.inv_freq[0], 1.0);
        assert!((f.inv_freq[1] - 1.0 / (2.0 * 100.0)).abs() < 1e-9);
        assert!((f.mscale - (1.0 + 16f32.ln() / 32f32.ln()).sqrt()).abs() < 1e-6);
        let short: Value = serde_json::json!({"type": "longrope", "long_factor": [1.0]});
        assert!(rope_freqs(4, 10000.0, Some(&short), 512).unwrap_err().contains("long_factor"));
    }

    #[test]
    fn unknown_scaling_is_refused_by_name() {
        let s: Value = serde_json::json!({"type": "warp", "factor": 4.0});
        assert!(rope_freqs(8, 10000.0, Some(&s), 2048).unwrap_err().contains("warp"));
    }
}
