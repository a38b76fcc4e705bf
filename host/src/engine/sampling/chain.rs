//! The candidate list the samplers cut, and llama.cpp's samplers over it, step for step as
//! `llama-sampling.cpp` writes them (the same comparisons, the same `min_keep` rules, the same order
//! of the survivors) — so a request tuned against llama-server samples the same way here. Only the
//! random numbers differ: each stochastic sampler draws from its own seeded stream, as there, but
//! not from a Mersenne twister.

use rand::rngs::StdRng;
use rand::Rng;

/// A candidate token: its id, logit and, where a sampler computed it, probability.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Cand {
    pub id: u32,
    pub logit: f32,
    pub p: f32,
}

/// The candidates left, and whether they are in order, best first (by logit; equal logits by id).
#[derive(Debug, Clone)]
pub struct Candidates {
    pub items: Vec<Cand>,
    pub sorted: bool,
}

/// Best first; equal logits in id order, the order a backend's top-k returns them in.
fn by_rank(a: &Cand, b: &Cand) -> std::cmp::Ordering {
    b.logit.total_cmp(&a.logit).then(a.id.cmp(&b.id))
}

impl Candidates {
    /// A whole row, in id order.
    pub fn from_row(row: &[f32]) -> Candidates {
        let items = row.iter().enumerate().map(|(i, &logit)| Cand { id: i as u32, logit, p: 0.0 }).collect();
        Candidates { items, sorted: false }
    }

    /// Candidates already best first.
    pub fn from_sorted(items: impl IntoIterator<Item = (u32, f32)>) -> Candidates {
        Candidates { items: items.into_iter().map(|(id, logit)| Cand { id, logit, p: 0.0 }).collect(), sorted: true }
    }

    pub fn len(&self) -> usize {
        self.items.len()
    }

    /// The candidate for token `id`: at index `id` in a whole row still in id order, else searched for.
    pub fn find_mut(&mut self, id: u32) -> Option<&mut Cand> {
        match self.items.get(id as usize) {
            Some(c) if c.id == id => self.items.get_mut(id as usize),
            _ => self.items.iter_mut().find(|c| c.id == id),
        }
    }

    pub fn sort(&mut self) {
        if !self.sorted {
            self.items.sort_unstable_by(by_rank);
            self.sorted = true;
        }
    }

    /// The best `k` first and the rest dropped.
    fn keep_best(&mut self, k: usize) {
        if self.sorted {
            self.items.truncate(k);
            return;
        }
        if k < self.items.len() {
            self.items.select_nth_unstable_by(k.saturating_sub(1), by_rank);
            self.items.truncate(k);
        }
        self.sort();
    }

    /// Each candidate's probability (a softmax of the logits), sorting first where `sort` asks.
    pub fn softmax(&mut self, sort: bool) {
        if sort {
            self.sort();
        }
        let max = self.items.iter().map(|c| c.logit).fold(f32::NEG_INFINITY, f32::max);
        let mut sum = 0.0f32;
        for c in &mut self.items {
            c.p = (c.logit - max).exp();
            sum += c.p;
        }
        for c in &mut self.items {
            c.p /= sum;
        }
    }

    pub fn top_k(&mut self, k: usize) {
        if k > 0 {
            self.keep_best(k.min(self.items.len()));
        }
    }

    /// The fewest best candidates whose probability reaches `p` (at least `min_keep`).
    pub fn top_p(&mut self, p: f32, min_keep: usize) {
        if p >= 1.0 || self.items.is_empty() {
            return;
        }
        self.softmax(false);
        // Most rows are decided by their best few: sort those first, the rest only where needed.
        if !self.sorted && self.items.len() > 1024 {
            let mut head = self.clone();
            head.keep_best(256);
            if let Some(n) = nucleus(&head.items, p, min_keep) {
                *self = head;
                self.items.truncate(n);
                return;
            }
        }
        self.sort();
        let n = nucleus(&self.items, p, min_keep).unwrap_or(self.items.len());
        self.items.truncate(n);
    }

