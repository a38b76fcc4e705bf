//! Causal attention over the paged KV cache with an online softmax: one pass over the keys per query
//! head, never a full score matrix.

use crate::pool;

use super::attention_prefill::{attention_runs, runs, Run};
use super::kv_elem::{cast_mut, KvElem};
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
        attention_tokens(isa, layout, shape, q, k_cache, v_cache, out, scratch);
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
    /// Tokens with more than one split.
    merged: Vec<usize>,
}

/// Keys per split of one token's context. A decode over a long context becomes several tasks per KV
/// head whose partial softmaxes are merged afterwards (flash-decoding), so every thread works on one
/// token's attention. Fixed, so how a token's keys are split — and its result — depends only on its own
/// context, never on what else is in the step.
const SPLIT_KEYS: usize = 512;

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

/// Attention for `scratch.tokens`: one task per (split of a token's keys, KV head), each a partial
/// softmax over its keys for the query heads of that KV head; a token with one split is finished in
/// its task, the others are merged in a second pass.
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
) {
    let AttentionShape { n_heads, n_kv_heads, head_dim: dh, window, scale, softcap } = shape;
    let group = n_heads / n_kv_heads;
    let kv_row = n_kv_heads * dh;
    // Cache offsets of every context position of every token, shared by that token's heads, and the
    // splits of each token's context.
    let AttentionScratch { tokens, bases, first_split, splits, split_token, partials, merged, .. } = scratch;
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
        bases.extend((start..=pos).map(|p| layout.slot(seq, p) * kv_row));
        let b1 = bases.len();
        first_split.push(splits.len());
        splits.extend((b0..b1).step_by(SPLIT_KEYS).map(|s| s..(s + SPLIT_KEYS).min(b1)));
        split_token.resize(splits.len(), ti);
        if splits.len() - first_split[ti] > 1 {
            merged.push(ti);
        }
    }
    first_split.push(splits.len());
    let partial_len = group * (dh + 2);
    partials.resize(splits.len() * n_kv_heads * partial_len, 0.0);
    let out_ptr = SharedMut(out.as_mut_ptr());
    let partial_ptr = SharedMut(partials.as_mut_ptr());
    let (tokens, bases, splits, first_split, split_token) = (&*tokens, &*bases, &*splits, &*first_split, &*split_token);
    let whole = |ti: usize| first_split[ti + 1] - first_split[ti] == 1;

    pool::for_each(splits.len() * n_kv_heads, |i| {
        let (si, kvh) = (i / n_kv_heads, i % n_kv_heads);
        let ti = split_token[si];
        let t = tokens[ti];
        let q0 = t * n_heads * dh + kvh * group * dh;
        let keys = &bases[splits[si].clone()];
        WORKER.with_borrow_mut(|w| {
            w.scores.resize(group * keys.len(), 0.0);
            w.acc.resize(group * dh, 0.0);
            w.max.resize(group, 0.0);
            w.sum.resize(group, 0.0);
            let part = Partial { max: &mut w.max, sum: &mut w.sum, acc: &mut w.acc, normalize: whole(ti) };
            attend_partial(
                isa,
                &q[q0..q0 + group * dh],
                dh,
                keys,
                kvh * dh,
                k_cache,
                v_cache,
                scale,
                softcap,
                &mut w.scores,
                part,
            );
            if whole(ti) {
                // SAFETY: each task writes only its token's heads of this KV head.
                let o = unsafe { out_ptr.slice(q0, group * dh) };
                for g in 0..group {
                    let inv = if w.sum[g] > 0.0 { 1.0 / w.sum[g] } else { 0.0 };
                    for (o, a) in o[g * dh..(g + 1) * dh].iter_mut().zip(&w.acc[g * dh..(g + 1) * dh]) {
                        *o = a * inv;
                    }
                }
            } else {
                // SAFETY: each (split, KV head) has its own stretch of the partials.
                let p = unsafe { partial_ptr.slice(i * partial_len, partial_len) };
                p[..group].copy_from_slice(&w.max);
                p[group..2 * group].copy_from_slice(&w.sum);
                p[2 * group..].copy_from_slice(&w.acc);
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
                    *o = a.mul_add(w, *o);
                }
            }
            let inv = if total > 0.0 { 1.0 / total } else { 0.0 };
            out_g.iter_mut().for_each(|o| *o *= inv);
        }
    });
}

/// One split's softmax before normalisation, per query head of a group: the largest score, the sum
/// of `e^(score − max)` and the sum of those weights times the values (`group × Dh`).
struct Partial<'a> {
    max: &'a mut [f32],
    sum: &'a mut [f32],
    acc: &'a mut [f32],
    /// The split is the whole context: a kernel may normalise the weights before the value pass
    /// (and report a sum of 1), as the AVX2 one does.
    normalize: bool,
}

