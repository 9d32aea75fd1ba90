"""The memory planner (hybrid_rl/planner/): terms checked against hand-computed bytes, the verdict, the CLI, train's check."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hybrid_rl.__main__ import main
from hybrid_rl.config import load_config
from hybrid_rl.planner import check
from hybrid_rl.planner.estimate import phases
from hybrid_rl.planner.shape import ShapeError, read_shape
from hybrid_rl.planner.verdict import judge

RECIPE = str(Path(__file__).resolve().parents[2] / "recipes" / "cpu_successor.yaml")
GIB = 2**30
# the tiny built-in: hidden 64, MLP 128, 2 layers, 4 heads of 16 with 2 key/value heads (kv width 32), tied
# embeddings over a vocabulary of 103 (3 special tokens + 100 printable characters)
H, I, L, KV, V = 64, 128, 2, 32, 103
LAYER = (H * H + H) + 2 * (H * KV + KV) + H * H + 3 * H * I + 2 * H  # q+bias, k/v+bias, o, gate/up/down, 2 norms
PARAMS = L * LAYER + V * H + H  # blocks, tied embedding, final norm


# the engine sleeps between rollouts, so that the training phases' verdicts are the trainer's own
BASE = ["trainer.device=cuda", "model.dtype=bfloat16", "rollout.name=hf", "data.max_prompt_length=32",
        "data.max_response_length=32", "rollout.free_cache_engine=true"]


def _cfg(*overrides: str, world: int = 1):
    return load_config(RECIPE, [*BASE, *overrides]).validate(world)


def test_tiny_shape_param_count():
    assert PARAMS == 80896  # 2 × 37,120 + 6,592 + 64, added up by hand
    assert read_shape("builtin:tiny-qwen2").params == PARAMS


def test_states_and_activations_match_hand_computed_bytes():
    cfg = _cfg("actor.use_remove_padding=false", "actor.share_prompts=false", "actor.fused_logprob=true",
               "actor.ppo_micro_batch_size_per_device=4", "actor.ppo_mini_batch_size=32", world=2)
    update = {p.name: p for p in phases(cfg, read_shape(cfg.model.path), 2, 80 * GIB)}["actor update"].terms
    assert update["actor params (fp32, sharded)"] == 4 * PARAMS / 2
    assert update["actor grads (fp32, sharded)"] == 4 * PARAMS / 2
    assert update["actor AdamW (2 x fp32, sharded)"] == 8 * PARAMS / 2
    tokens = 4 * (32 + 32)  # 4 sequences at full length
    per_token_layer = 22 * H + 4 * KV + 8 * I  # bf16 norms' fp32 copies, attention, the gated MLP's four I-wide tensors
    assert update[f"activations ({tokens} tokens)"] == tokens * L * per_token_layer


def test_gradients_are_held_only_in_their_models_update():
    """The optimizer step frees the gradients: each model's fp32 gradient shards (4 bytes a trainable parameter over
    the ranks) are a term of its own update phase and of no other phase."""
    cfg = _cfg("algorithm.adv_estimator=gae", world=2)
    by_name = {p.name: p.terms for p in phases(cfg, read_shape(cfg.model.path), 2, 80 * GIB)}
    critic_params = PARAMS + H + 1  # the backbone (tied: no separate head to drop) and a scalar value head
    grads = {"actor update": ("actor grads (fp32, sharded)", 4 * PARAMS / 2),
             "critic update": ("critic grads (fp32, sharded)", 4 * critic_params / 2)}
    assert {"weight push", "generation", "old log-prob", "critic values"} <= by_name.keys()
    for name, terms in by_name.items():
        for update, (term, size) in grads.items():
            assert terms.get(term) == (size if name == update else None), (name, term)
    assert by_name["generation"]["critic params (fp32, sharded)"] == 4 * critic_params / 2
    assert by_name["critic update"]["critic params (fp32, sharded)"] == 4 * critic_params / 2


def test_accumulating_unsharded_holds_whole_gradients_and_no_shards_beside_the_activations():
    """With ``accumulate_unsharded`` the update accumulates whole fp32 gradients (4 bytes a parameter, on every rank)
    and reduce-scatters them only in its last backward, as the activations are freed: the update holds those, not
    the shards as well (peaks measured on 1×H200 agree within 3%, ``plan_calibration.py``); the critic's likewise."""
    cfg = _cfg("algorithm.adv_estimator=gae", "actor.accumulate_unsharded=true", world=2)
    by_name = {p.name: p.terms for p in phases(cfg, read_shape(cfg.model.path), 2, 80 * GIB)}
    critic_params = PARAMS + H + 1
    assert by_name["actor update"]["unsharded grads (fp32, whole model)"] == 4 * PARAMS
    assert by_name["critic update"]["unsharded grads (fp32, whole model)"] == 4 * critic_params
    assert "actor grads (fp32, sharded)" not in by_name["actor update"]
    assert "critic grads (fp32, sharded)" not in by_name["critic update"]
    # the critic reduce-scattering every micro-batch holds its shards again
    off = _cfg("algorithm.adv_estimator=gae", "actor.accumulate_unsharded=true", "critic.accumulate_unsharded=false",
               world=2)
    critic = {p.name: p.terms for p in phases(off, read_shape(off.model.path), 2, 80 * GIB)}["critic update"]
    assert critic["critic grads (fp32, sharded)"] == 4 * critic_params / 2


