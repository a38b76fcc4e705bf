//! Decoding to 16 kHz mono: the clips in `fixtures/` (made by `fixtures/make_clips.sh` from the shared
//! speech WAV) against their 16 kHz mono WAV source, and damaged or foreign input, which must give a typed
//! error that names the file, never a panic.

mod common;

use std::path::Path;

use common::{fixture, speech_wav};
use mlxcel_audio::{decode_audio_bytes, load_audio, AudioError};

/// The 16-bit samples of a canonical 44-byte-header mono WAV, scaled as Whisper's `load_audio` does.
fn wav_pcm16(path: &Path) -> Vec<f32> {
    let bytes = std::fs::read(path).unwrap();
    assert_eq!(&bytes[36..40], b"data", "{}: expected a 44-byte header", path.display());
    bytes[44..].chunks_exact(2).map(|b| i16::from_le_bytes([b[0], b[1]]) as f32 / 32768.0).collect()
}

fn source_clip() -> Vec<f32> {
    wav_pcm16(&fixture("speech_16k_mono.wav"))
}

/// What the stereo clips hold, down-mixed: 0.75 x the source's first second.
fn stereo_clip_mixed_down() -> Vec<f32> {
    source_clip()[..16000].iter().map(|x| 0.75 * x).collect()
}

fn rms(x: &[f32]) -> f32 {
    (x.iter().map(|v| v * v).sum::<f32>() / x.len() as f32).sqrt()
}

/// The lag (in samples, within `max_lag`) at which `decoded` best matches `reference`, and the normalised
/// correlation there.
fn best_alignment(decoded: &[f32], reference: &[f32], max_lag: isize) -> (isize, f32) {
    let mut best = (0, f32::NEG_INFINITY);
    for lag in -max_lag..=max_lag {
        let (mut dot, mut ee, mut rr) = (0.0f64, 0.0f64, 0.0f64);
        for (i, &r) in reference.iter().enumerate() {
            let j = i as isize + lag;
            if j < 0 || j >= decoded.len() as isize {
                continue;
            }
            let e = decoded[j as usize] as f64;
            dot += e * r as f64;
            ee += e * e;
            rr += r as f64 * r as f64;
        }
        let corr = (dot / (ee.sqrt() * rr.sqrt()).max(1e-30)) as f32;
        if corr > best.1 {
            best = (lag, corr);
        }
    }
    best
}

#[test]
fn speech_wav_decodes_to_its_111118_samples_unchanged() {
    let Some(path) = speech_wav() else { return };
    let samples = load_audio(&path).unwrap();
    assert_eq!(samples.len(), 111118);
    assert_eq!(samples, wav_pcm16(&path));
}

#[test]
fn wav_clip_decodes_to_24000_samples() {
    let samples = load_audio(&fixture("speech_16k_mono.wav")).unwrap();
    assert_eq!(samples, source_clip());
    assert_eq!(samples.len(), 24000);
}

#[test]
fn flac_16k_mono_decodes_to_exactly_the_wav_samples() {
    assert_eq!(load_audio(&fixture("speech_16k_mono.flac")).unwrap(), source_clip());
}

#[test]
fn flac_44k_stereo_is_mixed_down_and_resampled_back_to_the_source() {
    // Left = x, right = x / 2 at 44.1 kHz: mono at 16 kHz must be 0.75 x, sample for sample.
    let decoded = load_audio(&fixture("speech_44k_stereo.flac")).unwrap();
    let expected = stereo_clip_mixed_down();
    assert_eq!(decoded.len(), expected.len());
    let error: Vec<f32> = decoded.iter().zip(&expected).map(|(a, b)| a - b).collect();
    let relative = rms(&error) / rms(&expected);
    eprintln!("44.1 kHz stereo FLAC: relative rms error {relative:e}");
    assert!(relative < 0.02, "relative rms error {relative}");
    assert_eq!(best_alignment(&decoded, &expected, 20).0, 0);
}

fn assert_lossy_clip_matches_source(name: &str) {
    let decoded = load_audio(&fixture(name)).unwrap();
    let expected = stereo_clip_mixed_down();
    let (lag, corr) = best_alignment(&decoded, &expected, 800);
    eprintln!(
        "{name}: {} samples, best lag {lag}, correlation {corr}, level {}",
        decoded.len(),
        rms(&decoded) / rms(&expected)
    );
    assert!((decoded.len() as isize - 16000).abs() <= 160, "{name}: {} samples", decoded.len());
    assert!(lag.abs() <= 16, "{name}: lag {lag}");
    assert!(corr > 0.98, "{name}: correlation {corr}");
    let level = rms(&decoded) / rms(&expected);
    assert!((0.9..1.1).contains(&level), "{name}: level {level}");
}