/// The `group` query heads `q` (`group × Dh`) that share one KV head over the keys at `bases`
/// (+ `off`): the AVX2 kernel where it applies, else one head at a time.
#[allow(clippy::too_many_arguments)]
fn attend_partial<K: KvElem, V: KvElem>(
    isa: Isa,
    q: &[f32],
    dh: usize,
    bases: &[usize],
    off: usize,
    k_cache: &[K],
    v_cache: &[V],
    scale: f32,
    softcap: f32,
    scores: &mut [f32],
    part: Partial,
) {
    #[cfg(target_arch = "x86_64")]
    if dh.is_multiple_of(8) && isa.has_avx2() {
        // SAFETY: AVX2, FMA and F16C are present on these paths; offsets were validated by the executor.
        unsafe { x86::attend_group_avx2(q, dh, bases, off, k_cache, v_cache, scale, softcap, scores, part) };
        return;
    }
    let np = bases.len();
    for (g, qh) in q.chunks_exact(dh).enumerate() {
        let (s, acc) = (&mut scores[g * np..(g + 1) * np], &mut part.acc[g * dh..(g + 1) * dh]);
        let (m, l) = match (as_f32(k_cache), as_f32(v_cache)) {
            (Some(kc), Some(vc)) => attend::run(isa, qh, bases, off, kc, vc, scale, softcap, s, acc),
            _ => attend_converted(qh, bases, off, k_cache, v_cache, scale, softcap, s, acc),
        };
        (part.max[g], part.sum[g]) = (m, l);
    }
}

/// The cache as f32 values when it is kept in f32.
fn as_f32<T: KvElem>(cache: &[T]) -> Option<&[f32]> {
    // SAFETY: `T` is f32 exactly when its dtype says so.
    (T::DTYPE == mlxcel_plugin_api::DType::F32)
        .then(|| unsafe { std::slice::from_raw_parts(cache.as_ptr() as *const f32, cache.len()) })
}

/// [`attend`] over a cache kept in f16 or bf16 (paths without the AVX2 kernel): the same arithmetic,
/// each value converted as it is read.
#[allow(clippy::too_many_arguments)]
fn attend_converted<K: KvElem, V: KvElem>(
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
    let mut m = f32::NEG_INFINITY;
    for (sc, &b) in scores.iter_mut().zip(bases) {
        let k = &k_cache[b + off..b + off + dh];
        let mut s = q.iter().zip(k).fold(0f32, |a, (&x, &y)| x.mul_add(y.to_f32(), a)) * scale;
        if softcap > 0.0 {
            s = softcap * (s / softcap).tanh();
        }
        *sc = s;
        m = m.max(s);
    }
    let mut sum = 0f32;
    for sc in scores.iter_mut() {
        let e = exp_approx(*sc - m);
        *sc = e;
        sum += e;
    }
    acc.fill(0.0);
    for (&w, &b) in scores.iter().zip(bases) {
        for (a, v) in acc.iter_mut().zip(&v_cache[b + off..b + off + dh]) {
            *a = v.to_f32().mul_add(w, *a);
        }
    }
    (m, sum)
}

