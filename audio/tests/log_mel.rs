//! Whisper's log-mel spectrogram against the numpy reference in `fixtures/make_reference.py` (Whisper's
//! algorithm in float64 with librosa's filter bank, cross-checked there against Hugging Face's
//! WhisperFeatureExtractor and against the mel_filters.npz that Whisper ships).

mod common;

use common::{fixture, max_abs_diff, read_npy_f32, speech_wav};
use mlxcel_audio::{
    audio_windows, load_audio, log_mel_spectrogram, mel_filter_bank, mel_window, pad_or_trim, MelSpectrogram, N_FRAMES,
    N_FREQS, N_SAMPLES,
};

#[test]
fn mel_filter_bank_equals_librosa_slaney_80_and_128() {
    for n_mels in [80, 128] {
        let (expected, shape) = read_npy_f32(&fixture(&format!("mel_filters{n_mels}.npy")));
        assert_eq!(shape, [n_mels, N_FREQS]);
        let filters = mel_filter_bank(16000, 400, n_mels);
        let diff = max_abs_diff(&filters, &expected);
        let scale = expected.iter().fold(0.0f32, |m, &x| m.max(x));
        eprintln!("n_mels={n_mels}: filter bank max abs diff {diff:e}");
        assert!(diff <= scale * 1e-6, "n_mels={n_mels}: max abs diff {diff} (largest weight {scale})");
    }
}

fn assert_chirp_matches_reference(n_mels: usize) {
    let (signal, _) = read_npy_f32(&fixture("chirp_signal.npy"));
    let (expected, shape) = read_npy_f32(&fixture(&format!("chirp_logmel{n_mels}.npy")));
    let (log_mel, frames) = log_mel_spectrogram(&signal, n_mels);
    assert_eq!(signal.len(), 16077);
    assert_eq!([n_mels, frames], shape[..], "frames = floor(16077 / 160)");
    let diff = max_abs_diff(&log_mel, &expected);
    eprintln!("n_mels={n_mels}: chirp log-mel max abs diff {diff:e}");
    assert!(diff < 1e-4, "n_mels={n_mels}: max abs diff {diff}");
}

#[test]
fn log_mel_of_chirp_matches_whisper_reference_80_bins() {
    assert_chirp_matches_reference(80);
}

#[test]
fn log_mel_of_chirp_matches_whisper_reference_128_bins() {
    assert_chirp_matches_reference(128);
}

#[test]
fn log_mel_of_speech_wav_is_80_by_3000_and_matches_reference() {
    let Some(path) = speech_wav() else { return };
    let samples = load_audio(&path).unwrap();
    let (log_mel, frames) = MelSpectrogram::new(80).compute(&pad_or_trim(&samples, N_SAMPLES));
    assert_eq!((frames, log_mel.len()), (N_FRAMES, 80 * N_FRAMES));
    // Whisper's output range: at most 8 (log10 units) below the maximum, scaled by 1/4.
    let max = log_mel.iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x));
    let min = log_mel.iter().fold(f32::INFINITY, |m, &x| m.min(x));
    assert!((max - min - 2.0).abs() < 1e-5, "range {min}..{max}");
    // Frames 100..200 of the reference, computed over the whole 30 s window.
    let (expected, shape) = read_npy_f32(&fixture("speech_logmel80.npy"));
    assert_eq!(shape, [80, 100]);
    let window = mel_window(&log_mel, 80, 100, 100);
    let diff = max_abs_diff(&window, &expected);
    eprintln!("speech log-mel max abs diff {diff:e}");
    assert!(diff < 1e-4, "max abs diff {diff}");
}

#[test]
fn mel_spectrogram_reused_gives_the_same_result() {
    let (signal, _) = read_npy_f32(&fixture("chirp_signal.npy"));
    let mel = MelSpectrogram::new(128);
    assert_eq!(mel.n_mels(), 128);
    assert_eq!(mel.filters().len(), 128 * N_FREQS);
    assert_eq!(mel.compute(&signal), mel.compute(&signal));
}

#[test]
fn short_input_gives_no_frames_and_no_panic() {
    for len in [0, 1, 2, 159] {
        assert_eq!(log_mel_spectrogram(&vec![0.1; len], 80), (Vec::new(), 0), "len {len}");
    }
    // Shorter than the 200-sample reflection pad: still one frame per hop, all finite.
    let (log_mel, frames) = log_mel_spectrogram(&[0.5; 160], 80);
    assert_eq!((frames, log_mel.len()), (1, 80));
    assert!(log_mel.iter().all(|x| x.is_finite()));
}

#[test]
fn silence_is_flat_at_the_floor() {
    let (log_mel, frames) = log_mel_spectrogram(&vec![0.0; N_SAMPLES], 80);
    assert_eq!(frames, N_FRAMES);
    // log10(1e-10) = -10, then (x + 4) / 4.
    assert!(log_mel.iter().all(|&x| x == -1.5));
}

#[test]
fn pad_or_trim_pads_with_zeros_and_cuts() {
    assert_eq!(pad_or_trim(&[1.0, 2.0], 4), [1.0, 2.0, 0.0, 0.0]);
    assert_eq!(pad_or_trim(&[1.0, 2.0, 3.0], 2), [1.0, 2.0]);
    assert_eq!(pad_or_trim(&[], 0), Vec::<f32>::new());
}

#[test]
fn mel_window_cuts_frames_and_pads_with_zeros() {
    // 2 mels x 3 frames: rows [1 2 3], [4 5 6].
    let mel = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0];
    assert_eq!(mel_window(&mel, 2, 1, 4), [2.0, 3.0, 0.0, 0.0, 5.0, 6.0, 0.0, 0.0]);
    assert_eq!(mel_window(&mel, 2, 0, 2), [1.0, 2.0, 4.0, 5.0]);
    assert_eq!(mel_window(&mel, 2, 5, 1), [0.0, 0.0]);
}

#[test]
fn audio_windows_are_30_s_each_the_last_zero_padded() {
    let samples: Vec<f32> = (0..N_SAMPLES * 2 + 10).map(|i| i as f32).collect();
    let windows: Vec<Vec<f32>> = audio_windows(&samples).collect();
    assert_eq!(windows.len(), 3);
    assert!(windows.iter().all(|w| w.len() == N_SAMPLES));
    assert_eq!(windows[1][0], N_SAMPLES as f32);
    assert_eq!(windows[2][9], (N_SAMPLES * 2 + 9) as f32);
    assert!(windows[2][10..].iter().all(|&x| x == 0.0));
    assert_eq!(audio_windows(&[]).count(), 0);
}

#[test]
fn thirty_seconds_give_a_full_window_of_frames() {
    // Speed is measured by benchmarks, not asserted here.
    let samples: Vec<f32> = (0..N_SAMPLES).map(|i| (i as f32 * 0.05).sin() * 0.3).collect();
    let (mel, frames) = MelSpectrogram::new(128).compute(&samples);
    assert_eq!(frames, N_FRAMES);
    assert_eq!(mel.len(), 128 * N_FRAMES);
    assert!(mel.iter().all(|v| v.is_finite()));
}
