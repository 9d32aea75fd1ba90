"""The ``env`` config section, the tasks made for tool use, and the engines' stop strings.

Multi-turn is off by default (every recipe but the tool ones leaves ``env.name`` null), bad settings are one line
naming the key, the ``mul3`` task's test pairs never reach training in either order (checked over 60,000 rows),
and both engines end a continuation at a stop string or id: the transformers engine by decoding (checked against
the same greedy continuation run without stops), vLLM through its own ``SamplingParams`` fields.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hybrid_rl.config import Config, ConfigError, load_config
from hybrid_rl.data import mul3
from hybrid_rl.data.tasks import TASKS
from hybrid_rl.rollout.base import Continuation, SamplingParams
from hybrid_rl.rollout.vllm import sampling_kwargs

ROOT = Path(__file__).resolve().parents[2]
LOOKUP = ROOT / "recipes" / "cpu_lookup_tool.yaml"


def test_multi_turn_is_off_by_default():
    assert Config().env.name is None
    for recipe in sorted((ROOT / "recipes").glob("*.yaml")):
        cfg = load_config(recipe)
        assert (cfg.env.name is not None) == (recipe.stem in ("cpu_lookup_tool", "calc_grpo_smollm2")), recipe


@pytest.mark.parametrize("overrides, message", [
    (["env.tools=[calc]"], "env.tools: 'calc' is not one of"),
    (["env.name=toolz"], "env.name='toolz' is not one of ['tools', 'lookup'"),
    (["env.call_format=xml"], "env.call_format='xml' is not one of ['hermes', 'tags']"),
    (["env.tools=[lookup,lookup]"], "names a tool twice"),
    (["env.max_turns=0"], "env.max_turns=0 must be a positive integer"),
    (["env.max_turn_tokens=9"], "env.max_turn_tokens=9 is more than the whole trajectory may hold "
                                "(data.max_response_length=8)"),
    (["env.tool_timeout_s=0"], "env.tool_timeout_s=0.0 must be > 0"),
    (["trainer.mode=overlap", "trainer.partial_rollouts=true", "trainer.max_staleness=2"],
     "trainer.partial_rollouts=true with env.name=lookup: partial rollouts would carry"),
    (["rollout.forced_lengths=fixed:4"], "rollout.forced_lengths with env.name=lookup"),
])
def test_bad_env_settings_name_the_key(overrides, message):
    with pytest.raises(ConfigError) as e:
        load_config(LOOKUP, overrides).validate()
    assert message in str(e.value) and "\n" not in str(e.value)


def test_a_bad_env_setting_exits_2_with_one_line(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "hybrid_rl", "train", str(LOOKUP), "env.tools=[nope]",
                           f"trainer.output_dir={tmp_path / 'run'}"], capture_output=True, text=True, cwd=ROOT,
                          timeout=120)
    assert proc.returncode == 2
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: env.tools: 'nope' is not one of"), proc.stderr
    assert not (tmp_path / "run").exists()  # nothing written


# --------------------------------------------------------------------------- tasks
def test_mul3_test_pairs_never_reach_training_in_either_order():
    test = mul3.held_out_rows()
    test_pairs = {mul3.identity(r["a"], r["b"]) for r in test}
    assert len(test) == len(test_pairs) == mul3.TEST_SIZE  # distinct problems
    rows = mul3.training_rows(60_000, seed=3)
    train_pairs = {mul3.identity(r["a"], r["b"]) for r in rows}
    assert not train_pairs & test_pairs
    # both orders of a pair occur in training (so an order-sensitive split would leak), and every answer is right
    assert sum((b, a) in {(r["a"], r["b"]) for r in rows} for a, b in [(r["a"], r["b"]) for r in rows[:2000]]) > 0
    for r in rows[:1000] + test:
        assert 100 <= r["a"] <= 999 and 100 <= r["b"] <= 999 and r["answer"] == r["a"] * r["b"]
        assert r["question"] == f"What is {r['a']} * {r['b']}?"
    # about a tenth of all pairs are held out: the hash splits, not the seed
    share = sum(mul3.is_held_out(a, b) for a in range(100, 1000, 7) for b in range(100, 1000, 11)) / (129 * 82)
    assert 0.08 < share < 0.12
    row = TASKS["mul3"].format_row(test[0], 0)
    assert row["ground_truth"] == str(test[0]["answer"]) and row["messages"][0]["content"].startswith("What is ")


def test_lookup_rows_hide_their_answer_from_the_prompt():
    rows = TASKS["lookup"].generate(200, seed=0)
    formatted = [TASKS["lookup"].format_row(r, i) for i, r in enumerate(rows)]
    assert {f["messages"][0]["content"] for f in formatted} == {"?"}  # every prompt the same
    assert {f["ground_truth"] for f in formatted} == {str(d) for d in range(10)}
    assert all(f["env_info"] == {"value": int(f["ground_truth"])} for f in formatted)


# --------------------------------------------------------------------------- stop strings
@pytest.fixture(scope="module")
def engine(tiny_model_path):
    from hybrid_rl.models import load_causal_lm, load_tokenizer
    from hybrid_rl.rollout.hf import HFRolloutEngine

    tok = load_tokenizer(tiny_model_path)
    model = load_causal_lm(tiny_model_path, torch.float32)
    return HFRolloutEngine(model, [tok.eos_token_id], tok.pad_token_id, torch.device("cpu"), tokenizer=tok), tok


def _greedy(engine, prompts, **stops):
    params = SamplingParams(temperature=0.0, **stops)
    return engine.generate_interruptible([Continuation(p, (), 24) for p in prompts], params)


def test_the_transformers_engine_stops_at_a_stop_string_and_id(engine):
    engine, tok = engine
    prompts = [tok.encode("<|im_start|>user\n" + t + "<|im_end|>\n<|im_start|>assistant\n") for t in ("7", "hello")]
    free = _greedy(engine, prompts)
    for p, seg in zip(prompts, free):
        tokens = seg.tokens
        assert len(tokens) >= 6
        text = tok.decode(tokens, skip_special_tokens=False)
        stop = tok.decode(tokens[2:5], skip_special_tokens=False)  # spans three tokens of the free run
        (cut,) = _greedy(engine, [p], stop=(stop,))
        # the first prefix of the free run whose text holds the stop string, and nothing after it
        expected = next(k for k in range(1, len(tokens) + 1) if stop in tok.decode(tokens[:k], skip_special_tokens=False))
        assert cut.tokens == tokens[:expected] and cut.finished and stop in text
        (by_id,) = _greedy(engine, [p], stop_token_ids=(tokens[3],))
        assert by_id.tokens == tokens[:tokens.index(tokens[3]) + 1] and by_id.finished


def test_vllm_gets_the_stops_as_its_own_fields():
    params = SamplingParams(stop=("</tool_call>",), stop_token_ids=(151658,))
    kw = sampling_kwargs(params, [151645])
    assert kw["stop"] == ["</tool_call>"] and kw["include_stop_str_in_output"] and kw["detokenize"]
    assert kw["skip_special_tokens"] is False  # matched on the text with special tokens, as the transformers engine
    assert kw["stop_token_ids"] == [151645, 151658]
    plain = sampling_kwargs(SamplingParams(), [151645])  # single-turn: as before, no detokenization
    assert "stop" not in plain and plain["detokenize"] is False and plain["stop_token_ids"] == [151645]


def test_a_multi_turn_vllm_engine_loads_the_tokenizer_its_stop_strings_need():
    """vLLM matches stop strings in its detokenizer, which an engine started with ``skip_tokenizer_init`` lacks (it
    then ignores ``stop`` without a word): multi-turn runs start it with the tokenizer, single-turn runs without."""
    from hybrid_rl.distributed import DistInfo
    from hybrid_rl.models import resolve_model_path
    from hybrid_rl.rollout.vllm import engine_kwargs

    one = DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
    multi = engine_kwargs(load_config(LOOKUP, ["rollout.name=vllm"]), one)
    assert multi["skip_tokenizer_init"] is False
    assert multi["tokenizer"] == multi["model"] == resolve_model_path(load_config(LOOKUP).model.path)
    single = engine_kwargs(load_config(LOOKUP, ["rollout.name=vllm", "env.name=null"]), one)
    assert single["skip_tokenizer_init"] is True and "tokenizer" not in single
    own = engine_kwargs(load_config(LOOKUP, ["rollout.name=vllm", "model.tokenizer_path=builtin:tiny-qwen2"]), one)
    assert own["tokenizer"] == resolve_model_path("builtin:tiny-qwen2")


def test_stop_strings_on_an_engine_without_its_tokenizer_are_refused():
    from hybrid_rl.rollout.vllm import VLLMRolloutEngine

    class NoTokenizer:
        tokenizer = None

        def add_request(self, *args):
            raise AssertionError("nothing may reach the engine")

    eng = VLLMRolloutEngine.__new__(VLLMRolloutEngine)
    eng.llm = None
    with pytest.raises(ValueError, match="stop strings need vLLM's tokenizer"):
        eng._add_continuations(NoTokenizer(), [Continuation(prompt=[1, 2], tokens=[], max_tokens=4)],
                               SamplingParams(stop=("</calculator>",)))
