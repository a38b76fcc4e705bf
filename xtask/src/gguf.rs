//! A GGUF reader (llama.cpp's file format, versions 2 and 3): header, metadata key/values, tensor
//! infos and the aligned data section, plus dequantization of the block types the converter meets.

use anyhow::{bail, ensure, Context, Result};
use half::f16;

/// One metadata value. Integers widen to i64/u64 and f32 to f64 exactly, as gguf-py's `contents()`
/// hands them to Python.
#[derive(Debug, Clone, PartialEq)]
pub enum MetaValue {
    Int(i64),
    UInt(u64),
    Float(f64),
    Bool(bool),
    Str(String),
    Array(Vec<MetaValue>),
}

impl MetaValue {
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            MetaValue::UInt(u) => Some(u),
            MetaValue::Int(i) => u64::try_from(i).ok(),
            _ => None,
        }
    }

    pub fn as_i64(&self) -> Option<i64> {
        match *self {
            MetaValue::Int(i) => Some(i),
            MetaValue::UInt(u) => i64::try_from(u).ok(),
            _ => None,
        }
    }

    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            MetaValue::Float(x) => Some(x),
            MetaValue::Int(i) => Some(i as f64),
            MetaValue::UInt(u) => Some(u as f64),
            _ => None,
        }
    }

    pub fn as_str(&self) -> Option<&str> {
        match self {
            MetaValue::Str(s) => Some(s),
            _ => None,
        }
    }

    pub fn as_array(&self) -> Option<&[MetaValue]> {
        match self {
            MetaValue::Array(a) => Some(a),
            _ => None,
        }
    }
}

/// The tensor element types the converter handles (ggml's `ggml_type` numbers).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TensorType {
    F32,
    F16,
    Q4_1,
    Q8_0,
    BF16,
}

impl TensorType {
    fn from_id(id: u32) -> Option<TensorType> {
        Some(match id {
            0 => TensorType::F32,
            1 => TensorType::F16,
            3 => TensorType::Q4_1,
            8 => TensorType::Q8_0,
            30 => TensorType::BF16,
            _ => return None,
        })
    }

    /// (elements per block, bytes per block)
    pub fn block(self) -> (usize, usize) {
        match self {
            TensorType::F32 => (1, 4),
            TensorType::F16 | TensorType::BF16 => (1, 2),
            TensorType::Q4_1 => (32, 20),
            TensorType::Q8_0 => (32, 34),
        }
    }
}

#[derive(Debug, Clone)]
pub struct TensorInfo {
    pub name: String,
    /// ggml order: `dims[0]` is the innermost (contiguous) dimension.
    pub dims: Vec<u64>,
    pub ty: TensorType,
    /// Byte range in the file.
    pub start: usize,
    pub len: usize,
}

/// A parsed GGUF file over its bytes.
pub struct Gguf<'a> {
    pub metadata: Vec<(String, MetaValue)>,
    pub tensors: Vec<TensorInfo>,
    pub bytes: &'a [u8],
}

struct Cursor<'a> {
    bytes: &'a [u8],
    pos: usize,
}

