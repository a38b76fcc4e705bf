//! Turning logits into the next token with llama.cpp's samplers: penalties, DRY, top-nσ, top-k,
//! typical-p, top-p, min-p, XTC and (dynamic) temperature — in that order unless a request lists
//! another — then a draw; or Mirostat (1 or 2) in place of all of them. llama.cpp's `infill`
//! sampler runs where a request lists it. Temperature 0 is greedy. A seed makes sampling repeatable.

mod chain;
pub mod dry;
pub mod infill;
mod params;
pub mod token_texts;
mod vocab_tables;

#[cfg(test)]
mod reference_tests;

use std::collections::HashMap;
use std::sync::Arc;

use rand::rngs::StdRng;
use rand::SeedableRng;

use chain::Candidates;
pub use dry::DryBreakers;
pub use params::{DryParams, SamplingOverrides, SamplingParams, Step};
pub use token_texts::TokenTexts;
pub use vocab_tables::VocabTables;

/// The largest `top_k` the engine has the backend select (llama.cpp's default is 40); a larger one
/// samples from whole rows.
pub const MAX_TOP_K_ON_BACKEND: usize = 128;
/// The most banned tokens (-inf biases) a top-k taken by the backend makes room for.
const MAX_BANS_ON_BACKEND: usize = 16;

pub struct Sampler {
    params: SamplingParams,
    /// The final draw's random numbers (and Mirostat's), and XTC's: separate streams, as in
    /// llama.cpp, so that switching XTC on does not change the draws.
    draw_rng: StdRng,
    xtc_rng: StdRng,
    /// Mirostat's surprise target as it adapts (starts at 2τ).
    mu: f32,
    /// For the infill sampler: the tokens' texts, and the tokens that end generation.
    texts: Option<Arc<TokenTexts>>,
    ends: Vec<u32>,
    /// DRY's sequence breakers over the model's vocabulary.
    dry: Option<Arc<DryBreakers>>,
}

impl Sampler {
    pub fn new(params: SamplingParams) -> Self {
        let rng = |salt: u64| match params.seed {
            Some(s) => StdRng::seed_from_u64(s ^ salt),
            None => StdRng::from_entropy(),
        };
        Sampler {
            draw_rng: rng(0),
            xtc_rng: rng(0x0078_7463),
            mu: 2.0 * params.mirostat_tau,
            params,
            texts: None,
            ends: Vec::new(),
            dry: None,
        }
    }

    /// What the infill sampler reads: the tokens' texts and the tokens that end generation.
    pub fn with_vocab(mut self, texts: Arc<TokenTexts>, ends: Vec<u32>) -> Self {
        self.texts = Some(texts);
        self.ends = ends;
        self
    }

    /// DRY's sequence breakers over this model's vocabulary (see [`SamplingParams::dry_breakers_needed`]).
    pub fn with_dry_breakers(mut self, breakers: Arc<DryBreakers>) -> Self {
        self.dry = Some(breakers);
        self
    }

    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    /// Whether the token is the best one after the steps that move logits: temperature 0 (without a
    /// dynamic range), and no sampler that may drop the best token (typical-p, XTC, infill).
    fn greedy(&self) -> bool {
        let p = &self.params;
        if p.temperature > 0.0 {
            return false;
        }
        if p.mirostat > 0 {
            return true;
        }
        p.dynatemp_range <= 0.0
            && p.runs(Step::Temperature)
            && !p.chain.iter().any(|&s| matches!(s, Step::TypicalP | Step::Xtc | Step::Infill) && p.acts(s))
    }

    /// Whether a step that moves logits (penalties, DRY) acts before a greedy pick: the pick is then
    /// the best after every step before the temperature, not simply the row's best.
    fn moves_before_greedy(&self) -> bool {
        let p = &self.params;
        p.mirostat == 0
            && p.chain
                .iter()
                .take_while(|&&s| s != Step::Temperature)
                .any(|&s| matches!(s, Step::Penalties | Step::Dry) && p.acts(s))
    }

