//! Times the encoder kernels on Whisper-tiny's and all-MiniLM-L6-v2's shapes: the two input
//! convolutions over one 30 s window (3000 mel frames), one encoder layer's attention over the 1500
//! frames they leave, a decoder step's cross-attention over them, and BERT attention over 32
//! sentences of 16 tokens. Reports the median of a few repetitions and the effective GFLOP/s.
//! `cargo run --release -p mlxcel-backend-cpu --example encoder_bench -- [threads]`

use std::time::Instant;

use mlxcel_backend_cpu::isa::Isa;
use mlxcel_backend_cpu::kernels::attention::AttentionShape;
use mlxcel_backend_cpu::kernels::attention_step::{step_attention, Mask};
use mlxcel_backend_cpu::kernels::conv1d::{conv1d, ConvShape};
use mlxcel_backend_cpu::kernels::cross_attention::{cross_attention, row_elems, store};
use mlxcel_backend_cpu::kernels::Segment;

fn data(n: usize, seed: &mut u64) -> Vec<f32> {
    (0..n)
        .map(|_| {
            *seed ^= *seed << 13;
            *seed ^= *seed >> 7;
            *seed ^= *seed << 17;
            (*seed % 2000) as f32 / 1000.0 - 1.0
        })
        .collect()
}

fn time(name: &str, flops: f64, mut f: impl FnMut()) {
    f();
    let mut t: Vec<f64> = (0..5)
        .map(|_| {
            let s = Instant::now();
            f();
            s.elapsed().as_secs_f64()
        })
        .collect();
    t.sort_by(f64::total_cmp);
    println!("{name:<48} {:>8.2} ms {:>7.1} GFLOP/s", t[2] * 1e3, flops / t[2] / 1e9);
}

fn main() {
    let threads: usize = std::env::args().nth(1).map_or(1, |a| a.parse().expect("threads"));
    let isa = Isa::from_env().unwrap();
    let pool = mlxcel_backend_cpu::pool::ThreadPool::new(threads).unwrap();
    let mut seed = 0x9e3779b97f4a7c15u64;
    let (mels, d, frames) = (80usize, 384usize, 3000usize);
    pool.install(|| {
        // conv1: 80 → 384, k3, pad 1; conv2: 384 → 384, k3, stride 2, pad 1.
        let x = data((frames + 2) * mels, &mut seed);
        let w1 = data(d * 3 * mels, &mut seed);
        let mut h1 = vec![0f32; frames * d];
        let sh1 = ConvShape { c_in: mels, c_out: d, kernel: 3, stride: 1, groups: 1 };
        time("whisper-tiny conv1 [3000, 80] -> [3000, 384]", 2.0 * (frames * d * 3 * mels) as f64, || {
            conv1d(isa, threads, sh1, &x, &w1, &[], &mut h1)
        });
        let p2 = data((frames + 2) * d, &mut seed);
        let w2 = data(d * 3 * d, &mut seed);
        let mut h2 = vec![0f32; frames / 2 * d];
        let sh2 = ConvShape { c_in: d, c_out: d, kernel: 3, stride: 2, groups: 1 };
        time("whisper-tiny conv2 stride 2 -> [1500, 384]", 2.0 * (frames / 2 * d * 3 * d) as f64, || {
            conv1d(isa, threads, sh2, &p2, &w2, &[], &mut h2)
        });
        let dw = data(1024 * 3, &mut seed);
        let pdw = data((512 + 2) * 1024, &mut seed);
        let mut odw = vec![0f32; 512 * 1024];
        let shd = ConvShape { c_in: 1024, c_out: 1024, kernel: 3, stride: 1, groups: 1024 };
        time("LFM2-350M short conv, 512 tokens (depthwise k3)", 2.0 * (512 * 1024 * 3) as f64, || {
            conv1d(isa, threads, shd, &pdw, &dw, &[], &mut odw)
        });

        // Encoder self-attention: 6 heads x 64 over 1500 frames, bidirectional.
        let n = frames / 2;
        let shape = AttentionShape { n_heads: 6, n_kv_heads: 6, head_dim: 64, window: 0, scale: 0.125, softcap: 0.0 };
        let q = data(n * d, &mut seed);
        let k = data(n * d, &mut seed);
        let v = data(n * d, &mut seed);
        let mut o = vec![0f32; n * d];
        let seg = [Segment { seq: 0, start: 0, end: n }];
        let mask = Mask { causal: false, window: 0 };
        time("whisper-tiny encoder attention, 1500 frames", 4.0 * (n * n * d) as f64, || {
            step_attention(isa, shape, mask, &seg, &q, &k, &v, &mut o)
        });

        // Cross-attention of a 1-token decoder step and of a 64-token prompt over the stored frames.
        let mut state = vec![0f32; row_elems(n, d)];
        store(&k, &v, d, &seg, &[0], n, &mut state);
        for t in [1usize, 64] {
            let qd = data(t * d, &mut seed);
            let mut od = vec![0f32; t * d];
            let segd = [Segment { seq: 0, start: 0, end: t }];
            time(&format!("whisper-tiny cross attention, {t} tokens"), 4.0 * (t * n * d) as f64, || {
                cross_attention(isa, shape, &segd, &[0], &[n], n, &qd, &state, &mut od)
            });
        }

        // all-MiniLM-L6-v2: 12 heads x 32, 32 sentences of 16 tokens in one step.
        let (ns, len) = (32usize, 16usize);
        let shape = AttentionShape { n_heads: 12, n_kv_heads: 12, head_dim: 32, window: 0, scale: 0.18, softcap: 0.0 };
        let segs: Vec<Segment> = (0..ns).map(|s| Segment { seq: s, start: s * len, end: (s + 1) * len }).collect();
        let q = data(ns * len * d, &mut seed);
        let mut o = vec![0f32; ns * len * d];
        time("MiniLM attention, 32 sentences x 16 tokens", 4.0 * (ns * len * len * d) as f64, || {
            step_attention(isa, shape, mask, &segs, &q, &q, &q, &mut o)
        });
    });
}
