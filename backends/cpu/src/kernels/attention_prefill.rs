//! Attention for runs of prompt tokens (prefill): flash-attention tiling. A tile of query tokens ×
//! the query heads of one KV head meets the context in blocks of keys; scores and the weighted sum of
//! values are matrix products (`gemm`), the softmax is online (a running max and sum per query row),
//! so every key and value row is read once per tile instead of once per query head and token.

use crate::pool;

use super::attention::{AttentionShape, PagedLayout};
use super::kv_elem::KvElem;
use super::math::exp_approx;
use super::matmul::gemm_rows;
use super::SharedMut;
use crate::isa::Isa;
use crate::simd_kernel;

/// Query tokens per tile.
const TILE_TOKENS: usize = 16;

/// Query rows (tokens × the query heads of one KV head) a tile of the cache-free kernels aims for:
/// their keys are gathered once per tile, so bigger tiles than the paged path's pay off.
const TILE_ROWS: usize = 64;

/// Query tokens per tile for the cache-free kernels, given how many query heads share a KV head.
pub fn tile_tokens(shape: AttentionShape) -> usize {
    (TILE_ROWS / (shape.n_heads / shape.n_kv_heads).max(1)).max(TILE_TOKENS)
}
/// Keys per block.
const KEY_BLOCK: usize = 64;

/// Tokens `start..end` of the step: one sequence, consecutive positions.
#[derive(Clone, Copy, Debug)]
pub struct Run {
    pub start: usize,
    pub end: usize,
}

/// The step's tokens grouped into runs of one sequence at consecutive positions (into `out`).
pub fn runs(layout: &PagedLayout, out: &mut Vec<Run>) {
    out.clear();
    for t in 0..layout.positions.len() {
        match out.last_mut() {
            Some(r)
                if layout.token_seq[t] == layout.token_seq[t - 1]
                    && layout.positions[t] == layout.positions[t - 1] + 1 =>
            {
                r.end = t + 1
            }
            _ => out.push(Run { start: t, end: t + 1 }),
        }
    }
}

/// Per-worker scratch, grown once per thread and reused across the tiles it takes.
#[derive(Default)]
struct Scratch {
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    s: Vec<f32>,
    acc: Vec<f32>,
    max: Vec<f32>,
    sum: Vec<f32>,
}

thread_local! {
    static SCRATCH: std::cell::RefCell<Scratch> = std::cell::RefCell::new(Scratch::default());
}

/// Attention for the tokens of `runs` (each long enough to tile), written into `out[t, h*Dh..]`.
/// `tasks` is the caller's buffer for the task list.
#[allow(clippy::too_many_arguments)]
pub fn attention_runs<K: KvElem, V: KvElem>(
    isa: Isa,
    layout: &PagedLayout,
    shape: AttentionShape,
    runs: impl Iterator<Item = Run>,
    q: &[f32],
    k_cache: &[K],
    v_cache: &[V],
    out: &mut [f32],
    tasks: &mut Vec<(Run, usize)>,
) {
    let AttentionShape { n_kv_heads, .. } = shape;
    // Tasks: (tile of tokens, KV head), the longest contexts first so the last tasks are short.
    tasks.clear();
    for run in runs {
        let mut t0 = run.start;
        while t0 < run.end {
            let tile = Run { start: t0, end: (t0 + TILE_TOKENS).min(run.end) };
            tasks.extend((0..n_kv_heads).map(|h| (tile, h)));
            t0 = tile.end;
        }
    }
    if tasks.is_empty() {
        return;
    }
    tasks.sort_by_key(|(tile, _)| std::cmp::Reverse(layout.positions[tile.end - 1]));
    let out = SharedMut(out.as_mut_ptr());
    pool::for_each(tasks.len(), |task| {
        let (tile, kvh) = tasks[task];
        SCRATCH.with_borrow_mut(|scratch| {
            // SAFETY: each task writes only its tokens' rows for its KV head's query heads.
            unsafe { tile_task(isa, layout, shape, tile, kvh, q, k_cache, v_cache, scratch, out) }
        })
    });
}

