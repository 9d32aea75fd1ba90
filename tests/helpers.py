"""Helpers shared by more than one test module; fixtures stay in ``conftest.py``.

Import them as ``from helpers import ...``: pytest puts ``tests/`` (the folder of the root
``conftest.py``) on ``sys.path``, so this works from every subfolder. A helper used by one
module only stays in that module.

- ``make_cfg``, ``cpu_dist``: a small CPU config and a world-of-one ``DistInfo`` for in-process tests.
- ``chat_prompts``, ``actor_params``, ``generate_batch``, ``score_batch``: drive one
  ``ActorRolloutRefWorker`` on the tiny model (prompts -> rollout -> scores/advantages -> update).
- ``ROOT``, ``subprocess_env``, ``run_checked``: launch ``python``/``torchrun`` from the checkout and
  fail with the tail of its output (one retry when torchrun's free port was taken).
- ``train_until_learned``: a training run stopped (SIGTERM, the trainer's clean stop) once its reward has
  reached the learning tests' bar, so that a learning curve costs the steps it needs, not the recipe's length.
- ``liger_patched``: the modules whose ``forward`` Liger's kernels replaced (``model.use_liger``).
- ``unwritable_dir``: a directory this user cannot write (mode 0555; for root, whom modes do not stop, the
  immutable attribute), made writable again on exit.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from concurrent.futures import Future
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

import torch

if TYPE_CHECKING:
    from hybrid_rl.batch import Batch

ROOT = Path(__file__).resolve().parents[1]  # the checkout


# --------------------------------------------------------------------------- in-process config and dist
def make_cfg(*overrides: str):
    """A small CPU config for in-process tests."""
    from hybrid_rl.config import load_config

    base = ["trainer.device=cpu", "model.dtype=float32", "data.max_response_length=6", "rollout.n=4",
            "data.train_batch_size=4", "actor.ppo_mini_batch_size=4", "actor.ppo_micro_batch_size_per_device=16",
            "actor.lr=1e-3", "trainer.logger=[jsonl]"]
    return load_config(None, base + list(overrides)).validate()


def cpu_dist():
    from hybrid_rl.distributed import DistInfo

    return DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))


# --------------------------------------------------------------------------- one worker: prompts -> rollout -> scores
def chat_prompts(worker, texts=("7", "Hello there, 12+5=?", "3", "a longer prompt with several words")) -> Batch:
    from hybrid_rl.data import collate_prompts

    tok = worker.tokenizer
    items = [dict(input_ids=tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True,
                                                    tokenize=True, return_dict=False),
                  ground_truth="8", data_source="successor", index=i) for i, t in enumerate(texts)]
    return collate_prompts(items, tok.pad_token_id)


def actor_params(worker) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in worker.actor.model.named_parameters()}


def generate_batch(worker, prompts=None) -> Batch:
    with worker.rollout_mode():
        return worker.generate(prompts if prompts is not None else chat_prompts(worker))


def score_batch(worker, batch: Batch, seed: int = 0) -> Batch:
    from hybrid_rl.phases.advantage import compute_advantage
    from hybrid_rl.phases.reward import sparse_scores

    g = torch.Generator().manual_seed(seed)
    scores = torch.randint(0, 2, (len(batch),), generator=g).float()
    batch = batch.union(tensors=dict(token_level_scores=sparse_scores(scores, batch["response_mask"]), scores=scores))
    batch = worker.compute_log_prob(batch)
    batch, _ = compute_advantage(batch, worker.cfg.algorithm)
    return batch


# --------------------------------------------------------------------------- file system
@contextmanager
def unwritable_dir(path: Path) -> Iterator[Path]:
    """Create ``path`` as a directory this process (and its children) cannot create anything in, for the ``with``
    block. Where this machine offers no way to (root on a file system without ``chattr +i``), the test is skipped
    with the reason."""
    import pytest

    path.mkdir(parents=True)
    if os.geteuid() != 0:
        path.chmod(0o555)
        undo = [["chmod", "755", str(path)]]
    else:
        made = subprocess.run(["chattr", "+i", str(path)], capture_output=True, text=True)
        if made.returncode != 0:
            pytest.skip(f"running as root, and chattr +i {path} failed ({made.stderr.strip()}): no directory here "
                        f"is unwritable for this user")
        undo = [["chattr", "-i", str(path)]]
    try:
        if os.access(path, os.W_OK):
            pytest.skip(f"{path} stays writable for this user")
        yield path
    finally:
        for cmd in undo:
            subprocess.run(cmd, check=True)


# --------------------------------------------------------------------------- subprocesses from the checkout
def subprocess_env(**extra: str) -> dict[str, str]:
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), **extra)


_RENDEZVOUS_ERRORS = ("address already in use", "EADDRINUSE", "DistNetworkError", "RendezvousConnectionError")


def run_checked(cmd: list[str], timeout: int = 300, **env: str) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, cwd=ROOT, env=subprocess_env(**env), capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0 and any(e in proc.stderr for e in _RENDEZVOUS_ERRORS):
        # torchrun --standalone picks a free port that another process can grab first: launch once more
        proc = subprocess.run(cmd, cwd=ROOT, env=subprocess_env(**env), capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} exited with {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return proc


def trailing_means(rewards: list[float], window: int = 3) -> list[float]:
    return [sum(rewards[i - window:i]) / window for i in range(window, len(rewards) + 1)]


def train_until_learned(cmd: list[str], out: Path, bar: float = 0.8, window: int = 3, timeout: int = 1500,
                        val_bar: float | None = None, **env: str) -> list[dict]:
    """Run ``cmd`` (a ``train`` writing ``out/metrics.jsonl``) until the mean ``reward/mean`` of its last ``window``
    steps is ≥ ``bar`` (and, with ``val_bar``, its latest ``val/reward_mean`` is ≥ ``val_bar``), then send SIGTERM
    to its process group: the trainer finishes the step and exits. Returns every metrics row written. A run that
    ends by itself must exit 0 (it may end without reaching the bar: the caller's assertion then fails with the
    curve)."""
    out.mkdir(parents=True, exist_ok=True)
    metrics = out / "metrics.jsonl"
    with open(out / "test_stdout.txt", "w") as so, open(out / "test_stderr.txt", "w") as se:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=subprocess_env(**env), stdout=so, stderr=se,
                                start_new_session=True)
        deadline, stopped = time.monotonic() + timeout, False
        try:
            while proc.poll() is None:
                if time.monotonic() > deadline:
                    raise AssertionError(f"{' '.join(cmd)} ran past {timeout} s")
                rows = _rows(metrics)
                rewards = [r["reward/mean"] for r in rows if "reward/mean" in r]
                vals = [r["val/reward_mean"] for r in rows if "val/reward_mean" in r]
                val_ok = val_bar is None or (len(vals) > 1 and vals[-1] >= val_bar)
                if not stopped and val_ok and any(m >= bar for m in trailing_means(rewards, window)):
                    os.killpg(proc.pid, signal.SIGTERM)
                    stopped = True
                time.sleep(0.5)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    if proc.returncode != 0 and not stopped:
        raise AssertionError(f"{' '.join(cmd)} exited with {proc.returncode}:\n"
                             f"{(out / 'test_stderr.txt').read_text()[-6000:]}")
    return _rows(metrics)


def _rows(path: Path) -> list[dict]:
    if not path.exists():
        return []
    lines = path.read_text().splitlines()
    rows = []
    for line in lines:
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:  # a line being written
            break
    return rows


class LazyFuture:
    """The round runs when the trainer takes it (after arming the interrupt): a deterministic interleaving."""

    def __init__(self, fn, *args):
        self.fn, self.args, self.done = fn, args, None

    def result(self):
        if self.done is None:
            self.done = (self.fn(*self.args),)
        return self.done[0]


class LazyExecutor:
    """Stands in for the rollout thread's executor: a submitted round runs when its result is asked for, i.e. when
    the trainer takes it (after arming the interrupt): the order of events of a trainer that is always faster than
    the engine, made deterministic (partial rollouts' tests; ``tests/integration/lazy_rounds.py`` under torchrun)."""

    def submit(self, fn, *args):
        class Lazy(Future):
            def result(self, timeout=None):
                if not self.done():
                    self.set_result(fn(*args))
                return super().result(timeout)

        return Lazy()

    def shutdown(self, wait: bool = True) -> None:
        pass


# --------------------------------------------------------------------------- gradients, and one actor pass on a GPU
def grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter's gradient, detached (float32), whole (an FSDP2 shard is gathered)."""
    out = {}
    for n, p in model.named_parameters():
        if p.grad is not None:
            g = p.grad.detach()
            out[n] = (g.full_tensor() if hasattr(g, "full_tensor") else g).float().clone()
    return out


@contextmanager
def grads_at_step(engine, read=grads) -> Iterator[list[dict[str, torch.Tensor]]]:
    """Within it, every ``engine.optimizer_step`` first records ``read(engine.model)``: the gradients each step
    takes, which the step then frees. Yields the list of records, one per step, in order."""
    steps: list[dict[str, torch.Tensor]] = []
    step = engine.optimizer_step

    def recording(*args, **kwargs):
        steps.append(read(engine.model))
        return step(*args, **kwargs)

    engine.optimizer_step = recording
    try:
        yield steps
    finally:
        del engine.optimizer_step  # the instance attribute: the method again


def update_grads(worker, batch: Batch) -> dict[str, torch.Tensor]:
    """``worker.update_actor(batch)``, and the gradients (``grads``) its last optimizer step took."""
    with grads_at_step(worker.actor) as steps:
        worker.update_actor(batch)
    assert steps, "the update took no optimizer step"
    return steps[-1]


def assert_close_grads(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], rel: float = 1e-5) -> None:
    """The same parameters, each gradient within ``rel`` of its largest entry."""
    assert a.keys() == b.keys() and len(a) > 10
    for n in a:
        scale = max(float(a[n].abs().max()), 1e-12)
        assert float((a[n] - b[n]).abs().max()) <= rel * scale + 1e-9, n


