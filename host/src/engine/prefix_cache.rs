//! The prefix cache: full KV pages kept after their sequence ends, found again by their contents.
//!
//! A page is keyed by a hash chain — `hash(parent's key, the page's tokens)` — so a key names the whole
//! prefix up to the end of that page, and a new prompt finds the longest run of cached pages by
//! walking its own chain from the start. Entries hold `Arc<KvBlock>`s: a page in use by sequences is
//! shared by reference count, and one only the cache holds is free to evict, least recently used first.
//! Only full pages are ever cached, and a sequence never writes into a page it did not fill itself,
//! so no page is copied on write. A prompt that shares only the head of a cached page (the prefix ends
//! inside it) gets that page's matching positions copied into a page of its own
//! ([`PrefixCache::lookup_partial`]).

use std::collections::HashMap;
use std::hash::{DefaultHasher, Hash, Hasher};
use std::sync::Arc;

use super::kv_cache::KvBlock;

/// Key of the empty prefix, the parent of every first page.
pub const ROOT: u64 = 0;

/// The key of a page holding `tokens`, after the prefix keyed `parent`.
pub fn page_key(parent: u64, tokens: &[u32]) -> u64 {
    let mut h = DefaultHasher::new();
    parent.hash(&mut h);
    tokens.hash(&mut h);
    // Keep ROOT out of the range of real keys.
    h.finish().max(1)
}

struct Entry {
    page: Arc<KvBlock>,
    parent: u64,
    /// The page's tokens, compared on lookup so a hash collision can never return the wrong KV.
    tokens: Box<[u32]>,
    /// Pages from the start of the prompt to this one (1 for a first page).
    depth: usize,
    last_used: u64,
}

/// What a lookup found: the cached pages of a prefix, in order, and the key of the last one.
#[derive(Default)]
pub struct PrefixHit {
    pub pages: Vec<Arc<KvBlock>>,
    pub key: u64,
}

/// Cached full pages by prefix key.
pub struct PrefixCache {
    block_size: usize,
    entries: HashMap<u64, Entry>,
    clock: u64,
}

impl PrefixCache {
    pub fn new(block_size: usize) -> Self {
        PrefixCache { block_size, entries: HashMap::new(), clock: 0 }
    }

    /// Pages the cache holds (shared or not).
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Pages only the cache holds: what eviction can give back.
    pub fn evictable(&self) -> usize {
        self.entries.values().filter(|e| Arc::strong_count(&e.page) == 1).count()
    }

    /// The cached pages of the longest prefix of `tokens` made of whole pages, at most `max_pages`,
    /// marked as just used. The caller holds them (shared) for as long as it reads them.
    pub fn lookup(&mut self, tokens: &[u32], max_pages: usize) -> PrefixHit {
        self.clock += 1;
        let mut found = Vec::new();
        let mut parent = ROOT;
        for chunk in tokens.chunks_exact(self.block_size).take(max_pages) {
            let key = page_key(parent, chunk);
            match self.entries.get_mut(&key) {
                Some(e) if e.parent == parent && *e.tokens == *chunk => {
                    e.last_used = self.clock;
                    found.push(e.page.clone());
                }
                _ => break,
            }
            parent = key;
        }
        PrefixHit { pages: found, key: parent }
    }

    /// After the prefix keyed `parent`, the cached page whose tokens start with the longest run of
    /// `next` (at most a page of the prompt's following tokens), and that run's length, if any; marked
    /// as just used. Its head is what a new sequence may copy instead of computing. Found by a scan
    /// of the entries: one per admission, over at most the pool's pages.
    pub fn lookup_partial(&mut self, parent: u64, next: &[u32]) -> Option<(Arc<KvBlock>, usize)> {
        let common = |e: &Entry| e.tokens.iter().zip(next).take_while(|(a, b)| a == b).count();
        let (n, e) =
            self.entries.values_mut().filter(|e| e.parent == parent).map(|e| (common(e), e)).max_by_key(|(n, _)| *n)?;
        if n == 0 {
            return None;
        }
        self.clock += 1;
        e.last_used = self.clock;
        Some((e.page.clone(), n))
    }

    /// Offers a freshly filled page holding `tokens` (a whole page) after the prefix keyed `parent`, at
    /// depth `depth`; returns its key. If the cache already has that prefix (another sequence computed
    /// it too), the cached page is kept and this one stays its sequence's alone.
    pub fn insert(&mut self, parent: u64, tokens: &[u32], depth: usize, page: &Arc<KvBlock>) -> u64 {
        debug_assert_eq!(tokens.len(), self.block_size);
        self.clock += 1;
        let key = page_key(parent, tokens);
        let clock = self.clock;
        let e = self.entries.entry(key).or_insert_with(|| Entry {
            page: page.clone(),
            parent,
            tokens: tokens.into(),
            depth,
            last_used: clock,
        });
        e.last_used = clock;
        key
    }

    /// Drops the least recently used page no sequence holds (deepest first among equals, so a chain
    /// shrinks from its end); false when every cached page is in use.
    pub fn evict_one(&mut self) -> bool {
        let victim = self
            .entries
            .iter()
            .filter(|(_, e)| Arc::strong_count(&e.page) == 1)
            .min_by_key(|(_, e)| (e.last_used, std::cmp::Reverse(e.depth)))
            .map(|(&k, _)| k);
        match victim {
            Some(k) => {
                self.entries.remove(&k);
                true
            }
            None => false,
        }
    }

