//! Op conformance: every op of every usable backend against a float64 reference on random inputs, with
//! several shapes including odd sizes (the suite every backend must pass, as llama.cpp's
//! `test-backend-ops`). `MLXCEL_CPU_ISA` selects the CPU kernel path under test.
//!
//! Tolerance: |got − ref| ≤ 1e-4·(1 + |ref|) for elementwise ops, and ≤ 1e-4·√K·(1 + |ref|) for
//! reductions over K terms (matmul, attention, norms): the backends compute in f32, whose rounding
//! grows with the square root of the number of summed terms. Weights in f16/bf16/quantized form are
//! decoded exactly in the reference, so every dtype shares these bounds.

mod common;

use half::{bf16, f16};
use mlxcel_plugin_api::*;
use mlxcel_plugins::{BackendContext, Catalog, DeviceBuffer, PluginSearch};

/// Deterministic random numbers (xorshift64*).
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545F4914F6CDD1D)
    }
    fn uniform(&mut self) -> f64 {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0
    }
    fn vec(&mut self, n: usize, scale: f64) -> Vec<f32> {
        (0..n).map(|_| (self.uniform() * scale) as f32).collect()
    }
}

fn bytes<T: Copy>(v: &[T]) -> Vec<u8> {
    let n = std::mem::size_of_val(v);
    unsafe { std::slice::from_raw_parts(v.as_ptr() as *const u8, n) }.to_vec()
}

/// A float weight in one of the storage dtypes, with its exactly decoded values.
struct FloatWeight {
    data: Vec<u8>,
    values: Vec<f64>,
}

fn float_weight(rng: &mut Rng, n: usize, dtype: DType, scale: f64) -> FloatWeight {
    let raw = rng.vec(n, scale);
    match dtype {
        DType::F32 => FloatWeight { data: bytes(&raw), values: raw.iter().map(|&v| v as f64).collect() },
        DType::F16 => {
            let h: Vec<u16> = raw.iter().map(|&v| f16::from_f32(v).to_bits()).collect();
            FloatWeight { values: h.iter().map(|&b| f16::from_bits(b).to_f64()).collect(), data: bytes(&h) }
        }
        DType::BF16 => {
            let h: Vec<u16> = raw.iter().map(|&v| bf16::from_f32(v).to_bits()).collect();
            FloatWeight { values: h.iter().map(|&b| bf16::from_bits(b).to_f64()).collect(), data: bytes(&h) }
        }
        _ => unreachable!(),
    }
}

/// A random MLX affine-quantized `[n, k]` matrix and its exact dequantization.
struct QuantWeight {
    packed: Vec<u32>,
    scales: FloatWeight,
    biases: FloatWeight,
    dequant: Vec<f64>,
}

fn quant_weight(rng: &mut Rng, n: usize, k: usize, bits: usize, group: usize, sdtype: DType) -> QuantWeight {
    let q: Vec<u64> = (0..n * k).map(|_| rng.next() % (1 << bits)).collect();
    // Pack as a little-endian bit stream per row (the MLX layout).
    let wpr = k * bits / 32;
    let mut packed = vec![0u32; n * wpr];
    for r in 0..n {
        for i in 0..k {
            let bit = i * bits;
            let v = q[r * k + i];
            let w = r * wpr + bit / 32;
            packed[w] |= (v << (bit % 32)) as u32;
            if bit % 32 + bits > 32 {
                packed[w + 1] |= (v >> (32 - bit % 32)) as u32;
            }
        }
    }
    let g = k / group;
    let scales = float_weight(rng, n * g, sdtype, 0.1);
    let biases = float_weight(rng, n * g, sdtype, 0.5);
    let dequant = (0..n * k)
        .map(|idx| {
            let (r, i) = (idx / k, idx % k);
            scales.values[r * g + i / group] * q[idx] as f64 + biases.values[r * g + i / group]
        })
        .collect();
    QuantWeight { packed, scales, biases, dequant }
}

/// One graph run on a backend.
struct Run<'a> {
    ctx: &'a mut BackendContext,
    g: Graph,
    inputs: Vec<Vec<u8>>,
    weights: Vec<DeviceBuffer>,
    kv: Vec<(DeviceBuffer, DeviceBuffer)>,
    batch: Option<BatchData>,
}

struct BatchData {
    token_seq: Vec<u32>,
    positions: Vec<i32>,
    slots: Vec<i64>,
    tables: Vec<u32>,
    max_blocks: u32,
    block_size: u32,
    num_blocks: u32,
}

