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
    /// Per layer: K, V and state buffer handles (null where absent); the test keeps the buffers.
    kv: Vec<[BufferHandle; 3]>,
    /// What the K and V caches keep (f32 unless a test says otherwise).
    kv_types: (DType, DType),
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
    /// Each sequence's recurrent-state row.
    state_slots: Vec<u32>,
}

impl BatchData {
    /// A step with no paged KV: each token's sequence (sequences of `lens` tokens, in order) and each
    /// sequence's state row.
    fn sequences(lens: &[usize], state_slots: &[u32]) -> BatchData {
        let token_seq: Vec<u32> =
            lens.iter().enumerate().flat_map(|(s, &n)| std::iter::repeat_n(s as u32, n)).collect();
        BatchData {
            positions: vec![0; token_seq.len()],
            slots: vec![0; token_seq.len()],
            token_seq,
            tables: vec![],
            max_blocks: 0,
            block_size: 1,
            num_blocks: 0,
            state_slots: state_slots.to_vec(),
        }
    }

    fn n_seqs(&self) -> usize {
        if self.max_blocks == 0 {
            self.state_slots.len()
        } else {
            self.tables.len() / self.max_blocks as usize
        }
    }
}

impl<'a> Run<'a> {
    fn new(ctx: &'a mut BackendContext) -> Self {
        Run {
            ctx,
            g: Graph::new(),
            inputs: vec![],
            weights: vec![],
            kv: vec![],
            kv_types: (DType::F32, DType::F32),
            batch: None,
        }
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
    /// An `I32 [n]` input bound at a given slot (earlier unused slots stay empty).
    fn input_i32_at(&mut self, slot: usize, v: &[i32]) -> TensorId {
        if self.inputs.len() <= slot {
            self.inputs.resize(slot + 1, Vec::new());
        }
        self.inputs[slot] = bytes(v);
        self.g.input(slot as i64, DType::I32, &[v.len() as u64])
    }
    fn weight(&mut self, data: &[u8], dtype: DType, shape: &[u64]) -> TensorId {
        // Leak the host copy: it must outlive the zero-copy buffer, and tests are short.
        let data: &'static [u8] = Box::leak(data.to_vec().into_boxed_slice());
        let buf = unsafe { self.ctx.buffer_from_host(data) }.unwrap();
        let idx = self.weights.len() as u32;
        self.weights.push(buf);
        self.g.weight(idx, dtype, shape)
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
    fn execute(self, out: TensorId) -> Vec<f32> {
        self.try_execute(out).unwrap_or_else(|e| panic!("compute failed: {e}"))
    }
    fn try_execute(mut self, out: TensorId) -> Result<Vec<f32>, String> {
        self.g.mark_output(out);
        for n in &self.g.nodes {
            if !self.ctx.supports(n) {
                let what = format!("backend `{}` does not support {:?} ({:?})", self.ctx.name(), n.opcode(), n.dtype());
                // The CPU backend is the reference implementation: it runs every op.
                assert!(self.ctx.name() != "cpu", "{what}");
                std::panic::resume_unwind(Box::new(Unsupported(what)));
            }
        }
        let mut result = vec![0f32; self.g.node(out).numel()];
        let inputs: Vec<HostTensor> =
            self.inputs.iter().map(|b| HostTensor { ptr: b.as_ptr() as *mut u8, len: b.len() }).collect();
        let weights: Vec<BufferHandle> = self.weights.iter().map(|b| b.handle()).collect();
        let kv: Vec<KvBinding> = self
            .kv
            .iter()
            .map(|&[k, v, state]| KvBinding {
                k,
                v,
                state,
                dtype: self.kv_types.0 as u32,
                v_dtype: self.kv_types.1 as u32,
                ..KvBinding::zeroed()
            })
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
        let n_seqs = self.batch.as_ref().map_or(0, |b| b.n_seqs());
        let mut seq_n_tokens = vec![0u32; n_seqs];
        for &s in self.batch.iter().flat_map(|b| &b.token_seq) {
            seq_n_tokens[s as usize] += 1;
        }
        let batch = self.batch.as_ref().map(|b| StepBatch {
            n_tokens: b.token_seq.len() as u32,
            n_seqs: n_seqs as u32,
            token_seq: b.token_seq.as_ptr(),
            positions: b.positions.as_ptr(),
            seq_state_slots: b.state_slots.as_ptr(),
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
        unsafe { self.ctx.compute(&args) }.map_err(|e| e.to_string())?;
        Ok(result)
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

/// The CPU backend runs the kernel path under test: `MLXCEL_CPU_ISA` when set (`cargo xtask test`
/// runs this suite once per path the CPU has, and says which it skipped), else the best one.
#[test]
fn cpu_backend_runs_the_kernel_path_asked_for() {
    let cat = Catalog::load(&PluginSearch { dirs: vec![common::staged_dir()] });
    let cpu = cat.backends.iter().find(|b| b.name() == "cpu").expect("the cpu backend is staged");
    let path = cpu.describe().features;
    eprintln!("cpu backend kernel path under test: {path}");
    if let Some(want) = std::env::var("MLXCEL_CPU_ISA").ok().filter(|v| !v.trim().is_empty()) {
        assert_eq!(path, want.trim().to_ascii_lowercase());
    }
}

/// A backend other than the CPU reference lacks an op the test needs: the rest of that test is
/// skipped for it, and says so.
struct Unsupported(String);

fn each_backend(f: impl Fn(&mut BackendContext, &mut Rng)) {
    for mut ctx in backends() {
        let mut rng = Rng(0x9E3779B97F4A7C15);
        let run = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(&mut ctx, &mut rng)));
        if let Err(payload) = run {
            match payload.downcast::<Unsupported>() {
                Ok(why) => eprintln!("SKIPPED on {} from here on: {}", ctx.name(), why.0),
                Err(payload) => std::panic::resume_unwind(payload),
            }
        }
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

/// A backend may keep its own layout of a weight tensor (the CPU backend's panel order of 4-bit
/// weights, built by the first step that reads it, for whole tensors and row views that start at a
/// multiple of 16 rows) and read other views from the stored layout: a matrix gives the same bits
/// whichever way it is bound — whole, or as rows `skip..skip + n` of a larger tensor, for `skip` 3
/// (never such a layout) and 16.
#[test]
fn a_quantized_weight_gives_the_same_bits_whole_or_as_a_row_view() {
    each_backend(|ctx, rng| {
        for (k, n, group, sd) in
            [(256usize, 40usize, 32usize, DType::F16), (192, 19, 64, DType::BF16), (128, 33, 128, DType::F32)]
        {
            let q = quant_weight(rng, n, k, 4, group, sd);
            let (wpr, g) = (k * 4 / 32, k / group);
            for t in [1usize, 3, 8, 11, 70] {
                let x = rng.vec(t * k, 1.0);
                let mut run = Run::new(ctx);
                let xi = run.input_f32(&x, &[t as u64, k as u64]);
                let whole = run.quant_matmul(xi, &q, t, k, n, 4, group, sd);
                let want = run.execute(whole);
                for skip in [3usize, 16] {
                    // `skip` rows of another matrix, then this one's.
                    let junk = quant_weight(rng, skip, k, 4, group, sd);
                    let stored = (skip + n) as u64;
                    let packed = bytes(&[junk.packed.clone(), q.packed.clone()].concat());
                    let scales = [junk.scales.data.clone(), q.scales.data.clone()].concat();
                    let biases = [junk.biases.data.clone(), q.biases.data.clone()].concat();
                    let mut run = Run::new(ctx);
                    let xi = run.input_f32(&x, &[t as u64, k as u64]);
                    let mut view = |data: &[u8], dtype: DType, cols: usize| {
                        let whole = run.weight(data, dtype, &[stored, cols as u64]);
                        let idx = run.g.node(whole).iparams[0] as u32;
                        run.g.weight_rows(idx, dtype, stored, skip as u64, n as u64, cols as u64)
                    };
                    let pi = view(&packed, DType::U32, wpr);
                    let si = view(&scales, sd, g);
                    let bi = view(&biases, sd, g);
                    let o = run.g.op_with(
                        OpCode::QuantMatMul,
                        &[t as u64, n as u64],
                        &[xi, pi, si, bi],
                        &[4, group as i64],
                        &[],
                    );
                    let got = run.execute(o);
                    let same = got.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits());
                    assert!(same, "{} 4b g{group} {sd:?} t{t} k{k} n{n}: rows {skip}.. of a view differ", ctx.name());
                }
            }
        }
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

/// A reference for an elementwise op: (input, parameter or second input) → output, in f64.
type RefFn = fn(f64, f64) -> f64;

#[test]
fn elementwise_ops_match_reference() {
    each_backend(|ctx, rng| {
        for &(r, c) in &[(1usize, 1usize), (3, 7), (5, 64), (2, 1000)] {
            let a = rng.vec(r * c, 4.0);
            let b = rng.vec(r * c, 2.0);
            let shape = [r as u64, c as u64];
            let unary: [(OpCode, f32, RefFn); 7] = [
                (OpCode::Scale, 0.37, |x, p| x * p),
                (OpCode::Silu, 0.0, |x, _| silu(x)),
                (OpCode::Gelu, 0.0, |x, _| 0.5 * x * (1.0 + erf(x / 2f64.sqrt()))),
                (OpCode::GeluTanh, 0.0, |x, _| gelu_tanh(x)),
                (OpCode::Relu, 0.0, |x, _| x.max(0.0)),
                (OpCode::Softcap, 3.0, |x, p| p * (x / p).tanh()),
                (OpCode::Sigmoid, 0.0, |x, _| 1.0 / (1.0 + (-x).exp())),
            ];
            for (op, p, f) in unary {
                let mut run = Run::new(ctx);
                let ai = run.input_f32(&a, &shape);
                let o = run.g.op_with(op, &shape, &[ai], &[], &[p]);
                let got = run.execute(o);
                let want: Vec<f64> = a.iter().map(|&x| f(x as f64, p as f64)).collect();
                check(&format!("{} {op:?} {r}x{c}", ctx.name()), &got, &want, 1);
            }
            let binary: [(OpCode, RefFn); 4] = [
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
            for (ti, &p) in pos.iter().enumerate().take(t) {
                for hh in 0..h {
                    let base = ti * h * hd + hh * hd;
                    for (i, &f) in inv.iter().enumerate().take(rot / 2) {
                        let th = p as f64 * f as f64;
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

/// `x` as a KV cache of type `dtype` keeps it.
fn round_through(x: f32, dtype: DType) -> f32 {
    match dtype {
        DType::F16 => f16::from_f32(x).to_f32(),
        DType::BF16 => bf16::from_f32(x).to_f32(),
        _ => x,
    }
}

/// `v` as the bytes of a KV cache of type `dtype`.
fn cache_bytes(v: &[f32], dtype: DType) -> Vec<u8> {
    match dtype {
        DType::F16 => bytes(&v.iter().map(|&x| f16::from_f32(x)).collect::<Vec<_>>()),
        DType::BF16 => bytes(&v.iter().map(|&x| bf16::from_f32(x)).collect::<Vec<_>>()),
        _ => bytes(v),
    }
}

#[test]
fn paged_attention_matches_reference() {
    // Caches in f32, f16, bf16 and a mixed pair (K and V may differ, as llama.cpp's flags allow): the
    // reference sees every key and value rounded as the cache keeps it, so the bound stays f32's.
    let types =
        [(DType::F32, DType::F32), (DType::F16, DType::F16), (DType::BF16, DType::BF16), (DType::F16, DType::BF16)];
    for (kt, vt) in types {
        paged_attention_with_cache_types(kt, vt);
    }
}

/// K and V bound to one buffer would be two mutable views of it: the CPU backend refuses the step.
#[test]
fn attention_with_k_and_v_on_one_buffer_is_refused() {
    each_backend(|ctx, rng| {
        if ctx.name() != "cpu" {
            return;
        }
        let (hq, hkv, dh) = (2usize, 1usize, 8usize);
        let desc = KvCacheDesc {
            num_blocks: 2,
            block_size: 4,
            n_kv_heads: hkv as u32,
            head_dim: dh as u32,
            dtype: DType::F32 as u32,
            ..KvCacheDesc::zeroed()
        };
        let kb = ctx.kv_alloc(&desc).unwrap();
        let mut run = Run::new(ctx);
        run.kv.push([kb.handle(), kb.handle(), std::ptr::null_mut()]);
        run.batch = Some(BatchData {
            token_seq: vec![0],
            positions: vec![0],
            slots: vec![0],
            tables: vec![0, 1],
            max_blocks: 2,
            block_size: 4,
            num_blocks: 2,
            state_slots: vec![0],
        });
        let qi = run.input_f32(&rng.vec(hq * dh, 1.0), &[1, (hq * dh) as u64]);
        let ki = run.input_f32(&rng.vec(hkv * dh, 1.0), &[1, (hkv * dh) as u64]);
        let vi = run.input_f32(&rng.vec(hkv * dh, 1.0), &[1, (hkv * dh) as u64]);
        let o = run.g.op_with(
            OpCode::Attention,
            &[1, (hq * dh) as u64],
            &[qi, ki, vi],
            &[0, hq as i64, hkv as i64, dh as i64, 0],
            &[0.35, 0.0],
        );
        let err = run.try_execute(o).unwrap_err();
        assert!(err.contains("K and V are bound to the same buffer"), "{err}");
    });
}

fn paged_attention_with_cache_types(kt: DType, vt: DType) {
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
        // The last step decodes A over 1100 cached keys: the per-token kernel splits them (256 a
        // split) and merges the partial softmaxes.
        let steps = [(9usize, 3usize, 6usize), (9, 20, 70), (1100, 1, 2)];
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

            let desc = |dtype: DType| KvCacheDesc {
                num_blocks: num_blocks as u32,
                block_size: bs as u32,
                n_kv_heads: hkv as u32,
                head_dim: dh as u32,
                dtype: dtype as u32,
                ..KvCacheDesc::zeroed()
            };
            let mut kb = ctx.kv_alloc(&desc(kt)).unwrap();
            let mut vb = ctx.kv_alloc(&desc(vt)).unwrap();
            ctx.write(&mut kb, 0, &cache_bytes(&kcache, kt)).unwrap();
            ctx.write(&mut vb, 0, &cache_bytes(&vcache, vt)).unwrap();
            let mut run = Run::new(ctx);
            run.kv.push([kb.handle(), vb.handle(), std::ptr::null_mut()]);
            run.kv_types = (kt, vt);
            run.batch = Some(BatchData {
                token_seq,
                positions: positions.clone(),
                slots,
                tables,
                max_blocks: max_blocks as u32,
                block_size: bs as u32,
                num_blocks: num_blocks as u32,
                state_slots: vec![0, 0],
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
            let row = |src: &[f32], i: usize, h: usize, dtype: DType| -> Vec<f64> {
                src[i * kv_row + h * dh..i * kv_row + (h + 1) * dh]
                    .iter()
                    .map(|&x| round_through(x, dtype) as f64)
                    .collect()
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
                                (row(&a_k_old, p, kvh, kt), row(&a_v_old, p, kvh, vt))
                            } else {
                                (row(&k, p - a_cached, kvh, kt), row(&v, p - a_cached, kvh, vt))
                            }
                        } else {
                            (row(&k, a_new + p, kvh, kt), row(&v, a_new + p, kvh, vt))
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
                "{} attention K {} V {} hq{hq} hkv{hkv} dh{dh} window{window} softcap{softcap} A {a_cached}+{a_new} B {b_new}",
                ctx.name(),
                kt.name(),
                vt.name()
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
        // Expert ids that are not ids of the experts given (beyond them, or not integers).
        let panic_message = |r: std::thread::Result<Vec<f32>>| match r {
            Ok(_) => String::new(),
            // An op this backend lacks skips the rest of the test (see `each_backend`).
            Err(p) if p.is::<Unsupported>() => std::panic::resume_unwind(p),
            Err(p) => p.downcast_ref::<String>().cloned().unwrap_or_default(),
        };
        let q = quant_weight(rng, 2 * 4, 64, 4, 32, DType::F16);
        for bad_id in [2.0f32, 1.5, -1.0] {
            let x = rng.vec(64, 1.0);
            let mut run = Run::new(ctx);
            let xi = run.input_f32(&x, &[1, 64]);
            let ii = run.input_f32(&[0.0, bad_id], &[1, 2]);
            let pi = run.weight(&bytes(&q.packed), DType::U32, &[2, 4, 8]);
            let si = run.weight(&q.scales.data, DType::F16, &[2, 4, 2]);
            let bi = run.weight(&q.biases.data, DType::F16, &[2, 4, 2]);
            let o = run.g.op_with(OpCode::GatherQuantMatMul, &[1, 2, 4], &[xi, ii, pi, si, bi], &[4, 32], &[]);
            let msg = panic_message(std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| run.execute(o))));
            assert!(msg.contains("GatherQuantMatMul") && msg.contains("expert index"), "expert id {bad_id}: {msg:?}");
        }
        // A top-k wider than its rows.
        let x = rng.vec(6, 1.0);
        let mut run = Run::new(ctx);
        let xi = run.input_f32(&x, &[2, 3]);
        let o = run.g.op_with(OpCode::TopK, &[2, 4], &[xi], &[4, TOPK_INDICES, 1, 0], &[]);
        let msg = panic_message(std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| run.execute(o))));
        assert!(msg.contains("TopK"), "{msg:?}");
    });
}

/// Reference softmax in f64.
fn ref_softmax(row: &[f32]) -> Vec<f64> {
    let m = row.iter().fold(f64::NEG_INFINITY, |m, &v| m.max(v as f64));
    let e: Vec<f64> = row.iter().map(|&v| (v as f64 - m).exp()).collect();
    let z: f64 = e.iter().sum();
    e.iter().map(|v| v / z).collect()
}

/// Router top-k: the columns of the k largest values in descending order, and their values, raw or
/// as softmax probabilities over the whole row, optionally renormalised over the k chosen.
#[test]
fn top_k_matches_reference() {
    each_backend(|ctx, rng| {
        for &(t, c, k) in &[(1usize, 8usize, 2usize), (5, 60, 4), (3, 7, 7), (9, 128, 8), (2, 3, 1)] {
            let x = rng.vec(t * c, 3.0);
            for softmax in [0i64, 1] {
                for renorm in [0i64, 1] {
                    let run_topk = |ctx: &mut BackendContext, what: i64| {
                        let mut run = Run::new(ctx);
                        let xi = run.input_f32(&x, &[t as u64, c as u64]);
                        let o = run.g.op_with(
                            OpCode::TopK,
                            &[t as u64, k as u64],
                            &[xi],
                            &[k as i64, what, softmax, renorm],
                            &[],
                        );
                        run.execute(o)
                    };
                    let got_idx = run_topk(ctx, TOPK_INDICES);
                    let got_val = run_topk(ctx, TOPK_VALUES);
                    let mut want_idx = Vec::new();
                    let mut want_val = Vec::new();
                    for r in 0..t {
                        let row = &x[r * c..(r + 1) * c];
                        let v: Vec<f64> =
                            if softmax == 1 { ref_softmax(row) } else { row.iter().map(|&a| a as f64).collect() };
                        let mut order: Vec<usize> = (0..c).collect();
                        order.sort_by(|&a, &b| v[b].total_cmp(&v[a]).then(a.cmp(&b)));
                        let sum: f64 = order[..k].iter().map(|&i| v[i]).sum();
                        for &i in &order[..k] {
                            want_idx.push(i as f32);
                            want_val.push(if renorm == 1 { v[i] / sum } else { v[i] });
                        }
                    }
                    let what = format!("{} top-k t{t} c{c} k{k} softmax{softmax} renorm{renorm}", ctx.name());
                    assert_eq!(got_idx, want_idx, "{what}: indices");
                    check(&what, &got_val, &want_val, c);
                }
            }
        }
        // Equal values: the lower column first, in both outputs.
        let x = [1.0f32, 3.0, 3.0, 0.5, 3.0];
        let mut run = Run::new(ctx);
        let xi = run.input_f32(&x, &[1, 5]);
        let o = run.g.op_with(OpCode::TopK, &[1, 2], &[xi], &[2, TOPK_INDICES, 1, 1], &[]);
        assert_eq!(run.execute(o), vec![1.0, 2.0], "{}: ties go to the lower column", ctx.name());
    });
}

/// `k` distinct experts per token, as a router picks them.
fn route(rng: &mut Rng, t: usize, k: usize, experts: usize) -> Vec<f32> {
    let mut out = Vec::with_capacity(t * k);
    for _ in 0..t {
        let mut chosen: Vec<usize> = Vec::new();
        while chosen.len() < k {
            let e = (rng.next() % experts as u64) as usize;
            if !chosen.contains(&e) {
                chosen.push(e);
            }
        }
        out.extend(chosen.iter().map(|&e| e as f32));
    }
    out
}

/// The reference of an expert matmul: row `(t, j)` of `[T·k, N]` against the f64 weights of expert
/// `idx[t, j]` (`w(e)` its `[N, K]` values), zeros where `held` excludes the expert.
#[allow(clippy::too_many_arguments)]
fn ref_gather(
    x: &[f32],
    x_per_token: bool,
    idx: &[f32],
    k: usize,
    kdim: usize,
    n: usize,
    w: impl Fn(usize) -> Vec<f64>,
    held: std::ops::Range<usize>,
) -> Vec<f64> {
    let mut want = vec![0f64; idx.len() * n];
    for (row, &e) in idx.iter().enumerate() {
        let e = e as usize;
        if !held.contains(&e) {
            continue;
        }
        let xr = if x_per_token { row / k } else { row };
        let we = w(e);
        for c in 0..n {
            want[row * n + c] = (0..kdim).map(|i| x[xr * kdim + i] as f64 * we[c * kdim + i]).sum();
        }
    }
    want
}

#[test]
fn gathered_matmul_matches_reference() {
    each_backend(|ctx, rng| {
        for dtype in FLOAT_DTYPES {
            // (tokens, experts per token, experts, K, N): decode, short and long prefill (row dots and gemm).
            for &(t, k, ne, kdim, n) in
                &[(1usize, 2usize, 4usize, 32usize, 7usize), (3, 3, 8, 48, 20), (37, 2, 5, 40, 33)]
            {
                let idx = route(rng, t, k, ne);
                let stack = float_weight(rng, ne * n * kdim, dtype, 0.5);
                let w = |e: usize| stack.values[e * n * kdim..(e + 1) * n * kdim].to_vec();
                for x_per_token in [true, false] {
                    let xr = if x_per_token { t } else { t * k };
                    let x = rng.vec(xr * kdim, 1.0);
                    let shape = [t as u64, k as u64, n as u64];
                    // One stack of all experts.
                    let mut run = Run::new(ctx);
                    let xi = run.input_f32(&x, &[xr as u64, kdim as u64]);
                    let ii = run.input_f32(&idx, &[t as u64, k as u64]);
                    let wi = run.weight(&stack.data, dtype, &[ne as u64, n as u64, kdim as u64]);
                    let o = run.g.op_with(OpCode::GatherMatMul, &shape, &[xi, ii, wi], &[0, 0], &[]);
                    let got = run.execute(o);
                    let want = ref_gather(&x, x_per_token, &idx, k, kdim, n, w, 0..ne);
                    let what = format!(
                        "{} gather matmul {dtype:?} t{t} k{k} E{ne} K{kdim} N{n} x/token {x_per_token}",
                        ctx.name()
                    );
                    check(&what, &got, &want, kdim);
                    // Experts 1.. one tensor each (as Hugging Face stores them), at most MAX_SRC - 2 per
                    // node, the nodes added; expert 0 is in no node: its rows are zeros.
                    let mut run = Run::new(ctx);
                    let xi = run.input_f32(&x, &[xr as u64, kdim as u64]);
                    let ii = run.input_f32(&idx, &[t as u64, k as u64]);
                    let esz = n * kdim * dtype.size();
                    let mut sum = None;
                    for first in (1..ne).step_by(MAX_SRC - 2) {
                        let mut srcs = vec![xi, ii];
                        for e in first..(first + MAX_SRC - 2).min(ne) {
                            let data = &stack.data[e * esz..(e + 1) * esz];
                            srcs.push(run.weight(data, dtype, &[n as u64, kdim as u64]));
                        }
                        let part = run.g.op_with(OpCode::GatherMatMul, &shape, &srcs, &[first as i64, ne as i64], &[]);
                        sum = Some(match sum {
                            None => part,
                            Some(s) => run.g.op(OpCode::Add, &shape, &[s, part]),
                        });
                    }
                    let got = run.execute(sum.unwrap());
                    let want = ref_gather(&x, x_per_token, &idx, k, kdim, n, w, 1..ne);
                    check(&format!("{what}, experts 1.. as single tensors"), &got, &want, kdim);
                }
            }
        }
    });
}

#[test]
fn gathered_quantized_matmul_matches_reference() {
    each_backend(|ctx, rng| {
        for bits in [2usize, 3, 4, 5, 6, 8] {
            for group in [32usize, 64, 128] {
                // Decode, the 4-bit multi-token passes, a long step whose experts each get fewer than 64 rows
                // (int16 or row dots), and one whose experts get 64 or more (float tiles through gemm).
                let shapes = [
                    (1usize, 2usize, 4usize, 128usize, 9usize, DType::F16),
                    (9, 3, 6, 256, 40, DType::BF16),
                    (70, 2, 3, 128, 17, DType::F32),
                    // Each of 2 experts gets all 70 rows: dequantized tiles through gemm.
                    (70, 2, 2, 128, 9, DType::F16),
                ];
                for &(t, k, ne, kdim, n, sd) in &shapes {
                    // The stack [E, N, K] is laid out as an [E·N, K] matrix.
                    let q = quant_weight(rng, ne * n, kdim, bits, group, sd);
                    let idx = route(rng, t, k, ne);
                    for x_per_token in [true, false] {
                        let xr = if x_per_token { t } else { t * k };
                        let x = rng.vec(xr * kdim, 1.0);
                        let mut run = Run::new(ctx);
                        let xi = run.input_f32(&x, &[xr as u64, kdim as u64]);
                        let ii = run.input_f32(&idx, &[t as u64, k as u64]);
                        let (e64, n64) = (ne as u64, n as u64);
                        let pi = run.weight(&bytes(&q.packed), DType::U32, &[e64, n64, (kdim * bits / 32) as u64]);
                        let si = run.weight(&q.scales.data, sd, &[e64, n64, (kdim / group) as u64]);
                        let bi = run.weight(&q.biases.data, sd, &[e64, n64, (kdim / group) as u64]);
                        let o = run.g.op_with(
                            OpCode::GatherQuantMatMul,
                            &[t as u64, k as u64, n64],
                            &[xi, ii, pi, si, bi],
                            &[bits as i64, group as i64],
                            &[],
                        );
                        let got = run.execute(o);
                        let w = |e: usize| q.dequant[e * n * kdim..(e + 1) * n * kdim].to_vec();
                        let want = ref_gather(&x, x_per_token, &idx, k, kdim, n, w, 0..ne);
                        let what = format!(
                            "{} gather qmatmul {bits}b g{group} t{t} k{k} E{ne} K{kdim} N{n} x/token {x_per_token}",
                            ctx.name()
                        );
                        if int_activations() {
                            // Row (t, j) against expert e's rows: the int16 bound of that product.
                            for row in 0..t * k {
                                let e = idx[row] as usize;
                                let xrow = if x_per_token { row / k } else { row };
                                let wq = &q.dequant[e * n * kdim..(e + 1) * n * kdim];
                                check_int16(
                                    &format!("{what}, row {row}"),
                                    &got[row * n..(row + 1) * n],
                                    &want[row * n..(row + 1) * n],
                                    &x[xrow * kdim..(xrow + 1) * kdim],
                                    wq,
                                    1,
                                    kdim,
                                    n,
                                );
                            }
                        } else {
                            check(&what, &got, &want, kdim);
                        }
                    }
                }
            }
        }
    });
}

#[test]
fn weighted_sum_matches_reference() {
    each_backend(|ctx, rng| {
        for &(t, k, n) in &[(1usize, 1usize, 5usize), (4, 2, 33), (7, 8, 64)] {
            let y = rng.vec(t * k * n, 2.0);
            let w = rng.vec(t * k, 1.0);
            let mut run = Run::new(ctx);
            let yi = run.input_f32(&y, &[t as u64, k as u64, n as u64]);
            let wi = run.input_f32(&w, &[t as u64, k as u64]);
            let o = run.g.op(OpCode::WeightedSum, &[t as u64, n as u64], &[yi, wi]);
            let got = run.execute(o);
            let want: Vec<f64> = (0..t * n)
                .map(|i| {
                    let (tt, c) = (i / n, i % n);
                    (0..k).map(|j| w[tt * k + j] as f64 * y[(tt * k + j) * n + c] as f64).sum()
                })
                .collect();
            check(&format!("{} weighted sum t{t} k{k} n{n}", ctx.name()), &got, &want, k);
        }
    });
}

/// Batch invariance of expert matmuls: a sequence's rows are bit for bit the same computed alone and
/// in a step where another sequence's tokens are routed to the same experts (so each expert's group
/// of rows is larger), for every kernel path (int16 decode and short prefill, row dots, gemm tiles).
#[test]
fn an_expert_row_is_the_same_alone_and_with_other_tokens_routed_to_its_expert() {
    each_backend(|ctx, rng| {
        let (ne, k, kdim, n) = (4usize, 2usize, 256usize, 48usize);
        let q4 = quant_weight(rng, ne * n, kdim, 4, 64, DType::F16);
        let q3 = quant_weight(rng, ne * n, kdim, 3, 32, DType::BF16);
        let fw = float_weight(rng, ne * n * kdim, DType::BF16, 0.5);
        // (A's tokens, B's tokens): both decoding, short prefills (4-bit passes of 8 and 4 tokens),
        // long prefills (float tiles), and mixed.
        for &(la, lb) in &[(1usize, 1usize), (5, 7), (1, 12), (6, 70), (70, 70), (3, 40)] {
            let xa = rng.vec(la * kdim, 1.0);
            let xb = rng.vec(lb * kdim, 1.0);
            // Every token of both sequences uses experts 1 and 2 (in either order).
            let idx_of = |l: usize, flip: bool| -> Vec<f32> {
                (0..l).flat_map(|i| if (i % 2 == 0) ^ flip { [1.0f32, 2.0] } else { [2.0, 1.0] }).collect()
            };
            let (ia, ib) = (idx_of(la, false), idx_of(lb, true));
            for which in ["q4", "q3", "float"] {
                let run_step = |ctx: &mut BackendContext, lens: &[usize], x: &[f32], idx: &[f32]| -> Vec<f32> {
                    let t = idx.len() / k;
                    let mut run = Run::new(ctx);
                    run.batch = Some(BatchData::sequences(lens, &vec![0; lens.len()]));
                    let xi = run.input_f32(x, &[t as u64, kdim as u64]);
                    let ii = run.input_f32(idx, &[t as u64, k as u64]);
                    let shape = [t as u64, k as u64, n as u64];
                    let o = match which {
                        "float" => {
                            let wi = run.weight(&fw.data, DType::BF16, &[ne as u64, n as u64, kdim as u64]);
                            run.g.op_with(OpCode::GatherMatMul, &shape, &[xi, ii, wi], &[0, 0], &[])
                        }
                        _ => {
                            let (q, bits, group) = if which == "q4" { (&q4, 4, 64) } else { (&q3, 3, 32) };
                            let sd = if which == "q4" { DType::F16 } else { DType::BF16 };
                            let (e64, n64) = (ne as u64, n as u64);
                            let pi = run.weight(&bytes(&q.packed), DType::U32, &[e64, n64, (kdim * bits / 32) as u64]);
                            let si = run.weight(&q.scales.data, sd, &[e64, n64, (kdim / group) as u64]);
                            let bi = run.weight(&q.biases.data, sd, &[e64, n64, (kdim / group) as u64]);
                            run.g.op_with(
                                OpCode::GatherQuantMatMul,
                                &shape,
                                &[xi, ii, pi, si, bi],
                                &[bits as i64, group as i64],
                                &[],
                            )
                        }
                    };
                    run.execute(o)
                };
                let alone = run_step(ctx, &[la], &xa, &ia);
                let x_ab: Vec<f32> = xa.iter().chain(&xb).copied().collect();
                let i_ab: Vec<f32> = ia.iter().chain(&ib).copied().collect();
                let ab = run_step(ctx, &[la, lb], &x_ab, &i_ab);
                let x_ba: Vec<f32> = xb.iter().chain(&xa).copied().collect();
                let i_ba: Vec<f32> = ib.iter().chain(&ia).copied().collect();
                let ba = run_step(ctx, &[lb, la], &x_ba, &i_ba);
                let rows = la * k * n;
                let what = format!("{} {which} experts: A of {la} tokens beside B of {lb}", ctx.name());
                assert!(alone == ab[..rows], "{what}: A first in the step differs from A alone");
                assert!(alone == ba[lb * k * n..], "{what}: A second in the step differs from A alone");
            }
        }
    });
}

/// Batch invariance of dense matmuls: a sequence's rows are bit for bit the same alone and beside
/// another sequence that takes the same kernel path (both short prefills, where 4-bit rows are
/// dotted several tokens at a time, or both long ones through gemm tiles).
#[test]
fn a_matmul_row_is_the_same_alone_and_beside_a_sequence_on_the_same_path() {
    each_backend(|ctx, rng| {
        let (kdim, n) = (256usize, 48usize);
        let q4 = quant_weight(rng, n, kdim, 4, 64, DType::F16);
        let fw = float_weight(rng, n * kdim, DType::BF16, 0.5);
        for &(la, lb) in &[(5usize, 7usize), (4, 4), (70, 70), (6, 70), (20, 30)] {
            let xa = rng.vec(la * kdim, 1.0);
            let xb = rng.vec(lb * kdim, 1.0);
            for which in ["q4", "float"] {
                let run_step = |ctx: &mut BackendContext, lens: &[usize], x: &[f32]| -> Vec<f32> {
                    let t = x.len() / kdim;
                    let mut run = Run::new(ctx);
                    run.batch = Some(BatchData::sequences(lens, &vec![0; lens.len()]));
                    let xi = run.input_f32(x, &[t as u64, kdim as u64]);
                    let o = if which == "float" {
                        let wi = run.weight(&fw.data, DType::BF16, &[n as u64, kdim as u64]);
                        run.g.op(OpCode::MatMul, &[t as u64, n as u64], &[xi, wi])
                    } else {
                        run.quant_matmul(xi, &q4, t, kdim, n, 4, 64, DType::F16)
                    };
                    run.execute(o)
                };
                let alone = run_step(ctx, &[la], &xa);
                let ab: Vec<f32> = xa.iter().chain(&xb).copied().collect();
                let ba: Vec<f32> = xb.iter().chain(&xa).copied().collect();
                let what = format!("{} {which} matmul: A of {la} tokens beside B of {lb}", ctx.name());
                assert!(alone == run_step(ctx, &[la, lb], &ab)[..la * n], "{what}: A first differs from A alone");
                assert!(alone == run_step(ctx, &[lb, la], &ba)[lb * n..], "{what}: A second differs from A alone");
            }
        }
    });
}

#[test]
fn slice_softmax_and_l2_normalize_match_reference() {
    each_backend(|ctx, rng| {
        for &(r, c) in &[(1usize, 1usize), (3, 7), (5, 64), (2, 1000)] {
            let x = rng.vec(r * c, 4.0);
            let shape = [r as u64, c as u64];
            let row = |i: usize| &x[i * c..(i + 1) * c];
            // Column ranges: the whole row, a prefix, an interior range, a suffix (the parts of a fused
            // projection).
            for (c0, c1) in [(0, c), (0, c.div_ceil(3)), (c / 3, c - c / 3), (c / 2, c)] {
                if c0 >= c1 {
                    continue;
                }
                let mut run = Run::new(ctx);
                let xi = run.input_f32(&x, &shape);
                let o =
                    run.g.op_with(OpCode::Slice, &[r as u64, (c1 - c0) as u64], &[xi], &[c0 as i64, c1 as i64], &[]);
                let got = run.execute(o);
                let want: Vec<f64> = (0..r).flat_map(|i| row(i)[c0..c1].iter().map(|&v| v as f64)).collect();
                check(&format!("{} slice {r}x{c} [{c0}..{c1}]", ctx.name()), &got, &want, 1);
            }
            // Softmax over the whole row and over groups of columns (any width dividing the row).
            for d in [0usize, 1, 7, 32] {
                if d > 0 && c % d != 0 {
                    continue;
                }
                let w = if d == 0 { c } else { d };
                let mut run = Run::new(ctx);
                let xi = run.input_f32(&x, &shape);
                let o = run.g.op_with(OpCode::Softmax, &shape, &[xi], &[d as i64], &[]);
                let got = run.execute(o);
                let want: Vec<f64> = x
                    .chunks(w)
                    .flat_map(|g| {
                        let m = g.iter().fold(f64::NEG_INFINITY, |m, &v| m.max(v as f64));
                        let z: f64 = g.iter().map(|&v| (v as f64 - m).exp()).sum();
                        g.iter().map(move |&v| (v as f64 - m).exp() / z)
                    })
                    .collect();
                check(&format!("{} softmax {r}x{c} groups of {w}", ctx.name()), &got, &want, w);
            }
            let mut run = Run::new(ctx);
            let xi = run.input_f32(&x, &shape);
            let o = run.g.op_with(OpCode::L2Normalize, &shape, &[xi], &[], &[0.0]);
            let got = run.execute(o);
            let want: Vec<f64> = (0..r)
                .flat_map(|i| {
                    let n = row(i).iter().map(|&v| (v as f64).powi(2)).sum::<f64>().sqrt().max(1e-12);
                    row(i).iter().map(move |&v| v as f64 / n)
                })
                .collect();
            check(&format!("{} l2_normalize {r}x{c}", ctx.name()), &got, &want, c);
        }
        // A zero row stays zero (eps, not a division by zero).
        let mut run = Run::new(ctx);
        let xi = run.input_f32(&[0.0; 6], &[2, 3]);
        let o = run.g.op_with(OpCode::L2Normalize, &[2, 3], &[xi], &[], &[0.0]);
        assert_eq!(run.execute(o), vec![0.0; 6], "{}: l2 of a zero row", ctx.name());
    });
}

/// BERT's embeddings: word embedding of the tokens plus an embedding of the token types, which arrive
/// in their own input slot ([`INPUT_TOKEN_TYPES`]), bound by slot like every input.
#[test]
fn token_types_bind_from_their_input_slot() {
    each_backend(|ctx, rng| {
        let (v, types, d) = (11usize, 2usize, 24usize);
        let ids = [3i32, 0, 7, 10, 1];
        let tt = [0i32, 0, 1, 1, 1];
        let words = float_weight(rng, v * d, DType::F32, 1.0);
        let ttab = float_weight(rng, types * d, DType::BF16, 1.0);
        let mut run = Run::new(ctx);
        let ii = run.input_i32_at(INPUT_TOKENS as usize, &ids);
        let ti = run.input_i32_at(INPUT_TOKEN_TYPES as usize, &tt);
        let wi = run.weight(&words.data, DType::F32, &[v as u64, d as u64]);
        let wt = run.weight(&ttab.data, DType::BF16, &[types as u64, d as u64]);
        let shape = [ids.len() as u64, d as u64];
        let a = run.g.op(OpCode::Embedding, &shape, &[ii, wi]);
        let b = run.g.op(OpCode::Embedding, &shape, &[ti, wt]);
        let o = run.g.op(OpCode::Add, &shape, &[a, b]);
        let got = run.execute(o);
        let want: Vec<f64> = (0..ids.len() * d)
            .map(|i| {
                let (t, j) = (i / d, i % d);
                words.values[ids[t] as usize * d + j] + ttab.values[tt[t] as usize * d + j]
            })
            .collect();
        check(&format!("{} token-type embeddings", ctx.name()), &got, &want, 2);
    });
}

/// Each sequence's row index per token for sequences of `lens` rows.
fn seq_ids(lens: &[usize]) -> Vec<i32> {
    lens.iter().enumerate().flat_map(|(s, &n)| std::iter::repeat_n(s as i32, n)).collect()
}

fn rows_f64(x: &[f32], r0: usize, r1: usize, width: usize, col: usize, n: usize) -> Vec<Vec<f64>> {
    (r0..r1).map(|r| x[r * width + col..r * width + col + n].iter().map(|&v| v as f64).collect()).collect()
}

#[test]
fn step_attention_matches_reference_per_sequence() {
    each_backend(|ctx, rng| {
        // (heads, kv heads, head_dim, causal, window, softcap): bidirectional (BERT), GQA, MQA, causal,
        // both kinds of window, soft-capping.
        let cases = [
            (2usize, 2usize, 16usize, false, 0usize, 0.0f32),
            (4, 2, 32, false, 0, 0.0),
            (6, 1, 8, true, 0, 0.0),
            (4, 2, 16, true, 5, 0.0),
            (2, 1, 24, false, 3, 0.0),
            (2, 2, 64, true, 0, 30.0),
        ];
        // Several sequences of different lengths in one step: one token, lengths that are not multiples of
        // the 16-token tiles or 64-key blocks, and one longer than a key block.
        for lens in [vec![9usize], vec![1, 17, 70, 5]] {
            for &(hq, hkv, dh, causal, window, softcap) in &cases {
                let t: usize = lens.iter().sum();
                let kv_row = hkv * dh;
                let q = rng.vec(t * hq * dh, 1.0);
                let k = rng.vec(t * kv_row, 1.0);
                let v = rng.vec(t * kv_row, 1.0);
                let scale = 1.0 / (dh as f64).sqrt();
                let mut run = Run::new(ctx);
                let qi = run.input_f32(&q, &[t as u64, (hq * dh) as u64]);
                let ki = run.input_f32(&k, &[t as u64, kv_row as u64]);
                let vi = run.input_f32(&v, &[t as u64, kv_row as u64]);
                let si = run.input_i32(&seq_ids(&lens));
                let o = run.g.op_with(
                    OpCode::StepAttention,
                    &[t as u64, (hq * dh) as u64],
                    &[qi, ki, vi, si],
                    &[hq as i64, hkv as i64, dh as i64, causal as i64, window as i64],
                    &[scale as f32, softcap],
                );
                let got = run.execute(o);
                let mut want = vec![0f64; t * hq * dh];
                let mut start = 0;
                for &len in &lens {
                    for i in 0..len {
                        let (lo, hi) = match (causal, window) {
                            (true, 0) => (0, i + 1),
                            (true, w) => ((i + 1).saturating_sub(w), i + 1),
                            (false, 0) => (0, len),
                            (false, w) => (i.saturating_sub(w), (i + w + 1).min(len)),
                        };
                        for h in 0..hq {
                            let kvh = h / (hq / hkv);
                            let keys = rows_f64(&k, start + lo, start + hi, kv_row, kvh * dh, dh);
                            let vals = rows_f64(&v, start + lo, start + hi, kv_row, kvh * dh, dh);
                            let qv = &rows_f64(&q, start + i, start + i + 1, hq * dh, h * dh, dh)[0];
                            let out = ref_attention(qv, &keys, &vals, scale, softcap as f64);
                            want[(start + i) * hq * dh + h * dh..][..dh].copy_from_slice(&out);
                        }
                    }
                    start += len;
                }
                let what = format!(
                    "{} step attention hq{hq} hkv{hkv} dh{dh} causal {causal} window {window} softcap {softcap} lens {lens:?}",
                    ctx.name()
                );
                check(&what, &got, &want, dh);
                // Batch invariance: each sequence alone gives its rows of the batched result bit for bit.
                let mut start = 0;
                for &len in lens.iter().filter(|_| lens.len() > 1) {
                    let rows = |x: &[f32], w: usize| x[start * w..(start + len) * w].to_vec();
                    let mut run = Run::new(ctx);
                    let qi = run.input_f32(&rows(&q, hq * dh), &[len as u64, (hq * dh) as u64]);
                    let ki = run.input_f32(&rows(&k, kv_row), &[len as u64, kv_row as u64]);
                    let vi = run.input_f32(&rows(&v, kv_row), &[len as u64, kv_row as u64]);
                    let si = run.input_i32(&vec![0; len]);
                    let o = run.g.op_with(
                        OpCode::StepAttention,
                        &[len as u64, (hq * dh) as u64],
                        &[qi, ki, vi, si],
                        &[hq as i64, hkv as i64, dh as i64, causal as i64, window as i64],
                        &[scale as f32, softcap],
                    );
                    assert_eq!(run.execute(o), rows(&got, hq * dh), "{what}: a sequence of {len} alone");
                    start += len;
                }
            }
        }
    });
}

/// A state buffer of `rows` rows of `row_elems` f32, zeroed (as the host clears a new sequence's row).
fn state_buffer(ctx: &mut BackendContext, rows: usize, row_elems: usize) -> DeviceBuffer {
    let mut b = ctx.alloc(rows * row_elems * 4).unwrap();
    ctx.write(&mut b, 0, &vec![0u8; rows * row_elems * 4]).unwrap();
    b
}

#[test]
fn cross_attention_attends_to_each_sequences_stored_encoder_rows() {
    each_backend(|ctx, rng| {
        for &(hq, hkv, dh) in &[(2usize, 2usize, 16usize), (6, 2, 8), (4, 1, 64)] {
            let kv_row = hkv * dh;
            let max_len = 80usize;
            let row_elems = cross_kv_state_elems(max_len as u64, hkv as u64, dh as u64) as usize;
            // Three state rows; the encoder step holds sequences 0 and 1 (70 and 3 rows, stored in rows 2
            // and 0); row 1 is a sequence with nothing stored.
            let state = state_buffer(ctx, 3, row_elems);
            let enc_lens = [70usize, 3];
            let slots = [2u32, 0];
            let s_total: usize = enc_lens.iter().sum();
            let k = rng.vec(s_total * kv_row, 1.0);
            let v = rng.vec(s_total * kv_row, 1.0);
            let scale = 1.0 / (dh as f64).sqrt();
            let ip = |layer: i64| [layer, hq as i64, hkv as i64, dh as i64, max_len as i64];

            // Step 1: store the encoder rows, and in the same graph attend from one query per sequence.
            let q1 = rng.vec(2 * hq * dh, 1.0);
            let mut run = Run::new(ctx);
            run.kv.push([std::ptr::null_mut(), std::ptr::null_mut(), state.handle()]);
            run.batch = Some(BatchData::sequences(&enc_lens, &slots));
            let ki = run.input_f32(&k, &[s_total as u64, kv_row as u64]);
            let vi = run.input_f32(&v, &[s_total as u64, kv_row as u64]);
            let si = run.input_i32(&seq_ids(&enc_lens));
            let stored = run.g.op_with(
                OpCode::StoreCrossKv,
                &[1],
                &[ki, vi, si],
                &[0, hkv as i64, dh as i64, max_len as i64],
                &[],
            );
            // The queries are separate rows: one per sequence.
            let qi = run.input_f32(&q1, &[2, (hq * dh) as u64]);
            let qs = run.input_i32(&[0, 1]);
            let o = run.g.op_with(
                OpCode::CrossAttention,
                &[2, (hq * dh) as u64],
                &[qi, qs, stored],
                &ip(0),
                &[scale as f32],
            );
            let got1 = run.execute(o);

            // Step 2 (a later decoder step): sequence 0 (row 2) prefills 19 tokens, the sequence of row 1
            // (nothing stored) 1 token, sequence 1 (row 0) 2 tokens.
            let dec_lens = [19usize, 1, 2];
            let t: usize = dec_lens.iter().sum();
            let q2 = rng.vec(t * hq * dh, 1.0);
            let mut run = Run::new(ctx);
            run.kv.push([std::ptr::null_mut(), std::ptr::null_mut(), state.handle()]);
            run.batch = Some(BatchData::sequences(&dec_lens, &[2, 1, 0]));
            let qi = run.input_f32(&q2, &[t as u64, (hq * dh) as u64]);
            let si = run.input_i32(&seq_ids(&dec_lens));
            let o = run.g.op_with(
                OpCode::CrossAttention,
                &[t as u64, (hq * dh) as u64],
                &[qi, si],
                &ip(0),
                &[scale as f32],
            );
            let got2 = run.execute(o);

            // Reference: encoder rows of each sequence, all visible.
            let enc_start = [0usize, enc_lens[0]];
            let attend = |q: &[f32], row: usize, enc: Option<usize>| -> Vec<f64> {
                let mut out = vec![0f64; hq * dh];
                let Some(e) = enc else { return out };
                for h in 0..hq {
                    let kvh = h / (hq / hkv);
                    let (a, b) = (enc_start[e], enc_start[e] + enc_lens[e]);
                    let keys = rows_f64(&k, a, b, kv_row, kvh * dh, dh);
                    let vals = rows_f64(&v, a, b, kv_row, kvh * dh, dh);
                    let qv = &rows_f64(q, row, row + 1, hq * dh, h * dh, dh)[0];
                    out[h * dh..(h + 1) * dh].copy_from_slice(&ref_attention(qv, &keys, &vals, scale, 0.0));
                }
                out
            };
            let want1: Vec<f64> = (0..2).flat_map(|r| attend(&q1, r, Some(r))).collect();
            check(
                &format!("{} cross attention hq{hq} hkv{hkv} dh{dh}, same step as the store", ctx.name()),
                &got1,
                &want1,
                dh,
            );
            let enc_of = [Some(0), None, Some(1)];
            let want2: Vec<f64> =
                seq_ids(&dec_lens).iter().enumerate().flat_map(|(r, &s)| attend(&q2, r, enc_of[s as usize])).collect();
            check(&format!("{} cross attention hq{hq} hkv{hkv} dh{dh}, a later step", ctx.name()), &got2, &want2, dh);

            // The stored layout is the documented one: length in element 0 of the row, then K then V rows.
            let mut raw = vec![0u8; 3 * row_elems * 4];
            ctx.read(&state, 0, &mut raw).unwrap();
            let f: Vec<f32> = raw.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect();
            let h = CROSS_KV_HEADER as usize;
            assert_eq!(f[2 * row_elems].to_bits(), 70, "stored length of sequence 0");
            assert_eq!(f[0].to_bits(), 3, "stored length of sequence 1");
            assert_eq!(f[row_elems].to_bits(), 0, "a row nothing was stored in");
            let p = 5; // sequence 0, encoder row 5
            assert_eq!(&f[2 * row_elems + h + p * 2 * kv_row..][..kv_row], &k[p * kv_row..(p + 1) * kv_row]);
            assert_eq!(&f[2 * row_elems + h + p * 2 * kv_row + kv_row..][..kv_row], &v[p * kv_row..(p + 1) * kv_row]);
        }
    });
}

/// f64 reference of a 1-D convolution over one sequence's padded input `p` (`rows × c_in`), weights
/// `[c_out, k, c_in/groups]`.
#[allow(clippy::too_many_arguments)]
fn ref_conv1d(
    p: &[f64],
    c_in: usize,
    w: &[f64],
    bias: Option<&[f64]>,
    c_out: usize,
    k: usize,
    stride: usize,
    groups: usize,
) -> Vec<f64> {
    let rows = p.len() / c_in;
    let t_out = if rows < k { 0 } else { (rows - k) / stride + 1 };
    let (cin_g, cout_g) = (c_in / groups, c_out / groups);
    let mut out = vec![0f64; t_out * c_out];
    for t in 0..t_out {
        for o in 0..c_out {
            let g = o / cout_g;
            let mut acc = bias.map_or(0.0, |b| b[o]);
            for kk in 0..k {
                for c in 0..cin_g {
                    acc += w[(o * k + kk) * cin_g + c] * p[(t * stride + kk) * c_in + g * cin_g + c];
                }
            }
            out[t * c_out + o] = acc;
        }
    }
    out
}

#[test]
fn conv1d_over_whole_sequences_matches_reference() {
    each_backend(|ctx, rng| {
        // (c_in, c_out, kernel, stride, padding, groups, weight dtype): Whisper's conv1 / conv2 (stride 2)
        // shapes in small, a depthwise conv, two groups, a 1-wide kernel.
        let cases = [
            (5usize, 7usize, 3usize, 1usize, 1usize, 1usize, DType::F32),
            (7, 12, 3, 2, 1, 1, DType::F16),
            (40, 300, 3, 2, 1, 1, DType::BF16),
            (6, 6, 4, 1, 2, 6, DType::F32),
            (8, 6, 3, 2, 0, 2, DType::F32),
            (4, 3, 1, 1, 0, 1, DType::BF16),
        ];
        // Sequences of different lengths, one shorter than the kernel and one over a 32-row task.
        let lens = [2usize, 70, 9, 1];
        for &(c_in, c_out, k, stride, pad, groups, wd) in &cases {
            for with_bias in [false, true] {
                let t: usize = lens.iter().sum();
                let x = rng.vec(t * c_in, 1.0);
                let w = float_weight(rng, c_out * k * (c_in / groups), wd, 0.5);
                let b = float_weight(rng, c_out, DType::F32, 0.5);
                let mut want = Vec::new();
                let mut start = 0;
                for &len in &lens {
                    let mut p = vec![0f64; pad * c_in];
                    p.extend(x[start * c_in..(start + len) * c_in].iter().map(|&v| v as f64));
                    p.extend(vec![0f64; pad * c_in]);
                    let bias = with_bias.then_some(&b.values[..]);
                    want.extend(ref_conv1d(&p, c_in, &w.values, bias, c_out, k, stride, groups));
                    start += len;
                }
                let t_out = want.len() / c_out;
                let mut run = Run::new(ctx);
                let xi = run.input_f32(&x, &[t as u64, c_in as u64]);
                let wi = run.weight(&w.data, wd, &[c_out as u64, k as u64, (c_in / groups) as u64]);
                let si = run.input_i32(&seq_ids(&lens));
                let mut src = vec![xi, wi, si];
                if with_bias {
                    src.push(run.weight(&b.data, DType::F32, &[c_out as u64]));
                }
                let o = run.g.op_with(
                    OpCode::Conv1d,
                    &[t_out as u64, c_out as u64],
                    &src,
                    &[CONV_WHOLE, stride as i64, pad as i64, groups as i64],
                    &[],
                );
                let got = run.execute(o);
                let what = format!(
                    "{} conv1d c_in {c_in} c_out {c_out} k{k} stride {stride} pad {pad} groups {groups} {wd:?} bias {with_bias}",
                    ctx.name()
                );
                check(&what, &got, &want, k * c_in / groups);
            }
        }
    });
}

/// Weights in PyTorch's `[C_out, C_in/groups, K]` layout (`iparams[5]` = 1, as Hugging Face Whisper
/// stores conv1/conv2) give what the same weights in MLX's layout give, to the reference.
#[test]
fn conv1d_with_pytorch_layout_weights_matches_reference() {
    each_backend(|ctx, rng| {
        for &(c_in, c_out, k, stride, pad, groups) in
            &[(5usize, 7usize, 3usize, 1usize, 1usize, 1usize), (8, 6, 3, 2, 1, 2)]
        {
            let lens = [9usize, 40];
            let t: usize = lens.iter().sum();
            let cin_g = c_in / groups;
            let x = rng.vec(t * c_in, 1.0);
            let w = float_weight(rng, c_out * k * cin_g, DType::F32, 0.5);
            // The same weights stored [C_out, C_in/g, K].
            let mut torch = vec![0f32; w.values.len()];
            for o in 0..c_out {
                for kk in 0..k {
                    for c in 0..cin_g {
                        torch[(o * cin_g + c) * k + kk] = w.values[(o * k + kk) * cin_g + c] as f32;
                    }
                }
            }
            let b = float_weight(rng, c_out, DType::F32, 0.5);
            let mut want = Vec::new();
            let mut start = 0;
            for &len in &lens {
                let mut p = vec![0f64; pad * c_in];
                p.extend(x[start * c_in..(start + len) * c_in].iter().map(|&v| v as f64));
                p.extend(vec![0f64; pad * c_in]);
                want.extend(ref_conv1d(&p, c_in, &w.values, Some(&b.values), c_out, k, stride, groups));
                start += len;
            }
            let t_out = want.len() / c_out;
            let mut run = Run::new(ctx);
            let xi = run.input_f32(&x, &[t as u64, c_in as u64]);
            let wi = run.weight(&bytes(&torch), DType::F32, &[c_out as u64, cin_g as u64, k as u64]);
            let si = run.input_i32(&seq_ids(&lens));
            let bi = run.weight(&b.data, DType::F32, &[c_out as u64]);
            let o = run.g.op_with(
                OpCode::Conv1d,
                &[t_out as u64, c_out as u64],
                &[xi, wi, si, bi],
                &[CONV_WHOLE, stride as i64, pad as i64, groups as i64, 0, CONV_WEIGHT_TORCH],
                &[],
            );
            let got = run.execute(o);
            let what = format!(
                "{} conv1d PyTorch layout c_in {c_in} c_out {c_out} k{k} stride {stride} groups {groups}",
                ctx.name()
            );
            check(&what, &got, &want, k * cin_g);
        }
    });
}

/// LFM2's short conv: causal, the last K − 1 input rows of each sequence carried in its state row, so a
/// prompt fed in chunks (a boundary inside the kernel's window, a chunk shorter than the window) and
/// then decoded token by token gives what one pass over the whole sequence gives — with two
/// sequences in every step, each in its own state row.
#[test]
fn causal_conv1d_carries_state_across_chunks() {
    each_backend(|ctx, rng| {
        // (channels in, out, kernel, groups): depthwise as LFM2, and a full one.
        for &(c_in, c_out, k, groups) in &[(24usize, 24usize, 4usize, 24usize), (10, 6, 3, 1)] {
            let total = [11usize, 8];
            let xs: Vec<Vec<f32>> = total.iter().map(|&n| rng.vec(n * c_in, 1.0)).collect();
            let w = float_weight(rng, c_out * k * (c_in / groups), DType::BF16, 0.5);
            let b = float_weight(rng, c_out, DType::F32, 0.5);
            let want: Vec<Vec<f64>> = xs
                .iter()
                .map(|x| {
                    let mut p = vec![0f64; (k - 1) * c_in];
                    p.extend(x.iter().map(|&v| v as f64));
                    ref_conv1d(&p, c_in, &w.values, Some(&b.values), c_out, k, 1, groups)
                })
                .collect();
            let row_elems = conv_state_elems(k as u64, c_in as u64) as usize;
            // Sequence 0 in state row 1, sequence 1 in row 0.
            let slots = [1u32, 0];
            let run_steps = |ctx: &mut BackendContext, chunks: &[[usize; 2]]| -> Vec<Vec<f32>> {
                let state = state_buffer(ctx, 2, row_elems);
                let mut got = vec![Vec::new(), Vec::new()];
                let mut done = [0usize, 0];
                for step in chunks {
                    let mut x = Vec::new();
                    for s in 0..2 {
                        x.extend_from_slice(&xs[s][done[s] * c_in..(done[s] + step[s]) * c_in]);
                    }
                    let t: usize = step.iter().sum();
                    let mut run = Run::new(ctx);
                    run.kv.push([std::ptr::null_mut(), std::ptr::null_mut(), state.handle()]);
                    run.batch = Some(BatchData::sequences(step, &slots));
                    let xi = run.input_f32(&x, &[t as u64, c_in as u64]);
                    let wi = run.weight(&w.data, DType::BF16, &[c_out as u64, k as u64, (c_in / groups) as u64]);
                    let si = run.input_i32(&seq_ids(step));
                    let bi = run.weight(&b.data, DType::F32, &[c_out as u64]);
                    let o = run.g.op_with(
                        OpCode::Conv1d,
                        &[t as u64, c_out as u64],
                        &[xi, wi, si, bi],
                        &[CONV_CAUSAL_STATE, 1, 0, groups as i64, 0],
                        &[],
                    );
                    let out = run.execute(o);
                    got[0].extend_from_slice(&out[..step[0] * c_out]);
                    got[1].extend_from_slice(&out[step[0] * c_out..]);
                    done[0] += step[0];
                    done[1] += step[1];
                }
                assert_eq!(done, total);
                got
            };
            let one_shot = run_steps(ctx, &[total]);
            // Chunks of 5, 1 (shorter than the window) and 2, then decode; sequence 1 joins a step late.
            let chunked = run_steps(ctx, &[[5, 0], [1, 6], [2, 1], [1, 1], [1, 0], [1, 0]]);
            for s in 0..2 {
                let what =
                    format!("{} causal conv1d c_in {c_in} c_out {c_out} k{k} groups {groups} seq {s}", ctx.name());
                check(&format!("{what} one pass"), &one_shot[s], &want[s], k * c_in / groups);
                check(&format!("{what} chunked"), &chunked[s], &want[s], k * c_in / groups);
                if groups == c_in {
                    // Per-channel sums in a fixed order: chunking changes nothing, bit for bit.
                    assert_eq!(one_shot[s], chunked[s], "{what}: chunked differs from one pass");
                }
            }
        }
    });
}

#[test]
fn segment_pooling_matches_reference() {
    each_backend(|ctx, rng| {
        let c = 37usize;
        // Sequences of 1, 70 and 4 rows; output row 3 is a sequence with no rows (zeros).
        let lens = [1usize, 70, 4];
        let t: usize = lens.iter().sum();
        let x = rng.vec(t * c, 1.0);
        let seq = seq_ids(&lens);
        for pool in [POOL_MEAN, POOL_FIRST, POOL_LAST] {
            let mut run = Run::new(ctx);
            let xi = run.input_f32(&x, &[t as u64, c as u64]);
            let si = run.input_i32(&seq);
            let o = run.g.op_with(OpCode::SegmentPool, &[4, c as u64], &[xi, si], &[pool], &[]);
            let got = run.execute(o);
            let mut want = vec![0f64; 4 * c];
            let mut start = 0;
            for (s, &len) in lens.iter().enumerate() {
                for j in 0..c {
                    let col = |r: usize| x[r * c + j] as f64;
                    want[s * c + j] = match pool {
                        POOL_MEAN => (start..start + len).map(col).sum::<f64>() / len as f64,
                        POOL_FIRST => col(start),
                        _ => col(start + len - 1),
                    };
                }
                start += len;
            }
            check(&format!("{} segment pool {pool}", ctx.name()), &got, &want, t);
        }
    });
}

#[test]
fn encoder_ops_refuse_bad_input_with_a_message() {
    each_backend(|ctx, rng| {
        let expect_err = |r: Result<Vec<f32>, String>, what: &str, needle: &str| match r {
            Ok(_) => panic!("{what}: accepted"),
            Err(m) => assert!(m.contains(needle), "{what}: message `{m}` should say `{needle}`"),
        };
        // A sequence whose rows are not contiguous.
        let x = rng.vec(3 * 8, 1.0);
        let mut run = Run::new(ctx);
        let qi = run.input_f32(&x, &[3, 8]);
        let si = run.input_i32(&[0, 1, 0]);
        let o = run.g.op_with(OpCode::StepAttention, &[3, 8], &[qi, qi, qi, si], &[1, 1, 8, 0], &[1.0]);
        expect_err(run.try_execute(o), "non-contiguous sequence", "not contiguous");
        // A column range past the row.
        let mut run = Run::new(ctx);
        let xi = run.input_f32(&x, &[3, 8]);
        let o = run.g.op_with(OpCode::Slice, &[3, 4], &[xi], &[6, 10], &[]);
        expect_err(run.try_execute(o), "slice past the row", "column range");
        // Pooling into fewer rows than there are sequences.
        let mut run = Run::new(ctx);
        let xi = run.input_f32(&x, &[3, 8]);
        let si = run.input_i32(&[0, 1, 2]);
        let o = run.g.op_with(OpCode::SegmentPool, &[2, 8], &[xi, si], &[POOL_MEAN], &[]);
        expect_err(run.try_execute(o), "pool index out of range", "out of range");
        // A convolution whose output rows do not match its sequences.
        let w = float_weight(rng, 8 * 3 * 8, DType::F32, 1.0);
        let mut run = Run::new(ctx);
        let xi = run.input_f32(&x, &[3, 8]);
        let wi = run.weight(&w.data, DType::F32, &[8, 3, 8]);
        let si = run.input_i32(&[0, 0, 0]);
        let o = run.g.op_with(OpCode::Conv1d, &[3, 8], &[xi, wi, si], &[CONV_WHOLE, 2, 1, 1], &[]);
        expect_err(run.try_execute(o), "conv output rows", "rows");
        // Storing more encoder rows than the state row holds, and attending without a state buffer.
        let max_len = 2usize;
        let state = state_buffer(ctx, 1, cross_kv_state_elems(max_len as u64, 1, 8) as usize);
        let mut run = Run::new(ctx);
        run.kv.push([std::ptr::null_mut(), std::ptr::null_mut(), state.handle()]);
        run.batch = Some(BatchData::sequences(&[3], &[0]));
        let ki = run.input_f32(&x, &[3, 8]);
        let si = run.input_i32(&[0, 0, 0]);
        let o = run.g.op_with(OpCode::StoreCrossKv, &[1], &[ki, ki, si], &[0, 1, 8, max_len as i64], &[]);
        expect_err(run.try_execute(o), "store past max_source_len", "more than");
        let mut run = Run::new(ctx);
        run.kv.push([std::ptr::null_mut(); 3]);
        run.batch = Some(BatchData::sequences(&[3], &[0]));
        let qi = run.input_f32(&x, &[3, 8]);
        let si = run.input_i32(&[0, 0, 0]);
        let o = run.g.op_with(OpCode::CrossAttention, &[3, 8], &[qi, si], &[0, 1, 1, 8, 2], &[1.0]);
        expect_err(run.try_execute(o), "cross attention without state", "no state");
    });
}

/// A fused projection (Phi-3's `qkv_proj`) bound once and used as row-range views, one matmul per part:
/// float, and MLX-quantized with packed weights, scales and biases each viewed over the same rows.
#[test]
fn row_views_of_a_fused_weight_match_its_parts() {
    each_backend(|ctx, rng| {
        let (t, k) = (5usize, 128usize);
        let parts = [(0usize, 48usize), (48, 16), (64, 16)]; // q, k, v rows
        let n: usize = 80;
        let x = rng.vec(t * k, 1.0);
        let w = float_weight(rng, n * k, DType::F16, 0.5);
        let q = quant_weight(rng, n, k, 4, 64, DType::BF16);
        for &(r0, rows) in &parts {
            let mut run = Run::new(ctx);
            let xi = run.input_f32(&x, &[t as u64, k as u64]);
            // Bind the whole tensor under index 0, then view it.
            let whole = run.weight(&w.data, DType::F16, &[n as u64, k as u64]);
            let idx = run.g.node(whole).iparams[0] as u32;
            let wi = run.g.weight_rows(idx, DType::F16, n as u64, r0 as u64, rows as u64, k as u64);
            let o = run.g.op(OpCode::MatMul, &[t as u64, rows as u64], &[xi, wi]);
            let got = run.execute(o);
            let want: Vec<f64> = (0..t * rows)
                .map(|i| (0..k).map(|j| x[(i / rows) * k + j] as f64 * w.values[(r0 + i % rows) * k + j]).sum())
                .collect();
            check(&format!("{} float row view {r0}+{rows}", ctx.name()), &got, &want, k);

            let mut run = Run::new(ctx);
            let xi = run.input_f32(&x, &[t as u64, k as u64]);
            let (wpr, g) = ((k * 4 / 32) as u64, (k / 64) as u64);
            let mut view = |data: &[u8], dtype: DType, cols: u64| {
                let whole = run.weight(data, dtype, &[n as u64, cols]);
                let idx = run.g.node(whole).iparams[0] as u32;
                run.g.weight_rows(idx, dtype, n as u64, r0 as u64, rows as u64, cols)
            };
            let pi = view(&bytes(&q.packed), DType::U32, wpr);
            let si = view(&q.scales.data, DType::BF16, g);
            let bi = view(&q.biases.data, DType::BF16, g);
            let o = run.g.op_with(OpCode::QuantMatMul, &[t as u64, rows as u64], &[xi, pi, si, bi], &[4, 64], &[]);
            let got = run.execute(o);
            let part = QuantWeight {
                packed: vec![],
                scales: FloatWeight { data: vec![], values: vec![] },
                biases: FloatWeight { data: vec![], values: vec![] },
                dequant: q.dequant[r0 * k..(r0 + rows) * k].to_vec(),
            };
            check_qmatmul(&format!("{} quantized row view {r0}+{rows}", ctx.name()), &got, &x, &part, t, k, rows);
        }
        // A view past the stored rows is refused.
        let mut run = Run::new(ctx);
        let xi = run.input_f32(&x, &[t as u64, k as u64]);
        let whole = run.weight(&w.data, DType::F16, &[n as u64, k as u64]);
        let idx = run.g.node(whole).iparams[0] as u32;
        let wi = run.g.weight_rows(idx, DType::F16, n as u64, 70, 16, k as u64);
        let o = run.g.op(OpCode::MatMul, &[t as u64, 16], &[xi, wi]);
        assert!(run.try_execute(o).is_err_and(|m| m.contains("outside")), "a view past the weight's rows");
    });
}

/// After a strided convolution (Whisper's conv2) the rows are no longer the step's tokens: the family
/// gives their sequence indices as an `I32` constant, which per-sequence ops read like the input.
#[test]
fn rows_after_a_strided_conv_take_sequence_indices_from_an_i32_constant() {
    each_backend(|ctx, rng| {
        let (c_in, c_out, k) = (6usize, 10usize, 3usize);
        let lens = [9usize, 6];
        let t: usize = lens.iter().sum();
        let x = rng.vec(t * c_in, 1.0);
        let w = float_weight(rng, c_out * k * c_in, DType::F32, 0.5);
        let mut conv = Vec::new();
        let mut out_lens = Vec::new();
        let mut start = 0;
        for &len in &lens {
            let mut p = vec![0f64; c_in];
            p.extend(x[start * c_in..(start + len) * c_in].iter().map(|&v| v as f64));
            p.extend(vec![0f64; c_in]);
            let o = ref_conv1d(&p, c_in, &w.values, None, c_out, k, 2, 1);
            out_lens.push(o.len() / c_out);
            conv.push(o);
            start += len;
        }
        assert_eq!(out_lens, [5, 3]);
        let mut run = Run::new(ctx);
        let xi = run.input_f32(&x, &[t as u64, c_in as u64]);
        let wi = run.weight(&w.data, DType::F32, &[c_out as u64, k as u64, c_in as u64]);
        let si = run.input_i32(&seq_ids(&lens));
        let ci = run.g.op_with(OpCode::Conv1d, &[8, c_out as u64], &[xi, wi, si], &[CONV_WHOLE, 2, 1, 1], &[]);
        let rows_seq = run.g.constant_i32(&seq_ids(&out_lens), &[8]);
        let o = run.g.op_with(OpCode::SegmentPool, &[2, c_out as u64], &[ci, rows_seq], &[POOL_MEAN], &[]);
        let got = run.execute(o);
        let want: Vec<f64> = conv
            .iter()
            .flat_map(|o| {
                let n = o.len() / c_out;
                (0..c_out).map(move |j| (0..n).map(|r| o[r * c_out + j]).sum::<f64>() / n as f64)
            })
            .collect();
        check(&format!("{} strided conv then pooling by an i32 constant", ctx.name()), &got, &want, k * c_in * 5);
    });
}
