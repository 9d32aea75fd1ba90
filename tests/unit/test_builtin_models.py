"""Built-in models in the shared cache: concurrent builders, half-built directories, the completeness marker.

The defect these guard against: ranks starting at once on a cold cache, or a cache
left holding only tokenizer files by an interrupted build, made ``resolve_model_path``
return a directory that ``from_pretrained`` rejects ("Unrecognized model ... Should
have a model_type key"), and the incomplete directory poisoned every later run.
"""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

MARKER = ".hybrid_rl_complete"  # spelled out, not imported, so the tests also run (and fail) on code without it
NAME = "tiny-qwen2"
REPO = Path(__file__).resolve().parents[2]

# One rank: imports first, then waits at a file barrier so that every rank calls
# resolve_model_path at the same moment; then loads the model as the trainer would.
CHILD = r"""
import json, os, sys, time
cache, barrier, idx, no_lock = sys.argv[1:5]
os.environ["HYBRID_RL_CACHE"] = cache
import fcntl, torch
torch.set_num_threads(1)
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
from hybrid_rl.models import resolve_model_path
if no_lock == "1":
    fcntl.flock = lambda *a, **k: None  # hosts sharing an NFS cache: each host's lock excludes nobody else
open(os.path.join(barrier, "ready" + idx), "w").close()
while not os.path.exists(os.path.join(barrier, "go")):
    time.sleep(0.005)
path = resolve_model_path("builtin:tiny-qwen2")
files = sorted(os.listdir(path))
config = AutoConfig.from_pretrained(path)
model = AutoModelForCausalLM.from_pretrained(path)
tok = AutoTokenizer.from_pretrained(path)
assert tok.chat_template
print("RESULT " + json.dumps(dict(path=path, files=files, model_type=config.model_type,
                                 params=sum(p.numel() for p in model.parameters()))))
"""


