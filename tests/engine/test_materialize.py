"""Only the first rank reads the weights: every rank's engines still start from exactly the checkpoint.

One ``torchrun --nproc_per_node=2`` launch of ``tests/engine/multirank/materialize_checks.py`` (2 gloo ranks on
CPU, tiny model) builds the actor, its frozen reference, a LoRA actor and a critic as the trainer does and records
what each rank holds; the tests compare that, bit for bit, with the same models loaded the plain way in this process
(``load_causal_lm``, ``apply_lora``, ``build_value_model``), and check that the second rank never read a checkpoint.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from helpers import run_checked

ROOT = Path(__file__).resolve().parents[2]
CHECKS = ROOT / "tests" / "engine" / "multirank" / "materialize_checks.py"
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def ranks(tiny_model_path, tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("materialize")
    run_checked(TORCHRUN + [str(CHECKS), str(out)])
    return [torch.load(out / f"rank{r}.pt", map_location="cpu", weights_only=False) for r in range(2)]


def _assert_holds(got: dict, want: torch.nn.Module) -> None:
    """``got`` (a rank's snapshot) holds ``want``'s parameters and buffers exactly, tied and in its modes."""
    params = dict(want.named_parameters())
    assert sorted(got["params"]) == sorted(params)
    for name, p in params.items():
        assert got["params"][name].dtype == p.dtype and torch.equal(got["params"][name], p.detach()), name
    buffers = dict(want.named_buffers())  # the rotary embedding's inv_freq: non-persistent, not in any checkpoint
    assert sorted(got["buffers"]) == sorted(buffers) and buffers
    for name, b in buffers.items():
        assert got["buffers"][name].dtype == b.dtype and torch.equal(got["buffers"][name], b), name
    assert got["tied"] == [n for n, _ in want.named_parameters(remove_duplicate=False) if n not in params]
    assert got["training"] == {n: m.training for n, m in want.named_modules()}
    assert got["devices"] == ["cpu"]  # nothing left on meta


def test_actor_and_reference_equal_the_checkpoint_on_every_rank(ranks, tiny_model_path):
    from hybrid_rl.models import load_causal_lm

    want = load_causal_lm(tiny_model_path, torch.float32)
    for res in ranks:
        _assert_holds(res["actor"], want)
        assert res["actor"]["tied"] == ["lm_head.weight"]  # the tiny model ties its embeddings
        assert len(res["actor"]["trainable"]) == 26
        _assert_holds(res["ref"], want)
        assert res["ref"]["trainable"] == []


def test_lora_actor_equals_the_first_ranks_adapters_on_every_rank(ranks, tiny_model_path):
    """The adapters are the ones the first rank drew (from the seed the checks set), on both ranks."""
    from hybrid_rl.config import load_config
    from hybrid_rl.models import apply_lora, load_causal_lm

    sys.path.insert(0, str(CHECKS.parent))
    from materialize_checks import BASE, LORA, LORA_SEED

    lora = load_config(None, BASE + LORA).model.lora
    torch.manual_seed(LORA_SEED)
    want = apply_lora(load_causal_lm(tiny_model_path, torch.float32), lora.rank, lora.alpha, lora.target_modules,
                      lora.dropout)
    a_weights = [p for n, p in want.named_parameters() if ".lora_A." in n]
    assert len(a_weights) == 4 and all(p.abs().sum() > 0 for p in a_weights)  # random, so equality means something
    for res in ranks:
        _assert_holds(res["lora"], want)
        assert sorted(res["lora"]["trainable"]) == sorted(n for n, p in want.named_parameters() if p.requires_grad)


def test_critic_equals_the_checkpoint_with_a_zero_value_head_on_every_rank(ranks, tiny_model_path):
    from hybrid_rl.workers.critic import build_value_model

    want = build_value_model(tiny_model_path)
    for res in ranks:
        _assert_holds(res["critic"], want)
        head = res["critic"]["params"]
        assert torch.equal(head["value_head.weight"], torch.zeros(1, 64)) and torch.equal(head["value_head.bias"],
                                                                                          torch.zeros(1))


def test_only_the_first_rank_reads_the_checkpoint(ranks, tiny_model_path):
    """Rank 1 never calls ``from_pretrained`` and hands every engine a model on ``meta``; rank 0 reads once per
    model (actor, reference, LoRA actor, critic) and hands over real weights."""
    first, second = ranks
    assert first["reads"] == [tiny_model_path] * 4 and first["handed"] == [{"cpu"}] * 4
    assert second["reads"] == [] and second["handed"] == [{"meta"}] * 4
