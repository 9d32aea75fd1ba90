"""The reward model (``reward.model``, ``hybrid_rl/rewards/model.py``), the ``chat`` task and the planner's phase.

- Scores: micro-batched, length-sorted, right-padded scoring gives each conversation the score transformers gives it
  alone (tokenized by the reward model's own chat template, no padding), in the batch's order; a conversation over
  ``max_length`` is scored on its last tokens and counted.
- ``compute_scores``: the reward is the function's score plus ``weight`` × the model's, per sample.
- Bad paths and non-reward models fail in one line naming ``reward.model.path``.
- The ``chat`` task reads ``prompt`` (text or messages) and ``messages`` rows; without a reward source it is refused.
- The planner adds a ``reward model`` phase: the model's parameters (counted from the built model) and its micro-batch.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from hybrid_rl.batch import Batch
from hybrid_rl.config import ConfigError, RewardModelConfig, load_config
from hybrid_rl.data.tasks import DataError, get_task
from hybrid_rl.models import ModelLoadError, load_tokenizer, resolve_model_path
from hybrid_rl.phases.reward import compute_scores
from hybrid_rl.rewards.model import RewardModel

from helpers import ROOT

RM = "builtin:tiny-qwen2-rm"
CONVERSATIONS = [
    [{"role": "user", "content": "3"}],
    [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "What comes after 41?"}],
    [{"role": "user", "content": "7"}],
    [{"role": "user", "content": "a much longer question, to pad the others in its micro-batch"}],
    [{"role": "user", "content": "0"}],
]
RESPONSES = ["4", "42", "8, I think", "no idea", "1"]


def _alone(path: str, messages, response: str, last: int | None = None) -> float:
    """The score transformers gives one conversation: its chat template tokenized, one row, no padding."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32).eval()
    ids = tok.apply_chat_template([*messages, {"role": "assistant", "content": response}], tokenize=True,
                                  return_dict=False)
    ids = ids[-last:] if last else ids
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0, 0].item()


def test_scores_are_each_conversation_scored_alone():
    model = RewardModel(RewardModelConfig(path=RM, micro_batch_size=2), torch.device("cpu"))
    scores, cut = model.score(CONVERSATIONS, RESPONSES)
    path = resolve_model_path(RM)
    expected = [_alone(path, m, r) for m, r in zip(CONVERSATIONS, RESPONSES)]
    assert cut == 0
    assert torch.allclose(scores, torch.tensor(expected), atol=1e-5), (scores, expected)
    assert len(set(round(s, 4) for s in expected)) == len(expected)  # distinct: the order is checked too


def test_a_conversation_over_max_length_is_scored_on_its_last_tokens():
    model = RewardModel(RewardModelConfig(path=RM, max_length=12), torch.device("cpu"))
    scores, cut = model.score(CONVERSATIONS[:2], RESPONSES[:2])
    path = resolve_model_path(RM)
    assert cut == 2  # both are longer than 12 tokens with the template
    expected = [_alone(path, m, r, last=12) for m, r in zip(CONVERSATIONS[:2], RESPONSES[:2])]
    assert torch.allclose(scores, torch.tensor(expected), atol=1e-5)


def _batch(tokenizer, messages, responses, truths) -> Batch:
    """A rollout batch of these responses (their tokens after a one-token prompt), keeping each prompt's messages."""
    rows = [tokenizer(r, add_special_tokens=False)["input_ids"] for r in responses]
    width = max(len(r) for r in rows)
    resp = torch.full((len(rows), width), tokenizer.pad_token_id)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        resp[i, :len(r)], mask[i, :len(r)] = torch.tensor(r), 1
    prompts = torch.full((len(rows), 1), tokenizer.pad_token_id)
    return Batch(tensors=dict(prompts=prompts, responses=resp, response_mask=mask,
                              input_ids=torch.cat([prompts, resp], 1),
                              attention_mask=torch.cat([torch.ones_like(prompts), mask], 1)),
                 non_tensors=dict(ground_truth=np.array(truths, dtype=object),
                                  messages=np.array([json.dumps(m) for m in messages], dtype=object)))