def test_recomputation_keeps_layer_inputs_and_one_layer():
    cfg = _cfg("actor.use_remove_padding=false", "actor.share_prompts=false", "model.enable_gradient_checkpointing=true",
               "actor.ppo_micro_batch_size_per_device=2", "actor.ppo_mini_batch_size=32")
    update = {p.name: p for p in phases(cfg, read_shape(cfg.model.path), 1, 80 * GIB)}["actor update"].terms
    tokens = 2 * 64
    assert update[f"activations ({tokens} tokens, recomputed)"] == tokens * (L * H * 2 + 22 * H + 4 * KV + 8 * I)
    # at the micro-batch a run logged (here 40 tokens and 24 for the log-prob pass) instead of the worst case
    at = {p.name: p for p in phases(cfg, read_shape(cfg.model.path), 1, 80 * GIB,
                                    {"actor update": 40, "old log-prob": 24})}
    assert at["actor update"].terms["activations (40 tokens, recomputed)"] == 40 * (L * H * 2 + 22 * H + 4 * KV + 8 * I)
    assert at["old log-prob"].terms["activations, no grad (24 tokens)"] == 24 * (16 * H + 6 * I)


# a 0.5B shape on one 16 GiB card: 16 bytes per parameter of states, and the update's activations decide
BIG = ["model.path=builtin:qwen2.5-0.5b-random", "data.max_prompt_length=512", "data.max_response_length=512",
       "actor.log_prob_micro_batch_size_per_device=1"]


def _fits(*overrides: str, gib: float = 16.0) -> bool:
    cfg = _cfg(*BIG, *overrides)
    return judge(cfg, read_shape(cfg.model.path), 1, gib * GIB)[1].fits


def test_verdict_flips_with_micro_batch_and_recomputation():
    assert not _fits("actor.ppo_micro_batch_size_per_device=8")
    assert _fits("actor.ppo_micro_batch_size_per_device=1")
    assert _fits("actor.ppo_micro_batch_size_per_device=8", "model.enable_gradient_checkpointing=true")


def test_verdict_names_one_setting_that_fits():
    cfg = _cfg(*BIG, "actor.ppo_micro_batch_size_per_device=8")
    _, verdict = judge(cfg, read_shape(cfg.model.path), 1, 16 * GIB)
    assert verdict.peak.name == "actor update"
    # prompts shared (on CUDA by default): 4 of a prompt's 16 samples compute 512 + 4 x 512 tokens, 8 of them 512 + 8 x 512
    assert verdict.fix == "lower actor.ppo_micro_batch_size_per_device to 4"
    assert _fits("actor.ppo_micro_batch_size_per_device=4") and not _fits("actor.ppo_micro_batch_size_per_device=8")
    # without sharing, 4 samples compute 4 x 1024 tokens: the largest that fits is 2
    _, verdict = judge(_cfg(*BIG, "actor.ppo_micro_batch_size_per_device=8", "actor.share_prompts=false"),
                       read_shape(cfg.model.path), 1, 16 * GIB)
    assert verdict.fix == "lower actor.ppo_micro_batch_size_per_device to 2"


def test_cli_prints_the_table_and_exits_0_when_it_fits(capsys):
    code = main(["plan", RECIPE, *BASE, "--gpus", "1", "--gpu-memory-gb", "80"])
    out = capsys.readouterr().out
    assert code == 0
    assert "actor update" in out and "old log-prob" in out and "generation" in out
    assert out.strip().splitlines()[-1].startswith("fits: peak")