impl<'a> Run<'a> {
    fn new(ctx: &'a mut BackendContext) -> Self {
        Run { ctx, g: Graph::new(), inputs: vec![], weights: vec![], kv: vec![], batch: None }
    }
    fn input_f32(&mut self, v: &[f32], shape: &[u64]) -> TensorId {
        let slot = self.inputs.len() as i64;
        self.inputs.push(bytes(v));
        self.g.input(slot, DType::F32, shape)
    }
    fn input_i32(&mut self, v: &[i32]) -> TensorId {
        let slot = self.inputs.len() as i64;
        self.inputs.push(bytes(v));
        self.g.input(slot, DType::I32, &[v.len() as u64])
    }
    fn weight(&mut self, data: &[u8], dtype: DType, shape: &[u64]) -> TensorId {
        let idx = self.weight_buffer(data);
        self.g.weight(idx, dtype, shape)
    }
    /// Binds `data` as the next weight and returns its index (for row views of it).
    fn weight_buffer(&mut self, data: &[u8]) -> u32 {
        // Leak the host copy: it must outlive the zero-copy buffer, and tests are short.
        let data: &'static [u8] = Box::leak(data.to_vec().into_boxed_slice());
        let buf = unsafe { self.ctx.buffer_from_host(data) }.unwrap();
        self.weights.push(buf);
        (self.weights.len() - 1) as u32
    }
    /// `x [t, k] · wᵀ` for an MLX-quantized `[n, k]` weight.
    #[allow(clippy::too_many_arguments)]
    fn quant_matmul(
        &mut self,
        x: TensorId,
        q: &QuantWeight,
        t: usize,
        k: usize,
        n: usize,
        bits: usize,
        group: usize,
        sd: DType,
    ) -> TensorId {
        let n64 = n as u64;
        let pi = self.weight(&bytes(&q.packed), DType::U32, &[n64, (k * bits / 32) as u64]);
        let si = self.weight(&q.scales.data, sd, &[n64, (k / group) as u64]);
        let bi = self.weight(&q.biases.data, sd, &[n64, (k / group) as u64]);
        self.g.op_with(OpCode::QuantMatMul, &[t as u64, n64], &[x, pi, si, bi], &[bits as i64, group as i64], &[])
    }
    fn execute(mut self, out: TensorId) -> Vec<f32> {
        self.g.mark_output(out);
        for n in &self.g.nodes {
            assert!(self.ctx.supports(n), "backend `{}` does not support {:?}", self.ctx.name(), n.opcode());
        }
        let mut result = vec![0f32; self.g.node(out).numel()];
        let inputs: Vec<HostTensor> =
            self.inputs.iter().map(|b| HostTensor { ptr: b.as_ptr() as *mut u8, len: b.len() }).collect();
        let weights: Vec<BufferHandle> = self.weights.iter().map(|b| b.handle()).collect();
        let kv: Vec<KvBinding> = self
            .kv
            .iter()
            .map(|(k, v)| KvBinding { k: k.handle(), v: v.handle(), dtype: DType::F32 as u32, ..KvBinding::zeroed() })
            .collect();
        let groups: Vec<KvGroupTables> = self
            .batch
            .iter()
            .map(|b| KvGroupTables {
                slot_mapping: b.slots.as_ptr(),
                block_tables: b.tables.as_ptr(),
                max_blocks_per_seq: b.max_blocks,
                block_size: b.block_size,
                num_blocks: b.num_blocks,
                ..KvGroupTables::zeroed()
            })
            .collect();
        let n_seqs = self.batch.as_ref().map_or(0, |b| b.tables.len() / b.max_blocks as usize);
        let mut seq_n_tokens = vec![0u32; n_seqs];
        for &s in self.batch.iter().flat_map(|b| &b.token_seq) {
            seq_n_tokens[s as usize] += 1;
        }
        let batch = self.batch.as_ref().map(|b| StepBatch {
            n_tokens: b.token_seq.len() as u32,
            n_seqs: n_seqs as u32,
            token_seq: b.token_seq.as_ptr(),
            positions: b.positions.as_ptr(),
            groups: groups.as_ptr(),
            n_groups: 1,
            seq_n_tokens: seq_n_tokens.as_ptr(),
            ..StepBatch::zeroed()
        });
        let outputs = [HostTensor { ptr: result.as_mut_ptr() as *mut u8, len: result.len() * 4 }];
        let args = ComputeArgs {
            graph: self.g.as_ref(),
            inputs: inputs.as_ptr(),
            n_inputs: inputs.len(),
            weights: weights.as_ptr(),
            n_weights: weights.len(),
            kv: kv.as_ptr(),
            n_kv: kv.len(),
            batch: batch.as_ref().map_or(std::ptr::null(), |b| b as *const _),
            outputs: outputs.as_ptr(),
            n_outputs: 1,
            ..ComputeArgs::zeroed()
        };
        unsafe { self.ctx.compute(&args) }.unwrap_or_else(|e| panic!("compute failed: {e}"));
        result
    }
}

fn check(what: &str, got: &[f32], want: &[f64], terms: usize) {
    assert_eq!(got.len(), want.len(), "{what}: output size");
    let tol = 1e-4 * (terms.max(1) as f64).sqrt();
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        let err = (g as f64 - w).abs();
        assert!(
            err <= tol * (1.0 + w.abs()),
            "{what}: element {i}: got {g}, want {w} (err {err:.3e}, tol {:.3e})",
            tol * (1.0 + w.abs())
        );
    }
}

/// Whether the CPU backend rounds activations to int16 for 4/8-bit matmuls (its default).
fn int_activations() -> bool {
    std::env::var("MLXCEL_CPU_INT16").map_or(true, |v| v != "0")
}

