//! Every token's text, made once per model, for the samplers that read text: the infill sampler
//! (which compares tokens' texts) and DRY (which finds the sequence breakers among them).

use std::sync::Arc;

use crate::text::TextTokenizer;

pub struct TokenTexts {
    texts: Vec<Vec<u8>>,
    special: Vec<bool>,
}

impl TokenTexts {
    pub fn new(tok: &TextTokenizer) -> Arc<TokenTexts> {
        let added = tok.inner.get_added_vocabulary().get_added_tokens_decoder();
        let n = tok.inner.get_vocab_size(true) as u32;
        let texts = (0..n).map(|id| tok.piece_bytes(id)).collect();
        let special = (0..n).map(|id| added.get(&id).is_some_and(|a| a.special)).collect();
        Arc::new(TokenTexts { texts, special })
    }

    /// Texts given by hand, token `i` being `words[i]` (none special).
    #[cfg(test)]
    pub fn for_test(words: &[&str]) -> TokenTexts {
        TokenTexts { texts: words.iter().map(|w| w.as_bytes().to_vec()).collect(), special: vec![false; words.len()] }
    }

    pub fn len(&self) -> usize {
        self.texts.len()
    }

    pub fn is_empty(&self) -> bool {
        self.texts.is_empty()
    }

    /// The token's text, special tokens' included (`<|im_end|>`).
    pub fn full_text(&self, id: u32) -> &[u8] {
        self.texts.get(id as usize).map_or(&[], Vec::as_slice)
    }

    /// The token's text where it is ordinary text; none for a special token.
    pub fn plain_text(&self, id: u32) -> &[u8] {
        match self.special.get(id as usize) {
            Some(false) => self.full_text(id),
            _ => &[],
        }
    }
}
