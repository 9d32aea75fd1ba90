"""The random-weight Qwen2.5 shapes: the 7B's parameter count against the published figures (no weights built), its
name resolving to the streamed writer, and that writer's checkpoint loading like ``save_pretrained``'s."""

from __future__ import annotations

import json

import pytest
import torch

from hybrid_rl import models
from hybrid_rl.planner.shape import read_shape
from hybrid_rl.models.random_init import SHARD_BYTES, param_plan, shards, write_random_qwen2

SEVEN_B = "qwen2.5-7b-random"
# Qwen2.5-7B-Instruct's config.json: hidden 3584, MLP 18944, 28 layers, 28 heads of 128, 4 key/value heads,
# vocabulary 152064, untied LM head
H, I, L, HEAD, KVH, V = 3584, 18944, 28, 128, 4, 152064
KV = KVH * HEAD
LAYER = (H * H + H) + 2 * (H * KV + KV) + H * H + 3 * H * I + 2 * H  # q+bias, k/v+bias, o, gate/up/down, 2 norms
NON_EMBEDDING = L * LAYER + H  # + the final norm
TOTAL = NON_EMBEDDING + 2 * V * H  # embedding and LM head


def _meta_model(shape: dict):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    with torch.device("meta"):
        return Qwen2ForCausalLM(Qwen2Config(**shape))


def test_7b_parameter_count_matches_the_published_model():
    assert LAYER == 233_057_792 and TOTAL == 7_615_616_512  # added up by hand from the line above
    # the model card: 7.61B parameters (7.62B rounded), 6.53B without the embeddings
    assert 7.61e9 < TOTAL < 7.62e9 and round(NON_EMBEDDING / 1e9, 2) == 6.53
    model = _meta_model(models.RANDOM_ARCHS[SEVEN_B])  # shapes only: no storage
    assert sum(p.numel() for p in model.parameters()) == TOTAL
    assert model.lm_head.weight is not model.model.embed_tokens.weight
    assert read_shape(f"builtin:{SEVEN_B}").params == TOTAL


def test_7b_is_written_in_shards_of_bounded_size():
    plan = param_plan(_meta_model(models.RANDOM_ARCHS[SEVEN_B]))
    groups = shards(plan, itemsize=2)
    sizes = [sum(shape.numel() * 2 for _, _, shape, _ in g) for g in groups]
    assert sum(sizes) == 2 * TOTAL  # 15.2 GB of bf16
    assert max(sizes) <= SHARD_BYTES and len(groups) == 4  # host memory peaks at one 4 GiB shard, not 2 × 15.2 GB


def test_7b_name_resolves_to_the_streamed_build(tmp_path, monkeypatch):
    assert SEVEN_B in models.BUILTIN_NAMES and SEVEN_B in models.STREAMED_ARCHS
    monkeypatch.setenv("HYBRID_RL_CACHE", str(tmp_path))
    built = []
    monkeypatch.setattr(models, "build_once", lambda out, stamp, write, marker: built.append((out, write, marker)))
    monkeypatch.setattr(models, "is_builtin_complete", lambda out, arch, seed=0: bool(built))
    assert models.resolve_model_path(f"builtin:{SEVEN_B}") == str(tmp_path / SEVEN_B)
    (out, write, marker), = built
    assert out == tmp_path / SEVEN_B and marker["arch"] == SEVEN_B

    class Streamed(Exception):
        pass

    def streamed(out, config, seed, dtype):
        assert (config.hidden_size, config.vocab_size, config.tie_word_embeddings) == (H, V, False)
        assert dtype == torch.bfloat16
        raise Streamed

    def whole(*args):
        raise AssertionError("the 7B was about to be built whole in host memory")

    monkeypatch.setattr(models, "write_random_qwen2", streamed)
    monkeypatch.setattr(models, "_write_whole", whole)
    (tmp_path / "w").mkdir()
    with pytest.raises(Streamed):  # the cache's writer takes the streamed path: no whole model in memory
        write(tmp_path / "w")


SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=512, rope_theta=1e6, rms_norm_eps=1e-6, vocab_size=300)


@pytest.mark.parametrize("tied", [False, True])
def test_streamed_checkpoint_loads_like_save_pretrained(tmp_path, tied):
    from transformers import AutoModelForCausalLM, Qwen2Config, Qwen2ForCausalLM

    shape = dict(SMALL, tie_word_embeddings=tied)
    config = lambda: Qwen2Config(bos_token_id=None, eos_token_id=2, pad_token_id=0, **shape)  # noqa: E731
    ours, ref = tmp_path / "streamed", tmp_path / "whole"
    ours.mkdir()
    nbytes = write_random_qwen2(ours, config(), seed=0, shard_bytes=40_000)
    Qwen2ForCausalLM(config()).to(torch.bfloat16).save_pretrained(ref)
    for name in ("config.json", "generation_config.json"):
        assert json.loads((ours / name).read_text()) == json.loads((ref / name).read_text())
    layer = (64 * 64 + 64) + 2 * (64 * 32 + 32) + 64 * 64 + 3 * 64 * 128 + 2 * 64
    params = 2 * layer + 300 * 64 * (1 if tied else 2) + 64
    assert nbytes == 2 * params
    assert len(list(ours.glob("model-*.safetensors"))) > 1  # 40 kB shards: several
    model, info = AutoModelForCausalLM.from_pretrained(ours, dtype=torch.bfloat16, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert sum(p.numel() for p in model.parameters()) == params
    emb = model.model.embed_tokens.weight.float()
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
    assert torch.all(emb[0] == 0)  # the padding row (pad_token_id 0)
    assert abs(emb[1:].std().item() - 0.02) < 0.002  # initializer_range, over 19k draws
    attn = model.model.layers[0].self_attn
    assert torch.all(attn.q_proj.bias == 0) and torch.all(model.model.norm.weight == 1)
    again = tmp_path / "again"
    again.mkdir()
    write_random_qwen2(again, config(), seed=0, shard_bytes=40_000)
    same = AutoModelForCausalLM.from_pretrained(again, dtype=torch.bfloat16)
    assert torch.equal(same.model.layers[1].mlp.up_proj.weight, model.model.layers[1].mlp.up_proj.weight)  # seeded


def test_the_shards_hold_one_generator_s_draws_in_the_model_s_order(tmp_path):
    """Shards are written while the next is drawn: the weights are still the seed's stream taken tensor by tensor
    in the model's parameter order (drawn here with torch alone), whatever shard each lands in."""
    from safetensors.torch import load_file
    from transformers import Qwen2Config

    config = Qwen2Config(bos_token_id=None, eos_token_id=2, pad_token_id=None, **SMALL)
    write_random_qwen2(tmp_path, config, seed=3, shard_bytes=40_000)
    got = {}
    for f in sorted(tmp_path.glob("model-*.safetensors")):
        got.update(load_file(f))
    gen = torch.Generator().manual_seed(3)
    drawn = 0
    for name, p in _meta_model(SMALL).named_parameters():
        if name.endswith("weight") and "norm" not in name:
            want = torch.empty(p.shape, dtype=torch.bfloat16).normal_(0.0, config.initializer_range, generator=gen)
            assert torch.equal(got[name], want), name
            drawn += 1
    assert drawn == len([n for n in got if n.endswith("weight") and "norm" not in n]) > 5
