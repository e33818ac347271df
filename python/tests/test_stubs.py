"""The type stubs (`tinygpt_cpu/_native.pyi`) say what the extension really has, and the
package's own annotations agree with them (mypy's stubtest and `mypy --strict`)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("mypy", reason="mypy is not installed")

from conftest import REPO  # noqa: E402


def mypy(args: list, cache: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, MYPY_CACHE_DIR=str(cache))
    return subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True, env=env, timeout=600)


def test_stubs_match_the_extension(tmp_path: Path) -> None:
    p = mypy(["mypy.stubtest", "tinygpt_cpu"], tmp_path)
    assert p.returncode == 0, p.stdout + p.stderr


def test_package_annotations_type_check(tmp_path: Path) -> None:
    """The package's source type-checks strictly against the stub beside it."""
    p = mypy(["mypy", "--strict", str(REPO / "python/tinygpt_cpu/__init__.py")], tmp_path)
    assert p.returncode == 0, p.stdout + p.stderr