#[test]
fn mp3_44k_stereo_decodes_to_the_source_speech() {
    assert_lossy_clip_matches_source("speech_44k_stereo.mp3");
}

#[test]
fn ogg_vorbis_48k_stereo_decodes_to_the_source_speech() {
    assert_lossy_clip_matches_source("speech_48k_stereo.ogg");
}

/// Whisper's `load_audio` (ffmpeg's decoder, down-mix and resampler, rounded to 16 bits) on the same clip.
fn assert_clip_matches_ffmpeg(name: &str, ffmpeg_wav: &str) {
    let decoded = load_audio(&fixture(name)).unwrap();
    let whisper = wav_pcm16(&fixture(ffmpeg_wav));
    assert_eq!(decoded.len(), whisper.len(), "{name}");
    let error: Vec<f32> = decoded.iter().zip(&whisper).map(|(a, b)| a - b).collect();
    let relative = rms(&error) / rms(&whisper);
    eprintln!("{name}: relative rms difference from ffmpeg's decoding {relative:e}");
    assert!(relative < 0.03, "{name}: relative rms difference {relative}");
}

/// AAC in M4A (ffmpeg's encoder at 96 kb/s): the container's edit list drops the encoder's 1024
/// frames of priming and the last packet's padding, so the clip is its one second, aligned with the
/// source; and it decodes as ffmpeg decodes it (whose `-ac 1 -ar 16000` keeps the padding: 347
/// samples more at the end, which are left out of the comparison).
#[test]
fn aac_in_m4a_decodes_to_its_edited_second_as_ffmpeg_does() {
    let decoded = load_audio(&fixture("speech_44k_stereo.m4a")).unwrap();
    assert_eq!(decoded.len(), 16000);
    let (lag, corr) = best_alignment(&decoded, &stereo_clip_mixed_down(), 800);
    // ffmpeg's own decoding of the file correlates 0.971 with the source: the codec's loss at this rate.
    assert!(lag == 0 && corr > 0.95, "lag {lag}, correlation {corr}");
    let whisper = wav_pcm16(&fixture("ffmpeg_speech_44k_stereo_m4a.wav"));
    assert_eq!(whisper.len(), 16347);
    let error: Vec<f32> = decoded.iter().zip(&whisper).map(|(a, b)| a - b).collect();
    let relative = rms(&error) / rms(&whisper[..16000]);
    assert!(relative < 0.03, "relative rms difference from ffmpeg's decoding {relative}");
}

/// The same AAC packets in a fragmented MP4 (`-movflags frag_keyframe+empty_moov`, as ffmpeg writes
/// to a pipe). ffmpeg writes no edit list there, and decodes the priming too (16719 samples at 16
/// kHz, as `ffmpeg -i … -ac 1 -ar 16000` gives): so does this, the same audio 372 samples later.
#[test]
fn fragmented_aac_without_an_edit_list_keeps_its_priming_as_ffmpeg_does() {
    let plain = load_audio(&fixture("speech_44k_stereo.m4a")).unwrap();
    let fragmented = load_audio(&fixture("speech_44k_stereo_fragmented.m4a")).unwrap();
    assert_eq!(fragmented.len(), 16719);
    let (lag, corr) = best_alignment(&fragmented, &plain, 800);
    // (The priming is 371.5 samples at 16 kHz: the half sample costs some correlation.)
    assert!(lag == 372 && corr > 0.95, "lag {lag}, correlation {corr}");
}

#[test]
fn alac_in_m4a_decodes_to_exactly_the_wav_samples() {
    assert_eq!(load_audio(&fixture("speech_16k_mono_alac.m4a")).unwrap(), source_clip());
}

#[test]
fn opus_in_webm_is_an_unsupported_codec_naming_it() {
    let e = show(load_audio(&fixture("speech_16k_mono.webm")));
    assert!(matches!(e, AudioError::Unsupported { .. }) && e.to_string().contains("Opus audio"), "{e}");
}

