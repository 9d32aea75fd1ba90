"""The hybrid engine on 2 ranks: FSDP2 vs one process, the weight push, LoRA, the reference policy, offload.

One ``torchrun --nproc_per_node=2`` launch of ``tests/engine/multirank/checks.py`` (2
gloo ranks on CPU, tiny model) measures everything and one plain process
measures the single-process reference; the tests below assert on what they
recorded, so each invariant fails under its own name. The driver itself runs
end to end in one process and under torchrun on 2 ranks, and the weight-sync
benchmark runs its CPU smoke test. ``pytest -m gpu`` repeats the invariants on
2 GPUs (NCCL, bf16 engine, real CPU offload).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers import run_checked

ROOT = Path(__file__).resolve().parents[2]
CHECKS = ROOT / "tests" / "engine" / "multirank" / "checks.py"
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]

pytestmark = pytest.mark.slow


def _load(path: Path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=False)


@pytest.fixture(scope="module")
def runs(tiny_model_path, tmp_path_factory):
    """{'single': ..., 'ranks': [rank0, rank1]}: one 2-rank launch and one single-process reference."""
    out = tmp_path_factory.mktemp("multirank")
    run_checked([sys.executable, str(CHECKS), str(out), "--single"])
    run_checked(TORCHRUN + [str(CHECKS), str(out)])
    return {"single": _load(out / "single.pt"), "ranks": [_load(out / f"rank{r}.pt") for r in range(2)]}


# --------------------------------------------------------------------------- FSDP2 vs one process
def test_fsdp_log_probs_equal_single_process(runs):
    single, rank0 = runs["single"], runs["ranks"][0]
    assert (rank0["log_probs"] - single["log_probs"]).abs().max().item() < 1e-5
    assert (rank0["ref_log_probs"] - single["ref_log_probs"]).abs().max().item() < 1e-5


def test_two_rank_update_equals_single_process_update(runs):
    """Each rank trains on its half of the global batch; one mini-batch step lands where one process lands."""
    single, rank0 = runs["single"], runs["ranks"][0]
    assert rank0["grad_norm"] == pytest.approx(single["grad_norm"], rel=1e-5)
    for name, want in single["exp_avg"].items():  # Adam's first moment after one step = (1-β1)·gradient
        got = rank0["exp_avg"][name]
        assert ((got - want).norm() / want.norm()).item() < 1e-5, name
    lr = 1e-3
    for name, want in single["params_after"].items():
        got = rank0["params_after"][name]
        # micro-batches group rows by length per rank, so the sums run in another order than in one process:
        # rounding only (zero-initialised biases make this relative to a single Adam step)
        assert ((got - want).norm() / want.norm()).item() < 5e-5, name
        # element by element where the gradient is well above Adam's eps (1e-8): there the first step is ±lr whatever
        # the rounding. Where |g| is near eps the step g/(|g| + eps)·lr turns the gradient's rounding into a
        # visible share of lr (1.2e-3 of a step seen on one CPU), so those elements count only in the norm above.
        firm = single["exp_avg"][name].abs() > 0.1 * 1e-6  # (1-β1)·|g| > (1-β1)·100·eps
        assert (got - want)[firm].abs().max().item() < 1e-3 * lr, name  # a thousandth of one Adam step


def test_accumulate_unsharded_gathers_once_per_pass_and_matches(runs):
    """actor.accumulate_unsharded: one all-gather per block per pass and one reduce-scatter per mini-batch,
    the same log-probs and (up to summation order) the same update, and nothing left gathered afterwards."""
    for res in runs["ranks"]:
        base, once = res["unsharded"][False], res["unsharded"][True]
        groups = 3  # 2 decoder blocks + the root
        assert once["log_prob_counts"] == {"all_gather": groups, "reduce_scatter": 0}
        assert base["log_prob_counts"]["all_gather"] > groups  # one per block per micro-batch without it
        assert once["update_counts"] == {"all_gather": groups, "reduce_scatter": groups}
        assert base["update_counts"]["reduce_scatter"] > groups and base["update_counts"]["all_gather"] > 2 * groups
        assert torch.equal(once["log_probs"], base["log_probs"])
        # the reference's pass likewise: its blocks gathered once, the same log-probs
        assert once["ref_counts"] == {"all_gather": groups, "reduce_scatter": 0}
        assert base["ref_counts"]["all_gather"] > groups
        assert torch.equal(once["ref_log_probs"], base["ref_log_probs"])
        for name, want in base["params"].items():  # 1% of one Adam step (lr 1e-3): near-zero gradients flip sign
            assert (once["params"][name] - want).abs().max().item() < 1e-5, name
        assert once["unsharded_after"] == [] and base["unsharded_after"] == []
        assert once["ref_unsharded_after"] == []  # (without it FSDP2 leaves the reference's root gathered, as before)


def test_critic_accumulate_unsharded_gathers_once_per_pass_and_matches(tiny_model_path, tmp_path):
    """critic.accumulate_unsharded: the value pass gathers each FSDP unit once and the update's mini-batch gathers and
    reduce-scatters each once (2 micro-batches each here), with the same values and the same update up to summation
    order; nothing is left gathered afterwards."""
    run_checked(TORCHRUN + [str(CHECKS), str(tmp_path)], timeout=600, MULTIRANK_CHECKS="critic_unsharded")
    for r in range(2):
        res = _load(tmp_path / f"rank{r}.pt")["critic_unsharded"]
        base, once = res[False], res[True]
        units = 3  # the tiny model's 2 decoder blocks + the root
        assert once["values_counts"] == {"all_gather": units, "reduce_scatter": 0}
        assert base["values_counts"]["all_gather"] > units  # each block once per micro-batch without it
        assert once["update_counts"] == {"all_gather": units, "reduce_scatter": units}
        assert base["update_counts"]["reduce_scatter"] == 2 * units  # once per micro-batch without it
        assert base["update_counts"]["all_gather"] > 2 * units
        assert base["values"].abs().max() > 0  # the first update moved the value head off zero
        # rounding only: the first update's gradients were summed before or after the reduce-scatter
        assert (once["values"] - base["values"]).abs().max().item() < 1e-6
        assert once["grad_norm"] == pytest.approx(base["grad_norm"], rel=1e-6)
        for name, want in base["params"].items():  # 1% of one Adam step (lr 1e-3): near-zero gradients flip sign
            assert (once["params"][name] - want).abs().max().item() < 1e-5, name
        assert once["unsharded_after"] == [] and base["unsharded_after"] == []


def _same_step(ref: dict, other: dict) -> None:
    """Two ways to one step: the same log-probs, gradient norm and updated weights, up to rounding."""
    assert (ref["log_probs"] - other["log_probs"]).abs().max().item() < 1e-5
    assert other["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-4)
    for name, want in ref["params"].items():  # 1% of one Adam step (lr 1e-3): near-zero gradients flip sign
        assert (other["params"][name] - want).abs().max().item() < 1e-5, name


def test_packed_passes_match_padded_on_two_ranks(runs):
    """FSDP2 on 2 ranks: padding-free packing with the fused LM head gives the padded pass's log-probs and update."""
    for rank in runs["ranks"]:
        _same_step(rank["packed"][False], rank["packed"][True])