def test_cli_exits_1_naming_the_setting_when_it_does_not_fit(capsys):
    code = main(["plan", RECIPE, *BASE, *BIG, "actor.ppo_micro_batch_size_per_device=8", "--gpus", "1",
                 "--gpu-memory-gb", "16"])
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert code == 1
    assert last.startswith("does not fit: actor update") and last.endswith("actor.ppo_micro_batch_size_per_device to 4")


def test_cli_unknown_model_path_is_one_line(capsys, tmp_path):
    code = main(["plan", RECIPE, f"model.path={tmp_path / 'nowhere'}", "--gpus", "1", "--gpu", "H100"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "no config.json here" in err[0]


def test_local_config_json_is_read(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                                          num_attention_heads=4, num_key_value_heads=2, vocab_size=103,
                                                          tie_word_embeddings=True)))
    assert read_shape(str(tmp_path)).params == PARAMS
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ShapeError, match="hidden_size"):
        read_shape(str(tmp_path))


def test_train_check_refuses_clearly_too_big_and_names_the_setting():
    cfg = _cfg(*BIG, "actor.ppo_micro_batch_size_per_device=16")
    line = check.memory_refusal(cfg, 1, 16 * GIB)
    assert line is not None and "actor.ppo_micro_batch_size_per_device to 4" in line
    assert "trainer.check_memory=false" in line
    assert check.memory_refusal(_cfg(*BIG, "actor.ppo_micro_batch_size_per_device=1"), 1, 16 * GIB) is None


def test_train_check_is_off_on_cpu_and_when_disabled(monkeypatch):
    monkeypatch.setattr(check, "visible_gpu", lambda: ("small", 1.0))  # any real config is too big for 1 GiB
    assert check.check_memory(_cfg(*BIG), 1) is not None
    assert check.check_memory(_cfg(*BIG, "trainer.check_memory=false"), 1) is None
    assert check.check_memory(_cfg(*BIG, "trainer.device=cpu"), 1) is None
    monkeypatch.setattr(check, "visible_gpu", lambda: None)
    assert check.check_memory(_cfg(*BIG), 1) is None


# -- sequence parallelism, tensor parallelism, hub shapes, the 7B recipe
SP_BASE = ["actor.use_remove_padding=true", "actor.share_prompts=false", "actor.fused_logprob=true",
           "actor.ppo_micro_batch_size_per_device=4", "actor.ppo_mini_batch_size=32"]


def _update_terms(*overrides: str, world: int) -> dict[str, float]:
    cfg = _cfg(*SP_BASE, *overrides, world=world)
    return {p.name: p for p in phases(cfg, read_shape(cfg.model.path), world, 80 * GIB)}["actor update"].terms


def test_sequence_parallel_cuts_activations_and_head_rows_per_rank():
    tokens = 4 * (32 + 32)  # 4 sequences at full length: the micro-batch of whole rows
    whole = _update_terms(world=4)
    assert whole[f"activations ({tokens} tokens)"] == tokens * L * (22 * H + 4 * KV + 8 * I)
    # size 2: 128 tokens a rank; each keeps 1 of the 2 key/value heads over all 256 positions (width 16 × 2 = KV)
    two = _update_terms("actor.ulysses_sequence_parallel_size=2", world=4)
    assert two[f"activations (128 tokens, 1/2 of {tokens})"] == 128 * L * (22 * H + 4 * KV + 8 * I)
    # size 4: 64 tokens a rank; the 2 key/value heads are repeated to 4, one per rank: width 16 × 4 per slice token
    four = _update_terms("actor.ulysses_sequence_parallel_size=4", world=4)
    assert four[f"activations (64 tokens, 1/4 of {tokens})"] == 64 * L * (22 * H + 4 * 16 * 4 + 8 * I)
    # the fused head over a rank's response rows: 128 of the 256 tokens are responses, 32 of them in a quarter slice
    assert whole["logits"] == 128 * V * 10 + 4 * V * H
    assert four["logits"] == 32 * V * 10 + 4 * V * H
    # the sharded states do not change: FSDP still shards over all 4 ranks
    assert four["actor AdamW (2 x fp32, sharded)"] == whole["actor AdamW (2 x fp32, sharded)"] == 8 * PARAMS / 4


