#!/usr/bin/env python3
"""`tinygpt-cpu serve` spoken to by the official `openai` Python package.

Starts the release binary on an ephemeral loopback port, then: /v1/models; completions and
chat completions, streaming and not; greedy output equal to `sample --temperature 0`; a
second chat turn resumed from the prompt cache (`usage.prompt_tokens_details`);
8 concurrent requests; a 400 for a bad field; SIGTERM drains and exits 0.

    python tests/openai_client.py [--bin target/release/tinygpt-cpu] [--model GGUF]

The model defaults to $TINYGPT_SMOLLM2 (SmolLM2 GGUF, which has a chat template); without
it the bundled model is used and the chat checks are skipped (it has no chat template).
Run by .ci/run after `pip install openai`. Loopback only, every request bounded in tokens
and time.
"""

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import openai

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def sample(binary, model, prompt, tokens, flags, chat):
    cmd = [binary, "sample"] + ([model] if model else [])
    cmd += ["--prompt", prompt, "--temperature", "0", "--json", "--tokens", str(tokens)] + flags
    if chat:
        cmd.append("--chat")
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=300)
    return json.loads(out.stdout)["text"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", default=os.path.join(ROOT, "target", "release", "tinygpt-cpu"))
    ap.add_argument("--model", default=os.environ.get("TINYGPT_SMOLLM2"))
    a = ap.parse_args()
    model = a.model if a.model and os.path.exists(a.model) else None
    flags = ["--streaming-llm-sink", "4", "--streaming-llm-window", "252", "--kv-quantize", "int4"]
    cmd = [a.bin, "serve"] + ([model] if model else []) + flags
    cmd += ["--host", "127.0.0.1", "--port", "0", "--max-sequences", "16"]
    srv = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    try:
        line = srv.stdout.readline()
        base = next(w for w in line.split() if w.startswith("http://"))
        print(f"server: {line.strip()}")
        client = openai.OpenAI(base_url=base + "/v1", api_key="none", timeout=300, max_retries=0)
        run_checks(client, a.bin, model, flags)
        srv.send_signal(signal.SIGTERM)
        rc = srv.wait(timeout=60)
        assert rc == 0, f"server exit status {rc} after SIGTERM"
        print("ok: SIGTERM -> exit 0")
    finally:
        if srv.poll() is None:
            srv.kill()
            srv.wait()
    print("openai client: all checks passed")


def run_checks(client, binary, model, flags):
    models = client.models.list()
    mid = models.data[0].id
    print(f"ok: models.list -> {mid}")
    has_chat = model is not None

    # Completions, greedy, equal to the CLI.
    prompt = "The capital of France is" if model else "The"
    c = client.completions.create(model=mid, prompt=prompt, max_tokens=24, temperature=0)
    want = sample(binary, model, prompt, 24, flags, chat=False)
    assert c.choices[0].text == want, (c.choices[0].text, want)
    assert c.usage.completion_tokens <= 24 and c.choices[0].finish_reason in ("stop", "length")
    # The prompt cache's usage field, as the client parses it (nothing kept before).
    assert c.usage.prompt_tokens_details.cached_tokens == 0, c.usage
    print(f"ok: completion (greedy) == sample: {want!r}")

    # Streaming completion == non-streaming with the same seed.
    kw = dict(model=mid, prompt="Once upon a time", max_tokens=32, temperature=0.8, seed=11,
              extra_body={"top_k": 40, "ignore_eos": True})
    whole = client.completions.create(**kw).choices[0].text
    parts = [ch.choices[0].text for ch in client.completions.create(stream=True, **kw) if ch.choices]
    assert "".join(parts) == whole, (parts, whole)
    assert len(parts) > 2
    print(f"ok: streamed completion ({len(parts)} chunks) == non-streamed")

    if has_chat:
        q = "What is the capital of France?"
        msgs = [{"role": "user", "content": q}]
        r = client.chat.completions.create(model=mid, messages=msgs, max_tokens=40, temperature=0)
        want = sample(binary, model, q, 40, flags, chat=True)
        assert r.choices[0].message.content == want, (r.choices[0].message.content, want)
        assert r.choices[0].message.role == "assistant"
        print(f"ok: chat (greedy) == sample --chat: {want!r}")
        stream = client.chat.completions.create(model=mid, messages=msgs, max_tokens=40,
                                                temperature=0, stream=True)
        text = "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices)
        assert text == want, (text, want)
        print("ok: streamed chat == non-streamed")
        # The next turn resumes from the kept cache, and answers what recomputing answers.
        turn2 = msgs + [{"role": "assistant", "content": want},
                        {"role": "user", "content": "And of Germany?"}]
        r2 = client.chat.completions.create(model=mid, messages=turn2, max_tokens=24, temperature=0)
        fresh = client.chat.completions.create(model=mid, messages=turn2, max_tokens=24, temperature=0,
                                               extra_body={"cache_prompt": False})
        cached = r2.usage.prompt_tokens_details.cached_tokens
        assert 0 < cached < r2.usage.prompt_tokens, r2.usage
        assert fresh.usage.prompt_tokens_details.cached_tokens == 0, fresh.usage
        assert r2.choices[0].message.content == fresh.choices[0].message.content
        print(f"ok: second turn resumed {cached} of {r2.usage.prompt_tokens} prompt tokens, same reply")
    else:
        print("skip: chat (the bundled model has no chat template; set TINYGPT_SMOLLM2)")

    # 8 concurrent requests: chat and completion, streaming and not.
    def one(i):
        t0 = time.time()
        if has_chat and i % 2 == 0:
            msgs = [{"role": "user", "content": f"Count to {i + 3}."}]
            if i % 4 == 0:
                s = client.chat.completions.create(model=mid, messages=msgs, max_tokens=24,
                                                   temperature=0.7, seed=i, stream=True)
                text = "".join(ch.choices[0].delta.content or "" for ch in s if ch.choices)
            else:
                r = client.chat.completions.create(model=mid, messages=msgs, max_tokens=24,
                                                   temperature=0.7, seed=i)
                text = r.choices[0].message.content
        else:
            if i % 4 == 1:
                s = client.completions.create(model=mid, prompt=f"Story {i}:", max_tokens=24,
                                              temperature=0.7, seed=i, stream=True)
                text = "".join(ch.choices[0].text for ch in s if ch.choices)
            else:
                r = client.completions.create(model=mid, prompt=f"Story {i}:", max_tokens=24,
                                              temperature=0.7, seed=i)
                text = r.choices[0].text
        return i, text, time.time() - t0

    with ThreadPoolExecutor(8) as ex:
        results = list(ex.map(one, range(8)))
    for i, text, secs in results:
        assert isinstance(text, str), (i, text)
    print(f"ok: 8 concurrent requests in {max(r[2] for r in results):.1f}s")

    # A bad field is a 400 naming it.
    try:
        client.completions.create(model=mid, prompt="x", max_tokens=4, temperature=-1)
        raise AssertionError("temperature -1 accepted")
    except openai.BadRequestError as e:
        assert "temperature" in str(e), str(e)
    try:
        client.completions.create(model=mid, prompt="x", max_tokens=4,
                                  extra_body={"kv_quantize": "int3"})
        raise AssertionError("kv_quantize int3 accepted")
    except openai.BadRequestError as e:
        assert "kv_quantize" in str(e), str(e)
    print("ok: 400 names the field")


if __name__ == "__main__":
    sys.exit(main())
