"""Generation against `tinygpt-cpu sample --json`: the same greedy ids and text for the same
options, streamed text equal to the non-streamed text, stop strings, usage and `kv`."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import pytest

import tinygpt_cpu

# (name, Model keyword arguments, the same cache as CLI flags, tokens, ignore_eos)
CACHES: List[Tuple[str, Dict[str, Any], List[str], int, bool]] = [
    ("dense", {}, [], 60, False),
    (
        "sink4-window28-int4",
        {"sink": 4, "window": 28, "kv": "int4"},
        ["--streaming-llm-sink", "4", "--streaming-llm-window", "28", "--kv-quantize", "int4"],
        80,
        True,
    ),
]

_models: Dict[Tuple[Optional[str], str], tinygpt_cpu.Model] = {}


def model_for(path: Optional[Path], kwargs: Dict[str, Any]) -> tinygpt_cpu.Model:
    key = (None if path is None else str(path), repr(sorted(kwargs.items())))
    if key not in _models:
        _models[key] = tinygpt_cpu.Model(path, **kwargs)
    return _models[key]


def cli_sample(cli, path: Optional[Path], prompt: str, flags: List[str], tokens: int, *extra: str):
    model = [] if path is None else [str(path)]
    return cli.json(
        ["sample", *model, "--prompt", prompt, "--tokens", str(tokens), "--temperature", "0", *flags, *extra]
    )


def check_greedy(cli, path: Optional[Path], prompt: str, case) -> None:
    _, kwargs, flags, tokens, ignore_eos = case
    m = model_for(path, kwargs)
    extra = ["--ignore-eos"] if ignore_eos else []
    want = cli_sample(cli, path, prompt, flags, tokens, *extra)
    ids = list(m.generate(prompt, max_tokens=tokens, temperature=0, ignore_eos=ignore_eos))
    assert ids == want["generated_ids"]
    assert m.tokenize(prompt) == want["prompt_ids"]
    # What the cache holds after the run, and the settings, as the CLI reports them.
    assert m.kv == want["kv"]
    out = m(prompt, max_tokens=tokens, temperature=0, ignore_eos=ignore_eos)
    assert out["choices"][0]["text"] == want["text"]
    eos = bool(want["generated_ids"]) and want["generated_ids"][-1] in m._model.eos_ids and not ignore_eos
    assert out["choices"][0]["finish_reason"] == ("stop" if eos else "length")
    assert out["usage"] == {
        "prompt_tokens": len(want["prompt_ids"]),
        "completion_tokens": len(want["generated_ids"]),
        "total_tokens": len(want["prompt_ids"]) + len(want["generated_ids"]),
    }
    if flags:
        # The bounded cache did evict: it holds fewer rows than went through it.
        assert want["kv"]["stored_tokens"] < want["kv"]["current_length"]


@pytest.mark.parametrize("case", CACHES, ids=[c[0] for c in CACHES])
def test_greedy_matches_sample_json_bundled(cli, case) -> None:
    check_greedy(cli, None, "Once upon a time", case)


@pytest.mark.parametrize("case", CACHES, ids=[c[0] for c in CACHES])
def test_greedy_matches_sample_json_smollm2(cli, smollm2_path, case) -> None:
    check_greedy(cli, smollm2_path, "The capital of France is", case)


def test_chat_matches_sample_chat(cli, smollm2_path) -> None:
    m = model_for(smollm2_path, {})
    q = "Write one sentence about the sea."
    want = cli_sample(cli, smollm2_path, q, [], 40, "--chat")
    out = m.create_chat_completion([{"role": "user", "content": q}], max_tokens=40, temperature=0)
    assert out["choices"][0]["message"] == {"role": "assistant", "content": want["text"]}
    assert out["usage"]["prompt_tokens"] == len(want["prompt_ids"])
    assert out["usage"]["completion_tokens"] == len(want["generated_ids"])
    parts = [{"type": "text", "text": "Write one sentence "}, {"type": "text", "text": "about the sea."}]
    again = m.create_chat_completion([{"role": "user", "content": parts}], max_tokens=40, temperature=0)
    assert again["choices"][0]["message"]["content"] == want["text"]


def stream_text(chunks) -> Tuple[str, List[Dict[str, Any]]]:
    chunks = list(chunks)
    return "".join(c["choices"][0]["text"] for c in chunks), chunks


def test_stream_equals_non_stream_sampled(tiny) -> None:
    args = dict(max_tokens=200, temperature=1.0, top_k=0, top_p=1.0, seed=7, ignore_eos=True)
    whole = tiny("def ", **args)
    text, chunks = stream_text(tiny("def ", stream=True, **args))
    assert text == whole["choices"][0]["text"]
    # One chunk per generated token; the last one says why it ended and counts.
    assert len(chunks) == 200
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None] * 199 + ["length"]
    assert chunks[-1]["usage"] == whole["usage"]
    assert len({c["id"] for c in chunks}) == 1


def test_stream_equals_sample_text_across_split_utf8(cli, smollm2_path) -> None:
    """A continuation whose characters span several byte-level tokens: each chunk holds
    whole characters, and the chunks add up to `sample`'s text."""
    m = model_for(smollm2_path, {})
    prompt = "Translate to Japanese: Good morning, how are you? Japanese:"
    want = cli_sample(cli, smollm2_path, prompt, [], 24, "--ignore-eos")
    chunks = list(m(prompt, max_tokens=24, temperature=0, ignore_eos=True, stream=True))
    texts = [c["choices"][0]["text"] for c in chunks]
    assert "".join(texts) == want["text"]
    # The test means something only if some token is part of a character.
    assert any("\ufffd" in m.detokenize([t]) for t in want["generated_ids"]), want["text"]
    assert "" in texts[:-1], texts
    # Only the end can hold half a character (max_tokens cut it; `sample` prints U+FFFD too).
    assert all("\ufffd" not in t for t in texts[:-1])