#[test]
fn mp3_decodes_like_whispers_ffmpeg_pipe() {
    assert_clip_matches_ffmpeg("speech_44k_stereo.mp3", "ffmpeg_speech_44k_stereo_mp3.wav");
}

#[test]
fn ogg_vorbis_decodes_like_whispers_ffmpeg_pipe() {
    assert_clip_matches_ffmpeg("speech_48k_stereo.ogg", "ffmpeg_speech_48k_stereo_ogg.wav");
}

#[test]
fn bytes_decode_like_the_file() {
    for name in [
        "speech_16k_mono.wav",
        "speech_16k_mono.flac",
        "speech_44k_stereo.mp3",
        "speech_48k_stereo.ogg",
        "speech_44k_stereo.m4a",
        "speech_16k_mono_alac.m4a",
    ] {
        let bytes = std::fs::read(fixture(name)).unwrap();
        assert_eq!(decode_audio_bytes(&bytes, name).unwrap(), load_audio(&fixture(name)).unwrap(), "{name}");
        // The hint only guides the probe: a bare extension, a wrong one or none still decode.
        let extension = name.rsplit('.').next().unwrap();
        assert!(decode_audio_bytes(&bytes, extension).is_ok(), "{name} as {extension}");
        assert!(decode_audio_bytes(&bytes, "upload.mp3").is_ok(), "{name} as upload.mp3");
        assert!(decode_audio_bytes(&bytes, "").is_ok(), "{name} without a hint");
    }
}

fn show(result: Result<Vec<f32>, AudioError>) -> AudioError {
    let error = result.expect_err("expected an error");
    eprintln!("{error}");
    error
}

#[test]
fn empty_file_is_an_empty_error_naming_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("silence.wav");
    std::fs::write(&path, b"").unwrap();
    let error = show(load_audio(&path));
    assert!(matches!(error, AudioError::Empty { .. }), "{error:?}");
    assert!(error.to_string().contains("silence.wav"), "{error}");
    assert!(matches!(show(decode_audio_bytes(&[], "up.flac")), AudioError::Empty { .. }));
}

#[test]
fn missing_file_is_an_io_error_naming_the_file() {
    let error = show(load_audio(Path::new("/nonexistent/clip.wav")));
    assert!(matches!(error, AudioError::Io { .. }), "{error:?}");
    assert!(error.to_string().contains("/nonexistent/clip.wav"), "{error}");
}

#[test]
fn text_named_mp3_is_not_recognised() {
    let text = b"This is not audio, just a text file that somebody named speech.mp3.\n".repeat(40);
    let error = show(decode_audio_bytes(&text, "speech.mp3"));
    assert!(matches!(error, AudioError::UnrecognisedFormat { .. }), "{error:?}");
    assert!(error.to_string().starts_with("speech.mp3: "), "{error}");
    // The same through a file.
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("notes.mp3");
    std::fs::write(&path, &text).unwrap();
    assert!(matches!(show(load_audio(&path)), AudioError::UnrecognisedFormat { .. }));
}

#[test]
fn wav_cut_inside_its_data_is_truncated() {
    let bytes = std::fs::read(fixture("speech_16k_mono.wav")).unwrap();
    for cut in [bytes.len() / 2, bytes.len() / 2 + 1, bytes.len() - 1] {
        let error = show(decode_audio_bytes(&bytes[..cut], "cut.wav"));
        assert!(matches!(error, AudioError::Truncated { .. }), "cut at {cut}: {error:?}");
    }
}

#[test]
fn wav_cut_inside_its_header_is_truncated() {
    let bytes = std::fs::read(fixture("speech_16k_mono.wav")).unwrap();
    for cut in [12, 20, 30, 43, 44] {
        let error = show(decode_audio_bytes(&bytes[..cut], "cut.wav"));
        assert!(matches!(error, AudioError::Truncated { .. }), "cut at {cut}: {error:?}");
    }
}

/// A mono 16 kHz WAV header with the given format tag and bits per sample, and `data` bytes.
fn wav_with_format(format_tag: u16, bits: u16, data: &[u8]) -> Vec<u8> {
    let block_align = (bits / 8).max(1);
    let mut out = Vec::new();
    out.extend_from_slice(b"RIFF");
    out.extend_from_slice(&(36 + data.len() as u32).to_le_bytes());
    out.extend_from_slice(b"WAVEfmt ");
    out.extend_from_slice(&16u32.to_le_bytes());
    out.extend_from_slice(&format_tag.to_le_bytes());
    out.extend_from_slice(&1u16.to_le_bytes());
    out.extend_from_slice(&16000u32.to_le_bytes());
    out.extend_from_slice(&(16000 * block_align as u32).to_le_bytes());
    out.extend_from_slice(&block_align.to_le_bytes());
    out.extend_from_slice(&bits.to_le_bytes());
    out.extend_from_slice(b"data");
    out.extend_from_slice(&(data.len() as u32).to_le_bytes());
    out.extend_from_slice(data);
    out
}

