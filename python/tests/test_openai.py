"""The `openai` package's response types accept the package's dicts as they are."""

from __future__ import annotations

import pytest

openai_types = pytest.importorskip("openai.types", reason="the openai package is not installed")
from openai.types import Completion  # noqa: E402
from openai.types.chat import ChatCompletion, ChatCompletionChunk  # noqa: E402


def test_completion_parses(tiny) -> None:
    out = tiny("Once upon a time", max_tokens=12, temperature=0)
    c = Completion.model_validate(out)
    assert c.object == "text_completion"
    assert c.choices[0].text == out["choices"][0]["text"]
    assert c.usage is not None and c.usage.completion_tokens == out["usage"]["completion_tokens"]


def test_completion_stream_chunks_parse(tiny) -> None:
    chunks = list(tiny("Once upon a time", max_tokens=12, temperature=0, stream=True, ignore_eos=True))
    # Streamed completions are Completion objects; OpenAI's own stream has a null
    # finish_reason before the last one, which the type (built for whole responses) does not
    # allow, so the client builds stream chunks without validating them.
    last = Completion.model_validate(chunks[-1])
    assert last.choices[0].finish_reason == "length"
    for c in chunks[:-1]:
        assert Completion.model_construct(**c).object == "text_completion"


def test_chat_completion_and_chunks_parse(smollm2_path) -> None:
    import tinygpt_cpu

    m = tinygpt_cpu.Model(smollm2_path, sink=4, window=60, kv="int8")
    msgs = [{"role": "user", "content": "Say hello."}]
    out = ChatCompletion.model_validate(m.create_chat_completion(msgs, max_tokens=12, temperature=0))
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].finish_reason in ("stop", "length")
    chunks = [
        ChatCompletionChunk.model_validate(c)
        for c in m.create_chat_completion(msgs, max_tokens=12, temperature=0, stream=True)
    ]
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert text == out.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == out.choices[0].finish_reason
    assert chunks[-1].usage is not None


def test_completion_round_trips_through_the_type(tiny) -> None:
    """Nothing is lost or renamed: the validated object dumps back to the same dict."""
    out = tiny("def", max_tokens=5, temperature=0)
    assert Completion.model_validate(out).model_dump(exclude_unset=True) == out