impl<'a> Cursor<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8]> {
        let end = self.pos.checked_add(n).filter(|&e| e <= self.bytes.len());
        let end = end.with_context(|| format!("truncated at byte {} (wanted {n} more)", self.pos))?;
        let s = &self.bytes[self.pos..end];
        self.pos = end;
        Ok(s)
    }

    fn array<const N: usize>(&mut self) -> Result<[u8; N]> {
        Ok(self.take(N)?.try_into().unwrap())
    }

    fn u32(&mut self) -> Result<u32> {
        Ok(u32::from_le_bytes(self.array()?))
    }

    fn u64(&mut self) -> Result<u64> {
        Ok(u64::from_le_bytes(self.array()?))
    }

    fn len(&mut self) -> Result<usize> {
        let n = self.u64()?;
        // Every counted thing takes at least a byte, so a count past the file's end is corrupt.
        ensure!(n <= (self.bytes.len() - self.pos) as u64, "count {n} at byte {} runs past the file", self.pos - 8);
        Ok(n as usize)
    }

    fn string(&mut self) -> Result<String> {
        let n = self.len()?;
        let at = self.pos;
        String::from_utf8(self.take(n)?.to_vec()).with_context(|| format!("string at byte {at} is not UTF-8"))
    }

    fn value(&mut self, ty: u32) -> Result<MetaValue> {
        Ok(match ty {
            0 => MetaValue::UInt(self.array::<1>()?[0] as u64),
            1 => MetaValue::Int(self.array::<1>()?[0] as i8 as i64),
            2 => MetaValue::UInt(u16::from_le_bytes(self.array()?) as u64),
            3 => MetaValue::Int(i16::from_le_bytes(self.array()?) as i64),
            4 => MetaValue::UInt(self.u32()? as u64),
            5 => MetaValue::Int(i32::from_le_bytes(self.array()?) as i64),
            6 => MetaValue::Float(f32::from_le_bytes(self.array()?) as f64),
            7 => MetaValue::Bool(self.array::<1>()?[0] != 0),
            8 => MetaValue::Str(self.string()?),
            9 => {
                let elem = self.u32()?;
                let n = self.len()?;
                ensure!(elem != 9, "nested metadata arrays are not supported");
                MetaValue::Array((0..n).map(|_| self.value(elem)).collect::<Result<_>>()?)
            }
            10 => MetaValue::UInt(self.u64()?),
            11 => MetaValue::Int(i64::from_le_bytes(self.array()?)),
            12 => MetaValue::Float(f64::from_le_bytes(self.array()?)),
            _ => bail!("unknown metadata value type {ty} at byte {}", self.pos - 4),
        })
    }
}

impl<'a> Gguf<'a> {
    pub fn parse(bytes: &'a [u8]) -> Result<Gguf<'a>> {
        let mut c = Cursor { bytes, pos: 0 };
        ensure!(c.take(4).ok() == Some(b"GGUF".as_slice()), "not a GGUF file (no GGUF magic)");
        let version = c.u32()?;
        ensure!(matches!(version, 2 | 3), "GGUF version {version} is not supported (2 and 3 are)");
        let n_tensors = c.len()?;
        let n_kv = c.len()?;
        let mut metadata = Vec::with_capacity(n_kv);
        for _ in 0..n_kv {
            let key = c.string()?;
            let ty = c.u32()?;
            let value = c.value(ty).with_context(|| format!("metadata `{key}`"))?;
            metadata.push((key, value));
        }
        let mut infos = Vec::with_capacity(n_tensors);
        for _ in 0..n_tensors {
            let name = c.string()?;
            let n_dims = c.u32()? as usize;
            ensure!(n_dims <= 4, "tensor `{name}` has {n_dims} dimensions");
            let dims = (0..n_dims).map(|_| c.u64()).collect::<Result<Vec<_>>>()?;
            let ty_id = c.u32()?;
            let offset = c.u64()?;
            let ty = TensorType::from_id(ty_id).with_context(|| {
                format!("tensor `{name}` has ggml type {ty_id}, which this converter does not read")
            })?;
            infos.push((name, dims, ty, offset));
        }
        let mut gguf = Gguf { metadata, tensors: Vec::new(), bytes };
        let alignment = gguf.get("general.alignment").map_or(Some(32), MetaValue::as_u64).unwrap_or(0) as usize;
        ensure!(alignment > 0 && alignment.is_power_of_two(), "general.alignment {alignment} is not a power of two");
        let data = c.pos.div_ceil(alignment) * alignment;
        for (name, dims, ty, offset) in infos {
            let (per_block, block_bytes) = ty.block();
            let n: u64 = dims.iter().product();
            ensure!(
                dims.first().is_some_and(|&d| d % per_block as u64 == 0),
                "tensor `{name}`: row of {:?} is not whole {ty:?} blocks",
                dims.first()
            );
            let len = (n / per_block as u64) as usize * block_bytes;
            let start =
                data.checked_add(offset as usize).filter(|s| s.checked_add(len).is_some_and(|e| e <= bytes.len()));
            let start = start.with_context(|| format!("tensor `{name}` lies outside the file"))?;
            gguf.tensors.push(TensorInfo { name, dims, ty, start, len });
        }
        Ok(gguf)
    }

    pub fn get(&self, key: &str) -> Option<&MetaValue> {
        self.metadata.iter().find(|(k, _)| k == key).map(|(_, v)| v)
    }

    pub fn data(&self, t: &TensorInfo) -> &'a [u8] {
        &self.bytes[t.start..t.start + t.len]
    }

