//! MLX affine-quantized weights: `w = scales[g] * q + biases[g]` per group of `group` elements, `q`
//! packed little-endian as a bit stream of `bits`-bit values inside `u32` words (a group always starts
//! on a word boundary since `group * bits` is a multiple of 32). Matrices are never dequantized whole:
//! decode (and, under the panel kernel, prefill) dots packed rows directly; elsewhere prefill
//! dequantizes one tile of rows at a time into gemm.

use crate::pool;

use super::int_dot::{dot_rows_tile, dot_tile, passes_match_tile, quantize_acts, ActOrder, ActRow, ActsKey, IntActs};
use super::matmul::{gemm_tile, tile_rows};
use super::panel_pack::Panels;
use super::{Floats, SharedMut};
use crate::isa::Isa;
use crate::simd_kernel;

/// A quantized `[N, K]` matrix.
#[derive(Clone, Copy)]
pub struct QuantMatrix<'a> {
    pub packed: &'a [u32],
    pub scales: Floats<'a>,
    pub biases: Floats<'a>,
    pub bits: usize,
    pub group: usize,
    /// Logical columns (elements per row).
    pub k: usize,
    /// The same matrix in the panel kernel's own layout, where one was built for it (4-bit weights
    /// on `avx512vnni`): [`panel_pack`](super::panel_pack).
    pub panels: Option<Panels<'a>>,
}

impl QuantMatrix<'_> {
    pub fn words_per_row(&self) -> usize {
        self.k * self.bits / 32
    }
    pub fn groups_per_row(&self) -> usize {
        self.k / self.group
    }

    /// Dequantizes row `r` into `out[..k]` (from the panel-ordered copy where there is one, so that
    /// an embedding row or a float tile reads the same copy as the panel kernel).
    pub fn dequantize_row(&self, isa: Isa, r: usize, out: &mut [f32]) {
        if let Some(p) = self.panels {
            let (mut words, wpg, at) = ([0u32; 16], self.group / 8, p.first + r);
            for g in 0..self.groups_per_row() {
                for (j, w) in words[..wpg].iter_mut().enumerate() {
                    *w = p.weights.word(at, g * wpg + j);
                }
                let o = &mut out[g * self.group..(g + 1) * self.group];
                dequantize_group::run(isa, &words[..wpg], 4, p.scales.get(at, g), p.biases.get(at, g), o);
            }
            return;
        }
        let wpr = self.words_per_row();
        let gpr = self.groups_per_row();
        let wpg = self.group * self.bits / 32;
        let row = &self.packed[r * wpr..(r + 1) * wpr];
        for g in 0..gpr {
            let o = &mut out[g * self.group..(g + 1) * self.group];
            let (s, b) = (self.scales.get(r * gpr + g), self.biases.get(r * gpr + g));
            dequantize_group::run(isa, &row[g * wpg..(g + 1) * wpg], self.bits, s, b, o);
        }
    }
}

simd_kernel! {
    /// Unpacks `out.len()` values of `bits` bits from `words` as `s · q + b` (inside the SIMD path, so
    /// the multiply-add is a vector FMA rather than a call to the software `fmaf`).
    pub fn dequantize_group(words: &[u32], bits: usize, s: f32, b: f32, out: &mut [f32]) {
        match bits {
            2 | 4 | 8 => {
                let per = 32 / bits;
                let mask = (1u32 << bits) - 1;
                for (w, o) in words.iter().zip(out.chunks_exact_mut(per)) {
                    for (j, v) in o.iter_mut().enumerate() {
                        *v = (((*w >> (j * bits)) & mask) as f32).mul_add(s, b);
                    }
                }
            }
            _ => {
                let mask = (1u64 << bits) - 1;
                for (i, v) in out.iter_mut().enumerate() {
                    let bit = i * bits;
                    let wi = bit / 32;
                    let lo = words[wi] as u64;
                    let hi = if wi + 1 < words.len() { words[wi + 1] as u64 } else { 0 };
                    *v = ((((lo | (hi << 32)) >> (bit % 32)) & mask) as f32).mul_add(s, b);
                }
            }
        }
    }
}

