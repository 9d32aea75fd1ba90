"""Data and rewards through the trainer, end to end on CPU: verl's data and reward functions unchanged, several
reward functions by weight, several validation files, the code task through the sandbox, and maj@n.

The first test's data file is a parquet of verl rows (``prompt`` messages, ``reward_model.ground_truth``,
``data_source``, ``extra_info``) from two sources; the reward function is verl's ``compute_score(data_source,
solution_str, ground_truth, extra_info)``, unchanged. It pays 1 for a row whose ``extra_info.index`` is even (every
``src_a`` row) and 0 otherwise (every ``src_b`` row), whatever the response, so the validation figures per source
are known in advance (1 and 0), and the sources' share of each training step's samples fixes ``reward/mean``. Every
call it receives is written to a log, which must show each row's own ``data_source`` and ``extra_info``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from helpers import ROOT, run_checked

REWARD = '''
import json, os

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    with open(os.environ["VERL_REWARD_LOG"], "a") as f:
        f.write(json.dumps({"data_source": data_source, "ground_truth": ground_truth, "extra_info": extra_info}) + "\\n")
    return {"score": 1.0 if extra_info["index"] % 2 == 0 else 0.0, "acc": 0.0}
'''


def _train(out: Path, *overrides: str) -> list[str]:
    """``python -m hybrid_rl train`` of the default recipe into ``out``, metrics to ``metrics.jsonl`` only."""
    return [sys.executable, "-m", "hybrid_rl", "train", str(ROOT / "recipes" / "cpu_successor.yaml"),
            f"trainer.output_dir={out}", "trainer.logger=[jsonl]", *overrides]


def test_a_verl_dataset_and_reward_function_run_unchanged(tmp_path, monkeypatch):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"data_source": "src_a" if i % 2 == 0 else "src_b",
             "prompt": [{"role": "user", "content": str(i % 10)}],
             "ability": "digits", "reward_model": {"style": "rule", "ground_truth": str((i + 1) % 10)},
             "extra_info": {"split": "train", "index": i}} for i in range(12)]
    data = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist(rows), data)
    reward = tmp_path / "verl_reward.py"
    reward.write_text(REWARD)
    log = tmp_path / "calls.jsonl"
    monkeypatch.setenv("VERL_REWARD_LOG", str(log))
    out = tmp_path / "run"
    run_checked(_train(out, "trainer.save_freq=-1",
                 "trainer.total_steps=2", "trainer.test_freq=2", "data.task=math", f"data.train_path={data}",
                 f"data.val_path={data}", "data.train_batch_size=6", "rollout.n=2", "actor.ppo_mini_batch_size=6",
                 "actor.ppo_micro_batch_size_per_device=12",
                 f"reward.function={reward}:compute_score"), timeout=300)
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    val = [m for m in metrics if "val/reward_mean" in m]
    assert len(val) == 2
    for m in val:  # 6 rows of each source: 1 and 0 by the function's rule, and their mean
        assert m["val/reward_mean/src_a"] == 1.0 and m["val/reward_mean/src_b"] == 0.0
        assert m["val/reward_mean"] == pytest.approx(0.5)
    by_index = {r["extra_info"]["index"]: r for r in rows}
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    assert len(calls) == 2 * 12 + 2 * 6 * 2  # two validations of 12 rows, two steps of 6 prompts x 2 samples
    for c in calls:
        row = by_index[c["extra_info"]["index"]]
        assert c == {"data_source": row["data_source"], "ground_truth": row["reward_model"]["ground_truth"],
                     "extra_info": row["extra_info"]}
    train = [m for m in metrics if "reward/mean" in m]
    assert len(train) == 2
    # the calls in order: validation before training, step 1, step 2, validation at step 2
    for m, step_calls in zip(train, (calls[12:24], calls[24:36])):
        share_a = sum(c["data_source"] == "src_a" for c in step_calls) / len(step_calls)
        assert m["reward/mean"] == pytest.approx(share_a)


def test_several_reward_functions_add_by_their_weights_and_are_logged_each(tmp_path):
    """``reward.extra_functions`` beside the task's reward: ``reward/mean`` is the successor reward's mean plus 0.5
    × the extra function's (a reward for a response that starts with an even digit), in training and validation, and each
    function's own mean is logged under its name."""
    extra = tmp_path / "shape.py"
    extra.write_text("def even_digit(response, ground_truth):\n"
                     "    return 1.0 if response[:1] in ('0', '2', '4', '6', '8') else 0.0\n")
    out = tmp_path / "run"
    run_checked(_train(out, "trainer.save_freq=-1",
                 "trainer.total_steps=2", "trainer.test_freq=2", f"reward.extra_functions=[{extra}:even_digit]",
                 "reward.extra_weights=[0.5]", "trainer.validation_data_dir=val"), timeout=300)
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    train = [m for m in metrics if "reward/mean" in m]
    val = [m for m in metrics if "val/reward_mean" in m]
    assert len(train) == 2 and len(val) == 2
    for m in train:
        assert m["reward/mean"] == pytest.approx(m["reward/function/successor"] + 0.5 * m["reward/function/even_digit"],
                                                 abs=1e-6)
        assert 0 < m["reward/function/even_digit"] < 1
    for m, step in zip(val, (0, 2)):  # each function recomputed from the samples validation wrote
        samples = [json.loads(line) for line in (out / "val" / f"step_{step:08d}_rank0.jsonl").read_text().splitlines()]
        succ = [float(s["response"].strip() == s["ground_truth"]) for s in samples]
        even = [float(s["response"][:1] in ("0", "2", "4", "6", "8")) for s in samples]
        assert m["val/function/successor"] == pytest.approx(sum(succ) / len(samples), abs=1e-6)
        assert m["val/function/even_digit"] == pytest.approx(sum(even) / len(samples), abs=1e-6)
        assert m["val/reward_mean"] == pytest.approx((sum(succ) + 0.5 * sum(even)) / len(samples), abs=1e-6)


