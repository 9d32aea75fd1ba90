"""The peer benchmark (benchmarks/peers/): the three frameworks' configs express the same workload, each profile's
options reach the config they claim to, the forced response lengths are hybrid_rl's own draw sample by sample, the
report combines one workload at a time, and verl's restart rule only retries the vLLM port collision."""

import asyncio
import json
import sys
import types
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks" / "peers"))

import plot  # noqa: E402
import run_hybrid_rl  # noqa: E402
import run_trl  # noqa: E402
import run_verl  # noqa: E402
import workload  # noqa: E402
from workload import WORKLOADS, resolve_options, workload_spec  # noqa: E402


def as_dict(overrides):
    """``key=value`` overrides → {key: value} (a leading ``+`` dropped); a key given twice is an error here."""
    out = {}
    for o in overrides:
        k, _, v = o.partition("=")
        k = k.lstrip("+")
        assert k not in out, f"{k} given twice"
        out[k] = v
    return out


def configs(name, gpus, profile="tuned", sets=()):
    """The workload and each framework's config for it: hybrid_rl's and verl's overrides, TRL's GRPOConfig kwargs."""
    w = workload_spec(name, gpus)
    h = as_dict(run_hybrid_rl.overrides("/m", Path("/r"), "/p.jsonl", w,
                                        resolve_options(run_hybrid_rl.PROFILES, profile, w, sets), cpu=False))
    v = as_dict(run_verl.overrides("/m", Path("/t.parquet"), gpus, w,
                                   resolve_options(run_verl.PROFILES, profile, w, sets), Path("/a.yaml")))
    t = (run_trl.grpo_kwargs(w, resolve_options(run_trl.PROFILES, profile, w, sets), gpus, cpu=False)
         if "trl" in w["frameworks"] else None)
    return w, h, v, t


@pytest.mark.parametrize("profile", ["tuned", "baseline"])
@pytest.mark.parametrize("gpus", [2, 4])
@pytest.mark.parametrize("name", list(WORKLOADS))
def test_every_framework_runs_the_same_workload(name, gpus, profile):
    w, h, v, t = configs(name, gpus, profile)
    a, r = "actor_rollout_ref.actor", "actor_rollout_ref.rollout"
    p, n, mini = w["prompts_per_step"], w["n"], w["mini_batch_prompts"]
    assert p == WORKLOADS[name]["prompts_per_gpu"] * gpus and mini == p // 2
    # prompts per step, samples per prompt, the mini-batch (2 optimizer steps per step), 1 epoch
    assert int(h["data.train_batch_size"]) == int(v["data.train_batch_size"]) == p
    assert int(h["rollout.n"]) == int(v[f"{r}.n"]) == n
    assert int(h["actor.ppo_mini_batch_size"]) == int(v[f"{a}.ppo_mini_batch_size"]) == mini
    assert h["actor.ppo_epochs"] == v[f"{a}.ppo_epochs"] == "1"
    # the response lengths: hybrid_rl draws them, verl reads each sample's from its agent loop, TRL from the wrapper
    cap = w["response_length"]
    assert h["rollout.forced_lengths"] == w["lengths"]
    assert int(h["data.max_response_length"]) == int(v["data.max_response_length"]) == cap
    assert v[f"{r}.ignore_eos"] == "True"
    forced = workload.forced(w)
    assert forced == (name != "grpo")
    assert (v.get(f"{r}.agent.default_agent_loop") == run_verl.AGENT_LOOP) == forced
    # the same prompt rows, in order
    assert h["data.shuffle"] == "false" and v["data.shuffle"] == "False"
    assert int(h["data.max_prompt_length"]) == int(v["data.max_prompt_length"]) == w["max_prompt_length"]
    # optimizer and loss
    assert float(h["actor.lr"]) == float(v[f"{a}.optim.lr"]) == w["lr"]
    assert float(h["actor.clip_ratio_low"]) == float(v[f"{a}.clip_ratio_low"]) == w["clip_low"]
    assert float(h["actor.clip_ratio_high"]) == float(v[f"{a}.clip_ratio_high"]) == w["clip_high"]
    assert float(h["actor.grad_clip"]) == float(v[f"{a}.optim.clip_grad"]) == w["grad_clip"]
    assert h["actor.loss_agg_mode"] == v[f"{a}.loss_agg_mode"] == "token-mean"
    assert h["actor.use_kl_loss"] == "false" and v[f"{a}.use_kl_loss"] == "False"
    assert h["algorithm.use_kl_in_reward"] == "false" and v["algorithm.use_kl_in_reward"] == "False"
    # the engine
    assert float(h["rollout.vllm.gpu_memory_utilization"]) == float(v[f"{r}.gpu_memory_utilization"])
    assert int(h["rollout.max_num_seqs"]) == int(v[f"{r}.max_num_seqs"]) == w["max_num_seqs"]
    assert int(h["rollout.vllm.max_num_batched_tokens"]) == int(v[f"{r}.max_num_batched_tokens"]) == 8192
    if w["algorithm"] == "gae":
        assert t is None and "trl" not in w["frameworks"]  # GRPOTrainer has no critic
        assert h["algorithm.adv_estimator"] == v["algorithm.adv_estimator"] == "gae"
        assert float(h["algorithm.gamma"]) == float(v["algorithm.gamma"]) == w["gamma"]
        assert float(h["algorithm.lam"]) == float(v["algorithm.lam"]) == w["lam"]
        assert float(h["critic.lr"]) == float(v["critic.optim.lr"]) == w["critic_lr"]
        assert float(h["critic.cliprange_value"]) == float(v["critic.cliprange_value"]) == w["cliprange_value"]
        assert int(h["critic.ppo_mini_batch_size"]) == int(v["critic.ppo_mini_batch_size"]) == mini
        assert v["critic.model.path"] == "/m"
    else:
        assert h["algorithm.adv_estimator"] == v["algorithm.adv_estimator"] == "grpo"
        assert t["generation_batch_size"] == p * n and t["num_generations"] == n
        assert t["per_device_train_batch_size"] * gpus * t["gradient_accumulation_steps"] == mini * n
        assert t["max_steps"] == 2 * w["steps"]
        assert t["max_completion_length"] == cap and t["vllm_max_model_length"] == w["max_prompt_length"] + cap
        assert t["generation_kwargs"]["ignore_eos"] is True
        # fixed lengths: every request min_tokens = the cap; drawn lengths: each request its own (the wrapper)
        assert ("min_tokens" in t["generation_kwargs"]) == (not forced)
        assert t["shuffle_dataset"] is False
        assert t["learning_rate"] == w["lr"] and t["epsilon"] == w["clip_low"] and t["epsilon_high"] == w["clip_high"]
        assert t["max_grad_norm"] == w["grad_clip"] and t["beta"] == 0.0 and t["loss_type"] == "dapo"
        assert t["vllm_gpu_memory_utilization"] == w["gpu_memory_utilization"] and t["vllm_mode"] == "colocate"


