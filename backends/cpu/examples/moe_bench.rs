//! Times an expert layer's matmuls (gate, up, down of `k` routed experts out of `E`, 4-bit group 32)
//! against a dense layer with all `E` experts' weights in one matrix, to show that unrouted experts
//! cost nothing: top-2 of 8 should take about a quarter of the dense time.
//! `cargo run --release -p mlxcel-backend-cpu --example moe_bench -- [tokens] [threads] [E] [k]`

use std::time::Instant;

use mlxcel_backend_cpu::isa::Isa;
use mlxcel_backend_cpu::kernels::experts::{gather_qmatmul, Routing};
use mlxcel_backend_cpu::kernels::int_dot::IntActs;
use mlxcel_backend_cpu::kernels::quantized::{qmatmul, QuantMatrix, QuantPath};
use mlxcel_backend_cpu::kernels::Floats;

fn rng(seed: &mut u64) -> u64 {
    *seed ^= *seed << 13;
    *seed ^= *seed >> 7;
    *seed ^= *seed << 17;
    *seed
}

struct Mat {
    packed: Vec<u32>,
    scales: Vec<u16>,
    biases: Vec<u16>,
}

/// `rows × k` 4-bit weights, group 32.
fn mat(rows: usize, k: usize, seed: &mut u64) -> Mat {
    let half = |v: f32| half::f16::from_f32(v).to_bits();
    Mat {
        packed: (0..rows * k / 8).map(|_| rng(seed) as u32).collect(),
        scales: (0..rows * k / 32).map(|_| half(0.01 + (rng(seed) % 100) as f32 * 1e-4)).collect(),
        biases: (0..rows * k / 32).map(|_| half(-0.05 + (rng(seed) % 100) as f32 * 1e-4)).collect(),
    }
}

fn view(m: &Mat, k: usize) -> QuantMatrix<'_> {
    QuantMatrix {
        packed: &m.packed,
        scales: Floats::F16(&m.scales),
        biases: Floats::F16(&m.biases),
        bits: 4,
        group: 32,
        k,
        panels: None,
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() {
    let args: Vec<usize> = std::env::args().skip(1).map(|a| a.parse().expect("numbers")).collect();
    let t = args.first().copied().unwrap_or(1);
    let threads = args.get(1).copied().unwrap_or(1);
    let (ne, k) = (args.get(2).copied().unwrap_or(8), args.get(3).copied().unwrap_or(2));
    let (d, inter) = (1024usize, 1024usize);
    let isa = Isa::from_env().unwrap();
    let pool = mlxcel_backend_cpu::pool::ThreadPool::new(threads).unwrap();
    let mut seed = 0x9e3779b97f4a7c15u64;
    // Stacks [E, inter, d] (gate, up) and [E, d, inter] (down); the dense layer multiplies by all of them.
    let (gate, up, down) =
        (mat(ne * inter, d, &mut seed), mat(ne * inter, d, &mut seed), mat(ne * d, inter, &mut seed));
    let x: Vec<f32> = (0..t * d).map(|_| (rng(&mut seed) % 2000) as f32 / 1000.0 - 1.0).collect();
    let xk: Vec<f32> = (0..t * k * inter).map(|_| (rng(&mut seed) % 2000) as f32 / 1000.0 - 1.0).collect();
    let xd: Vec<f32> = (0..t * ne * inter).map(|_| (rng(&mut seed) % 2000) as f32 / 1000.0 - 1.0).collect();
    let indices: Vec<f32> =
        (0..t).flat_map(|ti| (0..k).map(move |j| ((ti * 3 + j * 5) % ne) as f32)).collect::<Vec<_>>();
    let int = std::env::var("MLXCEL_CPU_INT16").map_or(true, |v| v != "0");
    let path = QuantPath::for_sequence(isa, 4, 32, t, int);
    let path_for = |n| QuantPath::for_sequence(isa, 4, 32, n, int);
    let mut acts = IntActs::default();
    let reps = 21;
    let (moe, dense) = pool.install(|| {
        let (mut moe, mut dense) = (Vec::new(), Vec::new());
        for _ in 0..reps {
            let route = |x_per_token| Routing {
                indices: &indices,
                k,
                x_per_token,
                tokens: t,
                token_seq: &[],
                path_for: &path_for,
                first_expert: 0,
                held: ne,
                total: ne,
            };
            let mut out = vec![0f32; t * k * inter.max(d)];
            let start = Instant::now();
            for w in [&gate, &up] {
                gather_qmatmul(isa, threads, &x, &route(true), view(w, d), inter, &mut out[..t * k * inter], &mut acts)
                    .unwrap();
            }
            gather_qmatmul(isa, threads, &xk, &route(false), view(&down, inter), d, &mut out[..t * k * d], &mut acts)
                .unwrap();
            moe.push(start.elapsed().as_secs_f64());

            let mut out = vec![0f32; t * ne * inter.max(d)];
            let start = Instant::now();
            for (i, w) in [&gate, &up].into_iter().enumerate() {
                acts.key = None;
                let int_acts = int.then_some((&mut acts, i));
                qmatmul(isa, threads, &x, t, view(w, d), ne * inter, &mut out[..t * ne * inter], path, int_acts, &[]);
            }
            // The dense down projection reads all E experts' activations: [t, E·inter] · [d, E·inter]ᵀ
            // costs the same as E experts' [d, inter] each.
            let down_all = QuantMatrix { k: ne * inter, ..view(&down, ne * inter) };
            acts.key = None;
            let int_acts = int.then_some((&mut acts, 2));
            qmatmul(isa, threads, &xd, t, down_all, d, &mut out[..t * d], path, int_acts, &[]);
            dense.push(start.elapsed().as_secs_f64());
        }
        (median(moe), median(dense))
    });
    println!(
        "{t} tokens, {threads} threads, {} path, top-{k} of {ne} experts (d {d}, expert width {inter}): \
         experts {:.3} ms, dense {:.3} ms ({:.0}%)",
        isa.name(),
        moe * 1e3,
        dense * 1e3,
        100.0 * moe / dense
    );
}