    /// The candidates at least `p` times as likely as the best (at least `min_keep`).
    pub fn min_p(&mut self, p: f32, min_keep: usize) {
        if p <= 0.0 || self.items.is_empty() {
            return;
        }
        if !self.sorted {
            let max = self.items.iter().map(|c| c.logit).fold(-f32::MAX, f32::max);
            let min_logit = max + p.ln();
            let kept = self.items.iter().filter(|c| c.logit >= min_logit).count();
            if kept > 0 && kept >= min_keep {
                self.items.retain(|c| c.logit >= min_logit);
                return;
            }
            self.sort();
        }
        let min_logit = self.items[0].logit + p.ln();
        let n = (1..self.items.len()).find(|&i| self.items[i].logit < min_logit && i >= min_keep);
        self.items.truncate(n.unwrap_or(self.items.len()));
    }

    /// Locally typical sampling: the candidates whose surprise is closest to the entropy, until their
    /// probability passes `p` — in that order, no longer best first.
    pub fn typical(&mut self, p: f32, min_keep: usize) {
        if p >= 1.0 || self.items.is_empty() {
            return;
        }
        self.softmax(true);
        let entropy: f32 = self.items.iter().map(|c| -c.p * c.p.ln()).sum();
        let shifted: Vec<f32> = self.items.iter().map(|c| (-c.p.ln() - entropy).abs()).collect();
        let mut order: Vec<usize> = (0..self.items.len()).collect();
        order.sort_by(|&a, &b| shifted[a].total_cmp(&shifted[b]));
        let mut sum = 0.0f32;
        let mut last = order.len();
        for (i, &idx) in order.iter().enumerate() {
            sum += self.items[idx].p;
            if sum > p && (min_keep == 0 || i + 1 >= min_keep) {
                last = i + 1;
                break;
            }
        }
        self.items = order[..last].iter().map(|&i| self.items[i]).collect();
        self.sorted = false;
    }

    /// Top-nσ: the logits more than `n` standard deviations (of the finite ones) below the best are
    /// masked (kept in place at -inf, as llama.cpp 0.3.36's sampler leaves them).
    pub fn top_n_sigma(&mut self, n: f32) {
        if n <= 0.0 || self.items.len() <= 1 {
            return;
        }
        let finite = || self.items.iter().filter(|c| c.logit != f32::NEG_INFINITY);
        let max = finite().map(|c| c.logit).fold(self.items[0].logit, f32::max);
        let count = finite().count();
        let mean = if count > 0 { finite().map(|c| c.logit).sum::<f32>() / count as f32 } else { 0.0 };
        // (Each square in f64, the sum in f32, as llama.cpp's `acc += pow(d, 2)`.)
        let acc = finite().fold(0f32, |acc, c| (f64::from(acc) + f64::from(c.logit - mean).powi(2)) as f32);
        let std = if count > 0 { (acc / count as f32).sqrt() } else { 0.0 };
        for c in &mut self.items {
            if c.logit < max - n * std {
                c.logit = f32::NEG_INFINITY;
            }
        }
    }

    /// XTC: with probability `probability`, every candidate at least `threshold` likely goes but the
    /// least likely of them.
    pub fn xtc(&mut self, probability: f32, threshold: f32, min_keep: usize, rng: &mut StdRng) {
        if probability <= 0.0 || threshold > 0.5 || self.items.len() < 2 {
            return;
        }
        if rng.gen::<f32>() > probability {
            return;
        }
        self.softmax(true);
        let above = self.items.iter().take_while(|c| c.p >= threshold).count();
        let last_above = above.saturating_sub(1);
        if self.items.len() - last_above >= min_keep && last_above > 0 {
            self.items.drain(..last_above);
        }
    }

    /// Divides the logits by `t`; at `t` ≤ 0 only the first best is left finite.
    pub fn temperature(&mut self, t: f32) {
        if t <= 0.0 {
            let Some(first) = self.items.first() else { return };
            let (mut best, mut best_logit) = (0, first.logit);
            for i in 1..self.items.len() {
                if self.items[i].logit > best_logit {
                    self.items[best].logit = f32::NEG_INFINITY;
                    (best, best_logit) = (i, self.items[i].logit);
                } else {
                    self.items[i].logit = f32::NEG_INFINITY;
                }
            }
            return;
        }
        for c in &mut self.items {
            c.logit /= t;
        }
    }

