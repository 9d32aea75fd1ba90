"""``trainer.logger`` with ``wandb``: the W&B sink of ``telemetry/tracking.py``.

- Against a recording stand-in for the ``wandb`` module: the run starts with the project, the name (the output
  directory's by default), the config and an id kept in ``output_dir/wandb_run_id``; a second tracker on the same
  directory (a resumed run) resumes that id; each step's finite numbers are logged at the step's number, strings and
  NaN left out; closing finishes the run; a failing ``wandb.init`` is one line naming ``trainer.logger``.
- Without the package, the config is refused in one line naming the fix.
- With the real package (where it is installed), offline: a training run writes a W&B run whose records hold the
  metrics, and the resumed run logs into the same run id.
"""

from __future__ import annotations

import glob
import importlib.util
import math
import sys
import types
from pathlib import Path

import pytest

from hybrid_rl.config import ConfigError, load_config
from hybrid_rl.telemetry.tracking import WANDB_ID_FILE, Tracker

from helpers import ROOT, run_checked


class FakeRun:
    def __init__(self, **kwargs):
        self.init, self.logged, self.finished = kwargs, [], False

    def log(self, metrics, step):
        self.logged.append((step, dict(metrics)))

    def finish(self):
        self.finished = True


@pytest.fixture
def fake_wandb(monkeypatch):
    runs: list[FakeRun] = []
    module = types.ModuleType("wandb")

    def init(**kwargs):
        if kwargs.get("project") == "refused":
            raise RuntimeError("api_key not configured (no-tty)\ncall wandb.login")
        runs.append(FakeRun(**kwargs))
        return runs[-1]

    module.init = init
    monkeypatch.setitem(sys.modules, "wandb", module)
    return runs


def test_the_tracker_logs_a_resumable_wandb_run(tmp_path, fake_wandb):
    out = tmp_path / "my_run"
    tracker = Tracker(str(out), ["wandb"], 10, enabled=True, project="proj", config={"actor": {"lr": 1e-3}})
    tracker.log({"reward/mean": 0.5, "timing/step": 2, "note": "text", "bad": math.nan}, step=1)
    tracker.close()
    run = fake_wandb[0]
    run_id = (out / WANDB_ID_FILE).read_text().strip()
    assert len(run_id) == 8 and run.init["id"] == run_id and run.init["resume"] == "allow"
    assert run.init["project"] == "proj" and run.init["name"] == "my_run" and run.init["dir"] == str(out)
    assert run.init["config"] == {"actor": {"lr": 1e-3}}
    assert run.logged == [(1, {"reward/mean": 0.5, "timing/step": 2})] and run.finished
    # a resumed run: the same id, its own name when given
    again = Tracker(str(out), ["wandb", "jsonl"], 10, enabled=True, initial_step=1, name="named")
    again.log({"reward/mean": 0.75}, step=2)
    again.close()
    assert fake_wandb[1].init["id"] == run_id and fake_wandb[1].init["name"] == "named"
    assert fake_wandb[1].logged == [(2, {"reward/mean": 0.75})]
    # ranks other than the logger start nothing
    Tracker(str(tmp_path / "other"), ["wandb"], 10, enabled=False).close()
    assert len(fake_wandb) == 2


def test_a_wandb_run_that_cannot_start_is_one_line(tmp_path, fake_wandb):
    with pytest.raises(ConfigError) as e:
        Tracker(str(tmp_path / "r"), ["wandb"], 10, enabled=True, project="refused")
    msg = str(e.value)
    assert "\n" not in msg and "trainer.logger=wandb" in msg and "api_key not configured" in msg
    assert "WANDB_MODE=offline" in msg


def test_wandb_without_the_package_is_refused(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    cfg = load_config(str(ROOT / "recipes" / "cpu_successor.yaml"), ["trainer.logger=[console,wandb]"])
    with pytest.raises(ConfigError, match=r"pip install 'hybrid_rl\[wandb\]'"):
        cfg.validate(1)


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("wandb") is None, reason="the wandb package is not installed")
def test_a_run_logs_to_wandb_offline_and_resumes_the_same_run(tmp_path):
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "hybrid_rl", "train", str(ROOT / "recipes" / "cpu_successor.yaml"),
           f"trainer.output_dir={out}", "trainer.logger=[jsonl,wandb]", "trainer.test_freq=2"]
    env = dict(WANDB_MODE="offline", WANDB_SILENT="true")
    run_checked([*cmd, "trainer.total_steps=2"], timeout=300, **env)
    run_checked([*cmd, "trainer.total_steps=4"], timeout=300, **env)  # resumes at step 2
    run_id = (out / WANDB_ID_FILE).read_text().strip()
    files = sorted(glob.glob(str(out / "wandb" / "offline-run-*" / "*.wandb")))
    assert len(files) == 2 and all(Path(f).name == f"run-{run_id}.wandb" for f in files)
    for f in files:  # the records hold the metric names, the resolved config and the run id (protobuf strings)
        data = Path(f).read_bytes()
        assert data.startswith(b":W&B") and b"reward/mean" in data and b"val/reward_mean" in data
        assert b"cpu_successor" in data and run_id.encode() in data