def test_several_validation_files_are_reported_each_by_name(tmp_path):
    """``data.val_path`` (and ``train_path``) as a list of two files: each row's ``data_source`` is its file's name,
    which the reward function reads (1 for ``first``, 0 for ``second``), so the per-file validation figures are known
    (1 and 0) and their mean is weighted by the files' sizes (6 and 4 prompts)."""
    first = tmp_path / "first.jsonl"
    first.write_text("".join(json.dumps({"prompt": str(d)}) + "\n" for d in range(6)))
    second = tmp_path / "second.jsonl"
    second.write_text("".join(json.dumps({"prompt": str(d)}) + "\n" for d in range(4)))
    reward = tmp_path / "by_source.py"
    reward.write_text("def score(response, ground_truth, data_source=None):\n"
                      "    return 1.0 if data_source == 'first' else 0.0\n")
    out = tmp_path / "run"
    run_checked(_train(out, "trainer.save_freq=-1",
                 "trainer.total_steps=1", "trainer.test_freq=1", "data.task=chat", f"data.train_path=[{first},{second}]",
                 f"data.val_path=[{first},{second}]", "data.train_batch_size=5", "rollout.n=2",
                 "actor.ppo_mini_batch_size=5", "actor.ppo_micro_batch_size_per_device=10",
                 f"reward.function={reward}:score", "reward.num_workers=0"), timeout=300)
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    val = [m for m in metrics if "val/reward_mean" in m]
    assert len(val) == 2
    for m in val:
        assert m["val/reward_mean/first"] == 1.0 and m["val/reward_mean/second"] == 0.0
        assert m["val/reward_mean"] == pytest.approx(6 / 10)


def test_a_code_task_run_scores_through_the_sandbox(tmp_path):
    """``data.task=code`` from MBPP-style rows: the ground truth reaches the ``code`` reward in its worker processes
    and the run logs its answer shape. The tiny model writes no code block in 4 tokens, so every score is 0."""
    rows = tmp_path / "mbpp.jsonl"
    rows.write_text("".join(json.dumps({"text": f"Return {d}.", "test_list": [f"assert f() == {d}"]}) + "\n"
                            for d in range(8)))
    out = tmp_path / "run"
    run_checked(_train(out, "trainer.save_freq=-1", "trainer.total_steps=1",
                 "trainer.test_freq=1", "data.task=code", f"data.train_path={rows}", f"data.val_path={rows}",
                 "data.max_prompt_length=256", "data.train_batch_size=8", "rollout.n=2", "actor.ppo_mini_batch_size=8",
                 "actor.ppo_micro_batch_size_per_device=16"), timeout=300)
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    train = [m for m in metrics if "reward/mean" in m]
    assert len(train) == 1 and train[0]["reward/mean"] == 0.0 and train[0]["reward/code_found"] == 0.0
    assert [m["val/reward_mean"] for m in metrics if "val/reward_mean" in m] == [0.0, 0.0]