    /// The tensor as f32, in file order (as gguf-py's `dequantize`).
    pub fn dequantize(&self, t: &TensorInfo) -> Vec<f32> {
        dequantize(self.data(t), t.ty)
    }
}

fn f16_at(b: &[u8]) -> f32 {
    f16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32()
}

/// Blocks of `ty` to f32. Q8_0 is `d * q` and Q4_1 `d * q + m`, computed in f32 as gguf-py does.
pub fn dequantize(raw: &[u8], ty: TensorType) -> Vec<f32> {
    match ty {
        TensorType::F32 => raw.chunks_exact(4).map(|b| f32::from_le_bytes(b.try_into().unwrap())).collect(),
        TensorType::F16 => raw.chunks_exact(2).map(f16_at).collect(),
        TensorType::BF16 => {
            raw.chunks_exact(2).map(|b| f32::from_bits((u16::from_le_bytes([b[0], b[1]]) as u32) << 16)).collect()
        }
        TensorType::Q8_0 => raw
            .chunks_exact(34)
            .flat_map(|b| {
                let d = f16_at(b);
                b[2..].iter().map(move |&q| q as i8 as f32 * d)
            })
            .collect(),
        TensorType::Q4_1 => raw
            .chunks_exact(20)
            .flat_map(|b| {
                let (d, m) = (f16_at(b), f16_at(&b[2..]));
                let qs = &b[4..20];
                let q = qs.iter().map(|x| x & 0xF).chain(qs.iter().map(|x| x >> 4));
                q.map(move |q| q as f32 * d + m).collect::<Vec<_>>()
            })
            .collect(),
    }
}

#[cfg(test)]
pub mod tests {
    use super::*;

    /// Writes a GGUF v3 file: metadata as (key, type id, encoded value) and tensors as (name, dims,
    /// type id, data), each tensor's data padded to `alignment`.
    pub fn write_gguf(
        meta: &[(&str, u32, Vec<u8>)],
        tensors: &[(&str, &[u64], u32, Vec<u8>)],
        alignment: usize,
    ) -> Vec<u8> {
        let mut f = b"GGUF".to_vec();
        f.extend(3u32.to_le_bytes());
        f.extend((tensors.len() as u64).to_le_bytes());
        f.extend((meta.len() as u64).to_le_bytes());
        for (k, ty, v) in meta {
            f.extend(enc_str(k));
            f.extend(ty.to_le_bytes());
            f.extend(v);
        }
        let mut offset = 0usize;
        for (name, dims, ty, data) in tensors {
            f.extend(enc_str(name));
            f.extend((dims.len() as u32).to_le_bytes());
            dims.iter().for_each(|d| f.extend(d.to_le_bytes()));
            f.extend(ty.to_le_bytes());
            f.extend((offset as u64).to_le_bytes());
            offset += data.len().div_ceil(alignment) * alignment;
        }
        f.resize(f.len().div_ceil(alignment) * alignment, 0);
        for (_, _, _, data) in tensors {
            f.extend(data);
            f.resize(f.len().div_ceil(alignment) * alignment, 0);
        }
        f
    }

    pub fn enc_str(s: &str) -> Vec<u8> {
        let mut v = (s.len() as u64).to_le_bytes().to_vec();
        v.extend(s.as_bytes());
        v
    }

    pub fn enc_str_array(items: &[&str]) -> Vec<u8> {
        let mut v = 8u32.to_le_bytes().to_vec();
        v.extend((items.len() as u64).to_le_bytes());
        items.iter().for_each(|s| v.extend(enc_str(s)));
        v
    }

