"""Checks, in seconds and before any rank starts, that a run can get what its recipe asks for.

Without them a missing piece shows up late: vLLM's absence after the model and data
have loaded, an uncached hub model on an offline machine after a minute of download
retries. ``preflight`` looks only at the config, the installed packages, the visible
GPUs, the file system and the local Hugging Face cache, and it reaches for the network
only once, with a short timeout, when a hub model or dataset is not cached. Each
failure is one ``PreflightError`` line naming the key and the fix. ``builtin:`` models
and ``synthetic:`` data pass without building anything. A local model directory must hold
a config and tokenizer files; ``reward.function`` is imported (a user's file runs here once)
and must take ``(response, ground_truth)``. On CUDA the memory planner (``hybrid_rl.planner``)
refuses a config predicted not to fit the GPU.

Left out on purpose: whatever needs the model or data loaded (a tokenizer without a
chat template, a malformed row, prompts that are too long) stays with the trainer,
which reports it as one line too; vLLM is checked for presence, not imported (that
takes seconds to tens of seconds and may touch the GPU).
"""

from __future__ import annotations

import functools
import importlib.util
import os
import socket
import sys
import threading
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Optional

from hybrid_rl.config import Config
from hybrid_rl.rollout import engine_info
from hybrid_rl.data.sources import FILE_LIKE, SYNTHETIC_PREFIX
from hybrid_rl.data.tasks import DataError

HUB_TIMEOUT_S = 3.0
"""How long the one connect to the hub (or the https proxy) may take before the hub counts as unreachable."""


class PreflightError(ValueError):
    """A recipe asks for something this machine cannot provide; the message says what to do."""


def validation_on(cfg: Config) -> bool:
    """Whether the run validates at all (only then does ``data.val_path`` matter)."""
    return cfg.trainer.test_freq > 0 or cfg.trainer.val_before_train or cfg.trainer.val_only


def preflight(cfg: Config, nproc: int = 1) -> None:
    """Raise a one-line user error for the first thing ``cfg`` needs that is missing.

    ``nproc`` is the number of processes on this machine (torchrun's ``--nproc_per_node``).
    """
    check_rollout_engine(cfg)
    check_devices(cfg, nproc)
    check_model(cfg)
    check_sequence_length(cfg)
    check_data(cfg)
    check_reward(cfg)
    check_outputs(cfg)
    check_gpu_memory(cfg, nproc)


# --------------------------------------------------------------------------- engine, devices
def pip_command() -> str:
    """pip for the interpreter running this: ``.venv/bin/pip`` in the checkout's venv, else ``<python> -m pip``."""
    venv = Path(__file__).resolve().parents[1] / ".venv"
    if Path(sys.prefix).resolve() == venv.resolve():
        rel = os.path.relpath(venv / "bin" / "pip")
        return rel if not rel.startswith("..") else str(venv / "bin" / "pip")
    return f"{sys.executable} -m pip"


def check_rollout_engine(cfg: Config) -> None:
    """The package the engine ``rollout.name`` picks needs (its ``EngineInfo``) is installed."""
    name, info = cfg.rollout.name, engine_info(cfg.rollout.name)
    if info.package is None or importlib.util.find_spec(info.package) is not None:
        return
    import torch

    from hybrid_rl.models import ModelLoadError

    install = f"{pip_command()} install -e '.[{info.pip_extra}]'"
    if not info.gpu_only or torch.cuda.device_count() > 0:
        raise ModelLoadError(f"rollout.name={name} needs {info.package_label}: {install} (tested: {info.tested_with}), "
                             f"or use rollout.name=hf")
    # no GPU either: rollout.name=hf only helps where the model is here; a hub model needs the hub or a copy
    if _model_is_here(cfg.model.path):
        fix = "with rollout.name=hf it runs on CPU (the transformers engine)"
    else:
        fix = f"its model.path={cfg.model.path!r} also needs hub access or a local copy (point model.path at it)"
    raise PreflightError(f"this recipe generates with {info.package_label} (rollout.name={name}), which needs NVIDIA "
                         f"GPUs and {info.package_label} ({install}), and this machine has no CUDA GPU; {fix}; to try "
                         f"hybrid_rl on CPU, run `make train` (recipes/cpu_successor.yaml: a built-in tiny model, no "
                         f"download)")


def _model_is_here(path: str) -> bool:
    """A built-in, a local directory or a model in the Hugging Face cache: loadable without the network."""
    from hybrid_rl.models import BUILTIN_PREFIX

    return path.startswith(BUILTIN_PREFIX) or Path(path).expanduser().exists() or _hub_cached(path, "model", "config.json")


def check_devices(cfg: Config, nproc: int) -> None:
    device = cfg.trainer.device
    if device == "cpu":
        return
    import torch

    gpus = torch.cuda.device_count()
    if device == "cuda" and gpus == 0:
        build = "a CPU-only build" if torch.version.cuda is None else f"built for CUDA {torch.version.cuda}"
        raise PreflightError(f"trainer.device=cuda but no CUDA GPU is visible (torch {torch.__version__} is {build}); "
                             f"set trainer.device=cpu or auto, or run on a GPU machine")
    if 0 < gpus < nproc:
        raise PreflightError(f"{nproc} processes need one GPU each (trainer.device={device}) but {gpus} GPU(s) are "
                             f"visible; launch {gpus} (make train GPUS={gpus}, or --nproc {gpus})")


