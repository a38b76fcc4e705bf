"""The official OpenAI and Anthropic Python SDKs against a running mlxcel-server.

Usage: test_sdk.py BASE_URL API_KEY MODEL_ID
Run by host/tests/server.rs in the venv it prepares (target/sdk-venv). Prints one line per check and
a closing 'N passed, N failed' line; exits non-zero on any failure.
"""

import json
import sys
import traceback
import urllib.request

import anthropic
import openai

BASE, KEY, MODEL = sys.argv[1:4]
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
# anthropic 2.x dropped the sampling parameters from messages.create; they still reach the server
# (which reads temperature, top_p and top_k) as extra body fields.
GREEDY = {"temperature": 0}

oa = openai.OpenAI(base_url=BASE + "/v1", api_key=KEY, max_retries=0, timeout=120)
an = anthropic.Anthropic(base_url=BASE, api_key=KEY, max_retries=0, timeout=120)


def openai_chat_plain():
    r = oa.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, max_tokens=32)
    text = r.choices[0].message.content
    assert "Paris" in text, text
    assert r.choices[0].finish_reason == "stop", r.choices[0].finish_reason
    assert r.usage.prompt_tokens > 0 and r.usage.completion_tokens > 0, r.usage
    assert r.usage.prompt_tokens_details.cached_tokens is not None


def openai_chat_streamed():
    stream = oa.chat.completions.create(
        model=MODEL,
        messages=QUESTION,
        temperature=0,
        max_tokens=32,
        stream=True,
        stream_options={"include_usage": True},
    )
    text, usage, finish = "", None, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            text += c.delta.content or ""
            finish = c.finish_reason or finish
    assert "Paris" in text, text
    assert finish == "stop", finish
    assert usage is not None and usage.completion_tokens > 0, usage


def openai_stream_with_llama_server_extras():
    # What llama.cpp's web UI asks for: prompt-progress chunks and timings in every chunk; the SDK
    # keeps the fields it does not know in model_extra.
    extras = {"return_progress": True, "timings_per_token": True, "reasoning_format": "auto"}
    stream = oa.chat.completions.create(
        model=MODEL, messages=QUESTION, temperature=0, max_tokens=32, stream=True, extra_body=extras
    )
    text, progress, timed = "", [], 0
    for chunk in stream:
        extra = chunk.model_extra or {}
        if "prompt_progress" in extra:
            progress.append(extra["prompt_progress"])
        for c in chunk.choices:
            if c.delta.content:
                text += c.delta.content
                timed += "timings" in extra
    assert "Paris" in text, text
    assert progress and progress[-1]["processed"] == progress[-1]["total"] > 0, progress
    assert timed > 0, "no timings in the text chunks"


def openai_responses():
    r = oa.responses.create(model=MODEL, input="What is the capital of France?", temperature=0, max_output_tokens=32)
    assert "Paris" in r.output_text, r.output_text
    assert r.status == "completed" and r.usage.output_tokens > 0, (r.status, r.usage)
    text, done = "", None
    with oa.responses.stream(model=MODEL, input=QUESTION, temperature=0, max_output_tokens=32) as stream:
        for event in stream:
            if event.type == "response.output_text.delta":
                text += event.delta
        done = stream.get_final_response()
    assert "Paris" in text and done.output_text == text, (text, done.output_text)


def openai_completions():
    r = oa.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=8, temperature=0)
    assert "Paris" in r.choices[0].text, r.choices[0].text
    stream = oa.completions.create(
        model=MODEL, prompt="The capital of France is", max_tokens=8, temperature=0, stream=True
    )
    text = "".join(c.choices[0].text for c in stream if c.choices)
    assert "Paris" in text, text


def openai_models():
    models = oa.models.list()
    ids = [m.id for m in models.data]
    assert ids == [MODEL], ids
    assert oa.models.retrieve(MODEL).id == MODEL
    try:
        oa.models.retrieve("no-such-model")
        raise AssertionError("an unknown model was found")
    except openai.NotFoundError:
        pass