def test_tuned_is_the_default_and_each_option_reaches_the_config():
    import argparse

    ap = argparse.ArgumentParser()
    workload.common_args(ap, 1)
    assert ap.parse_args([]).profile == "tuned"
    _, h, v, t = configs("ppo", 4)
    a, m, r = "actor_rollout_ref.actor", "actor_rollout_ref.model", "actor_rollout_ref.rollout"
    # verl: its tuning guide's levers that run without the flash-attn package
    assert v[f"{a}.strategy"] == v["critic.strategy"] == "fsdp2"
    assert v[f"{m}.use_remove_padding"] == v["critic.model.use_remove_padding"] == "True"
    assert v[f"{m}.override_config.attn_implementation"] == "flex_attention"
    assert v[f"{a}.pad_to_length"] == "True" and v[f"{a}.fsdp_config.pad_to_length_bucket"] == "1024"
    assert v[f"{a}.use_dynamic_bsz"] == v[f"{r}.log_prob_use_dynamic_bsz"] == v["critic.use_dynamic_bsz"] == "True"
    assert v[f"{a}.ppo_max_token_len_per_gpu"] == "16384" and v[f"{r}.log_prob_max_token_len_per_gpu"] == "32768"
    assert v["critic.ppo_infer_max_token_len_per_gpu"] == "16384"
    assert f"{a}.ppo_micro_batch_size_per_gpu" not in v
    assert v[f"{m}.use_fused_kernels"] == v[f"{m}.use_liger"] == v["critic.model.use_liger"] == "True"
    assert v[f"{m}.enable_gradient_checkpointing"] == v["critic.model.enable_gradient_checkpointing"] == "False"
    assert v[f"{a}.fsdp_config.reshard_after_forward"] == "False"
    assert v[f"{a}.fsdp_config.use_no_sync_for_gradient_accumulation"] == "True"
    assert v[f"{r}.enable_chunked_prefill"] == "True"
    # hybrid_rl: the flagship's levers for actor and critic
    assert h["actor.use_dynamic_bsz"] == h["critic.use_dynamic_bsz"] == "true"
    assert h["actor.max_token_len_per_device"] == h["critic.max_token_len_per_device"] == "16384"
    assert h["model.enable_gradient_checkpointing"] == h["critic.enable_gradient_checkpointing"] == "false"
    assert h["model.use_liger"] == h["actor.accumulate_unsharded"] == "true"
    assert "critic.use_remove_padding" not in h  # its default (on with CUDA) is the critic's own
    # TRL
    _, _, _, t = configs("grpo", 4)
    assert t["use_liger_kernel"] is True and t["gradient_checkpointing"] is False
    assert t["per_device_train_batch_size"] == 16
    assert configs("grpo_long", 4)[3]["per_device_train_batch_size"] == 2
    opts = resolve_options(run_trl.PROFILES, "tuned", workload_spec("grpo", 4))
    assert "fsdp_reshard_after_forward: false" in run_trl.accelerate_config(opts, 4)
    assert "distributed_type: MULTI_GPU" in run_trl.accelerate_config({**opts, "strategy": "ddp"}, 4)


def test_baseline_is_the_first_comparison():
    """The baseline profile reproduces the settings of the first comparison (verl padded with SDPA, no verl kernels)."""
    _, h, v, t = configs("grpo", 2, "baseline")
    a, m, r = "actor_rollout_ref.actor", "actor_rollout_ref.model", "actor_rollout_ref.rollout"
    assert v[f"{m}.use_remove_padding"] == "False" and v[f"{m}.override_config.attn_implementation"] == "sdpa"
    assert v[f"{a}.use_dynamic_bsz"] == "False" and v[f"{a}.ppo_micro_batch_size_per_gpu"] == "8"
    assert v[f"{r}.log_prob_micro_batch_size_per_gpu"] == "16" and v[f"{a}.strategy"] == "fsdp"
    assert v[f"{m}.use_fused_kernels"] == v[f"{m}.use_liger"] == "False"
    assert v[f"{m}.enable_gradient_checkpointing"] == "True" and f"{a}.pad_to_length" not in v
    assert h["model.enable_gradient_checkpointing"] == "true" and h["model.use_liger"] == "false"
    assert h["actor.use_dynamic_bsz"] == "true"  # the flagship recipe's budget ran in the first comparison too
    assert t["per_device_train_batch_size"] == 8 and t["gradient_checkpointing"] is True
    assert t["use_liger_kernel"] is False
    # the PPO recipe's settings before it took the flagship's levers
    _, h, v, _ = configs("ppo", 4, "baseline")
    assert h["actor.use_dynamic_bsz"] == h["critic.use_dynamic_bsz"] == "false"
    assert h["actor.ppo_micro_batch_size_per_device"] == h["critic.ppo_micro_batch_size_per_device"] == "8"
    assert v["critic.ppo_micro_batch_size_per_gpu"] == "8"
    assert v["critic.ppo_infer_max_token_len_per_gpu"] == "32768"  # verl's own default for its V1 critic


def test_set_changes_one_option_and_the_record_says_which_were_on():
    w = workload_spec("grpo", 4)
    opts = resolve_options(run_verl.PROFILES, "tuned", w, ["remove_padding=off", "attn_implementation=sdpa",
                                                           "max_token_len_per_gpu=8192"])
    assert opts["remove_padding"] is False and opts["attn_implementation"] == "sdpa"
    assert opts["max_token_len_per_gpu"] == 8192 and opts["dynamic_bsz"] is True
    v = as_dict(run_verl.overrides("/m", Path("/t"), 4, w, opts))
    assert v["actor_rollout_ref.model.use_remove_padding"] == "False"
    assert "actor_rollout_ref.actor.pad_to_length" not in v
    assert v["actor_rollout_ref.actor.ppo_max_token_len_per_gpu"] == "8192"
    rec = workload.settings_record("tuned", opts)
    assert "remove_padding" in rec["off"] and "dynamic_bsz" in rec["on"] and "liger" in rec["on"]
    # a critic's options are recorded only where the workload has a critic
    for profiles in (run_verl.PROFILES, run_hybrid_rl.PROFILES):
        assert not any(k.startswith("critic") for k in resolve_options(profiles, "tuned", w))
        assert any(k.startswith("critic") for k in resolve_options(profiles, "tuned", workload_spec("ppo", 4)))
    assert rec["options"]["attn_implementation"] == "sdpa"
    with pytest.raises(SystemExit, match="remove_paddding=on"):
        resolve_options(run_verl.PROFILES, "tuned", w, ["remove_paddding=on"])
    with pytest.raises(SystemExit, match="unknown profile"):
        resolve_options(run_verl.PROFILES, "fast", w)


@pytest.mark.parametrize("name", list(WORKLOADS))
@pytest.mark.parametrize("profile", ["tuned", "baseline"])
@pytest.mark.parametrize("gpus", [2, 4])
def test_hybrid_rl_overrides_validate(name, profile, gpus):
    from hybrid_rl.config import load_config

    w = workload_spec(name, gpus)
    opts = resolve_options(run_hybrid_rl.PROFILES, profile, w)
    cfg = load_config(run_hybrid_rl.recipe(w), run_hybrid_rl.overrides("builtin:qwen2.5-1.5b-random", Path("/r"),
                                                                       "/p.jsonl", w, opts, cpu=False))
    cfg.validate(world_size=gpus)
    assert cfg.rollout.forced_lengths == w["lengths"] and cfg.data.train_batch_size == w["prompts_per_step"]
    assert cfg.need_critic == (name == "ppo") and cfg.model.use_liger == (profile == "tuned")