    /// The greedy pick from `cand`: the first best after the steps before the temperature (where
    /// some move logits; the cuts among them keep the best, so alone they change nothing).
    fn greedy_pick(&mut self, mut cand: Candidates, history: &[u32]) -> u32 {
        if self.moves_before_greedy() {
            let before = self.params.chain.iter().take_while(|&&s| s != Step::Temperature).count();
            for i in 0..before {
                self.apply(self.params.chain[i], &mut cand, history);
            }
        }
        let best = cand.items.iter().fold(None::<chain::Cand>, |best, c| match best {
            Some(b) if b.logit >= c.logit => Some(b),
            _ => Some(*c),
        });
        best.map_or(0, |c| c.id)
    }

    /// How many of a row's largest logits this sampler needs, when that is all it needs: greedy
    /// decoding needs 1, sampling whose first cut is a top-k `top_k`, and one more for each banned
    /// token (a bias of -inf, as `ignore_eos` bans the ends) that may be among them. Penalties and
    /// DRY before the top-k (they can lift any token), other logit biases, and samplers that read the
    /// whole distribution before a top-k (top-p, typical-p, top-nσ, Mirostat) need the whole row
    /// (`None`); penalties and DRY after it move only its survivors.
    /// The engine then has the backend select them.
    pub fn top_k_needed(&self) -> Option<usize> {
        let p = &self.params;
        if !self.only_bans() {
            return None;
        }
        let bans = p.logit_bias.len();
        if self.greedy() && !self.moves_before_greedy() {
            return Some(1 + bans);
        }
        if p.mirostat > 0 {
            return None;
        }
        for &step in p.chain.iter().filter(|&&s| p.acts(s)) {
            match step {
                Step::TopK => return (1..=MAX_TOP_K_ON_BACKEND).contains(&p.top_k).then_some(p.top_k + bans),
                // Cuts and scalings that keep the best candidates best: a top-k after them takes the
                // same tokens from the row's top as from the whole row.
                Step::Temperature if p.temperature > 0.0 && p.dynatemp_range <= 0.0 => {}
                Step::MinP if p.min_keep == 0 => {}
                _ => return None,
            }
        }
        None
    }

    /// Whether every logit bias is a ban (-inf; none at all included) and they are few (the ends
    /// `ignore_eos` bans): a long list is cheaper applied to the whole row than asked of the top-k.
    fn only_bans(&self) -> bool {
        let bias = &self.params.logit_bias;
        bias.len() <= MAX_BANS_ON_BACKEND && bias.iter().all(|&(_, b)| b == f32::NEG_INFINITY)
    }

    /// Picks the next token from `logits` given the tokens so far (`history`: the prompt and what
    /// followed it, for penalties and DRY).
    pub fn sample(&mut self, logits: &mut [f32], history: &[u32]) -> u32 {
        for &(t, b) in &self.params.logit_bias {
            if let Some(l) = logits.get_mut(t as usize) {
                *l += b;
            }
        }
        let vocab = logits.len();
        if self.greedy() {
            if !self.moves_before_greedy() {
                return argmax(logits);
            }
            return self.greedy_pick(Candidates::from_row(logits), history);
        }
        self.run(Candidates::from_row(logits), history, vocab)
    }

    /// [`Sampler::sample`] from a row's largest logits alone, best first (`ids[i]` has `values[i]`; at
    /// least [`Sampler::top_k_needed`] of them): the same token the whole row would give. (Penalties
    /// and DRY after the top-k move the survivors' logits by `history`.)
    pub fn sample_top(&mut self, ids: &[u32], values: &[f32], history: &[u32]) -> u32 {
        debug_assert!(self.only_bans(), "other biases need the whole row");
        let bans = &self.params.logit_bias;
        let cand = Candidates::from_sorted(
            ids.iter().copied().zip(values.iter().copied()).filter(|(id, _)| !bans.iter().any(|(b, _)| b == id)),
        );
        if self.greedy() {
            return self.greedy_pick(cand, history);
        }
        let vocab = cand.len();
        self.run(cand, history, vocab)
    }