def test_chat_stream_equals_non_stream(smollm2_path) -> None:
    m = model_for(smollm2_path, {})
    msgs = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Name a color."}]
    whole = m.create_chat_completion(msgs, max_tokens=30, temperature=0)
    chunks = list(m.create_chat_completion(msgs, max_tokens=30, temperature=0, stream=True))
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert text == whole["choices"][0]["message"]["content"]
    assert chunks[-1]["choices"][0]["finish_reason"] == whole["choices"][0]["finish_reason"]
    assert len(chunks) == 1 + whole["usage"]["completion_tokens"]


def test_stop_strings_cut_the_text(cli, tiny) -> None:
    want = cli_sample(cli, None, "The", [], 80, "--ignore-eos")["text"]
    words = want.split()
    assert len(words) > 4, want
    stop = " " + words[3]
    expected = want[: want.index(stop)]
    out = tiny("The", max_tokens=80, temperature=0, ignore_eos=True, stop=["zzzz", stop])
    assert out["choices"][0]["text"] == expected
    assert out["choices"][0]["finish_reason"] == "stop"
    text, chunks = stream_text(tiny("The", max_tokens=80, temperature=0, ignore_eos=True, stop=stop, stream=True))
    assert text == expected
    assert stop not in text and chunks[-1]["choices"][0]["finish_reason"] == "stop"


def test_token_prompt_equals_text_prompt(tiny) -> None:
    ids = tiny.tokenize("Once upon a time")
    a = list(tiny.generate(ids, max_tokens=20, temperature=0))
    b = list(tiny.generate("Once upon a time", max_tokens=20, temperature=0))
    assert a == b and len(a) > 0


def test_seeded_sampling_matches_sample(cli, tiny) -> None:
    want = cli.json(
        ["sample", "--prompt", "import", "--tokens", "50", "--temperature", "0.9", "--top-k", "20",
         "--top-p", "0.9", "--seed", "42"]
    )
    ids = list(tiny.generate("import", max_tokens=50, temperature=0.9, top_k=20, top_p=0.9, seed=42))
    assert ids == want["generated_ids"]


def test_tokenize_round_trip(tiny) -> None:
    text = "Python's str.format() and f-strings"
    ids = tiny.tokenize(text)
    assert ids[0] == 0  # the bundled tokenizer adds BOS
    assert tiny.tokenize(text, add_special_tokens=False) == ids[1:]
    assert tiny.detokenize(ids) == text
    assert tiny.tokenize(text.encode()) == ids
