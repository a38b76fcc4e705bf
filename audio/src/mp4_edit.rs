//! The edit list of an MP4/M4A file's sound track: which decoded frames are the presentation. An AAC
//! encoder starts with frames of priming (1024 for ffmpeg's, 2112 for Apple's) and pads the last
//! packet; the container's `elst` says where the audio really starts and how long it runs, and
//! ffmpeg (so Whisper's `load_audio`) plays only that. symphonia reads no edit lists, so they are read
//! here, from the `moov` box, and applied to the decoded frames.

use std::io::{Read, Seek, SeekFrom};

/// The frames of a sound track to keep, in its media time scale (`mdhd`'s, frames per second).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Edit {
    /// Frames to drop from the start (the encoder's priming).
    pub skip: u64,
    /// Frames to keep after them.
    pub keep: u64,
    /// Units per second of `skip` and `keep`.
    pub timescale: u32,
}

impl Edit {
    /// `frames` (decoded at `rate` Hz) cut to the edit.
    pub fn apply(&self, frames: &mut Vec<f32>, rate: u32) {
        let scale = |v: u64| (v as u128 * rate as u128 / self.timescale.max(1) as u128) as usize;
        let start = scale(self.skip).min(frames.len());
        let end = start.saturating_add(scale(self.keep)).min(frames.len());
        frames.truncate(end);
        frames.drain(..start);
    }
}

/// Largest `moov` box read (the metadata of hours of audio is a few MB).
const MAX_MOOV_BYTES: u64 = 64 << 20;

/// The edit of the first sound track of the MP4 file in `r` (read from its start; the position is
/// left anywhere), if the file is an MP4 whose track has one plain edit. None for anything else: no
/// `ftyp`, no edit list, an empty edit before the audio, several edits, or a damaged box.
pub fn sound_track_edit<R: Read + Seek>(r: &mut R) -> Option<Edit> {
    r.seek(SeekFrom::Start(0)).ok()?;
    let mut first = true;
    loop {
        let (kind, body) = next_box_header(r)?;
        if first && &kind != b"ftyp" {
            return None;
        }
        first = false;
        if &kind == b"moov" {
            let len = body?;
            if len > MAX_MOOV_BYTES {
                return None;
            }
            let mut moov = vec![0; len as usize];
            r.read_exact(&mut moov).ok()?;
            return moov_edit(&moov);
        }
        // A box running to the end of the file (`body` None) is the last one.
        r.seek(SeekFrom::Current(i64::try_from(body?).ok()?)).ok()?;
    }
}

/// The next box's type and body length (None: it runs to the end of the file) from a reader.
fn next_box_header<R: Read>(r: &mut R) -> Option<([u8; 4], Option<u64>)> {
    let mut head = [0u8; 8];
    r.read_exact(&mut head).ok()?;
    let size = u32::from_be_bytes(head[..4].try_into().unwrap()) as u64;
    let kind: [u8; 4] = head[4..].try_into().unwrap();
    let body = match size {
        0 => None,
        1 => {
            let mut large = [0u8; 8];
            r.read_exact(&mut large).ok()?;
            Some(u64::from_be_bytes(large).checked_sub(16)?)
        }
        size => Some(size.checked_sub(8)?),
    };
    Some((kind, body))
}

/// The boxes directly inside `bytes`: (type, body).
fn boxes(mut bytes: &[u8]) -> impl Iterator<Item = ([u8; 4], &[u8])> {
    std::iter::from_fn(move || {
        let mut r = bytes;
        let (kind, body) = next_box_header(&mut r)?;
        let body_len = body.map_or(r.len(), |b| b as usize);
        let body = r.get(..body_len)?;
        bytes = &r[body_len..];
        Some((kind, body))
    })
}

fn child<'a>(bytes: &'a [u8], kind: &[u8; 4]) -> Option<&'a [u8]> {
    boxes(bytes).find(|(k, _)| k == kind).map(|(_, b)| b)
}

fn be_u32(b: &[u8], at: usize) -> Option<u32> {
    Some(u32::from_be_bytes(b.get(at..at + 4)?.try_into().unwrap()))
}

fn be_u64(b: &[u8], at: usize) -> Option<u64> {
    Some(u64::from_be_bytes(b.get(at..at + 8)?.try_into().unwrap()))
}

/// The time scale of an `mvhd` or `mdhd` body (both lay it out the same way).
fn header_timescale(body: &[u8]) -> Option<u32> {
    match body.first()? {
        0 => be_u32(body, 12),
        1 => be_u32(body, 20),
        _ => None,
    }
}

