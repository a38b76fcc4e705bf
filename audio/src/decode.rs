//! Audio files to 16 kHz mono `f32`: what `whisper.audio.load_audio` gets from its ffmpeg pipe.

use std::fs::File;
use std::io::{Cursor, ErrorKind, Read, Seek, SeekFrom};
use std::path::Path;

use symphonia::core::codecs::audio::well_known::CODEC_ID_OPUS;
use symphonia::core::codecs::audio::AudioDecoderOptions;
use symphonia::core::errors::Error as SymphoniaError;
use symphonia::core::formats::probe::Hint;
use symphonia::core::formats::{FormatOptions, TrackType};
use symphonia::core::io::{MediaSource, MediaSourceStream, ReadOnlySource};
use symphonia::core::meta::MetadataOptions;

use crate::mp4_edit::{sound_track_edits, Edit};
use crate::resample::resample_to_16k;

/// Why an audio file could not be turned into samples. Every variant names the file (or upload) it is about.
#[derive(Debug, thiserror::Error)]
pub enum AudioError {
    /// The file could not be opened or read.
    /// (The reason is in the message, not also a `source`, which a chained report would print twice.)
    #[error("{name}: cannot read the file: {error}")]
    Io { name: String, error: std::io::Error },
    /// Zero bytes.
    #[error("{name}: the file is empty")]
    Empty { name: String },
    /// The bytes are not a container we can read (WAV, FLAC, MP3, Ogg, MP4/M4A, Matroska/WebM).
    #[error("{name}: not a WAV, FLAC, MP3, Ogg, MP4/M4A or WebM audio file ({reason})")]
    UnrecognisedFormat { name: String, reason: String },
    /// A known container holding something we cannot decode: a sample format, codec or layout.
    #[error("{name}: unsupported audio: {reason}")]
    Unsupported { name: String, reason: String },
    /// The file ends before the audio it announces.
    #[error("{name}: the file is truncated: {reason}")]
    Truncated { name: String, reason: String },
    /// The container or the coded audio is damaged.
    #[error("{name}: malformed audio: {reason}")]
    Malformed { name: String, reason: String },
    /// The file decodes to no audio at all (no audio track, or zero samples).
    #[error("{name}: no audio in the file ({reason})")]
    NoAudio { name: String, reason: String },
    /// The resampler refused the input (a sample rate it cannot convert from).
    #[error("{name}: cannot resample {rate} Hz to 16000 Hz: {reason}")]
    Resample { name: String, rate: u32, reason: String },
}

/// Decodes a WAV, FLAC, MP3, Ogg Vorbis, M4A/MP4 (AAC or ALAC) or Matroska/WebM (with a codec of
/// those; not Opus, which symphonia does not decode) file into 16 kHz mono samples in [-1, 1].
///
/// Channels are averaged (ffmpeg's `-ac 1` does the same for stereo), and any other sample rate is converted
/// with rubato's FFT resampler. Unlike Whisper's ffmpeg pipe the result is not rounded to 16 bits.
///
/// Damaged packets inside a stream are skipped, as ffmpeg skips them. A file shorter than the length its
/// header declares (WAV, FLAC, MP3 with a Xing/LAME header) is [`AudioError::Truncated`]; where the
/// container declares no length (a streamed WAV, Ogg), what decodes is returned. Input never panics: a panic
/// inside a decoder becomes [`AudioError::Malformed`].
///
/// `-` is standard input; it, and any other file that is not a regular one (a pipe, `/dev/stdin`), is
/// read whole first, its length being unknown ahead.
pub fn load_audio(path: &Path) -> Result<Vec<f32>, AudioError> {
    let name = path.display().to_string();
    let io_error = |error| AudioError::Io { name: name.clone(), error };
    if path == Path::new("-") {
        let mut bytes = Vec::new();
        std::io::stdin().lock().read_to_end(&mut bytes).map_err(io_error)?;
        return decode_audio_bytes(&bytes, "<stdin>");
    }
    let mut file = File::open(path).map_err(io_error)?;
    let meta = file.metadata().map_err(io_error)?;
    if meta.is_dir() {
        return Err(io_error(std::io::Error::new(ErrorKind::IsADirectory, "a directory, not an audio file")));
    }
    if !meta.is_file() {
        let mut bytes = Vec::new();
        file.read_to_end(&mut bytes).map_err(io_error)?;
        return decode_audio_bytes(&bytes, &name);
    }
    if meta.len() == 0 {
        return Err(AudioError::Empty { name });
    }
    // A WAV with a recorder's placeholder sizes is read whole, to be given its real ones.
    let mut bytes = Vec::new();
    (&mut file).take(4096).read_to_end(&mut bytes).map_err(io_error)?;
    if with_streamed_wav_sizes(&bytes).is_some() {
        file.read_to_end(&mut bytes).map_err(io_error)?;
        return decode_audio_bytes(&bytes, &name);
    }
    let edits = if is_mp4(&bytes) { sound_track_edits(&mut file) } else { Vec::new() };
    file.seek(SeekFrom::Start(0)).map_err(io_error)?;
    let extension = path.extension().and_then(|e| e.to_str());
    let source: Box<dyn MediaSource> =
        if is_uncounted_stream(&bytes) { Box::new(ReadOnlySource::new(file)) } else { Box::new(file) };
    guarded(&name, || decode_source(source, extension, &edits, &name))
}

