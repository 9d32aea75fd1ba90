"""Multi-turn rollouts through the trainer, end to end on CPU (``recipes/cpu_lookup_tool.yaml``).

- Learning (``learning``): the tiny random-init model takes the reward from ≤ 0.3 to ≥ 0.8 by learning to call the
  ``lookup`` tool, in sync and overlap mode; the same recipe without the tool stays at 0 (only the tool reveals the
  answer). Each run is stopped once it has learned. Also with ``env.scheduler=async`` (on the transformers
  engine: each step of its stream generates the turns whose environments have answered).
- Every mode: split placement with one rollout and one trainer rank is the colocated one-rank run, step for step,
  in sync and overlap mode.
- Checkpoints: SIGKILL mid-run in overlap mode (the batch generated ahead is a multi-turn batch) and a resume end
  with the metrics and weights of an uninterrupted run.
- A chat template that cannot append observations stops the run before it starts, in one line, exit 2.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from helpers import ROOT, run_checked, subprocess_env, trailing_means, train_until_learned

RECIPE = ROOT / "recipes" / "cpu_lookup_tool.yaml"
SMALL = ["data.train_batch_size=16", "rollout.n=8", "actor.ppo_mini_batch_size=8",
         "actor.ppo_micro_batch_size_per_device=64", "data.max_val_samples=16", "trainer.logger=[jsonl]"]
# short runs of the untrained model: scoring the last turn by exact match rewards lucky guesses too, so that the
# first steps already have gradients (the recipe's own score pays only after a lookup, rare at first)
GUESSES_PAY = "reward.function=successor"
SKIP = ("timing/", "perf/")


def _train(*overrides: str) -> list[str]:
    return [sys.executable, "-m", "hybrid_rl", "train", str(RECIPE), *overrides]


def _rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]


def _stable(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith(SKIP)} for r in rows]


# --------------------------------------------------------------------------- learning
@pytest.mark.slow
@pytest.mark.learning
@pytest.mark.parametrize("mode, scheduler", [("sync", "auto"), ("overlap", "auto"), ("sync", "async")])
def test_the_lookup_recipe_learns_to_call_the_tool(tmp_path, mode, scheduler):
    out = tmp_path / f"{mode}_{scheduler}"
    rows = train_until_learned(_train(f"trainer.output_dir={out}", "trainer.logger=[jsonl]", f"trainer.mode={mode}",
                                      f"env.scheduler={scheduler}", "trainer.test_freq=20", "trainer.save_freq=-1"),
                               out, val_bar=0.8)
    train = [r for r in rows if "reward/mean" in r]
    rewards = [r["reward/mean"] for r in train]
    val = [r["val/reward_mean"] for r in rows if "val/reward_mean" in r]
    assert sum(rewards[:3]) / 3 <= 0.3 and val[0] <= 0.3, (rewards[:3], val)
    assert max(trailing_means(rewards)) >= 0.8 and val[-1] >= 0.8, ([round(r, 2) for r in rewards[-10:]], val)
    # it learned the tool: at the start almost no trajectory called it, at the end nearly all do, without faults
    assert train[0]["env/called_frac"] < 0.1 and train[-1]["env/called_frac"] > 0.8
    assert train[-1]["env/turns_mean"] > 1.8 and train[-1]["env/error_rate"] == 0.0
    assert train[-1]["env/observation_tokens_mean"] > 0.8  # one inline result token per call
    if mode == "overlap":
        assert max(r["rollout/staleness_max"] for r in train) == 1


@pytest.mark.slow
@pytest.mark.learning
def test_without_the_tool_the_reward_stays_at_zero(tmp_path):
    out = tmp_path / "no_tool"
    run_checked(_train(f"trainer.output_dir={out}", "trainer.logger=[jsonl]", "env.tools=[]", "trainer.total_steps=80",
                       "trainer.test_freq=40", "trainer.save_freq=-1"), timeout=1500)
    rows = _rows(out)
    train = [r for r in rows if "reward/mean" in r]
    assert len(train) == 80
    assert max(r["reward/mean"] for r in train) <= 0.3 and max(r["val/reward_mean"] for r in rows
                                                                if "val/reward_mean" in r) <= 0.3
    assert all(r["env/called_frac"] == 0 for r in train)


# --------------------------------------------------------------------------- split placement
def _torchrun(n: int) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={n}", "-m", "hybrid_rl",
            "train", str(RECIPE)]


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["sync", "overlap"])
def test_split_one_plus_one_equals_colocated_one_rank(tmp_path, mode):
    common = [*SMALL, GUESSES_PAY, "trainer.total_steps=4", "trainer.save_freq=-1", "trainer.test_freq=2",
              "trainer.val_before_train=false", f"trainer.mode={mode}"]
    split, colo = tmp_path / "split", tmp_path / "colo"
    run_checked(_torchrun(2) + common + ["trainer.placement=split", f"trainer.output_dir={split}"], timeout=900)
    run_checked(_torchrun(1) + common + [f"trainer.output_dir={colo}"], timeout=900)
    # everything but wall-clock figures and the bytes of the weight transfer (a broadcast under split placement, a
    # push into the engine colocated: in overlap mode they fall in different steps)
    drop = lambda rows: [{k: v for k, v in r.items() if k != "rollout/weight_sync_bytes"} for r in _stable(rows)]
    a, b = drop(_rows(split)), drop(_rows(colo))
    assert [r["step"] for r in a] == [1, 2, 3, 4] == [r["step"] for r in b]
    assert any(r["env/tool_calls_mean"] > 0 for r in a) and any(r["actor/grad_norm"] > 0 for r in a)
    for x, y in zip(a, b):
        diff = {k: (x.get(k), y[k]) for k in y if k not in x or abs(x[k] - y[k]) > 1e-6}
        assert not diff, f"step {x['step']}: {diff}"


# --------------------------------------------------------------------------- checkpoints
STEPS = 8
RESUME = [*SMALL, GUESSES_PAY, f"trainer.total_steps={STEPS}", "trainer.save_freq=2", "trainer.keep_last=0", "trainer.test_freq=0",
          "trainer.val_before_train=false", "trainer.mode=overlap", "actor.lr=0.002"]


def _final_params(out: Path) -> dict[str, torch.Tensor]:
    from hybrid_rl.checkpoint import find_latest, load_checkpoint
    from hybrid_rl.models import load_causal_lm

    model = load_causal_lm("builtin:tiny-qwen2-lookup", torch.float32)
    path = find_latest(out / "checkpoints")
    assert path is not None and path.name.endswith(f"{STEPS:08d}")
    load_checkpoint(path, model)
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.slow
def test_sigkill_mid_run_in_overlap_mode_resumes_with_identical_metrics(tmp_path):
    ref, out = tmp_path / "ref", tmp_path / "run"
    run_checked(_train(*RESUME, f"trainer.output_dir={ref}"), timeout=900)
    proc = subprocess.Popen(_train(*RESUME, f"trainer.output_dir={out}"), cwd=ROOT, env=subprocess_env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    metrics = out / "metrics.jsonl"
    deadline = time.time() + 900
    while time.time() < deadline and proc.poll() is None:
        if metrics.exists() and len(metrics.read_text().splitlines()) >= 5:
            break
        time.sleep(0.01)
    assert proc.poll() is None, "the run ended before it could be killed"
    proc.send_signal(signal.SIGKILL)  # inside step 6: the newest checkpoint is step 4, with batch 5 generated ahead
    proc.wait()
    from hybrid_rl.checkpoint import find_latest

    assert find_latest(out / "checkpoints").name == "step_00000004"
    resumed = run_checked(_train(*RESUME, f"trainer.output_dir={out}"), timeout=900)
    assert "resumed from" in resumed.stderr
    a, b = _stable(_rows(ref)), _stable(_rows(out))
    assert [r["step"] for r in b] == list(range(1, STEPS + 1))
    assert any(r["env/tool_calls_mean"] > 0 for r in a) and any(r["actor/grad_norm"] > 0 for r in a)
    assert a == b
    pa, pb = _final_params(ref), _final_params(out)
    for n in pa:
        assert torch.equal(pa[n], pb[n]), n


# --------------------------------------------------------------------------- templates
REWRITING_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' and not loop.last %}{{- '<|im_start|>assistant\\n[earlier]<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")


@pytest.mark.slow
def test_a_template_that_is_not_append_only_stops_the_run_in_one_line(tmp_path):
    from hybrid_rl.models import load_tokenizer

    tok = load_tokenizer("builtin:tiny-qwen2-lookup")
    tok.chat_template = REWRITING_TEMPLATE
    tok.save_pretrained(tmp_path / "tok")
    out = tmp_path / "run"
    proc = subprocess.run(_train(f"model.tokenizer_path={tmp_path / 'tok'}", f"trainer.output_dir={out}"), cwd=ROOT,
                          env=subprocess_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "is not append-only" in lines[0] and "model.tokenizer_path=" in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr


# --------------------------------------------------------------------------- plug-ins
PLUGIN = '''
from hybrid_rl.envs import StepResult, register_env, register_tool
from hybrid_rl.envs.tool_env import ToolEnv


@register_tool
def shout(text: str) -> str:
    """Upper-case a text.

    Args:
        text: The text.
    """
    return text.upper()


@register_env("always_more")
class AlwaysMore(ToolEnv):
    """Answers every turn, so every trajectory runs to env.max_turns."""

    def step(self, turn):
        result = super().step(turn)
        return result if result.observations else StepResult(observations=["go on"], done=False)
'''


@pytest.mark.slow
def test_a_plug_in_environment_and_tool_from_trainer_imports(tmp_path):
    plugin = tmp_path / "my_env.py"
    plugin.write_text(PLUGIN)
    out = tmp_path / "run"
    run_checked(_train(*SMALL, f"trainer.imports=[{plugin}]", "env.name=always_more", "env.tools=[lookup,shout]",
                       "data.max_response_length=16", "trainer.total_steps=2", "trainer.test_freq=0",
                       "trainer.val_before_train=false", "trainer.save_freq=-1", f"trainer.output_dir={out}"),
                timeout=600)
    rows = _rows(out)
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["env/turns_mean"] == 2.0 and r["env/stop/max_turns"] + r["env/stop/budget"] == 1.0 for r in rows)
    assert "shout" in (out / "config.yaml").read_text()