def anthropic_models():
    page = an.models.list()
    assert [m.id for m in page.data] == [MODEL], page
    assert page.data[0].type == "model" and page.data[0].created_at is not None, page.data[0]
    assert an.models.retrieve(MODEL).display_name == MODEL


def anthropic_prefill_is_continued():
    # A last assistant turn is a prefill: the answer continues it (Anthropic's behaviour).
    prefill = QUESTION + [{"role": "assistant", "content": "The capital of France is"}]
    m = an.messages.create(model=MODEL, max_tokens=8, messages=prefill, extra_body=GREEDY)
    text = m.content[0].text
    assert "Paris" in text and not text.startswith("The capital"), text


def openai_logit_bias_acts():
    plain = oa.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, max_tokens=4, logprobs=True)
    first = plain.choices[0].logprobs.content[0].token
    req = urllib.request.Request(
        BASE + "/tokenize",
        json.dumps({"content": first}).encode(),
        {"Content-Type": "application/json", "Authorization": "Bearer " + KEY},
    )
    (token_id,) = json.loads(urllib.request.urlopen(req).read())["tokens"]
    banned = oa.chat.completions.create(
        model=MODEL, messages=QUESTION, temperature=0, max_tokens=4, logprobs=True, logit_bias={str(token_id): -100}
    )
    assert banned.choices[0].logprobs.content[0].token != first, (first, banned.choices[0].message.content)


def openai_wrong_key_is_authentication_error():
    bad = openai.OpenAI(base_url=BASE + "/v1", api_key="wrong", max_retries=0)
    try:
        bad.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=4)
    except openai.AuthenticationError as e:
        assert e.status_code == 401
        return
    raise AssertionError("a wrong key was accepted")


def openai_bad_request_is_400():
    try:
        oa.chat.completions.create(model=MODEL, messages=QUESTION, temperature="hot")
    except openai.BadRequestError as e:
        assert e.status_code == 400
        assert "temperature" in str(e), str(e)
        return
    raise AssertionError("temperature='hot' was accepted")


def anthropic_messages_plain():
    m = an.messages.create(model=MODEL, max_tokens=32, messages=QUESTION, extra_body=GREEDY)
    assert m.type == "message" and m.role == "assistant"
    assert "Paris" in m.content[0].text, m.content
    assert m.stop_reason == "end_turn", m.stop_reason
    assert m.usage.output_tokens > 0


def anthropic_messages_streamed():
    with an.messages.stream(model=MODEL, max_tokens=32, messages=QUESTION, extra_body=GREEDY) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert "Paris" in text, text
    assert final.stop_reason == "end_turn", final.stop_reason
    kinds = [e.type for e in an.messages.create(model=MODEL, max_tokens=8, messages=QUESTION, stream=True)]
    # (The SDK swallows `ping`; the route tests check it is sent after content_block_start.)
    assert kinds[:3] == ["message_start", "content_block_start", "content_block_delta"], kinds
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"], kinds


def anthropic_stop_sequence_and_count_tokens():
    m = an.messages.create(
        model=MODEL, max_tokens=32, messages=QUESTION, stop_sequences=["Paris"], extra_body=GREEDY
    )
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == "Paris", (m.stop_reason, m.stop_sequence)
    n = an.messages.count_tokens(model=MODEL, messages=QUESTION)
    assert n.input_tokens > 5, n


def main():
    checks = [v for k, v in globals().items() if k.startswith(("openai_", "anthropic_")) and callable(v)]
    passed = failed = 0
    for check in checks:
        try:
            check()
            passed += 1
            print(f"ok   {check.__name__}", flush=True)
        except Exception:
            failed += 1
            print(f"FAIL {check.__name__}\n{traceback.format_exc()}", flush=True)
    print(f"sdk: {passed} passed, {failed} failed")
    sys.exit(1 if failed else 0)


main()
