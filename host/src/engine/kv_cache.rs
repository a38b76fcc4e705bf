//! The paged KV block pool: fixed-size blocks of cache slots handed to sequences as they grow, so many
//! sequences share one preallocated cache without fragmentation.

/// Free blocks of the pool.
#[derive(Debug)]
pub struct KvBlockPool {
    pub block_size: usize,
    pub num_blocks: usize,
    free: Vec<u32>,
}

/// The blocks one sequence holds, in position order, and how many positions are filled.
#[derive(Debug, Default, Clone)]
pub struct SeqBlocks {
    pub blocks: Vec<u32>,
    pub len: usize,
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