def test_tensor_parallel_engine_wakes_its_share_of_the_weights_for_the_push():
    def push(tp: int) -> float:
        cfg = _cfg("rollout.name=vllm", f"rollout.vllm.tensor_parallel_size={tp}", world=2)
        return {p.name: p for p in phases(cfg, read_shape(cfg.model.path), 2, 80 * GIB)}["weight push"].terms[
            "engine weights"]

    assert push(1) == 2 * PARAMS and push(2) == PARAMS  # bf16, whole or halved


def test_verdict_names_sequence_parallelism_for_a_long_row():
    # 0.5B shape, one 16k-token row per micro-batch without recomputation on 2 × 24 GiB: the budget cannot go below
    # one sequence, so the row's activations are cut over the two ranks instead
    long_row = ["model.path=builtin:qwen2.5-0.5b-random", "rollout.name=vllm", "rollout.vllm.gpu_memory_utilization=0.2",
                "data.max_prompt_length=512", "data.max_response_length=15872", "actor.use_dynamic_bsz=true",
                "actor.max_token_len_per_device=16384", "actor.ppo_mini_batch_size=32", "actor.use_remove_padding=true"]
    cfg = _cfg(*long_row, world=2)
    _, verdict = judge(cfg, read_shape(cfg.model.path), 2, 24 * GIB)
    assert not verdict.fits and verdict.peak.name == "actor update"
    assert verdict.fix == "set actor.ulysses_sequence_parallel_size=2"
    after = _cfg(*long_row, "actor.ulysses_sequence_parallel_size=2", world=2)
    assert judge(after, read_shape(after.model.path), 2, 24 * GIB)[1].fits


def test_known_hub_ids_are_planned_from_their_published_shape(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))  # nothing downloaded here
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    seven = read_shape("Qwen/Qwen2.5-7B-Instruct")
    assert (seven.hidden, seven.intermediate, seven.layers, seven.heads, seven.kv_heads, seven.vocab, seven.tied) == \
        (3584, 18944, 28, 28, 4, 152064, False)
    assert read_shape("Qwen/Qwen2.5-1.5B-Instruct").params == read_shape("builtin:qwen2.5-1.5b-random").params
    with pytest.raises(ShapeError, match="no config.json here"):
        read_shape("Qwen/Qwen2.5-3B-Instruct")


@pytest.mark.parametrize("gpus, card", [(8, "H100"), (4, "H200")])
def test_7b_recipe_fits_the_boxes_it_names(capsys, gpus, card):
    recipe = str(Path(RECIPE).parent / "gsm8k_grpo_7b.yaml")
    assert main(["plan", recipe, "--gpus", str(gpus), "--gpu", card]) == 0
    assert capsys.readouterr().out.strip().splitlines()[-1].startswith("fits: peak")


def test_a_packing_critic_cuts_its_rows_like_the_actor():
    def critic_update(*overrides: str) -> dict[str, float]:
        cfg = _cfg(*SP_BASE, "algorithm.adv_estimator=gae", "critic.ppo_micro_batch_size_per_device=4",
                   "critic.ppo_mini_batch_size=32", "actor.ulysses_sequence_parallel_size=4", *overrides, world=4)
        return {p.name: p for p in phases(cfg, read_shape(cfg.model.path), 4, 80 * GIB)}["critic update"].terms

    tokens = 4 * (32 + 32)  # 4 whole sequences: 64 a rank when cut in 4, key/value heads repeated to 4 (width 64)
    assert critic_update("critic.use_remove_padding=true")[f"activations (64 tokens, 1/4 of {tokens})"] == \
        64 * L * (22 * H + 4 * 16 * 4 + 8 * I)
    assert critic_update("critic.use_remove_padding=false")[f"activations ({tokens} tokens)"] == \
        tokens * L * (22 * H + 4 * KV + 8 * I)