def test_shared_prompts_match_unshared_on_two_ranks(runs):
    """FSDP2 on 2 ranks: each prompt once per packed row gives the unshared packed pass's log-probs and update."""
    for rank in runs["ranks"]:
        _same_step(rank["shared"][False], rank["shared"][True])
        ran, of = rank["shared"][True]["token_share"]
        assert 0 < ran / of < 1 and rank["shared"][False]["token_share"] is None


def test_update_with_own_old_log_probs_matches_pass_then_update_on_two_ranks(runs):
    """actor.old_log_prob=auto's skip under FSDP2: π_old from the update's own forward is the pass's, and the step is
    the same up to rounding (the pass and the update cut different micro-batches)."""
    for rank in runs["ranks"]:
        _same_step(rank["own_old"][False], rank["own_old"][True])
        assert rank["own_old_two_mini"][True]["mini_batches"] == 2  # the pass runs on the second mini-batch only
        _same_step(rank["own_old_two_mini"][False], rank["own_old_two_mini"][True])


def test_torch_compiled_blocks_match_eager(tiny_model_path, tmp_path):
    """actor.use_torch_compile under FSDP2 on 2 ranks: every decoder block compiled, the same log-probs before and
    after one update, and the same parameters after it up to rounding (compiled kernels sum in another order, and
    Adam turns the tiny gradients of zero-initialised biases into full steps). The parameter bound is relative to the
    update itself: a bound relative to the weights (5e-5 before) measured rounding against the random init's norm and
    failed at 5.3e-5 with torch 2.13, while the compiled update differs from the eager one by < 1% of its size."""
    run_checked(TORCHRUN + [str(CHECKS), str(tmp_path)], timeout=600, MULTIRANK_CHECKS="compile")
    for r in range(2):
        res = _load(tmp_path / f"rank{r}.pt")["compile"]
        eager, compiled = res[False], res[True]
        assert eager["compiled"] == [] and len(compiled["compiled"]) == 2  # the tiny model's 2 decoder blocks
        assert (compiled["log_probs"] - eager["log_probs"]).abs().max().item() < 1e-5
        assert (compiled["log_probs_after"] - eager["log_probs_after"]).abs().max().item() < 1e-5
        assert (compiled["log_probs_after"] - compiled["log_probs"]).abs().max().item() > 1e-4  # the update moved it
        assert all(torch.equal(compiled["params_before"][n], p) for n, p in eager["params_before"].items())  # same start
        for name, want in eager["params"].items():  # rounding only: fused kernels change the summation order
            got, step = compiled["params"][name], want - eager["params_before"][name]
            assert step.norm().item() > 0, name  # every parameter moved
            assert ((got - want).norm() / step.norm()).item() < 1e-2, name
            assert (got - want).abs().max().item() < 1e-2 * 1e-3, name  # a hundredth of one Adam step (lr 1e-3)


