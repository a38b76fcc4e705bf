//! Causal attention over the paged KV cache with an online softmax: one pass over the keys per query
//! head, never a full score matrix.

use crate::pool;

use super::attention_prefill::{attention_runs, runs, softmax_block, Run};
use super::kv_elem::{cast_mut, KvElem};
use super::math::exp_approx;
use super::SharedMut;
use crate::isa::Isa;

/// Where keys live: the step's sequence bookkeeping, borrowed from the host.
pub struct PagedLayout<'a> {
    pub token_seq: &'a [u32],
    pub positions: &'a [i32],
    pub slot_mapping: &'a [i64],
    pub block_tables: &'a [u32],
    pub max_blocks_per_seq: usize,
    pub block_size: usize,
}

impl PagedLayout<'_> {
    #[inline]
    pub fn slot(&self, seq: usize, pos: usize) -> usize {
        let block = self.block_tables[seq * self.max_blocks_per_seq + pos / self.block_size] as usize;
        block * self.block_size + pos % self.block_size
    }

    /// Appends `slot(seq, p) * row` for every `p` in `positions`, a page at a time (no division per
    /// position: a decode step does this for every context position of every layer).
    pub fn extend_offsets(&self, seq: usize, positions: std::ops::Range<usize>, row: usize, out: &mut Vec<usize>) {
        let table = &self.block_tables[seq * self.max_blocks_per_seq..];
        let mut p = positions.start;
        while p < positions.end {
            let (block, within) = (table[p / self.block_size] as usize, p % self.block_size);
            let n = (self.block_size - within).min(positions.end - p);
            let first = block * self.block_size + within;
            out.extend((first..first + n).map(|slot| slot * row));
            p += n;
        }
    }
}

/// Stores each token's K and V rows (`[Hkv*Dh]`) into its cache slot, in the caches' types.
pub fn write_kv<K: KvElem, V: KvElem>(
    layout: &PagedLayout,
    k: &[f32],
    v: &[f32],
    row: usize,
    k_cache: &mut [K],
    v_cache: &mut [V],
) {
    for (t, &slot) in layout.slot_mapping.iter().enumerate() {
        let dst = slot as usize * row;
        K::store(&k[t * row..(t + 1) * row], &mut k_cache[dst..dst + row]);
        V::store(&v[t * row..(t + 1) * row], &mut v_cache[dst..dst + row]);
    }
}

/// One layer's paged attention for a step, before the caches' element types are chosen: the step's
/// K/V rows are stored in the caches, then every token attends over its context.
pub struct CachedStep<'a> {
    pub isa: Isa,
    pub layout: &'a PagedLayout<'a>,
    pub shape: AttentionShape,
    pub q: &'a [f32],
    pub k: &'a [f32],
    pub v: &'a [f32],
}

impl CachedStep<'_> {
    /// Runs the step over caches whose bytes hold `K` keys and `V` values.
    pub fn run<K: KvElem, V: KvElem>(
        &self,
        k_cache: &mut [u8],
        v_cache: &mut [u8],
        out: &mut [f32],
        scratch: &mut AttentionScratch,
    ) {
        let (kc, vc) = (cast_mut::<K>(k_cache), cast_mut::<V>(v_cache));
        let row = self.shape.n_kv_heads * self.shape.head_dim;
        write_kv(self.layout, self.k, self.v, row, kc, vc);
        attention(self.isa, self.layout, self.shape, self.q, kc, vc, out, scratch);
    }
}

/// Attention parameters of one layer.
#[derive(Clone, Copy)]
pub struct AttentionShape {
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    /// Attend only to positions `p` with `pos - p < window` (0 = all).
    pub window: usize,
    pub scale: f32,
    /// `cap * tanh(score / cap)` on scores when > 0.
    pub softcap: f32,
}

/// Runs at least this long take the tiled prefill path.
const TILED_RUN: usize = 8;

/// `out[t, h*Dh..]` = softmax over the context of token `t` of `q·k` times `v`. Runs of prompt tokens
/// go through the tiled prefill kernel; the rest (decode steps, short runs) one token at a time.
#[allow(clippy::too_many_arguments)]
pub fn attention<K: KvElem, V: KvElem>(
    isa: Isa,
    layout: &PagedLayout,
    shape: AttentionShape,
    q: &[f32],
    k_cache: &[K],
    v_cache: &[V],
    out: &mut [f32],
    scratch: &mut AttentionScratch,
) {
    runs(layout, &mut scratch.runs);
    let long = scratch.runs.iter().copied().filter(|r| r.end - r.start >= TILED_RUN);
    attention_runs(isa, layout, shape, long, q, k_cache, v_cache, out, &mut scratch.tasks);
    scratch.tokens.clear();
    for r in scratch.runs.iter().filter(|r| r.end - r.start < TILED_RUN) {
        scratch.tokens.extend(r.start..r.end);
    }
    if !scratch.tokens.is_empty() {
        attention_tokens(isa, layout, shape, q, k_cache, v_cache, out, scratch, None);
    }
}