def test_workload_selection():
    assert workload_spec(None, 4)["name"] == "grpo"
    assert workload_spec("grpo_long", 2)["prompts_per_step"] == 16
    two = workload_spec("grpo", 2)
    assert (two["prompts_per_step"], two["mini_batch_prompts"]) == (32, 16)
    assert workload_spec("grpo", 4, prompts="48")["mini_batch_prompts"] == 24
    for bad in ("x", "7", "0", "6"):  # 6 prompts do not split over 4 GPUs
        with pytest.raises(SystemExit, match="PEERS_PROMPTS"):
            workload_spec("grpo", 4, prompts=bad)
    with pytest.raises(SystemExit, match="unknown workload"):
        workload_spec("dpo", 4)


def test_lognormal_lengths_have_the_workload_shape():
    w = workload_spec("grpo_long", 4)
    lengths = np.array(workload.length_table(w, 4, 40)).ravel()
    assert lengths.min() >= 1 and lengths.max() == w["response_length"] == 6144
    assert 1850 < lengths.mean() < 2050 and 1350 < np.median(lengths) < 1650  # mean ~2k, long-tailed
    assert 0.02 < (lengths == 6144).mean() < 0.06
    fixed = workload.length_table(workload_spec("grpo", 2), 2, 3)
    assert [len(s) for s in fixed] == [32 * 8] * 3 and {x for s in fixed for x in s} == {256}


def test_forced_lengths_are_hybrid_rls_draw(tiny_model_path):
    """Rank r's lengths of step s are what hybrid_rl's worker draws on rank r at step s, so verl's rows and TRL's
    requests get, sample by sample, the lengths hybrid_rl generates for the same prompts."""
    from types import SimpleNamespace

    from hybrid_rl.data.sampler import PromptSampler
    from hybrid_rl.workers.actor_rollout_ref import ActorRolloutRefWorker

    from helpers import cpu_dist, make_cfg

    gpus, steps = 4, 3
    w = workload_spec("grpo_long", gpus)
    per_rank = w["prompts_per_step"] // gpus * w["n"]
    keys = [f"rollout.forced_lengths={w['lengths']}", f"data.max_response_length={w['response_length']}",
            f"trainer.seed={w['seed']}"]
    # rank 0: the worker itself (its generator seeded as it seeds it), one draw per step
    worker = ActorRolloutRefWorker(make_cfg(*keys), cpu_dist())
    ours = workload.rank_lengths(w["lengths"], w["response_length"], w["seed"], 0, per_rank, steps)
    assert [list(worker.forced_lengths(per_rank)) for _ in range(steps)] == ours
    # every rank: the worker's draw with the generator seeded as the worker seeds rank r
    cfg = make_cfg(*keys)
    table = workload.length_table(w, gpus, steps)
    rows = workload.row_lengths(w, gpus, steps * w["prompts_per_step"])
    for rank in range(gpus):
        fake = SimpleNamespace(cfg=cfg, _length_rng=np.random.default_rng(w["seed"] + 104729 * (rank + 1)))
        sampler = PromptSampler(len(rows), w["prompts_per_step"], rank, gpus, seed=0, shuffle=False)
        for s in range(steps):
            drawn = list(ActorRolloutRefWorker.forced_lengths(fake, per_rank))
            assert table[s][rank * per_rank:(rank + 1) * per_rank] == drawn
            # the rows hybrid_rl's sampler gives this rank at step s carry these lengths, prompt by prompt
            assert [x for i in sampler.next_indices() for x in rows[i]] == drawn


def test_prepare_prompts_keeps_order_and_repeats(tmp_path):
    src = tmp_path / "gsm8k.jsonl"
    src.write_text("".join(json.dumps({"question": "q" * k, "answer": f"... #### {k}"}) + "\n" for k in range(1, 11)))
    w = workload_spec("grpo", 1, prompts="4")  # (12 + 2) steps x 4 prompts = 56 rows
    out = workload.prepare_prompts(src, tmp_path / "p.jsonl", {**w, "max_prompt_length": 6},
                                   count_tokens=lambda msgs: len(msgs[0]["content"].split("\n")[0]))
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == workload.rows_needed(w) == 56
    assert [len(r["question"]) for r in rows[:8]] == [1, 2, 3, 4, 5, 6, 1, 2]  # over 6 tokens dropped, order kept
    assert workload.gsm8k_rows(out)[5]["ground_truth"] == "6"


def test_verl_agent_loop_gives_each_sample_its_length(monkeypatch):
    """The agent loop verl loads from the registry file sets max_tokens from the row's lengths and the sample index."""
    seen = []

    class SingleTurnAgentLoop:  # verl's, as far as this loop relies on it
        async def run(self, sampling_params, **kwargs):
            seen.append(sampling_params)
            return "output"

    mod = types.ModuleType("verl.experimental.agent_loop.single_turn_agent_loop")
    mod.SingleTurnAgentLoop = SingleTurnAgentLoop
    for name in ("verl", "verl.experimental", "verl.experimental.agent_loop"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, mod.__name__, mod)
    monkeypatch.delitem(sys.modules, "verl_agent_loop", raising=False)
    import verl_agent_loop

    loop = verl_agent_loop.ForcedLengthAgentLoop()
    base = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "logprobs": True}
    for j in range(3):
        assert asyncio.run(loop.run(dict(base), raw_prompt=[], session_id=j,
                                    extra_info={"index": 7, "forced_lengths": [5, 900, 12]})) == "output"
    asyncio.run(loop.run(dict(base), raw_prompt=[], session_id=0, extra_info={"index": 7}))
    assert [s.get("max_tokens") for s in seen] == [5, 900, 12, None]
    assert all({k: s[k] for k in base} == base for s in seen)
    # the registry file verl reads names this class in the module run_verl copies into the run's site folder
    site = run_verl.port_site(Path(__import__("tempfile").mkdtemp()))
    assert (site / "peers_verl_agent_loop.py").read_text() == (ROOT / "benchmarks/peers/verl_agent_loop.py").read_text()
    reg = run_verl.agent_loop_config(site).read_text()
    assert f"name: {run_verl.AGENT_LOOP}" in reg and "_target_: peers_verl_agent_loop.ForcedLengthAgentLoop" in reg


def test_trl_length_wrapper_gives_each_request_its_length():
    class Params:  # vLLM's SamplingParams, as far as the wrapper relies on it
        def __init__(self, **kw):
            self.__dict__.update(kw)

        def clone(self):
            return Params(**self.__dict__)

    calls = []
    generate = lambda prompts, sampling_params, **kw: calls.append((prompts, sampling_params, kw)) or "done"
    table = [[3, 4, 5], [6, 7, 8]]
    wrapped = run_trl.forced_length_generate(generate, lambda k: table[k])
    shared = Params(max_tokens=9, min_tokens=0, ignore_eos=True)
    assert wrapped(["a", "b", "c"], sampling_params=shared, use_tqdm=False) == "done"
    assert wrapped(["a", "b", "c"], sampling_params=shared) == "done"
    assert [[p.max_tokens for p in c[1]] for c in calls] == table
    assert all(p.min_tokens == p.max_tokens and p.ignore_eos for c in calls for p in c[1])
    assert shared.max_tokens == 9 and calls[0][2] == {"use_tqdm": False}
    with pytest.raises(RuntimeError, match="forced lengths"):
        run_trl.forced_length_generate(generate, lambda k: [1, 2])(["a", "b", "c"], sampling_params=shared)


