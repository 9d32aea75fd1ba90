"""Split placement (``trainer.placement=split``): generate-only and train-only ranks in one torchrun world.

With one rollout rank and one trainer rank the run must be the colocated
one-rank run, step for step: same prompts, same engine RNG, same weights
pushed (broadcast instead of copied), same update. That is checked for both
modes on CPU (gloo), plus a 3-rank layout (1 rollout, 2 trainer ranks) for the
batch hand-over and the FSDP mesh over the trainer ranks only, and the
config's refusals.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from hybrid_rl.batch import Batch
from hybrid_rl.config import ConfigError
from hybrid_rl.micro_batching import pad_widths, trim_padding

from helpers import run_checked

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]

COMMON = ["-m", "hybrid_rl", "train", "recipes/cpu_successor.yaml", "trainer.total_steps=10", "trainer.save_freq=-1",
          "trainer.test_freq=0", "trainer.val_before_train=false", "trainer.logger=[jsonl]", "trainer.resume=never",
          "model.path=builtin:tiny-qwen2"]
# compared exactly: everything but wall-clock figures
SKIP = ("timing/", "perf/")


def _torchrun(n: int) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={n}"]


def _metrics(out_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


@pytest.mark.parametrize("mode", ["sync", "overlap"])
def test_split_one_plus_one_equals_colocated_one_rank(tiny_model_path, tmp_path, mode):
    split, colo = tmp_path / "split", tmp_path / "colo"
    val = ["trainer.val_before_train=true", "trainer.test_freq=5", "data.max_val_samples=32"]
    run_checked(_torchrun(2) + COMMON + val + [f"trainer.mode={mode}", "trainer.placement=split",
                                               f"trainer.output_dir={split}"])
    run_checked(_torchrun(1) + COMMON + val + [f"trainer.mode={mode}", f"trainer.output_dir={colo}"])
    a, b = _metrics(split), _metrics(colo)
    # validation (greedy, on the rollout rank with the trainer's current weights) before step 1 and at steps 5, 10
    assert [r["step"] for r in a if "val/reward_mean" in r] == [0, 5, 10] == [r["step"] for r in b if "val/reward_mean" in r]
    a, b = [r for r in a if r["step"] > 0], [r for r in b if r["step"] > 0]
    assert [r["step"] for r in a] == list(range(1, 11)) == [r["step"] for r in b]
    # the run must actually learn something, or equality would be vacuous
    assert any(r["actor/grad_norm"] > 0 for r in a)
    for x, y in zip(a, b):
        keys = {k for k in y if not k.startswith(SKIP)}
        assert keys <= set(x), keys - set(x)
        diff = {k: (x[k], y[k]) for k in keys if abs(x[k] - y[k]) > 1e-6}
        assert not diff, f"step {x['step']}: {diff}"
    # overlap: batch k+1 is generated while batch k trains, never more than one version behind
    assert max(r["rollout/staleness_max"] for r in a) == (1.0 if mode == "overlap" else 0.0)
    # the broadcast moved the full fp32 model (tied embedding once) whenever the version changed
    assert a[1]["rollout/weight_sync_bytes"] == 80896 * 4


def test_split_one_rollout_two_trainer_ranks(tiny_model_path, tmp_path):
    run_checked(_torchrun(3) + COMMON + ["trainer.total_steps=4", "trainer.mode=overlap",
                                        "trainer.placement=split", "trainer.rollout_ranks=1", "data.train_batch_size=16",
                                        "actor.ppo_mini_batch_size=8", "actor.ppo_micro_batch_size_per_device=32",
                                        f"trainer.output_dir={tmp_path}"], timeout=400)
    rows = _metrics(tmp_path)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert [r["rollout/weight_version"] for r in rows] == [0, 0, 1, 2]
    assert all(r["rollout/staleness_max"] <= 1 for r in rows)
    # perf/tokens_per_s counts the whole global batch: 16 prompts × 16 samples reached the two trainer ranks
    assert rows[-1]["rollout/response_length_mean"] > 0
    assert rows[-1]["perf/tokens_per_s"] * rows[-1]["timing/step"] >= 16 * 16 * 5


def test_split_two_rollout_two_trainer_ranks(tiny_model_path, tmp_path):
    """Four ranks, 2 + 2: batches from two rollout ranks are joined and re-cut for two trainer ranks, and the
    weights go from the first trainer rank to both rollout ranks (nothing assumes one rank per side)."""
    run_checked(_torchrun(4) + COMMON + ["trainer.total_steps=3", "trainer.mode=overlap",
                                        "trainer.placement=split", "trainer.rollout_ranks=2", "data.train_batch_size=16",
                                        "actor.ppo_mini_batch_size=8", "actor.ppo_micro_batch_size_per_device=32",
                                        f"trainer.output_dir={tmp_path}"], timeout=400)
    rows = _metrics(tmp_path)
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert [r["rollout/weight_version"] for r in rows] == [0, 0, 1]
    assert all(r["rollout/staleness_max"] <= 1 for r in rows) and rows[-1]["rollout/staleness_max"] == 1
    assert rows[-1]["perf/tokens_per_s"] * rows[-1]["timing/step"] >= 16 * 16 * 5  # the whole global batch trained


def test_split_overlap_step_holds_the_wait_for_generation(tmp_path):
    """Generation slower than the update: the trainer rank's wait for the rollout rank falls inside its step
    (``timing/wait_gen``), as the rollout rank generates the next batch in the background. Were the wait outside
    the step, a step would read as the update alone while the loop's real cadence is the generation.
    ``timing/iteration`` is the loop's cadence: it holds the step and what ran after the one before (here a
    validation).

    The premise holds by a wide margin on a loaded machine: 480 decoding steps cost the same whatever the batch
    (the tiny model is overhead-bound), while the update of 4 sequences is small (idle 2 cores: generation ~0.53 s,
    update ~0.08 s, wait ~0.45 s; with both cores busy elsewhere the ratio stays ~5)."""
    run_checked(_torchrun(2) + COMMON + [
        "trainer.total_steps=8", "trainer.mode=overlap", "trainer.placement=split", "trainer.test_freq=6",
        "data.max_val_samples=8", "data.max_response_length=480", "rollout.forced_lengths=fixed:480",
        "data.train_batch_size=2", "actor.ppo_mini_batch_size=2", "rollout.n=2",
        "actor.ppo_micro_batch_size_per_device=4", f"trainer.output_dir={tmp_path}"], timeout=400)
    rows = {r["step"]: r for r in _metrics(tmp_path) if r["step"] > 0}
    assert sorted(rows) == list(range(1, 9))
    steady = [rows[k] for k in (3, 4, 5, 6)]  # after the first update's warm-up, before the validation at step 6
    mean = lambda key: sum(r[key] for r in steady) / len(steady)
    assert mean("timing/gen") > 2 * mean("timing/update"), steady  # the premise: generation sets the pace
    assert mean("timing/step") >= 0.7 * mean("timing/gen"), steady  # (foreground: ~0.4)
    assert mean("timing/wait_gen") >= 0.5 * (mean("timing/gen") - mean("timing/update")), steady
    assert rows[7]["timing/iteration"] >= rows[7]["timing/step"] + rows[6]["timing/validate"] - 1e-3
    assert all(r["timing/iteration"] >= r["timing/step"] for r in rows.values())


def test_pad_widths_inverts_trim_padding():
    torch.manual_seed(0)
    b, p, r = 4, 5, 6
    prompt_mask = torch.ones(b, p, dtype=torch.long)
    prompt_mask[0, :2] = 0
    response_mask = torch.ones(b, r, dtype=torch.long)
    response_mask[1, 3:] = 0
    attn = torch.cat([prompt_mask, response_mask], 1)
    pos = (attn.cumsum(1) - 1).clamp(min=0)
    batch = Batch({"prompts": torch.randint(1, 9, (b, p)), "responses": torch.randint(1, 9, (b, r)),
                   "input_ids": torch.randint(1, 9, (b, p + r)), "attention_mask": attn, "position_ids": pos,
                   "response_mask": response_mask, "rollout_log_probs": torch.randn(b, r), "weight_version": torch.zeros(b)})
    wide = pad_widths(batch, 9, 11, pad_token_id=0)
    assert wide.tensors["prompts"].shape == (b, 9) and wide.tensors["input_ids"].shape == (b, 20)
    assert wide.tensors["rollout_log_probs"].shape == (b, 11) and wide.tensors["weight_version"].shape == (b,)
    assert int(wide.tensors["attention_mask"].sum()) == int(attn.sum())
    back = trim_padding(wide)
    for k, v in batch.tensors.items():
        assert torch.equal(back.tensors[k], v), k


def _cfg(*overrides: str):
    from hybrid_rl.config import load_config

    return load_config("recipes/cpu_successor.yaml", ["trainer.placement=split", *overrides])


def test_split_config_refusals():
    ok = ["trainer.save_freq=-1", "trainer.test_freq=0", "trainer.val_before_train=false"]
    _cfg(*ok).validate(2)
    assert _cfg(*ok).split_layout(8) == (4, 4) and _cfg(*ok, "trainer.rollout_ranks=2").split_layout(8) == (2, 6)
    with pytest.raises(ConfigError, match="at least 2 ranks"):
        _cfg(*ok).validate(1)
    with pytest.raises(ConfigError, match="rollout_ranks"):
        _cfg(*ok, "trainer.rollout_ranks=2").validate(2)
    with pytest.raises(ConfigError, match="param_offload"):
        _cfg(*ok, "actor.param_offload=true").validate(2)
    with pytest.raises(ConfigError, match="divisible by the 3 rollout ranks"):
        _cfg(*ok, "trainer.rollout_ranks=3").validate(4)


@pytest.mark.parametrize("mode", ["overlap"])
def test_split_resume_continues_the_same_run(tiny_model_path, tmp_path, mode):
    """Checkpoint at step 3 (DCP over the trainer ranks, extras from every rank, the batch generated ahead
    included), resume: steps 4-6 are the uninterrupted run's, metric for metric."""
    import shutil

    full, resumed = tmp_path / "full", tmp_path / "resumed"
    args = COMMON + ["trainer.total_steps=6", "trainer.save_freq=3", "trainer.keep_last=0", f"trainer.mode={mode}",
                     "trainer.placement=split"]
    run_checked(_torchrun(2) + args + [f"trainer.output_dir={full}"])
    shutil.copytree(full, resumed)
    shutil.rmtree(resumed / "checkpoints" / "step_00000006")
    run_checked(_torchrun(2) + [a for a in args if a != "trainer.resume=never"]
                + [f"trainer.output_dir={resumed}", "trainer.resume=auto"])
    a, b = _metrics(full), _metrics(resumed)
    assert [r["step"] for r in b] == [1, 2, 3, 4, 5, 6]
    assert any(r["actor/grad_norm"] > 0 for r in a[3:])
    for x, y in zip(a[3:], b[3:]):
        diff = {k: (x[k], y[k]) for k in x if not k.startswith(SKIP) and abs(x[k] - y.get(k, float("nan"))) > 1e-6}
        assert not diff, f"step {x['step']}: {diff}"


def test_modes_benchmark_adds_split_ratios():
    """benchmarks/modes.py: --rollout-ranks adds overlap_split_r<R> modes; a ratio that cannot exist is refused."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from modes import build_modes

    assert [m for m, _ in build_modes(1)] == ["sync", "overlap_colocated"]
    modes = dict(build_modes(4, "1,2"))
    assert list(modes) == ["sync", "overlap_colocated", "overlap_split", "overlap_split_r1"]  # 2 = half: no duplicate
    assert "trainer.rollout_ranks=1" in modes["overlap_split_r1"] and "trainer.placement=split" in modes["overlap_split_r1"]
    with pytest.raises(SystemExit, match="1..3 on 4 GPUs"):
        build_modes(4, "4")
    with pytest.raises(SystemExit, match="comma-separated integers"):
        build_modes(4, "one")
