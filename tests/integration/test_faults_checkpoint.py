"""Checkpoint faults: a broken ``latest``, a damaged checkpoint, a checkpoint write that
fails. Each ends in one line and loses nothing complete; resume=auto continues from the newest intact checkpoint with
the per-step metrics of an uninterrupted run. Tiny in-process runs of the CPU recipe (seconds each)."""

from __future__ import annotations

import errno
import os
import shutil
from collections import namedtuple
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from helpers import cpu_dist
from hybrid_rl import checkpoint as ckpt_mod
from hybrid_rl.checkpoint import saving as ckpt_saving
from hybrid_rl.checkpoint import (COMPLETE, CheckpointError, CorruptCheckpointError, find_latest, load_checkpoint,
                                  save_checkpoint)
from hybrid_rl.config import load_config
from hybrid_rl.trainer import Trainer

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "recipes" / "cpu_successor.yaml"
SMALL = ["data.num_synthetic=64", "data.train_batch_size=4", "rollout.n=4", "actor.ppo_mini_batch_size=4",
         "actor.ppo_micro_batch_size_per_device=16", "data.max_val_samples=4", "trainer.logger=[jsonl]",
         "trainer.total_steps=3", "trainer.save_freq=1", "trainer.keep_last=0", "trainer.test_freq=0",
         "trainer.val_before_train=false"]
STEP1, STEP2, STEP3 = "step_00000001", "step_00000002", "step_00000003"


def _train(out: Path, *overrides: str) -> list[dict]:
    return Trainer(load_config(RECIPE, [*SMALL, f"trainer.output_dir={out}", *overrides]).validate(), cpu_dist()).fit()


def _same(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith(("timing/", "perf/"))} for r in rows]


@pytest.fixture(scope="module")
def full_run(tmp_path_factory) -> tuple[Path, list[dict]]:
    """An uninterrupted 3-step run with a checkpoint after every step, and its per-step metrics."""
    out = tmp_path_factory.mktemp("faults") / "run"
    return out, _same(_train(out))


@pytest.fixture
def at_step2(full_run, tmp_path) -> Path:
    """A copy of the run as if it had stopped after saving step 2 (step_1, step_2, latest -> step_2)."""
    out = tmp_path / "run"
    shutil.copytree(full_run[0], out)
    ck = out / "checkpoints"
    shutil.rmtree(ck / STEP3)
    (ck / "latest").write_text(STEP2 + "\n")
    return out


def _truncate(f: Path, keep: int = 100) -> None:
    f.write_bytes(f.read_bytes()[:keep])


def _warnings(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("warning:")]


# -- item 2: `latest` is a hint ----------------------------------------------------------------------------------
def test_garbage_latest_resumes_from_newest_complete_with_one_warning(full_run, at_step2, capsys):
    (at_step2 / "checkpoints" / "latest").write_bytes(b"\xff\xfe\x00\x81garbage\x00")
    rows = _same(_train(at_step2))
    assert rows == full_run[1][2:]  # step 3 exactly as the uninterrupted run's
    warned = _warnings(capsys.readouterr().err)
    assert len(warned) == 1 and "latest" in warned[0] and "unreadable" in warned[0] and STEP2 in warned[0], warned


def test_latest_naming_a_missing_or_incomplete_directory_is_skipped(at_step2):
    ck = at_step2 / "checkpoints"
    (ck / "latest").write_text("step_00000009\n")
    assert find_latest(ck) == ck / STEP2
    path, notes = ckpt_mod.find_resumable(ck)
    assert path == ck / STEP2 and len(notes) == 1 and "does not exist" in notes[0]
    (ck / STEP2 / COMPLETE).unlink()  # step 2 incomplete: the newest complete is step 1
    (ck / "latest").write_text(STEP2 + "\n")
    path, notes = ckpt_mod.find_resumable(ck)
    assert path == ck / STEP1 and len(notes) == 1 and "not complete" in notes[0]


# -- item 3: a damaged checkpoint is corrupt, not "a different model" ---------------------------------------------
@pytest.mark.parametrize("name", ["__0_0.distcp", ".metadata"])
def test_truncated_file_in_newest_checkpoint_falls_back_under_auto(full_run, at_step2, capsys, name):
    _truncate(at_step2 / "checkpoints" / STEP2 / name)
    rows = _same(_train(at_step2))
    assert rows == full_run[1][1:]  # steps 2 and 3 exactly as the uninterrupted run's
    warned = _warnings(capsys.readouterr().err)
    assert len(warned) == 1 and STEP2 in warned[0] and name in warned[0] and "truncated" in warned[0], warned


@pytest.mark.parametrize("name", ["__0_0.distcp", ".metadata"])
def test_truncated_file_with_explicit_resume_is_one_line_naming_it(at_step2, name):
    ck = at_step2 / "checkpoints"
    _truncate(ck / STEP2 / name)
    with pytest.raises(CheckpointError) as ei:
        Trainer(load_config(RECIPE, [*SMALL, f"trainer.output_dir={at_step2}", f"trainer.resume={ck / STEP2}"]).validate(),
                cpu_dist())
    msg = str(ei.value)
    assert "\n" not in msg and "corrupt" in msg and name in msg and str(ck / STEP1) in msg
    assert "does not match this model" not in msg


def test_checkpoint_without_size_manifest_is_still_checked(at_step2):
    """Checkpoints written before COMPLETE listed file sizes: DCP's own index still exposes a truncated shard."""
    import json

    ck = at_step2 / "checkpoints"
    for step in (STEP1, STEP2):
        marker = json.loads((ck / step / COMPLETE).read_text())
        marker.pop("files", None)
        (ck / step / COMPLETE).write_text(json.dumps(marker))
    _truncate(ck / STEP2 / "__0_0.distcp")
    path, notes = ckpt_mod.find_resumable(ck)
    assert path == ck / STEP1 and "__0_0.distcp" in notes[0] and "index needs" in notes[0]


