"""Preflight (hybrid_rl/preflight.py) in-process: what passes without building or downloading, what fails, and when."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from hybrid_rl import preflight as pf
from hybrid_rl.config import load_config
from hybrid_rl.data.tasks import DataError
from hybrid_rl.models import ModelLoadError

RECIPE = "recipes/cpu_successor.yaml"
ROOT_DIR = Path(__file__).resolve().parents[2]


@pytest.fixture
def no_network(monkeypatch):
    """Any probe of the hub fails the test; the hub cache is an empty directory."""
    def probe(endpoint):
        raise AssertionError("preflight reached for the network")

    monkeypatch.setattr(pf, "_probe", probe)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)


@pytest.fixture
def empty_hf_cache(tmp_path, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets"))
    return tmp_path


def test_builtin_model_and_synthetic_data_pass_without_building_or_network(tmp_path, monkeypatch, no_network):
    monkeypatch.setenv("HYBRID_RL_CACHE", str(tmp_path / "builtin"))
    pf.preflight(load_config(RECIPE), nproc=2)
    pf.preflight(load_config(RECIPE, ["model.path=builtin:qwen2.5-0.5b-random"]))
    assert not (tmp_path / "builtin").exists()  # nothing was materialised


def test_unknown_builtin_model_is_named(no_network):
    with pytest.raises(ModelLoadError, match="unknown built-in model 'nope'"):
        pf.preflight(load_config(RECIPE, ["model.path=builtin:nope"]))


def test_missing_local_files(tmp_path, no_network):
    with pytest.raises(ModelLoadError, match="model.tokenizer_path: './no/tok' does not exist"):
        pf.preflight(load_config(RECIPE, ["model.tokenizer_path=./no/tok"]))
    with pytest.raises(DataError, match="data.train_path='x/train.jsonl': no such file"):
        pf.preflight(load_config(RECIPE, ["data.train_path=x/train.jsonl", "data.task=gsm8k"]))
    (tmp_path / "train.jsonl").write_text('{"question": "q", "answer": "#### 1"}\n')
    pf.preflight(load_config(RECIPE, [f"data.train_path={tmp_path}/train.jsonl", "data.task=gsm8k"]))


def test_cached_hub_model_and_dataset_pass_offline(empty_hf_cache, monkeypatch):
    snap = empty_hf_cache / "hub" / "models--org--m" / "snapshots" / "abc"
    snap.mkdir(parents=True)
    (snap / "config.json").write_text("{}")
    (snap.parents[1] / "refs").mkdir()
    (snap.parents[1] / "refs" / "main").write_text("abc")
    (empty_hf_cache / "datasets" / "org___d" / "main").mkdir(parents=True)  # as `datasets` prepares it
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    pf.preflight(load_config(RECIPE, ["model.path=org/m", "data.train_path=org/d", "data.task=gsm8k"]))
    with pytest.raises(pf.PreflightError, match="model.path='org/other'.*HF_HUB_OFFLINE=1 is set"):
        pf.preflight(load_config(RECIPE, ["model.path=org/other"]))


def test_uncached_hub_ids_pass_when_the_hub_answers(empty_hf_cache, monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(pf, "hub_unreachable", lambda datasets=False: None)
    pf.preflight(load_config(RECIPE, ["model.path=org/m", "data.train_path=org/d", "data.task=gsm8k"]))


def test_val_path_checked_only_when_validating(empty_hf_cache, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    off = ["data.val_path=org/d", "trainer.test_freq=0", "trainer.val_before_train=false"]
    pf.preflight(load_config(RECIPE, off))
    for on in (["trainer.test_freq=5"], ["trainer.val_before_train=true"]):
        with pytest.raises(pf.PreflightError, match="data.val_path='org/d'"):
            pf.preflight(load_config(RECIPE, off + on))


def test_vllm_missing_names_what_this_machine_lacks(monkeypatch, no_network):
    """With GPUs: the install line (pip of this interpreter) or the transformers engine. Without: the recipe needs
    GPUs, and a hub model the hub or a copy (rollout.name=hf would only lead to the hub's error); and `make train`."""
    import torch

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real(name, *a))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ModelLoadError) as e:
        pf.preflight(load_config(RECIPE, ["rollout.name=vllm"]))
    assert str(e.value) == f"rollout.name=vllm needs vLLM: {pf.pip_command()} install -e '.[vllm]' (tested: vllm 0.26), " \
                           f"or use rollout.name=hf"
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    monkeypatch.setattr(pf, "_hub_cached", lambda *a: False)
    with pytest.raises(pf.PreflightError) as e:
        pf.preflight(load_config("recipes/gsm8k_grpo.yaml"))
    msg = str(e.value)
    for part in ("needs NVIDIA GPUs and vLLM", "install -e '.[vllm]'", "model.path='Qwen/Qwen2.5-1.5B-Instruct' also "
                 "needs hub access or a local copy", "`make train` (recipes/cpu_successor.yaml"):
        assert part in msg, (part, msg)
    assert "rollout.name=hf" not in msg and "\n" not in msg
    with pytest.raises(pf.PreflightError, match="with rollout.name=hf it runs on CPU"):  # a built-in model is here
        pf.preflight(load_config(RECIPE, ["rollout.name=vllm"]))


def test_pip_command_is_this_interpreters(monkeypatch, tmp_path):
    import sys

    venv = ROOT_DIR / ".venv"
    monkeypatch.setattr(sys, "prefix", str(venv))
    monkeypatch.chdir(ROOT_DIR)
    assert pf.pip_command() == ".venv/bin/pip"
    monkeypatch.chdir(tmp_path)
    assert pf.pip_command() == str(venv / "bin" / "pip")
    monkeypatch.setattr(sys, "prefix", str(tmp_path / "other"))
    assert pf.pip_command() == f"{sys.executable} -m pip"