def check_gpu_memory(cfg: Config, nproc: int) -> None:
    """The config's predicted peak fits this GPU (``hybrid_rl.planner.check``; CUDA and ``trainer.check_memory`` only)."""
    from hybrid_rl.planner.check import check_memory

    refusal = check_memory(cfg, nproc)
    if refusal:
        raise PreflightError(refusal)


# --------------------------------------------------------------------------- model
def check_model(cfg: Config) -> None:
    """``model.path`` (and ``model.tokenizer_path``) name a built-in, a local directory holding a config and a
    tokenizer, or a hub model that is cached or reachable."""
    from hybrid_rl.models import check_model_dir

    m = cfg.model
    _check_model_path(m.path, "model.path", "config.json")
    check_model_dir(m.path, "model.path", "model")
    if m.tokenizer_path:
        _check_model_path(m.tokenizer_path, "model.tokenizer_path", "tokenizer_config.json")
    tokenizer_key = "model.tokenizer_path" if m.tokenizer_path else "model.path"
    check_model_dir(m.tokenizer_path or m.path, tokenizer_key, "tokenizer")
    if m.chat_template is not None:
        check_chat_template(m.chat_template)


def check_chat_template(value: str) -> None:
    """``model.chat_template`` is readable and parses as Jinja (the ranks render it with the tokenizer)."""
    import jinja2

    from hybrid_rl.models import ModelLoadError, read_chat_template

    text = read_chat_template(value)
    try:
        jinja2.Environment().parse(text)
    except jinja2.TemplateSyntaxError as e:
        raise ModelLoadError(f"model.chat_template: not a valid Jinja template ({e.message}, line {e.lineno}); "
                             f"fix the template") from None


def _check_model_path(path: str, key: str, marker: str) -> None:
    from hybrid_rl.models import BUILTIN_NAMES, BUILTIN_PREFIX, ModelLoadError, builtin_unbuildable, check_local_path

    if path.startswith(BUILTIN_PREFIX):  # built on first use by the ranks; here the name and the cache are checked
        known = list(BUILTIN_NAMES)
        if path[len(BUILTIN_PREFIX):] not in known:
            raise ModelLoadError(f"{key}: unknown built-in model {path[len(BUILTIN_PREFIX):]!r}; "
                                 f"choose one of {[BUILTIN_PREFIX + k for k in known]}")
        problem = builtin_unbuildable(path)
        if problem:
            raise ModelLoadError(problem)
        return
    check_local_path(path, key)  # the loader's own message for a local-looking path that is missing
    if Path(path).expanduser().exists() or _hub_cached(path, "model", marker):
        return
    why = hub_unreachable()
    if why:
        raise PreflightError(f"{key}={path!r} is neither a local directory nor in the Hugging Face cache "
                             f"({_hub_cache()}), and the hub is unreachable ({why}); point {key} at a local model "
                             f"directory, use a built-in model ({key}=builtin:tiny-qwen2), or download it with network "
                             f"access (hf download {path})")


def check_sequence_length(cfg: Config) -> None:
    """A prompt and a response together fit the positions the model was built for (``max_position_embeddings``,
    read from its config or a built-in's table, no weights loaded); a model whose config cannot be read here passes."""
    from hybrid_rl.planner.shape import ShapeError, read_shape

    d = cfg.data
    try:
        positions = read_shape(cfg.model.path).positions
    except (ShapeError, OSError, ValueError):
        return
    full = d.max_prompt_length + d.max_response_length
    if positions is not None and full > positions:
        room = positions - d.max_prompt_length
        fix = (f"lower data.max_response_length to at most {room}" if room > 0 else
               f"lower data.max_prompt_length and data.max_response_length")
        raise PreflightError(f"data.max_prompt_length + data.max_response_length = {d.max_prompt_length} + "
                             f"{d.max_response_length} = {full} tokens, more than the {positions} positions of "
                             f"model.path={cfg.model.path!r} (max_position_embeddings in its config); {fix} (or use a "
                             f"model built for longer sequences)")


# --------------------------------------------------------------------------- data
def check_data(cfg: Config) -> None:
    d = cfg.data
    keys = ["train_path"] + (["val_path"] if d.val_path and validation_on(cfg) else [])
    for key in keys:
        value = getattr(d, key)
        paths = value if isinstance(value, list) else [value]
        for i, path in enumerate(paths):
            _check_data_path(path, f"data.{key}" if len(paths) == 1 else f"data.{key}[{i}]")