# --------------------------------------------------------------------------- the push
def test_engine_weights_equal_gathered_actor_bit_for_bit(runs):
    for res in runs["ranks"]:
        assert res["engine_mismatches"] == []
        assert res["tied_ok"]
        assert res["generated"][0] == 2  # one prompt × n=2 generated inside rollout_mode


def test_push_skips_tied_duplicates_and_counts_bytes(runs):
    for res in runs["ranks"]:
        names = [n for n, _ in res["pushed"]]
        assert "lm_head.weight" not in names and names.count("model.embed_tokens.weight") == 1
        assert len(names) == len(set(names)) == res["push_tensors"] == 26
        assert {dt for _, dt in res["pushed"]} == {torch.float32}
        assert res["push_bytes"] == res["expected_bytes"] == 80896 * 4
        assert res["repeat_push_bytes"] == 0  # same version: skipped


def test_push_handles_uneven_and_empty_shards(runs):
    rows = [res["uneven_local_rows"] for res in runs["ranks"]]
    assert rows[1]["one_row.weight"] == 0 and rows[1]["odd.weight"] == 2  # torch.chunk: rank 1 holds nothing / less
    for res in runs["ranks"]:
        assert res["uneven_mismatches"] == []


def test_reference_policy_never_changes(runs):
    for res in runs["ranks"]:
        assert torch.equal(res["ref_log_probs"], res["ref_log_probs_after_update"])
        assert torch.equal(res["offload_ref_log_probs"], res["ref_log_probs"])  # parked on CPU between uses
        assert torch.equal(res["lora_ref_before"], res["lora_ref_after"])
        # LoRA's reference is the base: equal to the actor before training (B = 0), not after
        assert torch.equal(res["lora_ref_before"], res["lora_actor_before"])
        assert (res["lora_ref_after"] - res["lora_actor_after"]).abs().max() > 1e-3


