"""The ``math`` task and reward, verl's data rows and verl's reward-function signature.

- ``reward.function=math``: the last ``\\boxed{}`` of a response against a LaTeX ground truth, equal as mathematics
  (expected values written by hand from the mathematics, not from math-verify's output).
- ``data.task=math`` rows in MATH's layouts (``problem``/``answer``, ``problem``/``solution``), and verl's rows
  (``prompt``, ``reward_model.ground_truth``, ``data_source``, ``extra_info``) in the ``math``, ``gsm8k`` and
  ``chat`` tasks; one-line errors for bad rows.
- A reward function receives a sample's ``data_source`` and ``extra_info`` when it names them, in this process and
  in worker processes; verl's ``compute_score(data_source, solution_str, ground_truth, extra_info)`` runs unchanged.
"""

from __future__ import annotations

import json

import pytest

from hybrid_rl.data.answers import last_boxed
from hybrid_rl.data.tasks import MATH_INSTRUCTION, TASKS, DataError
from hybrid_rl.rewards import RewardError, RewardScorer, get_reward_fn
from hybrid_rl.rewards import math as math_reward


@pytest.mark.parametrize("response, truth, score", [
    (r"The answer is \boxed{\frac{1}{2}}.", "0.5", 1.0),
    (r"\boxed{\dfrac{1}{2}}", r"\frac12", 1.0),
    (r"so $x = 3$, \boxed{x = 3}", "3", 1.0),
    (r"\boxed{\frac{\sqrt{2}}{2}}", r"\frac{1}{\sqrt{2}}", 1.0),   # the same number, rationalised
    (r"\boxed{2\sqrt{2}}", r"\sqrt{8}", 1.0),
    (r"\boxed{(1, 2)}", "(1,2)", 1.0),                               # an open interval, spacing aside
    (r"\boxed{[1, 2)}", "(1,2)", 0.0),                               # a different interval
    (r"\boxed{2, 1}", "1,2", 1.0),                                   # a set of solutions, in any order
    (r"\boxed{x^2 + 2x + 1}", "(x+1)^2", 1.0),
    (r"\boxed{90^\circ}", "90", 1.0),
    (r"\boxed{3}", "4", 0.0),
    (r"\boxed{\pi}", "3.14", 0.0),                                   # close is not equal
    (r"the answer is 1/2", "0.5", 0.0),                              # no \boxed{}: no answer
    (r"\boxed{1", "1", 0.0),                                         # cut off inside the box
    (r"\boxed{1} then \boxed{2}", "2", 1.0),                         # the last box is the answer
    (r"\boxed{\text{(C)}}", r"\text{(C)}", 1.0),
    (r"\boxed{\frac{1}{2}}", r"\boxed{\frac{1}{2}}", 1.0),           # a ground truth with its own box
])
def test_math_reward_compares_answers_as_mathematics(response, truth, score):
    assert math_reward.compute_score(response, truth) == score
    assert get_reward_fn("auto", "math")(response, truth) == score


def test_last_boxed_keeps_nested_braces():
    assert last_boxed(r"\boxed{a} and \boxed{\frac{1}{\sqrt{2}}}.") == r"\frac{1}{\sqrt{2}}"
    assert last_boxed(r"\fbox{7}") == "7" and last_boxed("7") is None and last_boxed(r"\boxed{\frac{1}{2}") is None


def test_the_math_reward_runs_in_worker_processes_by_default_and_scores_as_in_process():
    responses = [r"\boxed{\frac{1}{2}}", r"\boxed{3}", "none", r"\boxed{x=4}"]
    truths = ["0.5", "4", "1", "4"]
    pooled = RewardScorer("auto", "math", timeout_s=60)
    try:
        assert pooled.pool is not None
        assert pooled.score(responses, truths) == ([1.0, 0.0, 0.0, 1.0], 0)
    finally:
        pooled.close()
    local = RewardScorer("math", "math", num_workers=0)
    assert local.pool is None and local.score(responses, truths) == ([1.0, 0.0, 0.0, 1.0], 0)


def test_without_math_verify_the_math_reward_is_refused_in_one_line(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "math_verify" else real(name, *a))
    with pytest.raises(RewardError) as ei:
        get_reward_fn("auto", "math")
    msg = str(ei.value)
    assert msg.startswith("reward.function='auto' (the math task's 'math') needs the math-verify package")
    assert "pip install -e '.[math]'" in msg and "\n" not in msg


# --------------------------------------------------------------------------- rows
def test_math_rows_in_the_layouts_of_math_datasets():
    task = TASKS["math"]
    a = task.format({"problem": "What is $1+1$?", "answer": "2", "level": "Level 1"}, 1)
    assert a == {"messages": [{"role": "user", "content": f"What is $1+1$? {MATH_INSTRUCTION}"}],
                 "ground_truth": "2", "data_source": "math"}
    b = task.format({"problem": "Half of one?", "solution": r"It is $\boxed{\frac{1}{2}}$.", "type": "Algebra"}, 2)
    assert b["ground_truth"] == r"\frac{1}{2}"
    c = task.format({"question": "Q?", "answer": 7, "data_source": "aime24", "extra_info": {"id": 3}}, 3)
    assert c["ground_truth"] == "7" and c["data_source"] == "aime24" and c["extra_info"] == {"id": 3}
    assert MATH_INSTRUCTION == r"Let's think step by step and output the final answer within \boxed{}."