simd_kernel! {
    /// `Σ_i x[i] · q[i]` over one group, fused with unpacking for 2/4/8 bits.
    pub fn qdot_group(x: &[f32], words: &[u32], bits: usize) -> f32 {
        match bits {
            4 => {
                let mut acc = [0f32; 8];
                for (w, xs) in words.iter().zip(x.chunks_exact(8)) {
                    for j in 0..8 {
                        acc[j] = xs[j].mul_add(((*w >> (4 * j)) & 15) as f32, acc[j]);
                    }
                }
                acc.iter().sum()
            }
            8 => {
                let mut acc = [0f32; 8];
                for (w2, xs) in words.chunks_exact(2).zip(x.chunks_exact(8)) {
                    for j in 0..8 {
                        acc[j] = xs[j].mul_add(((w2[j / 4] >> (8 * (j % 4))) & 255) as f32, acc[j]);
                    }
                }
                acc.iter().sum()
            }
            2 => {
                let mut acc = [0f32; 16];
                for (w, xs) in words.iter().zip(x.chunks_exact(16)) {
                    for j in 0..16 {
                        acc[j] = xs[j].mul_add(((*w >> (2 * j)) & 3) as f32, acc[j]);
                    }
                }
                acc.iter().sum()
            }
            _ => {
                let mask = (1u64 << bits) - 1;
                let mut s = 0f32;
                for (i, xv) in x.iter().enumerate() {
                    let bit = i * bits;
                    let wi = bit / 32;
                    let lo = words[wi] as u64;
                    let hi = if wi + 1 < words.len() { words[wi + 1] as u64 } else { 0 };
                    s += xv * (((lo | (hi << 32)) >> (bit % 32)) & mask) as f32;
                }
                s
            }
        }
    }
}

/// Largest step (tokens) that takes the float row-dot path (and the int path's decode tiling); larger
/// float steps dequantize tiles of rows into gemm.
pub const ROW_DOT_MAX_TOKENS: usize = 8;

/// From this many tokens a step dequantizes tiles of weight rows to f32 and multiplies them with
/// `gemm`, even where the int16 path is available: the conversion is paid once per row for all
/// tokens, and f32 FMAs then outrun the int16 kernel (break-even at 64 tokens, 1.3× at 128 on Zen 3
/// in `examples/qmatmul_bench.rs`); the result is the exact f32 one. Not where the panel kernel
/// serves the weights (see [`int_path_applies`]).
pub const FLOAT_TILES_MIN_TOKENS: usize = 64;