/// The int16-activation path: each activation is rounded to the nearest multiple of its block's
/// `d = max|x| / 32767`, so the error of a dot product is at most `Σ |w_i| · d_i / 2` (plus f32 noise).
#[allow(clippy::too_many_arguments)]
fn check_int16(what: &str, got: &[f32], want: &[f64], x: &[f32], w: &[f64], t: usize, k: usize, n: usize) {
    for i in 0..t * n {
        let (ti, r) = (i / n, i % n);
        let xs = &x[ti * k..(ti + 1) * k];
        let bound: f64 = (0..k)
            .map(|j| {
                let blk = &xs[j / 32 * 32..j / 32 * 32 + 32];
                let d = blk.iter().fold(0f32, |m, v| m.max(v.abs())) as f64 / 32767.0;
                w[r * k + j].abs() * d / 2.0
            })
            .sum::<f64>()
            + 1e-4 * (k as f64).sqrt() * (1.0 + want[i].abs());
        let err = (got[i] as f64 - want[i]).abs();
        assert!(
            err <= bound,
            "{what}: element {i}: got {}, want {} (err {err:.3e} > int16 bound {bound:.3e})",
            got[i],
            want[i]
        );
    }
}

/// A quantized matmul's result against the f64 reference: the int16 bound on the CPU backend's
/// default path (every width rounds activations to int16 there), the f32 tolerance otherwise.
#[allow(clippy::too_many_arguments)]
fn check_qmatmul(what: &str, got: &[f32], x: &[f32], q: &QuantWeight, t: usize, k: usize, n: usize) {
    let want: Vec<f64> =
        (0..t * n).map(|i| (0..k).map(|j| x[(i / n) * k + j] as f64 * q.dequant[(i % n) * k + j]).sum()).collect();
    if int_activations() {
        check_int16(what, got, &want, x, &q.dequant, t, k, n);
    } else {
        check(what, got, &want, k);
    }
}

fn backends() -> Vec<BackendContext> {
    let cat = Catalog::load(&PluginSearch { dirs: vec![common::staged_dir()] });
    let usable: Vec<BackendContext> = cat
        .backends
        .iter()
        .filter(|b| b.describe().score > 0)
        .map(|b| b.create(2, 0).unwrap_or_else(|e| panic!("creating backend {}: {e}", b.name())))
        .collect();
    assert!(!usable.is_empty(), "no usable backend found");
    usable
}

fn each_backend(f: impl Fn(&mut BackendContext, &mut Rng)) {
    for mut ctx in backends() {
        let mut rng = Rng(0x9E3779B97F4A7C15);
        f(&mut ctx, &mut rng);
    }
}

const FLOAT_DTYPES: [DType; 3] = [DType::F32, DType::F16, DType::BF16];

#[test]
fn matmul_matches_reference() {
    each_backend(|ctx, rng| {
        for dtype in FLOAT_DTYPES {
            for &(t, k, n) in &[(1, 32, 7), (3, 96, 33), (5, 130, 17), (17, 64, 300), (40, 33, 5)] {
                let x = rng.vec(t * k, 1.0);
                let w = float_weight(rng, n * k, dtype, 0.5);
                let mut run = Run::new(ctx);
                let xi = run.input_f32(&x, &[t as u64, k as u64]);
                let wi = run.weight(&w.data, dtype, &[n as u64, k as u64]);
                let o = run.g.op(OpCode::MatMul, &[t as u64, n as u64], &[xi, wi]);
                let got = run.execute(o);
                let want: Vec<f64> = (0..t * n)
                    .map(|i| (0..k).map(|j| x[(i / n) * k + j] as f64 * w.values[(i % n) * k + j]).sum())
                    .collect();
                check(&format!("{} matmul {dtype:?} t{t} k{k} n{n}", ctx.name()), &got, &want, k);
            }
        }
    });
}

#[test]
fn quantized_matmul_matches_reference_for_every_bits_and_group() {
    each_backend(|ctx, rng| {
        for bits in [2usize, 3, 4, 5, 6, 8] {
            for group in [32usize, 64, 128] {
                // Shapes cover row tiles of 1–4 rows and several tiles, scale dtypes, groups that are and
                // are not a multiple of 8 per row, rows longer than a kernel's 64-block chunk, and
                // token counts that take the 8-, 4- and 1-token passes and the float-tile path.
                let shapes = [
                    (1, 256, 9, DType::F16),
                    (6, 128, 5, DType::BF16),
                    (2, 384, 3, DType::F32),
                    (13, 128, 7, DType::F16),
                    (1, 2304, 70, DType::BF16),
                    (3, 640, 37, DType::F32),
                    // A long prefill step: dequantized tiles through gemm on the CPU backend.
                    (70, 128, 9, DType::BF16),
                ];
                for &(t, k, n, sd) in &shapes {
                    let q = quant_weight(rng, n, k, bits, group, sd);
                    let x = rng.vec(t * k, 1.0);
                    let mut run = Run::new(ctx);
                    let xi = run.input_f32(&x, &[t as u64, k as u64]);
                    let o = run.quant_matmul(xi, &q, t, k, n, bits, group, sd);
                    let got = run.execute(o);
                    check_qmatmul(
                        &format!("{} qmatmul {bits}b g{group} t{t} k{k} n{n}", ctx.name()),
                        &got,
                        &x,
                        &q,
                        t,
                        k,
                        n,
                    );
                }
            }
        }
    });
}