/// One tile of query tokens against its whole context for one KV head (keys in the paged cache).
#[allow(clippy::too_many_arguments)]
unsafe fn tile_task<K: KvElem, V: KvElem>(
    isa: Isa,
    layout: &PagedLayout,
    shape: AttentionShape,
    tile: Run,
    kvh: usize,
    q: &[f32],
    k_cache: &[K],
    v_cache: &[V],
    sc: &mut Scratch,
    out: SharedMut<f32>,
) {
    let kv_row = shape.n_kv_heads * shape.head_dim;
    let window = shape.window;
    let seq = layout.token_seq[tile.start] as usize;
    let pos0 = layout.positions[tile.start] as usize;
    let keys = TileKeys {
        k: k_cache,
        v: v_cache,
        row: |p| layout.slot(seq, p) * kv_row,
        // Keys token `i` of the tile may see: p ≤ pos, and pos − p < window.
        visible: |i: usize| {
            let pos = pos0 + i;
            (if window > 0 { (pos + 1).saturating_sub(window) } else { 0 }, pos + 1)
        },
    };
    attend_tile(isa, shape, tile, kvh, q, &keys, sc, out)
}

/// Where a tile's keys come from (in the cache's types `K`, `V`) and which of them each of its query
/// tokens sees.
pub struct TileKeys<'a, K, V, R, S> {
    /// Key rows; key `p` of KV head `h` is `k[row(p) + h·Dh..][..Dh]`.
    pub k: &'a [K],
    /// Value rows, at the same offsets as the keys.
    pub v: &'a [V],
    pub row: R,
    /// Keys `lo..hi` that the tile's `i`-th query token sees (key numbers, as `row` takes them).
    pub visible: S,
}

/// [`attend_tile`] with this worker's scratch.
///
/// # Safety
/// As for [`attend_tile`].
#[allow(clippy::too_many_arguments)]
pub unsafe fn attend_tile_scratch<K: KvElem, V: KvElem, R: Fn(usize) -> usize, S: Fn(usize) -> (usize, usize)>(
    isa: Isa,
    shape: AttentionShape,
    tile: Run,
    kvh: usize,
    q: &[f32],
    keys: &TileKeys<K, V, R, S>,
    out: SharedMut<f32>,
) {
    // SAFETY: the caller's contract is ours.
    SCRATCH.with_borrow_mut(|sc| unsafe { attend_tile(isa, shape, tile, kvh, q, keys, sc, out) })
}