    /// The chain over `cand`, then the draw (or Mirostat in place of both).
    fn run(&mut self, mut cand: Candidates, history: &[u32], vocab: usize) -> u32 {
        let p = &self.params;
        if p.mirostat > 0 {
            cand.temperature(p.temperature);
            let (tau, eta) = (p.mirostat_tau, p.mirostat_eta);
            let token = match p.mirostat {
                1 => cand.mirostat(vocab, tau, eta, &mut self.mu, &mut self.draw_rng),
                _ => cand.mirostat_v2(tau, eta, &mut self.mu, &mut self.draw_rng),
            };
            return token.unwrap_or(0);
        }
        for i in 0..self.params.chain.len() {
            self.apply(self.params.chain[i], &mut cand, history);
        }
        cand.draw(&mut self.draw_rng).unwrap_or(0)
    }

    /// One sampler of the chain.
    fn apply(&mut self, step: Step, cand: &mut Candidates, history: &[u32]) {
        let p = &self.params;
        match step {
            Step::Penalties => penalize(cand, history, p),
            Step::Dry => {
                let none = DryBreakers::default();
                dry::penalize(cand, history, &p.dry, self.dry.as_deref().unwrap_or(&none));
            }
            Step::TopNSigma => cand.top_n_sigma(p.top_n_sigma),
            Step::TopK => cand.top_k(p.top_k),
            Step::TypicalP => cand.typical(p.typical_p, p.min_keep),
            Step::TopP => cand.top_p(p.top_p, p.min_keep),
            Step::MinP => cand.min_p(p.min_p, p.min_keep),
            Step::Xtc => cand.xtc(p.xtc_probability, p.xtc_threshold, p.min_keep, &mut self.xtc_rng),
            Step::Temperature => cand.temperature_ext(p.temperature, p.dynatemp_range, p.dynatemp_exponent),
            Step::Infill => {
                cand.sort();
                let pairs = cand.items.iter().map(|c| (c.id, c.logit)).collect();
                let kept = infill::keep(pairs, self.texts.as_deref(), &self.ends);
                *cand = Candidates::from_sorted(kept);
                cand.sorted = false;
            }
        }
    }
}