def test_the_reward_is_the_function_plus_the_weighted_model_score(tiny_model_path):
    tokenizer = load_tokenizer(tiny_model_path)
    messages, responses, truths = CONVERSATIONS[:3], ["4", "42", "9"], ["4", "41", "8"]
    model = RewardModel(RewardModelConfig(path=RM, weight=0.25), torch.device("cpu"))
    out, stats = compute_scores(_batch(tokenizer, messages, responses, truths), tokenizer,
                                lambda response, truth: float(response == truth), "raise", reward_model=model)
    path = resolve_model_path(RM)
    alone = [_alone(path, m, r) for m, r in zip(messages, responses)]
    expected = [1.0 + 0.25 * alone[0], 0.25 * alone[1], 0.25 * alone[2]]
    assert torch.allclose(out.tensors["scores"], torch.tensor(expected), atol=1e-5)
    # the score sits on each response's last token
    last = out.tensors["response_mask"].sum(1) - 1
    assert torch.allclose(out.tensors["token_level_scores"][torch.arange(3), last], torch.tensor(expected), atol=1e-5)
    assert stats["reward/model_mean"] == pytest.approx((sum(alone), 3.0), abs=1e-4)
    assert stats["reward/model_truncated"] == (0.0, 3.0)


@pytest.mark.parametrize("path, says", [
    ("/no/such/reward_model", "does not exist"),
    ("builtin:tiny-qwen2", "is a Qwen2ForCausalLM, not a reward model"),
])
def test_a_path_that_is_no_reward_model_fails_in_one_line(path, says):
    with pytest.raises(ModelLoadError) as e:
        RewardModel(RewardModelConfig(path=path), torch.device("cpu"))
    assert "reward.model.path" in str(e.value) and says in str(e.value) and "\n" not in str(e.value)


def test_the_chat_task_reads_prompts_and_messages():
    chat = get_task("chat")
    assert chat.format_row({"prompt": "hi"}, 1)["messages"] == [{"role": "user", "content": "hi"}]
    msgs = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
    row = chat.format_row({"messages": msgs, "ground_truth": 7, "extra": 1}, 2)
    assert row["messages"] == msgs and row["ground_truth"] == "7"
    assert chat.format_row({"prompt": msgs}, 3)["ground_truth"] == ""
    for bad in ({"prompt": []}, {"messages": [{"role": "user"}]}, {"question": "q"}):
        with pytest.raises(DataError):
            chat.format_row(bad, 4)


def test_a_chat_task_without_a_reward_source_is_refused():
    recipe = str(ROOT / "recipes" / "cpu_successor.yaml")
    with pytest.raises(ConfigError, match="reward.model.path"):
        load_config(recipe, ["data.task=chat", "data.train_path=x.jsonl", "data.val_path=null"]).validate(1)
    load_config(recipe, ["data.task=chat", "data.train_path=x.jsonl", "data.val_path=null",
                         f"reward.model.path={RM}"]).validate(1)


def test_the_planner_has_a_reward_model_phase():
    from transformers import AutoModelForSequenceClassification

    from hybrid_rl.planner.estimate import phases
    from hybrid_rl.planner.shape import read_shape

    cfg = load_config(str(ROOT / "recipes" / "cpu_reward_model.yaml"),
                      ["reward.model.micro_batch_size=4", "reward.model.max_length=100"])
    got = {p.name: p for p in phases(cfg, read_shape(cfg.model.path), 1, 80 * 2**30)}
    params = sum(p.numel() for p in AutoModelForSequenceClassification.from_pretrained(resolve_model_path(RM)).parameters())
    terms = got["reward model"].terms
    assert terms["reward model weights"] == 2 * params  # bf16 on a GPU (dtype auto)
    assert terms["reward model activations (400 tokens)"] > 0
    assert "reward model" not in {p.name for p in phases(load_config(str(ROOT / "recipes" / "cpu_successor.yaml")),
                                                         read_shape(cfg.model.path), 1, 80 * 2**30)}


def test_plan_says_when_a_reward_model_is_not_counted(capsys, tmp_path):
    from hybrid_rl.__main__ import main

    recipe = str(ROOT / "recipes" / "cpu_reward_model.yaml")
    assert main(["plan", recipe, "--gpus", "1", "--gpu", "H100"]) == 0
    out = capsys.readouterr().out
    assert "\nreward model " in out and "not counted" not in out  # the phase's row
    assert main(["plan", recipe, f"reward.model.path={tmp_path / 'elsewhere'}", "--gpus", "1", "--gpu", "H100"]) == 0
    out = capsys.readouterr().out
    assert "\nreward model " not in out and "not counted: the reward model" in out
