"""The official OpenAI Python SDK's audio API against mlxcel-server serving Whisper.

Usage: test_audio.py BASE_URL API_KEY MODEL_ID AUDIO_FILE
Run by host/tests/speech.rs in the venv of tests/sdk/requirements.txt. Prints one line per check and a
closing 'N passed, N failed' line; exits non-zero on any failure.
"""

import os
import sys
import traceback

import openai

BASE, KEY, MODEL, AUDIO = sys.argv[1:5]
STABLE = "This is a speech recognition test."

oa = openai.OpenAI(base_url=BASE + "/v1", api_key=KEY, max_retries=0, timeout=300)


def transcription_as_text():
    with open(AUDIO, "rb") as f:
        text = oa.audio.transcriptions.create(model=MODEL, file=f, response_format="text")
    assert STABLE in text, text


def transcription_as_json():
    with open(AUDIO, "rb") as f:
        r = oa.audio.transcriptions.create(model=MODEL, file=f, language="en")
    assert STABLE in r.text, r.text


def transcription_verbose_json_with_segments():
    with open(AUDIO, "rb") as f:
        r = oa.audio.transcriptions.create(
            model=MODEL, file=f, response_format="verbose_json", timestamp_granularities=["segment"]
        )
    assert STABLE in r.text, r.text
    assert r.language == "english", r.language
    assert 6.0 < r.duration < 8.0, r.duration
    assert len(r.segments) >= 1, r.segments
    last = 0.0
    for s in r.segments:
        assert last <= s.start < s.end <= r.duration + 0.5, (s.start, s.end)
        last = s.end
    assert STABLE in "".join(s.text for s in r.segments)


def subtitles_as_srt():
    with open(AUDIO, "rb") as f:
        srt = oa.audio.transcriptions.create(model=MODEL, file=f, response_format="srt")
    assert srt.startswith("1\n00:00:00,000 --> "), srt
    assert STABLE in srt, srt


HERE = os.path.dirname(os.path.abspath(__file__))


def an_m4a_upload_is_transcribed():
    with open(os.path.join(HERE, "..", "fixtures", "speech-en-16k.m4a"), "rb") as f:
        text = oa.audio.transcriptions.create(model=MODEL, file=f, response_format="text")
    assert STABLE in text, text


def refused(call, words, what):
    """`call` must fail with a 400 whose message holds `words`."""
    try:
        call()
    except openai.BadRequestError as e:
        assert words in str(e), e
        return
    raise AssertionError(f"{what} was accepted")


def an_opus_upload_is_a_400_naming_opus():
    webm = os.path.join(HERE, "..", "..", "..", "audio", "tests", "fixtures", "speech_16k_mono.webm")
    with open(webm, "rb") as f:
        refused(lambda: oa.audio.transcriptions.create(model=MODEL, file=f), "Opus", "an Opus upload")


def an_empty_file_is_a_400():
    refused(lambda: oa.audio.transcriptions.create(model=MODEL, file=("empty.wav", b"")), "empty", "an empty upload")


def a_text_file_named_mp3_is_a_400():
    text = ("notes.mp3", b"hello, this is text, not audio\n" * 20)
    refused(lambda: oa.audio.transcriptions.create(model=MODEL, file=text), "could not be read as audio", "a text file")


def translation_on_an_english_only_model_is_a_400():
    with open(AUDIO, "rb") as f:
        refused(lambda: oa.audio.translations.create(model=MODEL, file=f), "English-only", "translation on tiny.en")


def chat_on_a_speech_model_is_a_400():
    try:
        oa.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}])
    except openai.BadRequestError as e:
        assert "speech-recognition model" in str(e), e
        # tiny.en cannot translate: the routes it names are the ones it answers.
        assert "/v1/audio/transcriptions" in str(e) and "translations" not in str(e), e
        return
    raise AssertionError("chat on a speech model was accepted")


CHECKS = [
    transcription_as_text,
    transcription_as_json,
    transcription_verbose_json_with_segments,
    subtitles_as_srt,
    an_m4a_upload_is_transcribed,
    an_opus_upload_is_a_400_naming_opus,
    an_empty_file_is_a_400,
    a_text_file_named_mp3_is_a_400,
    translation_on_an_english_only_model_is_a_400,
    chat_on_a_speech_model_is_a_400,
]

failed = 0
for check in CHECKS:
    try:
        check()
        print(f"ok   {check.__name__}")
    except Exception:
        failed += 1
        print(f"FAIL {check.__name__}\n{traceback.format_exc()}")
print(f"{len(CHECKS) - failed} passed, {failed} failed")
sys.exit(1 if failed else 0)