def test_report_combines_one_workload(tmp_path):
    w = workload_spec("ppo", 2)

    def res(name, step_s, median, profile="tuned", **kw):
        return {"framework": name, "step_s": step_s, "step_s_median": median, "workload": w, "device": "H200x2",
                "machine": "a", "profile": profile, **kw}

    (tmp_path / "hybrid_rl_ppo.json").write_text(json.dumps(res("hybrid_rl", 2.0, 2.0, trained_tokens_per_s=300.0)))
    took = {"mismatches": ["attn_implementation"]}
    (tmp_path / "verl_ppo.json").write_text(json.dumps(res("verl", 5.0, 4.0, trained_tokens_per_s=100.0,
                                                           took_effect=took)))
    (tmp_path / "trl_ppo.json").write_text(json.dumps(workload.skipped("trl", w, "no critic")))
    (tmp_path / "verl_grpo.json").write_text(json.dumps(res("verl", 9.0, 9.0)))  # another workload: not read
    doc = plot.combine(tmp_path, "ppo")
    assert doc["ratios"]["hybrid_rl_vs_verl_step_time"] == 2.5
    assert doc["ratios"]["hybrid_rl_vs_verl_step_time_median"] == 2.0
    assert doc["ratios"]["hybrid_rl_vs_verl_trained_tokens_per_s"] == 3.0
    assert doc["skipped"] == {"trl": "no critic"} and [r["framework"] for r in doc["frameworks"]] == ["hybrid_rl", "verl"]
    assert plot.stem(doc) == "peers_H200x2_ppo" and doc["target_met"] == {"verl": True}  # medians 4.0 / 2.0
    assert doc["took_effect_mismatches"] == {"verl": ["attn_implementation"]}
    (tmp_path / "verl_ppo.json").write_text(json.dumps(res("verl", 2.5, 2.5)))
    assert plot.combine(tmp_path, "ppo")["target_met"] == {"verl": False}  # 1.25x by the median: short of 1.3
    (tmp_path / "verl_ppo.json").write_text(json.dumps(res("verl", 5.0, 4.0, profile="baseline")))
    assert plot.stem(plot.combine(tmp_path, "ppo")) == "peers_H200x2_ppo_mixed"
    (tmp_path / "verl_ppo.json").write_text(json.dumps({**res("verl", 5.0, 4.0), "workload": workload_spec("ppo", 4)}))
    with pytest.raises(SystemExit, match="different workloads"):
        plot.combine(tmp_path, "ppo")


def test_report_pairs_each_peer_with_hybrid_rl_on_its_own_machine(tmp_path):
    w = workload_spec("grpo", 1)

    def res(name, median, machine):
        return {"framework": name, "step_s": median, "step_s_median": median, "workload": w, "device": "H200x1",
                "machine": machine, "profile": "tuned"}

    (tmp_path / "hybrid_rl_grpo.json").write_text(json.dumps(res("hybrid_rl", 3.0, "a")))
    (tmp_path / "trl_grpo.json").write_text(json.dumps(res("trl", 6.0, "a")))
    (tmp_path / "verl_grpo.json").write_text(json.dumps(res("verl", 9.0, "b")))
    doc = plot.combine(tmp_path, "grpo")  # verl's machine has no hybrid_rl run: compared across machines
    assert doc["ratios"]["hybrid_rl_vs_verl_step_time_median"] == 3.0 and not doc["same_machine"]
    assert doc["pairs"]["verl"] == {"hybrid_rl_machine": "a", "peer_machine": "b", "same_machine": False,
                                    "hybrid_rl_step_s_median": 3.0}
    (tmp_path / "hybrid_rl_grpo@b.json").write_text(json.dumps(res("hybrid_rl", 4.5, "b")))
    (tmp_path / "hybrid_rl_grpo_long@b.json").write_text(json.dumps(res("hybrid_rl", 1.0, "b")))  # not this workload
    doc = plot.combine(tmp_path, "grpo")
    assert doc["ratios"]["hybrid_rl_vs_verl_step_time_median"] == 2.0  # 9.0 / 4.5, both on b
    assert doc["ratios"]["hybrid_rl_vs_trl_step_time_median"] == 2.0  # 6.0 / 3.0, both on a
    assert doc["same_machine"] and doc["machine_note"] is None
    assert [(r["framework"], r["machine"]) for r in doc["frameworks"]] == [
        ("hybrid_rl", "a"), ("verl", "b"), ("trl", "a"), ("hybrid_rl", "b")]
    plot.plot(doc, tmp_path / "p.png")
    assert (tmp_path / "p.png").stat().st_size > 0


def test_report_shows_a_variant_beside_the_plain_run_with_its_own_ratios(tmp_path):
    w = workload_spec("grpo_long", 1)

    def res(name, mean, median, machine="a"):
        return {"framework": name, "step_s": mean, "step_s_median": median, "workload": w, "device": "H200x1",
                "machine": machine, "profile": "tuned"}

    (tmp_path / "hybrid_rl_grpo_long.json").write_text(json.dumps(res("hybrid_rl", 24.0, 24.0)))
    (tmp_path / "verl_grpo_long.json").write_text(json.dumps(res("verl", 25.0, 25.0)))
    (tmp_path / "trl_grpo_long.json").write_text(json.dumps(res("trl", 50.0, 48.0, machine="b")))
    (tmp_path / "hybrid_rl+overlap_grpo_long.json").write_text(json.dumps(res("hybrid_rl+overlap", 20.0, 16.0)))
    (tmp_path / "hybrid_rl+gc_grpo.json").write_text(json.dumps(res("hybrid_rl+gc", 1.0, 1.0)))  # another workload
    doc = plot.combine(tmp_path, "grpo_long")
    assert [r["framework"] for r in doc["frameworks"]] == ["hybrid_rl", "verl", "trl", "hybrid_rl+overlap"]
    # against verl on its machine (25 / 16 by the median, 25 / 20 by the mean); TRL ran on another machine: none
    assert doc["variant_ratios"] == {"hybrid_rl+overlap_vs_verl_step_time_median": 25.0 / 16.0,
                                     "hybrid_rl+overlap_vs_verl_step_time": 25.0 / 20.0,
                                     "hybrid_rl+overlap_vs_hybrid_rl_step_time_median": 24.0 / 16.0}
    assert doc["target_met"] == {"verl": False, "trl": True}  # the plain run's: 25 / 24 and 48 / 24
    assert doc["machines"]["hybrid_rl+overlap"] == "a"
    plot.plot(doc, tmp_path / "p.png")
    assert (tmp_path / "p.png").stat().st_size > 0


