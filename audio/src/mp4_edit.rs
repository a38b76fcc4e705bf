//! The edit lists of an MP4/M4A file's sound tracks: which decoded frames are the presentation. An
//! AAC encoder starts with frames of priming (1024 for ffmpeg's, 2112 for Apple's) and pads the last
//! packet; the container's `elst` says where the audio really starts and how long it runs. ffmpeg (so
//! Whisper's `load_audio`) drops the priming (it keeps the padding); symphonia reads no edit lists, so
//! they are read here, from the `moov` box, and both ends applied to the decoded frames.

use std::io::{Read, Seek, SeekFrom};

/// The frames of a sound track to keep, in its media time scale (`mdhd`'s, frames per second).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Edit {
    /// Frames to drop from the start (the encoder's priming).
    pub skip: u64,
    /// Frames to keep after them (`u64::MAX`: to the end, as in a fragmented file, whose edit gives
    /// no duration).
    pub keep: u64,
    /// Units per second of `skip` and `keep`.
    pub timescale: u32,
}

impl Edit {
    /// `frames` (decoded at `rate` Hz) cut to the edit.
    pub fn apply(&self, frames: &mut Vec<f32>, rate: u32) {
        let scale =
            |v: u64| usize::try_from(v as u128 * rate as u128 / self.timescale.max(1) as u128).unwrap_or(usize::MAX);
        let start = scale(self.skip).min(frames.len());
        let end = start.saturating_add(scale(self.keep)).min(frames.len());
        frames.truncate(end);
        frames.drain(..start);
    }
}

/// Largest `moov` box read (the metadata of hours of audio is a few MB).
const MAX_MOOV_BYTES: u64 = 64 << 20;

/// The edits of the sound tracks of the MP4 file in `r` (read from its start; the position is left
/// anywhere), by track id (`tkhd`'s, which symphonia's tracks carry). Empty for anything else than an
/// MP4, and a track is left out where its edit list does not hold one edit of the media (none, or
/// several; empty edits before it are passed over) or a box is damaged.
pub fn sound_track_edits<R: Read + Seek>(r: &mut R) -> Vec<(u32, Edit)> {
    read_moov(r).map_or_else(Vec::new, |moov| moov_edits(&moov))
}

