//! DRY ("don't repeat yourself", as llama.cpp and koboldcpp run it): a token that would continue a
//! repeat of earlier text already `n` ≥ `allowed_length` tokens long loses `multiplier · base^(n −
//! allowed_length)` from its logit. Sequence breakers (newlines, `:`, quotes by default) cut the
//! search: a repeat never runs back across one, so the shared scaffolding of a chat (`\nUser:`)
//! goes unpenalised.

use std::collections::HashMap;

use super::chain::Candidates;
use super::params::DryParams;
use super::token_texts::TokenTexts;
use crate::text::TextTokenizer;

/// llama.cpp's limits on a breaker: its first 40 bytes, and 20 tokens of what follows its first one.
const MAX_BREAKER_BYTES: usize = 40;
const MAX_TAIL_TOKENS: usize = 20;

/// The sequence breakers over a vocabulary: for each token that can start one, the token sequences
/// that complete it (an empty one: the token holds a whole breaker by itself).
#[derive(Debug, Default)]
pub struct DryBreakers {
    heads: HashMap<u32, Vec<Vec<u32>>>,
}

impl DryBreakers {
    pub fn new(tok: &TextTokenizer, texts: &TokenTexts, breakers: &[String]) -> DryBreakers {
        let tokenize = |s: &str| tok.encode_literal(s, false).unwrap_or_default();
        DryBreakers::over(texts, breakers, tokenize)
    }

    /// As [`DryBreakers::new`], with `tokenize` for the rest of a breaker after a token's text.
    pub fn over(texts: &TokenTexts, breakers: &[String], tokenize: impl Fn(&str) -> Vec<u32>) -> DryBreakers {
        let mut heads: HashMap<u32, Vec<Vec<u32>>> = HashMap::new();
        for breaker in breakers.iter().filter(|b| !b.is_empty()) {
            let b = &breaker.as_bytes()[..breaker.len().min(MAX_BREAKER_BYTES)];
            // The rest of the breaker after each possible first part, tokenized once.
            let mut tails: HashMap<usize, Vec<u32>> = HashMap::new();
            for id in 0..texts.len() as u32 {
                let word = texts.full_text(id);
                if contains(word, b) {
                    add(&mut heads, id, Vec::new());
                    continue;
                }
                // The word ends with the breaker's first bytes: what follows, as tokens.
                for pos in (0..word.len()).filter(|&p| word[p] == b[0]) {
                    let matched = (word.len() - pos).min(b.len());
                    if word[pos..pos + matched] == b[..matched] && matched < b.len() {
                        let tail = tails.entry(matched).or_insert_with(|| {
                            let mut t = tokenize(&String::from_utf8_lossy(&b[matched..]));
                            t.truncate(MAX_TAIL_TOKENS);
                            t
                        });
                        add(&mut heads, id, tail.clone());
                    }
                }
            }
        }
        DryBreakers { heads }
    }

    /// Whether `id` is a breaker by itself (such a token is never penalised).
    fn whole(&self, id: u32) -> bool {
        self.heads.get(&id).is_some_and(|tails| tails.iter().any(Vec::is_empty))
    }
}

fn contains(word: &[u8], b: &[u8]) -> bool {
    b.is_empty() || word.windows(b.len()).any(|w| w == b)
}

fn add(heads: &mut HashMap<u32, Vec<Vec<u32>>>, id: u32, tail: Vec<u32>) {
    let tails = heads.entry(id).or_default();
    if !tails.contains(&tail) {
        tails.push(tail);
    }
}