def test_report_pairs_a_peer_run_on_two_machines_and_needs_the_target_on_both(tmp_path):
    w = workload_spec("grpo_long", 1)

    def res(name, mean, median, machine):
        return {"framework": name, "step_s": mean, "step_s_median": median, "workload": w, "device": "H200x1",
                "machine": machine, "profile": "tuned"}

    (tmp_path / "hybrid_rl_grpo_long.json").write_text(json.dumps(res("hybrid_rl", 24.0, 24.0, "a")))
    (tmp_path / "verl_grpo_long.json").write_text(json.dumps(res("verl", 25.0, 25.0, "a")))
    (tmp_path / "trl_grpo_long.json").write_text(json.dumps(res("trl", 50.0, 48.0, "a")))
    (tmp_path / "hybrid_rl_grpo_long@b.json").write_text(json.dumps(res("hybrid_rl", 23.0, 22.0, "b")))
    (tmp_path / "verl_grpo_long@b.json").write_text(json.dumps(res("verl", 33.0, 33.0, "b")))
    (tmp_path / "hybrid_rl+engine_process_grpo_long.json").write_text(
        json.dumps(res("hybrid_rl+engine_process", 26.0, 27.5, "b")))
    doc = plot.combine(tmp_path, "grpo_long")
    # ratios stay the main files' (25 / 24); every pair is listed, each with hybrid_rl on its own machine
    assert doc["ratios"]["hybrid_rl_vs_verl_step_time_median"] == 25.0 / 24.0
    assert [(pm["peer"], pm["peer_machine"], pm["hybrid_rl_machine"], pm["ratio_median"], pm["ratio_mean"])
            for pm in doc["per_machine"]] == [("verl", "a", "a", 25.0 / 24.0, 25.0 / 24.0),
                                              ("trl", "a", "a", 2.0, 50.0 / 24.0),
                                              ("verl", "b", "b", 1.5, 33.0 / 23.0)]
    assert doc["target_met"] == {"verl": False, "trl": True}  # 1.5x on b, 1.04x on a: not on every machine
    assert doc["same_machine"] and doc["machines"]["verl@b"] == "b"
    # the variant ran on b: against verl there (33 / 27.5) and the plain run there (22 / 27.5, below 1: slower)
    assert doc["variant_ratios"] == {"hybrid_rl+engine_process_vs_verl_step_time_median": 33.0 / 27.5,
                                     "hybrid_rl+engine_process_vs_verl_step_time": 33.0 / 26.0,
                                     "hybrid_rl+engine_process_vs_hybrid_rl_step_time_median": 22.0 / 27.5}
    assert [(r["framework"], r["machine"]) for r in doc["frameworks"]] == [
        ("hybrid_rl", "a"), ("verl", "a"), ("trl", "a"), ("hybrid_rl", "b"), ("verl", "b"),
        ("hybrid_rl+engine_process", "b")]
    (tmp_path / "verl_grpo_long.json").write_text(json.dumps(res("verl", 32.0, 32.0, "a")))
    assert plot.combine(tmp_path, "grpo_long")["target_met"] == {"verl": True, "trl": True}  # 1.33x and 1.5x
    plot.plot(doc, tmp_path / "p.png")
    assert (tmp_path / "p.png").stat().st_size > 0


def test_gc_pauses_are_averaged_over_the_measured_steps(tmp_path):
    import run_hybrid_rl

    rows = [{"step": 1, "timing/step": 9.0, "perf/gc_pause_s": 5.0, "perf/gc_pause_s/gen": 5.0},
            {"step": 2, "timing/step": 3.0, "perf/gc_pause_s": 0.5, "perf/gc_pause_s/gen": 0.25,
             "perf/gc_pause_s/update": 0.25, "timing/gc": 0.1},
            {"step": 2, "val/reward_mean": 0.5},  # a validation row: not a step
            {"step": 3, "timing/step": 3.0, "perf/gc_pause_s": 0.25, "perf/gc_pause_s/gen": 0.25, "timing/gc": 0.3}]
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    # the warm-up step (1) left out; a phase absent in a step counts 0 there
    assert run_hybrid_rl.measured_gc(path, 1) == {"gc_pause_s": {"step": 0.375, "gen": 0.25, "update": 0.125,
                                                                 "between_steps": 0.2}}
    path.write_text(json.dumps({"step": 1, "timing/step": 1.0}) + "\n")
    assert run_hybrid_rl.measured_gc(path, 0) == {}  # a run that logs no pauses records none


def test_summary_drops_the_warmup_and_reports_means_and_medians():
    rows = [{"step_s": s, "phases": {"gen": s / 2}} for s in (30.0, 9.0, 2.0, 3.0, 10.0)]
    doc = workload.summarize("x", "1", rows, 2, 2, startup_s=None, wall_s=None,
                             settings={"profile": "tuned"}, notes=[])
    assert doc["steps_measured"] == 3 and doc["warmup_dropped"] == 2 and doc["profile"] == "tuned"
    assert doc["step_s"] == 5.0 and doc["step_s_median"] == 3.0
    assert doc["phases_s"] == {"gen": 2.5} and doc["phases_s_median"] == {"gen": 1.5}


def test_trl_grpo_config_accepts_every_kwarg():
    """Where trl is installed (TRL 1.16 pinned): GRPOConfig takes every kwarg the harness passes."""
    trl = pytest.importorskip("trl")
    import inspect
    import warnings

    fields = set(inspect.signature(trl.GRPOConfig).parameters)
    for name in ("grpo", "grpo_long"):
        for profile in ("tuned", "baseline"):
            w = workload_spec(name, 1)
            kw = run_trl.grpo_kwargs(w, resolve_options(run_trl.PROFILES, profile, w), 1, cpu=False)
            assert set(kw) <= fields, set(kw) - fields
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                cfg = trl.GRPOConfig(output_dir="/tmp/peers_trl_cfg", **{**kw, "bf16": False, "use_cpu": True})
            assert cfg.generation_batch_size == kw["generation_batch_size"]
            assert cfg.use_liger_kernel == kw["use_liger_kernel"]


def test_verl_config_composes_and_validates():
    """Where verl 0.9.1 and Hydra are installed: every workload x profile composes and passes verl's validation."""
    pytest.importorskip("hydra")
    pytest.importorskip("verl.trainer.main_ppo")
    from hybrid_rl.models import resolve_model_path

    model = resolve_model_path("builtin:tiny-qwen2")  # the critic's config reads a model directory
    for name in WORKLOADS:
        for profile in ("tuned", "baseline"):
            w = workload_spec(name, 4)
            ov = run_verl.overrides(model, Path("/t.parquet"), 4, w, resolve_options(run_verl.PROFILES, profile, w),
                                    Path("/a.yaml"))
            got = run_verl.check_config(ov)
            assert got["use_critic"] == (name == "ppo")
            assert got["actor_rollout_ref.model.use_liger"] == (profile == "tuned")
            if name == "ppo":
                assert got["critic.model.use_liger"] == (profile == "tuned")


# -- verl's restart rule -------------------------------------------------------------------------------------------------
def test_port_race_is_recognised(tmp_path):
    log = tmp_path / "verl_stdout.log"
    log.write_text("(Worker pid=1) ERROR ... DistNetworkError: ... code: -98, name: EADDRINUSE, message: address already"
                   " in use\nRuntimeError: Engine core initialization failed. See root cause above.\n")
    assert run_verl.port_race(log)