@pytest.mark.parametrize("device, gpus, nproc, error", [
    ("cuda", 0, 1, "trainer.device=cuda but no CUDA GPU is visible"),
    ("cuda", 2, 4, "4 processes need one GPU each (trainer.device=cuda) but 2 GPU(s) are visible; launch 2"),
    ("auto", 1, 2, "2 processes need one GPU each (trainer.device=auto)"),
    ("auto", 0, 4, None),  # CPU ranks
    ("cpu", 0, 4, None),
    ("cuda", 8, 8, None),
])
def test_gpu_count(monkeypatch, no_network, device, gpus, nproc, error):
    import torch

    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    cfg = load_config(RECIPE, [f"trainer.device={device}"])
    if error is None:
        pf.check_devices(cfg, nproc)
    else:
        with pytest.raises(pf.PreflightError, match=error.replace("(", r"\(").replace(")", r"\)")):
            pf.check_devices(cfg, nproc)


def test_nproc_argument():
    from hybrid_rl.__main__ import _nproc

    assert _nproc("auto", load_config(RECIPE)) == 1  # trainer.device=cpu: one process
    assert _nproc("3", load_config(RECIPE)) == 3
    with pytest.raises(pf.PreflightError, match="--nproc 'two'"):
        _nproc("two", load_config(RECIPE))


def test_validation_data_dir_that_cannot_be_created_is_named(tmp_path, no_network):
    """A file where trainer.validation_data_dir would go fails before any rank starts, naming the key; nothing is
    created by the check, and a creatable directory (or validation off) passes."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "blocked").write_text("a file, not a directory")
    args = [f"trainer.output_dir={run}", "trainer.val_before_train=true"]
    with pytest.raises(pf.PreflightError, match=r"trainer.validation_data_dir='blocked/val': cannot create .*is a file"):
        pf.preflight(load_config(RECIPE, [*args, "trainer.validation_data_dir=blocked/val"]))
    pf.preflight(load_config(RECIPE, [*args, "trainer.validation_data_dir=samples/val"]))
    pf.preflight(load_config(RECIPE, [f"trainer.output_dir={run}", "trainer.test_freq=0", "trainer.val_before_train=false",
                                      "trainer.validation_data_dir=blocked/val"]))
    assert sorted(p.name for p in run.iterdir()) == ["blocked"]


def test_a_local_model_directory_without_config_or_tokenizer_is_named(tmp_path, no_network):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ModelLoadError) as ei:
        pf.preflight(load_config(RECIPE, [f"model.path={empty}"]))
    msg = str(ei.value)
    assert msg.startswith(f"model.path={str(empty)!r}: the directory has no config.json (it is empty)"), msg
    assert "builtin:tiny-qwen2" in msg and "hub name" in msg
    config_only = tmp_path / "config_only"
    config_only.mkdir()
    (config_only / "config.json").write_text("{}")
    with pytest.raises(ModelLoadError, match=r"model.path=.*config_only': the directory has no tokenizer files .*"
                                             r"it holds config.json\); .*model.tokenizer_path"):
        pf.preflight(load_config(RECIPE, [f"model.path={config_only}"]))
    with pytest.raises(ModelLoadError, match=r"model.tokenizer_path=.*empty': the directory has no tokenizer files"):
        pf.preflight(load_config(RECIPE, [f"model.path={config_only}", f"model.tokenizer_path={empty}"]))
    (tmp_path / "weights.bin").write_bytes(b"")
    with pytest.raises(ModelLoadError, match=r"weights.bin' is a file, not a model directory"):
        pf.preflight(load_config(RECIPE, [f"model.path={tmp_path / 'weights.bin'}"]))


def test_the_loader_names_an_empty_model_directory_too(tmp_path):
    from hybrid_rl.models import load_causal_lm, load_tokenizer

    with pytest.raises(ModelLoadError, match="model.path=.*: the directory has no config.json"):
        load_causal_lm(str(tmp_path), dtype=__import__("torch").float32)
    with pytest.raises(ModelLoadError, match="model.path=.*: the directory has no tokenizer files"):
        load_tokenizer(str(tmp_path))


def test_prompt_plus_response_longer_than_the_models_positions_is_refused(tiny_model_path, tmp_path, no_network):
    import json
    import shutil

    positions = json.loads((Path(tiny_model_path) / "config.json").read_text())["max_position_embeddings"]
    fits = positions - 32
    for path in ("builtin:tiny-qwen2", tiny_model_path):
        pf.preflight(load_config(RECIPE, [f"model.path={path}", "data.max_prompt_length=32",
                                          f"data.max_response_length={fits}"]))
        with pytest.raises(pf.PreflightError) as ei:
            pf.preflight(load_config(RECIPE, [f"model.path={path}", "data.max_prompt_length=32",
                                              f"data.max_response_length={fits + 1}"]))
        msg = str(ei.value)
        assert (f"data.max_prompt_length + data.max_response_length = 32 + {fits + 1} = {positions + 1} tokens, more "
                f"than the {positions} positions of model.path={path!r}") in msg, msg
        assert f"lower data.max_response_length to at most {fits}" in msg
    short = tmp_path / "short"  # a local copy whose config says 40 positions
    shutil.copytree(tiny_model_path, short)
    config = json.loads((short / "config.json").read_text())
    (short / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 40}))
    with pytest.raises(pf.PreflightError, match=r"32 \+ 16 = 48 tokens, more than the 40 positions"):
        pf.preflight(load_config(RECIPE, [f"model.path={short}", "data.max_response_length=16"]))
