//! The paged KV block pool: fixed-size blocks of cache slots handed to sequences as they grow, so many
//! sequences share one preallocated cache without fragmentation.

/// Free blocks of the pool.
#[derive(Debug)]
pub struct KvBlockPool {
    pub block_size: usize,
    pub num_blocks: usize,
    pub(crate) free: Vec<u32>,
}

/// The blocks one sequence holds, in position order, and how many positions are filled.
#[derive(Debug, Default, Clone)]
pub struct SeqBlocks {
    /// Group 0's table (see [`KvCache`]).
    pub blocks: Vec<u32>,
    pub len: usize,
    /// The tables of groups 1.. (sliding windows); released pages are `NO_BLOCK`.
    pub windows: Vec<Vec<u32>>,
    /// This sequence's row of recurrent state, if the model has any.
    pub state_slot: Option<u32>,
    /// Some window page was released (the cached prefix can no longer be cut back).
    pub released: bool,
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
        KvBlockPool { block_size, num_blocks, free: (0..num_blocks as u32).rev().collect() }
    }

    pub fn free_blocks(&self) -> usize {
        self.free.len()
    }

    /// Grows `seq` so it can hold `new_len` positions.
    pub fn reserve(&mut self, seq: &mut SeqBlocks, new_len: usize) -> Result<(), KvFull> {
        let want = new_len.div_ceil(self.block_size);
        if want <= seq.blocks.len() {
            return Ok(());
        }
        let needed = want - seq.blocks.len();
        if needed > self.free.len() {
            return Err(KvFull { needed, free: self.free.len(), block_size: self.block_size });
        }
        for _ in 0..needed {
            seq.blocks.push(self.free.pop().expect("checked above"));
        }
        Ok(())
    }

    /// Forgets positions from `len` on, returning whole blocks no longer needed.
    pub fn truncate(&mut self, seq: &mut SeqBlocks, len: usize) {
        let keep = len.div_ceil(self.block_size);
        while seq.blocks.len() > keep {
            self.free.push(seq.blocks.pop().unwrap());
        }
        seq.len = seq.len.min(len);
    }

    /// Returns every block of `seq` to the pool.
    pub fn release(&mut self, seq: &mut SeqBlocks) {
        self.truncate(seq, 0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_sequence_that_never_reserved_truncates_to_nothing() {
        // A new session's first generate cuts its (empty) cached prefix before reserving anything.
        let mut cache = KvCache::new(&[0, 8], &[8, 4], 4, 0);
        let mut s = SeqBlocks::default();
        assert_eq!(cache.truncate(&mut s, 0), 0);
        cache.reserve(&mut s, 5).unwrap();
        assert_eq!((s.blocks.len(), s.windows[0].len()), (2, 2));
    }

    #[test]
    fn window_groups_release_pages_outside_the_window() {
        use mlxcel_plugin_api::NO_BLOCK;
        // Group 0 full, group 1 a window of 8 positions; blocks of 4.
        let mut cache = KvCache::new(&[0, 8], &[8, 4], 4, 0);
        let mut s = SeqBlocks::default();
        for len in 1..=24 {
            cache.reserve(&mut s, len).unwrap();
            s.len = len;
        }
        assert_eq!(s.blocks.len(), 6);
        let held: Vec<u32> = s.windows[0].iter().copied().filter(|&b| b != NO_BLOCK).collect();
        // Positions 16..24 (the next token at 24 sees 17..=24): at most 3 pages held, never the 6 a
        // full cache needs, so 4 blocks are enough for any length.
        assert!(held.len() <= 3, "{:?}", s.windows[0]);
        assert_eq!(s.windows[0][0], NO_BLOCK);
        assert!(!cache.prefix_reusable());
        // Cutting back a sequence whose window pages were released recomputes from scratch.
        assert_eq!(cache.truncate(&mut s, 10), 0);
        assert_eq!(cache.groups()[0].pool.free_blocks(), 8);
        assert_eq!(cache.groups()[1].pool.free_blocks(), 4);
    }

    #[test]
    fn blocks_are_reserved_on_demand_and_returned() {
        let mut pool = KvBlockPool::new(4, 16);
        let mut s = SeqBlocks::default();
        pool.reserve(&mut s, 17).unwrap();
        assert_eq!(s.blocks.len(), 2);
        assert_eq!(pool.free_blocks(), 2);
        pool.reserve(&mut s, 32).unwrap();
        assert_eq!(s.blocks.len(), 2);
        assert!(pool.reserve(&mut s, 100).is_err());
        pool.truncate(&mut s, 5);
        assert_eq!(s.blocks.len(), 1);
        pool.release(&mut s);
        assert_eq!(pool.free_blocks(), 4);
    }
}

/// Where a model keeps per-sequence state: one [`KvBlockPool`] per KV group (all full-attention layers
/// share group 0; sliding-window layers of one window size share another) and rows of recurrent state.
/// A sequence's [`SeqBlocks`] holds its table in each group; a window group releases the pages that
/// fell wholly out of its window, so a long conversation's memory there stays bounded by the window.
#[derive(Debug)]
pub struct KvCache {
    pub block_size: usize,
    /// Group 0's blocks (the full-attention group when the model has one).
    pub num_blocks: usize,
    groups: Vec<KvGroup>,
    free_state_slots: Vec<u32>,
    pub state_slots: usize,
}

/// One KV group: its pool and window (0 = full attention).
#[derive(Debug)]
pub struct KvGroup {
    pub pool: KvBlockPool,
    pub window: usize,
}

impl KvCache {
    /// `windows[g]` is group g's window (0 = full attention); `state_slots` rows of recurrent state.
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
            free_state_slots: (0..state_slots as u32).rev().collect(),
            state_slots,
        }
    }

    pub fn groups(&self) -> &[KvGroup] {
        &self.groups
    }

    /// Free blocks of group 0.
    pub fn free_blocks(&self) -> usize {
        self.groups.first().map_or(0, |g| g.pool.free_blocks())
    }

    /// Whether a sequence's cached prefix can be reused by truncating it: not when a window group
    /// released pages or recurrent state has moved past the prefix.
    pub fn prefix_reusable(&self) -> bool {
        self.state_slots == 0 && self.groups.iter().all(|g| g.window == 0)
    }

    /// The table of group `g` for `seq`.
    pub fn table<'a>(&self, seq: &'a SeqBlocks, g: usize) -> &'a [u32] {
        if g == 0 {
            &seq.blocks
        } else {
            &seq.windows[g - 1]
        }
    }

    /// Grows `seq` so it can hold `new_len` positions in every group (and gives it a state row), first
    /// releasing window pages no token from `seq.len` on can see.
    pub fn reserve(&mut self, seq: &mut SeqBlocks, new_len: usize) -> Result<(), KvFull> {
        if seq.windows.len() + 1 < self.groups.len() {
            seq.windows.resize(self.groups.len() - 1, Vec::new());
        }
        if self.state_slots > 0 && seq.state_slot.is_none() {
            let slot = self.free_state_slots.pop().ok_or(KvFull { needed: 1, free: 0, block_size: 0 })?;
            seq.state_slot = Some(slot);
        }
        let want = new_len.div_ceil(self.block_size);
        for (g, group) in self.groups.iter_mut().enumerate() {
            let table = if g == 0 { &mut seq.blocks } else { &mut seq.windows[g - 1] };
            if group.window > 0 {
                // Pages wholly before the first key the next token may see.
                let first_key = (seq.len + 1).saturating_sub(group.window);
                for b in table.iter_mut().take(first_key / self.block_size) {
                    if *b != mlxcel_plugin_api::NO_BLOCK {
                        group.pool.free.push(*b);
                        *b = mlxcel_plugin_api::NO_BLOCK;
                        seq.released = true;
                    }
                }
            }
            let needed = want.saturating_sub(table.len());
            if needed > group.pool.free.len() {
                return Err(KvFull { needed, free: group.pool.free.len(), block_size: self.block_size });
            }
            for _ in 0..needed {
                table.push(group.pool.free.pop().expect("checked above"));
            }
        }
        Ok(())
    }

    /// Forgets positions from `len` on and returns how many stay cached: `len`, or 0 when the state
    /// kept cannot be cut back (released window pages, recurrent state), in which case all is released.
    pub fn truncate(&mut self, seq: &mut SeqBlocks, len: usize) -> usize {
        let keep = if len < seq.len && (seq.released || seq.state_slot.is_some()) { 0 } else { len };
        let keep_blocks = keep.div_ceil(self.block_size);
        for (g, group) in self.groups.iter_mut().enumerate() {
            // A sequence that never reserved has no window tables yet.
            let table = match g {
                0 => &mut seq.blocks,
                _ => match seq.windows.get_mut(g - 1) {
                    Some(t) => t,
                    None => continue,
                },
            };
            while table.len() > keep_blocks {
                let b = table.pop().unwrap();
                if b != mlxcel_plugin_api::NO_BLOCK {
                    group.pool.free.push(b);
                }
            }
        }
        if keep == 0 {
            seq.released = false;
            if let Some(slot) = seq.state_slot.take() {
                self.free_state_slots.push(slot);
            }
        }
        seq.len = seq.len.min(keep);
        keep
    }

    /// Returns everything `seq` holds.
    pub fn release(&mut self, seq: &mut SeqBlocks) {
        self.truncate(seq, 0);
    }
}
