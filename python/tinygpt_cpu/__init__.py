"""tinygpt-cpu from Python: a pure-CPU decode engine whose KV cache can stop growing.

``Model`` loads a GGUF file, a Hugging Face model directory, a ``.tinygpt`` file or (with
no path) the bundled 1.4M-parameter model, and generates through the cache the options
describe: StreamingLLM (``sink`` + ``window``), KIVI quantisation (``kv="int4"``, ...).
Its API follows llama-cpp-python's ``Llama`` (``__call__``, ``create_completion``,
``create_chat_completion``, ``tokenize``, ``detokenize``) and returns OpenAI-shaped dicts;
``eval_logits``, ``perplexity`` and ``kv`` give what the CLI's ``perplexity --json`` and
``sample --json`` report. Options and errors are the CLI's (docs/python.md).
"""

from __future__ import annotations

import os
import time
import uuid
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple, Union

import numpy  # noqa: F401  (eval_logits returns arrays: NumPy is loaded before the engine)

from . import _native

__all__ = ["Model", "__version__"]
__version__: str = _native.__version__

Prompt = Union[str, Sequence[int]]
Stop = Union[str, Sequence[str], None]
Message = Dict[str, Any]


def _flag(flags: List[str], name: str, value: Any) -> None:
    """Appends ``--name=value`` (the CLI flag a keyword stands for) unless ``value`` is None."""
    if value is not None:
        flags.append(f"{name}={value}")


