"""Shared fixtures of the tinygpt_cpu tests.

The independent sources the package is checked against:

* the `tinygpt-cpu` binary (``TINYGPT_BIN``, default ``target/release/tinygpt-cpu``, which
  ``cargo test --release`` builds): ``sample --json`` for greedy ids and text, ``perplexity
  --json`` (``--engine reference``: the scalar reference crate) for logits, and its error
  lines for the error messages;
* PyTorch/transformers logits of the bundled model (``fixtures/golden/tiny.json``);
* the ``openai`` package's response types.

Real-model tests use SmolLM2-135M (``TINYGPT_SMOLLM2``, else the path
``scripts/fetch-smollm2.sh`` downloads to) and skip, saying so, when it is absent; tests
that need the binary skip likewise when it has not been built.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any, Dict, List, Optional

import pytest

import tinygpt_cpu

REPO = Path(__file__).resolve().parents[2]
SMOLLM2_DEFAULT = Path.home() / ".cache/tinygpt-cpu/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def _bin() -> Optional[Path]:
    given = os.environ.get("TINYGPT_BIN")
    if given:
        path = Path(given)
        if not path.is_file():
            raise FileNotFoundError(f"TINYGPT_BIN={given} does not exist")
        return path
    path = REPO / "target/release/tinygpt-cpu"
    return path if path.is_file() else None


@pytest.fixture(scope="session")
def cli_bin() -> Path:
    path = _bin()
    if path is None:
        pytest.skip("no tinygpt-cpu binary: run `cargo build --release` or set TINYGPT_BIN")
    return path


class Cli:
    """Runs the tinygpt-cpu binary."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def run(self, args: List[str], env: Optional[Dict[str, str]] = None) -> subprocess.CompletedProcess:
        full_env = dict(os.environ, **(env or {}))
        return subprocess.run(
            [str(self.path), *args], capture_output=True, text=True, env=full_env, timeout=600
        )

    def json(self, args: List[str], env: Optional[Dict[str, str]] = None) -> Dict[str, Any]:
        p = self.run([*args, "--json"], env)
        assert p.returncode == 0, p.stderr
        return json.loads(p.stdout)

    def error(self, args: List[str]) -> str:
        """The one-line error the CLI prints, without its "error: " prefix."""
        p = self.run(args)
        assert p.returncode != 0, p.stdout
        line = p.stderr.strip().splitlines()[0]
        assert line.startswith("error: "), p.stderr
        return line[len("error: ") :]


@pytest.fixture(scope="session")
def cli(cli_bin: Path) -> Cli:
    return Cli(cli_bin)


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    path = Path(os.environ.get("TINYGPT_SMOLLM2") or SMOLLM2_DEFAULT)
    if not path.is_file():
        pytest.skip(f"SmolLM2 not found at {path}: run scripts/fetch-smollm2.sh or set TINYGPT_SMOLLM2")
    return path


@pytest.fixture(scope="session")
def tiny() -> tinygpt_cpu.Model:
    """The bundled model with a dense fp32 cache."""
    return tinygpt_cpu.Model()


@pytest.fixture(scope="session")
def heldout() -> str:
    return (REPO / "fixtures/heldout.txt").read_text(encoding="utf-8")
