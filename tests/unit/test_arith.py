"""The arithmetic task: deterministic problems, a test split no training row can reach in any order or wording, right
answers, the reward's rule as a table, config errors, and the recipe running two steps on CPU with the real model."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from hybrid_rl.config import ConfigError, load_config
from hybrid_rl.data import DataError, load_rows
from hybrid_rl.data.arith import ArithConfig, held_out_rows, training_rows
from hybrid_rl.data.tasks import get_task
from hybrid_rl.rewards.arith import compute_score, compute_score_strict

ROOT = Path(__file__).resolve().parents[2]


def _operation(question: str) -> tuple[str, list[int]]:
    """The operation a question asks and its numbers, read from the text alone (not from the generator)."""
    nums = [int(x) for x in re.findall(r"\d+", question)]
    if question.startswith("Which number is the largest"):
        return "max", nums
    if " + " in question or "buys" in question and "more" in question or "collected" in question:
        return "+", nums
    if " - " in question or "gives" in question or "takes out" in question:
        return "-", nums
    if " * " in question or "in each bag" in question:
        return "*", nums
    raise AssertionError(f"unrecognised question {question!r}")


def _solve(question: str) -> int:
    op, nums = _operation(question)
    if op == "max":
        return max(nums)
    a, b = nums
    return {"+": a + b, "-": a - b, "*": a * b}[op]


def _canonical(question: str) -> tuple:
    """The problem a question asks whatever its wording and the order of commutative operands: + and * by their
    operands as a multiset, the largest of a list by the list as a multiset, - by its operands in order."""
    op, nums = _operation(question)
    return (op, tuple(nums) if op == "-" else tuple(sorted(nums)))


def test_rows_are_deterministic_and_seeded():
    cfg = ArithConfig()
    assert training_rows(300, 0, cfg) == training_rows(300, 0, cfg)
    assert training_rows(300, 0, cfg) != training_rows(300, 1, cfg)
    assert held_out_rows(cfg) == held_out_rows(ArithConfig())


def test_test_set_is_balanced_distinct_and_right():
    rows = held_out_rows(ArithConfig())
    assert len(rows) == 1000
    assert [r["family"] for r in rows[:10]] == ["add", "sub", "mul", "max", "word"] * 2  # any prefix is balanced
    for family in ("add", "sub", "mul", "max", "word"):
        assert sum(r["family"] == family for r in rows) == 200
    # 1,000 distinct problems, not only distinct texts: no test problem is another one commuted or reworded
    assert len({_canonical(r["question"]) for r in rows}) == 1000
    for r in rows:
        assert int(r["answer"]) == _solve(r["question"]), r


@pytest.fixture(scope="module")
def test_set() -> list[dict]:
    return held_out_rows(ArithConfig())


@pytest.mark.parametrize("seed", [0, 1, 7])
def test_no_test_problem_is_ever_trained_on(test_set, seed):
    """No training row, in any family, order or wording, is a test problem: ``46 * 7`` in training would be the test
    problem ``7 * 46``, and ``Tom has 37 apples and buys 45 more`` the test problem ``37 + 45``."""
    test_ids = {_canonical(r["question"]) for r in test_set}
    train = training_rows(50000, seed, ArithConfig())
    train_ids = {_canonical(r["question"]) for r in train}
    assert not test_ids & train_ids
    families = ("add", "sub", "mul", "max", "word")
    assert {r["family"] for r in train} == {r["family"] for r in test_set} == set(families)
    for family in families:
        assert sum(r["family"] == family for r in train) == 10000
    # word problems reach all three operations, in both splits: the check above compares them with add/sub/mul
    for rows in (train, test_set):
        assert {_operation(r["question"])[0] for r in rows if r["family"] == "word"} == {"+", "-", "*"}
    # disjoint although together they nearly cover the space: of the 8 * 90 distinct products of a factor 2-9 and a
    # two-digit one, training holds about three in five and the test set the rest it needs (a split by chance
    # would overlap on most of them)
    mul_train = {i for i in train_ids if i[0] == "*"}
    mul_test = {i for i in test_ids if i[0] == "*"}
    assert len(mul_test) > 200 and len(mul_train) + len(mul_test) > 0.85 * 8 * 90
    for r in train[:2000]:
        assert int(r["answer"]) == _solve(r["question"])


def test_the_split_is_named_in_the_config():
    cfg = load_config(str(ROOT / "recipes/arith_grpo_smollm2.yaml"), [])
    assert cfg.data.arith.split == "canonical" and ArithConfig().split == "canonical"
    with pytest.raises(ConfigError, match=r"data.arith.split='ordered' is not one of \['canonical'\]"):
        load_config(str(ROOT / "recipes/arith_grpo_smollm2.yaml"), ["data.arith.split=ordered"])


def test_held_out_rows_through_load_rows():
    cfg = ArithConfig(families=["add", "max"], test_size=100)
    val = load_rows("synthetic:arith", "test", None, "arith", 64, 1, options=cfg, held_out=True)
    assert len(val) == 100 and {r["family"] for r in val} == {"add", "max"}
    train = load_rows("synthetic:arith", "train", None, "arith", 64, 0, options=cfg)
    assert len(train) == 64
    assert not {_canonical(r["question"]) for r in val} & {_canonical(r["question"]) for r in train}
    # a synthetic task without a test set validates on rows of another seed
    assert len(load_rows("synthetic:successor", "test", None, "successor", 8, 1, held_out=True)) == 8


def test_prompt_and_source_per_family():
    row = get_task("arith").format_row({"family": "mul", "question": "What is 7 * 46?", "answer": "322"}, 0)
    assert row["messages"] == [{"role": "user", "content": "What is 7 * 46? Answer with just the number."}]
    assert row["ground_truth"] == "322" and row["data_source"] == "arith_mul"
    with pytest.raises(DataError, match="'answer' must be an integer"):
        get_task("arith").format_row({"question": "What is 1 + 1?", "answer": "two"}, 3)


@pytest.mark.parametrize("response,truth,flexible,strict", [
    ("82", "82", 1.0, 1.0),
    (" 82.\n", "82", 1.0, 1.0),
    ("The answer is 82.", "82", 1.0, 0.0),
    ("37 + 45 = 82", "82", 1.0, 0.0),
    ("82 or 83", "82", 0.0, 0.0),          # the last number decides
    ("It is 82.5", "82", 0.0, 0.0),        # not an integer
    ("82.0", "82", 1.0, 0.0),
    ("1,234", "1234", 1.0, 1.0),
    ("-7", "-7", 1.0, 1.0),
    ("10-3", "7", 0.0, 0.0),               # an expression, not its value
    ("no idea", "5", 0.0, 0.0),
    ("", "5", 0.0, 0.0),
    ("x2", "2", 0.0, 0.0),                 # a digit inside a word is not a number
])
def test_reward_rule(response, truth, flexible, strict):
    assert compute_score(response, truth) == flexible
    assert compute_score_strict(response, truth) == strict


def test_answer_shape_counts():
    stats = get_task("arith").answer_stats(["82", "The answer is 82", "none", "7."])
    assert stats == {"format_exact": 2.0, "answer_found": 3.0}


@pytest.mark.parametrize("override,message", [
    ("data.arith.families=[add,div]", r"data.arith.families=\['add', 'div'\]: use a non-empty list"),
    ("data.arith.digits=0", "data.arith.digits=0 must be 1-6"),
    ("data.arith.list_length=1", "data.arith.list_length=1 must be 2-20"),
    ("data.arith.test_size=3", "data.arith.test_size=3 must be at least one problem per family"),
])
def test_bad_settings_name_the_key(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(str(ROOT / "recipes/arith_grpo_smollm2.yaml"), [override]).validate()


def test_a_test_set_larger_than_the_held_out_problems_is_refused():
    with pytest.raises(ValueError, match="lower data.arith.test_size or raise data.arith.digits"):
        held_out_rows(ArithConfig(families=["mul"], digits=1, test_size=200))


@pytest.mark.slow
def test_recipe_runs_two_steps_on_cpu(tmp_path, smollm2_path):
    """The shipped recipe with the transformers engine on CPU, the real model, 2 small steps: validation reports every
    family and the answer shape. Skipped, with the reason, only where the model cannot be had (conftest.py)."""
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "hybrid_rl", "train", "recipes/arith_grpo_smollm2.yaml", "rollout.name=hf",
           "trainer.device=cpu", f"trainer.output_dir={out}", "trainer.total_steps=2", "trainer.test_freq=2",
           "trainer.save_freq=-1", "data.train_batch_size=2", "rollout.n=2", "actor.ppo_mini_batch_size=2",
           "data.max_response_length=16", "data.arith.test_size=10", "data.val_batch_size=10",
           "data.num_synthetic=64"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]
    for r in (rows[0], rows[2]):
        for family in ("add", "sub", "mul", "max", "word"):
            assert 0.0 <= r[f"val/reward_mean/arith_{family}"] <= 1.0
        assert "val/format_exact" in r and "val/answer_found" in r
    # every family's accuracy is 2 of the 10 problems: their mean is the overall accuracy
    fams = [rows[2][f"val/reward_mean/arith_{f}"] for f in ("add", "sub", "mul", "max", "word")]
    assert sum(fams) / 5 == pytest.approx(rows[2]["val/reward_mean"])
    assert "reward/format_exact" in rows[1]
