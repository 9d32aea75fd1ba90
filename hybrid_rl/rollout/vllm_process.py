"""The vLLM engine in a process of its own (``rollout.vllm.engine_process=true``): spawning it, and handing it tensors.

The engine core runs in a child process (vLLM's ``SyncMPClient`` over ZMQ; ``distributed_executor_backend="uni"``
in the child, which sees only this rank's GPU, and torchrun's variables are hidden from it while it is spawned:
``engine_process_env``). The trainer then shares no Python interpreter with the engine's scheduler and model
runner. A push sends each bucket as CUDA IPC handles (``cuda_ipc_handle``: the tensors stay where they are, the
child maps them with ``rebuild_ipc``, waits on the producer's event and copies them in through the model's
``load_weights``), which needs ``VLLM_ALLOW_INSECURE_SERIALIZATION=1`` (pickled handles and functions between the
trainer's own processes). The child is born with SIGTERM and SIGINT blocked (``signals_blocked``) and dies with
its parent (``_rpc_die_with_parent``).
"""

from __future__ import annotations

import contextlib
import os
from typing import Any, Callable

import torch


def cuda_ipc_handle(tensor: torch.Tensor) -> tuple[Callable[..., torch.Tensor], tuple]:
    """A picklable handle another process on the same GPU can open (``rebuild_ipc``): ``reduce_tensor``'s rebuild
    function and arguments. The tensor must stay alive, unchanged, until the other side has copied it."""
    from torch.multiprocessing.reductions import reduce_tensor

    if tensor.device.type != "cuda":
        raise ValueError(f"a CUDA IPC handle needs a CUDA tensor, got one on {tensor.device}")
    return reduce_tensor(tensor.detach())


_IPC_DEVICE_ARG = 6
"""Position of the storage's device index among ``rebuild_cuda_tensor``'s arguments (torch 2.x)."""


def rebuild_ipc(handle: tuple[Callable[..., torch.Tensor], tuple], device_index: int) -> torch.Tensor:
    """Open ``cuda_ipc_handle``'s handle in this process, with the device index it has here (the engine process
    sees only its GPU, as device 0, where the trainer may call it cuda:3)."""
    rebuild, args = handle
    args = list(args)
    args[_IPC_DEVICE_ARG] = device_index
    return rebuild(*args)


def _rpc_die_with_parent(worker: Any, parent_pid: int) -> bool:
    """Runs in an engine process: the kernel kills it when the trainer's process dies, however that happens (Linux
    ``PR_SET_PDEATHSIG``; False where it cannot be set). Its SIGTERM and SIGINT are blocked from birth
    (``signals_blocked``), so a signal to the whole process group stops the trainer's run gracefully instead of
    killing the engine under it; the trainer ends it (``shutdown``)."""
    import ctypes
    import signal

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        ok = libc.prctl(1, int(signal.SIGKILL), 0, 0, 0) == 0  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return False
    if ok and os.getppid() != parent_pid:  # the trainer died before the line above: go now
        os.kill(os.getpid(), signal.SIGKILL)
    return ok


_TORCHRUN_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                  "ROLE_RANK", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


_TORCHRUN_PREFIX = "TORCHELASTIC_"
"""...and every ``TORCHELASTIC_*`` variable: with torchrun's ``TORCHELASTIC_USE_AGENT_STORE=True`` a child's
``init_process_group`` connects to a store that nobody serves, and the engine process would wait in its
world-of-one set-up for ever."""


def torchrun_vars(env: Any) -> list[str]:
    """The names of torchrun's variables set in ``env``: hidden from an engine process."""
    return [k for k in env if k in _TORCHRUN_VARS or k.startswith(_TORCHRUN_PREFIX)]


def physical_gpu(device: torch.device, visible: str | None) -> str:
    """What ``CUDA_VISIBLE_DEVICES`` must say for a child process to see exactly ``device`` (this process's numbering,
    under this process's ``visible`` list, if any)."""
    index = device.index if device.index is not None else 0
    if not visible:
        return str(index)
    ids = [v.strip() for v in visible.split(",") if v.strip()]
    if index >= len(ids):
        raise RuntimeError(f"device {device} is not among CUDA_VISIBLE_DEVICES={visible!r}")
    return ids[index]


@contextlib.contextmanager
def engine_process_env(device: torch.device):
    """The environment while vLLM spawns the engine process: multiprocessing on, pickled handles allowed (kept on:
    every later call is serialised with it), only ``device`` visible, torchrun's variables hidden (the child is a
    world of one). Restored afterwards."""
    env = os.environ
    hidden = torchrun_vars(env)
    saved = {k: env.get(k) for k in ("VLLM_ENABLE_V1_MULTIPROCESSING", "CUDA_VISIBLE_DEVICES", *hidden)}
    env["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
    env["CUDA_VISIBLE_DEVICES"] = physical_gpu(device, saved["CUDA_VISIBLE_DEVICES"])
    for key in hidden:
        env.pop(key)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                env.pop(key, None)
            else:
                env[key] = value


@contextlib.contextmanager
def signals_blocked():
    """SIGTERM and SIGINT blocked in this thread (so in a process spawned from it, from birth: the mask survives fork
    and exec, and Python does not clear it); pending ones arrive when the block ends."""
    import signal

    if not hasattr(signal, "pthread_sigmask"):
        yield
        return
    old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)
