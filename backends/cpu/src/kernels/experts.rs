//! Mixture of experts: the router's top-k, expert (gathered) matmuls and the weighted combine.
//!
//! A gathered matmul groups its rows by expert, and an expert's rows by kernel path, gathers each
//! group's activation rows and runs the ordinary matmul kernels on them (int16, row dots or gemm
//! tiles, as for a dense layer): an expert computes only the rows routed to it. The path of a
//! sequence's rows at an expert is chosen from how many of that sequence's rows the expert has (the
//! dense rule, with the expert's share of the sequence in place of its length: 128 prompt tokens over
//! 8 experts are ~32 rows each, which the int16 kernel serves better than dequantized gemm tiles), so
//! it depends on that sequence alone; kernels that group rows never group across sequences, so a
//! token's output does not change with the tokens of other sequences that share its expert.

use crate::pool;

use super::int_dot::IntActs;
use super::matmul;
use super::quantized::{self, QuantMatrix, QuantPath};
use super::Floats;
use crate::isa::Isa;
use crate::simd_kernel;

/// What [`top_k`] computes per row.
#[derive(Clone, Copy, Debug)]
pub struct TopK {
    pub k: usize,
    /// Write the selected columns' indices (as f32 integers) instead of their values.
    pub indices: bool,
    /// Softmax over the whole row before selecting (router probabilities).
    pub softmax: bool,
    /// Divide the selected values by their sum.
    pub renormalize: bool,
}

/// `out[T, k]`: per row of `x [T, cols]` the `k` largest values (or their columns) in descending
/// order, equal values by ascending column. `1 ≤ k ≤ cols`.
pub fn top_k(isa: Isa, x: &[f32], cols: usize, p: TopK, out: &mut [f32]) {
    let k = p.k;
    if k == 0 || cols == 0 {
        return;
    }
    pool::zip_chunks_init(
        out,
        k,
        x,
        cols,
        || (Vec::<f32>::new(), Vec::<u32>::new()),
        |(v, order), o, row| {
            let v: &[f32] = if p.softmax {
                v.clear();
                v.extend_from_slice(row);
                softmax_in_place(v);
                v
            } else {
                row
            };
            if k <= SCAN_MAX_K && cols >= 8 * k {
                scan_top::run(isa, v, k, order);
            } else {
                // A total order (values by `total_cmp`, then column), so the selection is unique and
                // both outputs of a router agree.
                let by_rank = |a: &u32, b: &u32| v[*b as usize].total_cmp(&v[*a as usize]).then(a.cmp(b));
                order.clear();
                order.extend(0..cols as u32);
                if k < cols {
                    order.select_nth_unstable_by(k - 1, by_rank);
                }
                order[..k].sort_unstable_by(by_rank);
            }
            let chosen = &order[..k];
            if p.indices {
                for (d, &c) in o.iter_mut().zip(chosen) {
                    *d = c as f32;
                }
                return;
            }
            for (d, &c) in o.iter_mut().zip(chosen) {
                *d = v[c as usize];
            }
            if p.renormalize {
                let sum: f32 = o.iter().sum();
                o.iter_mut().for_each(|d| *d /= sum);
            }
        },
    );
}

/// Largest `k` for which [`scan_top`] is used (a vocabulary's top-k for sampling; routers are smaller).
const SCAN_MAX_K: usize = 128;

/// `x`'s rank in `f32::total_cmp`'s order, as an integer (what `total_cmp` compares).
#[inline(always)]
fn total_key(x: f32) -> i32 {
    let bits = x.to_bits() as i32;
    bits ^ (((bits >> 31) as u32) >> 1) as i32
}

/// Columns [`scan_top`] rules out at once: the largest of a run that cannot enter the list
/// excludes the run.
const SCAN_RUN: usize = 64;

simd_kernel! {
    /// The `k` best columns of `v` in one pass, best first, in [`top_k`]'s order: a sorted list of
    /// `k` that most values fail to enter, tested a run of [`SCAN_RUN`] at a time against the run's
    /// largest (a vector maximum of `total_cmp` keys), so a vocabulary row costs about one read.
    pub fn scan_top(v: &[f32], k: usize, best: &mut Vec<u32>) {
        best.clear();
        for (ri, run) in v.chunks(SCAN_RUN).enumerate() {
            let c0 = ri * SCAN_RUN;
            if best.len() == k {
                let max = run.iter().map(|&x| total_key(x)).fold(i32::MIN, i32::max);
                // Columns come in ascending order, so an equal value ranks below every one kept.
                if max <= total_key(v[best[k - 1] as usize]) {
                    continue;
                }
            }
            for (j, &x) in run.iter().enumerate() {
                if best.len() == k && total_key(x) <= total_key(v[best[k - 1] as usize]) {
                    continue;
                }
                let at = best.partition_point(|&b| v[b as usize].total_cmp(&x).is_ge());
                if best.len() == k {
                    best.pop();
                }
                best.insert(at, (c0 + j) as u32);
            }
        }
    }
}