    /// Temperature, or with `range` > 0, dynamic temperature: between `t ± range`, higher the more
    /// even the candidates' probabilities (their entropy against the most it could be).
    pub fn temperature_ext(&mut self, t: f32, range: f32, exponent: f32) {
        if range <= 0.0 {
            return self.temperature(t);
        }
        let (min_t, max_t) = ((t - range).max(0.0), t + range);
        if self.items.len() <= 1 {
            return;
        }
        let max_entropy = -(1.0 / self.items.len() as f32).ln();
        self.softmax(true);
        let entropy: f32 = self.items.iter().filter(|c| c.p > 0.0).map(|c| -c.p * c.p.ln()).sum();
        let dyn_t = min_t + (max_t - min_t) * (entropy / max_entropy).powf(exponent);
        self.temperature(dyn_t);
        let max = f64::from(self.items[0].logit);
        let e: Vec<f64> = self.items.iter().map(|c| (f64::from(c.logit) - max).exp()).collect();
        let sum: f64 = e.iter().sum();
        for (c, e) in self.items.iter_mut().zip(e) {
            c.p = (e / sum) as f32;
        }
    }

    /// The final draw: a candidate with the probability a softmax of its logit gives it. `None` for
    /// no candidates.
    pub fn draw(&self, rng: &mut StdRng) -> Option<u32> {
        match self.items.len() {
            0 => return None,
            1 => return Some(self.items[0].id),
            _ => {}
        }
        let max = self.items.iter().map(|c| c.logit).fold(f32::NEG_INFINITY, f32::max);
        let weights: Vec<f32> = self.items.iter().map(|c| (c.logit - max).exp()).collect();
        let total: f64 = weights.iter().map(|&w| f64::from(w)).sum();
        let target = total * rng.gen::<f64>();
        let mut run = 0.0f64;
        // A candidate without probability (masked, banned) is never the one drawn.
        for (c, &w) in self.items.iter().zip(&weights) {
            run += f64::from(w);
            if w > 0.0 && run >= target {
                return Some(c.id);
            }
        }
        self.items
            .iter()
            .zip(&weights)
            .rev()
            .find(|(_, &w)| w > 0.0)
            .or(self.items.last().zip(weights.last()))
            .map(|(c, _)| c.id)
    }

    /// A draw weighed by the candidates' probabilities as computed (Mirostat's).
    fn draw_by_p(&self, rng: &mut StdRng) -> usize {
        if self.items.len() < 2 {
            return 0;
        }
        let total: f64 = self.items.iter().map(|c| f64::from(c.p)).sum();
        let u = rng.gen::<f64>();
        let mut cum = 0.0f64;
        for (i, c) in self.items.iter().enumerate() {
            cum += f64::from(c.p) / total;
            if c.p > 0.0 && cum >= u {
                return i;
            }
        }
        // Rounding left `u` past the sum: the last candidate with any probability.
        self.items.iter().rposition(|c| c.p > 0.0).unwrap_or(0)
    }

    /// Mirostat (version 1): estimates the distribution's Zipf exponent from its best `m`, keeps the
    /// top-k that should give surprise `mu`, draws, and moves `mu` toward `tau`.
    pub fn mirostat(&mut self, vocab: usize, tau: f32, eta: f32, mu: &mut f32, rng: &mut StdRng) -> Option<u32> {
        if self.items.is_empty() {
            return None;
        }
        const M: usize = 100;
        self.softmax(true);
        let (mut sum_ti_bi, mut sum_ti_sq) = (0.0f32, 0.0f32);
        for i in 0..(M - 1).min(self.items.len() - 1) {
            let t_i = ((i + 2) as f32 / (i + 1) as f32).ln();
            let b_i = (self.items[i].p / self.items[i + 1].p).ln();
            sum_ti_bi += t_i * b_i;
            sum_ti_sq += t_i * t_i;
        }
        let s_hat = sum_ti_bi / sum_ti_sq;
        let epsilon_hat = s_hat - 1.0;
        let k = ((epsilon_hat * 2f32.powf(*mu)) / (1.0 - (vocab as f32).powf(-epsilon_hat))).powf(1.0 / s_hat);
        // (A degenerate estimate — one token with all the probability — keeps the best alone.)
        let k = if k.is_finite() { (k as i64).clamp(1, i64::from(i32::MAX)) as usize } else { 1 };
        self.top_k(k);
        self.softmax(true);
        let idx = self.draw_by_p(rng);
        let surprise = -self.items[idx].p.log2();
        *mu -= eta * (surprise - tau);
        Some(self.items[idx].id)
    }

