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

use mlxcel_plugin_api::NO_BLOCK;

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
    /// The pages of the sliding-window groups (groups 1.. of a [`KvCache`]).
    pub windows: Vec<WindowPages>,
    /// This sequence's row of recurrent state, if the model has any.
    state: Option<StateSlot>,
    /// Some window page was released: the cached prefix can no longer be cut back.
    pub released: bool,
}

impl SeqBlocks {
    pub fn new() -> Self {
        Self::default()
    }

    /// This sequence's row of recurrent state, once [`KvCache::reserve`] gave it one.
    pub fn state_slot(&self) -> Option<u32> {
        self.state.as_ref().map(|s| s.id)
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

/// A sliding-window group's pages of one sequence: ids in position order, [`NO_BLOCK`] where a page
/// fell out of the window and went back to the pool.
#[derive(Debug, Default)]
pub struct WindowPages {
    ids: Vec<u32>,
    pages: Vec<Option<KvBlock>>,
}

impl WindowPages {
    pub fn ids(&self) -> &[u32] {
        &self.ids
    }
}

/// A row of recurrent state, owned: dropping it returns the row.
struct StateSlot {
    id: u32,
    free: FreeList,
}

impl Drop for StateSlot {
    fn drop(&mut self) {
        lock(&self.free).push(self.id);
    }
}

impl fmt::Debug for StateSlot {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "StateSlot({})", self.id)
    }
}

/// Where a model keeps per-sequence state: one [`KvBlockPool`] per KV group (all full-attention layers
/// share group 0; sliding-window layers of one window size share another) and rows of recurrent state.
/// A sequence's [`SeqBlocks`] holds its pages in each group; a window group releases the pages that
/// fell wholly out of its window, so a long conversation's memory there stays bounded by the window.
/// The block size, count and free pages it reports are group 0's (where the prefix cache lives).
#[derive(Debug)]
pub struct KvCache {
    pub block_size: usize,
    pub num_blocks: usize,
    groups: Vec<KvGroup>,
    state_free: FreeList,
    pub state_slots: usize,
}

/// One KV group: its pool and window (0 = full attention).
#[derive(Debug)]
pub struct KvGroup {
    pub pool: KvBlockPool,
    pub window: usize,
}

impl KvCache {
    /// `windows[g]` is group g's window (0 = full attention), `blocks_per_group[g]` its pages;
    /// `state_slots` rows of recurrent state.
    pub fn new(windows: &[usize], blocks_per_group: &[usize], block_size: usize, state_slots: usize) -> KvCache {
        let groups: Vec<KvGroup> = windows
            .iter()
            .zip(blocks_per_group)
            .map(|(&window, &n)| KvGroup { pool: KvBlockPool::new(n, block_size), window })
            .collect();
        KvCache {
            block_size,
            num_blocks: groups.first().map_or(0, |g| g.pool.num_blocks),
            groups,
            state_free: Arc::new(Mutex::new((0..state_slots as u32).rev().collect())),
            state_slots,
        }
    }

    /// One full-attention group of `num_blocks` pages (most models).
    pub fn single(num_blocks: usize, block_size: usize) -> KvCache {
        KvCache::new(&[0], &[num_blocks], block_size, 0)
    }

    pub fn groups(&self) -> &[KvGroup] {
        &self.groups
    }

    /// Free pages of group 0.
    pub fn free_blocks(&self) -> usize {
        self.groups.first().map_or(0, |g| g.pool.free_blocks())
    }

    /// Pages needed to hold `len` positions.
    pub fn pages_for(&self, len: usize) -> usize {
        len.div_ceil(self.block_size)
    }

    /// Whether a sequence's cached prefix can be shared or cut back: not when a window group releases
    /// pages or recurrent state moves past the prefix.
    pub fn prefix_reusable(&self) -> bool {
        self.state_slots == 0 && self.groups.iter().all(|g| g.window == 0)
    }

    /// Whether a group keeps only a sliding window (letting go of the pages behind it).
    pub fn has_windows(&self) -> bool {
        self.groups.iter().any(|g| g.window > 0)
    }

