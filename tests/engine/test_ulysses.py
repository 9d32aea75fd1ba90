"""Ulysses sequence parallelism (``actor.ulysses_sequence_parallel_size``): a packed row cut in slices over a group
of ranks computes what one rank computes with the whole row.

The torchrun tests launch ``tests/engine/multirank/ulysses_checks.py`` on 2 and 4 gloo ranks (CPU, float32, the
tiny Qwen2: 4 attention heads, 2 key/value heads) and compare against sequence-parallel size 1 on the same global
batch, run in the same launch: log-probs, the gradients of one backward of a token-mean loss, and the actor worker's
whole update; and the driver's steps at sizes 2 and 1. The others check the slicing and the configuration in one
process.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from helpers import run_checked
from hybrid_rl.config import ConfigError, load_config
from hybrid_rl.workers.packed import pack, pack_shared
from hybrid_rl.batch import Batch
from hybrid_rl.phases.group_rows import per_member
from hybrid_rl.workers.ulysses import SequenceParallel, check_heads, repeat_kv_heads, shard

ROOT = Path(__file__).resolve().parents[2]
CHECKS = ROOT / "tests" / "engine" / "multirank" / "ulysses_checks.py"
TOL = 1e-5


def _launch(ranks: int, out: Path, *which: str) -> list[dict]:
    run_checked([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}",
                 str(CHECKS), str(out), *which])
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(ranks)]


@pytest.fixture(scope="module")
def two_ranks(tiny_model_path, tmp_path_factory):
    return _launch(2, tmp_path_factory.mktemp("ulysses2"), "engine", "worker")


def _assert_engine_matches(ranks: list[dict], sizes: tuple[int, ...]) -> None:
    for res in ranks:
        for variant in ("plain", "fused_shared_ckpt"):
            for size in sizes:
                got = res[(variant, size)]
                assert got["rows"] == 8 * size // res["world_size"]  # the group holds its data-parallel share
                assert min(got["lp_scale"], got["ent_scale"]) > 1.0 and got["grad_scale"] > 1e-2  # not zeros
                assert got["lp_diff"] < TOL and got["ent_diff"] < TOL, (variant, size, got)
                assert got["grad_diff"] < TOL, (variant, size, got)


@pytest.mark.slow
def test_two_rank_log_probs_and_gradients_equal_size_one(two_ranks):
    """Size 2: the same log-probs and entropies and, after one backward, the same full gradients as size 1 (the
    LM head on logits, and the fused head with shared prompts and gradient checkpointing)."""
    _assert_engine_matches(two_ranks, (2,))


@pytest.mark.slow
def test_two_rank_worker_update_equals_size_one(two_ranks):
    """The actor worker's update on the same batch: the same gradient norm and the same parameters after the step."""
    for res in two_ranks:
        w = res["worker"]
        assert w["moved"] > 1e-4  # the step moved every parameter
        assert w["param_diff"] < TOL, w
        got, want = w["grad_norm"]
        assert got == pytest.approx(want, rel=TOL)


@pytest.mark.slow
def test_four_rank_log_probs_and_gradients_equal_size_one(tiny_model_path, tmp_path):
    """Sizes 2 and 4 on 4 ranks; size 4 repeats the model's 2 key/value heads so each rank has one."""
    _assert_engine_matches(_launch(4, tmp_path, "engine"), (2, 4))


# the CPU recipe on the tiny model, packed, with a critic (GAE, whitened over each rank's rows) and loss terms that
# give gradients while the task's rewards are still 0 (the overlong penalty, an entropy bonus, a KL loss)
TRAIN = ["-m", "hybrid_rl", "train", "recipes/cpu_successor.yaml", "trainer.total_steps=2", "trainer.logger=[jsonl]",
         "trainer.val_before_train=false", "trainer.test_freq=0", "model.path=builtin:tiny-qwen2", "model.lora.rank=0",
         "data.train_batch_size=8", "actor.ppo_mini_batch_size=4", "rollout.n=4",
         "actor.ppo_micro_batch_size_per_device=8", "trainer.mode=sync", "actor.use_remove_padding=true", "actor.entropy_coeff=0.01", "actor.use_kl_loss=true",
         "algorithm.adv_estimator=gae", "critic.ppo_mini_batch_size=4", "critic.ppo_micro_batch_size_per_device=8",
         "reward.overlong_buffer_len=3"]


