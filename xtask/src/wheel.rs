//! One member of a zip archive (a Python wheel), read without unpacking the rest: stored or deflated,
//! length and CRC-32 checked. Wheels this size need no Zip64, so a Zip64 archive is refused by name.

use std::io::{Read, Seek, SeekFrom};
use std::path::Path;

use anyhow::{bail, ensure, Context, Result};

fn u16_at(b: &[u8], at: usize) -> u16 {
    u16::from_le_bytes([b[at], b[at + 1]])
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().unwrap())
}

/// The bytes of `member` (a path inside the archive, `/`-separated) in the zip file `archive`.
pub fn read_member(archive: &Path, member: &str) -> Result<Vec<u8>> {
    let mut f = std::fs::File::open(archive).with_context(|| format!("opening {}", archive.display()))?;
    read_member_from(&mut f, member).with_context(|| format!("reading `{member}` from {}", archive.display()))
}

pub fn read_member_from<R: Read + Seek>(f: &mut R, member: &str) -> Result<Vec<u8>> {
    let len = f.seek(SeekFrom::End(0))?;
    // The end-of-central-directory record: 22 bytes plus a comment of up to 64 KiB, at the very end.
    let tail_len = len.min(22 + 0xFFFF);
    f.seek(SeekFrom::Start(len - tail_len))?;
    let mut tail = vec![0u8; tail_len as usize];
    f.read_exact(&mut tail)?;
    let eocd = (0..tail.len().saturating_sub(21))
        .rev()
        .find(|&i| tail[i..i + 4] == [0x50, 0x4b, 0x05, 0x06])
        .context("not a zip archive (no end-of-central-directory record)")?;
    let entries = u16_at(&tail, eocd + 10);
    let (cd_size, cd_offset) = (u32_at(&tail, eocd + 12), u32_at(&tail, eocd + 16));
    ensure!(entries != 0xFFFF && cd_offset != u32::MAX, "Zip64 archives are not supported");
    ensure!(cd_offset as u64 + cd_size as u64 <= len, "the central directory lies outside the file");
    f.seek(SeekFrom::Start(cd_offset as u64))?;
    let mut cd = vec![0u8; cd_size as usize];
    f.read_exact(&mut cd)?;

    let mut at = 0usize;
    let mut names = Vec::new();
    for _ in 0..entries {
        ensure!(at + 46 <= cd.len() && u32_at(&cd, at) == 0x0201_4b50, "damaged central directory");
        let (flags, method, crc) = (u16_at(&cd, at + 8), u16_at(&cd, at + 10), u32_at(&cd, at + 16));
        let (packed, size) = (u32_at(&cd, at + 20), u32_at(&cd, at + 24));
        let name_len = u16_at(&cd, at + 28) as usize;
        let skip = name_len + u16_at(&cd, at + 30) as usize + u16_at(&cd, at + 32) as usize;
        let local = u32_at(&cd, at + 42);
        ensure!(at + 46 + name_len <= cd.len(), "damaged central directory");
        let name = String::from_utf8_lossy(&cd[at + 46..at + 46 + name_len]).into_owned();
        at += 46 + skip;
        if name != member {
            names.push(name);
            continue;
        }
        ensure!(flags & 1 == 0, "the member is encrypted");
        ensure!(packed != u32::MAX && size != u32::MAX && local != u32::MAX, "Zip64 members are not supported");
        let mut header = [0u8; 30];
        f.seek(SeekFrom::Start(local as u64))?;
        f.read_exact(&mut header)?;
        ensure!(u32_at(&header, 0) == 0x0403_4b50, "damaged local header");
        let data_at = local as u64 + 30 + u16_at(&header, 26) as u64 + u16_at(&header, 28) as u64;
        ensure!(data_at + packed as u64 <= len, "the member's data lies outside the file");
        f.seek(SeekFrom::Start(data_at))?;
        let raw = f.by_ref().take(packed as u64);
        let mut out = Vec::with_capacity(size as usize);
        match method {
            0 => raw.take(size as u64).read_to_end(&mut out)?,
            8 => flate2::read::DeflateDecoder::new(raw).take(size as u64 + 1).read_to_end(&mut out)?,
            m => bail!("compression method {m} is not supported (stored and deflate are)"),
        };
        ensure!(out.len() == size as usize, "unpacked {} bytes, the directory says {size}", out.len());
        let mut sum = flate2::Crc::new();
        sum.update(&out);
        ensure!(sum.sum() == crc, "CRC-32 mismatch: the archive is damaged");
        return Ok(out);
    }
    bail!("no such member; the archive holds: {}", names.join(", "))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Cursor, Write};

    /// A zip with the given members, each stored (method 0) or deflated (method 8).
    fn zip(members: &[(&str, &[u8], u16)]) -> Vec<u8> {
        let (mut out, mut cd) = (Vec::new(), Vec::new());
        for &(name, data, method) in members {
            let packed = match method {
                0 => data.to_vec(),
                _ => {
                    let mut e = flate2::write::DeflateEncoder::new(Vec::new(), flate2::Compression::default());
                    e.write_all(data).unwrap();
                    e.finish().unwrap()
                }
            };
            let mut crc = flate2::Crc::new();
            crc.update(data);
            let common = |v: &mut Vec<u8>| {
                v.extend(0u16.to_le_bytes()); // flags
                v.extend(method.to_le_bytes());
                v.extend([0u8; 4]); // time, date
                v.extend(crc.sum().to_le_bytes());
                v.extend((packed.len() as u32).to_le_bytes());
                v.extend((data.len() as u32).to_le_bytes());
                v.extend((name.len() as u16).to_le_bytes());
                v.extend(0u16.to_le_bytes()); // extra
            };
            let local = out.len() as u32;
            out.extend(0x0403_4b50u32.to_le_bytes());
            out.extend(20u16.to_le_bytes());
            common(&mut out);
            out.extend(name.as_bytes());
            out.extend(&packed);
            cd.extend(0x0201_4b50u32.to_le_bytes());
            cd.extend([20, 0, 20, 0]);
            common(&mut cd);
            cd.extend([0u8; 6]); // comment length, disk, internal attributes
            cd.extend(0u32.to_le_bytes()); // external attributes
            cd.extend(local.to_le_bytes());
            cd.extend(name.as_bytes());
        }
        let cd_offset = out.len() as u32;
        out.extend(&cd);
        out.extend(0x0605_4b50u32.to_le_bytes());
        out.extend([0u8; 4]);
        out.extend((members.len() as u16).to_le_bytes());
        out.extend((members.len() as u16).to_le_bytes());
        out.extend((cd.len() as u32).to_le_bytes());
        out.extend(cd_offset.to_le_bytes());
        out.extend(0u16.to_le_bytes());
        out
    }

    #[test]
    fn reads_stored_and_deflated_members() {
        let big: Vec<u8> = (0..100_000u32).map(|i| (i % 251) as u8).collect();
        let z = zip(&[("pkg/__init__.py", b"x = 1\n", 0), ("pkg/model.gguf", &big, 8)]);
        assert_eq!(read_member_from(&mut Cursor::new(&z), "pkg/__init__.py").unwrap(), b"x = 1\n");
        assert_eq!(read_member_from(&mut Cursor::new(&z), "pkg/model.gguf").unwrap(), big);
        let err = read_member_from(&mut Cursor::new(&z), "pkg/other").unwrap_err().to_string();
        assert!(err.contains("pkg/__init__.py, pkg/model.gguf"), "{err}");
    }

    #[test]
    fn a_damaged_member_fails_its_crc() {
        let mut z = zip(&[("a.bin", b"0123456789abcdef", 0)]);
        z[30 + 5 + 3] ^= 1; // a byte of the stored data, after the 30-byte header and the name
        let err = read_member_from(&mut Cursor::new(&z), "a.bin").unwrap_err().to_string();
        assert!(err.contains("CRC-32"), "{err}");
        assert!(read_member_from(&mut Cursor::new(b"not a zip at all, just text".to_vec()), "a").is_err());
    }
}
