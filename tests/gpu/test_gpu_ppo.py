"""PPO with a critic on GPUs with vLLM : a few steps on 1 and 4 ranks, the critic's phases timed, memory reported.

Run on a CUDA machine with vLLM 0.26 (benchmarks/offline/ installs it on a machine without network access):
    pytest -m gpu -s tests/gpu/test_gpu_ppo.py
Each run prints one JSON line per rank count with the mean of the timed phases (``timing/values``,
``timing/update_critic``, ``timing/update``, ``timing/gen``, ``timing/step``) and the peak memory
(``perf/max_memory_allocated_gb`` / ``perf/max_memory_reserved_gb``) over the steps after the first.
Skips cleanly without CUDA, without vLLM, or with fewer GPUs than a case needs.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
if importlib.util.find_spec("vllm") is None:
    pytest.skip("needs vLLM (pip install -e '.[vllm]')", allow_module_level=True)

ROOT = Path(__file__).resolve().parents[2]
ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_USE_FLASHINFER_SAMPLER": "0", "VLLM_NO_USAGE_STATS": "1",
       "HF_HUB_OFFLINE": "1"}
STEPS = 4
# the 0.5B shape (random init, no download) with imposed response lengths, so the critic's phases do real work
MODEL = ["model.path=builtin:qwen2.5-0.5b-random", "model.dtype=bfloat16", "rollout.forced_lengths=lognormal:256:0.6",
         "data.max_response_length=512", "data.train_batch_size=64", "rollout.n=4", "actor.ppo_mini_batch_size=32",
         "actor.ppo_micro_batch_size_per_device=16", "actor.log_prob_micro_batch_size_per_device=32",
         "critic.ppo_mini_batch_size=32", "critic.ppo_micro_batch_size_per_device=16",
         "critic.forward_micro_batch_size_per_device=32", "actor.lr=1e-6", "critic.lr=1e-5"]


@pytest.mark.parametrize(("gpus", "offload"), [(1, False), (1, True), (4, False)],
                         ids=["1gpu_resident", "1gpu_critic_offload", "4gpu_resident"])
def test_ppo_steps_with_vllm(tmp_path, gpus, offload):
    if torch.cuda.device_count() < gpus:
        pytest.skip(f"needs {gpus} GPUs")
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "hybrid_rl", "train", "--nproc", str(gpus), str(ROOT / "recipes/cpu_successor_gae.yaml"),
           "trainer.device=auto", "rollout.name=vllm", f"trainer.total_steps={STEPS}", "trainer.test_freq=0",
           "trainer.val_before_train=false", "trainer.save_freq=-1", "trainer.logger=[jsonl]", f"trainer.output_dir={out}",
           "rollout.vllm.gpu_memory_utilization=0.3", f"critic.param_offload={str(offload).lower()}",
           f"critic.optimizer_offload={str(offload).lower()}", *MODEL]
    proc = subprocess.run(cmd, cwd=ROOT, env={**os.environ, **ENV}, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    for r in rows:
        for key in ("critic/vf_loss", "critic/vf_clipfrac", "critic/grad_norm", "critic/values_mean", "actor/pg_loss"):
            assert math.isfinite(r[key]), (key, r[key])
        assert r["timing/values"] > 0 and r["timing/update_critic"] > 0
        assert r["perf/max_memory_allocated_gb"] > 0
    later = rows[1:]  # step 1 pays the compile/warm-up
    keys = ["timing/gen", "timing/old_log_prob", "timing/values", "timing/adv", "timing/update_critic", "timing/update",
            "timing/step", "perf/max_memory_allocated_gb", "perf/max_memory_reserved_gb", "critic/vf_loss"]
    summary = {k: round(sum(r[k] for r in later) / len(later), 4) for k in keys}
    line = json.dumps({"test": "ppo_critic_vllm", "gpus": gpus, "critic_offload": offload,
                       "device": torch.cuda.get_device_name(0), **summary})
    print(line)
    if os.environ.get("HYBRID_RL_GPU_RESULTS"):  # one JSON line per run, appended to this file
        with open(os.environ["HYBRID_RL_GPU_RESULTS"], "a") as f:
            f.write(line + "\n")