    /// The page ids of group `g` for `seq`.
    pub fn table<'a>(&self, seq: &'a SeqBlocks, g: usize) -> &'a [u32] {
        if g == 0 {
            &seq.blocks
        } else {
            seq.windows.get(g - 1).map_or(&[], |w| &w.ids)
        }
    }

    /// Grows `seq` so it can hold `new_len` positions in every group (and gives it a state row),
    /// first releasing window pages no token from `seq.len` on can see. All of it, or an error.
    pub fn reserve(&self, seq: &mut SeqBlocks, new_len: usize) -> Result<(), KvFull> {
        if seq.windows.len() + 1 < self.groups.len() {
            seq.windows.resize_with(self.groups.len() - 1, WindowPages::default);
        }
        if self.state_slots > 0 && seq.state.is_none() {
            let id = lock(&self.state_free).pop().ok_or(KvFull { needed: 1, free: 0, block_size: 0 })?;
            seq.state = Some(StateSlot { id, free: self.state_free.clone() });
        }
        let want = self.pages_for(new_len);
        // Check every group first so that a failure takes nothing.
        for (g, group) in self.groups.iter().enumerate().skip(1) {
            let w = &seq.windows[g - 1];
            let first_key = (seq.len + 1).saturating_sub(group.window);
            let releasable = w.pages.iter().take(first_key / self.block_size).filter(|p| p.is_some()).count();
            let needed = want.saturating_sub(w.ids.len());
            if needed > group.pool.free_blocks() + releasable {
                return Err(KvFull { needed, free: group.pool.free_blocks(), block_size: self.block_size });
            }
        }
        if let Some(group) = self.groups.first() {
            group.pool.reserve(seq, new_len)?;
        }
        let mut released = false;
        for (g, group) in self.groups.iter().enumerate().skip(1) {
            // Pages wholly before the first key the next token may see go back to the pool.
            let first_key = (seq.len + 1).saturating_sub(group.window);
            let w = &mut seq.windows[g - 1];
            for (id, page) in w.ids.iter_mut().zip(w.pages.iter_mut()).take(first_key / self.block_size) {
                if page.take().is_some() {
                    *id = NO_BLOCK;
                    released = true;
                }
            }
            while w.ids.len() < want {
                let page = group.pool.alloc().expect("checked above");
                w.ids.push(page.id());
                w.pages.push(Some(page));
            }
        }
        seq.released |= released;
        Ok(())
    }

    /// Forgets positions from `len` on and returns how many stay cached: `len`, or 0 when what is kept
    /// cannot be cut back (released window pages, recurrent state), in which case all is let go.
    pub fn truncate(&self, seq: &mut SeqBlocks, len: usize) -> usize {
        let keep = if len < seq.len && (seq.released || seq.state.is_some()) { 0 } else { len };
        if let Some(group) = self.groups.first() {
            group.pool.truncate(seq, keep);
        }
        let keep_pages = self.pages_for(keep);
        for w in &mut seq.windows {
            w.ids.truncate(keep_pages);
            w.pages.truncate(keep_pages);
        }
        if keep == 0 {
            seq.released = false;
            seq.state = None;
        }
        seq.len = seq.len.min(keep);
        keep
    }

    /// Lets go of everything `seq` holds (dropping the `SeqBlocks` does the same).
    pub fn release(&self, seq: &mut SeqBlocks) {
        self.truncate(seq, 0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn window_groups_release_pages_outside_the_window() {
        // Group 0 full, group 1 a window of 8 positions; pages of 4.
        let cache = KvCache::new(&[0, 8], &[8, 4], 4, 0);
        let mut s = SeqBlocks::default();
        for len in 1..=24 {
            cache.reserve(&mut s, len).unwrap();
            s.len = len;
        }
        assert_eq!(s.blocks.len(), 6);
        let held: Vec<u32> = s.windows[0].ids().iter().copied().filter(|&b| b != NO_BLOCK).collect();
        // The next token (position 24) sees 17..=24: at most 3 pages held, never the 6 a full cache
        // needs, so 4 pages are enough at any length.
        assert!(held.len() <= 3, "{:?}", s.windows[0]);
        assert_eq!(s.windows[0].ids()[0], NO_BLOCK);
        assert!(!cache.prefix_reusable());
        // Cutting back a sequence whose window pages were released starts it over.
        assert_eq!(cache.truncate(&mut s, 10), 0);
        assert_eq!(cache.groups()[0].pool.free_blocks(), 8);
        assert_eq!(cache.groups()[1].pool.free_blocks(), 4);
    }

    #[test]
    fn state_rows_are_given_once_and_return_on_drop() {
        let cache = KvCache::new(&[0], &[4], 4, 2);
        let (mut a, mut b, mut c) = (SeqBlocks::new(), SeqBlocks::new(), SeqBlocks::new());
        cache.reserve(&mut a, 3).unwrap();
        cache.reserve(&mut b, 3).unwrap();
        assert_ne!(a.state_slot(), b.state_slot());
        assert!(cache.reserve(&mut c, 1).is_err(), "two rows for two sequences");
        drop(a);
        cache.reserve(&mut c, 1).unwrap();
        assert!(c.state_slot().is_some());
    }

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
