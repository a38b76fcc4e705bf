//! A transcript in the response formats OpenAI's audio API and the CLI share.

use anyhow::{bail, Result};
use serde_json::{json, Value};

use super::transcribe::{Segment, Transcript};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ResponseFormat {
    Text,
    Json,
    VerboseJson,
    Srt,
    Vtt,
}

impl ResponseFormat {
    pub fn parse(s: &str) -> Result<ResponseFormat> {
        Ok(match s {
            "text" => ResponseFormat::Text,
            "json" => ResponseFormat::Json,
            "verbose_json" => ResponseFormat::VerboseJson,
            "srt" => ResponseFormat::Srt,
            "vtt" => ResponseFormat::Vtt,
            other => bail!("response format `{other}` is not one of text, json, verbose_json, srt, vtt"),
        })
    }

    /// Formats whose output carries segment times: they need timestamps from the decoder.
    pub fn needs_timestamps(self) -> bool {
        matches!(self, ResponseFormat::VerboseJson | ResponseFormat::Srt | ResponseFormat::Vtt)
    }

    pub fn content_type(self) -> &'static str {
        match self {
            ResponseFormat::Json | ResponseFormat::VerboseJson => "application/json",
            ResponseFormat::Vtt => "text/vtt; charset=utf-8",
            ResponseFormat::Text | ResponseFormat::Srt => "text/plain; charset=utf-8",
        }
    }
}

/// `HH:MM:SS,mmm` (SRT, `sep` = ',') or `HH:MM:SS.mmm` (WebVTT).
fn clock(seconds: f32, sep: char) -> String {
    let ms = (seconds.max(0.0) * 1000.0).round() as u64;
    format!("{:02}:{:02}:{:02}{sep}{:03}", ms / 3_600_000, ms / 60_000 % 60, ms / 1000 % 60, ms % 1000)
}

/// The transcript as `format` renders it (`task` names the endpoint's task in verbose JSON).
pub fn render(t: &Transcript, format: ResponseFormat, task: &str) -> String {
    if let Some(v) = render_json(t, format, task) {
        return v.to_string();
    }
    match format {
        ResponseFormat::Srt => {
            let mut out = String::new();
            for (i, s) in t.segments.iter().enumerate() {
                let (start, end) = span(s, t);
                out += &format!("{}\n{} --> {}\n{}\n\n", i + 1, clock(start, ','), clock(end, ','), s.text.trim());
            }
            out
        }
        ResponseFormat::Vtt => {
            let mut out = String::from("WEBVTT\n\n");
            for s in &t.segments {
                let (start, end) = span(s, t);
                out += &format!("{} --> {}\n{}\n\n", clock(start, '.'), clock(end, '.'), s.text.trim());
            }
            out
        }
        _ => format!("{}\n", t.text.trim()),
    }
}

/// The JSON formats' object (None for the others).
pub fn render_json(t: &Transcript, format: ResponseFormat, task: &str) -> Option<Value> {
    let text = t.text.trim();
    // OpenAI's usage for whisper-1: the audio's whole seconds, rounded up.
    let usage = json!({"type": "duration", "seconds": t.duration.max(0.0).ceil() as u64});
    match format {
        ResponseFormat::Json => Some(json!({ "text": text, "usage": usage })),
        ResponseFormat::VerboseJson => {
            let segments: Vec<_> = t
                .segments
                .iter()
                .map(|s| {
                    let (start, end) = span(s, t);
                    json!({
                        "id": s.id, "seek": s.seek, "start": tidy(start), "end": tidy(end), "text": s.text,
                        "tokens": s.tokens, "temperature": tidy(s.temperature), "avg_logprob": tidy(s.avg_logprob),
                        "compression_ratio": tidy(s.compression_ratio), "no_speech_prob": tidy(s.no_speech_prob),
                    })
                })
                .collect();
            Some(
                json!({ "task": task, "language": language_name(&t.language), "duration": tidy(t.duration), "text": text,
                    "segments": segments, "usage": usage }),
            )
        }
        _ => None,
    }
}