def test_the_engine_says_what_memory_it_takes_not_its_name(monkeypatch):
    """The planner reads an engine's GPU memory from its options section (``memory()``), never from ``rollout.name``:
    vLLM's options reserve their share of the card; an engine without a section holds its weights, KV cache and
    logits; and any engine that says it reserves a share is planned as vLLM is, its fix naming its own key."""
    from hybrid_rl.config import RolloutConfig
    from hybrid_rl.rollout import EngineMemory

    vllm = _cfg("rollout.name=vllm", "rollout.vllm.gpu_memory_utilization=0.4", "rollout.vllm.tensor_parallel_size=1",
                "rollout.vllm.fit_kv_cache=false")
    assert vllm.rollout.engine_memory() == EngineMemory(0.4, "rollout.vllm.gpu_memory_utilization", 1)
    assert _cfg().rollout.engine_memory() == EngineMemory()
    gen = lambda cfg: next(p for p in phases(cfg, read_shape("builtin:tiny-qwen2"), 1, 80 * GIB)  # noqa: E731
                           if p.name == "generation").terms["engine (awake)"]
    assert gen(vllm) == 0.4 * 80 * GIB
    assert gen(_cfg()) < 0.01 * GIB  # the tiny model's weights, cache and logits
    monkeypatch.setattr(RolloutConfig, "engine_memory", lambda self: EngineMemory(0.25, "rollout.other.share", 1))
    hf = _cfg()
    assert gen(hf) == 0.25 * 80 * GIB
    from hybrid_rl.planner.verdict import _engine_share  # the candidate fixes that lower the share: its own key

    assert _engine_share(hf) == [{"rollout.other.share": k / 20} for k in (4, 3, 2)]
    monkeypatch.undo()
    assert _engine_share(_cfg()) == []


def test_a_fitted_kv_cache_is_planned_as_what_the_engine_holds():
    """``rollout.vllm.fit_kv_cache`` (the default): the awake engine is its 16-bit weights, the fitted KV cache and one
    step's logits, not its share; where the fit would take over half of the share beside the weights, the share."""
    shape = read_shape("builtin:tiny-qwen2")  # 2 layers, 2 key/value heads of 16 dims, vocabulary 103
    cfg = _cfg("rollout.name=vllm", "rollout.max_num_seqs=8", "data.max_prompt_length=24", "data.max_response_length=8")
    engine = next(p for p in phases(cfg, shape, 1, 80 * GIB) if p.name == "generation").terms["engine (awake)"]
    kv = 8 * (24 + 8 + 256) * (2 * 2 * 2 * 16 * 2)  # sequences x (tokens + a block's rounding) x K and V of each layer
    assert engine == shape.params * 2 + kv + 8 * 103 * 4
    seven = read_shape("builtin:qwen2.5-7b-random")
    long = _cfg("rollout.name=vllm", "rollout.max_num_seqs=256", "data.max_response_length=16384")
    share = next(p for p in phases(long, seven, 1, 80 * GIB) if p.name == "generation").terms["engine (awake)"]
    assert share == long.rollout.vllm.gpu_memory_utilization * 80 * GIB


def test_a_config_head_dim_wider_than_hidden_over_heads():
    """Qwen3-0.6B's config gives ``head_dim`` 128 where hidden / heads is 64: its queries are 2,048 wide and each key
    and value 1,024. Its published non-embedding parameter count is 0.44B (the formula without ``head_dim`` gives
    0.38B)."""
    from hybrid_rl.planner.shape import from_hf_config

    qwen3 = from_hf_config(dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                                num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True))
    assert (qwen3.head_size, qwen3.q_dim, qwen3.kv_dim) == (128, 2048, 1024)
    assert abs(qwen3.layers * qwen3.layer_params / 0.44e9 - 1) < 0.01
    plain = from_hf_config(dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                                num_key_value_heads=8, vocab_size=151936, tie_word_embeddings=True))
    assert (plain.head_size, plain.kv_dim) == (64, 512)


def test_the_critic_gathers_as_its_own_accumulate_unsharded_says():
    """``critic.accumulate_unsharded`` (null: the actor's) decides what the critic's passes hold gathered: the whole
    value model in bf16 and its full fp32 gradients, or two blocks and the root and their gradients."""
    critic_params = PARAMS + H + 1  # the backbone (tied) and a scalar value head
    root = V * H  # the root as the planner counts it: the embedding
    for actor, critic, whole in (("true", "null", True), ("true", "false", False), ("false", "null", False),
                                 ("false", "true", True)):
        cfg = _cfg("algorithm.adv_estimator=gae", f"actor.accumulate_unsharded={actor}",
                   f"critic.accumulate_unsharded={critic}", world=2)
        by_name = {p.name: p.terms for p in phases(cfg, read_shape(cfg.model.path), 2, 80 * GIB)}
        if whole:
            want = {"gathered params (whole model)": 2 * critic_params,
                    "unsharded grads (fp32, whole model)": 4 * critic_params}
        else:
            want = {"gathered params (2 blocks + root)": 2 * (2 * LAYER + root),
                    "unsharded grads (2 blocks + root)": 4 * (2 * LAYER + root)}
        for phase in ("critic values", "critic update"):
            got = {k: v for k, v in by_name[phase].items() if k.startswith(("gathered", "unsharded"))}
            assert got == {k: v for k, v in want.items() if phase == "critic update" or k.startswith("gathered")}, \
                (actor, critic, phase)
        actor_whole = "gathered params (whole model)" in by_name["actor update"]
        assert actor_whole is (actor == "true")