/// Step-level bookkeeping kept between calls, so a decode step allocates nothing.
#[derive(Default)]
pub struct AttentionScratch {
    runs: Vec<Run>,
    tasks: Vec<(Run, usize)>,
    tokens: Vec<usize>,
    /// Cache offsets of every context position of every token in `tokens`, back to back.
    bases: Vec<usize>,
    /// Per token: its first split in `splits`.
    first_split: Vec<usize>,
    /// Key ranges (into `bases`) of every token's splits, in token order.
    splits: Vec<std::ops::Range<usize>>,
    /// The token of each split.
    split_token: Vec<usize>,
    /// Per (split, KV head): `group` maxima, `group` sums and `group × Dh` weighted values.
    partials: Vec<f32>,
    /// The tasks of a step: a split and the KV heads it covers.
    split_tasks: Vec<(usize, std::ops::Range<usize>)>,
    /// Tokens with more than one split.
    merged: Vec<usize>,
}

/// Keys per split of one token's context. A decode over a long context becomes several tasks whose
/// partial softmaxes are merged afterwards (flash-decoding), so every thread works on one token's
/// attention. Fixed, so how a token's keys are split — and its result — depends only on its own
/// context, never on what else is in the step.
const SPLIT_KEYS: usize = 256;

/// Per-worker buffers (scores and the value accumulator), grown once per thread.
#[derive(Default)]
struct WorkerScratch {
    scores: Vec<f32>,
    acc: Vec<f32>,
    max: Vec<f32>,
    sum: Vec<f32>,
}

thread_local! {
    static WORKER: std::cell::RefCell<WorkerScratch> = std::cell::RefCell::new(WorkerScratch::default());
}

/// Attention for `scratch.tokens`: tasks over the splits of each token's keys, each a partial
/// softmax per query head; a token with one split is finished in its task, the others are merged in
/// a second pass. A task takes every KV head of its split — whole cache rows, one sequential stream —
/// when there are splits enough to keep the threads busy (two per thread, or a full one per thread),
/// else one KV head (which heads a task takes never changes a result, only how the work is cut).
/// `whole_rows` forces one or the other.
#[allow(clippy::too_many_arguments)]
fn attention_tokens<K: KvElem, V: KvElem>(
    isa: Isa,
    layout: &PagedLayout,
    shape: AttentionShape,
    q: &[f32],
    k_cache: &[K],
    v_cache: &[V],
    out: &mut [f32],
    scratch: &mut AttentionScratch,
    whole_rows: Option<bool>,
) {
    let AttentionShape { n_heads, n_kv_heads, head_dim: dh, window, scale, softcap } = shape;
    let group = n_heads / n_kv_heads;
    let kv_row = n_kv_heads * dh;
    // Cache offsets of every context position of every token, shared by that token's heads, and the
    // splits of each token's context.
    let AttentionScratch { tokens, bases, first_split, splits, split_token, partials, merged, split_tasks, .. } =
        scratch;
    bases.clear();
    first_split.clear();
    splits.clear();
    split_token.clear();
    merged.clear();
    for (ti, &t) in tokens.iter().enumerate() {
        let seq = layout.token_seq[t] as usize;
        let pos = layout.positions[t].max(0) as usize;
        let start = if window > 0 { (pos + 1).saturating_sub(window) } else { 0 };
        let b0 = bases.len();
        layout.extend_offsets(seq, start..pos + 1, kv_row, bases);
        let b1 = bases.len();
        first_split.push(splits.len());
        splits.extend((b0..b1).step_by(SPLIT_KEYS).map(|s| s..(s + SPLIT_KEYS).min(b1)));
        split_token.resize(splits.len(), ti);
        if splits.len() - first_split[ti] > 1 {
            merged.push(ti);
        }
    }
    first_split.push(splits.len());
    split_tasks.clear();
    // Whole rows when the splits alone keep the threads busy: two per thread, or one full split per
    // thread (a context of 512 keys on two threads is two full splits and a one-key one).
    let threads = pool::threads();
    let full = splits.iter().filter(|s| s.len() == SPLIT_KEYS).count();
    if whole_rows.unwrap_or(splits.len() >= 2 * threads || full >= threads) {
        split_tasks.extend((0..splits.len()).map(|si| (si, 0..n_kv_heads)));
    } else {
        split_tasks.extend((0..splits.len()).flat_map(|si| (0..n_kv_heads).map(move |h| (si, h..h + 1))));
    }
    let partial_len = group * (dh + 2);
    partials.resize(splits.len() * n_kv_heads * partial_len, 0.0);
    let out_ptr = SharedMut(out.as_mut_ptr());
    let partial_ptr = SharedMut(partials.as_mut_ptr());
    let (tokens, bases, splits, first_split, split_token, split_tasks) =
        (&*tokens, &*bases, &*splits, &*first_split, &*split_token, &*split_tasks);
    let whole = |ti: usize| first_split[ti + 1] - first_split[ti] == 1;

    pool::for_each(split_tasks.len(), |i| {
        let (si, heads) = split_tasks[i].clone();
        let ti = split_token[si];
        let nq = heads.len() * group;
        let q0 = tokens[ti] * n_heads * dh + heads.start * group * dh;
        let keys = &bases[splits[si].clone()];
        // The split this thread most likely takes next (tasks are handed out in order), whose first
        // keys the kernel requests as it finishes this one; only when tasks take whole rows.
        let next = match split_tasks.get(i + threads) {
            Some((sn, h)) if h.len() == n_kv_heads && heads.len() == n_kv_heads => &bases[splits[*sn].clone()],
            _ => &[][..],
        };
        let keys = KeyRows { here: keys, next };
        WORKER.with_borrow_mut(|w| {
            // Room for the AVX2 kernel's padded rows of scores (at most 3 more per head).
            w.scores.resize(nq * (keys.here.len() + 3), 0.0);
            w.acc.resize(nq * dh, 0.0);
            w.max.resize(nq, 0.0);
            w.sum.resize(nq, 0.0);
            let part = Partial { max: &mut w.max, sum: &mut w.sum, acc: &mut w.acc, normalize: whole(ti) };
            let heads_q = HeadsQuery { q: &q[q0..q0 + nq * dh], dh, group, off: heads.start * dh };
            attend_partial(isa, heads_q, keys, k_cache, v_cache, scale, softcap, &mut w.scores, part);
            if whole(ti) {
                // SAFETY: each task writes only its token's query heads of its KV heads.
                let o = unsafe { out_ptr.slice(q0, nq * dh) };
                for (h, (o, a)) in o.chunks_exact_mut(dh).zip(w.acc.chunks_exact(dh)).enumerate() {
                    let inv = if w.sum[h] > 0.0 { 1.0 / w.sum[h] } else { 0.0 };
                    o.iter_mut().zip(a).for_each(|(o, a)| *o = a * inv);
                }
            } else {
                for (j, kvh) in heads.enumerate() {
                    // SAFETY: each (split, KV head) has its own stretch of the partials.
                    let p = unsafe { partial_ptr.slice((si * n_kv_heads + kvh) * partial_len, partial_len) };
                    let qh = j * group..(j + 1) * group;
                    p[..group].copy_from_slice(&w.max[qh.clone()]);
                    p[group..2 * group].copy_from_slice(&w.sum[qh]);
                    p[2 * group..].copy_from_slice(&w.acc[j * group * dh..(j + 1) * group * dh]);
                }
            }
        });
    });

    // Tokens whose keys were split: rescale each split's sums to the largest maximum and add them up.
    let partials = &*partials;
    pool::for_each(merged.len() * n_kv_heads, |i| {
        let (ti, kvh) = (merged[i / n_kv_heads], i % n_kv_heads);
        let q0 = tokens[ti] * n_heads * dh + kvh * group * dh;
        // SAFETY: each task writes only its token's heads of this KV head.
        let o = unsafe { out_ptr.slice(q0, group * dh) };
        let part = |si: usize| &partials[(si * n_kv_heads + kvh) * partial_len..][..partial_len];
        for g in 0..group {
            let m = (first_split[ti]..first_split[ti + 1]).map(|si| part(si)[g]).fold(f32::NEG_INFINITY, f32::max);
            let (mut total, out_g) = (0f32, &mut o[g * dh..(g + 1) * dh]);
            out_g.fill(0.0);
            for si in first_split[ti]..first_split[ti + 1] {
                let p = part(si);
                let w = if p[group + g] > 0.0 { exp_approx(p[g] - m) } else { 0.0 };
                total += w * p[group + g];
                for (o, a) in out_g.iter_mut().zip(&p[2 * group + g * dh..2 * group + (g + 1) * dh]) {
                    *o += a * w;
                }
            }
            let inv = if total > 0.0 { 1.0 / total } else { 0.0 };
            out_g.iter_mut().for_each(|o| *o *= inv);
        }
    });
}