#[test]
fn unsupported_wav_sample_formats_are_unsupported_errors() {
    let data = vec![0u8; 3200];
    // 0x0055 is MPEG layer 3 inside WAV, 0x0161 WMA.
    for tag in [0x0055, 0x0161] {
        let error = show(decode_audio_bytes(&wav_with_format(tag, 16, &data), "odd.wav"));
        assert!(matches!(error, AudioError::Unsupported { .. }), "tag {tag:#x}: {error:?}");
        assert!(error.to_string().starts_with("odd.wav: unsupported audio: "), "{error}");
    }
    // WAVE_FORMAT_EXTENSIBLE with a sub-format GUID nobody knows.
    let mut extensible = wav_with_format(0xfffe, 16, &data);
    let fmt_ext: Vec<u8> = [&22u16.to_le_bytes()[..], &16u16.to_le_bytes(), &4u32.to_le_bytes(), &[0x5a; 16]].concat();
    extensible.splice(36..36, fmt_ext);
    extensible[16..20].copy_from_slice(&40u32.to_le_bytes()); // fmt chunk size: 16 + 2 + 22
    let size = extensible.len() as u32 - 8;
    extensible[4..8].copy_from_slice(&size.to_le_bytes());
    let error = show(decode_audio_bytes(&extensible, "ext.wav"));
    assert!(matches!(error, AudioError::Unsupported { .. }), "{error:?}");
    // 12-bit integer PCM: symphonia calls the header malformed; either way a clear error, no panic.
    let error = show(decode_audio_bytes(&wav_with_format(1, 12, &data), "odd.wav"));
    assert!(matches!(error, AudioError::Unsupported { .. } | AudioError::Malformed { .. }), "{error:?}");
    assert!(error.to_string().contains("bits per sample"), "{error}");
}

#[test]
fn wav_float_and_24_bit_pcm_decode() {
    let floats: Vec<u8> = [0.5f32, -0.25, 0.0, 1.0].iter().flat_map(|x| x.to_le_bytes()).collect();
    assert_eq!(decode_audio_bytes(&wav_with_format(3, 32, &floats), "f.wav").unwrap(), [0.5, -0.25, 0.0, 1.0]);
    let pcm24: Vec<u8> = [0x40_0000i32, -0x20_0000].iter().flat_map(|x| x.to_le_bytes()[..3].to_vec()).collect();
    assert_eq!(decode_audio_bytes(&wav_with_format(1, 24, &pcm24), "p.wav").unwrap(), [0.5, -0.25]);
}

#[test]
fn header_with_no_samples_is_a_no_audio_error() {
    let error = show(decode_audio_bytes(&wav_with_format(1, 16, &[]), "none.wav"));
    assert!(matches!(error, AudioError::NoAudio { .. }), "{error:?}");
}

#[test]
fn random_bytes_give_an_error() {
    let mut state = 0x2545_f491_4f6c_dd1du64;
    let noise: Vec<u8> = (0..20000)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state as u8
        })
        .collect();
    for hint in ["noise.wav", "noise.flac", "noise.mp3", "noise.ogg", "noise"] {
        show(decode_audio_bytes(&noise, hint));
    }
}

#[test]
fn every_truncation_of_every_clip_returns_without_panicking() {
    for name in [
        "speech_16k_mono.flac",
        "speech_44k_stereo.mp3",
        "speech_48k_stereo.ogg",
        "speech_44k_stereo.flac",
        "speech_44k_stereo.m4a",
        "speech_16k_mono_alac.m4a",
        "speech_16k_mono.webm",
    ] {
        let bytes = std::fs::read(fixture(name)).unwrap();
        let (mut ok, mut errors) = (0, 0);
        for cut in (0..bytes.len()).step_by(997) {
            match decode_audio_bytes(&bytes[..cut], name) {
                Ok(_) => ok += 1,
                Err(_) => errors += 1,
            }
        }
        eprintln!("{name}: {ok} truncations decoded, {errors} refused");
    }
}

