//! Times the quantized matmul kernels on SmolLM2-135M's shapes (4-bit, group 32, f16 scales), with
//! every layer's weights distinct so they stream from memory as in a real decode step.
//! `cargo run --release -p mlxcel-backend-cpu --example qmatmul_bench -- [tokens] [threads]`
//! (`SEQS=1`: the tokens are separate sequences, as in a server step decoding several at once;
//! `PACK=0`: 4-bit matrices in MLX's row layout, not in the panel kernel's own order)

use std::time::Instant;

use mlxcel_backend_cpu::isa::Isa;
use mlxcel_backend_cpu::kernels::int_dot::IntActs;
use mlxcel_backend_cpu::kernels::panel_pack::{PanelFactors, PanelWeights, Panels};
use mlxcel_backend_cpu::kernels::quantized::{qmatmul, QuantMatrix, QuantPath};
use mlxcel_backend_cpu::kernels::Floats;

/// Weight width: `BITS` (default 4).
fn bits() -> usize {
    std::env::var("BITS").ok().and_then(|v| v.parse().ok()).unwrap_or(4)
}

struct Mat {
    packed: Vec<u32>,
    scales: Vec<u16>,
    biases: Vec<u16>,
    n: usize,
    k: usize,
}

fn rng(seed: &mut u64) -> u64 {
    *seed ^= *seed << 13;
    *seed ^= *seed >> 7;
    *seed ^= *seed << 17;
    *seed
}

fn mat(n: usize, k: usize, seed: &mut u64) -> Mat {
    let packed = (0..n * k * bits() / 32).map(|_| rng(seed) as u32).collect();
    let half = |v: f32| half::f16::from_f32(v).to_bits();
    let scales = (0..n * k / 32).map(|_| half(0.01 + (rng(seed) % 100) as f32 * 1e-4)).collect();
    let biases = (0..n * k / 32).map(|_| half(-0.05 + (rng(seed) % 100) as f32 * 1e-4)).collect();
    Mat { packed, scales, biases, n, k }
}

fn main() {
    let args: Vec<usize> = std::env::args().skip(1).map(|a| a.parse().expect("numbers")).collect();
    let t = args.first().copied().unwrap_or(1);
    let threads = args.get(1).copied().unwrap_or(1);
    let isa = Isa::from_env().unwrap();
    let pool = mlxcel_backend_cpu::pool::ThreadPool::new(threads).unwrap();
    let mut seed = 0x9e3779b97f4a7c15u64;
    let (h, f, kv, vocab, layers) = (576, 1536, 192, 49152, 30);
    let mut mats = Vec::new();
    // HOT=1: one layer's weights reused (cache-resident): the kernel's compute speed alone.
    let hot = std::env::var("HOT").is_ok_and(|v| v == "1" || v == "l2" || v == "long");
    for _ in 0..if hot { 1 } else { layers } {
        for (n, k) in [(h, h), (kv, h), (kv, h), (h, h), (f, h), (f, h), (h, f)] {
            mats.push(mat(n, k, &mut seed));
        }
    }
    if !hot {
        mats.push(mat(vocab, h, &mut seed));
    }
    // HOT=l2: one [768, 576] matrix (L1/L2-resident): the kernel's arithmetic alone.
    if std::env::var("HOT").is_ok_and(|v| v == "l2") {
        mats = vec![mat(768, h, &mut seed)];
    }
    // HOT=long: long rows (K = 4608) to separate per-row from per-block cost.
    if std::env::var("HOT").is_ok_and(|v| v == "long") {
        mats = vec![mat(96, 4608, &mut seed)];
    }
    // ONLY=n,k: one [n, k] shape, as many distinct copies as make the model's size (or COUNT of
    // them): how a shape's passes split across threads, apart from the others.
    if let Ok(only) = std::env::var("ONLY") {
        let v: Vec<usize> = only.split(',').map(|x| x.parse().expect("ONLY=n,k")).collect();
        let count =
            std::env::var("COUNT").map_or((134_000_000 / (v[0] * v[1])).max(1), |c| c.parse().expect("COUNT=number"));
        mats = (0..count).map(|_| mat(v[0], v[1], &mut seed)).collect();
    }
    let bytes: usize = mats.iter().map(|m| m.packed.len() * 4 + m.scales.len() * 4).sum();
    let x: Vec<f32> = (0..t * 4608).map(|_| (rng(&mut seed) % 2000) as f32 / 1000.0 - 1.0).collect();
    let mut out = vec![0f32; t * vocab];
    let mut acts = IntActs::default();
    let int = std::env::var("MLXCEL_CPU_INT16").map_or(true, |v| v != "0");
    // SEQS=1: each token its own sequence (several sequences decoding one token each in one step),
    // as the server's batches are; otherwise one sequence of `t` tokens.
    let segments: Vec<usize> =
        if std::env::var("SEQS").is_ok_and(|v| v == "1") { (1..=t).collect() } else { Vec::new() };
    // PACK=0: the panel kernel reads the matrices in MLX's row layout, not its own panel order.
    let pack_start = Instant::now();
    let packs: Vec<_> = if std::env::var("PACK").is_ok_and(|v| v == "0") || bits() != 4 {
        Vec::new()
    } else {
        mats.iter()
            .map(|m| {
                (
                    PanelWeights::new(&m.packed, m.n, m.k),
                    PanelFactors::new(Floats::F16(&m.scales), m.n, m.k / 32),
                    PanelFactors::new(Floats::F16(&m.biases), m.n, m.k / 32),
                )
            })
            .collect()
    };
    if !packs.is_empty() {
        eprintln!("panel order built in {:.1} ms", pack_start.elapsed().as_secs_f64() * 1e3);
    }
    let reps = if hot { 30 * 15 * 4 } else { 15 };
    // All repetitions inside one `install`, as the executor runs a whole graph, so the timings hold
    // no thread hand-off.
    let mut times = pool.install(|| {
        let mut times = Vec::new();
        for rep in 0..reps {
            let start = Instant::now();
            for (i, m) in mats.iter().enumerate() {
                let w = QuantMatrix {
                    packed: &m.packed,
                    scales: Floats::F16(&m.scales),
                    biases: Floats::F16(&m.biases),
                    bits: bits(),
                    group: 32,
                    k: m.k,
                    panels: packs.get(i).map(|(weights, scales, biases)| Panels { weights, scales, biases, first: 0 }),
                };
                // A new source name per call and repetition: every call quantizes its input.
                let source = rep * mats.len() + i;
                qmatmul(
                    isa,
                    threads,
                    &x[..t * m.k],
                    t,
                    w,
                    m.n,
                    &mut out[..t * m.n],
                    QuantPath::for_sequence(isa, bits(), 32, t, int),
                    int.then_some((&mut acts, source)),
                    &segments,
                );
            }
            times.push(start.elapsed().as_secs_f64());
        }
        times
    });
    times.sort_by(|a, b| a.partial_cmp(b).unwrap());
    let med = times[times.len() / 2];
    println!(
        "isa {} bits {} t={t}{} threads={threads}: {:.2} ms per pass (min {:.2}), {:.1} GB/s, {:.0} tok/s",
        isa.name(),
        bits(),
        if segments.is_empty() { "" } else { " (one token per sequence)" },
        med * 1e3,
        times[0] * 1e3,
        bytes as f64 / med / 1e9,
        t as f64 / med
    );
}