    /// Mirostat 2.0: keeps the best candidates whose surprise is at most `mu`, draws, and moves `mu`
    /// toward `tau`.
    pub fn mirostat_v2(&mut self, tau: f32, eta: f32, mu: &mut f32, rng: &mut StdRng) -> Option<u32> {
        if self.items.is_empty() {
            return None;
        }
        self.softmax(true);
        let n = self.items.iter().position(|c| -c.p.log2() > *mu).unwrap_or(self.items.len());
        self.items.truncate(n.max(1));
        self.softmax(true);
        let idx = self.draw_by_p(rng);
        let surprise = -self.items[idx].p.log2();
        *mu -= eta * (surprise - tau);
        Some(self.items[idx].id)
    }
}

/// How many of `sorted` (best first, probabilities set) top-p keeps: the first prefix whose
/// probability reaches `p` and that holds `min_keep`; `None` where no prefix of these does.
fn nucleus(sorted: &[Cand], p: f32, min_keep: usize) -> Option<usize> {
    let mut sum = 0.0f32;
    for (i, c) in sorted.iter().enumerate() {
        sum += c.p;
        if sum >= p && i + 1 >= min_keep {
            return Some(i + 1);
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;

    fn cands(logits: &[f32]) -> Candidates {
        Candidates::from_row(logits)
    }

    fn ids(c: &Candidates) -> Vec<u32> {
        c.items.iter().map(|c| c.id).collect()
    }

    #[test]
    fn top_p_keeps_the_smallest_prefix_reaching_p_and_min_keep() {
        // Probabilities 0.6, 0.3, 0.1 (ids 2, 0, 1).
        let row = [0.3f32.ln(), 0.1f32.ln(), 0.6f32.ln()];
        let mut c = cands(&row);
        c.top_p(0.85, 0);
        assert_eq!(ids(&c), [2, 0]);
        let mut c = cands(&row);
        c.top_p(0.5, 3);
        assert_eq!(ids(&c), [2, 0, 1]);
        // The large-row path (best 256 first) agrees with sorting everything.
        let big: Vec<f32> = (0..5000).map(|i| ((i * 7919 % 5000) as f32 * 0.001).sin() * 3.0).collect();
        for p in [0.01, 0.5, 0.999] {
            let (mut a, mut b) = (cands(&big), cands(&big));
            a.top_p(p, 0);
            b.sort();
            b.top_p(p, 0);
            assert_eq!(ids(&a), ids(&b), "p {p}");
        }
    }

    #[test]
    fn min_p_keeps_order_unsorted_and_honours_min_keep() {
        let row = [1.0f32, 5.0, 4.5, -3.0];
        let mut c = cands(&row);
        c.min_p(0.5, 0);
        assert_eq!((ids(&c), c.sorted), (vec![1, 2], false));
        let mut c = cands(&row);
        c.min_p(0.5, 3);
        assert_eq!((ids(&c), c.sorted), (vec![1, 2, 0], true));
    }

    #[test]
    fn typical_keeps_tokens_near_the_entropy_first() {
        // One dominant token: its surprise is far below the entropy, the middling ones near it.
        let row = [0.5f32.ln(), 0.2f32.ln(), 0.2f32.ln(), 0.1f32.ln()];
        let mut c = cands(&row);
        c.typical(0.3, 0);
        assert!(!c.sorted);
        // Entropy ≈ 1.22 nats; surprises 0.69, 1.61, 1.61, 2.30: the 0.2s are nearest, and 0.4 > 0.3.
        assert_eq!(ids(&c), [1, 2]);
        let mut c = cands(&row);
        c.typical(0.3, 3);
        assert_eq!(ids(&c).len(), 3);
    }

    #[test]
    fn top_n_sigma_masks_far_below_the_best() {
        let row = [10.0f32, 9.5, 0.0, 0.1, -0.2, 0.3, f32::NEG_INFINITY];
        let mut c = cands(&row);
        c.top_n_sigma(1.0);
        let finite: Vec<u32> = c.items.iter().filter(|c| c.logit.is_finite()).map(|c| c.id).collect();
        assert_eq!(finite, [0, 1]);
        assert_eq!(c.items.len(), row.len());
    }

    #[test]
    fn xtc_removes_the_likely_tokens_but_the_least_likely_of_them() {
        let row = [0.4f32.ln(), 0.3f32.ln(), 0.2f32.ln(), 0.1f32.ln()];
        let mut rng = StdRng::seed_from_u64(1);
        let mut c = cands(&row);
        c.xtc(1.0, 0.15, 0, &mut rng);
        assert_eq!(ids(&c), [2, 3]);
        // min_keep larger than what would be left: nothing goes.
        let mut c = cands(&row);
        c.xtc(1.0, 0.15, 3, &mut rng);
        assert_eq!(c.len(), 4);
        // Off above 0.5.
        let mut c = cands(&row);
        c.xtc(1.0, 0.6, 0, &mut rng);
        assert_eq!(c.len(), 4);
    }

    #[test]
    fn zero_temperature_leaves_the_first_best_alone() {
        let mut c = cands(&[1.0, 3.0, 3.0, 2.0]);
        c.temperature(0.0);
        let finite: Vec<u32> = c.items.iter().filter(|c| c.logit.is_finite()).map(|c| c.id).collect();
        assert_eq!(finite, [1]);
    }

    #[test]
    fn dynamic_temperature_rises_with_entropy() {
        // Flat candidates: entropy is at its most, the temperature at t + range.
        let mut c = cands(&[1.0, 1.0, 1.0, 1.0]);
        c.temperature_ext(1.0, 0.5, 1.0);
        assert!(c.items.iter().all(|c| (c.logit - 1.0 / 1.5).abs() < 1e-6));
        // One sure token: the temperature at t − range (greedy where that is 0).
        let mut c = cands(&[0.0, -1e9, -1e9]);
        c.temperature_ext(0.5, 0.5, 1.0);
        assert_eq!(c.items.iter().filter(|c| c.logit.is_finite()).count(), 1);
    }

    #[test]
    fn the_draw_follows_the_softmax_and_skips_masked_candidates() {
        let mut rng = StdRng::seed_from_u64(3);
        let c = cands(&[0.0, 2f32.ln(), f32::NEG_INFINITY]);
        let mut counts = [0; 3];
        for _ in 0..3000 {
            counts[c.draw(&mut rng).unwrap() as usize] += 1;
        }
        assert_eq!(counts[2], 0);
        assert!((1700..2300).contains(&counts[1]), "{counts:?}");
    }

    #[test]
    fn mirostat_v2_keeps_tokens_within_the_surprise_budget_and_adapts() {
        let row: Vec<f32> = (0..50).map(|i| -(i as f32) * 0.5).collect();
        let mut rng = StdRng::seed_from_u64(4);
        let mut mu = 2.0; // surprise ≤ 2 bits: only tokens with p ≥ 0.25
        let mut c = cands(&row);
        let t = c.mirostat_v2(1.0, 0.1, &mut mu, &mut rng).unwrap();
        assert!(c.items.iter().all(|c| c.id <= 1) && t <= 1, "{:?}", ids(&c));
        assert!(mu != 2.0);
        let mut mu = 10.0;
        let mut c = cands(&row);
        c.mirostat(50, 5.0, 0.1, &mut mu, &mut rng).unwrap();
        assert!(!c.items.is_empty() && c.sorted);
    }
}