/// `v = softmax(v)`, in f32 with the maximum subtracted first.
fn softmax_in_place(v: &mut [f32]) {
    let m = v.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut sum = 0f32;
    for x in v.iter_mut() {
        *x = (*x - m).exp();
        sum += *x;
    }
    v.iter_mut().for_each(|x| *x /= sum);
}

/// `out[t] = Σ_j w[t, j] · y[t·k + j]` over rows of `n` columns, summed in order of `j`.
pub fn weighted_sum(y: &[f32], w: &[f32], k: usize, n: usize, out: &mut [f32]) {
    if n == 0 {
        return;
    }
    pool::chunks_mut(out, n, |t, o| {
        o.fill(0.0);
        for j in 0..k {
            let wj = w[t * k + j];
            let yr = &y[(t * k + j) * n..(t * k + j + 1) * n];
            for (d, &v) in o.iter_mut().zip(yr) {
                *d += wj * v;
            }
        }
    });
}

/// Where the rows of a gathered matmul go.
pub struct Routing<'a> {
    /// `[T, k]` expert ids as f32 integers.
    pub indices: &'a [f32],
    pub k: usize,
    /// `x` has one row per token, shared by its `k` experts (else one row per `(t, j)`).
    pub x_per_token: bool,
    /// Tokens in the step.
    pub tokens: usize,
    /// Sequence of each token (empty when unknown: all one sequence); a sequence's tokens are
    /// contiguous.
    pub token_seq: &'a [u32],
    /// The kernel path for `n` rows of one sequence at one expert.
    pub path_for: &'a (dyn Fn(usize) -> QuantPath + Sync),
    /// The first expert this op holds, and how many it holds.
    pub first_expert: usize,
    pub held: usize,
    /// Experts in the model: every index must be below.
    pub total: usize,
}

/// One expert's rows that take one kernel path: output rows `t·k + j`, in order, and where each
/// sequence's rows end among them.
struct Group {
    expert: usize,
    path: QuantPath,
    rows: Vec<u32>,
    seq_ends: Vec<usize>,
}

fn path_slot(p: QuantPath) -> usize {
    match p {
        QuantPath::Int => 0,
        QuantPath::RowDot => 1,
        QuantPath::Tiles => 2,
    }
}

const PATHS: [QuantPath; 3] = [QuantPath::Int, QuantPath::RowDot, QuantPath::Tiles];

/// Checks every index and groups the rows of held experts by (expert, path).
fn groups(r: &Routing) -> Result<Vec<Group>, String> {
    let (t, k) = (r.tokens, r.k);
    if r.indices.len() != t * k {
        return Err(format!("indices hold {} values for {t} tokens of {k} experts each", r.indices.len()));
    }
    for (row, &v) in r.indices.iter().enumerate() {
        if !(v >= 0.0 && v.fract() == 0.0 && (v as usize) < r.total) {
            return Err(format!(
                "expert index {v} (token {}, slot {}) is not an expert id below {}",
                row / k.max(1),
                row % k.max(1),
                r.total
            ));
        }
    }
    let held = |v: f32| (v as usize).checked_sub(r.first_expert).filter(|&e| e < r.held);
    let mut buckets: Vec<Vec<u32>> = vec![Vec::new(); r.held * PATHS.len()];
    let mut count = vec![0usize; r.held];
    // Sequence by sequence: each expert's share of the sequence picks the path of those rows.
    let mut t0 = 0;
    while t0 < t {
        let seq = r.token_seq.get(t0);
        let t1 = (t0..t).find(|&ti| r.token_seq.get(ti) != seq).unwrap_or(t);
        count.fill(0);
        for &v in &r.indices[t0 * k..t1 * k] {
            if let Some(e) = held(v) {
                count[e] += 1;
            }
        }
        for row in t0 * k..t1 * k {
            if let Some(e) = held(r.indices[row]) {
                buckets[e * PATHS.len() + path_slot((r.path_for)(count[e]))].push(row as u32);
            }
        }
        t0 = t1;
    }
    Ok(buckets
        .into_iter()
        .enumerate()
        .filter(|(_, rows)| !rows.is_empty())
        .map(|(b, rows)| {
            let seq = |i: usize| r.token_seq.get(rows[i] as usize / k).copied().unwrap_or(0);
            let mut seq_ends: Vec<usize> = (1..rows.len()).filter(|&i| seq(i) != seq(i - 1)).collect();
            seq_ends.push(rows.len());
            Group { expert: b / PATHS.len(), path: PATHS[b % PATHS.len()], rows, seq_ends }
        })
        .collect())
}