/// A fused checkpoint tensor (`qkv_proj`, `gate_up_proj`) read as its parts: a Weight node with a row
/// view binds rows `first..first + rows` only, float and quantized (packed words, scales and biases),
/// and several views of one buffer in one graph each read their own rows.
#[test]
fn weight_row_views_read_their_rows() {
    each_backend(|ctx, rng| {
        let (t, k) = (5usize, 64usize);
        let parts = [(0usize, 7usize), (7, 3), (10, 6)];
        let n = 16;
        for dtype in FLOAT_DTYPES {
            let w = float_weight(rng, n * k, dtype, 0.5);
            let x = rng.vec(t * k, 1.0);
            for &(first, rows) in &parts {
                let mut run = Run::new(ctx);
                let xi = run.input_f32(&x, &[t as u64, k as u64]);
                let idx = run.weight_buffer(&w.data);
                // The other parts of the same buffer come first, so the view under test is not the only one.
                let mut out = 0;
                for &(f, r) in &parts {
                    let wi = run.g.weight_rows(idx, dtype, &[r as u64, k as u64], f as u64);
                    let o = run.g.op(OpCode::MatMul, &[t as u64, r as u64], &[xi, wi]);
                    if f == first {
                        out = o;
                    }
                }
                let got = run.execute(out);
                let want: Vec<f64> = (0..t * rows)
                    .map(|i| (0..k).map(|j| x[(i / rows) * k + j] as f64 * w.values[(first + i % rows) * k + j]).sum())
                    .collect();
                check(&format!("{} matmul over rows {first}+{rows} {dtype:?}", ctx.name()), &got, &want, k);
            }
        }
        let (bits, group, sd) = (4usize, 32usize, DType::F16);
        let q = quant_weight(rng, n, k, bits, group, sd);
        let x = rng.vec(t * k, 1.0);
        for &(first, rows) in &parts {
            let mut run = Run::new(ctx);
            let xi = run.input_f32(&x, &[t as u64, k as u64]);
            let (pi, si, bi) = (
                run.weight_buffer(&bytes(&q.packed)),
                run.weight_buffer(&q.scales.data),
                run.weight_buffer(&q.biases.data),
            );
            let mut out = 0;
            for &(f, r) in &parts {
                let (f64_, r64) = (f as u64, r as u64);
                let p = run.g.weight_rows(pi, DType::U32, &[r64, (k * bits / 32) as u64], f64_);
                let s = run.g.weight_rows(si, sd, &[r64, (k / group) as u64], f64_);
                let b = run.g.weight_rows(bi, sd, &[r64, (k / group) as u64], f64_);
                let o = run.g.op_with(
                    OpCode::QuantMatMul,
                    &[t as u64, r64],
                    &[xi, p, s, b],
                    &[bits as i64, group as i64],
                    &[],
                );
                if f == first {
                    out = o;
                }
            }
            let got = run.execute(out);
            let part = QuantWeight {
                packed: q.packed[first * k * bits / 32..(first + rows) * k * bits / 32].to_vec(),
                scales: FloatWeight { data: vec![], values: vec![] },
                biases: FloatWeight { data: vec![], values: vec![] },
                dequant: q.dequant[first * k..(first + rows) * k].to_vec(),
            };
            check_qmatmul(&format!("{} qmatmul over rows {first}+{rows}", ctx.name()), &got, &x, &part, t, k, rows);
        }
        // A view past the end of its tensor is refused.
        let w = float_weight(rng, n * k, DType::F32, 0.5);
        let mut run = Run::new(ctx);
        let xi = run.input_f32(&x, &[t as u64, k as u64]);
        let idx = run.weight_buffer(&w.data);
        let wi = run.g.weight_rows(idx, DType::F32, &[4, k as u64], (n - 2) as u64);
        let o = run.g.op(OpCode::MatMul, &[t as u64, 4], &[xi, wi]);
        let res = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| run.execute(o)));
        assert!(res.is_err(), "a row view past the end of its weight must be an error");
    });
}

/// Matmuls that read one input back to back (q/k/v, gate/up) may run together (the CPU backend
/// fuses them into one parallel loop): each result must still be its own. The same three-matmul
/// graph runs once per result it returns.
#[test]
fn matmuls_sharing_an_input_each_match_reference() {
    each_backend(|ctx, rng| {
        for bits in [3usize, 4, 8] {
            for &(t, k) in &[(1usize, 256usize), (5, 128)] {
                let ns = [40usize, 9, 70];
                let qs: Vec<QuantWeight> = ns.iter().map(|&n| quant_weight(rng, n, k, bits, 64, DType::F16)).collect();
                let x = rng.vec(t * k, 1.0);
                for (which, (q, &n)) in qs.iter().zip(&ns).enumerate() {
                    let mut run = Run::new(ctx);
                    let xi = run.input_f32(&x, &[t as u64, k as u64]);
                    let mut outs = Vec::new();
                    for (qj, &nj) in qs.iter().zip(&ns) {
                        outs.push(run.quant_matmul(xi, qj, t, k, nj, bits, 64, DType::F16));
                    }
                    let got = run.execute(outs[which]);
                    check_qmatmul(
                        &format!("{} shared-input qmatmul {bits}b t{t} k{k}, result {which} of 3", ctx.name()),
                        &got,
                        &x,
                        q,
                        t,
                        k,
                        n,
                    );
                }
            }
        }
    });
}

