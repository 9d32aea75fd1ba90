"""Split placement's process groups on real NCCL (no vLLM needed): every layout of 4 GPUs starts and trains.

    pytest -m gpu tests/gpu/test_split_groups_gpu.py        # 4 GPUs; skips with fewer

On 4xH200 every 2 + 2 and 1 + 3 split run hung before its first step (until 4c7d438): with a device
bound to the world group, torch makes every ``new_group`` an ``ncclCommSplit`` of the world's communicator, and a
rank outside the new group makes a no-colour split even when the new group is gloo. The weight-metadata group
(gloo, the rollout ranks and the first trainer rank) thus left the other trainer ranks in a split no one else made.
``split.make_layout`` now creates that group from its members only and connects each NCCL group at creation.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available() or torch.cuda.device_count() < 4:
    pytest.skip("needs 4 CUDA GPUs", allow_module_level=True)

ROOT = Path(__file__).resolve().parents[2]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=4"]


@pytest.mark.parametrize("rollout_ranks", [1, 2, 3])
def test_split_groups_form_and_carry_traffic(rollout_ranks):
    proc = subprocess.run(TORCHRUN + [str(ROOT / "tests/gpu/split_groups_probe.py"), f"--rollout-ranks={rollout_ranks}"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("probe ok") == 4, proc.stdout


@pytest.mark.parametrize("rollout_ranks", [1, 2])
def test_split_trains_on_four_gpus_with_the_hf_engine(tmp_path, rollout_ranks):
    """The trainer itself, split R + (4 - R) with the transformers engine (the groups are the same as with vLLM)."""
    out = tmp_path / "run"
    cmd = TORCHRUN + ["-m", "hybrid_rl", "train", str(ROOT / "recipes/cpu_successor.yaml"), "trainer.device=cuda",
                      "trainer.placement=split", f"trainer.rollout_ranks={rollout_ranks}", "trainer.mode=overlap",
                      "trainer.total_steps=3", "trainer.save_freq=-1", "trainer.logger=[jsonl]",
                      "data.train_batch_size=12", "actor.ppo_mini_batch_size=12", "actor.ppo_micro_batch_size_per_device=16",
                      "trainer.stall_dump_s=60",
                      f"trainer.output_dir={out}"]
    proc = subprocess.run(cmd, cwd=ROOT, env={**os.environ, "HF_HUB_OFFLINE": "1"}, capture_output=True, text=True,
                          timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    steps = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if '"reward/mean"' in x]
    assert [r["step"] for r in steps] == [1, 2, 3]