/// Decodes an audio file held in memory (an HTTP upload) like [`load_audio`].
///
/// `name_hint` is the upload's file name or bare extension (`"clip.mp3"`, `"mp3"`); it only guides the format
/// probe, which looks at the bytes, and names the upload in errors.
pub fn decode_audio_bytes(bytes: &[u8], name_hint: &str) -> Result<Vec<f32>, AudioError> {
    let name = if name_hint.is_empty() { "<upload>" } else { name_hint }.to_string();
    if bytes.is_empty() {
        return Err(AudioError::Empty { name });
    }
    let extension = match Path::new(name_hint).extension() {
        Some(extension) => extension.to_str(),
        None if !name_hint.is_empty() => Some(name_hint),
        None => None,
    };
    if let Some(fixed) = with_streamed_wav_sizes(bytes) {
        return guarded(&name, || decode_source(Box::new(Cursor::new(&fixed[..])), extension, &[], &name));
    }
    let edits = if is_mp4(bytes) { sound_track_edits(&mut Cursor::new(bytes)) } else { Vec::new() };
    let source: Box<dyn MediaSource> = match is_uncounted_stream(bytes) {
        true => Box::new(ReadOnlySource::new(Cursor::new(bytes))),
        false => Box::new(Cursor::new(bytes)),
    };
    guarded(&name, || decode_source(source, extension, &edits, &name))
}

/// Whether `head` starts raw MPEG audio (an ID3 tag or a frame's sync word) or ADTS AAC: streams with
/// no frame count but a Xing/VBRI header's. Read from a seekable source, symphonia estimates their
/// length from the first frames' bitrate and then cuts the audio at the estimate (a VBR MP3 without a
/// Xing header lost its last 10 s of 96) or finds it "truncated" against it; read as a stream, they
/// decode to the end of their data, as ffmpeg decodes them.
fn is_uncounted_stream(head: &[u8]) -> bool {
    head.starts_with(b"ID3") || (head.len() >= 2 && head[0] == 0xFF && head[1] & 0xE0 == 0xE0)
}

/// Whether `head` (a file's first bytes) starts an MP4 (M4A) file: an `ftyp` box first.
fn is_mp4(head: &[u8]) -> bool {
    head.get(4..8) == Some(&b"ftyp"[..])
}

