"""Tests for hybrid_rl.checkpoint and hybrid_rl.export: exact resume, atomic publish, pruning, FSDP2, HF export."""

from __future__ import annotations

import json
import os
import random
import socket
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a checkout without installing

from hybrid_rl.checkpoint import (COMPLETE, LATEST, CheckpointError, capture_rng, find_latest,  # noqa: E402
                                  load_checkpoint, restore_rng, save_checkpoint)
from hybrid_rl.export import export_hf  # noqa: E402

LORA_TARGETS = ["q_proj", "v_proj"]


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    """The built-in tiny model, materialised in a cache private to this module (HYBRID_RL_CACHE, restored after)."""
    from hybrid_rl.models import resolve_model_path

    mp = pytest.MonkeyPatch()
    mp.setenv("HYBRID_RL_CACHE", str(tmp_path_factory.mktemp("hrl_cache")))
    try:
        yield resolve_model_path("builtin:tiny-qwen2")
    finally:
        mp.undo()


# --------------------------------------------------------------------------- helpers
def _build(path: str, lora: bool = False):
    from hybrid_rl.models import apply_lora, load_causal_lm

    model = load_causal_lm(path, torch.float32)
    if lora:
        model = apply_lora(model, 4, 8, LORA_TARGETS, 0.0)
    return model


def _optim(model):
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-2, betas=(0.9, 0.99), weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 3))
    return opt, sched


def _batch(seed: int, vocab: int, rows: int = 2, length: int = 12) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (rows, length), generator=g)


def _step(model, opt, sched, ids: torch.Tensor) -> None:
    opt.zero_grad(set_to_none=True)
    model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], 1.0)
    opt.step()
    sched.step()


def _params(model) -> dict[str, torch.Tensor]:
    return {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone() for n, p in model.named_parameters()}


def _assert_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    bad = [k for k in a if not torch.equal(a[k], b[k])]
    assert not bad, f"parameters differ: {bad[:5]}"


def _vocab(model) -> int:
    return model.get_input_embeddings().weight.shape[0]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _touch_checkpoint(root: Path, step: int, complete: bool = True, name: str | None = None) -> Path:
    d = root / (name or f"step_{step:08d}")
    d.mkdir(parents=True)
    if complete:
        (d / COMPLETE).write_text(json.dumps({"step": step, "world_size": 1}))
    return d


# --------------------------------------------------------------------------- (1) exact resume, one process
def test_resume_is_bit_exact_single_process(tiny_path, tmp_path):
    torch.manual_seed(0)
    model = _build(tiny_path)
    opt, sched = _optim(model)
    vocab = _vocab(model)
    for s in range(2):
        _step(model, opt, sched, _batch(s, vocab))
    gen = torch.Generator().manual_seed(123)
    np_gen = np.random.default_rng(5)
    extra = {"step": 2, "weight_version": 2, "sampler": {"epoch": 0, "step_in_epoch": 2},
             "rng": capture_rng({"rollout": gen, "shuffle": np_gen})}
    ckpt = save_checkpoint(tmp_path / "ckpt", 2, model, opt, sched, extra, keep_last=0)
    assert ckpt == tmp_path / "ckpt" / "step_00000002" and (ckpt / COMPLETE).exists()
    assert (tmp_path / "ckpt" / LATEST).read_text().strip() == "step_00000002"
    draws = (random.random(), np.random.rand(), torch.rand(3), torch.rand(3, generator=gen), np_gen.random())
    _step(model, opt, sched, _batch(2, vocab))
    want, want_lr = _params(model), opt.param_groups[0]["lr"]

    # Fresh objects, with the weights scrambled so the load has to do the work.
    model2 = _build(tiny_path)
    with torch.no_grad():
        for p in model2.parameters():
            p.zero_()
    opt2, sched2 = _optim(model2)
    gen2, np_gen2 = torch.Generator().manual_seed(999), np.random.default_rng(999)
    random.seed(7), np.random.seed(7), torch.manual_seed(7)
    got = load_checkpoint(find_latest(tmp_path / "ckpt"), model2, opt2, sched2)
    assert {k: got[k] for k in ("step", "weight_version", "sampler")} == {k: extra[k] for k in ("step", "weight_version", "sampler")}
    restore_rng(got["rng"], {"rollout": gen2, "shuffle": np_gen2})
    assert random.random() == draws[0] and np.random.rand() == draws[1]
    assert torch.equal(torch.rand(3), draws[2]) and torch.equal(torch.rand(3, generator=gen2), draws[3])
    assert np_gen2.random() == draws[4]
    assert sched2.last_epoch == 2 and opt2.state_dict()["state"][0]["step"].item() == 2
    _step(model2, opt2, sched2, _batch(2, vocab))
    _assert_equal(want, _params(model2))
    assert opt2.param_groups[0]["lr"] == want_lr


