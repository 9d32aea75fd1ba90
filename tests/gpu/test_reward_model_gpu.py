"""The reward model on a GPU: bf16 scores near the CPU's fp32 ones, and between calls its weights off the device
(``reward.model.offload``: page-locked host memory), back on it only while it scores."""

from __future__ import annotations

import pytest
import torch

from hybrid_rl.config import RewardModelConfig
from hybrid_rl.rewards.model import RewardModel

pytestmark = pytest.mark.gpu

RM = "builtin:tiny-qwen2-rm"
MESSAGES = [[{"role": "user", "content": str(d)}] for d in range(6)]
RESPONSES = ["1", "22", "three", "4", "five five", "6"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_scores_match_the_cpu_and_the_weights_leave_the_device():
    cpu, _ = RewardModel(RewardModelConfig(path=RM), torch.device("cpu")).score(MESSAGES, RESPONSES)
    device = torch.device("cuda", torch.cuda.current_device())
    model = RewardModel(RewardModelConfig(path=RM, micro_batch_size=4), device)
    assert model.dtype == torch.bfloat16 and model.mirror is not None and model.mirror.pinned
    params = list(model.model.parameters())
    assert all(p.untyped_storage().nbytes() == 0 for p in params)  # parked before the first call
    gpu, cut = model.score(MESSAGES, RESPONSES)
    assert cut == 0
    assert torch.allclose(gpu, cpu, atol=0.05, rtol=0.02), (gpu, cpu)
    assert all(p.untyped_storage().nbytes() == 0 for p in params)  # parked again
    again, _ = model.score(MESSAGES, RESPONSES)
    assert torch.equal(again, gpu)  # the weights came back unchanged
