"""`eval_logits` and `perplexity` against independent sources.

* The scalar reference crate, through `tinygpt-cpu perplexity --engine reference --chunk 1
  --json`: each chunk is one prediction, so `log(ppl)` is the negative log-probability of
  each next token, computed from the reference's full logits row (its log-softmax). The
  package's `eval_logits` rows give the same numbers to 1e-9 (float64 summation order
  only: a changed logit moves them by ~1e-7). Both run the `portable` KIVI kernels
  (`TINYGPT_KV_KERNEL`), whose bits the reference reproduces (docs/design.md §6), so the
  package runs in a child interpreter with that variable set.
* PyTorch/transformers logits of the bundled model (`fixtures/golden/tiny.json`, 200
  positions, full rows at five of them): within the reference-vs-transformers budget.
* `perplexity --json` of the same engine and cache: the same object, exactly.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from typing import Any, Dict, List

import numpy as np
import pytest

import tinygpt_cpu
from conftest import REPO

HELDOUT = str(REPO / "fixtures/heldout.txt")
BOUNDED = {"sink": 4, "window": 28, "kv": "int4"}
BOUNDED_FLAGS = ["--streaming-llm-sink", "4", "--streaming-llm-window", "28", "--kv-quantize", "int4"]


def nll_rows(logits: np.ndarray, targets: List[int]) -> np.ndarray:
    """-log softmax(row)[target] for each row, in float64."""
    x = logits.astype(np.float64)
    top = x.max(axis=1)
    lse = top + np.log(np.exp(x - top[:, None]).sum(axis=1))
    return lse - x[np.arange(len(targets)), targets]


def cli_nll(cli, args: List[str], env: Dict[str, str]) -> List[float]:
    out = cli.json(["perplexity", *args, "--chunk", "1"], env=env)
    return [math.log(c["ppl"]) for c in out["chunks"]]


CHILD = """
import json, sys
import numpy as np
import tinygpt_cpu
path, kwargs, n = json.loads(sys.argv[1])
m = tinygpt_cpu.Model(path, **kwargs)
ids = m.tokenize(open(sys.argv[2], encoding="utf-8").read())[:n]
x = m.eval_logits(ids).astype(np.float64)
top = x.max(axis=1)
lse = top + np.log(np.exp(x - top[:, None]).sum(axis=1))
nll = lse[:-1] - x[np.arange(n - 1), ids[1:]]
print(json.dumps({"shape": list(m.eval_logits(ids[:3]).shape), "nll": nll.tolist()}))
"""


@pytest.mark.parametrize(
    "kwargs,flags", [({}, []), (BOUNDED, BOUNDED_FLAGS)], ids=["dense", "sink4-window28-int4"]
)
def test_eval_logits_equal_reference_engine(cli, kwargs: Dict[str, Any], flags: List[str]) -> None:
    n = 120
    env = {"TINYGPT_KV_KERNEL": "portable"}
    want = cli_nll(cli, ["--text", HELDOUT, "--max-tokens", str(n), "--engine", "reference", *flags], env)
    child = subprocess.run(
        [sys.executable, "-c", CHILD, json.dumps([None, kwargs, n]), HELDOUT],
        capture_output=True, text=True, env=dict(os.environ, **env), timeout=600,
    )
    assert child.returncode == 0, child.stderr
    got = json.loads(child.stdout)
    assert got["shape"] == [3, 2048]
    assert len(got["nll"]) == len(want) == n - 1
    np.testing.assert_allclose(got["nll"], want, rtol=0, atol=1e-9)


def test_eval_logits_match_transformers(tiny) -> None:
    golden = json.loads((REPO / "fixtures/golden/tiny.json").read_text())
    ids = golden["long_prompt_ids"]
    logits = tiny.eval_logits(ids)
    assert logits.dtype == np.float32 and logits.shape == (len(ids), 2048)
    for pos, row in golden["long_prompt_logits"].items():
        # The reference-vs-transformers budget (docs/design.md §6) plus engine-vs-reference.
        np.testing.assert_allclose(logits[int(pos)], np.array(row, dtype=np.float32), rtol=0, atol=1.1e-3)
    kv = tiny.kv
    assert kv["current_length"] == kv["stored_tokens"] == len(ids)


@pytest.mark.parametrize(
    "kwargs,flags", [({}, []), (BOUNDED, BOUNDED_FLAGS)], ids=["dense", "sink4-window28-int4"]
)
def test_perplexity_equals_cli(cli, heldout: str, kwargs: Dict[str, Any], flags: List[str]) -> None:
    m = tinygpt_cpu.Model(**kwargs)
    want = cli.json(["perplexity", "--text", HELDOUT, "--max-tokens", "200", "--chunk", "64", *flags])
    got = m.perplexity(heldout, max_tokens=200, chunk=64)
    assert got == want
    assert [c["end"] for c in got["chunks"]] == [64, 128, 192, 200]


def test_eval_logits_equal_perplexity_smollm2_int4(cli, smollm2_path, heldout: str) -> None:
    """SmolLM2 through a bounded int4 cache that evicts: eval_logits' rows give the
    per-token NLL `perplexity` computes from the same engine's rows."""
    n = 64
    m = tinygpt_cpu.Model(smollm2_path, **BOUNDED)
    want = cli_nll(cli, [str(smollm2_path), "--text", HELDOUT, "--max-tokens", str(n), *BOUNDED_FLAGS], {})
    ids = m.tokenize(heldout)[:n]
    logits = m.eval_logits(ids)
    assert logits.shape == (n, m.n_vocab())
    np.testing.assert_allclose(nll_rows(logits[:-1], ids[1:]), want, rtol=0, atol=1e-9)
    kv = m.kv
    assert kv["stored_tokens"] == 32 and kv["current_length"] == n