/// The body of the `moov` box of the MP4 file in `r`.
fn read_moov<R: Read + Seek>(r: &mut R) -> Option<Vec<u8>> {
    r.seek(SeekFrom::Start(0)).ok()?;
    let mut first = true;
    loop {
        let (kind, body) = next_box_header(r)?;
        if first && &kind != b"ftyp" {
            return None;
        }
        first = false;
        if &kind == b"moov" {
            let len = body.unwrap_or(MAX_MOOV_BYTES).min(MAX_MOOV_BYTES);
            // Read as far as the file goes: a size larger than the file allocates nothing more.
            let mut moov = Vec::new();
            r.take(len).read_to_end(&mut moov).ok()?;
            return Some(moov);
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

/// The 32-bit field after a full box's creation and modification times (32- or 64-bit by version):
/// the time scale of an `mvhd` or `mdhd`, the track id of a `tkhd`.
fn field_after_times(body: &[u8]) -> Option<u32> {
    match body.first()? {
        0 => be_u32(body, 12),
        1 => be_u32(body, 20),
        _ => None,
    }
}

fn moov_edits(moov: &[u8]) -> Vec<(u32, Edit)> {
    let Some(movie_timescale) = child(moov, b"mvhd").and_then(field_after_times) else { return Vec::new() };
    boxes(moov).filter(|(k, _)| k == b"trak").filter_map(|(_, trak)| track_edit(trak, movie_timescale)).collect()
}

/// A sound track's id and its one plain edit.
fn track_edit(trak: &[u8], movie_timescale: u32) -> Option<(u32, Edit)> {
    let mdia = child(trak, b"mdia")?;
    if child(mdia, b"hdlr").and_then(|h| h.get(8..12)) != Some(&b"soun"[..]) {
        return None;
    }
    let id = field_after_times(child(trak, b"tkhd")?)?;
    let media_timescale = field_after_times(child(mdia, b"mdhd")?)?;
    let elst = child(child(trak, b"edts")?, b"elst")?;
    let (version, count) = (*elst.first()?, be_u32(elst, 4)?);
    if movie_timescale == 0 || media_timescale == 0 || count > 16 {
        return None;
    }
    let entry = |i: usize| -> Option<(u64, i64)> {
        match version {
            0 => Some((be_u32(elst, 8 + 12 * i)? as u64, be_u32(elst, 12 + 12 * i)? as i32 as i64)),
            1 => Some((be_u64(elst, 8 + 20 * i)?, be_u64(elst, 16 + 20 * i)? as i64)),
            _ => None,
        }
    };
    // Empty edits (media time -1: the track starts later than the movie, as in a video whose sound
    // begins after a delay) place the audio in time; ffmpeg's decoding of the sound alone skips them.
    // One edit of the media is applied; several are not (a cut-up presentation).
    let entries = (0..count as usize).map(entry).collect::<Option<Vec<_>>>()?;
    let mut media = entries.into_iter().filter(|&(_, time)| time != -1);
    let (Some((duration, media_time)), None) = (media.next(), media.next()) else { return None };
    let skip = u64::try_from(media_time).ok()?;
    // A fragmented file's edit has no duration (its length is not known when the `moov` is written).
    let keep = match duration {
        0 => u64::MAX,
        d => u64::try_from(d as u128 * media_timescale as u128 / movie_timescale as u128).unwrap_or(u64::MAX),
    };
    Some((id, Edit { skip, keep, timescale: media_timescale }))
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

    /// The same box with a 64-bit size (size field 1).
    fn large_box(kind: &[u8; 4], body: &[u8]) -> Vec<u8> {
        let mut b = 1u32.to_be_bytes().to_vec();
        b.extend_from_slice(kind);
        b.extend_from_slice(&((body.len() + 16) as u64).to_be_bytes());
        b.extend_from_slice(body);
        b
    }

    /// An `mvhd`/`mdhd`/`tkhd` whose field after the times is `value`, in box version `version`.
    fn header(kind: &[u8; 4], version: u8, value: u32) -> Vec<u8> {
        let times = if version == 1 { 16 } else { 8 };
        let mut body = vec![version, 0, 0, 0];
        body.extend(std::iter::repeat_n(0u8, times));
        body.extend_from_slice(&value.to_be_bytes());
        body.extend_from_slice(&[0u8; 12]);
        mp4_box(kind, &body)
    }

    fn elst(version: u8, edits: &[(u64, i64)]) -> Vec<u8> {
        let mut body = vec![version, 0, 0, 0];
        body.extend_from_slice(&(edits.len() as u32).to_be_bytes());
        for &(duration, time) in edits {
            if version == 1 {
                body.extend_from_slice(&duration.to_be_bytes());
                body.extend_from_slice(&time.to_be_bytes());
            } else {
                body.extend_from_slice(&(duration as u32).to_be_bytes());
                body.extend_from_slice(&(time as i32).to_be_bytes());
            }
            body.extend_from_slice(&0x0001_0000u32.to_be_bytes());
        }
        mp4_box(b"elst", &body)
    }

    fn trak(id: u32, handler: &[u8; 4], version: u8, edits: &[(u64, i64)]) -> Vec<u8> {
        let mut hdlr = vec![0u8; 8];
        hdlr.extend_from_slice(handler);
        hdlr.extend_from_slice(&[0u8; 12]);
        let mdia = [header(b"mdhd", version, 44100), mp4_box(b"hdlr", &hdlr)].concat();
        let body =
            [header(b"tkhd", version, id), mp4_box(b"edts", &elst(version, edits)), mp4_box(b"mdia", &mdia)].concat();
        mp4_box(b"trak", &body)
    }

    /// An MP4 with `traks`, its `moov` after the data (as ffmpeg writes it without `+faststart`).
    fn file(traks: &[Vec<u8>]) -> Vec<u8> {
        let moov = [header(b"mvhd", 0, 1000), traks.concat()].concat();
        [mp4_box(b"ftyp", b"M4A \0\0\0\0"), mp4_box(b"mdat", &[0u8; 100]), mp4_box(b"moov", &moov)].concat()
    }

    fn edits(bytes: &[u8]) -> Vec<(u32, Edit)> {
        sound_track_edits(&mut std::io::Cursor::new(bytes))
    }

    #[test]
    fn each_sound_tracks_one_edit_is_read_in_its_media_time_scale() {
        let edit = Edit { skip: 1024, keep: 44100, timescale: 44100 };
        for version in [0, 1] {
            let bytes = file(&[trak(1, b"vide", version, &[(1000, 0)]), trak(2, b"soun", version, &[(1000, 1024)])]);
            assert_eq!(edits(&bytes), [(2, edit)], "version {version}");
        }
        let mut frames: Vec<f32> = (0..50_000).map(|i| i as f32).collect();
        edit.apply(&mut frames, 44100);
        assert_eq!((frames.len(), frames[0]), (44100, 1024.0));
        // Decoded at another rate than the media time scale: scaled.
        let mut frames = vec![0.0; 50_000];
        Edit { skip: 1024, keep: 22050, timescale: 44100 }.apply(&mut frames, 22050);
        assert_eq!(frames.len(), 11025);
    }

    #[test]
    fn an_empty_edit_before_the_audio_is_passed_over() {
        // As `ffmpeg -itsoffset 0.5` writes it: 476 ms of nothing, then the media from its start.
        for version in [0, 1] {
            let bytes = file(&[trak(1, b"soun", version, &[(476, -1), (1024, 0)])]);
            assert_eq!(edits(&bytes), [(1, Edit { skip: 0, keep: 45158, timescale: 44100 })], "version {version}");
        }
    }

    #[test]
    fn a_fragmented_files_edit_keeps_everything_after_the_priming() {
        let bytes = file(&[trak(1, b"soun", 0, &[(0, 1024)])]);
        let found = edits(&bytes);
        assert_eq!(found, [(1, Edit { skip: 1024, keep: u64::MAX, timescale: 44100 })]);
        let mut frames = vec![0.0; 5000];
        found[0].1.apply(&mut frames, 44100);
        assert_eq!(frames.len(), 5000 - 1024);
    }

    #[test]
    fn a_moov_with_a_64_bit_size_is_read() {
        let moov = [header(b"mvhd", 0, 1000), trak(3, b"soun", 0, &[(500, 2112)])].concat();
        let bytes = [mp4_box(b"ftyp", b"M4A \0\0\0\0"), large_box(b"moov", &moov)].concat();
        assert_eq!(edits(&bytes), [(3, Edit { skip: 2112, keep: 22050, timescale: 44100 })]);
    }

    #[test]
    fn other_files_and_edits_are_left_alone() {
        assert!(edits(&file(&[trak(1, b"soun", 0, &[(1000, -1)])])).is_empty());
        assert!(edits(&file(&[trak(1, b"soun", 0, &[(500, 1024), (500, 9000)])])).is_empty());
        assert!(edits(b"RIFF....WAVEfmt ").is_empty());
        // A `moov` claiming more bytes than the file has reads what there is.
        let mut bytes = file(&[trak(1, b"soun", 0, &[(1000, 1024)])]);
        let at = bytes.windows(4).position(|w| w == b"moov").unwrap() - 4;
        bytes[at..at + 4].copy_from_slice(&u32::MAX.to_be_bytes());
        assert_eq!(edits(&bytes).len(), 1);
        let bytes = file(&[trak(1, b"soun", 1, &[(u64::MAX, 1024)])]);
        assert_eq!(edits(&bytes)[0].1.keep, u64::MAX);
        for cut in 0..bytes.len() {
            // A damaged or cut file gives edits or none, never a panic.
            let _ = edits(&bytes[..cut]);
        }
    }
}
