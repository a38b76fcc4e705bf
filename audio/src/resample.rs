//! Sample-rate conversion to Whisper's 16 kHz.

use rubato::audioadapter_buffers::direct::InterleavedSlice;
use rubato::{Fft, FixedSync, Resampler};

/// Resamples mono `samples` at `rate` Hz to 16 kHz: `ceil(len * 16000 / rate)` samples, delay removed.
///
/// rubato's synchronous FFT resampler: band-limited (anti-aliased) and exact for a fixed ratio, which is the
/// offline conversion ffmpeg's resampler does for Whisper.
pub(crate) fn resample_to_16k(samples: &[f32], rate: u32) -> Result<Vec<f32>, String> {
    if rate == crate::SAMPLE_RATE {
        return Ok(samples.to_vec());
    }
    let mut resampler = Fft::<f32>::new(rate as usize, crate::SAMPLE_RATE as usize, 1024, 1, FixedSync::Both)
        .map_err(|e| e.to_string())?;
    let input = InterleavedSlice::new(samples, 1, samples.len()).map_err(|e| e.to_string())?;
    let output = resampler.process_all(&input, samples.len(), None).map_err(|e| e.to_string())?;
    Ok(output.take_data())
}
