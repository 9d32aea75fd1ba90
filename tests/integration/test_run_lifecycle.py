"""A run's start and end: the validation set is read only when used, a resume must continue the same run, and
``fit`` ends with a summary that says where the results are. Tiny in-process runs of the CPU recipe (seconds each)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml

from helpers import cpu_dist
from hybrid_rl.config import RESUME_HARMLESS, RESUME_IGNORED, ConfigError, all_keys, load_config, resume_config_diff
from hybrid_rl.data import DataError
from hybrid_rl.trainer import Trainer

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "recipes" / "cpu_successor.yaml"
SMALL = ["data.num_synthetic=64", "data.train_batch_size=4", "rollout.n=4", "actor.ppo_mini_batch_size=4",
         "actor.ppo_micro_batch_size_per_device=16", "data.max_val_samples=4", "trainer.logger=[jsonl]",
         "trainer.total_steps=1", "trainer.test_freq=0", "trainer.val_before_train=false"]


def _cfg(out: Path, *overrides: str):
    return load_config(RECIPE, [*SMALL, f"trainer.output_dir={out}", *overrides]).validate()


def _train(out: Path, *overrides: str) -> list[dict]:
    return Trainer(_cfg(out, *overrides), cpu_dist()).fit()


@pytest.fixture(scope="module")
def one_step_run(tmp_path_factory) -> Path:
    """A finished 1-step sync run (checkpoint at step 1); tests copy it before touching it."""
    out = tmp_path_factory.mktemp("one_step") / "run"
    _train(out)
    return out


@pytest.fixture
def run_copy(one_step_run, tmp_path) -> Path:
    out = tmp_path / "run"
    shutil.copytree(one_step_run, out)
    return out


# -- defect 7: data.val_path is read only when validation runs -------------------------------------------------
def test_missing_val_path_is_not_read_when_validation_is_off(tmp_path):
    rows = _train(tmp_path / "run", "data.val_path=/nonexistent/val.jsonl")
    assert [r["step"] for r in rows] == [1]


def test_missing_val_path_is_a_clear_error_when_validation_is_on(tmp_path):
    with pytest.raises(DataError, match=r"data\.val_path='/nonexistent/val.jsonl': no such file"):
        Trainer(_cfg(tmp_path / "run", "data.val_path=/nonexistent/val.jsonl", "trainer.test_freq=1"), cpu_dist())


# -- defect 8: resuming with different settings -----------------------------------------------------------------
def test_resume_with_a_setting_that_changes_training_stops_and_writes_nothing(run_copy):
    config_before = (run_copy / "config.yaml").read_text()
    metrics_before = (run_copy / "metrics.jsonl").read_text()
    with pytest.raises(ConfigError) as e:  # the README's `make train` then `make train ARGS="trainer.mode=overlap"`
        Trainer(_cfg(run_copy, "trainer.mode=overlap", "trainer.seed=3"), cpu_dist())
    msg = str(e.value)
    assert "\n" not in msg
    assert "trainer.mode (checkpoint: sync, now: overlap)" in msg and "trainer.seed (checkpoint: 0, now: 3)" in msg
    assert "step_00000001" in msg
    for fix in ("new trainer.output_dir", "trainer.resume=never", "trainer.allow_config_change=true"):
        assert fix in msg
    assert (run_copy / "config.yaml").read_text() == config_before  # nothing already written is lost
    assert (run_copy / "metrics.jsonl").read_text() == metrics_before


def test_checkpoint_without_its_own_config_is_compared_with_the_run_config(run_copy):
    """Checkpoints written before they kept config.yaml: the run directory's config.yaml is the record."""
    (run_copy / "checkpoints" / "step_00000001" / "config.yaml").unlink()
    with pytest.raises(ConfigError, match=r"trainer.mode \(checkpoint: sync, now: overlap\)"):
        Trainer(_cfg(run_copy, "trainer.mode=overlap"), cpu_dist())


def test_allow_config_change_resumes_with_a_warning(run_copy, capsys):
    rows = _train(run_copy, "actor.lr=0.002", "trainer.total_steps=2", "trainer.allow_config_change=true")
    assert [r["step"] for r in rows] == [2]
    err = capsys.readouterr().err
    lr = load_config(RECIPE).actor.lr  # the recipe's own value, whatever it is
    assert f"actor.lr (checkpoint: {lr}, now: 0.002)" in err and "allow_config_change" in err
    assert yaml.safe_load((run_copy / "config.yaml").read_text())["actor"]["lr"] == 0.002


