"""``model.lora.base_dtype=compute``: the LoRA actor's frozen base stored in the compute dtype computes what the fp32
base computes, bit for bit, in half the bytes (2 gloo ranks, bf16 compute, the first rank reading the weights;
``multirank/lora_base_checks.py`` records, these tests compare)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from helpers import run_checked

ROOT = Path(__file__).resolve().parents[2]
CHECKS = ROOT / "tests" / "engine" / "multirank" / "lora_base_checks.py"
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def ranks(tiny_model_path, tmp_path_factory):
    out = tmp_path_factory.mktemp("lora_base")
    run_checked(TORCHRUN + [str(CHECKS), str(out)])
    return [torch.load(out / f"rank{r}.pt", map_location="cpu", weights_only=False) for r in range(2)]


def test_the_base_is_stored_in_the_compute_dtype_and_the_adapters_in_fp32(ranks):
    for rank in ranks:
        full, compute = rank["float32"], rank["compute"]
        assert full["frozen_dtypes"] == ["torch.float32"] and compute["frozen_dtypes"] == ["torch.bfloat16"]
        assert full["trained_dtypes"] == compute["trained_dtypes"] == ["torch.float32"]
        assert compute["frozen_bytes"] * 2 == full["frozen_bytes"] > 0


def test_the_base_holds_the_fp32_base_rounded_once(ranks):
    """Independent of the engine: the fp32 run's full frozen tensors cast to bf16 here."""
    for rank in ranks:
        full, compute = rank["float32"]["frozen_full"], rank["compute"]["frozen_full"]
        assert full.keys() == compute.keys() and len(full) > 10
        for name, t in full.items():
            assert torch.equal(t.to(torch.bfloat16), compute[name]), name


def test_forward_and_adapter_gradients_are_bit_identical(ranks):
    """FSDP2 casts an fp32 base to bf16 for every pass: storing it in bf16 changes no logit and no gradient."""
    for rank in ranks:
        full, compute = rank["float32"], rank["compute"]
        assert torch.equal(full["logits"], compute["logits"])
        assert full["grads"].keys() == compute["grads"].keys() and len(full["grads"]) == 8  # A, B × q, v × 2 layers
        for name, g in full["grads"].items():
            assert torch.equal(g, compute["grads"][name]), name
            # B starts at zero (peft's init), so A's gradient is zero at the first step and B's is not
            assert (g.abs().sum() > 0) == ("lora_B" in name), name
