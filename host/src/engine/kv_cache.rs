//! The paged KV block pool: fixed-size pages of cache slots handed to sequences as they grow, so many
//! sequences share one preallocated cache without fragmentation.
//!
//! Ownership is in the types: a [`KvBlock`] is one page, not `Clone`, and dropping it puts its id back
//! on the pool's free list — exactly once, whoever drops it. Pages are held as `Arc<KvBlock>` so a full
//! page can be shared (by sequences reusing a prefix and by the prefix cache) and returns to the pool
//! when its last holder lets go. Nobody writes into a page it shares: sequences only write positions
//! past their shared prefix, in pages they hold alone.

use std::fmt;
use std::ops::Deref;
use std::sync::{Arc, Mutex, MutexGuard};

/// The pool's free list, shared with every block it handed out so a dropped block can return itself.
type FreeList = Arc<Mutex<Vec<u32>>>;

fn lock(free: &FreeList) -> MutexGuard<'_, Vec<u32>> {
    // A panic while holding this lock cannot leave the list half-updated (push/pop only), so a
    // poisoned lock is still a valid free list.
    free.lock().unwrap_or_else(|e| e.into_inner())
}

/// The KV pages of a model: `num_blocks` pages of `block_size` positions each.
pub struct KvBlockPool {
    pub block_size: usize,
    pub num_blocks: usize,
    free: FreeList,
}

impl fmt::Debug for KvBlockPool {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("KvBlockPool")
            .field("block_size", &self.block_size)
            .field("num_blocks", &self.num_blocks)
            .field("free", &self.free_blocks())
            .finish()
    }
}

/// One page of the pool, owned. Dropping it returns the page.
pub struct KvBlock {
    id: u32,
    free: FreeList,
}

impl KvBlock {
    /// The page's index in the backend's KV cache.
    pub fn id(&self) -> u32 {
        self.id
    }
}

impl Drop for KvBlock {
    fn drop(&mut self) {
        lock(&self.free).push(self.id);
    }
}

impl fmt::Debug for KvBlock {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "KvBlock({})", self.id)
    }
}

/// A sequence's block table as the runner reads it: page ids in position order. Read-only outside
/// this module, so the table can never disagree with the pages the sequence holds.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct BlockTable(Vec<u32>);

impl Deref for BlockTable {
    type Target = [u32];
    fn deref(&self) -> &[u32] {
        &self.0
    }
}

/// The pages one sequence holds, in position order, and how many positions are filled.
#[derive(Debug, Default)]
pub struct SeqBlocks {
    /// Page ids, for the runner.
    pub blocks: BlockTable,
    /// Positions whose keys and values are computed.
    pub len: usize,
    pages: Vec<Arc<KvBlock>>,
}

impl SeqBlocks {
    pub fn new() -> Self {
        Self::default()
    }

    /// How many pages the sequence holds.
    pub fn num_pages(&self) -> usize {
        self.pages.len()
    }

    /// The `i`-th page.
    pub fn page(&self, i: usize) -> &Arc<KvBlock> {
        &self.pages[i]
    }

    /// Appends a page another holder shares (a cached prefix page). Only full pages may be shared.
    pub fn push_shared(&mut self, page: Arc<KvBlock>) {
        self.blocks.0.push(page.id);
        self.pages.push(page);
    }

    fn push(&mut self, page: KvBlock) {
        self.push_shared(Arc::new(page));
    }

    fn pop(&mut self) -> Option<Arc<KvBlock>> {
        self.blocks.0.pop();
        self.pages.pop()
    }
}

#[derive(Debug, thiserror::Error)]
#[error("the KV cache is full: {needed} more blocks of {block_size} tokens needed, {free} free")]
pub struct KvFull {
    pub needed: usize,
    pub free: usize,
    pub block_size: usize,
}