def test_majority_vote_of_n_samples_is_recomputed_from_the_written_samples(tmp_path):
    """``rollout.val_n=4`` at temperature 1 on the successor task (one-token answers, a reward for a low digit):
    ``val/reward_maj_of_n`` is, per prompt, the score of the answer most of its 4 samples give (a tie to the answer
    given first; no answer scores 0), recomputed here from the samples validation wrote."""
    from collections import Counter

    reward = tmp_path / "low_digit.py"  # pays often enough at the start for the figures to say something
    reward.write_text("def score(response, ground_truth):\n    return float(response[:1] in '01234')\n")
    out = tmp_path / "run"
    run_checked(_train(out, "trainer.save_freq=-1", "trainer.total_steps=15",
                 "trainer.test_freq=15", "rollout.val_n=4", "rollout.val_temperature=1.0", "data.max_val_samples=20",
                 "trainer.validation_data_dir=val", f"reward.function={reward}:score", "reward.num_workers=0",
                 "data.max_response_length=1"),  # one-token answers: a prompt's samples often agree
                timeout=300)
    vals = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if "val/reward_mean" in line]
    assert len(vals) == 2
    for row, step in zip(vals, (0, 15)):
        samples = [json.loads(line) for line in (out / "val" / f"step_{step:08d}_rank0.jsonl").read_text().splitlines()]
        by_prompt: dict[int, list[dict]] = {}
        for s in samples:
            by_prompt.setdefault(s["index"], []).append(s)
        maj, votes = [], 0
        for group in by_prompt.values():
            answers = [s["response"].strip() for s in group if s["response"].strip()]
            if not answers:
                maj.append(0.0)
                continue
            counts = Counter(answers)
            top = max(counts.values())
            votes += top > 1
            winner = next(a for a in answers if counts[a] == top)
            maj.append(next(s["score"] for s in group if s["response"].strip() == winner))
        assert row["val/reward_maj_of_n"] == pytest.approx(sum(maj) / len(maj), abs=1e-6)
        assert 0 < row["val/reward_mean"] < 1
    assert votes >= 1  # some prompt's samples agree: a real vote, not only the first sample's score


def test_a_reward_server_scores_a_run(tmp_path):
    """``reward.remote.url`` (OpenRLHF's protocol) from a local server paying each response's length in characters:
    ``reward/remote_mean`` is the mean length of the step's responses as the server saw them, ``reward/mean`` 0.5 ×
    that (``reward.function=none``), every query is the prompt as the chat template wrote it followed by the
    response, and each step posts its 8 × 4 samples."""
    sys.path.insert(0, str(ROOT / "tests" / "unit"))
    try:
        from test_remote_reward import _Server
    finally:
        sys.path.pop(0)
    server = _Server()
    try:
        out = tmp_path / "run"
        run_checked(_train(out, "trainer.save_freq=-1",
                     "trainer.total_steps=2", "trainer.test_freq=0", "trainer.val_before_train=false",
                     "reward.function=none", f"reward.remote.url={server.url}", "reward.remote.weight=0.5",
                     "reward.remote.batch_size=5", "data.train_batch_size=8", "rollout.n=4",
                     "actor.ppo_mini_batch_size=8", "actor.ppo_micro_batch_size_per_device=32"), timeout=300)
    finally:
        server.close()
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    assert len(metrics) == 2
    for m in metrics:
        assert m["reward/mean"] == pytest.approx(0.5 * m["reward/remote_mean"], abs=1e-6)
    queries = [(q, p, r) for req in server.requests for q, p, r in zip(req["query"], req["prompts"], req["responses"])]
    assert len(queries) == 2 * 8 * 4
    for q, p, r in queries:
        assert q == p + r and "<|im_start|>" in p  # the template's own tokens, as OpenRLHF sends them
    step1 = [len(r) for _, _, r in queries[:32]]  # the first step's requests all end before the second's begin
    assert metrics[0]["reward/remote_mean"] == pytest.approx(sum(step1) / 32, abs=1e-6)
