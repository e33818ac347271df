"""Threads and signals: a model shared by threads gives each the result it gives alone;
the interpreter is released while the engine computes; Ctrl-C (SIGINT) stops a
generation, `eval_logits` and `perplexity` within a step."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from typing import List

import numpy as np

import tinygpt_cpu


def test_two_threads_share_a_model(tiny) -> None:
    alone = tiny("Once upon a time", max_tokens=60, temperature=0, ignore_eos=True)["choices"][0]["text"]
    logits_alone = tiny.eval_logits(list(range(2, 80)))
    results: List[object] = [None] * 4
    errors: List[BaseException] = []

    def work(i: int) -> None:
        try:
            if i % 2 == 0:
                out = tiny("Once upon a time", max_tokens=60, temperature=0, ignore_eos=True)
                results[i] = out["choices"][0]["text"]
            else:
                results[i] = tiny.eval_logits(list(range(2, 80)))
        except BaseException as e:  # noqa: BLE001 (reported below)
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert results[0] == results[2] == alone
    assert np.array_equal(results[1], logits_alone) and np.array_equal(results[3], logits_alone)


def test_the_interpreter_runs_while_the_engine_computes(smollm2_path, heldout: str) -> None:
    """A long prompt's prefill is one engine call of seconds: while a thread runs it, the
    main thread keeps running Python. Were the interpreter held during the call, the main
    loop would stall for about the whole call."""
    m = tinygpt_cpu.Model(smollm2_path, sink=4, window=252, threads=1)
    ids = m.tokenize(heldout)[:400]
    done = threading.Event()
    worker = threading.Thread(target=lambda: (list(m.generate(ids, max_tokens=1)), done.set()))
    t0 = time.perf_counter()
    worker.start()
    longest, last = 0.0, time.perf_counter()
    while not done.is_set():
        now = time.perf_counter()
        longest, last = max(longest, now - last), now
    took = time.perf_counter() - t0
    worker.join()
    assert took > 0.5, took  # the call is long enough to tell
    assert longest < took / 3, (longest, took)


CHILD = """
import sys, time
import tinygpt_cpu
m = tinygpt_cpu.Model(sink=4, window=60)
what = sys.argv[1]
text = open(sys.argv[2], encoding="utf-8").read()
print("ready", flush=True)
t = time.perf_counter()
try:
    if what == "generate":
        m("Once upon a time", max_tokens=10**9, temperature=0.8, ignore_eos=True)
    elif what == "stream":
        for _ in m("Once upon a time", max_tokens=10**9, ignore_eos=True, stream=True):
            pass
    elif what == "eval_logits":
        while True:
            m.eval_logits(m.tokenize(text)[:250])
    elif what == "perplexity":
        while True:
            m.perplexity(text, max_tokens=250)
    print("finished", flush=True)
except KeyboardInterrupt:
    print("interrupted", flush=True)
"""


def run_and_interrupt(what: str, heldout_path: str) -> str:
    p = subprocess.Popen(
        [sys.executable, "-c", CHILD, what, heldout_path],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    assert p.stdout is not None
    assert p.stdout.readline().strip() == "ready"
    time.sleep(1.0)
    p.send_signal(signal.SIGINT)
    t0 = time.perf_counter()
    out, err = p.communicate(timeout=60)
    assert time.perf_counter() - t0 < 10, "slow to stop"
    assert p.returncode == 0, err
    return out.strip()


def test_ctrl_c_stops_each_kind_of_run() -> None:
    from conftest import REPO

    heldout = str(REPO / "fixtures/heldout.txt")
    for what in ["generate", "stream", "eval_logits", "perplexity"]:
        assert run_and_interrupt(what, heldout) == "interrupted", what