#[test]
fn embeddings_match_reference() {
    each_backend(|ctx, rng| {
        let ids = [3i32, 0, 7, 7, 1];
        for dtype in FLOAT_DTYPES {
            let (v, d) = (8usize, 24usize);
            let w = float_weight(rng, v * d, dtype, 1.0);
            let mut run = Run::new(ctx);
            let ii = run.input_i32(&ids);
            let wi = run.weight(&w.data, dtype, &[v as u64, d as u64]);
            let o = run.g.op(OpCode::Embedding, &[ids.len() as u64, d as u64], &[ii, wi]);
            let got = run.execute(o);
            let want: Vec<f64> =
                ids.iter().flat_map(|&i| w.values[i as usize * d..(i as usize + 1) * d].to_vec()).collect();
            check(&format!("{} embedding {dtype:?}", ctx.name()), &got, &want, 1);
        }
        for bits in [2usize, 3, 4, 5, 6, 8] {
            for group in [32usize, 64, 128] {
                let (v, d) = (8usize, 128usize);
                let q = quant_weight(rng, v, d, bits, group, DType::F16);
                let mut run = Run::new(ctx);
                let ii = run.input_i32(&ids);
                let pi = run.weight(&bytes(&q.packed), DType::U32, &[v as u64, (d * bits / 32) as u64]);
                let si = run.weight(&q.scales.data, DType::F16, &[v as u64, (d / group) as u64]);
                let bi = run.weight(&q.biases.data, DType::F16, &[v as u64, (d / group) as u64]);
                let o = run.g.op_with(
                    OpCode::QuantEmbedding,
                    &[ids.len() as u64, d as u64],
                    &[ii, pi, si, bi],
                    &[bits as i64, group as i64],
                    &[],
                );
                let got = run.execute(o);
                let want: Vec<f64> =
                    ids.iter().flat_map(|&i| q.dequant[i as usize * d..(i as usize + 1) * d].to_vec()).collect();
                check(&format!("{} quant embedding {bits}b g{group}", ctx.name()), &got, &want, 1);
            }
        }
    });
}

fn silu(x: f64) -> f64 {
    x / (1.0 + (-x).exp())
}
fn gelu_tanh(x: f64) -> f64 {
    0.5 * x * (1.0 + ((2.0 / std::f64::consts::PI).sqrt() * (x + 0.044715 * x.powi(3))).tanh())
}
fn erf(x: f64) -> f64 {
    // Abramowitz–Stegun 7.1.26 is too coarse for a reference; integrate instead (Simpson, fine grid).
    let n = 2000;
    let h = x / n as f64;
    let f = |t: f64| (-t * t).exp();
    let mut s = f(0.0) + f(x);
    for i in 1..n {
        s += f(i as f64 * h) * if i % 2 == 1 { 4.0 } else { 2.0 };
    }
    s * h / 3.0 * 2.0 / std::f64::consts::PI.sqrt()
}

#[test]
fn elementwise_ops_match_reference() {
    each_backend(|ctx, rng| {
        for &(r, c) in &[(1usize, 1usize), (3, 7), (5, 64), (2, 1000)] {
            let a = rng.vec(r * c, 4.0);
            let b = rng.vec(r * c, 2.0);
            let shape = [r as u64, c as u64];
            let unary: [(OpCode, f32, fn(f64, f64) -> f64); 6] = [
                (OpCode::Scale, 0.37, |x, p| x * p),
                (OpCode::Silu, 0.0, |x, _| silu(x)),
                (OpCode::Gelu, 0.0, |x, _| 0.5 * x * (1.0 + erf(x / 2f64.sqrt()))),
                (OpCode::GeluTanh, 0.0, |x, _| gelu_tanh(x)),
                (OpCode::Relu, 0.0, |x, _| x.max(0.0)),
                (OpCode::Softcap, 3.0, |x, p| p * (x / p).tanh()),
            ];
            for (op, p, f) in unary {
                let mut run = Run::new(ctx);
                let ai = run.input_f32(&a, &shape);
                let o = run.g.op_with(op, &shape, &[ai], &[], &[p]);
                let got = run.execute(o);
                let want: Vec<f64> = a.iter().map(|&x| f(x as f64, p as f64)).collect();
                check(&format!("{} {op:?} {r}x{c}", ctx.name()), &got, &want, 1);
            }
            let binary: [(OpCode, fn(f64, f64) -> f64); 4] = [
                (OpCode::Add, |x, y| x + y),
                (OpCode::Mul, |x, y| x * y),
                (OpCode::SiluMul, |x, y| silu(x) * y),
                (OpCode::GeluTanhMul, |x, y| gelu_tanh(x) * y),
            ];
            for (op, f) in binary {
                let mut run = Run::new(ctx);
                let ai = run.input_f32(&a, &shape);
                let bi = run.input_f32(&b, &shape);
                let o = run.g.op(op, &shape, &[ai, bi]);
                let got = run.execute(o);
                let want: Vec<f64> = a.iter().zip(&b).map(|(&x, &y)| f(x as f64, y as f64)).collect();
                check(&format!("{} {op:?} {r}x{c}", ctx.name()), &got, &want, 1);
            }
            // Row broadcast, with the row as a bf16 weight (a bias).
            for (op, f) in [(OpCode::Add, (|x, y| x + y) as fn(f64, f64) -> f64), (OpCode::Mul, |x, y| x * y)] {
                let w = float_weight(rng, c, DType::BF16, 1.0);
                let mut run = Run::new(ctx);
                let ai = run.input_f32(&a, &shape);
                let wi = run.weight(&w.data, DType::BF16, &[c as u64]);
                let o = run.g.op(op, &shape, &[ai, wi]);
                let got = run.execute(o);
                let want: Vec<f64> = a.iter().enumerate().map(|(i, &x)| f(x as f64, w.values[i % c])).collect();
                check(&format!("{} {op:?} broadcast {r}x{c}", ctx.name()), &got, &want, 1);
            }
        }
    });
}