/// A copy of a WAV whose RIFF or `data` size is a recorder's placeholder (0 or `0xFFFFFFFF`: written
/// before the length was known, as streaming recorders and `ffmpeg` to a pipe leave it), with the
/// sizes the bytes give; None for anything else. A size that is merely larger than the file stays (a
/// truncated file is reported as one).
fn with_streamed_wav_sizes(bytes: &[u8]) -> Option<Vec<u8>> {
    const PLACEHOLDERS: [u32; 2] = [0, u32::MAX];
    if bytes.len() < 12 || &bytes[..4] != b"RIFF" || &bytes[8..12] != b"WAVE" {
        return None;
    }
    let size_at = |at: usize| u32::from_le_bytes(bytes[at..at + 4].try_into().unwrap());
    let mut fixed: Option<Vec<u8>> = None;
    let set = |fixed: &mut Option<Vec<u8>>, at: usize, v: u32| {
        fixed.get_or_insert_with(|| bytes.to_vec())[at..at + 4].copy_from_slice(&v.to_le_bytes())
    };
    if PLACEHOLDERS.contains(&size_at(4)) {
        set(&mut fixed, 4, u32::try_from(bytes.len() - 8).unwrap_or(u32::MAX));
    }
    // The chunks up to `data`, whose size is the rest of the file where it is a placeholder. A size
    // of 0 with another chunk after it is a data chunk that is really empty.
    let mut at = 12usize;
    while at + 8 <= bytes.len() {
        let size = size_at(at + 4);
        if &bytes[at..at + 4] == b"data" {
            let chunk_follows =
                bytes.get(at + 8..at + 12).is_some_and(|id| id.iter().all(|b| b.is_ascii_alphanumeric() || *b == b' '));
            if size == u32::MAX || (size == 0 && !chunk_follows) {
                set(&mut fixed, at + 4, u32::try_from(bytes.len() - at - 8).unwrap_or(u32::MAX));
            }
            break;
        }
        let Some(next) = at.checked_add(8 + size as usize % 2).and_then(|a| a.checked_add(size as usize)) else {
            break;
        };
        at = next;
    }
    fixed
}

/// Runs a decode, turning a panic inside a third-party decoder (on hostile input) into an error: a server
/// thread must not die on an upload.
fn guarded(name: &str, decode: impl FnOnce() -> Result<Vec<f32>, AudioError>) -> Result<Vec<f32>, AudioError> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(decode)).unwrap_or_else(|panic| {
        let message = panic
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| panic.downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "unknown panic".to_string());
        Err(AudioError::Malformed { name: name.to_string(), reason: format!("the decoder failed: {message}") })
    })
}

