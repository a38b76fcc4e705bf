//! Whisper's log-mel spectrogram (`whisper/audio.py: log_mel_spectrogram`), computed the same way.

use std::sync::Arc;

use realfft::num_complex::Complex;
use realfft::{RealFftPlanner, RealToComplex};

use crate::{HOP_LENGTH, N_FFT, N_SAMPLES, SAMPLE_RATE};

/// Frequency bins of one STFT frame: `N_FFT / 2 + 1` = 201.
pub const N_FREQS: usize = N_FFT / 2 + 1;

/// Computes Whisper's log-mel spectrogram with `n_mels` bands (80, or 128 for large-v3).
///
/// Build it once and reuse it: it holds the FFT plan, the Hann window and the mel filter bank. It is `Sync`, so
/// one instance serves every thread.
pub struct MelSpectrogram {
    n_mels: usize,
    /// `[n_mels][N_FREQS]`, row-major: `librosa.filters.mel(sr=16000, n_fft=400, n_mels)`.
    filters: Vec<f32>,
    /// The bins `[start, end)` where each filter is non-zero (each covers only a few bins).
    bands: Vec<(usize, usize)>,
    window: Vec<f64>,
    fft: Arc<dyn RealToComplex<f64>>,
}

impl MelSpectrogram {
    /// Prepares the filter bank and FFT plan for `n_mels` bands.
    pub fn new(n_mels: usize) -> Self {
        let filters = mel_filter_bank(SAMPLE_RATE, N_FFT, n_mels);
        let bands = filters
            .chunks_exact(N_FREQS)
            .map(|row| {
                let start = row.iter().position(|&w| w != 0.0).unwrap_or(0);
                let end = row.iter().rposition(|&w| w != 0.0).map_or(start, |last| last + 1);
                (start, end)
            })
            .collect();
        // torch.hann_window(N_FFT) is periodic: the denominator is N, not N - 1.
        let window =
            (0..N_FFT).map(|n| 0.5 - 0.5 * (2.0 * std::f64::consts::PI * n as f64 / N_FFT as f64).cos()).collect();
        let fft = RealFftPlanner::<f64>::new().plan_fft_forward(N_FFT);
        Self { n_mels, filters, bands, window, fft }
    }

    /// The number of mel bands.
    pub fn n_mels(&self) -> usize {
        self.n_mels
    }

    /// The mel filter bank, `[n_mels][N_FREQS]` row-major, as `librosa.filters.mel` returns it.
    pub fn filters(&self) -> &[f32] {
        &self.filters
    }

    /// The log-mel spectrogram of 16 kHz `samples`: `(values, frames)`, values `[n_mels][frames]` row-major.
    ///
    /// `frames = samples.len() / 160` (the STFT's last frame is dropped, as Whisper does); 480000 samples give
    /// 3000 frames. Input shorter than one hop gives no frames.
    pub fn compute(&self, samples: &[f32]) -> (Vec<f32>, usize) {
        let frames = samples.len() / HOP_LENGTH;
        if frames == 0 {
            return (Vec::new(), 0);
        }
        let padded = reflect_pad(samples, N_FFT / 2);
        let mut frame = self.fft.make_input_vec();
        let mut spectrum = self.fft.make_output_vec();
        let mut scratch = self.fft.make_scratch_vec();
        let mut power = vec![0.0f64; N_FREQS];
        let mut log_mel = vec![0.0f32; self.n_mels * frames];
        let mut max = f32::NEG_INFINITY;
        for t in 0..frames {
            let start = t * HOP_LENGTH;
            for ((x, &s), &w) in frame.iter_mut().zip(&padded[start..start + N_FFT]).zip(&self.window) {
                *x = s * w;
            }
            self.fft
                .process_with_scratch(&mut frame, &mut spectrum, &mut scratch)
                .expect("buffers come from the plan, so their sizes match");
            for (p, c) in power.iter_mut().zip(&spectrum) {
                *p = Complex::norm_sqr(c);
            }
            for (m, (row, &(lo, hi))) in self.filters.chunks_exact(N_FREQS).zip(&self.bands).enumerate() {
                let energy: f64 = row[lo..hi].iter().zip(&power[lo..hi]).map(|(&w, &p)| w as f64 * p).sum();
                let value = energy.max(1e-10).log10() as f32;
                max = max.max(value);
                log_mel[m * frames + t] = value;
            }
        }
        let floor = max - 8.0;
        for value in &mut log_mel {
            *value = (value.max(floor) + 4.0) / 4.0;
        }
        (log_mel, frames)
    }
}

/// Whisper's log-mel spectrogram of 16 kHz `samples` with `n_mels` bands: `(values [n_mels][frames], frames)`.
///
/// A one-off convenience; to process many inputs build a [`MelSpectrogram`] once and call
/// [`MelSpectrogram::compute`].
pub fn log_mel_spectrogram(samples: &[f32], n_mels: usize) -> (Vec<f32>, usize) {
    MelSpectrogram::new(n_mels).compute(samples)
}