crate::simd_kernel! {
    /// One query head over some of its keys: scores, their maximum `m`, the weights `e^(s − m)` and
    /// their sum `l`, and the weighted sum of values into `acc` (not yet divided by `l`); returns
    /// `(m, l)`. Everything inlined in one function so each SIMD path vectorises it whole.
    pub fn attend(
        q: &[f32],
        bases: &[usize],
        off: usize,
        k_cache: &[f32],
        v_cache: &[f32],
        scale: f32,
        softcap: f32,
        scores: &mut [f32],
        acc: &mut [f32],
    ) -> (f32, f32) {
        let dh = q.len();
        let mut m = f32::NEG_INFINITY;
        for (sc, &b) in scores.iter_mut().zip(bases) {
            let k = &k_cache[b + off..b + off + dh];
            let mut a = [0f32; 8];
            let mut j = 0;
            while j + 8 <= dh {
                for l in 0..8 {
                    a[l] = q[j + l].mul_add(k[j + l], a[l]);
                }
                j += 8;
            }
            let mut s = (a[0] + a[4]) + (a[1] + a[5]) + (a[2] + a[6]) + (a[3] + a[7]);
            while j < dh {
                s += q[j] * k[j];
                j += 1;
            }
            s *= scale;
            if softcap > 0.0 {
                s = softcap * (s / softcap).tanh();
            }
            *sc = s;
            m = m.max(s);
        }
        let mut sum = 0f32;
        for sc in scores.iter_mut() {
            let e = exp_approx(*sc - m);
            *sc = e;
            sum += e;
        }
        acc.fill(0.0);
        for (&w, &b) in scores.iter().zip(bases) {
            let v = &v_cache[b + off..b + off + dh];
            for j in 0..dh {
                acc[j] = v[j].mul_add(w, acc[j]);
            }
        }
        (m, sum)
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use super::{KvElem, Partial};

    #[inline(always)]
    unsafe fn hsum(v: __m256) -> f32 {
        let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        _mm_cvtss_f32(_mm_add_ss(s, _mm_shuffle_ps(s, s, 1)))
    }

    /// [`super::attend`] with explicit AVX2 for head sizes that are a multiple of 8, for the `group`
    /// query heads (`q` = group × dh) that share one KV head: every key and value row is read once
    /// and used by all of them. `scores` is group × positions; `part` gets each head's partial
    /// softmax. Keys and values are read in the caches' own types (f16 through F16C, bf16 by a shift).
    #[target_feature(enable = "avx2,fma,f16c")]
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn attend_group_avx2<K: KvElem, V: KvElem>(
        q: &[f32],
        dh: usize,
        bases: &[usize],
        off: usize,
        k_cache: &[K],
        v_cache: &[V],
        scale: f32,
        softcap: f32,
        scores: &mut [f32],
        part: Partial,
    ) {
        let group = q.len() / dh;
        let np = bases.len();
        let chunks = dh / 8;
        let qp = q.as_ptr();
        let kp = k_cache.as_ptr();
        let vp = v_cache.as_ptr();
        let sp = scores.as_mut_ptr();
        for (p, &b) in bases.iter().enumerate() {
            let k = kp.add(b + off);
            for g in 0..group {
                let qg = qp.add(g * dh);
                let (mut a0, mut a1) = (_mm256_setzero_ps(), _mm256_setzero_ps());
                let mut c = 0;
                while c + 2 <= chunks {
                    a0 = _mm256_fmadd_ps(_mm256_loadu_ps(qg.add(c * 8)), K::load8(k.add(c * 8)), a0);
                    a1 = _mm256_fmadd_ps(_mm256_loadu_ps(qg.add(c * 8 + 8)), K::load8(k.add(c * 8 + 8)), a1);
                    c += 2;
                }
                if c < chunks {
                    a0 = _mm256_fmadd_ps(_mm256_loadu_ps(qg.add(c * 8)), K::load8(k.add(c * 8)), a0);
                }
                let mut s = hsum(_mm256_add_ps(a0, a1)) * scale;
                if softcap > 0.0 {
                    s = softcap * (s / softcap).tanh();
                }
                *sp.add(g * np + p) = s;
            }
        }
        // Weights per head, relative to its largest score.
        for g in 0..group {
            let row = &mut scores[g * np..(g + 1) * np];
            let m = row.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
            let mut sum = 0f32;
            for sc in row.iter_mut() {
                let e = super::exp_approx(*sc - m);
                *sc = e;
                sum += e;
            }
            if part.normalize {
                let inv = if sum > 0.0 { 1.0 / sum } else { 0.0 };
                row.iter_mut().for_each(|w| *w *= inv);
                sum = if sum > 0.0 { 1.0 } else { 0.0 };
            }
            (part.max[g], part.sum[g]) = (m, sum);
        }
        let ap = part.acc.as_mut_ptr();
        for c in 0..group * chunks {
            _mm256_storeu_ps(ap.add(c * 8), _mm256_setzero_ps());
        }
        let sp = scores.as_ptr();
        for (p, &b) in bases.iter().enumerate() {
            let v = vp.add(b + off);
            for c in 0..chunks {
                let vv = V::load8(v.add(c * 8));
                for g in 0..group {
                    let a = ap.add(g * dh + c * 8);
                    _mm256_storeu_ps(a, _mm256_fmadd_ps(vv, _mm256_set1_ps(*sp.add(g * np + p)), _mm256_loadu_ps(a)));
                }
            }
        }
    }
}

/// `e^x` for `x ≤ 0` (softmax arguments), written so the compiler vectorises it: Cody–Waite range
/// reduction `x = n·ln2 + r` with |r| ≤ ln2/2, a degree-7 Taylor polynomial for `e^r`, and `2^n` built
/// in the exponent bits; relative error below 1e-6.
#[inline(always)]
pub fn exp_approx(x: f32) -> f32 {
    const LN2_HI: f32 = 0.693_145_75;
    const LN2_LO: f32 = 1.428_606_8e-6;
    let x = x.max(-87.0);
    let n = (x * std::f32::consts::LOG2_E + 0.5).floor();
    let r = (x - n * LN2_HI) - n * LN2_LO;
    let p = 1.0
        + r * (1.0
            + r * (0.5
                + r * (1.0 / 6.0 + r * (1.0 / 24.0 + r * (1.0 / 120.0 + r * (1.0 / 720.0 + r * (1.0 / 5040.0)))))));
    let bits = ((n as i32 + 127) as u32) << 23;
    p * f32::from_bits(bits)
}

#[cfg(test)]
mod tests {
    use super::exp_approx;

    #[test]
    fn exp_approx_is_accurate_on_softmax_range() {
        let mut worst = 0f64;
        for i in 0..=100_000 {
            let x = -(i as f32) * 0.0008; // [-80, 0]
            let want = (x as f64).exp();
            let got = exp_approx(x) as f64;
            worst = worst.max(((got - want) / want).abs());
        }
        assert!(worst < 1e-6, "relative error {worst}");
    }
}
