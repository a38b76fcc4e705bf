//! The tables over a model's vocabulary that the text-reading samplers need — every token's text (the
//! infill sampler, DRY) and DRY's sequence breakers per breaker list — built once and shared by every
//! request. Building one takes milliseconds (SmolLM2's 49K tokens' texts ~33 ms, a breaker list over
//! them 6–16 ms, more on larger vocabularies): the engine's handle builds each request's sampler on
//! the submitting thread, so that the scheduler, where the build would stall every running sequence,
//! gets it made.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};

use super::dry::DryBreakers;
use super::params::SamplingParams;
use super::token_texts::TokenTexts;
use super::Sampler;
use crate::text::TextTokenizer;

/// Breaker lists kept at once: a few are in use at a time, and a client sending ever new ones gets
/// no cache.
const MAX_BREAKER_LISTS: usize = 16;

pub struct VocabTables {
    tokenizer: Arc<TextTokenizer>,
    texts: OnceLock<Arc<TokenTexts>>,
    breakers: Mutex<HashMap<Vec<String>, Arc<DryBreakers>>>,
}

impl VocabTables {
    pub fn new(tokenizer: Arc<TextTokenizer>) -> Self {
        VocabTables { tokenizer, texts: OnceLock::new(), breakers: Mutex::new(HashMap::new()) }
    }

    /// Whether a sampler for `params` can be made without building anything.
    pub fn is_ready(&self, params: &SamplingParams) -> bool {
        (!params.reads_token_texts() || self.texts.get().is_some())
            && params.dry_breakers_needed().is_none_or(|list| self.lock().contains_key(list))
    }

    /// A sampler for `params`, building any table it reads that no request built before. `ends`:
    /// the tokens that end generation beside the model's end-of-sequence ones (none at all where
    /// ends are ignored), which the infill sampler prefers once its candidates are unsure.
    pub fn sampler(&self, params: SamplingParams, end_tokens: &[u32], ignore_eos: bool) -> Sampler {
        let texts = params.infill().then(|| self.texts());
        let breakers = params.dry_breakers_needed().map(|list| self.breakers(list));
        let mut sampler = Sampler::new(params);
        if let Some(texts) = texts {
            // With ends ignored, the infill sampler has none to prefer (llama.cpp bans them then).
            let ends = match ignore_eos {
                true => Vec::new(),
                false => self.tokenizer.eos_ids.iter().chain(end_tokens).copied().collect(),
            };
            sampler = sampler.with_vocab(texts, ends);
        }
        if let Some(breakers) = breakers {
            sampler = sampler.with_dry_breakers(breakers);
        }
        sampler
    }

    fn texts(&self) -> Arc<TokenTexts> {
        self.texts.get_or_init(|| TokenTexts::new(&self.tokenizer)).clone()
    }

    fn breakers(&self, list: &[String]) -> Arc<DryBreakers> {
        if let Some(table) = self.lock().get(list) {
            return table.clone();
        }
        // Built outside the lock, so that a lookup (the scheduler's) never waits on a build; two
        // requests bringing the same new list at once may both build it.
        let table = Arc::new(DryBreakers::new(&self.tokenizer, &self.texts(), list));
        let mut lists = self.lock();
        // (The tables let go are dropped after the lock.)
        let dropped = (lists.len() >= MAX_BREAKER_LISTS).then(|| std::mem::take(&mut *lists));
        lists.insert(list.to_vec(), table.clone());
        drop(lists);
        drop(dropped);
        table
    }

    fn lock(&self) -> MutexGuard<'_, HashMap<Vec<String>, Arc<DryBreakers>>> {
        self.breakers.lock().unwrap_or_else(|e| e.into_inner())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::sampling::{DryParams, Step};

    fn tables() -> VocabTables {
        let dir = crate::testing::workspace_root().join("families/llama/tests/fixtures/qwen3-f32");
        VocabTables::new(Arc::new(TextTokenizer::load(&dir, &serde_json::json!({}), None).unwrap()))
    }

    fn dry(breakers: &[&str]) -> SamplingParams {
        let dry = DryParams {
            multiplier: 0.8,
            sequence_breakers: breakers.iter().map(|b| b.to_string()).collect(),
            ..Default::default()
        };
        SamplingParams { dry, ..Default::default() }
    }

    #[test]
    fn a_prepared_request_finds_its_tables_built() {
        let t = tables();
        let plain = SamplingParams::default();
        assert!(t.is_ready(&plain), "a sampler that reads no text needs no table");
        let p = dry(&["\n", ":"]);
        assert!(!t.is_ready(&p));
        let first = t.sampler(p.clone(), &[], false);
        assert!(t.is_ready(&p));
        assert!(t.texts.get().is_some(), "DRY finds its breakers among the tokens' texts");
        assert!(!t.is_ready(&dry(&["\n"])), "another list is another table");

        // The next sampler gets the very table built, not a new one.
        let second = t.sampler(p.clone(), &[], false);
        assert!(Arc::ptr_eq(second.dry.as_ref().unwrap(), first.dry.as_ref().unwrap()));

        let infill = SamplingParams { chain: vec![Step::Infill], ..Default::default() };
        assert!(t.is_ready(&infill), "the texts DRY built serve the infill sampler");
        let s = t.sampler(infill.clone(), &[7], false);
        assert!(s.texts.is_some());
        assert_eq!(s.ends, [t.tokenizer.eos_ids.clone(), vec![7]].concat());
        assert!(t.sampler(infill, &[7], true).ends.is_empty(), "ignored ends are none to prefer");
    }

    #[test]
    fn breaker_lists_beyond_the_limit_start_the_cache_afresh() {
        let t = tables();
        for i in 0..MAX_BREAKER_LISTS {
            t.sampler(dry(&[&format!("<{i}>")]), &[], false);
        }
        assert_eq!(t.lock().len(), MAX_BREAKER_LISTS);
        t.sampler(dry(&["one more"]), &[], false);
        assert_eq!(t.lock().len(), 1);
        assert!(t.is_ready(&dry(&["one more"])));
        assert!(!t.is_ready(&dry(&["<0>"])));
    }
}
