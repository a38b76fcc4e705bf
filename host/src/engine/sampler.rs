//! Turning logits into the next token: penalties, then top-k, top-p, min-p and temperature, the order
//! llama.cpp applies them in. Temperature 0 is greedy. A seed makes sampling repeatable.

use std::collections::HashMap;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::Value;

/// Sampling settings; every field is honoured.
#[derive(Debug, Clone, PartialEq)]
pub struct SamplingParams {
    /// 0 (or less) = greedy.
    pub temperature: f32,
    /// 0 = disabled.
    pub top_k: usize,
    /// 1.0 = disabled.
    pub top_p: f32,
    /// 0.0 = disabled.
    pub min_p: f32,
    /// Divides positive / multiplies negative logits of recent tokens (1.0 = off).
    pub repeat_penalty: f32,
    /// Subtracted once from every recent token's logit (0 = off).
    pub presence_penalty: f32,
    /// Subtracted per occurrence of a recent token (0 = off).
    pub frequency_penalty: f32,
    /// How many recent tokens the penalties look at (0 = none).
    pub penalty_last_n: usize,
    pub seed: Option<u64>,
}

impl Default for SamplingParams {
    fn default() -> Self {
        // llama.cpp's defaults.
        SamplingParams {
            temperature: 0.8,
            top_k: 40,
            top_p: 0.95,
            min_p: 0.05,
            repeat_penalty: 1.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            penalty_last_n: 64,
            seed: None,
        }
    }
}

impl SamplingParams {
    pub fn greedy() -> Self {
        SamplingParams { temperature: 0.0, ..Default::default() }
    }

    /// Checks ranges; the message names the field.
    pub fn validate(&self) -> Result<(), String> {
        if !self.temperature.is_finite() || self.temperature < 0.0 {
            return Err(format!("temperature must be ≥ 0, got {}", self.temperature));
        }
        if !(0.0..=1.0).contains(&self.top_p) {
            return Err(format!("top_p must be in [0, 1], got {}", self.top_p));
        }
        if !(0.0..=1.0).contains(&self.min_p) {
            return Err(format!("min_p must be in [0, 1], got {}", self.min_p));
        }
        if !self.repeat_penalty.is_finite() || self.repeat_penalty <= 0.0 {
            return Err(format!("repeat_penalty must be > 0, got {}", self.repeat_penalty));
        }
        if !self.presence_penalty.is_finite() || !self.frequency_penalty.is_finite() {
            return Err("presence_penalty and frequency_penalty must be finite".into());
        }
        Ok(())
    }
}

/// Sampling options a person gave (the CLI's flags, the server's): each one set replaces the model's
/// default.
#[derive(Debug, Clone, Default)]
pub struct SamplingOverrides {
    pub temperature: Option<f32>,
    pub top_k: Option<usize>,
    pub top_p: Option<f32>,
    pub min_p: Option<f32>,
    pub repeat_penalty: Option<f32>,
    pub repeat_last_n: Option<usize>,
    pub presence_penalty: Option<f32>,
    pub frequency_penalty: Option<f32>,
    pub seed: Option<u64>,
}

impl SamplingOverrides {
    /// llama.cpp's defaults, then the model's `generation_config.json`, then these flags.
    pub fn resolve(&self, generation_config: Option<&Value>) -> SamplingParams {
        let mut p = SamplingParams::default();
        if let Some(g) = generation_config {
            let f = |k: &str| g.get(k).and_then(Value::as_f64).map(|v| v as f32);
            if let Some(v) = f("temperature") {
                p.temperature = v;
            }
            if let Some(v) = g.get("top_k").and_then(Value::as_u64) {
                p.top_k = v as usize;
            }
            if let Some(v) = f("top_p") {
                p.top_p = v;
            }
            if let Some(v) = f("min_p") {
                p.min_p = v;
            }
            if let Some(v) = f("repetition_penalty") {
                p.repeat_penalty = v;
            }
            if g.get("do_sample") == Some(&Value::Bool(false)) {
                p.temperature = 0.0;
            }
        }
        let o = self;
        p.temperature = o.temperature.unwrap_or(p.temperature);
        p.top_k = o.top_k.unwrap_or(p.top_k);
        p.top_p = o.top_p.unwrap_or(p.top_p);
        p.min_p = o.min_p.unwrap_or(p.min_p);
        p.repeat_penalty = o.repeat_penalty.unwrap_or(p.repeat_penalty);
        p.penalty_last_n = o.repeat_last_n.unwrap_or(p.penalty_last_n);
        p.presence_penalty = o.presence_penalty.unwrap_or(p.presence_penalty);
        p.frequency_penalty = o.frequency_penalty.unwrap_or(p.frequency_penalty);
        p.seed = o.seed.or(p.seed);
        p
    }
}

pub struct Sampler {
    params: SamplingParams,
    rng: StdRng,
}