def test_resume_with_harmless_changes_warns_and_continues(run_copy, capsys):
    rows = _train(run_copy, "trainer.total_steps=2", "trainer.keep_last=1", "data.val_path=null")
    assert [r["step"] for r in rows] == [2]
    warning = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning: resuming")]
    assert len(warning) == 1, warning
    for key in ("trainer.total_steps (checkpoint: 1, now: 2)", "trainer.keep_last (checkpoint: 2, now: 1)",
                "data.val_path (checkpoint: synthetic:successor, now: null)"):
        assert key in warning[0]
    assert [json.loads(line)["step"] for line in (run_copy / "metrics.jsonl").read_text().splitlines()] == [1, 2]
    # the new checkpoint records the config that trained it
    saved = yaml.safe_load((run_copy / "checkpoints" / "step_00000002" / "config.yaml").read_text())
    assert saved["trainer"]["total_steps"] == 2


def test_nothing_to_do_says_so_and_keeps_the_run_config(run_copy, capsys):
    config_before = (run_copy / "config.yaml").read_text()
    assert _train(run_copy, "trainer.keep_last=5") == []
    err = capsys.readouterr().err
    assert "nothing to do" in err and "trainer.total_steps" in err
    assert (run_copy / "config.yaml").read_text() == config_before


def test_every_config_key_has_a_resume_class():
    keys = all_keys()
    leaves = {k for k in keys if "." in k and not any(o.startswith(k + ".") for o in keys)}
    assert RESUME_HARMLESS <= leaves and RESUME_IGNORED <= leaves  # no misspelt entries
    base = load_config(RECIPE)
    strict, harmless = resume_config_diff(base.to_dict(), load_config(RECIPE, ["trainer.placement=split", "trainer.output_dir=x",
                                                                               "rollout.max_num_seqs=8"]))
    assert strict == ["trainer.placement (checkpoint: colocated, now: split)"]
    assert harmless == ["rollout.max_num_seqs (checkpoint: 256, now: 8)"]
    # a config saved before a key existed compares as that key's default
    old = base.to_dict()
    del old["trainer"]["allow_config_change"], old["actor"]["lr"]
    assert resume_config_diff(old, base) == ([f"actor.lr (checkpoint: 1e-06, now: {base.actor.lr})"], [])


# -- defect 12: the end-of-run summary --------------------------------------------------------------------------
def test_fit_ends_with_a_summary_naming_the_checkpoint(tmp_path, capsys):
    out = tmp_path / "run"
    _train(out, "trainer.total_steps=2", "trainer.test_freq=2", "trainer.logger=[jsonl,tensorboard]")
    err = capsys.readouterr().err
    summary = err[err.index("hybrid_rl: done"):]
    assert "2 step(s) run" in summary and "at step 2" in summary
    assert "reward/mean" in summary and "mean of the last 2 step(s)" in summary
    assert "val/reward_mean" in summary and "(step 2)" in summary
    assert f"checkpoint: {out / 'checkpoints' / 'step_00000002'}" in summary
    assert str(out / "metrics.jsonl") in summary and f"tensorboard --logdir {out / 'tensorboard'}" in summary
    assert f"export {out} {out / 'hf'}" in summary


def test_summary_without_checkpoints_has_no_export_line(tmp_path, capsys):
    _train(tmp_path / "run", "trainer.save_freq=-1")
    summary = capsys.readouterr().err.split("hybrid_rl: done")[1]
    assert "checkpoint: none (trainer.save_freq=-1)" in summary and "export" not in summary


def test_every_logged_metric_is_in_the_readme_table(tmp_path):
    """The README's Metrics table names every key a run logs (four were missing once): overlap mode with a KL loss
    and validation logs the widest set a CPU run has."""
    import re

    rows = _train(tmp_path / "run", "trainer.mode=overlap", "actor.use_kl_loss=true", "trainer.total_steps=2",
                  "trainer.test_freq=2", "reward.overlong_buffer_len=2")
    logged = {k for r in rows for k in r if "/" in k}
    readme = (ROOT / "README.md").read_text()
    table = readme[readme.index("| group | keys |"):readme.index("Under split placement the first trainer rank logs")]
    documented, per_phase = set(), set()
    for group, keys in re.findall(r"^\| `(\w+)/` \| (.*) \|$", table, flags=re.M):
        documented |= {f"{group}/{k}" for k in re.findall(r"`(\w+)`", keys)}
        per_phase |= {f"{group}/{k}/" for k in re.findall(r"`(\w+)/<phase>`", keys)}  # one key per timed phase
    undocumented = {k for k in logged - documented if not any(k.startswith(p) for p in per_phase)}
    assert undocumented == set(), sorted(undocumented)
    assert any(k.startswith("perf/phase_micro_batch_tokens/") for k in logged)  # a per-phase key, matched above