# --------------------------------------------------------------------------- LoRA
def test_lora_trains_only_adapters(runs):
    for res in runs["ranks"]:
        assert res["lora_trainable"] and all(".lora_A." in n or ".lora_B." in n for n in res["lora_trainable"])
        assert len(res["lora_trainable"]) == 8 == res["lora_optimizer_params"]  # 2 layers × {q, v} × {A, B}
        assert res["lora_base_changed"] == []
        assert sorted(res["lora_adapters_changed"]) == sorted(res["lora_adapters"])


def test_lora_engine_sees_merged_weights_and_static_weights_go_once(runs):
    for res in runs["ranks"]:
        assert res["lora_engine_mismatches"] == []  # engine == W + scale·B@A (targeted), == W elsewhere
        assert res["lora_bf16_mismatches"] == []  # the same merge into a bf16 engine
        assert len(res["lora_merged_names"]) == 4
        bytes1, tensors1, _ = res["lora_push1"]
        assert (bytes1, tensors1) == (res["lora_full_bytes"], 26)
        bytes2, tensors2, log2 = res["lora_push2"]
        assert sorted(n for n, _ in log2) == sorted(res["lora_merged_names"])
        assert bytes2 == 2 * (64 * 64 + 32 * 64) * 4 and tensors2 == 4
        # sleep level 2 discarded the engine's weights: everything is pushed again
        assert res["lora_push_after_discard"] == res["lora_full_bytes"]
        assert res["lora_after_discard_mismatches"] == []


# --------------------------------------------------------------------------- offload
def test_offload_round_trip_keeps_state(runs):
    for res in runs["ranks"]:
        assert res["offloaded_inside"] and res["params_back_optimizer_away_after"]
        assert res["offload_grads_after_update"] == []  # the round trip below is of parameters without gradients
        assert res["offload_param_mismatches"] == [] and res["offload_optim_mismatches"] == []
        # the bytes really left the device (every storage freed) and a host buffer holds at least as many
        assert res["offload_device_bytes_inside"] == 0 < res["offload_device_bytes_before"] <= res["offload_host_bytes"]
        # after the round trip the next update is exactly the one without offload
        for name, want in res["twin_params"].items():
            assert torch.equal(res["offload_params"][name], want), name


# --------------------------------------------------------------------------- the driver and the benchmark
# the CPU recipe, pinned to the tiny model and small batches so the byte counts below hold whatever the recipe tunes
TRAIN = ["-m", "hybrid_rl", "train", "recipes/cpu_successor.yaml", "trainer.total_steps=2", "trainer.logger=[jsonl]",
         "trainer.val_before_train=false", "trainer.test_freq=0", "model.path=builtin:tiny-qwen2", "model.lora.rank=0",
         "data.train_batch_size=8", "actor.ppo_mini_batch_size=4", "rollout.n=4", "actor.ppo_micro_batch_size_per_device=8",
         "trainer.mode=sync"]


