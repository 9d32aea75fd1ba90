"""Tests for hybrid_rl.rewards (and hybrid_rl.data.answers): GSM8K extraction/scoring, successor scoring, and the registry."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a checkout without installing

from hybrid_rl.data.answers import extract_answer  # noqa: E402
from hybrid_rl.rewards import RewardError, get_reward_fn, score_responses  # noqa: E402
from hybrid_rl.rewards import gsm8k, successor  # noqa: E402

# 1,024 rows of the GSM8K train split, shipped with the benchmarks (benchmarks/data/README.md)
GSM8K_1K = Path(__file__).resolve().parents[2] / "benchmarks" / "data" / "gsm8k_train_1k.jsonl"


@pytest.mark.parametrize("text, strict, flexible", [
    ("so 9 * 2 = 18\n#### 18", "18", "18"),
    ("#### 5\nthen again #### 7", "7", "7"),
    ("#### 1,000", "1000", "1000"),
    ("#### $1,234.50", "1234.50", "1234.50"),
    ("#### -3", "-3", "-3"),
    ("#### 18 eggs.", "18", "18"),
    ("The total is \\boxed{42}.", None, "42"),
    ("Thus \\boxed{\\$1{,}250} in all", None, "1250"),
    ("\\boxed{18 \\text{ dollars}}", None, "18"),
    ("\\boxed{\\frac{1}{2}} is wrong but \\boxed{7}", None, "7"),
    ("so \\boxed{x = 5}", None, "5"),
    ("\\boxed{\\frac{1}{2}}", None, "\\frac{1}{2}"),  # not a plain number: kept whole, never "1"
    ("She earns 3 per hour. The answer is $42 dollars.", None, "42"),
    ("**Answer:** 12", None, "12"),
    ("First 16 - 3 - 4 = 9, then 9 * 2 = 18 dollars.", None, "18"),
    ("It costs $3.50 each.", None, "3.50"),
    ("The temperature drops to -5 degrees", None, "-5"),
    ("10-3 leaves", None, "3"),
    ("We get 1, 2, 3", None, "3"),
    ("I don't know.", None, None),
    ("", None, None),
    # the result of an expression in the answer clause, not its first operand
    ("The answer is 12 * 3 = 36.", None, "36"),
    ("answer = 3 + 4 = 7", None, "7"),
    ("**Answer:** 10 - 3 = 7", None, "7"),
    ("answer: 3 - 10 = -7", None, "-7"),
    ("The answer is 5 × 3 = 15 cookies", None, "15"),
    ("The answer is 2 * $4.50 = $9.00.", None, "9.00"),
    ("The answer is 36 (12 * 3).", None, "36"),
    # strict: the #### line must be just a number (with $ , units, a trailing period or bold)
    ("#### 2. Final step\nAdd them: 3 + 4 = 7 apples.", None, "7"),
    ("#### 1. Read the problem\nThe answer is 9.", None, "9"),
    ("#### Step 2\nso 5", None, "5"),
    ("#### 2. Final step\nStuff.\n#### 36", "36", "36"),
    ("#### 18.", "18", "18"),
    ("#### **42**", "42", "42"),
    ("#### 25%", "25", "25"),
    ("#### 1,000 dollars", "1000", "1000"),
    ("#### 18 per hour\n", "18", "18"),
    ("#### 18\r\n", "18", "18"),
    ("So it is #### 18", "18", "18"),
])
def test_extract_answer_table(text, strict, flexible):
    assert extract_answer(text, "strict") == strict
    assert extract_answer(text, "flexible") == flexible
    assert extract_answer(text) == flexible


# (response, ground truth, score with the default flexible method, score with method="strict")
GSM8K_SCORE_CASES = [
    ("#### 5.0", "5", 1.0, 1.0),
    ("#### 1,000", "1000", 1.0, 1.0),
    ("The answer is $18.", "18", 1.0, 0.0),
    ("#### 17", "18", 0.0, 0.0),
    ("no number", "18", 0.0, 0.0),
    ("#### -2", "-2", 1.0, 1.0),
    ("\\boxed{x+1}", "x + 1", 1.0, 0.0),  # non-numeric: normalised string compare
    ("so 18", "18", 1.0, 0.0),
    # the result of an expression in the answer clause
    ("The answer is 12 * 3 = 36.", "36", 1.0, 0.0),
    ("The answer is 12 * 3 = 36.", "12", 0.0, 0.0),
    ("answer = 3 + 4 = 7", "7", 1.0, 0.0),
    ("answer = 3 + 4 = 7", "3", 0.0, 0.0),
    ("Final Answer: 1,200 / 4 = 300 dollars.", "300", 1.0, 0.0),
    ("The answer is 3 - 10 = -7.", "-7", 1.0, 0.0),
    # a markdown heading is not the #### answer
    ("#### 2. Final step\nAdd them: 3 + 4 = 7 apples.", "7", 1.0, 0.0),
    ("#### 2. Final step\nAdd them: 3 + 4 = 7 apples.", "2", 0.0, 0.0),
    ("#### 2. Final step\nThe answer is 9.\n#### 9", "9", 1.0, 1.0),
    # formats a GSM8K grader accepts: commas, negatives, $ signs, trailing periods, units
    ("The answer is 7.", "7", 1.0, 0.0),
    ("The answer is 1,000.", "1000", 1.0, 0.0),
    ("The answer is -5.", "-5", 1.0, 0.0),
    ("The answer is $1,250.50.", "1250.5", 1.0, 0.0),
    ("#### $1,250.50", "1250.50", 1.0, 1.0),
    ("#### 18.", "18", 1.0, 1.0),
    ("#### 18 eggs.", "18", 1.0, 1.0),
    ("#### 1,000,000", "1000000", 1.0, 1.0),
    ("#### 0.5", ".5", 1.0, 1.0),
    ("#### -$3", "-3", 1.0, 1.0),
]


@pytest.mark.parametrize("response, truth, score, strict_score", GSM8K_SCORE_CASES)
def test_gsm8k_compute_score(response, truth, score, strict_score):
    assert gsm8k.compute_score(response, truth) == score
    assert gsm8k.compute_score(response, truth, method="strict") == strict_score


def test_gsm8k_strict_method():
    assert gsm8k.compute_score("so 18", "18") == 1.0
    assert gsm8k.compute_score("so 18", "18", method="strict") == 0.0


def test_gsm8k_real_answers_score_one():
    from hybrid_rl.data import TASKS

    rows = [json.loads(line) for line in GSM8K_1K.read_text().splitlines() if line.strip()]
    assert len(rows) == 1024
    truths = [TASKS["gsm8k"].format_row(r, i)["ground_truth"] for i, r in enumerate(rows)]
    # The reference solutions themselves must score 1, and against a ground truth off by one 0 (also for the file's
    # answers in the hundreds of millions).
    assert all(gsm8k.compute_score(r["answer"], t) == 1.0 for r, t in zip(rows, truths))
    assert all(gsm8k.compute_score(r["answer"], str(int(float(t)) + 1)) == 0.0 for r, t in zip(rows, truths))


def test_successor_scores():
    assert successor.compute_score("8", "8") == 1.0
    assert successor.compute_score(" 8\n", "8") == 1.0
    assert successor.compute_score("3", "8") == 0.0
    assert successor.compute_score("88", "8") == 0.0
    assert successor.compute_score("8.", "8") == 0.0
    assert successor.compute_score("", "8") == 0.0
    assert successor.compute_score("a", "8") == 0.0


# --------------------------------------------------------------------------- registry
def test_builtin_and_auto():
    assert get_reward_fn("auto", "gsm8k") is gsm8k.compute_score
    assert get_reward_fn("auto", "successor") is successor.compute_score
    assert get_reward_fn("gsm8k", "successor") is gsm8k.compute_score
    with pytest.raises(RewardError, match="reward.function"):
        get_reward_fn("nonsense", "gsm8k")


def test_module_function(tmp_path, monkeypatch):
    (tmp_path / "my_reward_mod.py").write_text(
        "def score(response, ground_truth):\n    return float(response == ground_truth)\nNOT_FN = 3\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    fn = get_reward_fn("my_reward_mod:score", "gsm8k")
    assert fn("a", "a") == 1.0 and fn("a", "b") == 0.0
    file_fn = get_reward_fn(f"{tmp_path / 'my_reward_mod.py'}:score", "gsm8k")
    assert file_fn("a", "a") == 1.0
    for name, what in [("no_such_module_xyz:score", "cannot import"), ("my_reward_mod:missing", "no attribute"),
                       ("my_reward_mod:NOT_FN", "not a function")]:
        with pytest.raises(RewardError) as ei:
            get_reward_fn(name, "gsm8k")
        assert "reward.function" in str(ei.value) and what in str(ei.value)


@pytest.mark.parametrize("source, called_ok", [
    ("def score():\n    return 1.0\n", False),
    ("def score(response):\n    return 1.0\n", False),
    ("def score(response, ground_truth, extra):\n    return 1.0\n", False),
    ("def score(*, response, ground_truth):\n    return 1.0\n", False),
    ("def score(response, ground_truth, extra=1, **kw):\n    return 1.0\n", True),
    ("def score(*args):\n    return 1.0\n", True),
    ("class Score:\n    def __call__(self, response, ground_truth):\n        return 1.0\nscore = Score()\n", True),
], ids=["no arguments", "one", "three", "keyword-only", "extra with defaults", "varargs", "callable object"])
def test_a_reward_function_that_cannot_take_response_and_ground_truth_is_refused_by_its_key(tmp_path, source,
                                                                                             called_ok):
    path = tmp_path / "user_reward.py"
    path.write_text(source)
    spec = f"{path}:score"
    # what calling it the way every sample is scored does, independently of the check
    namespace: dict = {}
    exec(source, namespace)
    try:
        namespace["score"]("r", "g")
        callable_as_scored = True
    except TypeError:
        callable_as_scored = False
    assert callable_as_scored == called_ok
    if called_ok:
        assert get_reward_fn(spec, "gsm8k")("r", "g") == 1.0
        return
    with pytest.raises(RewardError) as ei:
        get_reward_fn(spec, "gsm8k")
    msg = str(ei.value)
    assert msg.startswith(f"reward.function={spec!r}: score(") and "(response, ground_truth)" in msg, msg
    assert "_hybrid_rl_reward" not in msg and "\n" not in msg


def test_a_failing_reward_is_named_by_the_key_and_the_value_as_written(tmp_path):
    from hybrid_rl.rewards import RewardScorer

    path = tmp_path / "raising.py"
    path.write_text("def score(response, ground_truth):\n    raise ZeroDivisionError('boom')\n")
    scorer = RewardScorer(f"{path}:score", "gsm8k", num_workers=0)
    with pytest.raises(RewardError) as ei:
        scorer.score(["a"], ["b"])
    msg = str(ei.value)
    assert msg.startswith(f"reward.function='{path}:score' failed on sample 0 (ZeroDivisionError: boom)"), msg
    assert "_hybrid_rl_reward" not in msg


def _raising(response, ground_truth):
    if response == "boom":
        raise KeyError("missing thing")
    if response == "nan":
        return math.nan
    if response == "none":
        return None
    return 1.0


def test_score_responses_raise_message():
    with pytest.raises(RewardError) as ei:
        score_responses(_raising, ["ok", "boom"], ["1", "gt-value"], on_error="raise")
    msg = str(ei.value)
    assert "\n" not in msg
    for part in ("sample 1", "_raising", "KeyError", "missing thing", "'boom'", "'gt-value'", "reward.on_error=zero"):
        assert part in msg, part


def test_score_responses_shortens_long_text():
    with pytest.raises(RewardError) as ei:
        score_responses(_raising, ["none"], ["x\n" * 500], on_error="raise")
    msg = str(ei.value)
    assert "\n" not in msg and len(msg) < 600 and "sample 0" in msg


def test_score_responses_zero_counts():
    scores, failed = score_responses(_raising, ["ok", "boom", "nan", "none", "ok"], ["1"] * 5, on_error="zero")
    assert scores == [1.0, 0.0, 0.0, 0.0, 1.0] and failed == 3
    scores, failed = score_responses(lambda r, g: {"score": 0.5}, ["a"], ["b"], on_error="raise")
    assert scores == [0.5] and failed == 0
    with pytest.raises(RewardError, match="nan"):
        score_responses(_raising, ["nan"], ["1"], on_error="raise")
    with pytest.raises(RewardError, match="reward.on_error"):
        score_responses(_raising, ["ok"], ["1"], on_error="skip")


def test_gsm8k_answer_stats_tell_format_from_any_answer_and_reach_the_metrics():
    """reward/format_strict and reward/answer_found: the fractions of responses with the '####' line the prompt asks
    for and with any answer the flexible reward reads (a 135M instruct model writes 'The answer is 5' and loops to
    the length cap: these say which way a run moves apart from the reward)."""
    import torch

    from hybrid_rl.batch import Batch
    from hybrid_rl.data.tasks import TASKS
    from hybrid_rl.models import build_tiny_tokenizer
    from hybrid_rl.phases.reward import compute_scores

    texts = ["6 + 12 = 18.\n#### 18", "The answer is 5.", "no digits here", "so we get 7 apples"]
    assert TASKS["gsm8k"].answer_stats(texts) == {"format_strict": 1.0, "answer_found": 3.0}
    assert TASKS["successor"].answer_stats(texts) == {}
    tok = build_tiny_tokenizer()
    ids = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    width = max(map(len, ids))
    responses = torch.tensor([r + [tok.pad_token_id] * (width - len(r)) for r in ids])
    mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in ids])
    batch = Batch(tensors=dict(responses=responses, response_mask=mask),
                  non_tensors=dict(ground_truth=np.array(["18", "5", "3", "8"], dtype=object)))
    out, stats = compute_scores(batch, tok, gsm8k.compute_score, "raise", TASKS["gsm8k"])
    assert out.tensors["scores"].tolist() == [1.0, 1.0, 0.0, 0.0]
    assert stats["reward/format_strict"] == (1.0, 4.0) and stats["reward/answer_found"] == (3.0, 4.0)
    _, val_stats = compute_scores(batch, tok, gsm8k.compute_score, "raise", TASKS["gsm8k"], prefix="val")
    assert set(val_stats) == {"val/errors", "val/format_strict", "val/answer_found"}
    _, plain = compute_scores(batch, tok, gsm8k.compute_score, "raise")
    assert set(plain) == {"reward/errors"}