impl KvBlockPool {
    pub fn new(num_blocks: usize, block_size: usize) -> Self {
        // Hand out low block ids first (pop from the back).
        KvBlockPool { block_size, num_blocks, free: Arc::new(Mutex::new((0..num_blocks as u32).rev().collect())) }
    }

    pub fn free_blocks(&self) -> usize {
        lock(&self.free).len()
    }

    /// Pages needed to hold `len` positions.
    pub fn pages_for(&self, len: usize) -> usize {
        len.div_ceil(self.block_size)
    }

    /// Takes one free page.
    pub fn alloc(&self) -> Option<KvBlock> {
        let id = lock(&self.free).pop()?;
        Some(KvBlock { id, free: self.free.clone() })
    }

    /// Grows `seq` so it can hold `new_len` positions: all the pages needed, or none.
    pub fn reserve(&self, seq: &mut SeqBlocks, new_len: usize) -> Result<(), KvFull> {
        let want = self.pages_for(new_len);
        if want <= seq.pages.len() {
            return Ok(());
        }
        let needed = want - seq.pages.len();
        let ids: Vec<u32> = {
            let mut free = lock(&self.free);
            if needed > free.len() {
                return Err(KvFull { needed, free: free.len(), block_size: self.block_size });
            }
            let at = free.len() - needed;
            free.drain(at..).rev().collect()
        };
        for id in ids {
            seq.push(KvBlock { id, free: self.free.clone() });
        }
        Ok(())
    }

    /// Forgets positions from `len` on, letting go of whole pages no longer needed.
    pub fn truncate(&self, seq: &mut SeqBlocks, len: usize) {
        let keep = self.pages_for(len);
        while seq.pages.len() > keep {
            seq.pop();
        }
        seq.len = seq.len.min(len);
    }

    /// Lets go of every page of `seq` (dropping the `SeqBlocks` does the same).
    pub fn release(&self, seq: &mut SeqBlocks) {
        self.truncate(seq, 0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_are_reserved_on_demand_and_returned() {
        let pool = KvBlockPool::new(4, 16);
        let mut s = SeqBlocks::default();
        pool.reserve(&mut s, 17).unwrap();
        assert_eq!(&*s.blocks, &[0, 1]);
        assert_eq!(pool.free_blocks(), 2);
        pool.reserve(&mut s, 32).unwrap();
        assert_eq!(s.blocks.len(), 2);
        assert!(pool.reserve(&mut s, 100).is_err());
        assert_eq!(s.blocks.len(), 2, "a failed reserve takes nothing");
        pool.truncate(&mut s, 5);
        assert_eq!(s.blocks.len(), 1);
        pool.release(&mut s);
        assert_eq!(pool.free_blocks(), 4);
    }

    #[test]
    fn dropping_a_sequence_returns_its_pages() {
        let pool = KvBlockPool::new(8, 4);
        let mut s = SeqBlocks::new();
        pool.reserve(&mut s, 20).unwrap();
        assert_eq!(pool.free_blocks(), 3);
        drop(s);
        assert_eq!(pool.free_blocks(), 8);
    }

    #[test]
    fn a_shared_page_returns_once_when_its_last_holder_lets_go() {
        let pool = KvBlockPool::new(4, 4);
        let mut a = SeqBlocks::new();
        pool.reserve(&mut a, 8).unwrap();
        let mut b = SeqBlocks::new();
        b.push_shared(a.page(0).clone());
        pool.reserve(&mut b, 8).unwrap();
        assert_eq!(b.blocks[0], a.blocks[0]);
        assert_eq!(pool.free_blocks(), 1);
        drop(a);
        assert_eq!(pool.free_blocks(), 2, "page 0 is still held by b");
        drop(b);
        assert_eq!(pool.free_blocks(), 4);
        let mut ids: Vec<u32> = lock(&pool.free).clone();
        ids.sort_unstable();
        assert_eq!(ids, [0, 1, 2, 3], "every page exactly once");
    }
}
