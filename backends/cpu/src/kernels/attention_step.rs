//! Attention among a step's own tokens, without the cache (encoders; whole-prompt passes that keep no
//! KV): each sequence's tokens attend to each other, causally or both ways, through the prefill tile
//! kernel with keys read straight from the step's K/V rows. No padding: sequences of any lengths
//! share one step.

use crate::pool;

use super::attention::AttentionShape;
use super::attention_prefill::{attend_tile_scratch, tile_tokens, Run, TileKeys};
use super::{Segment, SharedMut};
use crate::isa::Isa;

/// Which keys of its sequence a token sees.
#[derive(Clone, Copy, Debug)]
pub struct Mask {
    pub causal: bool,
    /// 0 = no limit; causal: the last `window` keys (itself included); bidirectional: keys at most
    /// `window` away on either side.
    pub window: usize,
}

impl Mask {
    /// Keys `lo..hi` that token `i` of a sequence of `len` tokens sees.
    #[inline]
    pub fn visible(self, i: usize, len: usize) -> (usize, usize) {
        match (self.causal, self.window) {
            (true, 0) => (0, i + 1),
            (true, w) => ((i + 1).saturating_sub(w), i + 1),
            (false, 0) => (0, len),
            (false, w) => (i.saturating_sub(w), (i + w + 1).min(len)),
        }
    }
}

/// `out[t, h*Dh..]` = attention of token `t` over the keys of its own segment that `mask` lets it
/// see. `q`/`out` are `[T, Hq*Dh]`, `k`/`v` `[T, Hkv*Dh]`; `segs` cover the rows to compute.
#[allow(clippy::too_many_arguments)]
pub fn step_attention(
    isa: Isa,
    shape: AttentionShape,
    mask: Mask,
    segs: &[Segment],
    q: &[f32],
    k: &[f32],
    v: &[f32],
    out: &mut [f32],
) {
    let kv_row = shape.n_kv_heads * shape.head_dim;
    let per_tile = tile_tokens(shape);
    // Tasks: (segment, tile of its tokens, KV head), the most keys first so the last tasks are short.
    let mut tasks: Vec<(Segment, Run, usize, usize)> = Vec::new();
    for &seg in segs {
        let mut t0 = seg.start;
        while t0 < seg.end {
            let tile = Run { start: t0, end: (t0 + per_tile).min(seg.end) };
            let lo = mask.visible(tile.start - seg.start, seg.len()).0;
            let hi = mask.visible(tile.end - 1 - seg.start, seg.len()).1;
            tasks.extend((0..shape.n_kv_heads).map(|h| (seg, tile, h, hi.saturating_sub(lo))));
            t0 = tile.end;
        }
    }
    tasks.sort_by_key(|t| std::cmp::Reverse(t.3));
    let out = SharedMut(out.as_mut_ptr());
    pool::for_each(tasks.len(), |task| {
        let (seg, tile, kvh, _) = tasks[task];
        let len = seg.len();
        let keys = TileKeys {
            k: &k[seg.start * kv_row..seg.end * kv_row],
            v: &v[seg.start * kv_row..seg.end * kv_row],
            row: |p: usize| p * kv_row,
            visible: |i: usize| mask.visible(tile.start - seg.start + i, len),
        };
        // SAFETY: visible keys are rows of this segment's K/V; each task writes only its tile's rows of
        // its KV head's query heads.
        unsafe { attend_tile_scratch(isa, shape, tile, kvh, q, &keys, out) }
    });
}