def _metrics(out_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def test_trainer_single_process(tiny_model_path, tmp_path):
    run_checked([sys.executable] + TRAIN + [f"trainer.output_dir={tmp_path}"])
    rows = _metrics(tmp_path)
    assert [r["step"] for r in rows] == [1, 2] and rows[-1]["rollout/weight_sync_bytes"] == 80896 * 4


def test_trainer_two_ranks_lora_kl_offload(tiny_model_path, tmp_path):
    run_checked(TORCHRUN + TRAIN + [f"trainer.output_dir={tmp_path}", "model.lora.rank=4", "actor.use_kl_loss=true",
                                    "actor.param_offload=true", "actor.optimizer_offload=true"])
    rows = _metrics(tmp_path)
    assert [r["step"] for r in rows] == [1, 2]
    # step 1 pushes everything, step 2 only the merged LoRA targets (all 7 linears of 2 layers)
    assert rows[0]["rollout/weight_sync_bytes"] == 80896 * 4
    linear = 64 * 64 + 32 * 64 * 2 + 64 * 64 + 3 * 128 * 64
    assert rows[1]["rollout/weight_sync_bytes"] == 2 * linear * 4
    assert "actor/kl_loss" in rows[-1]


def test_weight_sync_benchmark_cpu_smoke(tmp_path):
    proc = run_checked(TORCHRUN + ["benchmarks/weight_sync.py", "--model", "tiny", "--switches", "3",
                                   "--out-dir", str(tmp_path)])
    record = json.loads([line for line in proc.stdout.splitlines() if line.startswith("{")][-1])
    assert record["world_size"] == 2 and record["device"] == "cpux2" and record["verified"] is True
    assert record["bytes"] == 80896 * 4 and record["sync_s"] > 0 and record["bound_s"] > 0
    assert {"memory_before", "memory_after", "model"} <= set(record)
    assert json.loads((tmp_path / "weight_sync_cpux2_tiny.json").read_text())["sync_s"] == record["sync_s"]


def test_two_rank_mixed_precision_lora_reference_first(tiny_model_path, tmp_path):
    """bf16 compute under FSDP2's mixed-precision policy, on gloo. The LoRA check computes the reference
    (adapters disabled) before any actor forward: peft's disable_adapter freezes the adapters, and if FSDP2 lazily
    initialised then, it skipped the fp32 gradient reduction and the first backward failed (found on 2xH200)."""
    run_checked(TORCHRUN + [str(CHECKS), str(tmp_path)], MULTIRANK_DTYPE="bfloat16", MULTIRANK_CHECKS="full,lora")
    for r in range(2):
        res = _load(tmp_path / f"rank{r}.pt")
        _assert_bf16_push_reference_and_lora(res)
        assert sorted(res["lora_adapters_changed"]) == sorted(res["lora_adapters"])


def _assert_bf16_push_reference_and_lora(res: dict) -> None:
    """A bf16 engine got the gathered actor bit for bit, the reference never moved, LoRA pushed merged weights."""
    assert res["engine_mismatches"] == [] and res["tied_ok"]
    assert {dt for _, dt in res["pushed"]} == {torch.bfloat16} and res["push_bytes"] == 80896 * 2
    assert torch.equal(res["ref_log_probs"], res["ref_log_probs_after_update"])
    assert res["lora_engine_mismatches"] == [] and res["lora_base_changed"] == []
    assert res["lora_push2"][0] == 2 * (64 * 64 + 32 * 64) * 2


# --------------------------------------------------------------------------- GPU (pytest -m gpu)
@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_gpu_two_rank_push_lora_offload(tiny_model_path, tmp_path):
    """NCCL, bf16 engine, mixed precision FSDP2, offload to real host memory."""
    run_checked(TORCHRUN + [str(CHECKS), str(tmp_path)], MULTIRANK_DEVICE="cuda")
    for r in range(2):
        res = _load(tmp_path / f"rank{r}.pt")
        _assert_bf16_push_reference_and_lora(res)
        assert res["offload_grads_after_update"] == []
        assert res["offload_param_mismatches"] == [] and res["offload_optim_mismatches"] == []
        assert res["offload_device_bytes_inside"] == 0 and res["offload_mem_inside"] < res["offload_mem_before"]


def test_update_step_benchmark_cpu_smoke(tmp_path):
    configs = ["default", "accumulate_unsharded", "accumulate_unsharded+dynamic_bsz"]  # compile: its own test
    proc = run_checked(TORCHRUN + ["benchmarks/update_step.py", "--cpu-smoke", "--configs", ",".join(configs),
                                   "--out", str(tmp_path)])
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert [r["config"] for r in rows] == configs
    doc = json.loads((tmp_path / "update_step_cpux2_tiny-qwen2.json").read_text())
    assert doc["world_size"] == 2 and doc["configs"][0]["speedup_vs_first"] == 1.0
    assert all(r["log_prob_s"] > 0 and r["update_s"] > 0 and r["tokens"] > 0 for r in doc["configs"])
    # --best-of hands the fastest configuration's overrides to a follow-up modes run (modes.py --tag _tuned)
    best = max(doc["configs"], key=lambda r: r["trained_tokens_per_s"])["overrides"]
    out = subprocess.run([sys.executable, "benchmarks/update_step.py", "--best-of",
                          str(tmp_path / "update_step_cpux2_tiny-qwen2.json")], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.split() == best
