//! Times one decode step's cached attention on SmolLM2-135M's shapes (9 query heads, 3 KV heads of
//! 64, f16 cache in pages of 16 positions), every layer's cache distinct so it streams from memory as
//! in a real decode step at that depth.
//! `cargo run --release -p mlxcel-backend-cpu --example attention_bench -- [depth] [threads] [tokens]`
//! (`tokens` > 1: that many sequences of the same depth decode in one step; `HKV=n`: n KV heads of
//! three query heads each; `LAYERS=n`: only n distinct caches, shared round-robin by the 30 layers —
//! `LAYERS=1` keeps them cache-resident, timing the arithmetic alone; `FLUSH=mb`: that many MB of
//! other memory read between layers, untimed, as a step's weights stream between two layers'
//! attention; `REPS`: repetitions, 20 by default.)

use std::time::Instant;

use half::f16;
use mlxcel_backend_cpu::isa::Isa;
use mlxcel_backend_cpu::kernels::attention::{attention, AttentionScratch, AttentionShape, PagedLayout};

fn main() {
    let args: Vec<usize> = std::env::args().skip(1).map(|a| a.parse().expect("numbers")).collect();
    let depth = args.first().copied().unwrap_or(4096);
    let threads = args.get(1).copied().unwrap_or(1);
    let seqs = args.get(2).copied().unwrap_or(1);
    let isa = Isa::from_env().unwrap();
    let pool = mlxcel_backend_cpu::pool::ThreadPool::new(threads).unwrap();
    let hkv: usize = std::env::var("HKV").ok().and_then(|v| v.parse().ok()).unwrap_or(3);
    let (hq, dh, layers, block) = (3 * hkv, 64, 30, 16);
    let kv_row = hkv * dh;
    let blocks_per_seq = (depth + 1).div_ceil(block);
    let slots = seqs * blocks_per_seq * block;
    let mut seed = 0x9e3779b97f4a7c15u64;
    let mut rnd = move || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        (seed % 2000) as f32 / 1000.0 - 1.0
    };
    let mut fill = |n: usize| (0..n).map(|_| f16::from_f32(rnd())).collect::<Vec<f16>>();
    let distinct = std::env::var("LAYERS").ok().and_then(|v| v.parse().ok()).unwrap_or(layers).clamp(1, layers);
    let owned: Vec<(Vec<f16>, Vec<f16>)> =
        (0..distinct).map(|_| (fill(slots * kv_row), fill(slots * kv_row))).collect();
    let caches: Vec<&(Vec<f16>, Vec<f16>)> = (0..layers).map(|l| &owned[l % distinct]).collect();
    let q: Vec<f32> = (0..seqs * hq * dh).map(|_| rnd()).collect();
    let mut out = vec![0f32; seqs * hq * dh];
    let token_seq: Vec<u32> = (0..seqs as u32).collect();
    let positions = vec![depth as i32; seqs];
    let block_tables: Vec<u32> = (0..(seqs * blocks_per_seq) as u32).collect();
    let slot_mapping: Vec<i64> = (0..seqs).map(|s| (s * blocks_per_seq * block + depth) as i64).collect();
    let layout = PagedLayout {
        token_seq: &token_seq,
        positions: &positions,
        slot_mapping: &slot_mapping,
        block_tables: &block_tables,
        max_blocks_per_seq: blocks_per_seq,
        block_size: block,
    };
    let shape = AttentionShape { n_heads: hq, n_kv_heads: hkv, head_dim: dh, window: 0, scale: 0.125, softcap: 0.0 };
    let mut scratch = AttentionScratch::default();
    let reps = std::env::var("REPS").ok().and_then(|v| v.parse().ok()).unwrap_or(20);
    // FLUSH=mb: that many MB of other memory read between layers (untimed), as a decode step's
    // weights stream through the caches between one layer's attention and the next.
    let flush_mb: usize = std::env::var("FLUSH").ok().and_then(|v| v.parse().ok()).unwrap_or(0);
    let other = vec![1u8; flush_mb << 20];
    let per_layer = other.len() / layers;
    let mut sink = 0u64;
    let mut times = pool.install(|| {
        (0..reps)
            .map(|_| {
                let mut secs = 0.0;
                for (l, (k, v)) in caches.iter().enumerate() {
                    if per_layer > 0 {
                        let part = &other[l * per_layer..(l + 1) * per_layer];
                        sink += part.iter().step_by(64).map(|&b| b as u64).sum::<u64>();
                    }
                    let start = Instant::now();
                    attention(isa, &layout, shape, &q, k, v, &mut out, &mut scratch);
                    secs += start.elapsed().as_secs_f64();
                }
                secs
            })
            .collect::<Vec<_>>()
    });
    std::hint::black_box(sink);
    times.sort_by(|a, b| a.partial_cmp(b).unwrap());
    let med = times[times.len() / 2];
    let bytes = (layers * seqs * (depth + 1) * kv_row * 2 * 2) as f64;
    println!(
        "isa {} depth {depth} seqs {seqs} threads {threads}: {:.2} ms per step (min {:.2}), {:.1} GB/s of KV, {:.1} ns per position per layer",
        isa.name(),
        med * 1e3,
        times[0] * 1e3,
        bytes / med / 1e9,
        med * 1e9 / (layers * seqs * (depth + 1)) as f64
    );
}