def test_validation_runs_every_test_freq_steps_and_at_the_last(tmp_path):
    """As verl does: a run whose last step is not a multiple of trainer.test_freq still ends with a validation."""
    rows = _train(tmp_path / "run", "trainer.total_steps=3", "trainer.test_freq=2")
    assert [r["step"] for r in rows if "val/reward_mean" in r] == [2, 3]
    rows = _train(tmp_path / "off", "trainer.total_steps=2", "trainer.test_freq=0")
    assert not any("val/reward_mean" in r for r in rows)


@pytest.mark.parametrize("mode", ["sync", "overlap"])
def test_a_stop_signal_puts_the_due_validation_off_to_the_resumed_run(tmp_path, monkeypatch, mode):
    """SIGTERM in a step after which validation is due: the run checkpoints without validating (a long validation
    could outlast the scheduler's grace before SIGKILL), the checkpoint owes it, and the resumed run validates first,
    logging the same figures at the same step as an uninterrupted run; then it goes on as usual."""
    import signal

    from hybrid_rl.interrupt import RunInterrupted

    args = ["trainer.total_steps=4", "trainer.test_freq=2", "trainer.save_freq=100", f"trainer.mode={mode}"]
    ref = _train(tmp_path / "ref", *args)
    out = tmp_path / "run"
    original = Trainer.step

    def step_then_signal(self, last=False):
        metrics = original(self, last)
        if self.current_step == 2:
            signal.raise_signal(signal.SIGTERM)  # the handler only notes it; the loop stops after this step
        return metrics

    monkeypatch.setattr(Trainer, "step", step_then_signal)
    with pytest.raises(RunInterrupted):
        _train(out, *args)
    monkeypatch.setattr(Trainer, "step", original)
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and not any("val/reward_mean" in r for r in rows)
    assert (out / "checkpoints" / "step_00000002" / "COMPLETE").exists()
    _train(out, *args)
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    val = {r["step"]: r["val/reward_mean"] for r in rows if "val/reward_mean" in r}
    want = {r["step"]: r["val/reward_mean"] for r in ref if "val/reward_mean" in r}
    assert val == want and sorted(val) == [2, 4]


def test_val_only_validates_the_checkpoint_and_trains_nothing(tmp_path):
    """``trainer.val_only=true``: on a fresh directory it validates the model at step 0; on a trained run's directory
    the checkpoint a resume finds, at its step, with the figure the run itself logged at that step (greedy decoding
    of the same weights), and it writes no checkpoint."""
    fresh = _train(tmp_path / "fresh", "trainer.val_only=true", "trainer.total_steps=3")
    assert len(fresh) == 1 and fresh[0]["step"] == 0 and "val/reward_mean" in fresh[0] and "reward/mean" not in fresh[0]
    assert not list((tmp_path / "fresh" / "checkpoints").glob("step_*"))
    run = tmp_path / "run"
    trained = _train(run, "trainer.total_steps=3", "trainer.test_freq=3", "trainer.save_freq=3")
    at_3 = [r for r in trained if r["step"] == 3][0]["val/reward_mean"]
    rows = _train(run, "trainer.total_steps=3", "trainer.test_freq=3", "trainer.save_freq=3", "trainer.val_only=true")
    assert rows[-1]["step"] == 3 and rows[-1]["val/reward_mean"] == at_3 and "reward/mean" not in rows[-1]
    assert sorted(p.name for p in (run / "checkpoints").glob("step_*")) == ["step_00000003"]
    from hybrid_rl.config import ConfigError

    with pytest.raises(ConfigError) as ei:
        _cfg(tmp_path / "none", "trainer.val_only=true", "data.val_path=null")
    assert str(ei.value).startswith("trainer.val_only=true validates and stops, but data.val_path is null")