def test_garbled_shard_bytes_fail_at_load_and_fall_back(full_run, at_step2, capsys):
    """Damage of the right size passes the cheap checks; the load itself reports it as corrupt and auto falls back
    (over whatever the failed load had already written into the model)."""
    f = at_step2 / "checkpoints" / STEP2 / "__0_0.distcp"
    data = bytearray(f.read_bytes())
    data[:32] = b"\x00garbled-bytes-garbled-bytes-xx\x00"
    f.write_bytes(bytes(data))
    rows = _same(_train(at_step2))
    assert rows == full_run[1][1:]
    warned = _warnings(capsys.readouterr().err)
    assert len(warned) == 1 and "corrupt" in warned[0] and "__0_0.distcp" in warned[0] and STEP1 in warned[0], warned


def _tiny(tmp_path: Path) -> tuple[torch.nn.Module, torch.optim.Optimizer, Path]:
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 4)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(2, 16)).sum().backward()
    opt.step()
    root = tmp_path / "ckpt"
    save_checkpoint(root, 1, model, opt, None, {"step": 1})
    return model, opt, root


def test_garbled_shard_is_corrupt_but_a_real_mismatch_is_a_different_model(tmp_path):
    model, opt, root = _tiny(tmp_path)
    other = torch.nn.Linear(8, 4)
    with pytest.raises(CheckpointError, match="does not match this model") as ei:
        load_checkpoint(root / STEP1, other, torch.optim.AdamW(other.parameters()))
    assert not isinstance(ei.value, CorruptCheckpointError)
    f = root / STEP1 / "__0_0.distcp"
    f.write_bytes(b"\x00garbled\x00" + f.read_bytes()[9:])
    with pytest.raises(CorruptCheckpointError) as ei:
        load_checkpoint(root / STEP1, model, opt)
    msg = str(ei.value)
    assert "\n" not in msg and "corrupt" in msg and "__0_0.distcp" in msg and "does not match" not in msg


# -- item 6: a checkpoint write that fails --------------------------------------------------------------------------
@contextmanager
def _failing_shard_writes(monkeypatch, err: int):
    import torch.distributed.checkpoint.filesystem as fs

    real = fs.FileSystem.create_stream

    @contextmanager
    def create_stream(self, path, mode):
        if str(path).endswith(".distcp") and "w" in mode:
            raise OSError(err, os.strerror(err), str(path))
        with real(self, path, mode) as stream:
            yield stream

    monkeypatch.setattr(fs.FileSystem, "create_stream", create_stream)
    yield


def _assert_untouched(ck: Path, newest: str) -> None:
    assert (ck / "latest").read_text() == newest + "\n"
    assert ckpt_mod.find_resumable(ck) == (ck / newest, [])
    assert not list(ck.glob(".tmp-*")) and not list(ck.glob(".*.tmp*"))


def test_disk_full_during_save_is_one_line_and_loses_nothing(at_step2, monkeypatch):
    ck = at_step2 / "checkpoints"
    with _failing_shard_writes(monkeypatch, errno.ENOSPC), pytest.raises(CheckpointError) as ei:
        _train(at_step2)
    msg = str(ei.value)
    assert "\n" not in msg and str(ck / f".tmp-{STEP3}") in msg and "No space left on device" in msg
    assert "needs about" in msg and "MiB" in msg and "is free" in msg
    _assert_untouched(ck, STEP2)


def test_unwritable_checkpoint_dir_is_one_line(tmp_path, monkeypatch):
    """Root ignores permission bits, so the refusal is monkeypatched: creating the temporary directory fails."""
    model, opt, root = _tiny(tmp_path)
    real_mkdir = Path.mkdir

    def mkdir(self, *a, **k):
        if self.name.startswith(".tmp-step_"):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(self))
        return real_mkdir(self, *a, **k)

    monkeypatch.setattr(Path, "mkdir", mkdir)
    with pytest.raises(CheckpointError) as ei:
        save_checkpoint(root, 2, model, opt, None, {"step": 2})
    msg = str(ei.value)
    assert "\n" not in msg and "Permission denied" in msg and "needs about" in msg and "is free" in msg
    _assert_untouched(root, STEP1)


def test_too_little_free_space_fails_before_writing(tmp_path, monkeypatch):
    model, opt, root = _tiny(tmp_path)
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(ckpt_saving.shutil, "disk_usage", lambda p: usage(10**9, 10**9 - 1000, 1000))
    with _failing_shard_writes(monkeypatch, errno.EIO), pytest.raises(CheckpointError) as ei:  # must not be reached
        save_checkpoint(root, 2, model, opt, None, {"step": 2})
    msg = str(ei.value)
    assert "not enough free space" in msg and "1000 bytes is free" in msg and "needs about" in msg
    _assert_untouched(root, STEP1)


def test_failure_writing_the_marker_removes_the_temporary_directory(tmp_path, monkeypatch):
    model, opt, root = _tiny(tmp_path)
    real = ckpt_saving.write_atomic

    def write_atomic(path, data):
        if path.name in (COMPLETE, "latest"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        return real(path, data)

    monkeypatch.setattr(ckpt_saving, "write_atomic", write_atomic)
    with pytest.raises(CheckpointError, match="No space left on device"):
        save_checkpoint(root, 2, model, opt, None, {"step": 2})
    _assert_untouched(root, STEP1)