/// One split's softmax before normalisation, per query head: the largest score, the sum of
/// `e^(score − max)` and the sum of those weights times the values (`heads × Dh`).
struct Partial<'a> {
    max: &'a mut [f32],
    sum: &'a mut [f32],
    acc: &'a mut [f32],
    /// The split is the whole context: a kernel may normalise the weights before the value pass
    /// (and report a sum of 1), as the AVX2 one does.
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    normalize: bool,
}

/// The query heads of one task: `q` holds `group` heads per KV head, for consecutive KV heads whose
/// first one starts `off` values into each cache row.
#[derive(Clone, Copy)]
struct HeadsQuery<'a> {
    q: &'a [f32],
    dh: usize,
    group: usize,
    off: usize,
}

/// The cache offsets of a task's keys, and of the keys of the task its thread probably runs next
/// (whose rows a kernel may start loading as it finishes).
#[derive(Clone, Copy)]
struct KeyRows<'a> {
    here: &'a [usize],
    /// Read by the x86 kernels only (the portable loop does not prefetch).
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    next: &'a [usize],
}

/// The query heads of `hq` over the keys at `keys.here`: the AVX2 kernel where it applies, else one
/// head at a time through [`attend`]. `scores` holds heads × keys.
#[allow(clippy::too_many_arguments)]
fn attend_partial<K: KvElem, V: KvElem>(
    isa: Isa,
    hq: HeadsQuery,
    keys: KeyRows,
    k_cache: &[K],
    v_cache: &[V],
    scale: f32,
    softcap: f32,
    scores: &mut [f32],
    part: Partial,
) {
    #[cfg(target_arch = "x86_64")]
    if hq.dh.is_multiple_of(8) && isa.has_avx2() {
        // SAFETY: AVX2, FMA and F16C (and AVX-512 F/VL on its paths) are present; offsets were
        // validated by the executor.
        unsafe {
            if isa.has_avx512() {
                x86::attend_heads_avx512(hq, keys, k_cache, v_cache, scale, softcap, scores, part)
            } else {
                x86::attend_heads_avx2(hq, keys, k_cache, v_cache, scale, softcap, scores, part)
            }
        }
        return;
    }
    let (bases, np, dh) = (keys.here, keys.here.len(), hq.dh);
    for (h, qh) in hq.q.chunks_exact(dh).enumerate() {
        let off = hq.off + h / hq.group * dh;
        let (s, acc) = (&mut scores[h * np..(h + 1) * np], &mut part.acc[h * dh..(h + 1) * dh]);
        (part.max[h], part.sum[h]) = attend(isa, qh, bases, off, k_cache, v_cache, scale, softcap, s, acc);
    }
}

