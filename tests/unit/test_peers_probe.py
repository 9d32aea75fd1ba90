"""``benchmarks/peers/probe.py``: a process started with the probe's site on its ``PYTHONPATH`` reports the attention
implementation its forwards ran, their rows and lengths, its model's Liger modules, and ``collect`` compares that
with what the run asked for. The expected counts are worked out from the model's shape and the forwards run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

from helpers import ROOT, subprocess_env

sys.path.insert(0, str(ROOT / "benchmarks" / "peers"))
import probe  # noqa: E402

SCRIPT = textwrap.dedent("""
    import sys, time
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM
    from liger_kernel.transformers.rms_norm import LigerRMSNorm  # a stand-in module of that name (see the test)

    cfg = Qwen2Config(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    cfg._attn_implementation = "sdpa"
    model = Qwen2ForCausalLM(cfg)
    if sys.argv[1] == "liger":
        for layer in model.model.layers:
            layer.input_layernorm = LigerRMSNorm(32)
            layer.post_attention_layernorm = LigerRMSNorm(32)
        model.model.norm = LigerRMSNorm(32)
    if sys.argv[1] == "frozen":  # what vLLM does once its engine has started: the heap so far leaves the GC's view
        import gc
        gc.freeze()
        assert not any(o is model for o in gc.get_objects())
    model(torch.randint(0, 97, (1, 40))).logits.sum().backward()   # one row of 40 tokens, with autograd
    with torch.no_grad():
        model(torch.randint(0, 97, (2, 12)))                           # two rows of 12, no grad
    time.sleep(3)                                                       # the look at +0.5 s after the first call
""")

FAKE_LIGER = """
import torch
class LigerRMSNorm(torch.nn.Module):
    def __init__(self, h):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(h))
    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight
"""


def _run(tmp_path, variant: str):
    fake = tmp_path / "fake"
    (fake / "liger_kernel" / "transformers").mkdir(parents=True, exist_ok=True)
    for d in (fake / "liger_kernel", fake / "liger_kernel" / "transformers"):
        (d / "__init__.py").write_text("")
    (fake / "liger_kernel" / "transformers" / "rms_norm.py").write_text(FAKE_LIGER)
    site = probe.site(tmp_path / "site")
    out = tmp_path / f"probe_{variant}"
    env = probe.env_for(subprocess_env(), site, out)
    env["PYTHONPATH"] = os.pathsep.join([env["PYTHONPATH"], str(fake)])
    env[probe.ENV_AT] = "0.5"
    script = tmp_path / "run.py"
    script.write_text(SCRIPT)
    proc = subprocess.run([sys.executable, str(script), variant], env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


def test_the_probe_counts_the_attention_that_ran_and_finds_liger_modules(tmp_path):
    out = _run(tmp_path, "liger")
    files = list(out.glob("probe_*.json"))
    assert len(files) == 1  # the one process that used transformers
    took = probe.collect(out, seq_cap=32, asked={"liger": True, "attn_implementation": "flex_attention",
                                                 "remove_padding": True})
    sdpa = took["attention"]["sdpa"]
    # 3 layers x 2 forwards; the grad forward: 3 calls, all on one row of 40 queries
    assert (sdpa["calls"], sdpa["grad_calls"], sdpa["batch1_grad_calls"]) == (6, 3, 3)
    assert sdpa["max_q_len_grad"] == 40 and sdpa["batch1_calls"] == 3
    assert took["attention_in_training"] == ["sdpa"]
    assert took["packed_rows_in_training"] is True  # one row of 40 > 32, the longest single sequence
    [model] = [m for m in took["models"] if m["class"] == "Qwen2ForCausalLM"]
    assert model["attn_implementation"] == "sdpa" and model["liger_modules"] == 3 * 2 + 1
    assert took["checks"]["liger"] == {"asked": True, "ran": True}
    assert took["mismatches"] == ["attn_implementation"]  # flex attention asked, sdpa ran


def test_without_liger_and_within_one_sequence_nothing_is_claimed(tmp_path):
    out = _run(tmp_path, "plain")
    took = probe.collect(out, seq_cap=64, asked={"liger": True, "attn_implementation": "sdpa",
                                                 "remove_padding": False})
    assert took["liger_modules"] == 0 and took["packed_rows_in_training"] is False  # 40 fits one sequence of 64
    assert took["mismatches"] == ["liger"]
    assert probe.collect(tmp_path / "nothing", seq_cap=64, asked={"liger": True})["processes"] == 0


def test_a_model_built_before_the_heap_is_frozen_is_still_found(tmp_path):
    """vLLM freezes the garbage collector's heap after start-up; a trainer's model built before that is out of
    ``gc.get_objects()`` (the script checks) and the probe still lists it, from the models it saw being built."""
    out = _run(tmp_path, "frozen")
    took = probe.collect(out, seq_cap=64, asked={"liger": False})
    [model] = [m for m in took["models"] if m["class"] == "Qwen2ForCausalLM"]
    # 3 layers of a 32-wide Qwen2 with a 97-token vocabulary, embeddings untied: counted from the shape
    per_layer = (32 * 32 + 32) + 2 * (32 * 16 + 16) + (32 * 32) + 3 * 32 * 64 + 2 * 32
    assert model["params"] == 97 * 32 * 2 + 3 * per_layer + 32
    assert model["training"] is True and model["liger_modules"] == 0


def test_the_site_keeps_what_runs_before_the_probe(tmp_path):
    site = probe.site(tmp_path / "s", prelude="X = 1\n")
    text = (site / "sitecustomize.py").read_text()
    assert text.startswith("X = 1\n") and "peers_probe" in text
    assert (site / "peers_probe.py").read_text() == (ROOT / "benchmarks" / "peers" / "probe.py").read_text()
    proc = subprocess.run([sys.executable, "-c", "import sitecustomize, sys; print(sitecustomize.X, "
                           "'transformers' in sys.modules)"], env={**subprocess_env(), "PYTHONPATH": str(site),
                          probe.ENV_DIR: str(tmp_path / "o")}, capture_output=True, text=True, timeout=60)
    assert proc.stdout.split() == ["1", "False"], proc.stderr  # the probe never imports transformers itself
    assert json.dumps(probe.collect(tmp_path / "o", seq_cap=1))  # nothing written: an empty record
