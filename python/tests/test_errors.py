"""Bad options and files raise FileNotFoundError / ValueError carrying the message the CLI
prints for the same mistake (its stderr line after "error: ")."""

from __future__ import annotations

from typing import Any, Dict, List

import pytest

import tinygpt_cpu
from conftest import REPO

SAMPLE = ["sample", "--prompt", "Once upon a time"]

# (Model keyword arguments, the same mistake as CLI flags)
BAD_MODEL_OPTIONS = [
    ({"sink": 4}, ["--streaming-llm-sink", "4"]),
    ({"window": 0}, ["--streaming-llm-window", "0"]),
    ({"kv_group_size": 0}, ["--kv-group-size", "0"]),
    ({"threads": 0}, ["--threads", "0"]),
    ({"sink": 1 << 30, "window": 8}, ["--streaming-llm-sink", str(1 << 30), "--streaming-llm-window", "8"]),
    ({"kv": "int4", "kv_group_size": 1 << 21}, ["--kv-quantize", "int4", "--kv-group-size", str(1 << 21)]),
]


@pytest.mark.parametrize("kwargs,flags", BAD_MODEL_OPTIONS)
def test_bad_model_options_raise_the_cli_message(cli, kwargs: Dict[str, Any], flags: List[str]) -> None:
    want = cli.error([*SAMPLE, *flags])
    with pytest.raises(ValueError) as e:
        tinygpt_cpu.Model(**kwargs)
    assert str(e.value) == want


# Values the CLI's parser refuses: the first line of its message, then its hint.
BAD_VALUES = [
    ({"kv": "int5"}, ["--kv-quantize=int5"]),
    ({"kv_quantize_v": "int3"}, ["--kv-quantize-v=int3"]),
    ({"kv_rotation": "sometimes"}, ["--kv-rotation=sometimes"]),
    ({"weights_dtype": "f16"}, ["--weights-dtype=f16"]),
    ({"positions": "absolute"}, ["--streaming-llm-positions=absolute"]),
    ({"sink": -1, "window": 8}, ["--streaming-llm-sink=-1", "--streaming-llm-window=8"]),
]


@pytest.mark.parametrize("kwargs,flags", BAD_VALUES)
def test_bad_values_raise_the_cli_parser_message(cli, kwargs: Dict[str, Any], flags: List[str]) -> None:
    want = cli.error([*SAMPLE, *flags])
    with pytest.raises(ValueError) as e:
        tinygpt_cpu.Model(**kwargs)
    assert str(e.value).startswith(want), (str(e.value), want)
    assert "\n" not in str(e.value)


def test_missing_file_is_file_not_found(cli) -> None:
    path = "/nonexistent/model.gguf"
    want = cli.error(["sample", path, "--prompt", "x"])
    with pytest.raises(FileNotFoundError) as e:
        tinygpt_cpu.Model(path)
    assert str(e.value) == want


def test_a_file_that_is_not_a_model(cli) -> None:
    path = str(REPO / "fixtures/heldout.txt")
    want = cli.error(["sample", path, "--prompt", "x"])
    with pytest.raises(ValueError) as e:
        tinygpt_cpu.Model(path)
    assert str(e.value) == want


# (generation keyword arguments, the same mistake as `sample` flags)
BAD_GENERATION = [
    ({"temperature": -1}, ["--temperature", "-1"]),
    ({"top_p": 0}, ["--top-p", "0"]),
    ({"top_p": 1.5}, ["--top-p", "1.5"]),
    ({"max_tokens": 300}, ["--tokens", "300"]),
]


@pytest.mark.parametrize("kwargs,flags", BAD_GENERATION)
def test_bad_generation_options_raise_the_cli_message(cli, tiny, kwargs: Dict[str, Any], flags: List[str]) -> None:
    want = cli.error([*SAMPLE, *flags])
    with pytest.raises(ValueError) as e:
        tiny("Once upon a time", **kwargs)
    assert str(e.value) == want
    with pytest.raises(ValueError):
        tiny("Once upon a time", stream=True, **kwargs)


def test_bad_parsed_generation_values(cli, tiny) -> None:
    want = cli.error([*SAMPLE, "--top-k=-1"])
    with pytest.raises(ValueError) as e:
        tiny("Once upon a time", top_k=-1)
    assert str(e.value).startswith(want)


def test_a_window_past_the_context(cli) -> None:
    want = cli.error([*SAMPLE, "--streaming-llm-sink", "4", "--streaming-llm-window", "300", "--tokens", "300"])
    m = tinygpt_cpu.Model(sink=4, window=300)
    with pytest.raises(ValueError) as e:
        m("Once upon a time", max_tokens=300)
    assert str(e.value) == want
    # Unless past the context is allowed, as with --allow-past-context.
    m = tinygpt_cpu.Model(sink=4, window=300, allow_past_context=True)
    assert m("Once upon a time", max_tokens=3, temperature=0)["usage"]["completion_tokens"] >= 1


def test_no_chat_template(cli, tiny) -> None:
    want = cli.error([*SAMPLE, "--chat"])
    with pytest.raises(ValueError) as e:
        tiny.create_chat_completion([{"role": "user", "content": "hi"}])
    assert str(e.value) == want


def test_perplexity_options(cli, tiny, heldout: str) -> None:
    text = str(REPO / "fixtures/heldout.txt")
    for kwargs, flags in [({"chunk": 0}, ["--chunk", "0"]), ({"max_tokens": 1}, ["--max-tokens", "1"])]:
        want = cli.error(["perplexity", "--text", text, *flags])
        with pytest.raises(ValueError) as e:
            tiny.perplexity(heldout, **kwargs)
        assert str(e.value) == want
    with pytest.raises(ValueError, match="more than the model's context length"):
        tiny.perplexity(heldout)
    with pytest.raises(ValueError, match="perplexity needs at least 2"):
        tiny.perplexity("")


def test_bad_ids_and_messages(tiny) -> None:
    with pytest.raises(ValueError, match="outside the model's vocabulary"):
        tiny.detokenize([1, 99999])
    with pytest.raises(ValueError, match="outside the model's vocabulary"):
        tiny.eval_logits([0, 5000])
    with pytest.raises(ValueError, match="outside the model's vocabulary"):
        tiny([0, 5000])
    with pytest.raises(ValueError, match="must not be empty"):
        tiny.eval_logits([])
    with pytest.raises(ValueError, match="exceeds the model's context length"):
        tiny.eval_logits([0] * 300)
    with pytest.raises(ValueError, match="stop"):
        tiny("x", stop=[""])
    with pytest.raises(ValueError, match="messages"):
        tiny.create_chat_completion([])
    with pytest.raises(ValueError, match="content"):
        tiny.create_chat_completion([{"role": "user", "content": [{"type": "image_url"}]}])