/// Decodes `source`; an MP4's `edits` (by track id, read beforehand: symphonia reads no edit lists)
/// cut the decoded track's frames to its presentation.
fn decode_source(
    source: Box<dyn MediaSource + '_>,
    extension: Option<&str>,
    edits: &[(u32, Edit)],
    name: &str,
) -> Result<Vec<f32>, AudioError> {
    let stream = MediaSourceStream::new(source, Default::default());
    let mut hint = Hint::new();
    if let Some(extension) = extension {
        hint.with_extension(&extension.to_ascii_lowercase());
    }
    let mut format = symphonia::default::get_probe()
        .probe(&hint, stream, FormatOptions::default(), MetadataOptions::default())
        .map_err(|e| match e {
            SymphoniaError::Unsupported(reason) if reason.contains("no suitable format reader") => {
                AudioError::UnrecognisedFormat { name: name.to_string(), reason: reason.to_string() }
            }
            e => classify(name, e),
        })?;

    let track = format
        .default_track(TrackType::Audio)
        .ok_or_else(|| AudioError::NoAudio { name: name.to_string(), reason: "no audio track".to_string() })?;
    let track_id = track.id;
    let declared_frames = track.num_frames;
    let params = track
        .codec_params
        .as_ref()
        .and_then(|p| p.audio())
        .ok_or_else(|| AudioError::NoAudio { name: name.to_string(), reason: "the track is not audio".to_string() })?;
    let mut decoder = symphonia::default::get_codecs()
        .make_audio_decoder(params, &AudioDecoderOptions::default())
        .map_err(|e| match e {
            // The codec of most WebM and Ogg voice recordings: name it, as symphonia's message does not.
            SymphoniaError::Unsupported(_) if params.codec == CODEC_ID_OPUS => AudioError::Unsupported {
                name: name.to_string(),
                reason: "Opus audio cannot be decoded (send WAV, FLAC, MP3, Ogg Vorbis or AAC/ALAC in M4A)".to_string(),
            },
            e => classify(name, e),
        })?;

    let mut mono = Vec::new();
    let mut interleaved: Vec<f32> = Vec::new();
    let mut rate = None;
    let mut decoded_frames = 0u64;
    let mut bad_packets = 0usize;
    let mut first_bad_packet = None;
    let mut ended_early = false;
    loop {
        let packet = match format.next_packet() {
            Ok(Some(packet)) => packet,
            Ok(None) => break,
            Err(SymphoniaError::IoError(e)) if e.kind() == ErrorKind::UnexpectedEof => {
                ended_early = true;
                break;
            }
            Err(SymphoniaError::ResetRequired) => {
                return Err(AudioError::Unsupported {
                    name: name.to_string(),
                    reason: "chained streams (the track list changes within the file)".to_string(),
                })
            }
            Err(e) => return Err(classify(name, e)),
        };
        if packet.track_id != track_id {
            continue;
        }
        let buffer = match decoder.decode(&packet) {
            Ok(buffer) => buffer,
            // A damaged packet is skipped, as ffmpeg does; a file of nothing but damage is an error below.
            Err(SymphoniaError::DecodeError(reason)) => {
                bad_packets += 1;
                first_bad_packet.get_or_insert(reason);
                continue;
            }
            Err(SymphoniaError::IoError(e)) if e.kind() == ErrorKind::UnexpectedEof => {
                ended_early = true;
                break;
            }
            Err(e) => return Err(classify(name, e)),
        };
        let spec = buffer.spec();
        let packet_rate = spec.rate();
        if *rate.get_or_insert(packet_rate) != packet_rate {
            return Err(AudioError::Unsupported {
                name: name.to_string(),
                reason: format!(
                    "the sample rate changes within the file ({} Hz, then {packet_rate} Hz)",
                    rate.unwrap()
                ),
            });
        }
        let channels = spec.channels().count().max(1);
        buffer.copy_to_vec_interleaved(&mut interleaved);
        decoded_frames += buffer.frames() as u64;
        mix_down(&interleaved, channels, &mut mono);
    }

    if let Some(declared) = declared_frames.filter(|&declared| decoded_frames < declared) {
        return Err(AudioError::Truncated {
            name: name.to_string(),
            reason: format!("the header announces {declared} sample frames, the data holds {decoded_frames}"),
        });
    }
    if ended_early && mono.is_empty() {
        return Err(AudioError::Truncated { name: name.to_string(), reason: "the data ends early".to_string() });
    }
    if mono.is_empty() {
        return Err(match first_bad_packet {
            Some(reason) => AudioError::Malformed {
                name: name.to_string(),
                reason: format!("none of {bad_packets} packets decodes: {reason}"),
            },
            None => AudioError::NoAudio { name: name.to_string(), reason: "zero samples".to_string() },
        });
    }
    let rate = rate.unwrap_or(crate::SAMPLE_RATE);
    if let Some((_, edit)) = edits.iter().find(|(id, _)| *id == track_id) {
        edit.apply(&mut mono, rate);
        if mono.is_empty() {
            return Err(AudioError::NoAudio {
                name: name.to_string(),
                reason: "the edit list keeps no samples".to_string(),
            });
        }
    }
    resample_to_16k(&mono, rate).map_err(|reason| AudioError::Resample { name: name.to_string(), rate, reason })
}

/// Averages the channels of interleaved frames onto `mono`.
fn mix_down(interleaved: &[f32], channels: usize, mono: &mut Vec<f32>) {
    if channels == 1 {
        mono.extend_from_slice(interleaved);
        return;
    }
    let scale = 1.0 / channels as f32;
    mono.extend(interleaved.chunks_exact(channels).map(|frame| frame.iter().sum::<f32>() * scale));
}

/// Sorts symphonia's errors into ours.
fn classify(name: &str, error: SymphoniaError) -> AudioError {
    let name = name.to_string();
    match error {
        SymphoniaError::IoError(e) if e.kind() == ErrorKind::UnexpectedEof => {
            AudioError::Truncated { name, reason: "the file ends inside its header or data".to_string() }
        }
        SymphoniaError::IoError(error) => AudioError::Io { name, error },
        SymphoniaError::Unsupported(reason) => AudioError::Unsupported { name, reason: reason.to_string() },
        SymphoniaError::DecodeError(reason) => AudioError::Malformed { name, reason: reason.to_string() },
        SymphoniaError::LimitError(reason) => {
            AudioError::Malformed { name, reason: format!("limit reached: {reason}") }
        }
        e => AudioError::Malformed { name, reason: e.to_string() },
    }
}