    #[test]
    fn parses_metadata_tensor_infos_and_alignment() {
        let mut arr = 5u32.to_le_bytes().to_vec(); // array of i32
        arr.extend(2u64.to_le_bytes());
        arr.extend((-3i32).to_le_bytes());
        arr.extend(7i32.to_le_bytes());
        for alignment in [32usize, 64] {
            let mut meta = vec![
                ("general.architecture", 8, enc_str("llama")),
                ("llama.block_count", 4, 30u32.to_le_bytes().to_vec()),
                ("llama.eps", 6, 1e-5f32.to_le_bytes().to_vec()),
                ("flag", 7, vec![1]),
                ("big", 10, u64::MAX.to_le_bytes().to_vec()),
                ("ints", 9, arr.clone()),
                ("words", 9, enc_str_array(&["a", "Ġb"])),
            ];
            if alignment != 32 {
                meta.push(("general.alignment", 4, (alignment as u32).to_le_bytes().to_vec()));
            }
            let norm: Vec<u8> = [1.0f32, -2.0, 0.5, 4.0].iter().flat_map(|x| x.to_le_bytes()).collect();
            let q8: Vec<u8> = {
                let mut b = f16::from_f32(0.25).to_bits().to_le_bytes().to_vec();
                b.extend((0..32).map(|i| (i as i8 - 16) as u8));
                b
            };
            let file = write_gguf(&meta, &[("norm", &[4], 0, norm), ("emb", &[32, 1], 8, q8)], alignment);
            let g = Gguf::parse(&file).unwrap();
            assert_eq!(g.get("general.architecture").and_then(MetaValue::as_str), Some("llama"));
            assert_eq!(g.get("llama.block_count").and_then(MetaValue::as_u64), Some(30));
            assert_eq!(g.get("llama.eps"), Some(&MetaValue::Float(1e-5f32 as f64)));
            assert_eq!(g.get("flag"), Some(&MetaValue::Bool(true)));
            assert_eq!(g.get("big"), Some(&MetaValue::UInt(u64::MAX)));
            assert_eq!(g.get("ints"), Some(&MetaValue::Array(vec![MetaValue::Int(-3), MetaValue::Int(7)])));
            let words = g.get("words").and_then(MetaValue::as_array).unwrap();
            assert_eq!(words.iter().map(|w| w.as_str().unwrap()).collect::<Vec<_>>(), ["a", "Ġb"]);
            assert_eq!(g.tensors.len(), 2);
            assert!(g.tensors.iter().all(|t| t.start % alignment == 0));
            assert_eq!(g.dequantize(&g.tensors[0]), [1.0, -2.0, 0.5, 4.0]);
            assert_eq!(g.tensors[1].dims, [32, 1]);
            assert_eq!(g.dequantize(&g.tensors[1]), (0..32).map(|i| (i - 16) as f32 * 0.25).collect::<Vec<_>>());
        }
    }

    #[test]
    fn rejects_truncated_and_foreign_files() {
        let file = write_gguf(&[("k", 8, enc_str("v"))], &[("t", &[8], 0, vec![0; 32])], 32);
        assert!(Gguf::parse(&file[..file.len() - 1]).is_err(), "tensor data cut short");
        assert!(Gguf::parse(&file[..30]).is_err(), "metadata cut short");
        assert!(Gguf::parse(b"GGML\x03\0\0\0").is_err());
        let q5 = write_gguf(&[], &[("t", &[32], 6, vec![0; 22])], 32);
        let err = Gguf::parse(&q5).err().unwrap().to_string();
        assert!(err.contains("ggml type 6"), "{err}");
    }

    #[test]
    fn q4_1_dequantizes_low_nibbles_then_high() {
        let mut b = f16::from_f32(0.5).to_bits().to_le_bytes().to_vec();
        b.extend(f16::from_f32(-1.0).to_bits().to_le_bytes());
        b.extend((0..16u8).map(|i| i | ((15 - i) << 4)));
        let want: Vec<f32> = (0..16).chain((0..16).rev()).map(|q| q as f32 * 0.5 - 1.0).collect();
        assert_eq!(dequantize(&b, TensorType::Q4_1), want);
    }
}
