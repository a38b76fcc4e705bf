//! Helpers shared by the integration tests: fixture paths and a reader for the float32 `.npy` files that
//! `fixtures/make_reference.py` writes.
#![allow(dead_code)]

use std::path::{Path, PathBuf};

pub fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures").join(name)
}

/// `../shared/models/speech-en-16k.wav` beside the repository, if present. Without it the test skips with a
/// message; with `MLXCEL_REQUIRE_TEST_MODELS` set (CI) it fails.
pub fn speech_wav() -> Option<PathBuf> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../shared/models/speech-en-16k.wav");
    if path.is_file() {
        return Some(path);
    }
    if std::env::var_os("MLXCEL_REQUIRE_TEST_MODELS").is_some() {
        panic!("MLXCEL_REQUIRE_TEST_MODELS is set but {} is missing", path.display());
    }
    eprintln!("skipping: needs {} (the project's shared/ folder beside the repository)", path.display());
    None
}

/// A little-endian float32, C-order `.npy` file: `(values, shape)`.
pub fn read_npy_f32(path: &Path) -> (Vec<f32>, Vec<usize>) {
    let bytes = std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    assert_eq!(&bytes[..6], b"\x93NUMPY", "{}: not a .npy file", path.display());
    let (header_len, header_start) = match bytes[6] {
        1 => (u16::from_le_bytes([bytes[8], bytes[9]]) as usize, 10),
        _ => (u32::from_le_bytes(bytes[8..12].try_into().unwrap()) as usize, 12),
    };
    let header = std::str::from_utf8(&bytes[header_start..header_start + header_len]).unwrap();
    assert!(header.contains("'descr': '<f4'"), "{}: not float32: {header}", path.display());
    assert!(header.contains("'fortran_order': False"), "{}: not C order: {header}", path.display());
    let shape_text = header.split("'shape': (").nth(1).and_then(|s| s.split(')').next()).unwrap();
    let shape: Vec<usize> =
        shape_text.split(',').filter(|s| !s.trim().is_empty()).map(|s| s.trim().parse().unwrap()).collect();
    let values: Vec<f32> =
        bytes[header_start + header_len..].chunks_exact(4).map(|b| f32::from_le_bytes(b.try_into().unwrap())).collect();
    assert_eq!(values.len(), shape.iter().product::<usize>(), "{}: size does not match shape", path.display());
    (values, shape)
}

pub fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
}