def test_a_critic_peak_is_offered_the_critics_accumulate_unsharded():
    from hybrid_rl.planner.verdict import candidates

    def offered(peak: str, *overrides: str) -> list[dict]:
        cfg = _cfg("algorithm.adv_estimator=gae", *overrides, world=2)
        return [s for group in candidates(cfg, peak) for s in group if "accumulate_unsharded" in next(iter(s))]

    assert offered("critic update", "actor.accumulate_unsharded=true") == [{"critic.accumulate_unsharded": False}]
    assert offered("critic update", "actor.accumulate_unsharded=true", "critic.accumulate_unsharded=false") == []
    assert offered("actor update", "actor.accumulate_unsharded=true") == [{"actor.accumulate_unsharded": False}]


def _full_length_batch(prompts: int, n: int, p: int, r: int):
    """``prompts`` groups of ``n`` rows, every prompt ``p`` real tokens (distinct per group), every response ``r``."""
    import numpy as np
    import torch

    from hybrid_rl.batch import Batch

    g = torch.arange(prompts).repeat_interleave(n)[:, None]
    prompt_ids = 3 + (g * 7 + torch.arange(p)[None, :]) % 97
    responses = 3 + torch.randint(0, 97, (prompts * n, r), generator=torch.Generator().manual_seed(0))
    ids = torch.cat([prompt_ids, responses], 1)
    return Batch(dict(prompts=prompt_ids, responses=responses, input_ids=ids, attention_mask=torch.ones_like(ids),
                      position_ids=torch.arange(p + r).expand(len(ids), -1).contiguous()),
                 dict(uid=np.repeat(np.arange(prompts), n)))


@pytest.mark.parametrize("n", [4, 8])
def test_shared_fixed_micro_batch_is_planned_at_what_the_packer_lays_out(n):
    """The planner's largest fixed-size micro-batch with prompts shared equals the longest row ``pack_shared`` builds
    from ``micro_batches``' chunks of full-length rows; the timer credits that row's tokens to the open phase."""
    from hybrid_rl.micro_batching import micro_batches
    from hybrid_rl.planner.estimate import micro_tokens
    from hybrid_rl.telemetry.tracking import Timer
    from hybrid_rl.workers.packed import pack_shared

    p, r, prompts = 5, 3, 6
    cfg = _cfg("data.max_prompt_length=5", "data.max_response_length=3", f"rollout.n={n}")
    batch = _full_length_batch(prompts, n, p, r)
    for seqs in (1, 2, 3, 4, 5, 6, 8, 12):
        timer = Timer()
        with timer("step"), timer("update"):
            micros = micro_batches(batch, seqs, None, None, packed=True, share_prompts=True)
        longest = max(pack_shared(m.tensors).input_ids.shape[1] for _, m in micros)
        assert micro_tokens(cfg, seqs, None, len(batch), shared=True) == longest, seqs
        assert timer.micro_batch_metrics() == {"perf/phase_micro_batch_tokens/update": float(longest)}
        # unshared: every row whole
        assert micro_tokens(cfg, seqs, None, len(batch)) == seqs * (p + r)
    # shuffled mini-batches scatter a prompt's rows: the update is planned with every row whole, the log-prob pass not
    shuffled = _cfg("data.max_prompt_length=5", "data.max_response_length=3", f"rollout.n={n}",
                    "actor.use_remove_padding=true", "actor.share_prompts=true", "actor.shuffle_mini_batches=true",
                    "actor.ppo_micro_batch_size_per_device=4", "actor.log_prob_micro_batch_size_per_device=4",
                    "actor.use_dynamic_bsz=false", "data.train_batch_size=8", "actor.ppo_mini_batch_size=8")
    by_name = {ph.name: ph for ph in phases(shuffled, read_shape(shuffled.model.path), 1, 80 * GIB)}
    assert "activations (32 tokens, recomputed)" in by_name["actor update"].terms or \
        "activations (32 tokens)" in by_name["actor update"].terms
    assert f"activations, no grad ({p + 4 * r} tokens)" in by_name["old log-prob"].terms  # 4 rows of one prompt


