//! Audio for speech recognition: any WAV, FLAC, MP3, Ogg Vorbis, M4A or WebM (not Opus) file to 16 kHz
//! mono samples, and those samples to the log-mel spectrogram OpenAI Whisper's encoder reads, computed as `whisper/audio.py` does.
//!
//! ```no_run
//! use mlxcel_audio::{load_audio, pad_or_trim, MelSpectrogram, N_SAMPLES};
//!
//! let samples = load_audio(std::path::Path::new("speech.mp3"))?;
//! let mel = MelSpectrogram::new(80); // 128 for large-v3
//! let (log_mel, frames) = mel.compute(&pad_or_trim(&samples, N_SAMPLES));
//! assert_eq!((log_mel.len(), frames), (80 * 3000, 3000));
//! # Ok::<(), mlxcel_audio::AudioError>(())
//! ```

mod decode;
mod mel;
mod mp4_edit;
mod resample;

pub use decode::{decode_audio_bytes, load_audio, AudioError};
pub use mel::{audio_windows, log_mel_spectrogram, mel_filter_bank, mel_window, pad_or_trim, MelSpectrogram, N_FREQS};

/// The sample rate Whisper works at.
pub const SAMPLE_RATE: u32 = 16000;
/// STFT window length in samples (25 ms).
pub const N_FFT: usize = 400;
/// STFT hop in samples (10 ms): one spectrogram frame.
pub const HOP_LENGTH: usize = 160;
/// Samples in one 30 s window, the encoder's input length.
pub const N_SAMPLES: usize = 30 * SAMPLE_RATE as usize;
/// Spectrogram frames in one 30 s window.
pub const N_FRAMES: usize = N_SAMPLES / HOP_LENGTH;