#[test]
fn norms_match_reference() {
    each_backend(|ctx, rng| {
        for &(r, c, d) in &[(1usize, 64usize, 64usize), (3, 96, 32), (4, 33, 33), (2, 576, 576)] {
            let x = rng.vec(r * c, 3.0);
            for dtype in FLOAT_DTYPES {
                for unit in [0i64, 1] {
                    let w = float_weight(rng, d, dtype, 1.0);
                    let mut run = Run::new(ctx);
                    let xi = run.input_f32(&x, &[r as u64, c as u64]);
                    let wi = run.weight(&w.data, dtype, &[d as u64]);
                    let o = run.g.op_with(OpCode::RmsNorm, &[r as u64, c as u64], &[xi, wi], &[unit], &[1e-5]);
                    let got = run.execute(o);
                    let want: Vec<f64> = (0..r * c)
                        .map(|i| {
                            let g0 = i / d * d;
                            let ms = x[g0..g0 + d].iter().map(|&v| (v as f64).powi(2)).sum::<f64>() / d as f64;
                            x[i] as f64 / (ms + 1e-5).sqrt() * (w.values[i % d] + unit as f64)
                        })
                        .collect();
                    check(&format!("{} rms_norm {dtype:?} {r}x{c}/{d} unit={unit}", ctx.name()), &got, &want, d);
                }
            }
            let w = float_weight(rng, c, DType::F32, 1.0);
            let b = float_weight(rng, c, DType::F16, 1.0);
            let mut run = Run::new(ctx);
            let xi = run.input_f32(&x, &[r as u64, c as u64]);
            let wi = run.weight(&w.data, DType::F32, &[c as u64]);
            let bi = run.weight(&b.data, DType::F16, &[c as u64]);
            let o = run.g.op_with(OpCode::LayerNorm, &[r as u64, c as u64], &[xi, wi, bi], &[], &[1e-5]);
            let got = run.execute(o);
            let want: Vec<f64> = (0..r * c)
                .map(|i| {
                    let row = &x[i / c * c..(i / c + 1) * c];
                    let mean = row.iter().map(|&v| v as f64).sum::<f64>() / c as f64;
                    let var = row.iter().map(|&v| (v as f64 - mean).powi(2)).sum::<f64>() / c as f64;
                    (x[i] as f64 - mean) / (var + 1e-5).sqrt() * w.values[i % c] + b.values[i % c]
                })
                .collect();
            check(&format!("{} layer_norm {r}x{c}", ctx.name()), &got, &want, c);
        }
    });
}

#[test]
fn rope_matches_reference() {
    each_backend(|ctx, rng| {
        for &(t, h, hd, rot, trad, mscale) in &[
            (1usize, 1usize, 8usize, 8usize, 0i64, 1.0f32),
            (5, 3, 64, 64, 0, 1.0),
            (4, 2, 32, 16, 1, 1.0),
            (3, 4, 16, 12, 0, 1.2),
        ] {
            let x = rng.vec(t * h * hd, 1.0);
            let pos: Vec<i32> = (0..t as i32).map(|i| i * 37 + 3).collect();
            let inv: Vec<f32> = (0..rot / 2).map(|i| 10000f32.powf(-2.0 * i as f32 / rot as f32)).collect();
            let mut run = Run::new(ctx);
            let xi = run.input_f32(&x, &[t as u64, (h * hd) as u64]);
            let pi = run.input_i32(&pos);
            let fi = run.g.constant_f32(&inv, &[inv.len() as u64]);
            let o = run.g.op_with(
                OpCode::Rope,
                &[t as u64, (h * hd) as u64],
                &[xi, pi, fi],
                &[hd as i64, rot as i64, trad],
                &[mscale],
            );
            let got = run.execute(o);
            let mut want: Vec<f64> = x.iter().map(|&v| v as f64).collect();
            for ti in 0..t {
                for hh in 0..h {
                    let base = ti * h * hd + hh * hd;
                    for i in 0..rot / 2 {
                        let th = pos[ti] as f64 * inv[i] as f64;
                        let (c, s) = (th.cos() * mscale as f64, th.sin() * mscale as f64);
                        let (a, b) = if trad == 1 { (2 * i, 2 * i + 1) } else { (i, i + rot / 2) };
                        let (x1, x2) = (x[base + a] as f64, x[base + b] as f64);
                        want[base + a] = x1 * c - x2 * s;
                        want[base + b] = x2 * c + x1 * s;
                    }
                }
            }
            // Angles up to ~150 rad: f32 argument rounding (~1e-5) dominates, hence a few terms' slack.
            check(&format!("{} rope t{t} h{h} hd{hd} rot{rot} trad{trad}", ctx.name()), &got, &want, 16);
        }
    });
}