class Model:
    """A model loaded once, with the KV cache every run goes through.

    ``path`` is a ``.gguf`` file, a Hugging Face model directory or a ``.tinygpt`` file;
    None is the bundled model. The other arguments are the CLI's cache and engine flags
    (same values, same checks, same error messages): ``kv`` is ``--kv-quantize``
    (fp32, fp16, bf16, int8, int4, int2), ``sink`` / ``window`` are
    ``--streaming-llm-sink`` / ``--streaming-llm-window``, ``positions`` is
    ``--streaming-llm-positions``, ``kv_group_size``, ``kv_residual``, ``kv_rotation``,
    ``kv_quantize_k``, ``kv_quantize_v``, ``kv_key_rope`` are ``--kv-group-size``, ...,
    ``weights_dtype`` is ``--weights-dtype``, ``threads`` ``--threads``, ``kernel`` /
    ``kv_kernel`` are ``--kernel`` / ``--kv-kernel`` (e.g. ``kv_kernel="exact"``: the
    reference's bits under KIVI; unset, the flags' defaults, ``TINYGPT_KERNEL`` /
    ``TINYGPT_KV_KERNEL`` when set, else the fastest).

    Raises FileNotFoundError for a missing file, ValueError for a bad option or a file that
    is not a model, each with the CLI's message.
    """

    def __init__(
        self,
        path: Union[str, "os.PathLike[str]", None] = None,
        *,
        kv: str = "fp32",
        sink: Optional[int] = None,
        window: Optional[int] = None,
        kv_group_size: Optional[int] = None,
        kv_residual: Optional[int] = None,
        kv_rotation: str = "auto",
        kv_quantize_k: Optional[str] = None,
        kv_quantize_v: Optional[str] = None,
        weights_dtype: str = "native",
        threads: Optional[int] = None,
        kernel: Optional[str] = None,
        kv_kernel: Optional[str] = None,
        positions: str = "original",
        kv_key_rope: str = "post",
        allow_past_context: bool = False,
    ) -> None:
        flags: List[str] = []
        _flag(flags, "--kv-quantize", kv)
        _flag(flags, "--streaming-llm-sink", sink)
        _flag(flags, "--streaming-llm-window", window)
        _flag(flags, "--streaming-llm-positions", positions)
        _flag(flags, "--kv-group-size", kv_group_size)
        _flag(flags, "--kv-residual", kv_residual)
        _flag(flags, "--kv-rotation", kv_rotation)
        _flag(flags, "--kv-quantize-k", kv_quantize_k)
        _flag(flags, "--kv-quantize-v", kv_quantize_v)
        _flag(flags, "--kv-key-rope", kv_key_rope)
        _flag(flags, "--weights-dtype", weights_dtype)
        _flag(flags, "--threads", threads)
        _flag(flags, "--kernel", kernel)
        _flag(flags, "--kv-kernel", kv_kernel)
        if allow_past_context:
            flags.append("--allow-past-context")
        self._model = _native.Model(None if path is None else os.fspath(path), flags)
        self.model_path: str = self._model.path

    def __repr__(self) -> str:
        return f"tinygpt_cpu.Model({self.model_path!r}, kv={self.kv['quantize']!r})"

    # -- tokens ---------------------------------------------------------------------------

    def tokenize(self, text: Union[str, bytes], add_special_tokens: bool = True) -> List[int]:
        """The tokenizer's ids for ``text`` (with the special tokens it adds, such as BOS)."""
        if isinstance(text, bytes):
            text = text.decode("utf-8")
        return self._model.tokenize(text, add_special_tokens)

    def detokenize(self, ids: Sequence[int]) -> str:
        """The text of ``ids`` (special tokens skipped)."""
        return self._model.detokenize(list(ids))

    def n_vocab(self) -> int:
        """Vocabulary size: the length of a logits row."""
        return self._model.n_vocab

    def n_ctx(self) -> int:
        """The model's context length."""
        return self._model.n_ctx

    @property
    def chat_template(self) -> Optional[str]:
        """The model's chat template (Jinja), if it has one."""
        return self._model.chat_template

    @property
    def kv(self) -> Dict[str, Any]:
        """The cache settings and what the last run's cache held: ``sample --json``'s
        ``kv`` object (``quantize``, ``sink``, ``window``, ``stored_tokens``,
        ``current_length``, ``bytes``, ``layers_with_kv``, ...)."""
        return self._model.kv

    # -- logits and perplexity ------------------------------------------------------------

    def eval_logits(self, ids: Sequence[int]) -> Any:
        """Logits at every position of ``ids``, fed one token at a time through a fresh
        cache configured as this model's: a float32 ``numpy.ndarray`` of shape
        ``(len(ids), n_vocab())``."""
        return self._model.eval_logits(list(ids))

    def perplexity(
        self, text: str, max_tokens: Optional[int] = None, chunk: int = 1024
    ) -> Dict[str, Any]:
        """Teacher-forced perplexity of ``text`` through a fresh cache, as ``tinygpt-cpu
        perplexity --json`` computes it: ``tokens``, ``ppl``, ``nll_mean`` and ``chunks``
        (``start``, ``end``, ``ppl`` per ``chunk`` tokens)."""
        flags: List[str] = []
        _flag(flags, "--max-tokens", max_tokens)
        _flag(flags, "--chunk", chunk)
        return self._model.perplexity(text, flags)

    # -- generation -----------------------------------------------------------------------

    def _generate(
        self,
        prompt: Prompt,
        chat: bool,
        max_tokens: Optional[int],
        temperature: float,
        top_p: float,
        top_k: int,
        seed: Optional[int],
        stop: Stop,
        ignore_eos: bool,
    ) -> _native.Generation:
        flags: List[str] = []
        _flag(flags, "--temperature", temperature)
        _flag(flags, "--top-k", top_k)
        _flag(flags, "--top-p", top_p)
        _flag(flags, "--seed", seed)
        if ignore_eos:
            flags.append("--ignore-eos")
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        if any(not isinstance(s, str) or s == "" for s in stops):
            raise ValueError("stop: each stop string must be a non-empty string")
        if max_tokens is not None and max_tokens <= 0:
            max_tokens = None
        if isinstance(prompt, bytes):
            prompt = prompt.decode("utf-8")
        elif not isinstance(prompt, str):
            prompt = [int(t) for t in prompt]
        return self._model.generate(prompt, flags, max_tokens, stops, chat)

    def generate(
        self,
        prompt: Prompt,
        max_tokens: Optional[int] = 16,
        temperature: float = 0.8,
        top_p: float = 0.95,
        top_k: int = 40,
        seed: Optional[int] = None,
        stop: Stop = None,
        ignore_eos: bool = False,
    ) -> Iterator[int]:
        """The generated token ids, one at a time, as ``sample --json`` lists them in
        ``generated_ids`` (the end-of-sequence token included when generation stops on
        it). Arguments as :meth:`create_completion`."""
        gen = self._generate(
            prompt, False, max_tokens, temperature, top_p, top_k, seed, stop, ignore_eos
        )
        return (t for t, _, _ in gen if t is not None)

    def __call__(
        self,
        prompt: Prompt,
        max_tokens: Optional[int] = 16,
        temperature: float = 0.8,
        top_p: float = 0.95,
        top_k: int = 40,
        seed: Optional[int] = None,
        stop: Stop = None,
        stream: bool = False,
        ignore_eos: bool = False,
    ) -> Union[Dict[str, Any], Iterator[Dict[str, Any]]]:
        """Same as :meth:`create_completion`."""
        return self.create_completion(
            prompt, max_tokens, temperature, top_p, top_k, seed, stop, stream, ignore_eos
        )

    def create_completion(
        self,
        prompt: Prompt,
        max_tokens: Optional[int] = 16,
        temperature: float = 0.8,
        top_p: float = 0.95,
        top_k: int = 40,
        seed: Optional[int] = None,
        stop: Stop = None,
        stream: bool = False,
        ignore_eos: bool = False,
    ) -> Union[Dict[str, Any], Iterator[Dict[str, Any]]]:
        """Continues ``prompt`` (text, or token ids) and returns an OpenAI ``text_completion``
        dict, or with ``stream=True`` an iterator of completion chunks, one per generated
        token (the last one with ``finish_reason`` and ``usage``).

        ``temperature`` 0 is greedy; ``top_k`` 0 and ``top_p`` 1 turn those filters off;
        ``seed`` None draws one from the clock. ``max_tokens`` None (or <= 0) generates up
        to the context length. Generation ends at the model's end-of-sequence token
        (unless ``ignore_eos``) or before the first ``stop`` string. Options are checked
        as ``tinygpt-cpu sample`` checks them (ValueError with its message); Ctrl-C raises
        KeyboardInterrupt within one token.
        """
        gen = self._generate(
            prompt, False, max_tokens, temperature, top_p, top_k, seed, stop, ignore_eos
        )
        cid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        if stream:
            return self._completion_chunks(gen, cid, created)
        text = "".join(t for _, t, _ in gen)
        return {
            "id": cid,
            "object": "text_completion",
            "created": created,
            "model": self.model_path,
            "choices": [
                {"text": text, "index": 0, "logprobs": None, "finish_reason": gen.finish_reason}
            ],
            "usage": _usage(gen),
        }

    def _completion_chunks(
        self, gen: _native.Generation, cid: str, created: int
    ) -> Iterator[Dict[str, Any]]:
        for _, text, finish in gen:
            chunk: Dict[str, Any] = {
                "id": cid,
                "object": "text_completion",
                "created": created,
                "model": self.model_path,
                "choices": [
                    {"text": text, "index": 0, "logprobs": None, "finish_reason": finish}
                ],
            }
            if finish is not None:
                chunk["usage"] = _usage(gen)
            yield chunk

    def create_chat_completion(
        self,
        messages: Sequence[Message],
        max_tokens: Optional[int] = None,
        temperature: float = 0.2,
        top_p: float = 0.95,
        top_k: int = 40,
        seed: Optional[int] = None,
        stop: Stop = None,
        stream: bool = False,
        ignore_eos: bool = False,
    ) -> Union[Dict[str, Any], Iterator[Dict[str, Any]]]:
        """Replies to ``messages`` (dicts with ``role`` and ``content``: a string, or a list
        of ``{"type": "text", "text": ...}`` parts) rendered with the model's chat template,
        as ``tinygpt-cpu sample --chat`` renders one user message. Returns an OpenAI
        ``chat.completion`` dict, or with ``stream=True`` an iterator of
        ``chat.completion.chunk`` dicts: the assistant role first, then one per generated
        token. Other arguments as :meth:`create_completion`."""
        text = self._model.render_chat(_chat_pairs(messages))
        gen = self._generate(
            text, True, max_tokens, temperature, top_p, top_k, seed, stop, ignore_eos
        )
        cid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        if stream:
            return self._chat_chunks(gen, cid, created)
        content = "".join(t for _, t, _ in gen)
        return {
            "id": cid,
            "object": "chat.completion",
            "created": created,
            "model": self.model_path,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": content},
                    "logprobs": None,
                    "finish_reason": gen.finish_reason,
                }
            ],
            "usage": _usage(gen),
        }

    def _chat_chunks(
        self, gen: _native.Generation, cid: str, created: int
    ) -> Iterator[Dict[str, Any]]:
        def chunk(delta: Dict[str, Any], finish: Optional[str]) -> Dict[str, Any]:
            return {
                "id": cid,
                "object": "chat.completion.chunk",
                "created": created,
                "model": self.model_path,
                "choices": [
                    {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
                ],
            }

        yield chunk({"role": "assistant", "content": ""}, None)
        for _, text, finish in gen:
            c = chunk({"content": text} if text or finish is None else {}, finish)
            if finish is not None:
                c["usage"] = _usage(gen)
            yield c


def _usage(gen: _native.Generation) -> Dict[str, int]:
    p, c = gen.prompt_tokens, gen.completion_tokens
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


def _chat_pairs(messages: Sequence[Message]) -> List[Tuple[str, str]]:
    """``messages`` as (role, text) pairs; content parts other than text are refused."""
    pairs = []
    for i, m in enumerate(messages):
        role = m.get("role") if isinstance(m, dict) else None
        if not isinstance(role, str):
            raise ValueError(f"messages[{i}]: each message needs a string 'role'")
        content = m.get("content")
        if content is None:
            text = ""
        elif isinstance(content, str):
            text = content
        elif isinstance(content, list) and all(
            isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
            for p in content
        ):
            text = "".join(p["text"] for p in content)
        else:
            raise ValueError(
                f"messages[{i}]: 'content' must be a string or a list of text parts"
            )
        pairs.append(("system" if role == "developer" else role, text))
    if not pairs:
        raise ValueError("messages: must not be empty")
    return pairs