fn moov_edit(moov: &[u8]) -> Option<Edit> {
    let movie_timescale = header_timescale(child(moov, b"mvhd")?)?;
    let sound = boxes(moov).filter(|(k, _)| k == b"trak").map(|(_, t)| t).find(|trak| {
        child(trak, b"mdia").and_then(|m| child(m, b"hdlr")).and_then(|h| h.get(8..12)) == Some(&b"soun"[..])
    })?;
    let media_timescale = header_timescale(child(child(sound, b"mdia")?, b"mdhd")?)?;
    let elst = child(child(sound, b"edts")?, b"elst")?;
    let (version, count) = (*elst.first()?, be_u32(elst, 4)?);
    if count != 1 || movie_timescale == 0 || media_timescale == 0 {
        return None;
    }
    let (duration, media_time) = match version {
        0 => (be_u32(elst, 8)? as u64, be_u32(elst, 12)? as i32 as i64),
        1 => (be_u64(elst, 8)?, be_u64(elst, 16)? as i64),
        _ => return None,
    };
    // -1: an empty edit (silence before the track), which ffmpeg plays; not a trim.
    let skip = u64::try_from(media_time).ok()?;
    let keep = (duration as u128 * media_timescale as u128 / movie_timescale as u128) as u64;
    Some(Edit { skip, keep, timescale: media_timescale })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A box of `kind` around `body`.
    fn mp4_box(kind: &[u8; 4], body: &[u8]) -> Vec<u8> {
        let mut b = ((body.len() + 8) as u32).to_be_bytes().to_vec();
        b.extend_from_slice(kind);
        b.extend_from_slice(body);
        b
    }

    /// `mvhd`/`mdhd` version 0 with a time scale.
    fn header(kind: &[u8; 4], timescale: u32) -> Vec<u8> {
        let mut body = vec![0u8; 12];
        body.extend_from_slice(&timescale.to_be_bytes());
        body.extend_from_slice(&[0u8; 8]);
        mp4_box(kind, &body)
    }

    fn file(handler: &[u8; 4], edits: &[(u32, i32)]) -> Vec<u8> {
        let mut hdlr = vec![0u8; 8];
        hdlr.extend_from_slice(handler);
        hdlr.extend_from_slice(&[0u8; 12]);
        let mdia = [header(b"mdhd", 44100), mp4_box(b"hdlr", &hdlr)].concat();
        let mut elst = vec![0u8; 4];
        elst.extend_from_slice(&(edits.len() as u32).to_be_bytes());
        for &(duration, time) in edits {
            elst.extend_from_slice(&duration.to_be_bytes());
            elst.extend_from_slice(&time.to_be_bytes());
            elst.extend_from_slice(&0x0001_0000u32.to_be_bytes());
        }
        let trak = [mp4_box(b"edts", &mp4_box(b"elst", &elst)), mp4_box(b"mdia", &mdia)].concat();
        let moov = [header(b"mvhd", 1000), mp4_box(b"trak", &trak)].concat();
        [mp4_box(b"ftyp", b"M4A \0\0\0\0"), mp4_box(b"mdat", &[0u8; 100]), mp4_box(b"moov", &moov)].concat()
    }

    #[test]
    fn one_edit_of_a_sound_track_is_read_in_its_media_time_scale() {
        let bytes = file(b"soun", &[(1000, 1024)]);
        let edit = sound_track_edit(&mut std::io::Cursor::new(&bytes));
        assert_eq!(edit, Some(Edit { skip: 1024, keep: 44100, timescale: 44100 }));
        let mut frames: Vec<f32> = (0..50_000).map(|i| i as f32).collect();
        edit.unwrap().apply(&mut frames, 44100);
        assert_eq!((frames.len(), frames[0]), (44100, 1024.0));
    }

    #[test]
    fn other_files_and_edits_are_left_alone() {
        assert_eq!(sound_track_edit(&mut std::io::Cursor::new(file(b"vide", &[(1000, 1024)]))), None);
        assert_eq!(sound_track_edit(&mut std::io::Cursor::new(file(b"soun", &[(10, -1), (990, 0)]))), None);
        assert_eq!(sound_track_edit(&mut std::io::Cursor::new(file(b"soun", &[(1000, -1)]))), None);
        assert_eq!(sound_track_edit(&mut std::io::Cursor::new(b"RIFF....WAVE".to_vec())), None);
        let bytes = file(b"soun", &[(1000, 1024)]);
        for cut in 0..bytes.len() {
            // A damaged or cut file gives None or an edit, never a panic.
            let _ = sound_track_edit(&mut std::io::Cursor::new(&bytes[..cut]));
        }
    }
}
