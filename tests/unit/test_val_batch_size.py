"""data.val_batch_size: validation generates in calls of that many prompts (default data.train_batch_size)."""

from __future__ import annotations

from pathlib import Path

import pytest

from helpers import cpu_dist
from hybrid_rl.config import ConfigError, load_config

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "recipes" / "cpu_successor.yaml"
SMALL = ["data.num_synthetic=64", "data.train_batch_size=4", "rollout.n=2", "actor.ppo_mini_batch_size=4",
         "actor.ppo_micro_batch_size_per_device=8", "data.max_val_samples=10", "trainer.logger=[jsonl]", "trainer.total_steps=1", "trainer.test_freq=0",
         "trainer.val_before_train=true", "trainer.save_freq=-1", "data.max_response_length=4"]


@pytest.mark.parametrize(("extra", "calls"), [([], [4, 4, 2]), (["data.val_batch_size=10"], [10]),
                                              (["data.val_batch_size=3"], [3, 3, 3, 1])])
def test_validation_generates_in_val_batch_size_chunks(tmp_path, monkeypatch, extra, calls):
    from hybrid_rl.trainer import Trainer
    from hybrid_rl.workers.actor_rollout_ref import ActorRolloutRefWorker

    seen = []
    generate = ActorRolloutRefWorker.generate

    def spy(self, prompts, *a, **k):
        if k.get("validate"):
            seen.append(len(prompts))
        return generate(self, prompts, *a, **k)

    monkeypatch.setattr(ActorRolloutRefWorker, "generate", spy)
    cfg = load_config(RECIPE, [*SMALL, *extra, f"trainer.output_dir={tmp_path / 'run'}"]).validate()
    trainer = Trainer(cfg, cpu_dist())
    try:
        out = trainer.validate()
    finally:
        trainer.close()
    assert seen == calls
    assert 0.0 <= out["val/reward_mean"] <= 1.0
    # successor has no answer-shape counts; the validation's own time is logged beside its figures
    assert out.pop("timing/validate") > 0
    assert set(out) == {"val/reward_mean", "val/clipped_reward_mean", "val/response_length_mean",
                        "val/response_clip_ratio"}
    assert 0.0 <= out["val/response_clip_ratio"] <= 1.0
    assert 0.0 <= out["val/clipped_reward_mean"] <= out["val/reward_mean"]


def test_gsm8k_validation_logs_the_answer_shape_on_every_rank_layout(tmp_path):
    """With the gsm8k task, validation also logs val/format_strict and val/answer_found (fractions in [0, 1]); the
    keys are fixed before any prompt is scored, so a rank with no validation prompts all-reduces the same ones."""
    import json

    from hybrid_rl.trainer import Trainer

    rows = [{"question": f"What is {i} + 1?", "answer": f"{i} + 1 = {i + 1}\n#### {i + 1}"} for i in range(6)]
    data = tmp_path / "gsm8k.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = load_config(RECIPE, [*SMALL, "data.task=gsm8k", "reward.function=auto", f"data.train_path={data}",
                               f"data.val_path={data}", "data.max_prompt_length=160",
                               f"trainer.output_dir={tmp_path / 'run'}"]).validate()
    trainer = Trainer(cfg, cpu_dist())
    try:
        out = trainer.validate()
        assert out.pop("timing/validate") > 0
        assert set(out) == {"val/reward_mean", "val/clipped_reward_mean", "val/response_length_mean",
                            "val/response_clip_ratio", "val/format_strict", "val/answer_found"}
        assert all(0.0 <= out[k] <= 1.0 for k in out if k != "val/response_length_mean")
        empty = trainer.validator.on_engine(rank=7, world=8)  # a rank past the 6 prompts: same keys, no samples
        assert set(empty) == set(out) and not any(empty.values())
    finally:
        trainer.close()


def test_val_batch_size_must_be_positive():
    with pytest.raises(ConfigError, match=r"data.val_batch_size=0 must be a positive number of prompts"):
        load_config(RECIPE, ["data.val_batch_size=0"]).validate()


def test_validation_data_dir_writes_every_sample_per_step(tmp_path):
    """trainer.validation_data_dir: each validation writes one record per validation prompt (its dataset index, the
    prompt and response text, the response's length, the ground truth and the score that val/reward_mean averages)
    under the run directory."""
    import json

    from hybrid_rl.trainer import Trainer

    cfg = load_config(RECIPE, [*SMALL, "trainer.validation_data_dir=val_samples",
                               f"trainer.output_dir={tmp_path / 'run'}"]).validate()
    trainer = Trainer(cfg, cpu_dist())
    try:
        out = trainer.validate()
        trainer.current_step = 3
        trainer.validate()
    finally:
        trainer.close()
    files = sorted(p.name for p in (tmp_path / "run" / "val_samples").iterdir())
    assert files == ["step_00000000_rank0.jsonl", "step_00000003_rank0.jsonl"]
    rows = [json.loads(line) for line in (tmp_path / "run" / "val_samples" / files[0]).read_text().splitlines()]
    assert sorted(r["index"] for r in rows) == list(range(10))  # data.max_val_samples=10, each once
    assert sum(r["score"] for r in rows) / len(rows) == pytest.approx(out["val/reward_mean"])
    assert all(r["prompt"] and set(r) == {"index", "prompt", "response", "response_length", "ground_truth", "score"}
               for r in rows)
    # the lengths are the ones val/response_length_mean and val/clipped_reward_mean count (cut = at the cap)
    assert sum(r["response_length"] for r in rows) / len(rows) == pytest.approx(out["val/response_length_mean"])
    cut = sum(r["score"] for r in rows if r["response_length"] >= cfg.data.max_response_length) / len(rows)
    assert cut == pytest.approx(out["val/clipped_reward_mean"])
    # the prompt as the chat template wrote it ("user\n4\nassistant\n"), and the successor task's truth for its digit
    assert all(r["ground_truth"] == str((int(r["prompt"].split("\n")[1]) + 1) % 10) for r in rows)


def test_several_validation_samples_need_a_temperature():
    with pytest.raises(ConfigError, match="rollout.val_temperature"):
        load_config(str(RECIPE), ["rollout.val_n=4"]).validate(1)
    load_config(str(RECIPE), ["rollout.val_n=4", "rollout.val_temperature=0.6"]).validate(1)