/// One query head over some of its keys (paths without the AVX2 kernel), reading the caches in their
/// own types: scores, their maximum `m`, the weights `e^(s − m)` and their sum `l`, and the weighted
/// sum of values into `acc` (not yet divided by `l`); returns `(m, l)`. Eight-lane sums so the
/// compiler vectorises the dot products; the weights come from the prefill kernel's block softmax.
#[allow(clippy::too_many_arguments)]
fn attend<K: KvElem, V: KvElem>(
    isa: Isa,
    q: &[f32],
    bases: &[usize],
    off: usize,
    k_cache: &[K],
    v_cache: &[V],
    scale: f32,
    softcap: f32,
    scores: &mut [f32],
    acc: &mut [f32],
) -> (f32, f32) {
    let dh = q.len();
    for (sc, &b) in scores.iter_mut().zip(bases) {
        let k = &k_cache[b + off..b + off + dh];
        let mut a = [0f32; 8];
        let mut j = 0;
        while j + 8 <= dh {
            for l in 0..8 {
                a[l] += q[j + l] * k[j + l].to_f32();
            }
            j += 8;
        }
        let mut s = (a[0] + a[4]) + (a[1] + a[5]) + (a[2] + a[6]) + (a[3] + a[7]);
        while j < dh {
            s += q[j] * k[j].to_f32();
            j += 1;
        }
        *sc = s * scale;
    }
    let (mut m, mut sum) = (f32::NEG_INFINITY, 0f32);
    let n = scores.len();
    softmax_block::run(isa, scores, 0, n, softcap, &mut m, &mut sum);
    acc.fill(0.0);
    for (&w, &b) in scores.iter().zip(bases) {
        for (a, v) in acc.iter_mut().zip(&v_cache[b + off..b + off + dh]) {
            *a += v.to_f32() * w;
        }
    }
    (m, sum)
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use super::{HeadsQuery, KeyRows, KvElem, Partial};
    use crate::kernels::math::{exp16, exp8, exp_approx};

    /// Positions ahead of the one being read whose cache rows are requested (into L2: asking for L1
    /// fills its few miss buffers and stalls the loads being computed on). The rows of a page are
    /// contiguous but pages are not, so the hardware prefetcher alone stalls at every page. 20–28
    /// measured 5–8% faster than 16 or 32 at 4096 keys on one Zen 4 thread (`attention_bench`).
    const AHEAD: usize = 24;

    /// Query heads one pass over a block of keys serves (HEADS × KEYS sums in registers).
    const HEADS: usize = 3;

    /// Positions per value pass: the pass's sums stay in registers across them.
    const VALUE_BLOCK: usize = 16;

    /// Distance between two heads' scores for `np` keys when a pass scores `keys` keys (at most
    /// four) and stores four lanes.
    fn score_stride(np: usize, keys: usize) -> usize {
        np.next_multiple_of(keys) + 4 - keys
    }

    /// Starts loading the `n` values at `p` into L2.
    #[inline(always)]
    unsafe fn prefetch<T>(p: *const T, n: usize) {
        let (p, bytes) = (p as *const i8, n * std::mem::size_of::<T>());
        let mut o = 0;
        while o < bytes {
            _mm_prefetch::<_MM_HINT_T1>(p.add(o));
            o += 64;
        }
    }

    /// `(first head, heads)` of each pass over a block of keys: up to [`HEADS`] query heads, never
    /// crossing from one KV head's group into the next.
    fn sub_passes(heads: usize, group: usize) -> impl Iterator<Item = (usize, usize)> {
        (0..heads)
            .step_by(group)
            .flat_map(move |g0| (g0..g0 + group).step_by(HEADS).map(move |h| (h, (g0 + group - h).min(HEADS))))
    }

    /// The sums of four vectors' lanes, as one vector `[Σa0, Σa1, Σa2, Σa3]`.
    #[inline(always)]
    unsafe fn hsum4(a: [__m256; 4]) -> __m128 {
        let t = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
        _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1))
    }

    /// The vector width the kernel computes in: eight lanes (AVX2) or sixteen (AVX-512, for head
    /// sizes that are a multiple of 16). The width changes the order of each dot product's additions,
    /// so the two widths round differently; one width serves every task on a host.
    pub trait Lanes {
        type V: Copy;
        /// Lanes per vector.
        const N: usize;
        unsafe fn zero() -> Self::V;
        unsafe fn load(p: *const f32) -> Self::V;
        unsafe fn load_kv<K: KvElem>(p: *const K) -> Self::V;
        /// `p[0]` in every lane.
        unsafe fn splat(p: *const f32) -> Self::V;
        unsafe fn fmadd(a: Self::V, b: Self::V, c: Self::V) -> Self::V;
        unsafe fn store(p: *mut f32, v: Self::V);
        /// `[Σa0, Σa1, Σa2, Σa3]`.
        unsafe fn hsum4(a: [Self::V; 4]) -> __m128;
        /// A whole row of scores (not soft-capped) into `e^(s − max)` in place; returns `(max, Σ)`.
        unsafe fn softmax(row: &mut [f32]) -> (f32, f32);
    }

    /// Eight lanes (AVX2, FMA, F16C).
    pub struct W8;
    /// Sixteen lanes (AVX-512 F).
    pub struct W16;

    impl Lanes for W8 {
        type V = __m256;
        const N: usize = 8;
        #[inline(always)]
        unsafe fn zero() -> __m256 {
            _mm256_setzero_ps()
        }
        #[inline(always)]
        unsafe fn load(p: *const f32) -> __m256 {
            _mm256_loadu_ps(p)
        }
        #[inline(always)]
        unsafe fn load_kv<K: KvElem>(p: *const K) -> __m256 {
            K::load8(p)
        }
        #[inline(always)]
        unsafe fn splat(p: *const f32) -> __m256 {
            _mm256_broadcast_ss(&*p)
        }
        #[inline(always)]
        unsafe fn fmadd(a: __m256, b: __m256, c: __m256) -> __m256 {
            _mm256_fmadd_ps(a, b, c)
        }
        #[inline(always)]
        unsafe fn store(p: *mut f32, v: __m256) {
            _mm256_storeu_ps(p, v)
        }
        #[inline(always)]
        unsafe fn hsum4(a: [__m256; 4]) -> __m128 {
            hsum4(a)
        }
        #[inline(always)]
        unsafe fn softmax(row: &mut [f32]) -> (f32, f32) {
            // The block softmax's arithmetic, eight lanes with `exp8` (fused multiply-adds), the
            // last `n % 8` scores one at a time with `exp_approx`.
            let (n, p) = (row.len(), row.as_mut_ptr());
            let full = n / 8 * 8;
            let mut high = _mm256_set1_ps(f32::NEG_INFINITY);
            for i in (0..full).step_by(8) {
                high = _mm256_max_ps(high, _mm256_loadu_ps(p.add(i)));
            }
            let mut lanes = [0f32; 8];
            _mm256_storeu_ps(lanes.as_mut_ptr(), high);
            let m = lanes.iter().chain(&row[full..]).fold(f32::NEG_INFINITY, |m, &v| m.max(v));
            let (vm, mut sums) = (_mm256_set1_ps(m), _mm256_setzero_ps());
            for i in (0..full).step_by(8) {
                let e = exp8(_mm256_sub_ps(_mm256_loadu_ps(p.add(i)), vm));
                _mm256_storeu_ps(p.add(i), e);
                sums = _mm256_add_ps(sums, e);
            }
            _mm256_storeu_ps(lanes.as_mut_ptr(), sums);
            let mut sum = lanes.iter().sum::<f32>();
            for v in &mut row[full..] {
                *v = exp_approx(*v - m);
                sum += *v;
            }
            (m, sum)
        }
    }

    impl Lanes for W16 {
        type V = __m512;
        const N: usize = 16;
        #[inline(always)]
        unsafe fn zero() -> __m512 {
            _mm512_setzero_ps()
        }
        #[inline(always)]
        unsafe fn load(p: *const f32) -> __m512 {
            _mm512_loadu_ps(p)
        }
        #[inline(always)]
        unsafe fn load_kv<K: KvElem>(p: *const K) -> __m512 {
            K::load16(p)
        }
        #[inline(always)]
        unsafe fn splat(p: *const f32) -> __m512 {
            _mm512_set1_ps(*p)
        }
        #[inline(always)]
        unsafe fn fmadd(a: __m512, b: __m512, c: __m512) -> __m512 {
            _mm512_fmadd_ps(a, b, c)
        }
        #[inline(always)]
        unsafe fn store(p: *mut f32, v: __m512) {
            _mm512_storeu_ps(p, v)
        }
        #[inline(always)]
        unsafe fn softmax(row: &mut [f32]) -> (f32, f32) {
            // The block softmax's arithmetic in sixteen lanes, the tail masked; `exp16` is
            // `exp_approx` with fused multiply-adds.
            let (n, p) = (row.len(), row.as_mut_ptr());
            let full = n / 16 * 16;
            let tail = ((1u32 << (n - full)) - 1) as __mmask16;
            let mut high = _mm512_set1_ps(f32::NEG_INFINITY);
            for i in (0..full).step_by(16) {
                high = _mm512_max_ps(high, _mm512_loadu_ps(p.add(i)));
            }
            high = _mm512_mask_max_ps(high, tail, high, _mm512_maskz_loadu_ps(tail, p.add(full)));
            let m = _mm512_reduce_max_ps(high);
            let (vm, mut sums) = (_mm512_set1_ps(m), _mm512_setzero_ps());
            for i in (0..full).step_by(16) {
                let e = exp16(_mm512_sub_ps(_mm512_loadu_ps(p.add(i)), vm));
                _mm512_storeu_ps(p.add(i), e);
                sums = _mm512_add_ps(sums, e);
            }
            let e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(tail, p.add(full)), vm));
            _mm512_mask_storeu_ps(p.add(full), tail, e);
            sums = _mm512_mask_add_ps(sums, tail, sums, e);
            (m, _mm512_reduce_add_ps(sums))
        }
        #[inline(always)]
        unsafe fn hsum4(a: [__m512; 4]) -> __m128 {
            // Each vector's two halves added, then the eight-lane reduction. (No closure: one would
            // not inherit the target features, and its intrinsics would become calls.)
            let mut halves = [_mm256_setzero_ps(); 4];
            for (h, &v) in halves.iter_mut().zip(&a) {
                let hi = _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(v)));
                *h = _mm256_add_ps(_mm512_castps512_ps256(v), hi);
            }
            hsum4(halves)
        }
    }

    /// [`super::attend`]'s arithmetic with explicit AVX2 for head sizes that are a multiple of 8, for every query
    /// head of `hq` at once, so each cache row (the task's KV heads of it, side by side) is read once
    /// as one stream and each KV head's part serves its whole group. `scores` is heads × positions;
    /// `part` gets each head's partial softmax. Keys and values are read in the caches' own types (f16
    /// through F16C, bf16 by a shift). Three passes: scores a few keys at a time (their dot products
    /// reduced together), the weights eight lanes at a time, then the values into sums that stay in
    /// registers across a block of positions.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn attend_heads_avx2<K: KvElem, V: KvElem>(
        hq: HeadsQuery,
        keys: KeyRows,
        k_cache: &[K],
        v_cache: &[V],
        scale: f32,
        softcap: f32,
        scores: &mut [f32],
        part: Partial,
    ) {
        // 16 registers: HEADS × 3 sums, HEADS query chunks or weights and the row chunk in flight.
        attend_heads::<W8, K, V, 3, 3>(hq, keys, k_cache, v_cache, scale, softcap, scores, part)
    }

    /// [`attend_heads_avx2`] where AVX-512 is present: sixteen-lane vectors for head sizes that
    /// are a multiple of 16 (else the eight-lane arithmetic, with four keys' and four value chunks'
    /// sums per pass in its 32 registers).
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl")]
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn attend_heads_avx512<K: KvElem, V: KvElem>(
        hq: HeadsQuery,
        keys: KeyRows,
        k_cache: &[K],
        v_cache: &[V],
        scale: f32,
        softcap: f32,
        scores: &mut [f32],
        part: Partial,
    ) {
        if hq.dh.is_multiple_of(16) {
            attend_heads::<W16, K, V, 4, 4>(hq, keys, k_cache, v_cache, scale, softcap, scores, part)
        } else {
            attend_heads::<W8, K, V, 4, 4>(hq, keys, k_cache, v_cache, scale, softcap, scores, part)
        }
    }

    /// The body of both: `KEYS` keys per scoring pass, `CHUNKS` eight-value chunks per value pass
    /// (how many sums a pass keeps in registers; neither changes the arithmetic of any one sum).
    #[inline(always)]
    #[allow(clippy::too_many_arguments)]
    unsafe fn attend_heads<W: Lanes, K: KvElem, V: KvElem, const KEYS: usize, const CHUNKS: usize>(
        hq: HeadsQuery,
        keys: KeyRows,
        k_cache: &[K],
        v_cache: &[V],
        scale: f32,
        softcap: f32,
        scores: &mut [f32],
        part: Partial,
    ) {
        let HeadsQuery { q, dh, group, off } = hq;
        let heads = q.len() / dh;
        let row = heads / group * dh;
        const { assert!(KEYS >= 1 && KEYS <= 4, "a scoring pass reduces at most four keys together") };
        let bases = keys.here;
        let np = bases.len();
        // Each head's scores `ns` apart: a pass stores four lanes whatever the keys left.
        let ns = score_stride(np, KEYS);
        assert!(scores.len() >= heads * ns, "scores buffer too short");
        let (kp, vp) = (k_cache.as_ptr().add(off), v_cache.as_ptr().add(off));
        let sp = scores.as_mut_ptr();
        // The rows are requested as one stream, `AHEAD` positions before they are read: the keys,
        // then the values, then the next task's first keys, so no pass starts on a cold row.
        let ahead = |i: usize| {
            if i < np {
                prefetch(kp.add(bases[i]), row)
            } else if i < 2 * np {
                prefetch(vp.add(bases[i - np]), row)
            } else if let Some(&b) = keys.next.get(i - 2 * np) {
                prefetch(kp.add(b), row)
            }
        };
        (0..AHEAD).for_each(ahead);
        // The passes over each block, worked out once: iterating `sub_passes` per block of keys
        // cost ~10% of the kernel. A stack array for up to 64 query heads, else the heap.
        let mut stack = [(0usize, 0usize); 64];
        let heap: Vec<(usize, usize)>;
        let passes: &[(usize, usize)] = if heads <= stack.len() {
            let mut n = 0;
            for pass in sub_passes(heads, group) {
                stack[n] = pass;
                n += 1;
            }
            &stack[..n]
        } else {
            heap = sub_passes(heads, group).collect();
            &heap
        };
        for p in (0..np).step_by(KEYS) {
            let n = (np - p).min(KEYS);
            (p + AHEAD..p + AHEAD + n).for_each(ahead);
            let rows: [*const K; KEYS] = std::array::from_fn(|i| kp.add(bases[p + i.min(n - 1)]));
            for &(h0, take) in passes {
                let (qh, kv) = (q.as_ptr().add(h0 * dh), h0 / group * dh);
                let s = sp.add(h0 * ns + p);
                match take {
                    1 => score_keys::<W, K, 1, KEYS>(qh, dh, rows, kv, scale, s, ns),
                    2 => score_keys::<W, K, 2, KEYS>(qh, dh, rows, kv, scale, s, ns),
                    _ => score_keys::<W, K, HEADS, KEYS>(qh, dh, rows, kv, scale, s, ns),
                }
            }
        }
        for h in 0..heads {
            let (m, sum) = weights::<W>(&mut scores[h * ns..h * ns + np], softcap, part.normalize);
            (part.max[h], part.sum[h]) = (m, sum);
        }
        let (ap, sp) = (part.acc.as_mut_ptr(), scores.as_ptr());
        let chunks = dh / W::N;
        for p0 in (0..np).step_by(VALUE_BLOCK) {
            let block = &bases[p0..(p0 + VALUE_BLOCK).min(np)];
            // The rows ahead are asked for one per position of the block's first pass: asked for
            // all at once, they fill the core's miss buffers and the prefetches themselves stall.
            let mut first_pass = true;
            for &(h0, take) in passes {
                let v = vp.add(h0 / group * dh);
                for c0 in (0..chunks).step_by(CHUNKS) {
                    let (a, w, v) = (ap.add(h0 * dh + c0 * W::N), sp.add(h0 * ns + p0), v.add(c0 * W::N));
                    let first = p0 == 0;
                    let pf = |i: usize| {
                        if first_pass {
                            ahead(np + p0 + AHEAD + i)
                        }
                    };
                    match (take, (chunks - c0).min(CHUNKS)) {
                        (1, 1) => values::<W, V, 1, 1>(v, block, w, ns, a, dh, first, pf),
                        (1, 2) => values::<W, V, 1, 2>(v, block, w, ns, a, dh, first, pf),
                        (1, 3) => values::<W, V, 1, 3>(v, block, w, ns, a, dh, first, pf),
                        (1, _) => values::<W, V, 1, CHUNKS>(v, block, w, ns, a, dh, first, pf),
                        (2, 1) => values::<W, V, 2, 1>(v, block, w, ns, a, dh, first, pf),
                        (2, 2) => values::<W, V, 2, 2>(v, block, w, ns, a, dh, first, pf),
                        (2, 3) => values::<W, V, 2, 3>(v, block, w, ns, a, dh, first, pf),
                        (2, _) => values::<W, V, 2, CHUNKS>(v, block, w, ns, a, dh, first, pf),
                        (_, 1) => values::<W, V, HEADS, 1>(v, block, w, ns, a, dh, first, pf),
                        (_, 2) => values::<W, V, HEADS, 2>(v, block, w, ns, a, dh, first, pf),
                        (_, 3) => values::<W, V, HEADS, 3>(v, block, w, ns, a, dh, first, pf),
                        (_, _) => values::<W, V, HEADS, CHUNKS>(v, block, w, ns, a, dh, first, pf),
                    }
                    first_pass = false;
                }
            }
        }
    }

    /// `s[g·ns + i] = scale · q_g · k_i` for `G` heads of one KV head (its values start `kv` into
    /// each row) and [`KEYS`] keys, whose dot products are reduced together. Four lanes are stored
    /// (rows past the real ones repeat the last; the stride leaves room).
    #[inline(always)]
    #[allow(clippy::too_many_arguments)]
    unsafe fn score_keys<W: Lanes, K: KvElem, const G: usize, const KEYS: usize>(
        q: *const f32,
        dh: usize,
        rows: [*const K; KEYS],
        kv: usize,
        scale: f32,
        s: *mut f32,
        ns: usize,
    ) {
        let mut acc = [[W::zero(); KEYS]; G];
        for c in (0..dh).step_by(W::N) {
            // One key chunk live at a time: G × KEYS sums + G query chunks + 1 key fit the registers.
            let qg: [W::V; G] = std::array::from_fn(|g| W::load(q.add(g * dh + c)));
            for (i, row) in rows.iter().enumerate() {
                let k = W::load_kv(row.add(kv + c));
                for (acc, &qg) in acc.iter_mut().zip(&qg) {
                    acc[i] = W::fmadd(qg, k, acc[i]);
                }
            }
        }
        let scale = _mm_set1_ps(scale);
        for (g, acc) in acc.iter().enumerate() {
            let sums = _mm_mul_ps(W::hsum4(std::array::from_fn(|i| acc[i.min(KEYS - 1)])), scale);
            _mm_storeu_ps(s.add(g * ns), sums);
        }
    }

    /// One head's scores into weights `e^(s − max)` in place: by the width's own softmax, or, where
    /// the scores are soft-capped, by the prefill kernel's block softmax; returns `(max, sum)`, or
    /// `(max, 1)` with the weights divided by their sum when `normalize`.
    #[inline(always)]
    unsafe fn weights<W: Lanes>(row: &mut [f32], softcap: f32, normalize: bool) -> (f32, f32) {
        let (m, mut sum) = if softcap > 0.0 {
            let (mut m, mut sum) = (f32::NEG_INFINITY, 0f32);
            // SAFETY: the caller runs with AVX2, FMA and F16C.
            super::softmax_block::avx2(row, 0, row.len(), softcap, &mut m, &mut sum);
            (m, sum)
        } else {
            W::softmax(row)
        };
        if normalize {
            let inv = if sum > 0.0 { 1.0 / sum } else { 0.0 };
            row.iter_mut().for_each(|w| *w *= inv);
            sum = if sum > 0.0 { 1.0 } else { 0.0 };
        }
        (m, sum)
    }

    /// `a[g·dh + 8c..] (+)= Σ_i w[g·ns + i] · v_i[8c..]` for `G` heads and `C` eight-value chunks
    /// of the rows at `v` + each base of a block, the `G × C` sums in registers across the block;
    /// `first` starts them at zero instead of `a`; `ahead(i)` is called before position `i` is read.
    #[inline(always)]
    #[allow(clippy::too_many_arguments)]
    unsafe fn values<W: Lanes, V: KvElem, const G: usize, const C: usize>(
        v: *const V,
        block: &[usize],
        w: *const f32,
        ns: usize,
        a: *mut f32,
        dh: usize,
        first: bool,
        ahead: impl Fn(usize),
    ) {
        let mut acc: [[W::V; C]; G] = std::array::from_fn(|g| {
            std::array::from_fn(|c| if first { W::zero() } else { W::load(a.add(g * dh + c * W::N)) })
        });
        for (i, &b) in block.iter().enumerate() {
            ahead(i);
            let row = v.add(b);
            // One value chunk live at a time: G × C sums + G weights + 1 chunk fit AVX2's 16 registers.
            let wg: [W::V; G] = std::array::from_fn(|g| W::splat(w.add(g * ns + i)));
            for c in 0..C {
                let vals = W::load_kv(row.add(c * W::N));
                for (acc, &wg) in acc.iter_mut().zip(&wg) {
                    acc[c] = W::fmadd(vals, wg, acc[c]);
                }
            }
        }
        for (g, acc) in acc.iter().enumerate() {
            for (c, &x) in acc.iter().enumerate() {
                W::store(a.add(g * dh + c * W::N), x);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A task over all KV heads of a split and tasks over one KV head each give the same bits, on
    /// every kernel this host runs; the paths that share a vector width agree bit for bit (the
    /// AVX-512 build computes head sizes that are a multiple of 16 in sixteen lanes, others as the
    /// AVX2 build does), and every path agrees with the portable kernel to rounding. Shapes cover groups of 1 to 5 query heads (passes of
    /// 3 + 1 and 3 + 2 heads), head sizes of 1 to 6 eight-value chunks, and contexts of 1 to 4 keys
    /// (fewer than a scoring pass takes) as well as one and several splits; f16 cache.
    #[test]
    fn tasks_over_whole_rows_or_single_heads_agree_bit_for_bit() {
        use half::f16;
        let bs = 16;
        for (hq, hkv, dh) in [(12, 4, 32), (5, 1, 40), (4, 2, 16), (8, 2, 48), (4, 4, 8), (4, 1, 8)] {
            let kv_row = hkv * dh;
            for depth in [0usize, 1, 2, 3, 40, 700] {
                let blocks = (depth + 1).div_ceil(bs);
                let mut x = 0x2545f4914f6cdd1du64;
                let mut rnd = move || {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    (x % 2000) as f32 / 1000.0 - 1.0
                };
                let kc: Vec<f16> = (0..blocks * bs * kv_row).map(|_| f16::from_f32(rnd())).collect();
                let vc: Vec<f16> = (0..blocks * bs * kv_row).map(|_| f16::from_f32(rnd())).collect();
                let q: Vec<f32> = (0..hq * dh).map(|_| rnd()).collect();
                let tables: Vec<u32> = (0..blocks as u32).rev().collect();
                let layout = PagedLayout {
                    token_seq: &[0],
                    positions: &[depth as i32],
                    slot_mapping: &[0],
                    block_tables: &tables,
                    max_blocks_per_seq: blocks,
                    block_size: bs,
                };
                let shape =
                    AttentionShape { n_heads: hq, n_kv_heads: hkv, head_dim: dh, window: 0, scale: 0.17, softcap: 0.0 };
                let case = format!("{hq}/{hkv} heads of {dh}, depth {depth}");
                let mut outs: Vec<(Isa, Vec<f32>)> = Vec::new();
                for isa in Isa::all_supported() {
                    let run = |whole| {
                        let mut scratch = AttentionScratch { tokens: vec![0], ..Default::default() };
                        let mut out = vec![0f32; hq * dh];
                        attention_tokens(isa, &layout, shape, &q, &kc, &vc, &mut out, &mut scratch, Some(whole));
                        out
                    };
                    let (whole, single) = (run(true), run(false));
                    assert!(whole.iter().all(|v| v.is_finite()), "{}: {case}", isa.name());
                    assert_eq!(whole, single, "{}: {case}", isa.name());
                    outs.push((isa, whole));
                }
                // One kernel build per vector width: the AVX2 paths agree bit for bit, and so do the
                // AVX-512 ones (sixteen lanes where the head size allows, else the AVX2 arithmetic).
                for wide in [false, true] {
                    let simd: Vec<&(Isa, Vec<f32>)> =
                        outs.iter().filter(|(isa, _)| isa.has_avx2() && isa.has_avx512() == wide).collect();
                    for (isa, out) in simd.iter().skip(1) {
                        assert_eq!(out, &simd[0].1, "{} vs {}: {case}", isa.name(), simd[0].0.name());
                    }
                }
                let (avx2, avx512) = (
                    outs.iter().find(|(isa, _)| isa.has_avx2() && !isa.has_avx512()),
                    outs.iter().find(|(isa, _)| isa.has_avx512()),
                );
                if let (Some((_, a)), Some((_, b))) = (avx2, avx512) {
                    if dh % 16 != 0 {
                        assert_eq!(a, b, "avx512 vs avx2 (eight lanes both): {case}");
                    }
                }
                for (isa, out) in &outs[1..] {
                    let worst = out.iter().zip(&outs[0].1).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
                    assert!(worst < 1e-4, "{} vs {}: {case}: {worst}", isa.name(), outs[0].0.name());
                }
            }
        }
    }
}