/// Repeat, frequency and presence penalties on the candidates among the last `penalty_last_n`
/// tokens of `history`.
fn penalize(cand: &mut Candidates, history: &[u32], p: &SamplingParams) {
    if !p.acts(Step::Penalties) {
        return;
    }
    let recent = &history[history.len().saturating_sub(p.penalty_last_n)..];
    let mut counts: HashMap<u32, usize> = HashMap::new();
    for &t in recent {
        *counts.entry(t).or_default() += 1;
    }
    for (&t, &n) in &counts {
        let Some(c) = cand.find_mut(t) else { continue };
        if c.logit <= 0.0 {
            c.logit *= p.repeat_penalty;
        } else {
            c.logit /= p.repeat_penalty;
        }
        c.logit -= n as f32 * p.frequency_penalty + p.presence_penalty;
    }
    cand.sorted = false;
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
        // The best tokens said before, some twice (for the penalties and DRY after a top-k).
        let history: Vec<u32> = [order[1], order[2], order[5], order[1], order[2]].to_vec();
        let dry = DryParams { multiplier: 2.0, base: 1.5, allowed_length: 1, ..Default::default() };
        for params in [
            SamplingParams::greedy(),
            SamplingParams { seed: Some(5), ..Default::default() },
            SamplingParams { temperature: 1.3, top_k: 7, top_p: 1.0, min_p: 0.0, seed: Some(9), ..Default::default() },
            // llama.cpp's other samplers after the top-k: they read only its survivors.
            SamplingParams { typical_p: 0.8, min_keep: 2, seed: Some(2), ..Default::default() },
            SamplingParams { xtc_probability: 0.7, xtc_threshold: 0.05, seed: Some(3), ..Default::default() },
            SamplingParams { dynatemp_range: 0.5, dynatemp_exponent: 1.5, seed: Some(4), ..Default::default() },
            // Order-keeping steps before the top-k.
            SamplingParams {
                chain: vec![Step::Temperature, Step::MinP, Step::TopK, Step::TopP],
                seed: Some(5),
                ..Default::default()
            },
            // Penalties and DRY after the top-k move only its survivors; greedy picks after them.
            SamplingParams {
                repeat_penalty: 1.5,
                frequency_penalty: 0.5,
                chain: vec![Step::TopK, Step::Penalties, Step::Dry, Step::Temperature],
                dry: dry.clone(),
                seed: Some(6),
                ..Default::default()
            },
            SamplingParams {
                top_k: 3,
                repeat_penalty: 3.0,
                chain: vec![Step::TopK, Step::Penalties, Step::Temperature],
                ..SamplingParams::greedy()
            },
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
                let want = whole.sample(&mut logits.clone(), &history);
                assert_eq!(want, top.sample_top(ids, &values, &history), "{params:?}");
            }
        }
        // Samplers that read or move the whole row first.
        for whole in [
            SamplingParams { top_n_sigma: 1.0, ..Default::default() },
            SamplingParams { mirostat: 2, ..Default::default() },
            SamplingParams { dry: DryParams { multiplier: 0.8, ..Default::default() }, ..Default::default() },
            SamplingParams { dry: DryParams { multiplier: 0.8, ..Default::default() }, ..SamplingParams::greedy() },
            SamplingParams { chain: vec![Step::TopP, Step::TopK], ..Default::default() },
            SamplingParams { typical_p: 0.5, top_k: 0, ..SamplingParams::greedy() },
        ] {
            assert_eq!(Sampler::new(whole.clone()).top_k_needed(), None, "{whole:?}");
        }
        // Greedy under Mirostat, and with DRY left out of the chain: the best token alone.
        let greedy_mirostat = SamplingParams { mirostat: 1, ..SamplingParams::greedy() };
        assert_eq!(Sampler::new(greedy_mirostat).top_k_needed(), Some(1));
        let no_dry = SamplingParams {
            dry: DryParams { multiplier: 0.8, ..Default::default() },
            chain: vec![Step::TopK, Step::Temperature],
            ..SamplingParams::greedy()
        };
        assert_eq!(Sampler::new(no_dry).top_k_needed(), Some(1));
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

    /// Greedy decoding still takes DRY's penalty, and a sampler that may drop the best token
    /// (typical-p, XTC) is not skipped at temperature 0.
    #[test]
    fn greedy_picks_after_dry_and_runs_cuts_that_drop_the_best() {
        let dry = DryParams { multiplier: 5.0, base: 2.0, allowed_length: 1, last_n: 100, sequence_breakers: vec![] };
        let mut s = Sampler::new(SamplingParams { dry, ..SamplingParams::greedy() });
        // After 1 2 … 1, a 2 would repeat "1 2": it loses 5 and 3 wins.
        assert_eq!(s.sample(&mut [0.0, 0.0, 3.0, 2.5], &[1, 2, 3, 1]), 3);
        // Typical-p keeps the tokens nearest the entropy: here not the likeliest (0.4 against 0.15s).
        let p = SamplingParams { typical_p: 0.2, top_k: 0, ..SamplingParams::greedy() };
        let mut s = Sampler::new(p);
        let mut row = [0.4f32.ln(), 0.15f32.ln(), 0.15f32.ln(), 0.15f32.ln(), 0.15f32.ln()];
        assert_eq!(s.sample(&mut row, &[]), 1);
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
                chain: vec![Step::TopK, Step::TopP, Step::Infill, Step::MinP, Step::Temperature],
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
        let no_top_k = SamplingParams { top_k: 0, chain: vec![Step::TopK, Step::Infill], ..Default::default() };
        assert!(no_top_k.validate().unwrap_err().starts_with("samplers"));
    }
}