/// `out[T, N] = x[T, K] · dequant(w)ᵀ`. With `int` (scratch for quantized activations, and the
/// caller's name for `x` so matmuls sharing an input quantize it once), steps where
/// [`int_path_applies`] take the int16-activation path; larger steps, widths without a NEON kernel,
/// or `int = None` (`MLXCEL_CPU_INT16=0`) take the exact f32 paths. `segments` as for
/// [`qmatmul_shared_input`].
#[allow(clippy::too_many_arguments)]
pub fn qmatmul(
    isa: Isa,
    threads: usize,
    x: &[f32],
    t: usize,
    w: QuantMatrix,
    n: usize,
    out: &mut [f32],
    path: QuantPath,
    int: Option<(&mut IntActs, usize)>,
    segments: &[usize],
) {
    let k = w.k;
    if k == 0 {
        out.fill(0.0); // an empty sum (and no division by a zero row length below)
        return;
    }
    if path == QuantPath::Int {
        if let Some((acts, source)) = int {
            qmatmul_shared_input(isa, x, source, t, segments, [QuantPart { w, n, out }], acts);
            return;
        }
    }
    if path != QuantPath::Tiles {
        let gpr = w.groups_per_row();
        let wpr = w.words_per_row();
        let wpg = w.group * w.bits / 32;
        // Σx per group, shared by every row: Σ x·(s·q + b) = s·Σx·q + b·Σx.
        let xsum: Vec<f32> = x.chunks_exact(w.group).map(|g| g.iter().sum::<f32>()).collect();
        let out_ptr = SharedMut(out.as_mut_ptr());
        let rows_per_task = 8;
        pool::for_each(n.div_ceil(rows_per_task), |chunk| {
            for r in chunk * rows_per_task..((chunk + 1) * rows_per_task).min(n) {
                let row = &w.packed[r * wpr..(r + 1) * wpr];
                for ti in 0..t {
                    let xt = &x[ti * k..(ti + 1) * k];
                    let mut acc = 0f32;
                    for g in 0..gpr {
                        let d = qdot_group::run(
                            isa,
                            &xt[g * w.group..(g + 1) * w.group],
                            &row[g * wpg..(g + 1) * wpg],
                            w.bits,
                        );
                        acc += w.scales.get(r * gpr + g) * d + w.biases.get(r * gpr + g) * xsum[ti * gpr + g];
                    }
                    unsafe { *out_ptr.ptr().add(ti * n + r) = acc };
                }
            }
        });
        return;
    }
    let nc = tile_rows(n, threads);
    let out_ptr = SharedMut(out.as_mut_ptr());
    pool::for_each_init(n.div_ceil(nc), Vec::<f32>::new, |tile, ti| {
        let n0 = ti * nc;
        let rows = nc.min(n - n0);
        tile.resize(rows * k, 0.0);
        for r in 0..rows {
            w.dequantize_row(isa, n0 + r, &mut tile[r * k..(r + 1) * k]);
        }
        unsafe { gemm_tile(x, t, k, tile, rows, out_ptr, n, n0) };
    });
}

/// One matrix of [`qmatmul_shared_input`]: `out[T, n] = x · wᵀ`.
pub struct QuantPart<'a, 'o> {
    pub w: QuantMatrix<'a>,
    pub n: usize,
    pub out: &'o mut [f32],
}

/// Whether [`qmatmul`] takes the int16 path for `bits`-bit weights in groups of `group` and a
/// `t`-token step (so matmuls sharing an input can go through [`qmatmul_shared_input`] together). The
/// integer kernels are hand-written for x86 (256-bit for AVX2, 512-bit for AVX-512, each with a VNNI
/// build) and for 4-bit weights on AArch64 (NEON, with a `sdot`/`udot` build); `scalar` runs the
/// portable version of the same arithmetic (so CI checks it). Other widths on NEON would run that
/// portable code, so they take the float paths (auto-vectorised for NEON) instead.
///
/// Where the panel kernel serves the weights (AVX-512 VNNI, 4-bit in groups of 32, 64 or 128), every
/// step takes the int16 path: its eight-token passes outran the float tiles at every size measured
/// (SmolLM2's matmuls on two Zen 5 cores: 64 tokens 3.9×, 128 tokens 3.1×, 512 tokens 2.4×), and each
/// token's result is then the same however the prompt was cut into steps.
pub fn int_path_applies(isa: Isa, bits: usize, group: usize, t: usize, int_enabled: bool) -> bool {
    let kernel = if isa.is_neon() { bits == 4 } else { matches!(bits, 2 | 3 | 4 | 5 | 6 | 8) };
    let panels = panels_serve(isa, bits, group);
    int_enabled && kernel && (panels || t < FLOAT_TILES_MIN_TOKENS)
}

/// Whether the panel kernel serves `bits`-bit weights in groups of `group` on `isa`.
fn panels_serve(isa: Isa, bits: usize, group: usize) -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        super::panel::applies(isa, bits, group, ActOrder::for_weights(isa, bits, group))
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (isa, bits, group);
        false
    }
}