/// Runs `mul(expert, path, x_rows, n_rows, out_rows, seq_ends)` on each group's gathered rows of
/// `x [·, kdim]` and scatters the results into `out [T·k, n]`; rows of experts not held stay as they
/// are.
fn for_each_group(
    r: &Routing,
    x: &[f32],
    kdim: usize,
    n: usize,
    out: &mut [f32],
    mut mul: impl FnMut(usize, QuantPath, &[f32], usize, &mut [f32], &[usize]),
) -> Result<(), String> {
    let (mut xg, mut og) = (Vec::<f32>::new(), Vec::<f32>::new());
    for g in groups(r)? {
        let m = g.rows.len();
        xg.clear();
        for &row in &g.rows {
            let xr = if r.x_per_token { row as usize / r.k } else { row as usize };
            xg.extend_from_slice(&x[xr * kdim..(xr + 1) * kdim]);
        }
        og.clear();
        og.resize(m * n, 0.0);
        if g.path == QuantPath::Tiles {
            // gemm's result for a row depends on how many rows it multiplies at once: one call per
            // sequence, whose rows for this expert do not depend on the rest of the step.
            let mut start = 0;
            for &end in &g.seq_ends {
                let (xs, os) = (&xg[start * kdim..end * kdim], &mut og[start * n..end * n]);
                mul(g.expert, g.path, xs, end - start, os, &[end - start]);
                start = end;
            }
        } else {
            mul(g.expert, g.path, &xg, m, &mut og, &g.seq_ends);
        }
        for (&row, o) in g.rows.iter().zip(og.chunks_exact(n.max(1))) {
            out[row as usize * n..(row as usize + 1) * n].copy_from_slice(o);
        }
    }
    Ok(())
}

/// Expert matmul with float weights, `experts[e]` the `[n, kdim]` weight of held expert `e`.
#[allow(clippy::too_many_arguments)]
pub fn gather_matmul(
    isa: Isa,
    threads: usize,
    x: &[f32],
    kdim: usize,
    r: &Routing,
    experts: &[Floats],
    n: usize,
    out: &mut [f32],
) -> Result<(), String> {
    for_each_group(r, x, kdim, n, out, |e, path, xg, m, og, _| {
        matmul::matmul(isa, threads, xg, m, kdim, experts[e], n, og, path == QuantPath::RowDot)
    })
}

/// Expert matmul with a stack of quantized experts: `w` is `[E·n, k]` (expert `e` is rows
/// `e·n..(e+1)·n`). `acts` is the int16 scratch of the int path (its key is cleared: every group
/// quantizes its own gathered rows).
#[allow(clippy::too_many_arguments)]
pub fn gather_qmatmul(
    isa: Isa,
    threads: usize,
    x: &[f32],
    r: &Routing,
    w: QuantMatrix,
    n: usize,
    out: &mut [f32],
    acts: &mut IntActs,
) -> Result<(), String> {
    let (wpr, gpr) = (w.words_per_row(), w.groups_per_row());
    let result = for_each_group(r, x, w.k, n, out, |e, path, xg, m, og, seq_ends| {
        let expert = QuantMatrix {
            packed: &w.packed[e * n * wpr..(e + 1) * n * wpr],
            scales: w.scales.slice(e * n * gpr, n * gpr),
            biases: w.biases.slice(e * n * gpr, n * gpr),
            // The whole tensor's panels (never built for expert weights) do not describe a slice.
            panels: None,
            ..w
        };
        acts.key = None;
        let int = (path == QuantPath::Int).then_some((&mut *acts, usize::MAX));
        quantized::qmatmul(isa, threads, xg, m, expert, n, og, path, int, seq_ends);
    });
    acts.key = None;
    result
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::isa::IsaPath;

    /// The one-pass selection agrees with a full sort under the same total order (ties included).
    #[test]
    fn scanned_top_k_matches_a_full_sort() {
        let cols = 3000;
        // Few distinct values, so many ties; a NaN and infinities for the total order's edges.
        let mut row: Vec<f32> = (0..cols).map(|i| ((i * 7919) % 97) as f32 * 0.25 - 12.0).collect();
        row[17] = f32::INFINITY;
        row[2999] = f32::NEG_INFINITY;
        row[1234] = -0.0;
        row[2500] = f32::NAN;
        row[2600] = -f32::NAN;
        for k in [1, 2, 40, 100, 128] {
            let mut want: Vec<u32> = (0..cols as u32).collect();
            want.sort_by(|&a, &b| row[b as usize].total_cmp(&row[a as usize]).then(a.cmp(&b)));
            for isa in IsaPath::ALL.into_iter().filter_map(Isa::detect) {
                let mut got = Vec::new();
                scan_top::run(isa, &row, k, &mut got);
                assert_eq!(got, want[..k], "k = {k} {}", isa.name());
                let mut idx = vec![0f32; k];
                top_k(isa, &row, cols, TopK { k, indices: true, softmax: false, renormalize: false }, &mut idx);
                assert_eq!(idx, want[..k].iter().map(|&c| c as f32).collect::<Vec<_>>());
            }
        }
    }
}