#[test]
fn get_rows_matches_reference() {
    each_backend(|ctx, rng| {
        let (r, c) = (6usize, 11usize);
        let x = rng.vec(r * c, 1.0);
        let rows = [5i32, 0, 2];
        let mut run = Run::new(ctx);
        let xi = run.input_f32(&x, &[r as u64, c as u64]);
        let ri = run.input_i32(&rows);
        let o = run.g.op(OpCode::GetRows, &[rows.len() as u64, c as u64], &[xi, ri]);
        let got = run.execute(o);
        let want: Vec<f64> = rows
            .iter()
            .flat_map(|&i| x[i as usize * c..(i as usize + 1) * c].iter().map(|&v| v as f64).collect::<Vec<_>>())
            .collect();
        check(&format!("{} get_rows", ctx.name()), &got, &want, 1);
    });
}

/// Reference attention for one token of one head over explicit key/value lists.
fn ref_attention(q: &[f64], keys: &[Vec<f64>], values: &[Vec<f64>], scale: f64, softcap: f64) -> Vec<f64> {
    let mut s: Vec<f64> = keys.iter().map(|k| q.iter().zip(k).map(|(a, b)| a * b).sum::<f64>() * scale).collect();
    if softcap > 0.0 {
        s.iter_mut().for_each(|v| *v = softcap * (*v / softcap).tanh());
    }
    let m = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
    let e: Vec<f64> = s.iter().map(|v| (v - m).exp()).collect();
    let z: f64 = e.iter().sum();
    let mut out = vec![0.0; q.len()];
    for (w, v) in e.iter().zip(values) {
        for (o, x) in out.iter_mut().zip(v) {
            *o += w / z * x;
        }
    }
    out
}

#[test]
fn paged_attention_matches_reference() {
    each_backend(|ctx, rng| {
        // (heads, kv heads, head_dim, window, softcap): MHA, GQA, MQA, sliding window, soft-capping.
        let heads = [
            (2usize, 2usize, 16usize, 0usize, 0.0f32),
            (4, 2, 32, 0, 0.0),
            (6, 1, 8, 0, 0.0),
            (4, 2, 16, 5, 0.0),
            (2, 1, 64, 0, 30.0),
        ];
        // Two sequences: A has cached tokens and adds some, B is a fresh prompt. Short runs take the
        // per-token kernel; long ones the tiled prefill kernel (tiles of 16 tokens, key blocks of 64).
        let steps = [(9usize, 3usize, 6usize), (9, 20, 70)];
        for (&(hq, hkv, dh, window, softcap), &(a_cached, a_new, b_new)) in
            heads.iter().flat_map(|h| steps.iter().map(move |s| (h, s)))
        {
            let bs = 4usize;
            // Blocks handed out in a scrambled order, as a pool that has been reused would.
            let a_len = (a_cached + a_new).div_ceil(bs);
            let b_len = b_new.div_ceil(bs);
            let num_blocks = a_len + b_len + 3;
            let mut ids: Vec<u32> = (0..num_blocks as u32).collect();
            ids.sort_by_key(|&i| (i * 7919) % num_blocks as u32);
            let a_blocks: Vec<u32> = ids[..a_len].to_vec();
            let b_blocks: Vec<u32> = ids[a_len..a_len + b_len].to_vec();
            let max_blocks = a_len.max(b_len);
            let slot = |blocks: &[u32], p: usize| blocks[p / bs] as usize * bs + p % bs;
            let kv_row = hkv * dh;
            let scale = 1.0 / (dh as f64).sqrt();

            // Cached keys/values of A, written into the cache buffers directly.
            let mut kcache = vec![0f32; num_blocks * bs * kv_row];
            let mut vcache = vec![0f32; num_blocks * bs * kv_row];
            let a_k_old = rng.vec(a_cached * kv_row, 1.0);
            let a_v_old = rng.vec(a_cached * kv_row, 1.0);
            for p in 0..a_cached {
                let s = slot(&a_blocks, p);
                kcache[s * kv_row..(s + 1) * kv_row].copy_from_slice(&a_k_old[p * kv_row..(p + 1) * kv_row]);
                vcache[s * kv_row..(s + 1) * kv_row].copy_from_slice(&a_v_old[p * kv_row..(p + 1) * kv_row]);
            }
            let t = a_new + b_new;
            let q = rng.vec(t * hq * dh, 1.0);
            let k = rng.vec(t * kv_row, 1.0);
            let v = rng.vec(t * kv_row, 1.0);
            let mut token_seq = vec![0u32; a_new];
            token_seq.extend(vec![1u32; b_new]);
            let positions: Vec<i32> = (a_cached..a_cached + a_new).chain(0..b_new).map(|p| p as i32).collect();
            let slots: Vec<i64> = (0..t)
                .map(|i| if i < a_new { slot(&a_blocks, a_cached + i) } else { slot(&b_blocks, i - a_new) } as i64)
                .collect();
            let mut tables = vec![0u32; 2 * max_blocks];
            tables[..a_blocks.len()].copy_from_slice(&a_blocks);
            tables[max_blocks..max_blocks + b_blocks.len()].copy_from_slice(&b_blocks);

            let mut kb = ctx.alloc(kcache.len() * 4).unwrap();
            let mut vb = ctx.alloc(vcache.len() * 4).unwrap();
            ctx.write(&mut kb, 0, &bytes(&kcache)).unwrap();
            ctx.write(&mut vb, 0, &bytes(&vcache)).unwrap();
            let mut run = Run::new(ctx);
            run.kv.push((kb, vb));
            run.batch = Some(BatchData {
                token_seq,
                positions: positions.clone(),
                slots,
                tables,
                max_blocks: max_blocks as u32,
                block_size: bs as u32,
                num_blocks: num_blocks as u32,
            });
            let qi = run.input_f32(&q, &[t as u64, (hq * dh) as u64]);
            let ki = run.input_f32(&k, &[t as u64, kv_row as u64]);
            let vi = run.input_f32(&v, &[t as u64, kv_row as u64]);
            let o = run.g.op_with(
                OpCode::Attention,
                &[t as u64, (hq * dh) as u64],
                &[qi, ki, vi],
                &[0, hq as i64, hkv as i64, dh as i64, window as i64],
                &[scale as f32, softcap],
            );
            let got = run.execute(o);

            // Reference: the full key/value history of each sequence in order.
            let row = |src: &[f32], i: usize, h: usize| -> Vec<f64> {
                src[i * kv_row + h * dh..i * kv_row + (h + 1) * dh].iter().map(|&x| x as f64).collect()
            };
            let mut want = vec![0f64; t * hq * dh];
            for ti in 0..t {
                for h in 0..hq {
                    let kvh = h / (hq / hkv);
                    let (mut keys, mut vals) = (vec![], vec![]);
                    let pos = positions[ti] as usize;
                    let start = if window > 0 { (pos + 1).saturating_sub(window) } else { 0 };
                    for p in start..=pos {
                        let (kk, vv) = if ti < a_new {
                            if p < a_cached {
                                (row(&a_k_old, p, kvh), row(&a_v_old, p, kvh))
                            } else {
                                (row(&k, p - a_cached, kvh), row(&v, p - a_cached, kvh))
                            }
                        } else {
                            (row(&k, a_new + p, kvh), row(&v, a_new + p, kvh))
                        };
                        keys.push(kk);
                        vals.push(vv);
                    }
                    let qv: Vec<f64> = q[ti * hq * dh + h * dh..][..dh].iter().map(|&x| x as f64).collect();
                    let out = ref_attention(&qv, &keys, &vals, scale, softcap as f64);
                    want[ti * hq * dh + h * dh..][..dh].copy_from_slice(&out);
                }
            }
            let what = format!(
                "{} attention hq{hq} hkv{hkv} dh{dh} window{window} softcap{softcap} A {a_cached}+{a_new} B {b_new}",
                ctx.name()
            );
            check(&what, &got, &want, dh);
        }
    });
}