def test_micro_batch_tokens_go_to_the_phases_open_on_this_thread():
    from hybrid_rl.micro_batching import micro_batches
    from hybrid_rl.telemetry.tracking import Timer

    batch = _full_length_batch(2, 4, 5, 3)  # 8 rows of 8 tokens
    micro_batches(batch, 4, None, None, packed=True)  # no phase open: nothing is credited, nothing fails
    timer = Timer()
    with timer("step"):
        with timer("old_log_prob"):
            micro_batches(batch, 2, None, None, packed=True)  # rows whole: 2 x 8
        with timer("update"):
            micro_batches(batch, 4, None, None, packed=False)  # padded: 4 x 8
            micro_batches(batch, 1, None, None, packed=True)
    assert timer.micro_batch_metrics() == {"perf/phase_micro_batch_tokens/old_log_prob": 16.0,
                                           "perf/phase_micro_batch_tokens/update": 32.0}


SEVEN_ON_ONE = ["model.path=builtin:qwen2.5-7b-random", "rollout.forced_lengths=lognormal:8192:0.8",
                "data.max_response_length=16384", "actor.max_token_len_per_device=16896", "data.train_batch_size=4",
                "actor.ppo_mini_batch_size=1", "rollout.vllm.tensor_parallel_size=1"]


def _seven(*overrides: str):
    recipe = str(Path(RECIPE).parent / "gsm8k_grpo_7b.yaml")
    return load_config(recipe, [*SEVEN_ON_ONE, *overrides]).validate(1)


def test_a_combination_is_named_when_no_single_setting_fits():
    """Full fine-tuning of the 7B shape on one H200 (scale_7b's long run): no one setting fits, so the verdict names
    the settings that fit together, and each of them alone, or the engine's share alone, still does not fit."""
    h200 = 139.8 * GIB
    shape = read_shape("builtin:qwen2.5-7b-random")
    _, verdict = judge(_seven(), shape, 1, h200)
    assert not verdict.fits
    assert verdict.fix == "set actor.optimizer_offload=true and set ref.offload=true (together: no single setting fits)"
    assert judge(_seven("actor.optimizer_offload=true", "ref.offload=true"), shape, 1, h200)[1].fits
    for alone in ("actor.optimizer_offload=true", "ref.offload=true", "actor.param_offload=true",
                  "rollout.vllm.gpu_memory_utilization=0.15"):
        assert not judge(_seven(alone), shape, 1, h200)[1].fits, alone


def test_an_engine_share_is_never_offered_below_what_the_engine_runs_in():
    from hybrid_rl.planner.verdict import _engine_share

    shape = read_shape("builtin:qwen2.5-7b-random")
    # bf16 weights of 7.62B parameters (14.2 GiB), one 16,896-token sequence's K and V in 28 layers of 4 x 128 dims
    # (0.9 GiB), 1 GiB beside them: 16.1 GiB, 11.5% of 139.8 GiB, so 15% is the smallest share in steps of 5%
    floor = (2 * 7_615_616_512 + 16896 * 28 * 2 * 512 * 2) / GIB + 1.0
    assert 16.0 < floor < 16.2
    shares = [next(iter(s.values())) for s in _engine_share(_seven(), shape, 139.8 * GIB)]
    assert shares == [k / 20 for k in range(9, 2, -1)]
    assert [next(iter(s.values())) for s in _engine_share(_seven())][-1] == 0.1  # without the shape: no floor


def test_the_update_peak_is_its_optimizer_step_when_the_step_holds_more():
    """The 7B shape fully fine-tuned on one H200 with the offloads that make the passes fit: at the optimizer step the
    GPU holds the fp32 masters (4 bytes a parameter), AdamW's moments (8), the gradients (4) and, with ``foreach``,
    a copy of the second moment (4 more): 20 bytes × 7,615,616,512 = 141.8 GiB, past the card, as the run that
    tried it ran out of memory in ``torch._foreach_sqrt``. ``fused`` has no copy: 16 bytes a parameter at the step,
    and the update's peak is its backward again."""
    h200, P = 139.8 * GIB, 7_615_616_512
    shape = read_shape("builtin:qwen2.5-7b-random")
    offloads = ("actor.optimizer_offload=true", "ref.offload=true")
    by_name, verdict = judge(_seven(*offloads, "actor.optimizer_impl=foreach"), shape, 1, h200)
    update = {p.name: p for p in by_name}["actor update"]
    assert update.total == pytest.approx(20 * P, rel=1e-9)
    assert update.terms["actor AdamW step copy (fp32, sharded)"] == 4 * P
    assert not any(k.startswith("activations") for k in update.terms)
    assert not verdict.fits and verdict.fix == "set actor.optimizer_impl=fused"
    by_name, verdict = judge(_seven(*offloads), shape, 1, h200)
    update = {p.name: p for p in by_name}["actor update"]
    assert verdict.fits and update.total > 16 * P
    assert any(k.startswith("activations") for k in update.terms)
    loop = {p.name: p for p in phases(_seven(*offloads, "actor.optimizer_impl=for_loop"), shape, 1, h200)}
    assert loop["actor update"].total == update.total  # one tensor's copy (the 152,064 x 3,584 embedding) is less


