//! Causal attention over the paged KV cache with an online softmax: one pass over the keys per query
//! head, never a full score matrix.

use rayon::prelude::*;

use super::attention_prefill::{attention_runs, runs, Run};
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

/// Copies each token's K and V rows (`[Hkv*Dh]`) into its cache slot.
pub fn write_kv(layout: &PagedLayout, k: &[f32], v: &[f32], row: usize, k_cache: &mut [f32], v_cache: &mut [f32]) {
    for (t, &slot) in layout.slot_mapping.iter().enumerate() {
        let dst = slot as usize * row;
        k_cache[dst..dst + row].copy_from_slice(&k[t * row..(t + 1) * row]);
        v_cache[dst..dst + row].copy_from_slice(&v[t * row..(t + 1) * row]);
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
pub fn attention(
    isa: Isa,
    layout: &PagedLayout,
    shape: AttentionShape,
    q: &[f32],
    k_cache: &[f32],
    v_cache: &[f32],
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
    /// Per token: its range in `bases`.
    spans: Vec<std::ops::Range<usize>>,
}

/// Per-worker buffers (scores and the value accumulator), grown once per thread.
#[derive(Default)]
struct WorkerScratch {
    scores: Vec<f32>,
    acc: Vec<f32>,
}

thread_local! {
    static WORKER: std::cell::RefCell<WorkerScratch> = std::cell::RefCell::new(WorkerScratch::default());
}

/// Attention for `scratch.tokens`, one (token, KV head) per task.
#[allow(clippy::too_many_arguments)]
fn attention_tokens(
    isa: Isa,
    layout: &PagedLayout,
    shape: AttentionShape,
    q: &[f32],
    k_cache: &[f32],
    v_cache: &[f32],
    out: &mut [f32],
    scratch: &mut AttentionScratch,
) {
    let AttentionShape { n_heads, n_kv_heads, head_dim: dh, window, scale, softcap } = shape;
    let group = n_heads / n_kv_heads;
    let kv_row = n_kv_heads * dh;
    // Cache offsets of every context position of every token, shared by that token's heads.
    scratch.bases.clear();
    scratch.spans.clear();
    for &t in &scratch.tokens {
        let seq = layout.token_seq[t] as usize;
        let pos = layout.positions[t].max(0) as usize;
        let start = if window > 0 { (pos + 1).saturating_sub(window) } else { 0 };
        let b0 = scratch.bases.len();
        scratch.bases.extend((start..=pos).map(|p| layout.slot(seq, p) * kv_row));
        scratch.spans.push(b0..scratch.bases.len());
    }
    let (tokens, bases, spans) = (&scratch.tokens, &scratch.bases, &scratch.spans);
    let out_ptr = SharedMut(out.as_mut_ptr());
    #[cfg(target_arch = "x86_64")]
    if dh % 8 == 0 && isa.has_avx2() {
        // One task per (token, KV head): each key and value row is loaded once for the whole group of
        // query heads that share it (GQA).
        (0..tokens.len() * n_kv_heads).into_par_iter().for_each(|i| {
            let (ti, kvh) = (i / n_kv_heads, i % n_kv_heads);
            let t = tokens[ti];
            let q0 = t * n_heads * dh + kvh * group * dh;
            let ctx = &bases[spans[ti].clone()];
            WORKER.with_borrow_mut(|w| {
                w.scores.resize(group * ctx.len(), 0.0);
                w.acc.resize(group * dh, 0.0);
                // SAFETY: each task writes only its token's heads of this KV head.
                let o = unsafe { out_ptr.slice(q0, group * dh) };
                // SAFETY: AVX2 and FMA are present on these paths; offsets were validated by the executor.
                unsafe {
                    x86::attend_group_avx2(
                        &q[q0..q0 + group * dh],
                        dh,
                        ctx,
                        kvh * dh,
                        k_cache,
                        v_cache,
                        scale,
                        softcap,
                        &mut w.scores,
                        &mut w.acc,
                        o,
                    )
                };
            });
        });
        return;
    }
    (0..tokens.len() * n_heads).into_par_iter().for_each(|i| {
        let (ti, h) = (i / n_heads, i % n_heads);
        let t = tokens[ti];
        let off = (h / group) * dh;
        let qh = &q[t * n_heads * dh + h * dh..][..dh];
        let ctx = &bases[spans[ti].clone()];
        WORKER.with_borrow_mut(|w| {
            w.scores.resize(ctx.len(), 0.0);
            w.acc.resize(dh, 0.0);
            // SAFETY: each task writes only its own head of its token.
            let o = unsafe { out_ptr.slice(t * n_heads * dh + h * dh, dh) };
            attend::run(isa, qh, ctx, off, k_cache, v_cache, scale, softcap, &mut w.scores, &mut w.acc, o);
        });
    });
}

crate::simd_kernel! {
    /// One query head over its context: scores, a numerically stable softmax, the weighted sum of
    /// values. Everything inlined in one function so each SIMD path vectorises it whole.
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
        out: &mut [f32],
    ) {
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
        let inv = if sum > 0.0 { 1.0 / sum } else { 0.0 };
        for (o, a) in out.iter_mut().zip(acc.iter()) {
            *o = a * inv;
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    #[inline(always)]
    unsafe fn hsum(v: __m256) -> f32 {
        let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        _mm_cvtss_f32(_mm_add_ss(s, _mm_shuffle_ps(s, s, 1)))
    }

    /// [`super::attend`] with explicit AVX2 for head sizes that are a multiple of 8, for the `group`
    /// query heads (`q` = group × dh) that share one KV head: every key and value row is read once
    /// and used by all of them. `scores` is group × positions, `acc` and `out` group × dh.
    #[target_feature(enable = "avx2,fma")]
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn attend_group_avx2(
        q: &[f32],
        dh: usize,
        bases: &[usize],
        off: usize,
        k_cache: &[f32],
        v_cache: &[f32],
        scale: f32,
        softcap: f32,
        scores: &mut [f32],
        acc: &mut [f32],
        out: &mut [f32],
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
                    a0 = _mm256_fmadd_ps(_mm256_loadu_ps(qg.add(c * 8)), _mm256_loadu_ps(k.add(c * 8)), a0);
                    a1 = _mm256_fmadd_ps(_mm256_loadu_ps(qg.add(c * 8 + 8)), _mm256_loadu_ps(k.add(c * 8 + 8)), a1);
                    c += 2;
                }
                if c < chunks {
                    a0 = _mm256_fmadd_ps(_mm256_loadu_ps(qg.add(c * 8)), _mm256_loadu_ps(k.add(c * 8)), a0);
                }
                let mut s = hsum(_mm256_add_ps(a0, a1)) * scale;
                if softcap > 0.0 {
                    s = softcap * (s / softcap).tanh();
                }
                *sp.add(g * np + p) = s;
            }
        }
        // Softmax per head; the weights are normalised here so the value pass needs no division.
        for g in 0..group {
            let row = &mut scores[g * np..(g + 1) * np];
            let m = row.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
            let mut sum = 0f32;
            for sc in row.iter_mut() {
                let e = super::exp_approx(*sc - m);
                *sc = e;
                sum += e;
            }
            let inv = if sum > 0.0 { 1.0 / sum } else { 0.0 };
            row.iter_mut().for_each(|w| *w *= inv);
        }
        let ap = acc.as_mut_ptr();
        for c in 0..group * chunks {
            _mm256_storeu_ps(ap.add(c * 8), _mm256_setzero_ps());
        }
        let sp = scores.as_ptr();
        for (p, &b) in bases.iter().enumerate() {
            let v = vp.add(b + off);
            for c in 0..chunks {
                let vv = _mm256_loadu_ps(v.add(c * 8));
                for g in 0..group {
                    let a = ap.add(g * dh + c * 8);
                    _mm256_storeu_ps(a, _mm256_fmadd_ps(vv, _mm256_set1_ps(*sp.add(g * np + p)), _mm256_loadu_ps(a)));
                }
            }
        }
        out[..group * dh].copy_from_slice(&acc[..group * dh]);
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