def test_other_failures_are_not_retried(tmp_path):
    log = tmp_path / "verl_stdout.log"
    log.write_text("RuntimeError: Engine core initialization failed. See root cause above.\nCUDA out of memory\n")
    assert not run_verl.port_race(log)
    assert not run_verl.port_race(tmp_path / "missing.log")


CHILD = ("import os, subprocess, sys; print(os.getpid(), os.environ['VLLM_PORT']); sys.stdout.flush(); "
         "subprocess.run([sys.executable, '-c', 'import os; print(os.getpid(), os.environ[\\'VLLM_PORT\\'])'])")


def _vllm_port(site, env_port=None):
    """(pid, VLLM_PORT) of a process started with the port site, then of a child it starts."""
    import os
    import subprocess

    env = {k: v for k, v in os.environ.items() if k not in ("VLLM_PORT", "HYBRID_RL_PEERS_VLLM_PORT")}
    env["PYTHONPATH"] = str(site)
    if env_port:
        env["VLLM_PORT"] = env_port
    out = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True,
                         check=True).stdout.split()
    return (int(out[0]), int(out[1])), (int(out[2]), int(out[3]))


def test_port_site_gives_each_process_its_own_vllm_port(tmp_path):
    site = run_verl.port_site(tmp_path)
    # a child gets its own base, not its parent's (an inherited base made every vLLM engine core collide)
    (pid_a, a), (pid_b, b) = _vllm_port(site)
    assert a == 20000 + (pid_a % 2000) * 16 and b == 20000 + (pid_b % 2000) * 16
    assert 20000 <= min(a, b) and max(a, b) < 20000 + 2000 * 16 < 65536
    if pid_a % 2000 != pid_b % 2000:
        assert abs(a - b) >= 16
    assert [p for _, p in _vllm_port(site, "31000")] == [31000, 31000]  # the user's own VLLM_PORT is kept


# -- staging, the runner script, the report's inputs and outputs ----------------------------------------------------------

PEERS = ROOT / "benchmarks" / "peers"


def test_staged_folders_hold_at_most_52_mib(tmp_path):
    """stage.sh cuts the big wheels at 52 MiB (PEERS_FOLDER_MIB) and packs every file into folders of at most that
    (pack.py)."""
    import pack

    stage = (PEERS / "stage.sh").read_text()
    assert "MIB=${PEERS_FOLDER_MIB:-52}" in stage and 'split -b "${MIB}m"' in stage
    assert "PIECE=$((MIB * 1024 * 1024))" in stage
    assert '-le "$PIECE"' in stage and "pack.py" in stage
    src, out = tmp_path / "src", tmp_path / "out"
    src.mkdir()
    sizes = {"a.part00": 55, "a.part01": 20, "b.whl": 30, "c.whl": 25, "d.whl": 5, "e.whl": 1}
    for name, size in sizes.items():
        (src / name).write_bytes(b"x" * size)
    dirs = pack.pack(src, out, 55, "verl_c")
    held = {d.name: {f.name: f.stat().st_size for f in d.iterdir()} for d in dirs}
    assert all(sum(v.values()) <= 55 for v in held.values())
    assert sorted(n for v in held.values() for n in v) == sorted(sizes) and len(dirs) == 3
    (src / "big.whl").write_bytes(b"x" * 56)
    with pytest.raises(SystemExit, match="over 55"):
        pack.pack(src, tmp_path / "out2", 55, "verl_c")


def test_staging_is_git_ignored_and_pins_datasets():
    assert "/.stage_peers/" in (ROOT / ".gitignore").read_text().splitlines()
    for pins in ("trl.sha256", "verl.sha256"):
        names = [line.split()[1] for line in (PEERS / pins).read_text().splitlines()]
        assert {"datasets-5.2.0-py3-none-any.whl", "dill-0.4.1-py3-none-any.whl",
                "multiprocess-0.70.19-py312-none-any.whl"} <= set(names), pins


def test_runner_installs_vllm_with_the_offline_installer():
    """vLLM 0.26 comes from benchmarks/offline/install.sh (the .stage/pN pieces), verl reuses its unpacked wheels, and
    nothing names a path outside the checkout but /tmp."""
    run_all, install = (PEERS / "run_all.sh").read_text(), (PEERS / "install_remote.sh").read_text()
    assert 'benchmarks/offline/install.sh" "$VS" /tmp/site' in run_all
    assert "--with-datasets" not in run_all and "/tmp/vs/install_remote.sh" not in run_all
    assert '"$VS"/wheels/*.whl' in install and "datasets/*.whl" not in install
    for f in PEERS.iterdir():
        if f.is_file():
            assert "/work/" not in f.read_text(errors="replace"), f


def test_foreground_parts_fit_one_command():
    """A foreground grpo part (the run's limit, plus install and report) fits a 600 s command."""
    run_all = (PEERS / "run_all.sh").read_text()
    assert "grpo) LIMIT=${PEERS_TIMEOUT:-420}" in run_all