def _check_data_path(path: str, key: str) -> None:
    if path.startswith(SYNTHETIC_PREFIX):  # generated by the ranks in milliseconds; they check the name
        return
    local = Path(path).expanduser()
    if local.exists():
        return
    if local.suffix.lower() in FILE_LIKE or path.startswith((".", "/", "~")):
        # the same words as the loader's, so the message does not depend on who caught it
        raise DataError(f"{key}={path!r}: no such file; fix {key} to point at an existing .jsonl/.parquet file")
    if _hub_cached(path, "dataset", None) or _datasets_cache_has(path):
        return
    why = hub_unreachable(datasets=True)
    if why:
        raise PreflightError(f"{key}={path!r} is neither a local file nor a cached hub dataset, and the hub "
                             f"is unreachable ({why}); point {key} at a local .jsonl/.parquet file, use "
                             f"{key}=synthetic:successor with data.task=successor, or run once with network access "
                             f"so that the datasets library caches it")


# --------------------------------------------------------------------------- reward
def check_reward(cfg: Config) -> None:
    """``reward.function`` and each of ``reward.extra_functions`` resolve (module or file imports, the function
    exists) and can be called as samples are scored: caught here rather than at the first reward, after the model
    has loaded."""
    from hybrid_rl.rewards.weighted import check_functions

    check_functions(cfg.reward, cfg.data.task)
    if cfg.reward.remote.url is not None:
        from hybrid_rl.rewards.remote import RemoteReward

        RemoteReward(cfg.reward.remote)  # the URL's form; the server is reached at the first reward


# --------------------------------------------------------------------------- outputs
def check_outputs(cfg: Config) -> None:
    """``trainer.validation_data_dir`` can be created (a file in its way, or an unwritable parent, fails here rather
    than at the first validation, after minutes of start-up); nothing is created."""
    d = cfg.trainer.validation_data_dir
    if not d or not validation_on(cfg):
        return
    path = Path(cfg.trainer.output_dir).expanduser() / d
    existing = path
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    problem = ("is a file" if not existing.is_dir() else
               "is not writable" if not os.access(existing, os.W_OK | os.X_OK) else None)
    if problem:
        raise PreflightError(f"trainer.validation_data_dir={d!r}: cannot create {path} ({existing} {problem}); point "
                             f"it at a writable directory, or set it to '' to stop writing validation samples")


# --------------------------------------------------------------------------- the hub and its caches
def _hub_cache() -> str:
    from huggingface_hub import constants

    return constants.HF_HUB_CACHE


def _hub_cached(repo_id: str, repo_type: str, marker: Optional[str]) -> bool:
    """A snapshot of ``repo_id`` in the hub cache (holding ``marker`` when given)."""
    from huggingface_hub import constants, try_to_load_from_cache
    from huggingface_hub.file_download import repo_folder_name

    try:
        if marker is not None:
            return isinstance(try_to_load_from_cache(repo_id, marker, repo_type=repo_type), str)
        snapshots = Path(constants.HF_HUB_CACHE) / repo_folder_name(repo_id=repo_id, repo_type=repo_type) / "snapshots"
        return snapshots.is_dir() and any(snapshots.iterdir())
    except Exception:  # an id the hub would reject is simply not cached
        return False


def _datasets_cache_has(name: str) -> bool:
    """``datasets`` keeps prepared hub datasets as ``<cache>/<namespace>___<name>``, readable offline."""
    from huggingface_hub import constants

    root = Path(os.environ.get("HF_DATASETS_CACHE") or Path(constants.HF_HOME) / "datasets").expanduser()
    folder = root / "___".join(name.split("/"))
    return folder.is_dir() and any(folder.iterdir())


def _env_true(name: str) -> bool:
    return os.environ.get(name, "").strip().upper() in {"1", "ON", "YES", "TRUE"}


def hub_unreachable(datasets: bool = False) -> Optional[str]:
    """Why the hub cannot be reached, or None when a connection to it opens."""
    from huggingface_hub import constants

    for flag in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE") + (("HF_DATASETS_OFFLINE",) if datasets else ()):
        if _env_true(flag):
            return f"{flag}=1 is set"
    if constants.HF_HUB_OFFLINE:
        return "HF_HUB_OFFLINE is set"
    return _probe(constants.ENDPOINT)


@functools.lru_cache(maxsize=None)
def _probe(endpoint: str) -> Optional[str]:
    url = urllib.parse.urlsplit(endpoint)
    host, port = url.hostname or "huggingface.co", url.port or (443 if url.scheme == "https" else 80)
    proxy = urllib.request.getproxies().get(url.scheme)
    if proxy and not urllib.request.proxy_bypass(host):
        p = urllib.parse.urlsplit(proxy if "://" in proxy else "http://" + proxy)
        host, port = p.hostname or host, p.port or 8080
    outcome: list[Optional[BaseException]] = []

    def connect() -> None:
        try:
            socket.create_connection((host, port), timeout=HUB_TIMEOUT_S).close()
            outcome.append(None)
        except OSError as e:
            outcome.append(e)

    # in a thread, because name resolution has no timeout of its own
    t = threading.Thread(target=connect, daemon=True)
    t.start()
    t.join(HUB_TIMEOUT_S + 0.5)
    if not outcome:
        return f"no connection to {host}:{port} within {HUB_TIMEOUT_S:g} s"
    if outcome[0] is not None:
        return f"cannot connect to {host}:{port}: {outcome[0]}"
    return None
