"""Crash safety: SIGKILL mid-step or mid-checkpoint, resume with trainer.resume=auto, end where an uninterrupted run ends."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from hybrid_rl.checkpoint import find_latest, load_checkpoint
from hybrid_rl.models import load_causal_lm, resolve_model_path

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "recipes" / "cpu_successor.yaml"
STEPS = 8
COMMON = [f"trainer.total_steps={STEPS}", "trainer.save_freq=2", "trainer.keep_last=0", "trainer.test_freq=0",
          "trainer.val_before_train=false", "trainer.logger=[jsonl]", "actor.lr=0.01"]


def _cmd(out: Path, *overrides: str) -> list[str]:
    return [sys.executable, "-m", "hybrid_rl", "train", str(RECIPE), f"trainer.output_dir={out}", *COMMON, *overrides]


def _run(out: Path, *overrides: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(_cmd(out, *overrides), capture_output=True, text=True, cwd=ROOT, timeout=600,
                          env={**os.environ, **(env or {})})


def _metrics(out: Path) -> list[dict]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith(("timing/", "perf/"))} for r in rows]


def _final_params(out: Path) -> dict[str, torch.Tensor]:
    model = load_causal_lm(resolve_model_path("builtin:tiny-qwen2"), torch.float32)
    path = find_latest(out / "checkpoints")
    assert path is not None and path.name.endswith(f"{STEPS:08d}")
    load_checkpoint(path, model)
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _assert_same_run(a: Path, b: Path) -> None:
    ma, mb = _metrics(a), _metrics(b)
    assert [r["step"] for r in mb] == list(range(1, STEPS + 1))
    assert [r["reward/mean"] for r in ma] == [r["reward/mean"] for r in mb]
    assert ma == mb
    pa, pb = _final_params(a), _final_params(b)
    for n in pa:
        assert torch.equal(pa[n], pb[n]), n


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    refs = {}
    for mode in ("sync", "overlap"):
        out = tmp_path_factory.mktemp(f"ref_{mode}")
        proc = _run(out, f"trainer.mode={mode}")
        assert proc.returncode == 0, proc.stderr[-2000:]
        refs[mode] = out
    # the run learned something, so equal metrics are not trivially equal zeros
    assert any(r["actor/grad_norm"] > 0 for r in _metrics(refs["sync"]))
    return refs


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["sync", "overlap"])
def test_sigkill_mid_step_then_resume(tmp_path, reference, mode):
    out = tmp_path / "run"
    proc = subprocess.Popen(_cmd(out, f"trainer.mode={mode}"), cwd=ROOT, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    metrics = out / "metrics.jsonl"
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None:
        if metrics.exists() and len(metrics.read_text().splitlines()) >= 5:
            break
        time.sleep(0.01)
    assert proc.poll() is None, "the run ended before it could be killed"
    proc.send_signal(signal.SIGKILL)  # somewhere inside step 6 (step 5 logged, its checkpoint is step 4)
    proc.wait()
    assert find_latest(out / "checkpoints").name == "step_00000004"
    resumed = _run(out, f"trainer.mode={mode}")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "resumed from" in resumed.stderr
    _assert_same_run(reference[mode], out)


@pytest.mark.slow
def test_sigkill_while_writing_a_checkpoint(tmp_path, reference):
    out = tmp_path / "run"
    crashed = _run(out, env={"HYBRID_RL_FAULT": "save:4"})
    assert crashed.returncode == -signal.SIGKILL
    ckpts = out / "checkpoints"
    assert (ckpts / ".tmp-step_00000004").exists() and not (ckpts / "step_00000004").exists()
    assert find_latest(ckpts).name == "step_00000002"  # the half-written one is never chosen
    resumed = _run(out)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "step_00000002" in resumed.stderr
    _assert_same_run(reference["sync"], out)


def test_resume_at_the_last_step_does_nothing_and_says_so(tmp_path, reference):
    done = _run(reference["sync"])
    assert done.returncode == 0
    assert "nothing to do" in done.stderr and "trainer.total_steps" in done.stderr
    assert len(_metrics(reference["sync"])) == STEPS


@pytest.mark.slow
def test_resume_across_an_epoch_boundary(tmp_path):
    """A checkpoint at the end of an epoch continues into the next epoch instead of stopping."""
    out = tmp_path / "run"
    small = ["data.num_synthetic=64", "data.train_batch_size=32", "trainer.total_steps=2"]  # 2 steps = one epoch
    assert _run(out, *small).returncode == 0
    more = _run(out, *small[:-1], "trainer.total_steps=4")
    assert more.returncode == 0, more.stderr[-2000:]
    assert [r["step"] for r in _metrics(out)] == [1, 2, 3, 4]


def test_export_round_trip_matches_trainer_logprobs(tmp_path, reference):
    from transformers import AutoModelForCausalLM

    out = tmp_path / "hf"
    proc = subprocess.run([sys.executable, "-m", "hybrid_rl", "export", str(reference["sync"]), str(out), "--dtype", "float32"],
                          capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    exported = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    trained = load_causal_lm(resolve_model_path("builtin:tiny-qwen2"), torch.float32)
    load_checkpoint(find_latest(reference["sync"] / "checkpoints"), trained)
    ids = torch.randint(3, 100, (2, 12))
    a = torch.log_softmax(exported(input_ids=ids).logits, -1)
    b = torch.log_softmax(trained(input_ids=ids).logits, -1)
    assert (a - b).abs().max() < 1e-6


def test_non_finite_updates_are_skipped_then_stop_the_run(tmp_path, monkeypatch):
    """A NaN gradient norm skips the optimizer step (params unchanged, counted); N in a row end the run with a message."""
    from helpers import cpu_dist
    from hybrid_rl.config import load_config
    from hybrid_rl.trainer import Trainer, TrainingDiverged

    cfg = load_config(RECIPE, [f"trainer.output_dir={tmp_path}", "trainer.total_steps=5", "trainer.max_skipped_updates=2",
                               "trainer.val_before_train=false", "trainer.test_freq=0", "trainer.logger=[jsonl]",
                               "trainer.save_freq=-1"]).validate()
    trainer = Trainer(cfg, cpu_dist())
    engine = trainer.worker.actor
    before = {n: p.detach().clone() for n, p in engine.model.named_parameters()}
    real_clip = torch.nn.utils.clip_grad_norm_

    def poisoned(params, max_norm, *a, **k):  # what a NaN loss produces: a non-finite global norm
        real_clip(params, max_norm, *a, **k)
        return torch.tensor(float("nan"))

    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", poisoned)
    import warnings

    with warnings.catch_warnings(record=True) as caught, pytest.raises(TrainingDiverged, match="trainer.max_skipped_updates=2"):
        warnings.simplefilter("always")
        trainer.fit()
    # a skipped update leaves the LR schedule where it was, without torch's scheduler-order warning
    assert engine.scheduler.last_epoch == 0
    assert not [w for w in caught if "lr_scheduler.step()" in str(w.message)]
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["actor/skipped_updates"] for r in rows] == [1.0, 1.0]  # both logged, then the run stopped
    for n, p in engine.model.named_parameters():
        assert torch.equal(p, before[n]), n
