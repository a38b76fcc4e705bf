//! MLX affine quantization against MLX itself: packed words, scales and biases made by `mx.quantize`
//! (fixtures/make_quant_fixtures.py) must unpack to the same integers under our bit-stream reading,
//! repack to the same words, and dequantize (through each backend's kernels) to `mx.dequantize`'s
//! values, for every bits × group size.

mod common;

use mlxcel_plugin_api::*;
use mlxcel_plugins::{Catalog, PluginSearch};
use safetensors::SafeTensors;

fn fixtures() -> Vec<u8> {
    std::fs::read(std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/mlx-quant.safetensors"))
        .unwrap()
}

fn u32s(b: &[u8]) -> Vec<u32> {
    b.chunks_exact(4).map(|c| u32::from_le_bytes(c.try_into().unwrap())).collect()
}
fn f32s(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect()
}

/// Value `i` of a row: bits `i*bits..` of the row's little-endian bit stream.
fn unpack(row: &[u32], bits: usize, n: usize) -> Vec<u64> {
    (0..n)
        .map(|i| {
            let bit = i * bits;
            let lo = row[bit / 32] as u64;
            let hi = row.get(bit / 32 + 1).copied().unwrap_or(0) as u64;
            ((lo | hi << 32) >> (bit % 32)) & ((1 << bits) - 1)
        })
        .collect()
}

fn pack(values: &[u64], bits: usize) -> Vec<u32> {
    let mut out = vec![0u32; values.len() * bits / 32];
    for (i, &v) in values.iter().enumerate() {
        let bit = i * bits;
        out[bit / 32] |= (v << (bit % 32)) as u32;
        if bit % 32 + bits > 32 {
            out[bit / 32 + 1] |= (v >> (32 - bit % 32)) as u32;
        }
    }
    out
}

#[test]
fn mlx_packing_round_trips_for_every_bits_and_group() {
    let data = fixtures();
    let st = SafeTensors::deserialize(&data).unwrap();
    for bits in [2usize, 3, 4, 5, 6, 8] {
        for group in [32usize, 64, 128] {
            let key = format!("b{bits}_g{group}");
            let packed = u32s(st.tensor(&format!("{key}.packed")).unwrap().data());
            let wpr = 256 * bits / 32;
            assert_eq!(packed.len(), 4 * wpr, "{key}: packed size");
            for r in 0..4 {
                let row = &packed[r * wpr..(r + 1) * wpr];
                let q = unpack(row, bits, 256);
                assert!(q.iter().all(|&v| v < 1 << bits));
                assert_eq!(pack(&q, bits), row, "{key}: row {r} repacks to MLX's words");
            }
        }
    }
}

#[test]
fn backends_dequantize_exactly_like_mlx() {
    let data = fixtures();
    let st = SafeTensors::deserialize(&data).unwrap();
    let cat = Catalog::load(&PluginSearch { dirs: vec![common::staged_dir()] });
    for plugin in cat.backends.iter().filter(|b| b.describe().score > 0) {
        let mut ctx = plugin.create(2, 0).unwrap();
        for bits in [2usize, 3, 4, 5, 6, 8] {
            for group in [32usize, 64, 128] {
                let key = format!("b{bits}_g{group}");
                let t = |s: &str| st.tensor(&format!("{key}.{s}")).unwrap().data().to_vec();
                let (packed, scales, biases) = (t("packed"), t("scales"), t("biases"));
                let want = f32s(&t("dequant"));
                let bufs: Vec<_> = [&packed, &scales, &biases]
                    .iter()
                    .map(|b| unsafe { ctx.buffer_from_host(Box::leak(b.to_vec().into_boxed_slice())) }.unwrap())
                    .collect();
                let ids: Vec<i32> = vec![0, 1, 2, 3];
                let mut g = Graph::new();
                let ii = g.input(0, DType::I32, &[4]);
                let p = g.weight(0, DType::U32, &[4, (256 * bits / 32) as u64]);
                let s = g.weight(1, DType::F16, &[4, (256 / group) as u64]);
                let b = g.weight(2, DType::F16, &[4, (256 / group) as u64]);
                let o = g.op_with(OpCode::QuantEmbedding, &[4, 256], &[ii, p, s, b], &[bits as i64, group as i64], &[]);
                g.mark_output(o);
                let mut out = vec![0f32; 4 * 256];
                let inputs = [HostTensor { ptr: ids.as_ptr() as *mut u8, len: 16 }];
                let handles: Vec<BufferHandle> = bufs.iter().map(|b| b.handle()).collect();
                let outputs = [HostTensor { ptr: out.as_mut_ptr() as *mut u8, len: out.len() * 4 }];
                let args = ComputeArgs {
                    graph: g.as_ref(),
                    inputs: inputs.as_ptr(),
                    n_inputs: 1,
                    weights: handles.as_ptr(),
                    n_weights: handles.len(),
                    kv: std::ptr::null(),
                    n_kv: 0,
                    batch: std::ptr::null(),
                    outputs: outputs.as_ptr(),
                    n_outputs: 1,
                    ..ComputeArgs::zeroed()
                };
                unsafe { ctx.compute(&args) }.unwrap();
                for (i, (g, w)) in out.iter().zip(&want).enumerate() {
                    assert!(
                        (g - w).abs() <= 1e-6 * (1.0 + w.abs()),
                        "{} {key}: element {i}: {g} vs MLX {w}",
                        plugin.name()
                    );
                }
                // The quantization is also faithful to the original matrix (sanity of the fixture).
                let w = f32s(&t("w"));
                let step = 4.0 / ((1 << bits) - 1) as f32 * 2.0;
                assert!(
                    w.iter().zip(&want).all(|(a, b)| (a - b).abs() <= step),
                    "{key}: dequantized far from original"
                );
            }
        }
    }
}
