//! llama.cpp's `infill` sampler, which code editors put in their fill-in-the-middle chains
//! (llama.vim's and llama.vscode's: `top_k`, `top_p`, `infill`): between the other cuts it keeps the
//! candidates a fill should choose among —
//!
//! 1. if the ends of generation hold enough of the probability (`3·p_end·n > p_text`), only them;
//! 2. else, tokens whose text starts another's merge their probability into the likelier of the two
//!    (`"re"` and `"return"` are one choice, not two halves of it);
//! 3. text tokens under 0.2 are dropped, then, renormalized, those under `1/(n_text + 1)`;
//! 4. with no text token left, the fill ends (one end token; with none known — `ignore_eos` — the
//!    likeliest candidate).
//!
//! Only which candidates survive matters: the draw that follows weighs them by their own logits.

use super::token_texts::TokenTexts;

/// The candidates (`(id, logit)`, best first) the infill sampler keeps; `ends`: the tokens that end
/// generation (the first stands for them when nothing else is left).
pub fn keep(cand: Vec<(u32, f32)>, texts: Option<&TokenTexts>, ends: &[u32]) -> Vec<(u32, f32)> {
    if cand.is_empty() {
        return cand;
    }
    let is_end = |id: u32| ends.contains(&id);
    let max = cand.iter().map(|c| c.1).fold(f32::NEG_INFINITY, f32::max);
    let mut p: Vec<f32> = cand.iter().map(|c| (c.1 - max).exp()).collect();
    let sum: f32 = p.iter().sum();
    p.iter_mut().for_each(|x| *x /= sum);
    let (mut p_end, mut p_text) = (0.0f32, 0.0f32);
    for (c, &pr) in cand.iter().zip(&p) {
        if is_end(c.0) {
            p_end += pr;
        } else {
            p_text += pr;
        }
    }
    if 3.0 * p_end * cand.len() as f32 > p_text {
        return cand.into_iter().filter(|c| is_end(c.0)).collect();
    }

    // Merge a token into another whose text it starts (or that starts it), keeping the likelier.
    let text = |i: usize| texts.map_or(&[][..], |t| t.plain_text(cand[i].0));
    let mut alive = vec![true; cand.len()];
    for i0 in 0..cand.len() {
        for i1 in 0..cand.len() {
            if !alive[i0] {
                break;
            }
            if i0 == i1 || !alive[i1] {
                continue;
            }
            let (a, b) = (text(i0), text(i1));
            if !a.is_empty() && b.starts_with(a) {
                let (dst, src) = if p[i1] > p[i0] { (i1, i0) } else { (i0, i1) };
                p[dst] += p[src];
                p[src] = 0.0;
                alive[src] = false;
            }
        }
    }

    // Two cuts of unlikely text tokens; ends always stay.
    let kept: Vec<usize> = (0..cand.len()).filter(|&i| alive[i] && (p[i] >= 0.2 || is_end(cand[i].0))).collect();
    let n_text = kept.iter().filter(|&&i| !is_end(cand[i].0)).count();
    if n_text == 0 {
        return vec![(ends.first().copied().unwrap_or(cand[0].0), 1.0)];
    }
    let sum: f32 = kept.iter().map(|&i| p[i]).sum();
    let threshold = 1.0 / (n_text + 1) as f32;
    kept.into_iter().filter(|&i| p[i] / sum >= threshold || is_end(cand[i].0)).map(|i| cand[i]).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn texts(words: &[&str]) -> TokenTexts {
        TokenTexts::for_test(words)
    }

    #[test]
    fn likely_ends_take_over() {
        let t = texts(&["a", "b", "<end>"]);
        // The end holds a fair share: only it stays.
        let kept = keep(vec![(2, 2.0), (0, 1.5), (1, 1.0)], Some(&t), &[2]);
        assert_eq!(kept.iter().map(|c| c.0).collect::<Vec<_>>(), [2]);
    }

    #[test]
    fn tokens_sharing_a_start_are_one_choice_and_unlikely_ones_go() {
        // "re" and "return" merge (into "return", the likelier); "x" is too unlikely to stay.
        let t = texts(&["re", "return", "x", "<end>", "if"]);
        let cand = vec![(1, 3.0), (4, 3.0), (0, 2.9), (2, 0.0), (3, -6.0)];
        let kept: Vec<u32> = keep(cand.clone(), Some(&t), &[3]).iter().map(|c| c.0).collect();
        assert_eq!(kept, [1, 4, 3]);
        // Without texts nothing merges: "re" stays on its own.
        let kept: Vec<u32> = keep(cand, None, &[3]).iter().map(|c| c.0).collect();
        assert_eq!(kept, [1, 4, 0, 3]);
    }

    #[test]
    fn with_no_likely_text_the_fill_ends() {
        let t = texts(&["a", "b", "c", "d", "e", "f", "<end>"]);
        let cand: Vec<(u32, f32)> = (0..6).map(|i| (i, 1.0)).collect();
        assert_eq!(keep(cand, Some(&t), &[6]), [(6, 1.0)]);
    }
}