/// The kernel a quantized matmul takes for rows of a sequence with `seq_tokens` tokens in the step.
/// Chosen per sequence, never from the step's total, so that a sequence's result does not depend on
/// what else is batched with it (each path's result for a row depends only on that row).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum QuantPath {
    /// int16 activations ([`int_path_applies`]).
    Int,
    /// Exact f32 per-row dots (few tokens).
    RowDot,
    /// Exact f32: dequantized row tiles through gemm (many tokens).
    Tiles,
}

impl QuantPath {
    pub fn for_sequence(isa: Isa, bits: usize, group: usize, seq_tokens: usize, int_enabled: bool) -> QuantPath {
        if int_path_applies(isa, bits, group, seq_tokens, int_enabled) {
            QuantPath::Int
        } else if seq_tokens <= ROW_DOT_MAX_TOKENS {
            QuantPath::RowDot
        } else {
            QuantPath::Tiles
        }
    }
}

/// The int16-activation path (see [`int_dot`](super::int_dot)) for one or several matmuls of the
/// same input (q/k/v, gate/up) as one parallel loop: one fork/join instead of one per matrix, and the
/// input quantized once. Every part must satisfy
/// [`int_path_applies`] and share `bits`, `group` and `k`.
///
/// `segments` are the ends of runs of rows (the rows of one sequence), ascending, the last `t`; empty
/// for one run. 4-bit rows (2/4/8-bit on the 512-bit kernels) are dotted several tokens at a time
/// (`dot_rows`, each block unpacked once for all of them). Where that gives each token the bits of
/// one token at a time (`dot_tile`; [`passes_match_tile`]: the 512-bit kernels, and 4-bit weights in
/// groups of 32/64/128 on every x86 and NEON kernel), passes run over the whole step, so eight
/// sequences decoding one token each share one pass; elsewhere passes never cross a run's end, so a
/// sequence's rows take the same passes whatever runs beside them (batch invariance).
pub fn qmatmul_shared_input<'a, 'o>(
    isa: Isa,
    x: &[f32],
    source: usize,
    t: usize,
    segments: &[usize],
    parts: impl IntoIterator<Item = QuantPart<'a, 'o>>,
    acts: &mut IntActs,
) {
    const MAX_PARTS: usize = 8;
    // Fixed-size tables (no allocation per step): each part's matrix, rows and output.
    let mut dims: [Option<(QuantMatrix, usize, SharedMut<f32>)>; MAX_PARTS] = [None; MAX_PARTS];
    let mut n_parts = 0;
    for part in parts {
        assert!(n_parts < MAX_PARTS, "at most {MAX_PARTS} matrices per shared-input matmul");
        dims[n_parts] = Some((part.w, part.n, SharedMut(part.out.as_mut_ptr())));
        n_parts += 1;
    }
    let Some((w0, _, _)) = dims[0] else { return };
    let k = w0.k;
    if k == 0 {
        for (_, n, out) in dims.iter().flatten() {
            // SAFETY: each part's `out` holds `t · n` values.
            unsafe { out.slice(0, t * n).fill(0.0) };
        }
        return;
    }
    debug_assert!(dims.iter().flatten().all(|(w, _, _)| w.k == k && w.bits == w0.bits && w.group == w0.group));
    let order = ActOrder::for_weights(isa, w0.bits, w0.group);
    let key = ActsKey { source, t, k, group: w0.group, order };
    // Small inputs: each thread quantizes its own copy at its first task (see `OWN_COPY_MAX_VALUES`).
    let own_copies = t * k <= OWN_COPY_MAX_VALUES && pool::threads() > 1;
    if !own_copies && acts.key != Some(key) {
        quantize_acts(isa, x, t, k, w0.group, order, acts);
        acts.key = Some(key);
    }
    let gpr = w0.groups_per_row();
    let shared = CallerActs(acts);
    let call = CALLS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    debug_assert!(segments.is_empty() || (segments.last() == Some(&t) && segments.windows(2).all(|p| p[0] <= p[1])));
    let multi = w0.bits == 4 || matches!(order, ActOrder::Fields(_));
    let whole = [t];
    let segments = if passes_match_tile(isa, w0.bits, w0.group, order) { &[][..] } else { segments };
    // A task is a tile of rows of one part; its weights stay in L1/L2 while all tokens stream past.
    // A row's result does not depend on its tile.
    let rows_per_task = if t <= ROW_DOT_MAX_TOKENS {
        let mut rows = [0usize; MAX_PARTS];
        for (r, d) in rows.iter_mut().zip(&dims) {
            *r = d.map_or(0, |d| d.1);
        }
        few_token_tile(&rows[..n_parts], pool::threads())
    } else {
        16
    };
    let mut first_task = [0usize; MAX_PARTS + 1];
    for p in 0..n_parts {
        first_task[p + 1] = first_task[p] + dims[p].map_or(0, |(_, n, _)| n.div_ceil(rows_per_task));
    }
    // A task's part and the rows of that part it covers.
    let task_rows = |task: usize| {
        let p = (0..n_parts).find(|&p| task < first_task[p + 1]).unwrap_or(0);
        let chunk = task - first_task[p];
        (p, chunk * rows_per_task..((chunk + 1) * rows_per_task).min(dims[p].map_or(0, |d| d.1)))
    };
    // One task: a tile of rows of one part, against every token of `acts`.
    let run_task = |task: usize, acts: &IntActs| {
        let act = |ti: usize| acts.row(ti, k, gpr, order);
        let (p, tile) = task_rows(task);
        let Some((w, n, out_ptr)) = dims[p] else { return };
        // Widths with a multi-token kernel: eight tokens per pass while they last, then four (each
        // block unpacked once for all of them); then, and for other widths, one token at a time
        // over the cached tile.
        let mut start = 0;
        for &end in if segments.is_empty() { &whole[..] } else { segments } {
            let mut ti = start;
            while multi && ti + 8 <= end {
                tokens_pass::<8>(isa, w, tile.clone(), &act, ti, out_ptr, n);
                ti += 8;
            }
            while multi && ti + 4 <= end {
                tokens_pass::<4>(isa, w, tile.clone(), &act, ti, out_ptr, n);
                ti += 4;
            }
            for tj in ti..end {
                // SAFETY: each task owns its rows' columns of its part's `out`.
                let o = unsafe { out_ptr.slice(tj * n + tile.start, tile.len()) };
                dot_tile(isa, w, tile.clone(), act(tj), o);
            }
            start = end;
        }
    };
    // A task's first panel, asked for before the task quantizes its own copy of the input.
    let warm = |task: usize| {
        #[cfg(target_arch = "x86_64")]
        {
            let (p, tile) = task_rows(task);
            if let Some((w, _, _)) = dims[p] {
                super::panel::prefetch_panel(&w, tile.start);
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        let _ = task;
    };
    pool::for_each(first_task[n_parts], |task| {
        if !own_copies {
            // SAFETY: quantized above; every thread only reads it during the fan-out.
            return run_task(task, unsafe { &*shared.ptr() });
        }
        if pool::participant() == 0 {
            // SAFETY: with own copies, the caller (participant 0) alone touches its scratch during
            // the fan-out, one task at a time.
            let acts = unsafe { &mut *shared.ptr() };
            if acts.key != Some(key) {
                warm(task);
                quantize_acts(isa, x, t, k, w0.group, order, acts);
                acts.key = Some(key);
            }
            return run_task(task, acts);
        }
        // A worker's copy, keyed by this call; quantized at the worker's first task of the call.
        let own_key = ActsKey { source: call, ..key };
        OWN_ACTS.with(|own| match own.try_borrow_mut() {
            Ok(mut own) => {
                if own.key != Some(own_key) {
                    warm(task);
                    quantize_acts(isa, x, t, k, w0.group, order, &mut own);
                    own.key = Some(own_key);
                }
                run_task(task, &own);
            }
            // Only if a task itself ran a matmul on this thread (none does): a copy for this task.
            Err(_) => {
                let mut copy = IntActs::default();
                quantize_acts(isa, x, t, k, w0.group, order, &mut copy);
                run_task(task, &copy);
            }
        })
    });
}

/// What a task costs beyond its rows, in rows (of the same matrices): each task claimed is a cache
/// line passed between cores and a new stretch of weights to start streaming. With tiles about a
/// quarter of a matrix's rows per thread, SmolLM2's eight-token steps ran ~10% slower on two Zen 5
/// cores than with about one; with 32-row tiles of a vocabulary-sized matrix, the second thread cost
/// more than it gained.
const TASK_COST_ROWS: usize = 64;

/// The rows per task of a few-token fan-out over `parts` (the rows of each matrix sharing the
/// input, whose tasks are claimed in order) on `threads` threads: the tile of 32 to 1024 rows whose
/// estimated finish — each thread's rows when each task goes to the thread free first, plus
/// [`TASK_COST_ROWS`] per task it ran — comes first; on a tie the one whose busiest thread has
/// fewer rows, then the smaller (tasks closer to one size). (q, k and v of 576, 192 and 192 rows on
/// two threads: 288-row tiles, 2 + 1 + 1 tasks.) Remembered per shape, as every step asks again.
fn few_token_tile(parts: &[usize], threads: usize) -> usize {
    thread_local! {
        static TILES: std::cell::RefCell<Vec<(Vec<usize>, usize, usize)>> = const { std::cell::RefCell::new(Vec::new()) };
    }
    if let Some(rows) =
        TILES.with_borrow(|c| c.iter().find(|(p, t, _)| p.as_slice() == parts && *t == threads).map(|e| e.2))
    {
        return rows;
    }
    let finish = |rows: usize| {
        // Each thread's (rows, tasks), the next task to the one whose rows end first.
        let mut load = vec![(0usize, 0usize); threads.max(1)];
        for &n in parts {
            let mut left = n;
            while left > 0 {
                let take = left.min(rows);
                let first = load.iter_mut().min_by_key(|l| l.0).expect("at least one thread");
                *first = (first.0 + take, first.1 + 1);
                left -= take;
            }
        }
        let finish = load.iter().map(|&(r, k)| r + TASK_COST_ROWS * k).max().unwrap_or(0);
        (finish, load.iter().map(|l| l.0).max().unwrap_or(0), rows)
    };
    let rows = (1..=32).map(|i| 32 * i).min_by_key(|&rows| finish(rows)).unwrap_or(32);
    TILES.with_borrow_mut(|c| {
        if c.len() >= 32 {
            c.remove(0);
        }
        c.push((parts.to_vec(), threads, rows));
    });
    rows
}

/// Inputs of at most this many values (`t · k`) are quantized by every thread of a
/// [`qmatmul_shared_input`] fan-out for itself, at its first task: a decode step's input takes a
/// few µs to quantize, less than the same rows cost a thread to read from the cache of the core
/// that wrote them (an 8-token SmolLM2 step's matmuls took about 13% longer on two Xeon cores when
/// the threads quantized the tokens between them). Quantizing is per row, so every copy has the
/// same bits. Larger inputs are quantized once, across the threads.
const OWN_COPY_MAX_VALUES: usize = 32 * 1024;

/// Numbers each [`qmatmul_shared_input`] call, to key the workers' own copies of its input.
static CALLS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

thread_local! {
    /// A pool worker's own copy of a small quantized input (see [`OWN_COPY_MAX_VALUES`]).
    static OWN_ACTS: std::cell::RefCell<IntActs> = std::cell::RefCell::new(IntActs::default());
}

/// The caller's quantized-input scratch, shared with the fan-out's tasks.
#[derive(Clone, Copy)]
struct CallerActs(*mut IntActs);
// SAFETY: it outlives the fan-out; during it either every thread only reads it (quantized before),
// or only the caller (participant 0) touches it (each worker reads its own copy).
unsafe impl Sync for CallerActs {}

impl CallerActs {
    /// (A method, so that closures capture the whole wrapper rather than its raw field.)
    fn ptr(self) -> *mut IntActs {
        self.0
    }
}

/// Tokens `ti..ti + NT` against `rows` of `w`, each weight row unpacked once for all of them.
fn tokens_pass<'a, const NT: usize>(
    isa: Isa,
    w: QuantMatrix,
    rows: std::ops::Range<usize>,
    act: &impl Fn(usize) -> ActRow<'a>,
    ti: usize,
    out: SharedMut<f32>,
    n: usize,
) {
    let xs: [ActRow; NT] = std::array::from_fn(|j| act(ti + j));
    // SAFETY: each task owns its rows' columns of `out` (`t · n` values, `ti + NT ≤ t`).
    unsafe { dot_rows_tile(isa, w, rows, &xs, out.ptr().add(ti * n), n) };
}

/// Rows `ids` of a quantized table, dequantized.
pub fn qembedding(isa: Isa, ids: &[i32], w: QuantMatrix, out: &mut [f32]) {
    let k = w.k;
    pool::zip_chunks(out, k, ids, 1, |_, o, id| w.dequantize_row(isa, id[0] as usize, o));
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pool::ThreadPool;

    /// A random 4-bit matrix in groups of 32 with f16 scales and biases.
    struct Random4Bit {
        packed: Vec<u32>,
        scales: Vec<u16>,
        biases: Vec<u16>,
        k: usize,
    }

    impl Random4Bit {
        fn new(rng: &mut crate::kernels::TestRng, n: usize, k: usize) -> Random4Bit {
            let packed = (0..n * k / 8).map(|_| rng.next() as u32).collect();
            let mut factor = |base: f32| half::f16::from_f32(base + (rng.next() % 1000) as f32 * 1e-5).to_bits();
            let scales = (0..n * k / 32).map(|_| factor(0.01)).collect();
            let biases = (0..n * k / 32).map(|_| factor(-0.005)).collect();
            Random4Bit { packed, scales, biases, k }
        }

        fn matrix(&self) -> QuantMatrix<'_> {
            QuantMatrix {
                packed: &self.packed,
                scales: Floats::F16(&self.scales),
                biases: Floats::F16(&self.biases),
                bits: 4,
                group: 32,
                k: self.k,
                panels: None,
            }
        }
    }

    /// Few-token tiles: SmolLM2's shapes on two threads take one tile per thread where that splits
    /// the rows evenly, and other thread counts are not left with one thread running a whole
    /// matrix while the others wait (the busiest thread within a task of an even share).
    #[test]
    fn few_token_tiles_share_the_rows_evenly() {
        assert_eq!(few_token_tile(&[576, 192, 192], 2), 288);
        assert_eq!(few_token_tile(&[576], 2), 288);
        assert_eq!(few_token_tile(&[1536, 1536], 2), 768);
        assert_eq!(few_token_tile(&[49152], 2), 1024);
        for (parts, threads) in [
            (vec![576, 192, 192], 3),
            (vec![2048, 512, 512], 4),
            (vec![2048, 512, 512], 8),
            (vec![896, 128, 128], 4),
            (vec![4864, 4864], 16),
            (vec![100], 4),
        ] {
            let rows = few_token_tile(&parts, threads);
            assert!(rows.is_multiple_of(32) && (32..=1024).contains(&rows), "{parts:?} on {threads}: {rows}");
            // Tasks claimed in order by whichever thread is free first.
            let mut load = vec![0usize; threads];
            for &n in &parts {
                for start in (0..n).step_by(rows) {
                    *load.iter_mut().min().unwrap() += (n - start).min(rows);
                }
            }
            let share = parts.iter().sum::<usize>().div_ceil(threads);
            let busiest = *load.iter().max().unwrap();
            assert!(busiest <= share + rows.min(share), "{parts:?} on {threads}: {rows}-row tiles, busiest {busiest}");
            assert!(
                busiest <= share * 3 / 2 || rows <= 64,
                "{parts:?} on {threads}: {rows}-row tiles, busiest {busiest}"
            );
        }
    }

    /// Where the panel kernel serves the weights, a step of many tokens (a 100-token prompt) takes the
    /// int16 path too and gives each token the bits it gets alone, so a prompt's results do not
    /// depend on how it is cut into steps (a cached prefix and a recomputed one agree). Skipped
    /// without the panel kernel (printed).
    #[test]
    fn a_long_step_under_the_panel_kernel_gives_each_token_its_own_bits() {
        let isa = Isa::best();
        if !panels_serve(isa, 4, 32) {
            eprintln!("long int16 steps: SKIPPED (no panel kernel on {})", isa.name());
            return;
        }
        assert!(int_path_applies(isa, 4, 32, 100, true) && int_path_applies(isa, 4, 32, 4096, true));
        assert!(!int_path_applies(isa, 4, 32, 100, false));
        let mut rng = crate::kernels::TestRng(0x51_7CC1_B727_220Au64);
        let (n, k, t) = (80, 576, 100);
        let m = Random4Bit::new(&mut rng, n, k);
        let w = m.matrix();
        let mut next = move || rng.next();
        let x: Vec<f32> = (0..t * k).map(|_| (next() % 2001) as f32 / 1000.0 - 1.0).collect();
        let pool = ThreadPool::new(2).unwrap();
        let mut whole = vec![f32::NAN; t * n];
        pool.install(|| {
            let part = QuantPart { w, n, out: &mut whole };
            qmatmul_shared_input(isa, &x, 1, t, &[], [part], &mut IntActs::default());
        });
        for ti in 0..t {
            let mut alone = vec![f32::NAN; n];
            let part = QuantPart { w, n, out: &mut alone };
            qmatmul_shared_input(isa, &x[ti * k..(ti + 1) * k], 2 + ti, 1, &[], [part], &mut IntActs::default());
            for r in 0..n {
                assert_eq!(whole[ti * n + r].to_bits(), alone[r].to_bits(), "token {ti} row {r}");
            }
        }
    }

    /// With two threads, a decode-sized input is quantized by each thread for itself and a larger
    /// one once for both; either way every (row, token) gets the bits of a one-thread run, which
    /// quantizes once. (Many row tiles, so that the worker takes some of them.)
    #[test]
    fn every_threads_copy_of_the_input_gives_the_one_thread_bits() {
        let isa = Isa::best();
        let mut rng = crate::kernels::TestRng(0x9E37_79B9_7F4A_7C15u64);
        let (n, k) = (2048, 576);
        let m = Random4Bit::new(&mut rng, n, k);
        let w = m.matrix();
        let mut next = move || rng.next();
        let pool = ThreadPool::new(2).unwrap();
        // 8 tokens: own copies; 60 tokens: over `OWN_COPY_MAX_VALUES`, one shared copy.
        for t in [1, 8, 60] {
            let x: Vec<f32> = (0..t * k).map(|_| (next() % 2001) as f32 / 1000.0 - 1.0).collect();
            let run = |out: &mut Vec<f32>| {
                let part = QuantPart { w, n, out };
                qmatmul_shared_input(isa, &x, 7, t, &[], [part], &mut IntActs::default());
            };
            let mut alone = vec![0f32; t * n];
            run(&mut alone);
            let mut shared = vec![f32::NAN; t * n];
            pool.install(|| run(&mut shared));
            let differ = alone.iter().zip(&shared).filter(|(a, b)| a.to_bits() != b.to_bits()).count();
            assert_eq!(differ, 0, "{t} tokens on {}: {differ} results differ", isa.name());
        }
    }
}