def test_save_before_first_step_leaves_optimizer_untouched(tmp_path):
    model = torch.nn.Linear(4, 3)
    opt, sched = _optim(model)
    save_checkpoint(tmp_path, 0, model, opt, sched, {"step": 0}, keep_last=0)
    assert not opt.state, "saving must not run DCP's init step on the live optimizer"
    ref = torch.nn.Linear(4, 3)
    ref.load_state_dict(model.state_dict())
    ref_opt, ref_sched = _optim(ref)
    x = torch.randn(5, 4)
    for m, o, s in ((model, opt, sched), (ref, ref_opt, ref_sched)):
        o.zero_grad()
        m(x).pow(2).sum().backward()
        o.step()
        s.step()
    # A used optimizer loaded from the step-0 checkpoint ends up state-free again, at step 0's lr.
    load_checkpoint(tmp_path / "step_00000000", ref, ref_opt, ref_sched)
    assert not ref_opt.state and ref_opt.param_groups[0]["lr"] == pytest.approx(1e-2 / 3) and ref_sched.last_epoch == 0


# --------------------------------------------------------------------------- (2) find_latest
def test_find_latest_skips_partial_and_stale(tmp_path):
    root = tmp_path / "ckpt"
    assert find_latest(root) is None
    one = _touch_checkpoint(root, 1)
    _touch_checkpoint(root, 3, complete=False)                      # renamed without marker: impossible, still ignored
    _touch_checkpoint(root, 4, name=".tmp-step_00000004")           # a save in progress, even with a marker
    (root / LATEST).write_text("step_00000005\n")                  # points at a deleted dir
    assert find_latest(root) == one
    (root / LATEST).write_text("step_00000003\n")                  # points at an incomplete dir
    assert find_latest(root) == one
    two = _touch_checkpoint(root, 2)
    (root / LATEST).write_text("step_00000001\n")                  # crash between rename and `latest` update
    assert find_latest(root) == two
    (root / LATEST).write_text("../elsewhere/step_00000009\n")
    assert find_latest(root) == two
    with pytest.raises(CheckpointError) as ei:
        load_checkpoint(root / "step_00000003", torch.nn.Linear(2, 2))
    assert "step_00000003" in str(ei.value) and "\n" not in str(ei.value)


# --------------------------------------------------------------------------- (3) pruning, world size
def test_keep_last_prunes_only_older_complete(tmp_path):
    root = tmp_path / "ckpt"
    model = torch.nn.Linear(4, 2)
    opt, sched = _optim(model)
    stale = _touch_checkpoint(root, 2, name=".tmp-step_00000002")   # a crashed save
    for step in range(1, 6):
        _step_linear(model, opt, sched)
        save_checkpoint(root, step, model, opt, sched, {"step": step}, keep_last=2)
    names = sorted(p.name for p in root.iterdir() if p.is_dir())
    assert names == ["step_00000004", "step_00000005"] and not stale.exists()
    assert find_latest(root) == root / "step_00000005"
    save_checkpoint(root, 6, model, opt, sched, {"step": 6}, keep_last=0)
    assert sorted(p.name for p in root.iterdir() if p.is_dir()) == ["step_00000004", "step_00000005", "step_00000006"]
    # Re-saving an existing step replaces it.
    save_checkpoint(root, 6, model, opt, sched, {"step": 66}, keep_last=0)
    assert load_checkpoint(root / "step_00000006", model, opt, sched)["step"] == 66


def _step_linear(model, opt, sched):
    opt.zero_grad()
    model(torch.ones(3, 4)).pow(2).sum().backward()
    opt.step()
    sched.step()


