//! The tables over a model's vocabulary that the text-reading samplers need — every token's text (the
//! infill sampler, DRY) and DRY's sequence breakers per breaker list — built once and shared by every
//! request. Building one takes milliseconds (SmolLM2's 49K tokens' texts ~33 ms, a breaker list over
//! them 6–16 ms, more on larger vocabularies): the engine's handle builds them on the submitting
//! thread ([`VocabTables::prepare`]), so that the scheduler, where the build would stall every running
//! sequence, finds them ready.

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
        let needs_texts = params.infill() || params.dry_breakers_needed().is_some();
        (!needs_texts || self.texts.get().is_some())
            && params.dry_breakers_needed().is_none_or(|list| self.lock().contains_key(list))
    }

    /// Builds what a sampler for `params` will read (nothing where it reads no text).
    pub fn prepare(&self, params: &SamplingParams) {
        if params.infill() {
            self.texts();
        }
        if let Some(list) = params.dry_breakers_needed() {
            self.breakers(list);
        }
    }

    /// A sampler for `params`; `ends` are the tokens that end generation, which the infill sampler
    /// prefers once its candidates are unsure. Builds any table [`prepare`](Self::prepare) did not.
    pub fn sampler(&self, params: SamplingParams, ends: Vec<u32>) -> Sampler {
        let texts = params.infill().then(|| self.texts());
        let breakers = params.dry_breakers_needed().map(|list| self.breakers(list));
        let mut sampler = Sampler::new(params);
        if let Some(texts) = texts {
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
        if lists.len() >= MAX_BREAKER_LISTS {
            lists.clear();
        }
        lists.insert(list.to_vec(), table.clone());
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
        t.prepare(&p);
        assert!(t.is_ready(&p));
        assert!(t.texts.get().is_some(), "DRY finds its breakers among the tokens' texts");
        assert!(!t.is_ready(&dry(&["\n"])), "another list is another table");

        // The sampler gets the very table prepared, not a new one.
        let prepared = t.lock().get(&p.dry.sequence_breakers).unwrap().clone();
        let sampler = t.sampler(p.clone(), Vec::new());
        assert!(Arc::ptr_eq(sampler.dry.as_ref().unwrap(), &prepared));

        let infill = SamplingParams { chain: vec![Step::Infill], ..Default::default() };
        assert!(t.is_ready(&infill), "the texts DRY built serve the infill sampler");
        assert!(t.sampler(infill, vec![1]).texts.is_some());
    }

    #[test]
    fn breaker_lists_beyond_the_limit_start_the_cache_afresh() {
        let t = tables();
        for i in 0..MAX_BREAKER_LISTS {
            t.prepare(&dry(&[&format!("<{i}>")]));
        }
        assert_eq!(t.lock().len(), MAX_BREAKER_LISTS);
        t.prepare(&dry(&["one more"]));
        assert_eq!(t.lock().len(), 1);
        assert!(t.is_ready(&dry(&["one more"])));
        assert!(!t.is_ready(&dry(&["<0>"])));
    }
}