impl Sampler {
    pub fn new(params: SamplingParams) -> Self {
        let rng = match params.seed {
            Some(s) => StdRng::seed_from_u64(s),
            None => StdRng::from_entropy(),
        };
        Sampler { params, rng }
    }

    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    /// Picks the next token from `logits` given the tokens so far (`history`, for penalties).
    pub fn sample(&mut self, logits: &mut [f32], history: &[u32]) -> u32 {
        let p = &self.params;
        self.apply_penalties(logits, history);
        if p.temperature <= 0.0 {
            return argmax(logits);
        }
        let mut cand: Vec<(u32, f32)> = logits.iter().enumerate().map(|(i, &l)| (i as u32, l)).collect();
        cand.sort_unstable_by(|a, b| b.1.total_cmp(&a.1));
        if p.top_k > 0 && p.top_k < cand.len() {
            cand.truncate(p.top_k);
        }
        // Probabilities at temperature 1 for the top-p / min-p cut, as llama.cpp does.
        let probs = softmax(&cand.iter().map(|c| c.1).collect::<Vec<_>>(), 1.0);
        if p.top_p < 1.0 {
            let mut acc = 0.0;
            let mut keep = cand.len();
            for (i, pr) in probs.iter().enumerate() {
                acc += pr;
                if acc >= p.top_p {
                    keep = i + 1;
                    break;
                }
            }
            cand.truncate(keep.max(1));
        }
        if p.min_p > 0.0 {
            let threshold = probs[0] * p.min_p;
            let keep = probs.iter().take(cand.len()).take_while(|&&pr| pr >= threshold).count();
            cand.truncate(keep.max(1));
        }
        let probs = softmax(&cand.iter().map(|c| c.1).collect::<Vec<_>>(), p.temperature);
        let r: f32 = self.rng.gen();
        let mut acc = 0.0;
        for (c, pr) in cand.iter().zip(&probs) {
            acc += pr;
            if r < acc {
                return c.0;
            }
        }
        cand.last().map_or(0, |c| c.0)
    }

    fn apply_penalties(&self, logits: &mut [f32], history: &[u32]) {
        let p = &self.params;
        let active = p.repeat_penalty != 1.0 || p.presence_penalty != 0.0 || p.frequency_penalty != 0.0;
        if !active || p.penalty_last_n == 0 {
            return;
        }
        let recent = &history[history.len().saturating_sub(p.penalty_last_n)..];
        let mut counts: HashMap<u32, usize> = HashMap::new();
        for &t in recent {
            *counts.entry(t).or_default() += 1;
        }
        for (&t, &n) in &counts {
            let Some(l) = logits.get_mut(t as usize) else { continue };
            if *l > 0.0 {
                *l /= p.repeat_penalty;
            } else {
                *l *= p.repeat_penalty;
            }
            *l -= n as f32 * p.frequency_penalty + p.presence_penalty;
        }
    }
}

pub fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &l) in logits.iter().enumerate() {
        if l > logits[best] {
            best = i;
        }
    }
    best as u32
}

fn softmax(logits: &[f32], temperature: f32) -> Vec<f32> {
    let m = logits.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
    let e: Vec<f32> = logits.iter().map(|l| ((l - m) / temperature).exp()).collect();
    let s: f32 = e.iter().sum();
    e.into_iter().map(|v| v / s).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn temperature_zero_is_argmax() {
        let mut s = Sampler::new(SamplingParams::greedy());
        assert_eq!(s.sample(&mut [0.1, 3.0, 2.0], &[]), 1);
    }

    #[test]
    fn same_seed_gives_same_tokens() {
        let p =
            SamplingParams { temperature: 1.5, top_k: 0, top_p: 1.0, min_p: 0.0, seed: Some(7), ..Default::default() };
        let logits: Vec<f32> = (0..50).map(|i| (i as f32 * 0.37).sin()).collect();
        let run = || {
            let mut s = Sampler::new(p.clone());
            (0..20).map(|_| s.sample(&mut logits.clone(), &[])).collect::<Vec<_>>()
        };
        assert_eq!(run(), run());
        assert!(run().iter().collect::<std::collections::HashSet<_>>().len() > 1, "sampling should vary");
    }

    #[test]
    fn top_k_one_is_greedy_even_when_hot() {
        let p = SamplingParams { temperature: 5.0, top_k: 1, seed: Some(1), ..Default::default() };
        let mut s = Sampler::new(p);
        for _ in 0..10 {
            assert_eq!(s.sample(&mut [0.0, 1.0, 0.5], &[]), 1);
        }
    }

    #[test]
    fn min_p_removes_unlikely_tokens() {
        let p =
            SamplingParams { temperature: 1.0, top_k: 0, top_p: 1.0, min_p: 0.5, seed: Some(3), ..Default::default() };
        let mut s = Sampler::new(p);
        for _ in 0..50 {
            let t = s.sample(&mut [10.0, 9.9, 0.0, -5.0], &[]);
            assert!(t == 0 || t == 1);
        }
    }

    #[test]
    fn repeat_penalty_demotes_seen_tokens() {
        let p = SamplingParams { temperature: 0.0, repeat_penalty: 2.0, ..Default::default() };
        let mut s = Sampler::new(p);
        assert_eq!(s.sample(&mut [3.0, 2.0], &[0]), 1);
    }

    #[test]
    fn frequency_and_presence_penalties_subtract() {
        let p =
            SamplingParams { temperature: 0.0, frequency_penalty: 0.6, presence_penalty: 0.5, ..Default::default() };
        let mut s = Sampler::new(p);
        // token 0: 3.0 - 2*0.6 - 0.5 = 1.3 < 2.0
        assert_eq!(s.sample(&mut [3.0, 2.0], &[0, 0]), 1);
    }
}