def _run_ranks(cache: Path, barrier: Path, n: int, no_lock: bool) -> list[dict]:
    barrier.mkdir()
    env = dict(os.environ, PYTHONPATH=str(REPO), HYBRID_RL_CACHE=str(cache), OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, "-c", CHILD, str(cache), str(barrier), str(i), "1" if no_lock else "0"],
                              cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in range(n)]
    try:
        deadline = time.monotonic() + 180
        while sum((barrier / f"ready{i}").exists() for i in range(n)) < n:
            if any(p.poll() is not None for p in procs) or time.monotonic() > deadline:
                break
            time.sleep(0.02)
        (barrier / "go").touch()
        outs = [p.communicate(timeout=600) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    results = []
    for i, (p, (out, err)) in enumerate(zip(procs, outs)):
        assert p.returncode == 0, f"rank {i} failed:\n{err[-3000:]}"
        results.append(json.loads(next(line for line in out.splitlines() if line.startswith("RESULT "))[7:]))
    return results


def _check_ranks(results: list[dict], cache: Path) -> None:
    assert {r["path"] for r in results} == {str(cache / NAME)}
    for r in results:
        assert r["model_type"] == "qwen2" and r["params"] > 0
        assert MARKER in r["files"] and "config.json" in r["files"] and "tokenizer_config.json" in r["files"]
    assert sorted(p.name for p in cache.iterdir() if not p.name.endswith(".lock")) == [NAME], "temporary build directories left behind"


def _write_partial(out: Path) -> None:
    """What the failed 4-GPU run left: tokenizer files only, no config.json, no weights."""
    from hybrid_rl.models import build_tiny_tokenizer

    out.mkdir(parents=True)
    build_tiny_tokenizer().save_pretrained(out)


# Four processes each importing torch and transformers: 25-65 s on the shared 2-core machine.
@pytest.mark.slow
def test_ranks_on_a_cold_cache_all_load_the_model(tmp_path):
    cache = tmp_path / "cache"
    _check_ranks(_run_ranks(cache, tmp_path / "barrier", n=4, no_lock=False), cache)


@pytest.mark.slow
def test_ranks_without_a_working_lock_replace_a_partial_directory(tmp_path):
    # Several hosts on one NFS cache (fcntl locks exclude nobody) meeting the half-built
    # directory of an earlier run: every rank must still end up with the complete model.
    cache = tmp_path / "cache"
    _write_partial(cache / NAME)
    _check_ranks(_run_ranks(cache, tmp_path / "barrier", n=4, no_lock=True), cache)


def _load(path: str) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    assert AutoConfig.from_pretrained(path).model_type == "qwen2"
    AutoModelForCausalLM.from_pretrained(path)


def test_partial_directory_is_rebuilt(tmp_path, monkeypatch):
    from hybrid_rl.models import resolve_model_path

    monkeypatch.setenv("HYBRID_RL_CACHE", str(tmp_path))
    _write_partial(tmp_path / NAME)
    path = resolve_model_path(f"builtin:{NAME}")
    _load(path)  # the old code returned the tokenizer-only directory: "Unrecognized model ... model_type"
    assert (Path(path) / MARKER).exists()
    assert [p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock")] == [NAME]


def _empty(out: Path) -> None:
    out.mkdir(parents=True)


def _weights_without_tokenizer(out: Path) -> None:
    import torch

    from hybrid_rl.models import TINY_CONFIG, write_random_model

    write_random_model(out, dict(TINY_CONFIG, vocab_size=128), dtype=torch.float32)


def _legacy_complete(out: Path) -> None:
    # A whole directory written by the code before the marker existed: rebuilt, because
    # without the marker a complete build cannot be told from one cut off mid-write.
    from hybrid_rl.models import build_tiny_model

    build_tiny_model(out)
    (out / MARKER).unlink(missing_ok=True)


def _wrong_marker(out: Path) -> None:
    from hybrid_rl.models import build_tiny_model

    build_tiny_model(out)
    (out / MARKER).write_text('{"stamp": "from-another-builder-version"}')


def _truncated_marker(out: Path) -> None:
    _write_partial(out)
    (out / MARKER).write_text("")


def _marker_without_weights(out: Path) -> None:
    # what a rank > 0 build left before save_on_any_rank: a valid marker over tokenizer files only
    from hybrid_rl.models import build_tiny_model

    build_tiny_model(out)
    for name in ("config.json", "generation_config.json", "model.safetensors"):
        (out / name).unlink()


def _a_file(out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("not a model")


@pytest.mark.parametrize("make", [_empty, _write_partial, _weights_without_tokenizer, _legacy_complete, _wrong_marker,
                                  _truncated_marker, _marker_without_weights, _a_file])
def test_resolve_never_returns_a_directory_without_a_valid_marker(tmp_path, monkeypatch, make):
    import hybrid_rl.models as models

    monkeypatch.setenv("HYBRID_RL_CACHE", str(tmp_path))
    make(tmp_path / NAME)
    path = Path(models.resolve_model_path(f"builtin:{NAME}"))
    assert path == tmp_path / NAME and path.is_dir()
    marker = json.loads((path / MARKER).read_text())
    assert marker["arch"] == NAME and marker["stamp"] != "from-another-builder-version"
    _load(str(path))
    assert [p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock")] == [NAME]


def test_complete_directory_is_read_without_rebuilding(tmp_path, monkeypatch):
    import hybrid_rl.models as models

    monkeypatch.setenv("HYBRID_RL_CACHE", str(tmp_path))
    first = models.resolve_model_path(f"builtin:{NAME}")
    before = (Path(first) / "config.json").stat().st_mtime_ns

    def no_build(*a, **k):
        raise AssertionError("rebuilt a complete directory")

    monkeypatch.setattr(models, "_write_model", no_build)
    assert models.resolve_model_path(f"builtin:{NAME}") == first
    assert (Path(first) / "config.json").stat().st_mtime_ns == before


def test_build_failure_is_one_line_naming_the_cache_and_the_fix(tmp_path, monkeypatch):
    import hybrid_rl.models as models

    # The cache path runs through a regular file: nothing can be created there (works as root too).
    (tmp_path / "a_file").write_text("")
    monkeypatch.setenv("HYBRID_RL_CACHE", str(tmp_path / "a_file" / "cache"))
    with pytest.raises(models.ModelLoadError) as e:
        models.resolve_model_path(f"builtin:{NAME}")
    msg = str(e.value)
    assert "\n" not in msg and str(tmp_path / "a_file" / "cache") in msg and "HYBRID_RL_CACHE" in msg

    # Disk full halfway through writing the weights: the same message, and no temporary directory left behind.
    monkeypatch.setenv("HYBRID_RL_CACHE", str(tmp_path / "cache"))

    def disk_full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(models, "_write_model", disk_full)
    with pytest.raises(models.ModelLoadError) as e:
        models.resolve_model_path(f"builtin:{NAME}")
    msg = str(e.value)
    assert "\n" not in msg and "No space left" in msg and str(tmp_path / "cache") in msg and "HYBRID_RL_CACHE" in msg
    assert [p.name for p in (tmp_path / "cache").iterdir() if not p.name.endswith(".lock")] == []


RANK1_BUILDS = r"""
import json, os, sys
cache, store, rank = sys.argv[1], sys.argv[2], int(sys.argv[3])
os.environ["HYBRID_RL_CACHE"] = cache
import torch, torch.distributed as dist
torch.set_num_threads(1)
dist.init_process_group("gloo", init_method="file://" + store, rank=rank, world_size=2)
from hybrid_rl.models import load_causal_lm, resolve_model_path
if rank == 1:  # rank 1 alone meets the cold cache and builds
    path = resolve_model_path("builtin:tiny-qwen2")
dist.barrier()
path = resolve_model_path("builtin:tiny-qwen2")
model = load_causal_lm(path, torch.float32)
print("RESULT " + json.dumps(dict(rank=rank, files=sorted(os.listdir(path)))))
dist.destroy_process_group()
"""


@pytest.mark.slow
def test_a_nonzero_rank_builds_a_complete_model(tmp_path):
    """Regression (4×H100): transformers' save_pretrained writes on global rank 0 only once torch.distributed is up,
    so a build by rank 1 left the tokenizer files and the marker but no config or weights, and every rank failed with
    'Unrecognized model'. Here rank 1 of a 2-rank gloo group builds on a cold cache; both ranks must load the model."""
    cache, store = tmp_path / "cache", tmp_path / "store"
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, "-c", RANK1_BUILDS, str(cache), str(store), str(r)], cwd=REPO, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(2)]
    outs = [p.communicate(timeout=600) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err[-2000:]
        files = json.loads(out.split("RESULT ", 1)[1])["files"]
        assert "config.json" in files and "model.safetensors" in files and MARKER in files


def test_a_cache_that_cannot_be_written_is_named_with_how_to_point_elsewhere(tmp_path, monkeypatch):
    """Permission denied (not a full disk): the rank's build and the preflight both say the cache is not writable
    and how to point HYBRID_RL_CACHE elsewhere, never to free space; nothing is created."""
    import hybrid_rl.models as models
    from hybrid_rl import preflight as pf
    from hybrid_rl.config import load_config
    from helpers import unwritable_dir

    with unwritable_dir(tmp_path / "locked") as locked:
        monkeypatch.setenv("HYBRID_RL_CACHE", str(locked))
        with pytest.raises(models.ModelLoadError) as build:
            models.resolve_model_path(f"builtin:{NAME}")
        with pytest.raises(models.ModelLoadError) as checked:
            pf.preflight(load_config(REPO / "recipes" / "cpu_successor.yaml"))
        assert list(locked.iterdir()) == []
    for msg in (str(build.value), str(checked.value)):
        assert f"the cache {locked} ($HYBRID_RL_CACHE) is not writable" in msg, msg
        assert "point HYBRID_RL_CACHE at a directory you can write" in msg and "free space" not in msg, msg
        assert "\n" not in msg