@pytest.mark.parametrize("row, words", [
    ({"problem": "Q?", "solution": "no box here"}, "has no \\boxed{} answer"),
    ({"problem": "Q?"}, "has no 'answer' field"),
    ({"problem": "", "answer": "1"}, "must be a non-empty text"),
    ({"problem": "Q?", "answer": "1", "extra_info": [1]}, "'extra_info' must be a mapping"),
    ({"question": "Q?", "answer": "2 + 2 = 4\n#### 4"}, "set data.task=gsm8k for GSM8K's rows"),
])
def test_bad_math_rows_are_one_line_errors(row, words):
    with pytest.raises(DataError) as ei:
        TASKS["math"].format(row, 5)
    assert str(ei.value).startswith("row 5") and words in str(ei.value) and "\n" not in str(ei.value)


def _verl_row(truth, source="openai/gsm8k", extra=None):
    return {"data_source": source, "prompt": [{"role": "system", "content": "be brief"},
                                              {"role": "user", "content": "Q? Let's think step by step."}],
            "ability": "math", "reward_model": {"style": "rule", "ground_truth": truth},
            "extra_info": extra if extra is not None else {"split": "train", "index": 4}}


@pytest.mark.parametrize("task", ["math", "gsm8k", "chat"])
def test_verl_rows_are_taken_as_they_are(task):
    row = _verl_row("72")
    out = TASKS[task].format(row, 1)
    assert out["messages"] == row["prompt"]  # no instruction added: verl's preparation wrote the prompt
    assert out["ground_truth"] == "72" and out["data_source"] == "openai/gsm8k"
    assert out["extra_info"] == {"split": "train", "index": 4} and out["env_info"] == out["extra_info"]
    assert TASKS[task].format(_verl_row(["1", "2"]), 2)["ground_truth"] == '["1", "2"]'
    with pytest.raises(DataError) as ei:
        TASKS[task].format({**row, "reward_model": {"style": "rule"}}, 3)
    assert "'reward_model' has no 'ground_truth'" in str(ei.value)


def test_the_synthetic_tasks_keep_their_own_layout():
    with pytest.raises(DataError):  # a verl row is not a successor row
        TASKS["successor"].format(_verl_row("1"), 1)


# --------------------------------------------------------------------------- reward-function signatures
PLAIN_WITH_INFO = """
def score(response, ground_truth, data_source=None, extra_info=None):
    return float(extra_info["k"]) + (10.0 if data_source == "b" else 0.0)
"""
VERL_STYLE = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return {"score": float(solution_str == ground_truth) + extra_info["k"] + (10.0 if data_source == "b" else 0.0)}
"""
KWARGS = """
def score(response, ground_truth, **kwargs):
    return float(kwargs["extra_info"]["k"]) + (10.0 if kwargs["data_source"] == "b" else 0.0)
"""


@pytest.mark.parametrize("source, attr", [(PLAIN_WITH_INFO, "score"), (VERL_STYLE, "compute_score"),
                                          (KWARGS, "score")], ids=["named", "verl", "kwargs"])
@pytest.mark.parametrize("workers", [0, 1])
def test_a_reward_function_gets_each_samples_data_source_and_extra_info(tmp_path, source, attr, workers):
    path = tmp_path / "user_reward.py"
    path.write_text(source)
    scorer = RewardScorer(f"{path}:{attr}", "math", num_workers=workers, timeout_s=60)
    infos = [("a", json.dumps({"k": 1})), ("b", json.dumps({"k": 2})), ("a", json.dumps({"k": 3}))]
    try:
        scores, failed = scorer.score(["x", "y", "z"], ["x", "q", "q"], infos=infos)
    finally:
        scorer.close()
    exact = [1.0, 0.0, 0.0] if attr == "compute_score" else [0.0, 0.0, 0.0]  # verl's: solution_str == ground_truth
    assert failed == 0 and scores == [e + k for e, k in zip(exact, [1.0, 12.0, 3.0])]


def test_a_verl_function_with_another_required_parameter_is_refused_in_one_line(tmp_path):
    path = tmp_path / "r.py"
    path.write_text("def compute_score(data_source, solution_str, ground_truth, tokenizer):\n    return 1.0\n")
    with pytest.raises(RewardError) as ei:
        get_reward_fn(f"{path}:compute_score", "math")
    msg = str(ei.value)
    assert "takes solution_str, so it is called as verl calls a reward function" in msg and "\n" not in msg


# --------------------------------------------------------------------------- majority vote (val/reward_maj_of_n)
def test_majority_scores_take_the_most_frequent_answer_per_prompt():
    from hybrid_rl.validation import majority_scores

    keys = ["7", "3", "7", None,      # 7 twice: its score (the first 7's)
            "1", "2", "2", "1",       # a tie: the answer given first, 1
            None, None, None, None,   # no answer: 0
            "5", None, None, None]    # one answer among no answers
    scores = [1.0, 0.0, 1.0, 0.0,  0.0, 1.0, 1.0, 0.0,  1.0, 1.0, 1.0, 1.0,  0.5, 0.0, 0.0, 0.0]
    assert majority_scores(keys, scores, 4) == [1.0, 0.0, 0.0, 0.5]


@pytest.mark.parametrize("task, response, key", [
    ("math", r"so \boxed{\dfrac{1}{2}}.", r"\frac{1}{2}"),
    ("math", "no box", None),
    ("gsm8k", "... #### 18.00", repr(18.0)),
    ("gsm8k", "The answer is 18", repr(18.0)),
    ("arith", "It is 1,234.", "1234"),
    ("successor", " 7 ", "7"),
    ("chat", "anything", None),
])
def test_vote_keys(task, response, key):
    assert TASKS[task].vote_key(response) == key
    assert TASKS[task].votes == (task != "chat")