/// Query tokens `tile` (rows of `q` and `out`, `[T, Hq*Dh]`) × the query heads of KV head `kvh`
/// against the keys they see: scores and the weighted value sum through `gemm` on blocks of keys,
/// an online softmax in between. A token that sees no key gets zeros. `shape.window` is not read
/// (`keys.visible` says what each token sees).
///
/// # Safety
/// Every visible key's row must lie inside `keys.k` and `keys.v`; no other thread may write the
/// tile's output rows of this KV head's query heads.
#[allow(clippy::too_many_arguments)]
unsafe fn attend_tile<K: KvElem, V: KvElem, R: Fn(usize) -> usize, S: Fn(usize) -> (usize, usize)>(
    isa: Isa,
    shape: AttentionShape,
    tile: Run,
    kvh: usize,
    q: &[f32],
    keys: &TileKeys<K, V, R, S>,
    sc: &mut Scratch,
    out: SharedMut<f32>,
) {
    let AttentionShape { n_heads, n_kv_heads, head_dim: dh, scale, softcap, .. } = shape;
    let group = n_heads / n_kv_heads;
    let n_tok = tile.end - tile.start;
    let rows = n_tok * group; // row i = token i / group, head kvh·group + i % group
    let (mut first_key, mut end_key) = (usize::MAX, 0);
    for i in 0..n_tok {
        let (lo, hi) = (keys.visible)(i);
        if lo < hi {
            first_key = first_key.min(lo);
            end_key = end_key.max(hi);
        }
    }

    // Q tile, pre-scaled so the scores come out of the product ready.
    sc.q.resize(rows * dh, 0.0);
    for i in 0..n_tok {
        let src = &q[(tile.start + i) * n_heads * dh + kvh * group * dh..][..group * dh];
        for (d, s) in sc.q[i * group * dh..(i + 1) * group * dh].iter_mut().zip(src) {
            *d = s * scale;
        }
    }
    sc.k.resize(KEY_BLOCK * dh, 0.0);
    sc.v.resize(KEY_BLOCK * dh, 0.0);
    sc.s.resize(rows * KEY_BLOCK, 0.0);
    sc.acc.clear();
    sc.acc.resize(rows * dh, 0.0);
    sc.max.clear();
    sc.max.resize(rows, f32::NEG_INFINITY);
    sc.sum.clear();
    sc.sum.resize(rows, 0.0);

    let mut p0 = first_key;
    while p0 < end_key {
        let kb = KEY_BLOCK.min(end_key - p0);
        for j in 0..kb {
            let base = (keys.row)(p0 + j) + kvh * dh;
            K::load(&keys.k[base..base + dh], &mut sc.k[j * dh..(j + 1) * dh]);
            V::load(&keys.v[base..base + dh], &mut sc.v[j * dh..(j + 1) * dh]);
        }
        // S[rows, kb] = Q · Kᵀ
        gemm_rows(rows, kb, dh, sc.s.as_mut_ptr(), kb, false, sc.q.as_ptr(), sc.k.as_ptr(), true);
        for r in 0..rows {
            let (lo, hi) = (keys.visible)(r / group);
            let lo = lo.saturating_sub(p0).min(kb);
            let hi = hi.saturating_sub(p0).min(kb);
            let s_row = &mut sc.s[r * kb..(r + 1) * kb];
            let alpha = softmax_block::run(isa, s_row, lo, hi, softcap, &mut sc.max[r], &mut sc.sum[r]);
            if alpha != 1.0 {
                sc.acc[r * dh..(r + 1) * dh].iter_mut().for_each(|a| *a *= alpha);
            }
        }
        // acc[rows, dh] += P[rows, kb] · V[kb, dh]
        gemm_rows(rows, dh, kb, sc.acc.as_mut_ptr(), dh, true, sc.s.as_ptr(), sc.v.as_ptr(), false);
        p0 += kb;
    }
    for r in 0..rows {
        let (i, g) = (r / group, r % group);
        let inv = if sc.sum[r] > 0.0 { 1.0 / sc.sum[r] } else { 0.0 };
        let dst = out.slice((tile.start + i) * n_heads * dh + (kvh * group + g) * dh, dh);
        for (d, a) in dst.iter_mut().zip(&sc.acc[r * dh..(r + 1) * dh]) {
            *d = a * inv;
        }
    }
}

simd_kernel! {
    /// One query row's scores for a key block, in place: keys `lo..hi` are visible (soft-capped if
    /// `softcap > 0`), the rest become 0. Updates the row's running max and sum and returns the
    /// factor its accumulated values must be scaled by (`e^(old max − new max)`).
    pub fn softmax_block(s: &mut [f32], lo: usize, hi: usize, softcap: f32, max: &mut f32, sum: &mut f32) -> f32 {
        if lo >= hi {
            s.fill(0.0);
            return 1.0;
        }
        if softcap > 0.0 {
            for v in &mut s[lo..hi] {
                *v = softcap * (*v / softcap).tanh();
            }
        }
        // Eight-lane reductions so the loops vectorise (a single running sum would not).
        let mut lanes = [f32::NEG_INFINITY; 8];
        let mut chunks = s[lo..hi].chunks_exact(8);
        for c in &mut chunks {
            for l in 0..8 {
                lanes[l] = if c[l] > lanes[l] { c[l] } else { lanes[l] };
            }
        }
        let block_max = chunks.remainder().iter().chain(&lanes).fold(f32::NEG_INFINITY, |m, &v| m.max(v));
        let new_max = max.max(block_max);
        let alpha = if *max == f32::NEG_INFINITY { 0.0 } else { exp_approx(*max - new_max) };
        let mut sums = [0f32; 8];
        let mut chunks = s[lo..hi].chunks_exact_mut(8);
        for c in &mut chunks {
            for l in 0..8 {
                let e = exp_approx(c[l] - new_max);
                c[l] = e;
                sums[l] += e;
            }
        }
        let mut block_sum = sums.iter().sum::<f32>();
        for v in chunks.into_remainder() {
            let e = exp_approx(*v - new_max);
            *v = e;
            block_sum += e;
        }
        s[..lo].fill(0.0);
        s[hi..].fill(0.0);
        *max = new_max;
        *sum = *sum * alpha + block_sum;
        alpha
    }
}