GPU_PROMPTS = ("7", "a longer prompt with several words", "3", "12+5=?")


def gpu_actor_pass(*overrides: str, batch: Batch | None = None):
    """(worker, batch, masked log-probs, gradients) of one bf16 actor forward + backward on cuda:0, on ``batch`` or a
    fresh ragged rollout of ``GPU_PROMPTS`` (the GPU parity tests compare two configurations on one batch)."""
    from hybrid_rl.distributed import DistInfo
    from hybrid_rl.workers.actor_rollout_ref import ActorRolloutRefWorker

    cuda_world_of_one()  # FSDP2 over a world of one, as torchrun runs it: bf16 activations, the varlen kernel
    torch.manual_seed(0)
    cfg = make_cfg("trainer.device=cuda", "model.dtype=bfloat16", "data.max_response_length=24",
                   "rollout.forced_lengths=lognormal:12:0.8", *overrides)
    w = ActorRolloutRefWorker(cfg, DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cuda", 0)))
    if batch is None:
        batch = generate_batch(w, chat_prompts(w, GPU_PROMPTS))
    lp, ent = w.actor.forward(batch, 1.0, with_entropy=True)
    m = batch["response_mask"].to(lp.device).float()
    ((lp * m).sum() + 0.1 * (ent * m).sum()).backward()
    return w, batch, lp * m, grads(w.actor.model)


def assert_bf16_parity(batch: Batch, lp_a: torch.Tensor, lp_b: torch.Tensor, g_a: dict, g_b: dict) -> None:
    """Two bf16 passes agree: log-probs within bf16 noise, every gradient pointing the same way."""
    m = batch["response_mask"].bool().to(lp_a.device)
    diff = (lp_a - lp_b).abs()[m]
    assert diff.mean() < 0.02 and diff.max() < 0.2, (float(diff.mean()), float(diff.max()))
    assert set(g_a) == set(g_b)
    cos = [torch.nn.functional.cosine_similarity(g_a[n].flatten(), g_b[n].flatten(), dim=0) for n in g_a]
    assert min(float(c) for c in cos) > 0.98


def liger_patched(model: torch.nn.Module) -> list[str]:
    """Names of the modules whose ``forward`` Liger replaced on the instance (``model.use_liger``)."""
    return [name for name, m in model.named_modules()
            if "forward" in vars(m) and getattr(vars(m)["forward"], "__module__", "").startswith("liger_kernel")]


class AfterPolls:
    """An interrupt flag that reads as set from its (m+1)-th poll on (the engines poll once per decoding step)."""

    def __init__(self, m: int):
        self.m, self.polls = m, 0

    def is_set(self) -> bool:
        self.polls += 1
        return self.polls > self.m


def cuda_world_of_one():
    """torch.distributed on cuda:0 as a world of one when pytest is not under torchrun (a free port found here)."""
    import socket

    from hybrid_rl.distributed import init_distributed

    if "MASTER_ADDR" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    return init_distributed("cuda")


def vllm_hybrid(tmp_path_factory, overrides: list[str], free_cache_engine: bool, sleep_level: int):
    """trainer (FSDP2, a world of one on cuda:0) + vLLM engine + sharding manager, as the worker builds them, on a random
    model of Qwen2.5-0.5B's shape (EOS 151645, pad 151643) for the vLLM GPU tests; ``overrides`` go to the config
    after the shared ones. Returns (actor, engine, sm, version, dist, cfg); the caller shuts the engine down."""
    from types import SimpleNamespace

    from hybrid_rl.config import load_config
    from hybrid_rl.models import RANDOM_ARCHS, load_causal_lm, write_random_model
    from hybrid_rl.rollout import vllm as vr
    from hybrid_rl.weights.sharding_manager import ShardingManager
    from hybrid_rl.workers.fsdp_engine import TrainingEngine

    eos, pad = 151645, 151643
    dist = cuda_world_of_one()
    path = write_random_model(tmp_path_factory.mktemp("qwen25_05b_arch"), RANDOM_ARCHS["qwen2.5-0.5b-random"],
                              dist.device, eos_token_id=eos, pad_token_id=pad)
    cfg = load_config(None, [f"model.path={path}", "model.dtype=bfloat16", "trainer.device=cuda", "rollout.name=vllm",
                             "rollout.vllm.enforce_eager=true", "rollout.max_num_seqs=64", "rollout.vllm.max_model_len=256",
                             "data.max_prompt_length=64", *overrides])
    actor = TrainingEngine(load_causal_lm(str(path), torch.float32), dist.device, torch.bfloat16, trainable=True)
    actor.configure_optimizer(1e-3, (0.9, 0.999), 0.0, 0, "constant", 100, 0.0)
    engine = vr.VLLMRolloutEngine.from_config(cfg, dist, SimpleNamespace(eos_token_id=eos, pad_token_id=pad))
    version = [0]
    sm = ShardingManager(actor, engine, lambda: version[0], dtype=torch.bfloat16, bucket_mb=256,
                         free_cache_engine=free_cache_engine, sleep_level=sleep_level, replay=engine.in_process)
    return SimpleNamespace(actor=actor, engine=engine, sm=sm, version=version, dist=dist, cfg=cfg)


def require_vllm_gpu():
    """At the top of a vLLM GPU test module: skip it without CUDA or vllm, set vLLM's in-process, offline
    environment (unless already set), and return the vllm module."""
    import pytest

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU", allow_module_level=True)
    for key, value in {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_USE_FLASHINFER_SAMPLER": "0",
                       "VLLM_NO_USAGE_STATS": "1", "HF_HUB_OFFLINE": "1"}.items():
        os.environ.setdefault(key, value)
    return pytest.importorskip("vllm")


def actor_step(h, loss) -> None:
    """One real AdamW step of ``vllm_hybrid``'s actor on ``loss()`` and a version bump (the next push moves the
    engine)."""
    h.actor.model.train()
    h.actor.zero_grad()
    loss().backward()
    _, stepped = h.actor.optimizer_step(grad_clip=1.0)
    assert stepped
    h.version[0] += 1


def raise_sampled_log_probs(h, batch: Batch) -> None:
    """``actor_step`` raising the sampled tokens' log-probs."""
    mask = batch.tensors["response_mask"]
    actor_step(h, lambda: -(h.actor.forward(batch, 1.0)[0] * mask).sum() / mask.sum())


# --------------------------------------------------------------------------- shared by the vLLM GPU test modules
def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> float:
    mask = mask.float()
    return float((x.float() * mask).sum() / mask.sum().clamp(min=1))


def random_token_prompts(num: int, lo: int, hi: int, seed: int, pad: int = 151643) -> Batch:
    """Left-padded random prompts of lengths in [lo, hi] over Qwen2.5's vocabulary (``vllm_hybrid``'s model)."""
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(lo, hi + 1, (num,), generator=g)
    ids = torch.full((num, hi), pad, dtype=torch.long)
    mask = torch.zeros((num, hi), dtype=torch.long)
    for i, n in enumerate(lens.tolist()):
        ids[i, hi - n:] = torch.randint(0, 150000, (n,), generator=g)
        mask[i, hi - n:] = 1
    from hybrid_rl.batch import Batch

    return Batch({"input_ids": ids, "attention_mask": mask})


def trainer_logprobs(h, batch: Batch, temperature: float) -> torch.Tensor:
    """``vllm_hybrid``'s trainer log-probs of the batch's responses at ``temperature``."""
    lp, _ = h.actor.compute_log_prob(batch, 16, temperature)
    return lp


def engine_score(engine, batch: Batch) -> torch.Tensor:
    """T=1 log-probs of the batch's response tokens under the engine's current weights, via vLLM's
    prompt log-probs of prompt+response (test-only: the product never scores given tokens)."""
    import vllm

    ids, am = batch.tensors["input_ids"].cpu(), batch.tensors["attention_mask"].cpu().bool()
    rmask = batch.tensors["response_mask"].cpu()
    seqs = [row[m].tolist() for row, m in zip(ids, am)]
    sp = vllm.SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0, detokenize=False)
    outs = engine.llm.generate([{"prompt_token_ids": s} for s in seqs], sp, use_tqdm=False)
    scores = torch.zeros(rmask.shape, dtype=torch.float32)
    for i, (o, s) in enumerate(zip(outs, seqs)):
        n = int(rmask[i].sum())
        plps = o.prompt_logprobs
        scores[i, :n] = torch.tensor([plps[j][s[j]].logprob for j in range(len(s) - n, len(s))])
    return scores.to(batch.tensors["responses"].device)