def test_load_rejects_other_world_size_and_bad_extra(tmp_path):
    model = torch.nn.Linear(4, 2)
    opt, sched = _optim(model)
    ckpt = save_checkpoint(tmp_path, 1, model, opt, sched, {"step": 1}, keep_last=0)
    marker = json.loads((ckpt / COMPLETE).read_text())
    (ckpt / COMPLETE).write_text(json.dumps({**marker, "world_size": 2}))
    with pytest.raises(CheckpointError, match="written by 2 ranks but this run has 1") as ei:
        load_checkpoint(ckpt, model, opt, sched)
    assert str(ckpt) in str(ei.value) and "\n" not in str(ei.value)
    for bad in (object(), lambda: 0):
        with pytest.raises(CheckpointError, match="weights_only"):
            save_checkpoint(tmp_path, 2, model, opt, sched, {"obj": bad}, keep_last=0)
    assert not (tmp_path / "step_00000002").exists()
    (ckpt / COMPLETE).write_text(json.dumps(marker))
    with pytest.raises(CheckpointError, match="does not match this model") as ei:
        load_checkpoint(ckpt, torch.nn.Linear(5, 2))
    assert "\n" not in str(ei.value)


# --------------------------------------------------------------------------- (4) FSDP2, 2 ranks (gloo)
def _fsdp_worker(rank: int, world: int, model_path: str, out: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    import faulthandler
    faulthandler.enable(open(f"{out}/faults_rank{rank}.txt", "w"), all_threads=True)
    torch.set_num_threads(1)
    # A file store: no port to race for beside other test workers, and no TCP store thread on rank 0
    dist.init_process_group("gloo", init_method=f"file://{out}/store", rank=rank, world_size=world)
    # An explicit CPU mesh: fully_shard's default mesh is CUDA whenever a GPU is visible.
    mesh = init_device_mesh("cpu", (world,))
    try:
        # A failure on one rank (unsaveable extra on rank 1) raises on every rank, not a hang in a barrier.
        with pytest.raises(CheckpointError) as ei:
            save_checkpoint(Path(out) / "bad", 0, torch.nn.Linear(2, 2), None, None,
                            {"obj": object()} if rank == 1 else {}, keep_last=0)
        assert ("another rank" in str(ei.value)) == (rank == 0)
        assert find_latest(Path(out) / "bad") is None
        for lora in (False, True):
            def sharded():
                m = _build(model_path, lora=lora)
                layer_classes = set(getattr(m, "_no_split_modules", None) or [])
                for module in m.modules():
                    if type(module).__name__ in layer_classes:
                        fully_shard(module, mesh=mesh)
                fully_shard(m, mesh=mesh)
                assert all(isinstance(p, DTensor) for p in m.parameters())
                return m

            torch.manual_seed(0)  # LoRA init draws from the global RNG: same on every rank
            model = sharded()
            opt, sched = _optim(model)
            vocab = _vocab(model)
            root = Path(out) / ("lora" if lora else "full")
            _step(model, opt, sched, _batch(100 + rank, vocab))
            at_save = _params(model)
            ckpt = save_checkpoint(root, 1, model, opt, sched, {"rank": rank, "rng": capture_rng()}, keep_last=1)
            assert (ckpt / COMPLETE).exists() and {p.name for p in ckpt.glob("extra_rank*.pt")} == {"extra_rank0.pt", "extra_rank1.pt"}
            _step(model, opt, sched, _batch(200 + rank, vocab))
            want = _params(model)

            torch.manual_seed(1234)
            model2 = sharded()
            opt2, sched2 = _optim(model2)
            extra = load_checkpoint(find_latest(root), model2, opt2, sched2)
            assert extra["rank"] == rank
            _assert_equal(at_save, _params(model2))
            _step(model2, opt2, sched2, _batch(200 + rank, vocab))
            _assert_equal(want, _params(model2))
            if rank == 0:
                torch.save(at_save, Path(out) / f"{root.name}_at_save.pt")
            dist.barrier()
    finally:
        dist.destroy_process_group()
    # Every assertion has passed: leave without interpreter teardown, where gloo's worker threads can still be
    # releasing tensors and abort the process (SIGABRT, "terminate called without an active exception").
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


@pytest.fixture(scope="module")
def fsdp_run(tiny_path, tmp_path_factory):
    """Run the 2-rank FSDP2 save/resume once; later tests export its checkpoints."""
    import torch.multiprocessing as mp

    # A rank killed by a signal (a native crash inside gloo's threads on a loaded CPU, never a failed assertion: that
    # raises ProcessRaisedException) gets one fresh run; a second crash fails with each rank's native stack.
    for attempt in (1, 2):
        out = tmp_path_factory.mktemp("fsdp")
        try:
            mp.spawn(_fsdp_worker, args=(2, tiny_path, str(out)), nprocs=2, join=True)
            return out
        except mp.ProcessExitedException as e:
            stacks = "\n".join(f.read_text() for f in sorted(out.glob("faults_rank*.txt")))
            if e.signal_name is None or attempt == 2:
                raise AssertionError(f"{e}\n{stacks}") from e
            warnings.warn(f"two-rank FSDP2 run, attempt 1: {e}; running it again\n{stacks}")


def test_fsdp2_two_ranks_resume_is_bit_exact(fsdp_run):
    # The assertions ran inside both ranks; here: both runs published exactly one checkpoint.
    for name in ("full", "lora"):
        root = fsdp_run / name
        assert find_latest(root) == root / "step_00000001"
        assert json.loads((root / "step_00000001" / COMPLETE).read_text())["world_size"] == 2


def test_fsdp2_checkpoint_refuses_single_rank_resume_but_exports(fsdp_run, tiny_path, tmp_path):
    ckpt = fsdp_run / "full" / "step_00000001"
    with pytest.raises(CheckpointError, match="written by 2 ranks"):
        load_checkpoint(ckpt, _build(tiny_path))
    # ...but DCP reshards the 2-rank shards into one plain module for export.
    from transformers import AutoModelForCausalLM

    out = export_hf(ckpt, tmp_path / "hf", tiny_path, lora=None)
    exported = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    at_save = torch.load(fsdp_run / "full_at_save.pt", weights_only=True)
    _assert_equal(at_save, _params(exported))


def _nccl_engine_worker(rank: int, world: int, port: int, model_path: str, out: str) -> None:
    """The trainer's real path on GPUs: TrainingEngine (FSDP2, bf16 compute, fp32 masters) + NCCL + CUDA RNG."""
    import torch.distributed as dist

    from hybrid_rl.workers.fsdp_engine import TrainingEngine

    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, device_id=device)
    try:
        for lora in (False, True):
            def engine():
                e = TrainingEngine(_build(model_path, lora=lora), device, torch.bfloat16, trainable=True)
                e.configure_optimizer(1e-3, (0.9, 0.99), 0.01, 2, "cosine", 10, 0.1)
                return e

            def step(e, seed):
                e.zero_grad()
                ids = _batch(seed, _vocab(e.model)).to(device)
                e.model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
                e.optimizer_step(1.0)

            torch.manual_seed(0)
            eng = engine()
            gen = torch.Generator(device=device).manual_seed(10 + rank)
            step(eng, 100 + rank)
            root = Path(out) / ("lora" if lora else "full")
            extra = {"rank": rank, "weight_version": 1, "rng": capture_rng({"rollout": gen})}
            save_checkpoint(root, 1, eng.model, eng.optimizer, eng.scheduler, extra, keep_last=1)
            draws = (torch.rand(4, device=device), torch.rand(4, device=device, generator=gen))
            step(eng, 200 + rank)
            want, want_lr = _params(eng.model), eng.lr

            torch.manual_seed(1234)
            eng2 = engine()
            gen2 = torch.Generator(device=device).manual_seed(999)
            got = load_checkpoint(find_latest(root), eng2.model, eng2.optimizer, eng2.scheduler)
            assert got["rank"] == rank and got["weight_version"] == 1
            restore_rng(got["rng"], {"rollout": gen2})
            assert torch.equal(torch.rand(4, device=device), draws[0])
            assert torch.equal(torch.rand(4, device=device, generator=gen2), draws[1])
            step(eng2, 200 + rank)
            _assert_equal(want, _params(eng2.model))
            assert eng2.lr == want_lr
            dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_fsdp2_nccl_training_engine_resume_is_bit_exact(tiny_path, tmp_path):
    import torch.multiprocessing as mp

    mp.spawn(_nccl_engine_worker, args=(2, _free_port(), tiny_path, str(tmp_path)), nprocs=2, join=True)
    for name in ("full", "lora"):
        assert find_latest(tmp_path / name) == tmp_path / name / "step_00000001"