#[test]
fn streamed_wav_with_unknown_length_decodes_fully() {
    // Writers that cannot seek back (ffmpeg to a pipe) leave the RIFF and data sizes at 0xFFFFFFFF.
    let mut bytes = std::fs::read(fixture("speech_16k_mono.wav")).unwrap();
    bytes[4..8].copy_from_slice(&u32::MAX.to_le_bytes());
    bytes[40..44].copy_from_slice(&u32::MAX.to_le_bytes());
    assert_eq!(decode_audio_bytes(&bytes, "live.wav").unwrap(), source_clip());
}

/// A recorder that writes its WAV before it knows the length leaves 0 or 0xFFFFFFFF as the RIFF and
/// `data` sizes (ffmpeg to a pipe, streaming recorders): the samples are those of the finished file,
/// from bytes and from a file alike.
#[test]
fn streamed_wav_placeholder_sizes_decode_like_the_finished_file() {
    let wav = std::fs::read(fixture("speech_16k_mono.wav")).unwrap();
    let want = decode_audio_bytes(&wav, "speech.wav").unwrap();
    let dir = tempfile::tempdir().unwrap();
    for (riff, data) in [(None, 0u32), (None, u32::MAX), (Some(0u32), u32::MAX), (Some(u32::MAX), 0)] {
        let mut v = wav.clone();
        if let Some(r) = riff {
            v[4..8].copy_from_slice(&r.to_le_bytes());
        }
        v[40..44].copy_from_slice(&data.to_le_bytes());
        let what = format!("RIFF size {riff:?}, data size {data:#x}");
        assert_eq!(decode_audio_bytes(&v, "streamed.wav").unwrap(), want, "{what}");
        let path = dir.path().join("streamed.wav");
        std::fs::write(&path, &v).unwrap();
        assert_eq!(load_audio(&path).unwrap(), want, "{what}, from a file");
    }
}

/// A data chunk that is really empty, with another chunk after it, stays empty (its 0 is no
/// placeholder): no audio, not the next chunk's bytes as samples.
#[test]
fn an_empty_data_chunk_before_another_chunk_is_no_audio() {
    let mut v = wav_with_format(1, 16, &[]);
    v.extend_from_slice(b"LIST");
    v.extend_from_slice(&200u32.to_le_bytes());
    v.extend_from_slice(&[7u8; 200]);
    let riff = (v.len() - 8) as u32;
    v[4..8].copy_from_slice(&riff.to_le_bytes());
    let error = show(decode_audio_bytes(&v, "empty-data.wav"));
    assert!(matches!(error, AudioError::NoAudio { .. }), "{error:?}");
}

/// The reason is in the message and not also the source, so that a chained report (`{:#}`, as the
/// CLI prints errors) gives it once.
#[test]
fn an_io_error_reads_its_reason_once() {
    let error = show(load_audio(Path::new("/nonexistent/clip.wav")));
    assert!(std::error::Error::source(&error).is_none(), "{error:?}");
    assert_eq!(error.to_string().matches("No such file").count(), 1, "{error}");
}

/// Raw MPEG audio and ADTS AAC carry no frame count (here a VBR MP3 without a Xing header, whose
/// quiet first second makes a bitrate estimate of its length wrong): decoded to the end of the data,
/// as ffmpeg decodes them (41472 and 41984 samples), neither cut at an estimate nor called truncated
/// against one. Both are one second of silence, then the 1.5 s clip.
#[test]
fn streams_without_a_frame_count_decode_to_the_end_of_their_data() {
    for (name, ffmpeg_len) in [("speech_16k_mono_vbr_noxing.mp3", 41472), ("speech_16k_mono_adts.aac", 41984)] {
        let samples = load_audio(&fixture(name)).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert!(samples.len().abs_diff(ffmpeg_len) <= 2048, "{name}: {} samples, ffmpeg {ffmpeg_len}", samples.len());
        let bytes = std::fs::read(fixture(name)).unwrap();
        assert_eq!(decode_audio_bytes(&bytes, name).unwrap().len(), samples.len(), "{name} as an upload");
        // The speech is there after the silence.
        let (silence, speech) = samples.split_at(16000);
        assert!(rms(silence) < 1e-3 && rms(&speech[..24000]) > 0.01, "{name}");
    }
}