def expected_engine_weight(pushed: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    """What vLLM's parameter ``name`` must hold after a push of the HF-named ``pushed`` tensors (q/k/v and gate/up
    fused along dim 0; vocabulary padding rows aside)."""
    fused = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
    for fused_name, parts in fused.items():
        if f".{fused_name}." in name:
            return torch.cat([pushed[name.replace(fused_name, p)] for p in parts], dim=0)
    return pushed[name]


def old_split_groups(n_rollout: int):
    """Split placement's groups as ``split.make_layout`` made them before the fix (every rank created the
    gloo weight-metadata group, NCCL groups connected at their first collective): what hung 2 + 2 and 1 + 3 on CUDA.
    For ``gpu/split_groups_probe.py --unpatched`` and the CPU replay in ``unit/test_split_groups.py``."""
    import torch.distributed as dist

    from hybrid_rl.modes.split import SplitLayout

    world, rank = dist.get_world_size(), dist.get_rank()
    rollout, trainer = list(range(n_rollout)), list(range(n_rollout, world))
    backend = dist.get_backend()
    groups = [dist.new_group(trainer, backend=backend), dist.new_group(rollout, backend=backend),
              dist.new_group(list(range(world)), backend="gloo")]
    bcast = [n_rollout, *rollout]
    groups += [dist.new_group(bcast, backend=backend), dist.new_group(bcast, backend="gloo")]
    return SplitLayout(rank, n_rollout, world, *groups)


def fsdp_params(model: torch.nn.Module) -> list:
    """FSDP2's own per-parameter records (``FSDPParam``: ``sharded_param`` whatever the module holds now) of every
    FSDP module in ``model``; torch keeps them in one group per module (``_fsdp_param_group``) or, newer, a list."""
    from torch.distributed.fsdp import FSDPModule

    out = []
    for m in model.modules():
        if isinstance(m, FSDPModule):
            state = m._get_fsdp_state()
            groups = getattr(state, "_fsdp_param_groups", None)
            if groups is None:
                groups = [g for g in [getattr(state, "_fsdp_param_group", None)] if g is not None]
            out += [fp for g in groups for fp in g.fsdp_params]
    return out