/// `librosa.filters.mel(sr, n_fft, n_mels)` with its defaults (fmin 0, fmax sr/2, Slaney mel scale,
/// `norm="slaney"`, float32): `[n_mels][n_fft / 2 + 1]` row-major.
///
/// Follows librosa's arithmetic step by step, including its float32 rounding, so the values match the
/// `mel_filters.npz` Whisper ships (which was saved from this very call).
pub fn mel_filter_bank(sample_rate: u32, n_fft: usize, n_mels: usize) -> Vec<f32> {
    let n_freqs = n_fft / 2 + 1;
    let sr = sample_rate as f64;
    // np.fft.rfftfreq(n_fft, d=1/sr)
    let bin_step = 1.0 / (n_fft as f64 * (1.0 / sr));
    let fft_freqs: Vec<f64> = (0..n_freqs).map(|k| k as f64 * bin_step).collect();
    // mel_frequencies(n_mels + 2, fmin=0, fmax=sr/2): np.linspace in mel, back to Hz.
    let (min_mel, max_mel) = (hz_to_mel(0.0), hz_to_mel(sr / 2.0));
    let points = n_mels + 2;
    let step = (max_mel - min_mel) / (points - 1) as f64;
    let mel_f: Vec<f64> =
        (0..points).map(|i| if i == points - 1 { max_mel } else { i as f64 * step + min_mel }).map(mel_to_hz).collect();

    let mut weights = vec![0.0f32; n_mels * n_freqs];
    for (i, row) in weights.chunks_exact_mut(n_freqs).enumerate() {
        let (lower_diff, upper_diff) = (mel_f[i + 1] - mel_f[i], mel_f[i + 2] - mel_f[i + 1]);
        // Slaney normalisation: each triangle has unit area in Hz.
        let enorm = 2.0 / (mel_f[i + 2] - mel_f[i]);
        for (w, &f) in row.iter_mut().zip(&fft_freqs) {
            let lower = -(mel_f[i] - f) / lower_diff;
            let upper = (mel_f[i + 2] - f) / upper_diff;
            let triangle = 0.0f64.max(lower.min(upper)) as f32;
            *w = (triangle as f64 * enorm) as f32;
        }
    }
    weights
}

// librosa's Slaney mel scale: linear below 1 kHz, logarithmic above.
const F_SP: f64 = 200.0 / 3.0;
const MIN_LOG_HZ: f64 = 1000.0;
const MIN_LOG_MEL: f64 = MIN_LOG_HZ / F_SP;

fn log_step() -> f64 {
    6.4f64.ln() / 27.0
}

fn hz_to_mel(hz: f64) -> f64 {
    if hz >= MIN_LOG_HZ {
        MIN_LOG_MEL + (hz / MIN_LOG_HZ).ln() / log_step()
    } else {
        hz / F_SP
    }
}

fn mel_to_hz(mel: f64) -> f64 {
    if mel >= MIN_LOG_MEL {
        MIN_LOG_HZ * (log_step() * (mel - MIN_LOG_MEL)).exp()
    } else {
        F_SP * mel
    }
}

/// `samples` with `pad` samples mirrored onto each end, the edge sample not repeated
/// (`torch.stft(center=True, pad_mode="reflect")`; input shorter than `pad` keeps reflecting, like numpy).
fn reflect_pad(samples: &[f32], pad: usize) -> Vec<f64> {
    let n = samples.len() as isize;
    let period = 2 * (n - 1).max(1);
    let reflect = |i: isize| -> usize {
        if n == 1 {
            return 0;
        }
        let i = i.rem_euclid(period);
        (if i < n { i } else { period - i }) as usize
    };
    (-(pad as isize)..n + pad as isize).map(|i| samples[reflect(i)] as f64).collect()
}

/// `samples` cut or zero-padded to exactly `length` (`whisper.audio.pad_or_trim`; `N_SAMPLES` for 30 s).
pub fn pad_or_trim(samples: &[f32], length: usize) -> Vec<f32> {
    let mut out = samples[..samples.len().min(length)].to_vec();
    out.resize(length, 0.0);
    out
}

/// Frames `[start, start + n_frames)` of a log-mel spectrogram (`[n_mels][frames]` row-major), zero-padded past
/// its end: Whisper's `pad_or_trim(mel[:, start:start + n_frames], n_frames)`.
///
/// `whisper.transcribe` computes the log-mel of the whole recording plus 30 s of silence, then walks it in
/// windows of `N_FRAMES` frames starting wherever the last window's transcript ended; this cuts one such window.
pub fn mel_window(mel: &[f32], n_mels: usize, start: usize, n_frames: usize) -> Vec<f32> {
    let frames = mel.len().checked_div(n_mels).unwrap_or(0);
    let mut out = vec![0.0f32; n_mels * n_frames];
    let (from, to) = (start.min(frames), (start + n_frames).min(frames));
    for (row_out, row) in out.chunks_exact_mut(n_frames.max(1)).zip(mel.chunks_exact(frames.max(1))) {
        row_out[..to - from].copy_from_slice(&row[from..to]);
    }
    out
}

/// Consecutive 30 s windows of `samples` (`N_SAMPLES` each, the last one zero-padded); none for empty input.
///
/// The simple fixed split for long recordings; see [`mel_window`] for Whisper's own seek-driven walk.
pub fn audio_windows(samples: &[f32]) -> impl Iterator<Item = Vec<f32>> + '_ {
    samples.chunks(N_SAMPLES).map(|chunk| pad_or_trim(chunk, N_SAMPLES))
}