@pytest.mark.slow
def test_driver_steps_at_size_two_equal_size_one(tiny_model_path, tmp_path):
    """Two driver steps on 2 ranks (2 mini-batches each): each rank generates its own rows, the group trains on both
    ranks' rows in the mini-batches size 1 cuts, each rank's advantages whitened over its own rows, so every step's
    gradient norms and losses (actor and critic) are size 1's."""
    rows = {}
    for size in (1, 2):
        out = tmp_path / f"sp{size}"
        run_checked([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"] + TRAIN
                    + [f"trainer.output_dir={out}", f"actor.ulysses_sequence_parallel_size={size}"], timeout=600)
        rows[size] = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    assert [r["step"] for r in rows[2]] == [1, 2]
    for got, want in zip(rows[2], rows[1]):
        assert want["actor/grad_norm"] > 0 and want["critic/vf_loss"] > 0
        for key in ("actor/grad_norm", "actor/pg_loss", "actor/kl_loss", "actor/entropy", "critic/grad_norm",
                    "critic/vf_loss"):
            assert got[key] == pytest.approx(want[key], rel=TOL), key
        assert got["rollout/response_length_mean"] == want["rollout/response_length_mean"]


# --------------------------------------------------------------------------- one process
def _padded_batch() -> dict[str, torch.Tensor]:
    """3 rows: left-padded prompts (two equal), right-padded responses."""
    mask = torch.tensor([[0, 1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1, 1], [0, 1, 1, 1, 1, 0, 0]])
    ids = torch.arange(1, 22).view(3, 7) * mask
    ids[2, :4] = ids[0, :4]  # rows 0 and 2 share their prompt
    positions = (mask.cumsum(1) - 1).clamp(min=0)
    return dict(input_ids=ids, attention_mask=mask, position_ids=positions, responses=ids[:, 4:])


@pytest.mark.parametrize("packer", [pack, pack_shared])
@pytest.mark.parametrize("size", [2, 3, 4])
def test_slices_cover_the_row_and_its_head_rows(packer, size):
    p = packer(_padded_batch())
    rows = [shard(p, SequenceParallel(size=size, rank=r)) for r in range(size)]
    real = p.input_ids.shape[1]
    ids = torch.cat([s.input_ids for s in rows], dim=1)
    assert ids.shape[1] % size == 0 and ids.shape[1] - real < size
    assert torch.equal(ids[:, :real], p.input_ids) and not ids[:, real:].any()
    assert torch.equal(torch.cat([s.position_ids for s in rows], dim=1)[:, :real], p.position_ids)
    width = rows[0].input_ids.shape[1]
    assert [len(s.keep) for s in rows] == rows[0].counts and sum(rows[0].counts) == len(p.keep)
    # each slice's head rows, back in the row's order, are the row's, with their targets
    flat_keep = torch.cat([s.keep + r * width for r, s in enumerate(rows)])
    flat_targets = torch.cat([s.targets for s in rows])
    order = rows[0].order
    assert torch.equal(flat_keep.new_empty(flat_keep.shape).index_copy(0, order, flat_keep), p.keep)
    assert torch.equal(flat_targets.new_empty(flat_targets.shape).index_copy(0, order, flat_targets), p.targets)
    assert all(((s.keep >= 0) & (s.keep < width)).all() for s in rows)


def test_key_value_heads_repeat_to_the_group_size():
    k = torch.arange(2.0).view(1, 2, 1).expand(3, 2, 1)
    assert repeat_kv_heads(k, 4)[0, :, 0].tolist() == [0, 0, 1, 1]  # query heads 0-1 use kv head 0, 2-3 kv head 1
    assert repeat_kv_heads(k, 2) is k


def test_heads_must_split_over_the_group():
    class Cfg:
        num_attention_heads, num_key_value_heads = 4, 2

    check_heads(Cfg, 4, "actor.ulysses_sequence_parallel_size")
    with pytest.raises(ValueError, match="actor.ulysses_sequence_parallel_size=3"):
        check_heads(Cfg, 3, "actor.ulysses_sequence_parallel_size")
    Cfg.num_attention_heads, Cfg.num_key_value_heads = 12, 3
    with pytest.raises(ValueError, match="3 key/value heads"):
        check_heads(Cfg, 4, "actor.ulysses_sequence_parallel_size")


def test_config_needs_packing_and_divides_the_ranks():
    sp = ["actor.ulysses_sequence_parallel_size=2"]
    with pytest.raises(ConfigError, match="actor.use_remove_padding=true"):
        load_config(None, sp + ["actor.use_remove_padding=false"]).validate(world_size=2)
    with pytest.raises(ConfigError, match="actor.ulysses_sequence_parallel_size=2 must divide the 3"):
        load_config(None, sp + ["data.train_batch_size=6", "actor.ppo_mini_batch_size=6"]).validate(world_size=3)
    with pytest.raises(ConfigError, match="actor.ulysses_sequence_parallel_size"):
        load_config(None, ["actor.ulysses_sequence_parallel_size=0"]).validate()


def test_mini_batches_divide_over_data_parallel_shares():
    """4 ranks in groups of 2 are 2 data-parallel shares: a mini-batch of 2 prompts splits over them (over 4 ranks it
    would not), one of 3 does not."""
    base = ["actor.ulysses_sequence_parallel_size=2", "data.train_batch_size=12", "rollout.n=2",
            "actor.ppo_micro_batch_size_per_device=2"]
    load_config(None, base + ["actor.ppo_mini_batch_size=2"]).validate(world_size=4)  # 4 ranks would refuse 2
    with pytest.raises(ConfigError, match="by the 2 data-parallel ranks"):
        load_config(None, base + ["actor.ppo_mini_batch_size=3"]).validate(world_size=4)


def test_per_member_computes_each_members_rows_alone():
    """A batch-wide normalisation over a gathered batch (members' rows interleaved) equals each member's own."""
    x = torch.tensor([[1.0], [10.0], [3.0], [30.0], [5.0]])
    members = [np.array([0, 2, 4]), np.array([1, 3])]

    def centre(b: Batch):
        v = b.tensors["x"]
        return b.union(tensors=dict(y=v - v.mean())), float(v.mean())

    out, own_mean = per_member(Batch({"x": x}, {}, {"step": 1}), members, 1, centre)
    assert out["y"].squeeze(1).tolist() == [-2.0, -10.0, 0.0, 10.0, 2.0]
    assert own_mean == 20.0 and out.meta == {"step": 1}