    /// Drops every page no sequence holds.
    pub fn clear_unused(&mut self) {
        self.entries.retain(|_, e| Arc::strong_count(&e.page) > 1);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::kv_cache::{KvBlockPool, SeqBlocks};

    /// A sequence of `tokens` with all its whole pages offered to the cache.
    fn fill(pool: &KvBlockPool, cache: &mut PrefixCache, tokens: &[u32]) -> SeqBlocks {
        let mut s = SeqBlocks::new();
        pool.reserve(&mut s, tokens.len()).unwrap();
        let mut parent = ROOT;
        for (i, chunk) in tokens.chunks_exact(pool.block_size).enumerate() {
            parent = cache.insert(parent, chunk, i + 1, s.page(i));
        }
        s
    }

    #[test]
    fn longest_chain_of_whole_pages_is_found() {
        let pool = KvBlockPool::new(16, 4);
        let mut cache = PrefixCache::new(4);
        let a: Vec<u32> = (0..10).collect();
        let s = fill(&pool, &mut cache, &a);
        assert_eq!(cache.len(), 2, "the partial third page is not cached");

        let mut b: Vec<u32> = (0..6).collect();
        b.extend([99, 98, 97]);
        let hit = cache.lookup(&b, usize::MAX).pages;
        assert_eq!(hit.len(), 1, "only the first page matches");
        assert_eq!(hit[0].id(), s.blocks[0]);
        assert_eq!(cache.lookup(&a, 1).pages.len(), 1, "max_pages caps the reuse");
        assert_eq!(cache.lookup(&a, usize::MAX).pages.len(), 2);
        // Same tokens at another depth are another prefix.
        let shifted: Vec<u32> = (4..12).collect();
        assert!(cache.lookup(&shifted, usize::MAX).pages.is_empty());
    }

    #[test]
    fn pages_outlive_their_sequence_until_evicted_least_recently_used_first() {
        let pool = KvBlockPool::new(8, 4);
        let mut cache = PrefixCache::new(4);
        let old: Vec<u32> = (100..108).collect();
        let new: Vec<u32> = (200..208).collect();
        drop(fill(&pool, &mut cache, &old));
        drop(fill(&pool, &mut cache, &new));
        assert_eq!(pool.free_blocks(), 4, "four cached pages stay out of the pool");
        assert_eq!(cache.evictable(), 4);

        let held = cache.lookup(&new, usize::MAX).pages;
        assert_eq!(cache.evictable(), 2, "pages a sequence holds cannot be evicted");
        assert!(cache.evict_one());
        assert!(cache.evict_one());
        assert!(!cache.evict_one(), "the rest are in use");
        assert_eq!(pool.free_blocks(), 6);
        assert!(cache.lookup(&old, usize::MAX).pages.is_empty(), "the older prefix went first");
        drop(held);
        assert_eq!(cache.lookup(&new, usize::MAX).pages.len(), 2);
        cache.clear_unused();
        assert_eq!(pool.free_blocks(), 8);
    }

    #[test]
    fn eviction_takes_the_end_of_a_chain_before_its_start() {
        let pool = KvBlockPool::new(8, 2);
        let mut cache = PrefixCache::new(2);
        let t: Vec<u32> = (0..6).collect();
        drop(fill(&pool, &mut cache, &t));
        drop(cache.lookup(&t, usize::MAX)); // all three used at the same instant
        assert!(cache.evict_one());
        assert_eq!(cache.lookup(&t, usize::MAX).pages.len(), 2, "the third page went, the first two still chain");
    }

    #[test]
    fn the_longest_matching_head_of_a_following_page_is_found() {
        let pool = KvBlockPool::new(16, 4);
        let mut cache = PrefixCache::new(4);
        let a = fill(&pool, &mut cache, &[1, 2, 3, 4, 5, 6, 7, 8]);
        let b = fill(&pool, &mut cache, &[1, 2, 3, 4, 5, 6, 9, 9]);
        let first = cache.lookup(&[1, 2, 3, 4], 1).key;
        let (page, n) = cache.lookup_partial(first, &[5, 6, 7]).unwrap();
        assert_eq!((page.id(), n), (a.blocks[1], 3), "three of a's second page");
        let (page, n) = cache.lookup_partial(first, &[5, 6, 9, 1]).unwrap();
        assert_eq!((page.id(), n), (b.blocks[1], 3));
        assert_eq!(cache.lookup_partial(first, &[5, 6]).map(|(_, n)| n), Some(2));
        assert!(cache.lookup_partial(first, &[7]).is_none(), "no page starts with 7 there");
        assert!(cache.lookup_partial(ROOT, &[5, 6]).is_none(), "5, 6 start no first page");
        assert!(cache.lookup_partial(first, &[]).is_none());
    }

    #[test]
    fn a_prefix_computed_twice_keeps_the_first_page() {
        let pool = KvBlockPool::new(8, 2);
        let mut cache = PrefixCache::new(2);
        let a = fill(&pool, &mut cache, &[1, 2]);
        let b = fill(&pool, &mut cache, &[1, 2]);
        assert_eq!(cache.len(), 1);
        assert_eq!(cache.lookup(&[1, 2], 9).pages[0].id(), a.blocks[0]);
        drop(b);
        assert_eq!(pool.free_blocks(), 7, "b's own copy went back to the pool");
    }
}