#[test]
fn bad_graphs_are_refused_with_a_message_not_a_crash() {
    each_backend(|ctx, rng| {
        // MatMul whose weight does not fit x.
        let x = rng.vec(2 * 8, 1.0);
        let w = float_weight(rng, 3 * 5, DType::F32, 1.0);
        let mut run = Run::new(ctx);
        let xi = run.input_f32(&x, &[2, 8]);
        let wi = run.weight(&w.data, DType::F32, &[3, 5]);
        let o = run.g.op(OpCode::MatMul, &[2, 3], &[xi, wi]);
        run.g.mark_output(o);
        let inputs: Vec<HostTensor> =
            run.inputs.iter().map(|b| HostTensor { ptr: b.as_ptr() as *mut u8, len: b.len() }).collect();
        let weights: Vec<BufferHandle> = run.weights.iter().map(|b| b.handle()).collect();
        let mut out = vec![0f32; 6];
        let outputs = [HostTensor { ptr: out.as_mut_ptr() as *mut u8, len: 24 }];
        let args = ComputeArgs {
            graph: run.g.as_ref(),
            inputs: inputs.as_ptr(),
            n_inputs: inputs.len(),
            weights: weights.as_ptr(),
            n_weights: weights.len(),
            kv: std::ptr::null(),
            n_kv: 0,
            batch: std::ptr::null(),
            outputs: outputs.as_ptr(),
            n_outputs: 1,
            ..ComputeArgs::zeroed()
        };
        let err = unsafe { run.ctx.compute(&args) }.unwrap_err();
        assert!(err.message.contains("MatMul"), "message should name the op: {}", err.message);
        // Embedding with an out-of-range token id.
        let tbl = float_weight(rng, 4 * 3, DType::F32, 1.0);
        let mut run = Run::new(ctx);
        let ii = run.input_i32(&[9]);
        let wi = run.weight(&tbl.data, DType::F32, &[4, 3]);
        let o = run.g.op(OpCode::Embedding, &[1, 3], &[ii, wi]);
        let res = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| run.execute(o)));
        assert!(res.is_err(), "out-of-range token id must be an error");
    });
}