def test_each_optimizer_implementation_adds_its_own_step_copy():
    """At the step: the gradient shards, and beside them nothing (fused), the second moment again (foreach), or the
    largest tensor, the tiny model's tied 103 × 64 embedding (for-loop), 4 bytes an element."""
    from hybrid_rl.planner.estimate import largest_tensor, optimizer_step

    shape = read_shape("builtin:tiny-qwen2")
    assert largest_tensor(shape, lora=False) == V * H
    assert optimizer_step("actor", PARAMS / 2, "fused", V * H / 2) == {"actor grads (fp32, sharded)": 2 * PARAMS}
    assert optimizer_step("actor", PARAMS / 2, "foreach", V * H / 2) == {
        "actor grads (fp32, sharded)": 2 * PARAMS, "actor AdamW step copy (fp32, sharded)": 2 * PARAMS}
    assert optimizer_step("critic", PARAMS, "for_loop", V * H) == {
        "critic grads (fp32, sharded)": 4 * PARAMS, "critic AdamW step copy (one tensor)": 4 * V * H}


def test_a_lora_base_in_the_compute_dtype_is_planned_at_its_bytes_and_offered_first():
    """7B LoRA (rank 64) without recomputation at 16,896-token micro-batches on one H200: the fp32 base (4 bytes a
    parameter) leaves no room for the activations; in bf16 (2 bytes) it fits, and the verdict says so first."""
    h200, P = 139.8 * GIB, 7_615_616_512
    shape = read_shape("builtin:qwen2.5-7b-random")
    lora = ("model.lora.rank=64", "model.enable_gradient_checkpointing=false")
    by_name, verdict = judge(_seven(*lora), shape, 1, h200)
    assert not verdict.fits and verdict.fix == "set model.lora.base_dtype=compute"
    fp32_update = {p.name: p for p in by_name}["actor update"]
    by_name, verdict = judge(_seven(*lora, "model.lora.base_dtype=compute"), shape, 1, h200)
    update = {p.name: p for p in by_name}["actor update"]
    assert verdict.fits
    assert update.terms["actor frozen base (sharded)"] == 2 * P
    # rank × (in + out) per adapted linear, 28 layers: q, o 3584+3584; k, v 3584+512; gate, up, down 3584+18944
    adapters = 64 * 28 * (2 * 7168 + 2 * 4096 + 3 * 22528)
    assert update.terms["actor params (fp32, sharded)"] == 4 * adapters
    assert fp32_update.total - update.total == pytest.approx(4 * P - 2 * P - 4 * adapters)


def test_an_offloaded_optimizer_state_is_counted_in_the_update_only():
    """``actor.optimizer_offload``: AdamW's two fp32 moments (8 bytes a parameter over the ranks) are on the GPU for
    the actor's update alone, so every other phase plans exactly that much less than without the offload, and the
    update the same."""
    kw = ("algorithm.adv_estimator=grpo", "actor.use_kl_loss=true")
    plain = {p.name: p for p in phases(_cfg(*kw, world=2), read_shape("builtin:tiny-qwen2"), 2, 80 * GIB)}
    off = {p.name: p for p in phases(_cfg(*kw, "actor.optimizer_offload=true", world=2),
                                     read_shape("builtin:tiny-qwen2"), 2, 80 * GIB)}
    assert plain.keys() == off.keys() and {"weight push", "generation", "old log-prob", "ref log-prob"} <= off.keys()
    for name in plain:
        less = 0 if name == "actor update" else 8 * PARAMS / 2
        assert plain[name].total - off[name].total == pytest.approx(less), name
    assert off["actor update"].terms["actor AdamW (2 x fp32, sharded)"] == 8 * PARAMS / 2
