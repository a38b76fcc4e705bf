"""The official OpenAI and Anthropic Python SDKs against a running mlxcel-server.

Usage: test_sdk.py BASE_URL API_KEY MODEL_ID
Run by host/tests/server.rs in the venv it prepares (target/sdk-venv). Prints one line per check and
a closing 'N passed, N failed' line; exits non-zero on any failure.
"""

import sys
import traceback

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
