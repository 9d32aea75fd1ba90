"""Plug-ins on every rank: a module of the user's own, named in ``trainer.imports`` or passed as ``--import``, is
imported by the launcher and by each rank that ``train --nproc`` starts before the config's names are checked, so
the advantage estimator, policy loss and reward it registers run on every rank; a module that cannot be imported
stops the run with one line naming the key or flag, the module and the fix.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RECIPE = "recipes/cpu_successor.yaml"
SMALL = ["data.num_synthetic=64", "data.train_batch_size=4", "rollout.n=4", "actor.ppo_mini_batch_size=4",
         "actor.ppo_micro_batch_size_per_device=8", "trainer.logger=[jsonl]", "trainer.total_steps=2",
         "trainer.test_freq=0", "trainer.val_before_train=false", "trainer.save_freq=-1"]

# Each plug-in, when it runs, leaves a file <marks>/<kind>.rank<R> holding its process id.
MARK = '''
import os
from pathlib import Path


def _mark(kind):
    marks = Path(__file__).parent / "marks"
    marks.mkdir(exist_ok=True)
    (marks / f"{kind}.rank{os.environ.get('RANK', '0')}").write_text(str(os.getpid()))
'''

ALGORITHMS = MARK + '''
import torch

from hybrid_rl.algorithms import ppo_clip_loss, register_estimator, register_policy_loss


@register_estimator("plugin_mean_baseline")
@torch.no_grad()
def mean_baseline(token_level_rewards, response_mask):
    _mark("estimator")
    scores = (token_level_rewards * response_mask).sum(-1)
    adv = (scores - scores.mean()).unsqueeze(-1) * response_mask
    return adv, adv.clone()


@register_policy_loss("plugin_ppo", inputs=lambda t, cfg: {"old_log_prob": t["old_log_probs"]})
def plugin_ppo(**kw):
    _mark("loss")
    return ppo_clip_loss(**kw)
'''

REWARD = MARK + '''
from hybrid_rl.rewards import register_reward


@register_reward("plugin_parity")
def parity(response, ground_truth):
    _mark("reward")
    return float(sum(map(ord, response)) % 2)
'''


def _train(*args: str, path: Path | None = None, timeout: int = 240) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if path is not None:  # where the plug-in modules passed by name are
        env["PYTHONPATH"] = os.pathsep.join([str(path), *filter(None, [env.get("PYTHONPATH")])])
    return subprocess.run([sys.executable, "-m", "hybrid_rl", "train", *args], capture_output=True, text=True,
                          cwd=ROOT, timeout=timeout, env=env)


@pytest.mark.slow
def test_plugins_run_on_both_ranks(tmp_path):
    """The estimator and the loss come from a file in trainer.imports, the reward from a module passed as --import."""
    (tmp_path / "my_algorithms.py").write_text(ALGORITHMS)
    (tmp_path / "my_reward.py").write_text(REWARD)
    proc = _train("--nproc", "2", "--import", "my_reward", RECIPE, f"trainer.imports=[{tmp_path / 'my_algorithms.py'}]",
                  "algorithm.adv_estimator=plugin_mean_baseline",
                  "actor.policy_loss=plugin_ppo", "reward.function=plugin_parity", "reward.num_workers=0",
                  f"trainer.output_dir={tmp_path / 'run'}", *SMALL, path=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    marks = {p.name: int(p.read_text()) for p in (tmp_path / "marks").iterdir()}
    assert set(marks) == {f"{kind}.rank{r}" for kind in ("estimator", "loss", "reward") for r in (0, 1)}, marks
    # each rank is its own process (not the launcher, which imported the module but ran none of it)
    assert marks["loss.rank0"] != marks["loss.rank1"] and os.getpid() not in marks.values()
    assert len((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()) >= 2


def test_missing_plugin_is_one_line():
    proc = _train("--nproc", "2", RECIPE, "trainer.imports=[no_such_plugin_mod]", timeout=120)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        "error: trainer.imports: cannot import module 'no_such_plugin_mod' (No module named 'no_such_plugin_mod'); "
        "put its directory on PYTHONPATH, give its file as path/to/no_such_plugin_mod.py, or fix trainer.imports"
    ], proc.stderr
    proc = _train("--import", "no_such_plugin_mod", RECIPE, timeout=120)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        "error: --import: cannot import module 'no_such_plugin_mod' (No module named 'no_such_plugin_mod'); "
        "put its directory on PYTHONPATH, give its file as path/to/no_such_plugin_mod.py, or fix --import"
    ], proc.stderr


def test_policy_loss_key_takes_auto_or_a_registered_name():
    from hybrid_rl.config import ConfigError, load_config

    assert load_config(None, []).policy_loss == "ppo"  # auto
    assert load_config(None, ["actor.policy_loss=decoupled_ppo"]).policy_loss == "decoupled_ppo"
    with pytest.raises(ConfigError, match=r"^actor.policy_loss='ppo2' is not one of \['auto', 'ppo', 'decoupled_ppo'.*"
                                          r"\(did you mean 'ppo'\?\)$"):
        load_config(None, ["actor.policy_loss=ppo2"])