# --------------------------------------------------------------------------- (5) export
def _log_probs(model, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    with torch.no_grad():
        logits = model(input_ids=ids, use_cache=False).logits.float()
    lp = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    return logits, lp


def test_export_full_model_round_trip(tiny_path, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = _build(tiny_path)
    opt, sched = _optim(model)
    vocab = _vocab(model)
    for s in range(2):
        _step(model, opt, sched, _batch(s, vocab))
    ckpt = save_checkpoint(tmp_path / "ckpt", 2, model, opt, sched, {}, keep_last=0)
    out = export_hf(ckpt, tmp_path / "hf", tiny_path, lora=None)
    assert (out / "model.safetensors").exists() and (out / "config.json").exists()
    exported = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert AutoTokenizer.from_pretrained(out).chat_template
    ids = _batch(42, vocab, rows=3, length=16)
    (l1, lp1), (l2, lp2) = _log_probs(model.eval(), ids), _log_probs(exported, ids)
    assert (l1 - l2).abs().max() < 1e-6 and (lp1 - lp2).abs().max() < 1e-6
    with pytest.raises(CheckpointError, match="not empty"):
        export_hf(ckpt, out, tiny_path, lora=None)


def test_export_lora_via_cli_merged_and_adapters(tiny_path, tmp_path, capsys):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from hybrid_rl.config import load_config, save_config
    from hybrid_rl.export import main as export_main

    run = tmp_path / "run"
    cfg = load_config(None, ["model.path=builtin:tiny-qwen2", "model.lora.rank=4", "model.lora.alpha=8",
                             f"model.lora.target_modules={','.join(LORA_TARGETS)}", f"trainer.output_dir={run}"])
    save_config(cfg, run / "config.yaml")
    torch.manual_seed(0)
    model = _build(tiny_path, lora=True)
    opt, sched = _optim(model)
    vocab = _vocab(model)
    for s in range(3):
        _step(model, opt, sched, _batch(s, vocab))
    ckpt = save_checkpoint(run / "checkpoints", 3, model, opt, sched, {}, keep_last=0)
    model.eval()
    ids = _batch(7, vocab, rows=3, length=16)
    want_logits, want_lp = _log_probs(model, ids)
    base_logits, _ = _log_probs(_build(tiny_path), ids)
    assert (want_logits - base_logits).abs().max() > 1e-4, "the adapters should have moved the model"

    assert export_main(str(ckpt), str(tmp_path / "merged"), adapters_only=False) == 0
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32).eval()
    assert not any("lora" in n for n, _ in merged.named_parameters())
    logits, lp = _log_probs(merged, ids)
    assert (logits - want_logits).abs().max() < 1e-6 and (lp - want_lp).abs().max() < 1e-6

    assert export_main(str(run), str(tmp_path / "adapters"), adapters_only=True) == 0  # run dir → newest checkpoint
    assert (tmp_path / "adapters" / "adapter_model.safetensors").exists()
    assert not (tmp_path / "adapters" / "model.safetensors").exists()
    reloaded = PeftModel.from_pretrained(_build(tiny_path), tmp_path / "adapters").eval()
    logits, _ = _log_probs(reloaded, ids)
    assert (logits - want_logits).abs().max() < 1e-6

    capsys.readouterr()
    assert export_main(str(tmp_path / "nope"), str(tmp_path / "x"), adapters_only=False) == 2
    assert export_main(str(tmp_path / "ckpt_no_cfg" / "checkpoints"), str(tmp_path / "x"), adapters_only=False) == 2
    orphan = save_checkpoint(tmp_path / "orphan" / "ckpts", 1, torch.nn.Linear(2, 2), None, None, {}, keep_last=0)
    assert export_main(str(orphan), str(tmp_path / "x"), adapters_only=False) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 3 and all(line.startswith("error: ") for line in err)
    assert "does not exist" in err[0] and "config.yaml" in err[2]
