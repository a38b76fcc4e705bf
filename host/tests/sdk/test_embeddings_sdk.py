"""The official OpenAI Python SDK's embeddings calls against mlxcel-server serving all-MiniLM-L6-v2.

Usage: test_embeddings_sdk.py BASE_URL MODEL_ID REFERENCE_JSON
Run by host/tests/embeddings.rs in the SDK venv (target/sdk-venv). REFERENCE_JSON is
host/tests/fixtures/minilm-reference.json (tools/fixtures/minilm_reference.py). Prints one line per
check and a closing 'N passed, N failed' line; exits non-zero on any failure.
"""

import json
import math
import sys
import traceback

import openai

BASE, MODEL, REFERENCE = sys.argv[1:4]
REF = json.load(open(REFERENCE))
TEXTS = [i["text"] for i in REF["inputs"]]
oa = openai.OpenAI(base_url=BASE + "/v1", api_key="unused", max_retries=0, timeout=120)


def cos(a, b):
    return sum(x * y for x, y in zip(a, b)) / math.sqrt(sum(x * x for x in a) * sum(y * y for y in b))


def close_to_reference(vectors):
    for i, (got, want) in enumerate(zip(vectors, REF["embeddings"])):
        d = max(abs(x - y) for x, y in zip(got, want))
        assert d <= 1e-4, f"input {i}: max |diff| {d}"


def embeddings_default_encoding():
    # The SDK asks for base64 unless told otherwise, and decodes it.
    r = oa.embeddings.create(model=MODEL, input=TEXTS)
    vectors = [d.embedding for d in r.data]
    assert [d.index for d in r.data] == list(range(len(TEXTS)))
    assert all(len(v) == 384 for v in vectors), [len(v) for v in vectors]
    c = cos(vectors[0], vectors[1])
    assert abs(c - 0.755) <= 0.005, c
    assert cos(vectors[0], vectors[2]) < 0.2
    close_to_reference(vectors)
    assert r.usage.prompt_tokens == sum(len(i["input_ids"]) for i in REF["inputs"]), r.usage
    assert r.usage.total_tokens == r.usage.prompt_tokens


def embeddings_float_and_token_ids():
    r = oa.embeddings.create(model=MODEL, input=TEXTS[0], encoding_format="float")
    close_to_reference([r.data[0].embedding])
    r = oa.embeddings.create(model=MODEL, input=[i["input_ids"] for i in REF["inputs"]], encoding_format="float")
    close_to_reference([d.embedding for d in r.data])


def dimensions_shorten_and_normalise_again():
    r = oa.embeddings.create(model=MODEL, input=TEXTS[:2], dimensions=128, encoding_format="float")
    for got, want in zip([d.embedding for d in r.data], REF["embeddings"]):
        assert len(got) == 128, len(got)
        norm = math.sqrt(sum(x * x for x in want[:128]))
        d = max(abs(x - y / norm) for x, y in zip(got, want))
        assert d <= 1e-4, f"max |diff| {d}"


def bad_requests_raise_bad_request_error():
    for kwargs in [dict(input=[]), dict(input=""), dict(input=TEXTS[0], dimensions=385),
                   dict(input=[[1, 2, 10**7]])]:
        try:
            oa.embeddings.create(model=MODEL, **kwargs)
        except openai.BadRequestError:
            continue
        raise AssertionError(f"{kwargs} was accepted")
    try:
        oa.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}])
    except openai.BadRequestError as e:
        assert "embedding model" in str(e), e
    else:
        raise AssertionError("chat on an embedding model was accepted")


passed = failed = 0
for check in [embeddings_default_encoding, embeddings_float_and_token_ids, dimensions_shorten_and_normalise_again,
              bad_requests_raise_bad_request_error]:
    try:
        check()
        passed += 1
        print(f"ok   {check.__name__}")
    except Exception:
        failed += 1
        print(f"FAIL {check.__name__}\n{traceback.format_exc()}")
print(f"{passed} passed, {failed} failed")
sys.exit(1 if failed else 0)