/// Each segment on its own line after its times, as whisper.cpp's command line prints them
/// (`[00:00:01.500 --> 00:00:03.000]  text`).
pub fn timed_lines(t: &Transcript) -> String {
    let line = |s: &Segment| {
        let (start, end) = span(s, t);
        format!("[{} --> {}]  {}\n", clock(start, '.'), clock(end, '.'), s.text.trim())
    };
    t.segments.iter().map(line).collect()
}

/// A segment's times, its end no later than the audio's (the model may time a last segment past it).
fn span(s: &Segment, t: &Transcript) -> (f32, f32) {
    (s.start.min(t.duration), s.end.min(t.duration).max(s.start.min(t.duration)))
}

/// An f32 as the shortest decimal that reads back as it (`3.2`, not `3.200000047683716`).
fn tidy(x: f32) -> f64 {
    x.to_string().parse().unwrap_or(x as f64)
}

/// OpenAI's verbose JSON names the language in English words (`english`), not by code.
fn language_name(code: &str) -> String {
    const NAMES: &[(&str, &str)] = &[
        ("en", "english"),
        ("de", "german"),
        ("fr", "french"),
        ("es", "spanish"),
        ("it", "italian"),
        ("pt", "portuguese"),
        ("nl", "dutch"),
        ("ru", "russian"),
        ("zh", "chinese"),
        ("ja", "japanese"),
        ("ko", "korean"),
        ("pl", "polish"),
        ("tr", "turkish"),
        ("sv", "swedish"),
        ("uk", "ukrainian"),
    ];
    NAMES.iter().find(|(c, _)| *c == code).map_or(code.to_string(), |(_, n)| n.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::speech::transcribe::Segment;

    fn sample() -> Transcript {
        let seg = |id, start, end, text: &str| Segment {
            id,
            seek: 0,
            start,
            end,
            text: text.into(),
            tokens: vec![],
            temperature: 0.0,
            avg_logprob: -0.2,
            compression_ratio: 1.1,
            no_speech_prob: 0.01,
        };
        Transcript {
            text: " Hello world. This is a test.".into(),
            language: "en".into(),
            duration: 3661.3,
            segments: vec![seg(0, 0.0, 1.5, " Hello world."), seg(1, 1.5, 3661.25, " This is a test.")],
        }
    }

    #[test]
    fn srt_and_vtt_number_and_time_each_segment() {
        let t = sample();
        assert_eq!(
            render(&t, ResponseFormat::Srt, "transcribe"),
            "1\n00:00:00,000 --> 00:00:01,500\nHello world.\n\n2\n00:00:01,500 --> 01:01:01,250\nThis is a test.\n\n"
        );
        assert!(render(&t, ResponseFormat::Vtt, "transcribe").starts_with("WEBVTT\n\n00:00:00.000 --> 00:00:01.500\n"));
    }

    #[test]
    fn json_formats_carry_text_and_segments() {
        let t = sample();
        assert_eq!(render(&t, ResponseFormat::Text, "transcribe"), "Hello world. This is a test.\n");
        let v: serde_json::Value = serde_json::from_str(&render(&t, ResponseFormat::Json, "transcribe")).unwrap();
        assert_eq!(v["text"], "Hello world. This is a test.");
        let v: serde_json::Value = serde_json::from_str(&render(&t, ResponseFormat::VerboseJson, "translate")).unwrap();
        assert_eq!((v["task"].as_str(), v["language"].as_str()), (Some("translate"), Some("english")));
        assert_eq!(v["segments"][1]["end"], 3661.25);
        // f32 values as their shortest decimals, not their f64 widening (1.100000023841858).
        assert_eq!((v["duration"].as_f64(), v["segments"][0]["compression_ratio"].as_f64()), (Some(3661.3), Some(1.1)));
        assert!(ResponseFormat::parse("xml").is_err());
        // A segment timed past the end of the audio ends with it.
        let mut short = sample();
        short.duration = 2.0;
        let v: serde_json::Value = serde_json::from_str(&render(&short, ResponseFormat::VerboseJson, "x")).unwrap();
        assert_eq!((v["segments"][1]["start"].as_f64(), v["segments"][1]["end"].as_f64()), (Some(1.5), Some(2.0)));
    }
}