def test_report_goes_to_the_run_directory(tmp_path):
    """run_all.sh writes the combined report to $OUT; plot.py refuses benchmarks/results/ (publish.py's)."""
    import subprocess

    run_all = (PEERS / "run_all.sh").read_text()
    assert '--out-dir "$OUT"' in run_all and "--out-dir \"$ROOT/benchmarks/results\"" not in run_all
    w = workload_spec("grpo", 2)
    res = tmp_path / "res"
    res.mkdir()
    (res / "hybrid_rl_grpo.json").write_text(json.dumps({"framework": "hybrid_rl", "step_s": 1.0, "step_s_median": 1.0,
                                                         "workload": w, "device": "H200x2", "profile": "tuned"}))
    out = tmp_path / "out"
    r = subprocess.run([sys.executable, str(PEERS / "plot.py"), "--res", str(res), "--workload", "grpo",
                        "--out-dir", str(out)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert (out / "peers_H200x2_grpo.json").exists()
    r = subprocess.run([sys.executable, str(PEERS / "plot.py"), "--res", str(res), "--workload", "grpo",
                        "--out-dir", str(ROOT / "benchmarks" / "results")], capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "publish.py" in r.stderr


def test_report_refuses_results_of_different_prompt_files(tmp_path):
    import subprocess

    w = workload_spec("grpo", 2)

    def res(name, sha):
        return {"framework": name, "step_s": 1.0, "step_s_median": 1.0, "workload": w, "device": "H200x2",
                "profile": "tuned", "settings": {"profile": "tuned", "prompts_sha256": sha}}

    (tmp_path / "hybrid_rl_grpo.json").write_text(json.dumps(res("hybrid_rl", "a" * 64)))
    (tmp_path / "trl_grpo.json").write_text(json.dumps(res("trl", "a" * 64)))
    assert plot.combine(tmp_path, "grpo")["prompts_sha256"] == "a" * 64
    (tmp_path / "verl_grpo.json").write_text(json.dumps(res("verl", "b" * 64)))
    r = subprocess.run([sys.executable, str(PEERS / "plot.py"), "--res", str(tmp_path), "--workload", "grpo",
                        "--out-dir", str(tmp_path / "out")], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "prompts_sha256" in r.stderr


def test_verl_asked_for_flash_attention_without_flash_attn_is_recorded_as_not_run(tmp_path, monkeypatch):
    """A verl run that asks for flash_attention_2 where flash_attn does not import is recorded as not run, in one
    line that names the fix."""
    monkeypatch.setattr(run_verl, "flash_attn_importable", lambda env: False)
    monkeypatch.setattr(run_verl, "prepare_model", lambda *a: pytest.fail("the model is not needed"))
    monkeypatch.delenv("OUT", raising=False)
    monkeypatch.setattr(sys, "argv", ["run_verl.py", "--workload", "ppo", "--gpus", "2", "--out", str(tmp_path),
                                      "--set", "attn_implementation=flash_attention_2"])
    run_verl.main()
    doc = json.loads((tmp_path / "verl_ppo.json").read_text())
    assert "flash_attention_2" in doc["skipped"] and "\n" not in doc["skipped"] and "--set" in doc["skipped"]
    assert doc["settings"]["flash_attn_importable"] is False
    assert plot.combine(tmp_path, "ppo")["skipped"]["verl"] == doc["skipped"]


def test_verl_ppo_without_flash_attn_runs_its_critic_with_the_actors_attention(tmp_path, monkeypatch):
    """Without flash_attn, verl's ppo run goes on: its processes get the actor's attention implementation for the
    critic (the environment variable its site hook reads), and the result records it."""
    seen = {}

    class Stop(Exception):
        pass

    def watched(cmd, out, env, *a, **k):
        seen["env"] = env
        raise Stop

    monkeypatch.setattr(run_verl, "flash_attn_importable", lambda env: False)
    monkeypatch.setattr(run_verl, "prepare_model", lambda *a: tmp_path)
    monkeypatch.setattr(run_verl, "prepare_prompts", lambda *a: tmp_path / "p.jsonl")
    monkeypatch.setattr(run_verl, "chat_token_counter", lambda *a: None)
    monkeypatch.setattr(run_verl, "write_parquet", lambda *a: None)
    monkeypatch.setattr(run_verl, "run_watched", watched)
    monkeypatch.delenv("OUT", raising=False)
    for profile, attn in (("tuned", "flex_attention"), ("baseline", "sdpa")):
        monkeypatch.setattr(sys, "argv", ["run_verl.py", "--workload", "ppo", "--gpus", "1", "--out", str(tmp_path),
                                          "--profile", profile])
        with pytest.raises(Stop):
            run_verl.main()
        assert seen.pop("env")[run_verl.verl_critic_attn.ENV] == attn
    assert not (tmp_path / "verl_ppo.json").exists()
    site = tmp_path / "verl_port_site"
    assert (site / "peers_verl_critic_attn.py").read_text() == (PEERS / "verl_critic_attn.py").read_text()
    assert run_verl.verl_critic_attn.ENV in (site / "sitecustomize.py").read_text()


def test_verl_critic_loader_takes_the_asked_attention(tmp_path):
    """verl_critic_attn.wrap: a loader written like verl 0.9.1's (flash_attention_2 in the call) fails without
    flash_attn; wrapped, it loads with the implementation asked for, and the auto class is as it was afterwards."""
    import torch
    import transformers
    import verl_critic_attn

    cfg = transformers.Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)
    transformers.Qwen2ForCausalLM(cfg).save_pretrained(tmp_path)
    cls = transformers.AutoModelForTokenClassification
    before = cls.__dict__.get("from_pretrained")

    def load_valuehead_model(local_path, torch_dtype, model_config, trust_remote_code):
        return transformers.AutoModelForTokenClassification.from_pretrained(
            pretrained_model_name_or_path=local_path, torch_dtype=torch_dtype, config=model_config,
            attn_implementation="flash_attention_2", trust_remote_code=trust_remote_code)

    cfg.num_labels = 1
    with pytest.raises(Exception, match="(?i)flash"):
        load_valuehead_model(str(tmp_path), torch.float32, cfg, False)
    model = verl_critic_attn.wrap(load_valuehead_model, "sdpa")(str(tmp_path), torch.float32, cfg, False)
    assert type(model).__name__ == "Qwen2ForTokenClassification" and model.config._attn_implementation == "sdpa"
    assert model.score.out_features == 1
    assert cls.__dict__.get("from_pretrained") is before


def test_verl_critic_site_hook_wraps_verls_loader_on_import(tmp_path):
    """The run's sitecustomize wraps verl.utils.model.load_valuehead_model when the module is imported, in any
    process started with the environment variable, and leaves it alone without it (a stand-in verl package)."""
    import subprocess

    site = run_verl.port_site(tmp_path)
    pkg = tmp_path / "fake" / "verl" / "utils"
    pkg.mkdir(parents=True)
    (pkg.parent / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "model.py").write_text("def load_valuehead_model(*a, **k):\n    return 'loaded'\n")
    code = ("from verl.utils.model import load_valuehead_model as f; "
            "print(getattr(f, '__peers_critic_attn__', None), f())")
    base = {k: v for k, v in __import__("os").environ.items() if not k.startswith("HYBRID_RL_PEERS")}
    base["PYTHONPATH"] = f"{site}:{tmp_path / 'fake'}"
    outs = []
    for extra in ({run_verl.verl_critic_attn.ENV: "flex_attention"}, {}):
        r = subprocess.run([sys.executable, "-c", code], env={**base, **extra}, capture_output=True, text=True,
                           timeout=120, cwd=tmp_path)
        assert r.returncode == 0, r.stderr[-2000:]
        outs.append(r.stdout.split())
    assert outs == [["flex_attention", "loaded"], ["None", "loaded"]]


def _run_all(tmp_path, *args, timeout=60):
    import os
    import subprocess

    env = {k: v for k, v in os.environ.items() if not k.startswith("PEERS_")}
    env.update(OUT=str(tmp_path / "out"), PEERS_RES=str(tmp_path / "res"), PEERS_VS=str(tmp_path / "no_vs"))
    return subprocess.run(["bash", str(PEERS / "run_all.sh"), *args], capture_output=True, text=True, env=env,
                          timeout=timeout, cwd=ROOT)


@pytest.mark.parametrize("items, key", [
    ([], "name the runs"), (["hybrid_rl:grpo", "slime:grpo"], "'slime:grpo'"), (["verl:dpo"], "'verl:dpo'"),
    (["trl:ppo"], "no critic"), (["hybrid_rl+nope:grpo"], "unknown hybrid_rl variant in 'hybrid_rl+nope:grpo'"),
])
def test_run_all_queue_refuses_bad_items_in_one_line(tmp_path, items, key):
    """`run_all.sh queue` checks every FW:WORKLOAD before it starts anything: exit 2, one line naming the item."""
    r = _run_all(tmp_path, "queue", "1", *items)
    assert r.returncode == 2, (r.stdout, r.stderr)
    last = [l for l in r.stdout.splitlines() if l.startswith("queue:")]
    assert len(last) == 1 and key in last[0], r.stdout
    assert not (tmp_path / "res" / "queue.pid").exists()


def test_run_all_queue_runs_its_items_in_order_detached(tmp_path):
    """The queue returns at once and runs its items one after the other in the background: here, with no vLLM
    staged, each part stops at its install (exit 3), and the queue goes on to the next and says when it is done."""
    import time

    r = _run_all(tmp_path, "queue", "1", "hybrid_rl:ppo", "hybrid_rl+overlap:grpo", "trl:grpo_long")
    assert r.returncode == 0 and "queued hybrid_rl:ppo hybrid_rl+overlap:grpo trl:grpo_long" in r.stdout, (
        r.stdout, r.stderr)
    log = tmp_path / "res" / "queue.log"
    deadline = time.monotonic() + 180
    while "queue done" not in (log.read_text() if log.exists() else "") and time.monotonic() < deadline:
        time.sleep(0.5)
    lines = [l.split()[:4] for l in log.read_text().splitlines()]
    items = ["hybrid_rl:ppo", "hybrid_rl+overlap:grpo", "trl:grpo_long"]
    assert lines == [row for i, item in enumerate(items)
                     for row in (["start", item] + lines[2 * i][2:3], ["end", item, "exit", "3"])] + [
                         ["queue", "done"] + lines[6][2:3]], lines
    w = _run_all(tmp_path, "wait", "1")
    assert "queue:" in w.stdout and "queue done" in w.stdout and "still running" not in w.stdout


@pytest.mark.slow
@pytest.mark.parametrize("name", list(WORKLOADS))
def test_hybrid_rl_cpu_smoke(name, tmp_path, monkeypatch):
    """run_hybrid_rl.py --cpu-smoke trains 3 steps of every workload on CPU (prompts within the tiny model's 512
    positions), records the prompt file's hash and what took effect in the rank: on CPU the training passes run
    transformers' SDPA on padded rows (packing is for CUDA and 16-bit models), and no Liger (CUDA only)."""
    import subprocess

    monkeypatch.delenv("OUT", raising=False)
    env = {k: v for k, v in __import__("os").environ.items() if k != "OUT"}
    env["HYBRID_RL_PEERS_PROBE_AT"] = "0,0.3"  # a smoke step takes well under a second: look at once
    r = subprocess.run([sys.executable, str(PEERS / "run_hybrid_rl.py"), "--cpu-smoke", "--workload", name,
                        "--out", str(tmp_path)], capture_output=True, text=True, timeout=600, env=env)
    doc = json.loads((tmp_path / f"hybrid_rl_{name}.json").read_text())
    assert "step_s" in doc, (r.stdout[-2000:], doc.get("log_tail", "")[-3000:])
    assert doc["settings"]["prompts_sha256"] == workload.file_sha256(tmp_path / f"prompts_{name}.jsonl")
    took = doc["took_effect"]
    assert took["processes"] == 1 and took["attention_in_training"] == ["sdpa"], took
    assert took["packed_rows_in_training"] is False and took["liger_modules"] == 0


@pytest.mark.slow
def test_an_overlap_variant_runs_one_step_more_and_times_the_loop_cadence(tmp_path):
    """``--variant overlap``: written as hybrid_rl+overlap; the run goes one step past the workload's (its last step
    has nothing to generate beside it) and that step is left out; each step's time is its ``timing/iteration``."""
    import subprocess

    env = {k: v for k, v in __import__("os").environ.items() if k != "OUT"}
    env["HYBRID_RL_PEERS_PROBE_AT"] = "0,0.3"
    r = subprocess.run([sys.executable, str(PEERS / "run_hybrid_rl.py"), "--cpu-smoke", "--workload", "grpo",
                        "--variant", "overlap", "--out", str(tmp_path)], capture_output=True, text=True, timeout=600,
                       env=env)
    doc = json.loads((tmp_path / "hybrid_rl+overlap_grpo.json").read_text())
    assert "step_s" in doc, (r.stdout[-2000:], doc.get("log_tail", "")[-3000:])
    rows = [json.loads(line) for line in (tmp_path / "run_hybrid_rl+overlap_grpo" / "metrics.jsonl").read_text()
            .splitlines()]
    rows = [r for r in rows if "timing/step" in r]
    assert len(rows) == 4 and doc["framework"] == "hybrid_rl+overlap" and doc["steps_logged"] == 3
    assert doc["step_s_all"] == [round(r["timing/iteration"], 3) for r in rows[:3]]
    assert "trainer.mode=overlap" in doc["settings"]["overrides"] and doc["settings"]["variant"] == "overlap"
    assert any(n.startswith("variant overlap:") for n in doc["notes"])


@pytest.mark.parametrize("script, env, args, key", [
    ("benchmarks/peers/stage.sh", {"PEERS_FOLDER_MIB": "52m"}, [], "PEERS_FOLDER_MIB"),
    ("benchmarks/offline/stage.sh", {}, ["5x"], "SIZE '5x'"),
])
def test_staging_refuses_a_bad_size_in_one_line_before_downloading(tmp_path, script, env, args, key):
    import os
    import subprocess

    out = subprocess.run(["bash", str(ROOT / script), *args], env={**os.environ, **env}, capture_output=True,
                         text=True, timeout=60, cwd=tmp_path)
    assert out.returncode == 2 and out.stdout == ""
    assert len(out.stderr.strip().splitlines()) == 1 and key in out.stderr


def test_add_memory_records_the_phase_peaks_of_a_finished_run(tmp_path):
    """``run_hybrid_rl.py --add-memory`` runs nothing: it adds to the result in --out the per-phase peaks of the
    measured steps (after the result's warm-up) of its run's metrics.jsonl, the engine's pool off the training
    phases; without the files it is one line and exit 2, the result untouched."""
    import subprocess

    run = tmp_path / "run_hybrid_rl_ppo"
    run.mkdir()
    rows = [{"timing/step": 9.0, "perf/engine_pool_gb": 4.0, "perf/phase_memory_allocated_gb/update": 99.0},  # warm-up
            {"event": "not a step", "perf/phase_memory_allocated_gb/update": 500.0},
            {"timing/step": 1.0, "perf/engine_pool_gb": 4.0, "perf/phase_memory_allocated_gb/update": 30.0,
             "perf/phase_memory_allocated_gb/gen": 20.0, "perf/phase_micro_batch_tokens/update": 700},
            {"timing/step": 1.0, "perf/engine_pool_gb": 4.0, "perf/phase_memory_allocated_gb/update": 34.0,
             "perf/phase_micro_batch_tokens/update": 900}]
    (run / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    env = {k: v for k, v in __import__("os").environ.items() if k != "OUT"}
    cmd = [sys.executable, str(PEERS / "run_hybrid_rl.py"), "--workload", "ppo", "--out", str(tmp_path), "--add-memory"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "hybrid_rl_ppo.json" in r.stderr
    (tmp_path / "hybrid_rl_ppo.json").write_text(json.dumps({"framework": "hybrid_rl", "warmup_dropped": 1,
                                                              "step_s": 1.0}))
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0, r.stderr
    doc = json.loads((tmp_path / "hybrid_rl_ppo.json").read_text())
    assert doc["step_s"] == 1.0
    assert doc["memory"] == {"update": {"measured_gib": 34.0 - 4.0, "micro_batch_tokens": 900},
                             "gen": {"measured_gib": 20.0, "micro_batch_tokens": None}}
    assert doc["engine_pool"] == {"measured_gib": 4.0} and "metrics.jsonl" in doc["memory_added"]
