//! Turning logits into the next token: penalties, then top-k, top-p, llama.cpp's `infill` (when a
//! request asks for it), min-p and temperature, the order llama.cpp applies them in. Temperature 0
//! is greedy. A seed makes sampling repeatable.

use std::collections::HashMap;
use std::sync::Arc;

use super::infill_sampler::{self, TokenTexts};
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
    /// Added to these tokens' logits before anything else (`-inf` bans a token).
    pub logit_bias: Vec<(u32, f32)>,
    /// llama.cpp's `infill` sampler after top-p (see [`infill_sampler`](super::infill_sampler)).
    pub infill: bool,
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
            logit_bias: Vec::new(),
            infill: false,
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
        if let Some((t, b)) = self.logit_bias.iter().find(|(_, b)| b.is_nan() || *b == f32::INFINITY) {
            return Err(format!("logit_bias of token {t} must be a number or -inf, got {b}"));
        }
        if self.infill && !(1..=MAX_TOP_K_ON_BACKEND).contains(&self.top_k) {
            return Err(format!(
                "samplers with infill need top_k between 1 and {MAX_TOP_K_ON_BACKEND} before it (the infill sampler compares every pair of candidates)"
            ));
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

/// The largest `top_k` the engine has the backend select (llama.cpp's default is 40); a larger one
/// samples from whole rows.
pub const MAX_TOP_K_ON_BACKEND: usize = 128;
/// The most banned tokens (-inf biases) a top-k taken by the backend makes room for.
const MAX_BANS_ON_BACKEND: usize = 16;

pub struct Sampler {
    params: SamplingParams,
    rng: StdRng,
    /// For the infill sampler: the tokens' texts, and the tokens that end generation.
    texts: Option<Arc<TokenTexts>>,
    ends: Vec<u32>,
}

impl Sampler {
    pub fn new(params: SamplingParams) -> Self {
        let rng = match params.seed {
            Some(s) => StdRng::seed_from_u64(s),
            None => StdRng::from_entropy(),
        };
        Sampler { params, rng, texts: None, ends: Vec::new() }
    }

    /// What the infill sampler reads: the tokens' texts and the tokens that end generation.
    pub fn with_vocab(mut self, texts: Arc<TokenTexts>, ends: Vec<u32>) -> Self {
        self.texts = Some(texts);
        self.ends = ends;
        self
    }

    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    /// How many of a row's largest logits this sampler needs, when that is all it needs: greedy
    /// decoding needs 1, top-k sampling `top_k`, and one more for each banned token (a bias of
    /// -inf, as `ignore_eos` bans the ends) that may be among them; penalties (which can lift any
    /// token) need the whole row (`None`), as do other logit biases and sampling without a top-k.
    /// The engine then has the backend select them.
    pub fn top_k_needed(&self) -> Option<usize> {
        let p = &self.params;
        if !self.only_bans() {
            return None;
        }
        let penalties = p.repeat_penalty != 1.0 || p.presence_penalty != 0.0 || p.frequency_penalty != 0.0;
        if penalties && p.penalty_last_n > 0 {
            return None;
        }
        let bans = p.logit_bias.len();
        if p.temperature <= 0.0 && !p.infill {
            return Some(1 + bans);
        }
        (1..=MAX_TOP_K_ON_BACKEND).contains(&p.top_k).then_some(p.top_k + bans)
    }

    /// Whether every logit bias is a ban (-inf; none at all included) and they are few (the ends
    /// `ignore_eos` bans): a long list is cheaper applied to the whole row than asked of the top-k.
    fn only_bans(&self) -> bool {
        let bias = &self.params.logit_bias;
        bias.len() <= MAX_BANS_ON_BACKEND && bias.iter().all(|&(_, b)| b == f32::NEG_INFINITY)
    }

    /// Picks the next token from `logits` given the tokens so far (`history`, for penalties).
    pub fn sample(&mut self, logits: &mut [f32], history: &[u32]) -> u32 {
        for &(t, b) in &self.params.logit_bias {
            if let Some(l) = logits.get_mut(t as usize) {
                *l += b;
            }
        }
        self.apply_penalties(logits, history);
        if self.params.temperature <= 0.0 && !self.params.infill {
            return argmax(logits);
        }
        let mut cand: Vec<(u32, f32)> = logits.iter().enumerate().map(|(i, &l)| (i as u32, l)).collect();
        // Equal logits: the lower id first, the order a backend's top-k returns.
        let by_rank = |a: &(u32, f32), b: &(u32, f32)| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0));
        let k = self.params.top_k;
        if k > 0 && k < cand.len() {
            cand.select_nth_unstable_by(k - 1, by_rank);
            cand.truncate(k);
        }
        cand.sort_unstable_by(by_rank);
        self.pick(cand)
    }

    /// [`Sampler::sample`] from a row's largest logits alone, best first (`ids[i]` has `values[i]`; at
    /// least [`Sampler::top_k_needed`] of them): the same token the whole row would give.
    pub fn sample_top(&mut self, ids: &[u32], values: &[f32]) -> u32 {
        debug_assert!(self.only_bans(), "other biases need the whole row");
        let bans = &self.params.logit_bias;
        let mut cand: Vec<(u32, f32)> = ids
            .iter()
            .copied()
            .zip(values.iter().copied())
            .filter(|(id, _)| !bans.iter().any(|(b, _)| b == id))
            .collect();
        if self.params.temperature <= 0.0 && !self.params.infill {
            return cand.first().map_or(0, |c| c.0);
        }
        if self.params.top_k > 0 {
            cand.truncate(self.params.top_k);
        }
        self.pick(cand)
    }

    /// Top-p, min-p and temperature over candidates sorted best first (after top-k).
    fn pick(&mut self, mut cand: Vec<(u32, f32)>) -> u32 {
        let p = &self.params;
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
        let probs = if p.infill {
            cand = infill_sampler::keep(cand, self.texts.as_deref(), &self.ends);
            softmax(&cand.iter().map(|c| c.1).collect::<Vec<_>>(), 1.0)
        } else {
            probs
        };
        if p.min_p > 0.0 {
            let threshold = probs[0] * p.min_p;
            let keep = probs.iter().take(cand.len()).take_while(|&&pr| pr >= threshold).count();
            cand.truncate(keep.max(1));
        }
        if p.temperature <= 0.0 {
            // Greedy after the infill cut: the best survivor.
            return cand.first().map_or(0, |c| c.0);
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
        // Rounding left `r` past the sum: the last candidate that has any probability (a masked
        // or banned one has none).
        cand.iter()
            .zip(&probs)
            .rev()
            .find(|(_, &pr)| pr > 0.0)
            .or(cand.last().zip(probs.last()))
            .map_or(0, |(c, _)| c.0)
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
    fn logit_bias_moves_and_bans_tokens_and_needs_the_whole_row() {
        let p = SamplingParams { logit_bias: vec![(1, -100.0), (2, 0.5)], ..SamplingParams::greedy() };
        let mut s = Sampler::new(p);
        assert_eq!(s.top_k_needed(), None);
        assert_eq!(s.sample(&mut [0.1, 3.0, 2.0], &[]), 2);
        let p = SamplingParams { logit_bias: vec![(0, f32::NEG_INFINITY)], seed: Some(2), ..Default::default() };
        let mut s = Sampler::new(p.clone());
        for _ in 0..20 {
            assert_ne!(s.sample(&mut [5.0, 1.0, 1.0], &[]), 0);
        }
        assert!(p.validate().is_ok());
        assert!(SamplingParams { logit_bias: vec![(0, f32::NAN)], ..p }.validate().is_err());
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

    /// The token from a row's top-k is the token from the whole row, for greedy and sampled draws.
    #[test]
    fn sampling_from_the_top_k_matches_the_whole_row() {
        let logits: Vec<f32> = (0..500).map(|i| ((i * 37 % 101) as f32 * 0.13).sin() * 4.0).collect();
        let mut order: Vec<u32> = (0..500).collect();
        order.sort_by(|&a, &b| logits[b as usize].total_cmp(&logits[a as usize]).then(a.cmp(&b)));
        let bans = vec![(order[0], f32::NEG_INFINITY), (order[3], f32::NEG_INFINITY), (499, f32::NEG_INFINITY)];
        for params in [
            SamplingParams::greedy(),
            SamplingParams { seed: Some(5), ..Default::default() },
            SamplingParams { temperature: 1.3, top_k: 7, top_p: 1.0, min_p: 0.0, seed: Some(9), ..Default::default() },
            // Banned tokens (ignore_eos bans the ends) among the best: the backend brings back more.
            SamplingParams { logit_bias: bans.clone(), ..SamplingParams::greedy() },
            SamplingParams {
                temperature: 1.3,
                top_k: 7,
                top_p: 1.0,
                min_p: 0.0,
                seed: Some(9),
                logit_bias: bans.clone(),
                ..Default::default()
            },
        ] {
            let k = Sampler::new(params.clone()).top_k_needed().expect("needs only a top-k");
            // A backend may bring back more than asked (the largest any sequence of the step needs).
            let kk = (k + 3).min(order.len());
            let ids = &order[..kk];
            let values: Vec<f32> = ids.iter().map(|&i| logits[i as usize]).collect();
            let (mut whole, mut top) = (Sampler::new(params.clone()), Sampler::new(params.clone()));
            for _ in 0..30 {
                assert_eq!(whole.sample(&mut logits.clone(), &[]), top.sample_top(ids, &values), "{params:?}");
            }
        }
        let penalised = SamplingParams { repeat_penalty: 1.1, ..SamplingParams::greedy() };
        assert_eq!(Sampler::new(penalised).top_k_needed(), None);
        let no_top_k = SamplingParams { top_k: 0, ..Default::default() };
        assert_eq!(Sampler::new(no_top_k).top_k_needed(), None);
        let lifted = SamplingParams { logit_bias: vec![(7, 2.0)], ..SamplingParams::greedy() };
        assert_eq!(Sampler::new(lifted).top_k_needed(), None);
        let many = SamplingParams {
            logit_bias: (0..100).map(|t| (t, f32::NEG_INFINITY)).collect(),
            ..SamplingParams::greedy()
        };
        assert_eq!(Sampler::new(many).top_k_needed(), None);
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

    /// The infill cut runs between top-p and the draw, also before a greedy pick: here the end of
    /// generation holds a fair share of the top three, so only it is left.
    #[test]
    fn infill_cut_runs_before_the_draw() {
        let texts = Arc::new(TokenTexts::for_test(&["a", "b", "c", "<end>"]));
        for temperature in [0.0, 1.0] {
            let p = SamplingParams {
                temperature,
                top_k: 3,
                top_p: 1.0,
                min_p: 0.0,
                infill: true,
                seed: Some(1),
                ..Default::default()
            };
            assert_eq!(p.validate(), Ok(()));
            let mut s = Sampler::new(p).with_vocab(texts.clone(), vec![3]);
            let mut row = [3.0f32, 1.0, 0.9, -5.0];
            // Top-3 leaves a, b, c (no end): the cuts keep only the likeliest.
            assert_eq!(s.sample(&mut row, &[]), 0, "temperature {temperature}");
            let mut s =
                Sampler::new(SamplingParams { top_k: 4, ..s.params.clone() }).with_vocab(texts.clone(), vec![3]);
            // With the end among the candidates and a fair share of them, the end alone.
            let mut row = [3.0f32, 1.0, 0.9, 1.5];
            assert_eq!(s.sample(&mut row, &[]), 3, "temperature {temperature}");
        }
        let no_top_k = SamplingParams { top_k: 0, infill: true, ..Default::default() };
        assert!(no_top_k.validate().unwrap_err().starts_with("samplers"));
    }
}