/// Lowers the logits of the candidates that would extend a repeat in `history` (the prompt and what
/// followed it), as llama.cpp's DRY sampler does.
pub fn penalize(cand: &mut Candidates, history: &[u32], p: &DryParams, breakers: &DryBreakers) {
    if !p.active() {
        return;
    }
    let n = history.len().min(p.last_n);
    if n <= p.allowed_length {
        return;
    }
    // The i-th most recent token.
    let rat = |i: usize| history[history.len() - 1 - i];

    // 1. The most recent breaker limits how far back a repeat may run.
    let mut rep_limit = n;
    for i in 0..n {
        let Some(tails) = breakers.heads.get(&rat(i)) else { continue };
        let mut longest: Option<usize> = None;
        for tail in tails {
            let len = tail.len();
            if longest.is_none_or(|l| len > l) && len <= i && (0..len).all(|o| tail[o] == rat(i - o - 1)) {
                longest = Some(len);
            }
        }
        if let Some(len) = longest {
            rep_limit = i - len;
            break;
        }
    }
    if rep_limit < p.allowed_length {
        return;
    }

    // 2. For each earlier position, how long the text ending there matches the text ending now (the
    //    Z-algorithm, run backwards; capped at the limit).
    let mut repeat = vec![0usize; n];
    let last = n - 1;
    let (mut lt, mut rt) = (0usize, 0usize);
    for k in 1..n {
        if k > rt {
            let mut m = 0;
            while m + k < n && rat(m) == rat(m + k) {
                m += 1;
            }
            repeat[last - k] = m.min(rep_limit);
            if m > 0 {
                (lt, rt) = (k, k + m - 1);
            }
        } else {
            let pair = k - lt;
            let right_len = rt - k + 1;
            if repeat[last - pair] < right_len {
                repeat[last - k] = repeat[last - pair].min(rep_limit);
            } else {
                let mut i = rt + 1;
                while i < n && rat(i) == rat(i - k) {
                    i += 1;
                }
                repeat[last - k] = (i - k).min(rep_limit);
                (lt, rt) = (k, i - 1);
            }
        }
    }

    // 3. The token that followed each long enough match would continue the repeat: the longest such
    //    repeat per token.
    let mut longest: HashMap<u32, usize> = HashMap::new();
    for (i, &len) in repeat.iter().enumerate().take(n - 1) {
        if len >= p.allowed_length {
            let next = rat(n - 2 - i);
            let e = longest.entry(next).or_insert(len);
            *e = (*e).max(len);
        }
    }

    // 4. The penalty, its exponent capped where the power would overflow an f32.
    let max_exponent = if p.base > 1.000_001 { (88.722_84f32 / p.base.ln()) as i64 } else { 0 };
    for (&id, &len) in &longest {
        if breakers.whole(id) {
            continue;
        }
        let Some(c) = cand.find_mut(id) else { continue };
        let mut exponent = len as i64 - p.allowed_length as i64;
        if max_exponent > 0 && exponent > max_exponent {
            exponent = max_exponent;
        }
        c.logit -= (f64::from(p.multiplier) * f64::from(p.base).powf(exponent as f64)) as f32;
    }
    cand.sorted = false;
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(allowed_length: usize) -> DryParams {
        DryParams { multiplier: 1.0, base: 2.0, allowed_length, last_n: 1000, sequence_breakers: Vec::new() }
    }

    /// The penalties DRY gives each of `vocab` tokens after `history`.
    fn penalties(history: &[u32], vocab: usize, p: &DryParams, b: &DryBreakers) -> Vec<f32> {
        let mut c = Candidates::from_row(&vec![0.0; vocab]);
        penalize(&mut c, history, p, b);
        let mut out = vec![0.0; vocab];
        for c in c.items {
            out[c.id as usize] = -c.logit;
        }
        out
    }

    #[test]
    fn a_token_extending_a_repeat_pays_by_its_length() {
        // 1 2 3 4 … 1 2 3: a 4 would extend a 3-token repeat; "3" itself appeared only once before.
        let history = [1, 2, 3, 4, 9, 9, 1, 2, 3];
        let got = penalties(&history, 10, &params(2), &DryBreakers::default());
        // Length 3 against allowed 2: 2^(3−2) = 2.
        assert_eq!(got[4], 2.0);
        assert!(got.iter().enumerate().all(|(i, &v)| i == 4 || v == 0.0), "{got:?}");
        // Allowed 3: the repeat would become 4 > 3 long, 2^0; allowed 4: no penalty yet.
        assert_eq!(penalties(&history, 10, &params(3), &DryBreakers::default())[4], 1.0);
        assert!(penalties(&history, 10, &params(4), &DryBreakers::default()).iter().all(|&v| v == 0.0));
    }

    #[test]
    fn breakers_cut_the_search_and_are_never_penalised() {
        // Token 5 is a breaker: the repeat 1 5 2 3 counts only after it (2 tokens, 2^0).
        let texts = TokenTexts::for_test(&["a", "b", "c", "d", "e", "\n", "x:", ":y"]);
        let b = DryBreakers::over(&texts, &["\n".into()], |_| Vec::new());
        let history = [1, 5, 2, 3, 4, 1, 5, 2, 3];
        assert_eq!(penalties(&history, 8, &params(2), &b)[4], 1.0);
        assert_eq!(penalties(&history, 8, &params(2), &DryBreakers::default())[4], 4.0);
        // A breaker token that would itself extend a repeat: no penalty on it.
        let history = [1, 2, 5, 7, 1, 2];
        assert_eq!(penalties(&history, 8, &params(1), &b)[5], 0.0);
        assert_eq!(penalties(&history, 8, &params(1), &DryBreakers::default())[5], 2.0);
        // A breaker split over tokens: "x:" ends with its first byte, ":y" holds it whole.
        let b = DryBreakers::over(&texts, &[":y".into()], |rest| if rest == "y" { vec![99] } else { Vec::new() });
        assert_eq!(b.heads.get(&6), Some(&vec![vec![99]]));
        assert!(b.whole(7) && !b.whole(6));
    }
}
