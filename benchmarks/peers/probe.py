"""What took effect inside each framework's processes: the attention implementation that ran, packed rows, Liger.

A framework's options say what was asked for; this says what ran. Each framework's run gets a folder on its
``PYTHONPATH`` holding a ``sitecustomize.py`` (Python's start-up hook, so verl's Ray workers and TRL's accelerate ranks
load it too; no framework code is touched) that starts ``start()`` here when ``HYBRID_RL_PEERS_PROBE_DIR`` is set.
In each process that imports transformers it

- wraps every entry of transformers' attention registry (``ALL_ATTENTION_FUNCTIONS``: ``sdpa``, ``flex_attention``,
  ``flash_attention_2``, ...) with a counter: calls with and without autograd, calls on a batch of one row, the
  longest query, and the mask's type (flex attention's ``BlockMask``, a dense tensor, None);
- looks, a few times during the run, for the Hugging Face models alive in the process (``nn.Module`` with a
  ``config``, found by the garbage collector or noted as they were built): class, ``config._attn_implementation``,
  parameters and their dtype, and how many submodules run Liger's kernels (a class or a bound ``forward`` from
  ``liger_kernel``), plus whether Qwen2's rotary function is Liger's;
- writes ``probe_<pid>.json`` into that folder after each look, every 30 s, and at exit (``atexit``, and
  ``os._exit``, which ranks that skip interpreter finalization leave through), with torch.compile's counters. A
  process killed outright keeps what its last write held.

``collect()`` merges a run's files into the ``took_effect`` record of its result: per attention implementation the
calls, whether training passes ran packed rows (one row longer than any single sequence may be), Liger's modules per
model. Models of vLLM (its own classes, its own attention) are listed under their module path, apart from the
trainer's. The looks cost well under a second each, a handful per process: ``HYBRID_RL_PEERS_PROBE_AT`` (seconds after
the first attention call, comma-separated; default ``20,120,400``).
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
import weakref
from pathlib import Path

ENV_DIR = "HYBRID_RL_PEERS_PROBE_DIR"
ENV_AT = "HYBRID_RL_PEERS_PROBE_AT"
HOOK = """\
# what took effect in this process (benchmarks/peers/probe.py), when the harness asks for it
import os as _os
if _os.environ.get("HYBRID_RL_PEERS_PROBE_DIR"):
    try:
        import peers_probe as _peers_probe
        _peers_probe.start()
    except Exception as _e:  # the probe never stops a run
        print(f"peers_probe: not started ({_e!r})")
"""

_calls: dict[str, dict] = {}
_first_call: list[float] = []
_lock = threading.Lock()


# -- in the framework's process -------------------------------------------------------------------------------------
def _count(name: str, fn):
    def wrapped(module, query, key, value, *args, **kwargs):
        try:
            attention_mask = args[0] if args else kwargs.get("attention_mask")
            import torch

            grad = torch.is_grad_enabled()
            b, q = (int(query.shape[0]), int(query.shape[2])) if getattr(query, "dim", lambda: 0)() == 4 else (-1, -1)
            with _lock:
                c = _calls.setdefault(name, {"calls": 0, "grad_calls": 0, "batch1_calls": 0, "batch1_grad_calls": 0,
                                             "max_q_len": 0, "max_q_len_grad": 0, "mask_types": []})
                c["calls"] += 1
                c["grad_calls"] += int(grad)
                c["batch1_calls"] += int(b == 1)
                c["batch1_grad_calls"] += int(b == 1 and grad)
                c["max_q_len"] = max(c["max_q_len"], q)
                if grad:
                    c["max_q_len_grad"] = max(c["max_q_len_grad"], q)
                kind = type(attention_mask).__name__
                if kind not in c["mask_types"]:
                    c["mask_types"].append(kind)
                if not _first_call:
                    _first_call.append(time.monotonic())
        except Exception:  # noqa: BLE001  (counting never breaks the forward)
            pass
        return fn(module, query, key, value, *args, **kwargs)

    wrapped.__peers_probe__ = True
    return wrapped


def _wrap_registry() -> bool:
    """Wrap each registered attention function once, where it is registered: a framework's override on the
    instance stays on the instance, the rest in the class-wide mapping, so a later ``register`` still replaces it
    (and is wrapped at the next call of this). False until transformers' modeling code has been imported."""
    if "transformers.modeling_utils" not in sys.modules:
        return False  # never import transformers into a process that does not use it
    try:
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS as registry
    except Exception:  # noqa: BLE001  (still importing)
        return False
    cls = type(registry)
    if not getattr(cls.__dict__.get("register"), "__peers_probe__", False):  # what registers later, wrapped as it does
        register, setitem = cls.register.__func__, cls.__setitem__

        def wrapped_register(klass, key, value):
            return register(klass, key, value if getattr(value, "__peers_probe__", False) else _count(key, value))

        def wrapped_setitem(self, key, value):
            return setitem(self, key, value if getattr(value, "__peers_probe__", False) else _count(key, value))

        wrapped_register.__peers_probe__ = wrapped_setitem.__peers_probe__ = True
        cls.register, cls.__setitem__ = classmethod(wrapped_register), wrapped_setitem
    local = getattr(registry, "_local_mapping", None)
    shared = getattr(cls, "_global_mapping", None)
    for name in list(registry.keys()):
        fn = registry[name]
        if getattr(fn, "__peers_probe__", False):
            continue
        if local is not None and name in local:
            local[name] = _count(name, fn)
        elif shared is not None and name in shared:
            shared[name] = _count(name, fn)
        else:
            registry[name] = _count(name, fn)
    return True


def _from_liger(obj) -> bool:
    mod = getattr(obj, "__module__", "") or ""
    return mod.startswith("liger_kernel")


_built: weakref.WeakSet = weakref.WeakSet()
"""Every transformers model built since ``transformers.modeling_utils`` loaded (``_track_models``), held weakly."""


def _track_models(modeling_utils) -> None:
    """Note each ``PreTrainedModel`` as it is built (its ``post_init``, which every model's ``__init__`` ends with).
    vLLM freezes the garbage collector's heap once its engine has started (``gc.freeze``), and ``gc.get_objects()``
    leaves frozen objects out, so a trainer's model built before its in-process engine is found only through this."""
    cls = getattr(modeling_utils, "PreTrainedModel", None)
    if cls is None or getattr(cls.post_init, "__peers_probe__", False):
        return
    post_init = cls.post_init

    def wrapped(self, *args, **kwargs):
        try:
            _built.add(self)
        except TypeError:  # noqa: BLE001  (not weak-referenceable: the garbage collector's view still has it)
            pass
        return post_init(self, *args, **kwargs)

    wrapped.__peers_probe__ = True
    cls.post_init = wrapped


def _on_modeling_utils(module) -> None:
    _wrap_registry()
    _track_models(module)


def _models() -> list[dict]:
    """The Hugging Face-style models alive in this process (the outermost of those nested in one another): those the
    garbage collector tracks, and those noted as they were built (``_track_models``)."""
    import gc
    import warnings

    import torch

    with warnings.catch_warnings():  # isinstance on every live object touches deprecated module attributes
        warnings.simplefilter("ignore")
        found = [o for o in gc.get_objects() if isinstance(o, torch.nn.Module)
                 and getattr(getattr(o, "config", None), "model_type", None) is not None]
    seen = {id(m) for m in found}
    found += [m for m in list(_built) if id(m) not in seen
              and getattr(getattr(m, "config", None), "model_type", None) is not None]
    inner = {id(m) for o in found for m in o.modules() if m is not o}
    out = []
    for m in found:
        if id(m) in inner:
            continue
        subs = list(m.modules())
        liger = sum(1 for s in subs if _from_liger(type(s))
                    or ("forward" in vars(s) and _from_liger(getattr(vars(s)["forward"], "__func__", vars(s)["forward"]))))
        params = list(m.parameters())
        out.append({"class": type(m).__name__, "module": type(m).__module__,
                    "attn_implementation": getattr(m.config, "_attn_implementation", None),
                    "modules": len(subs), "liger_modules": liger, "params": sum(p.numel() for p in params),
                    "dtype": str(params[0].dtype) if params else None,
                    "training": bool(getattr(m, "training", False))})
    return out


def _record(out_dir: Path, looked: bool) -> None:
    rec = {"pid": os.getpid(), "argv": [Path(a).name for a in sys.argv[:3]], "written_at": time.time()}
    with _lock:
        rec["attention"] = json.loads(json.dumps(_calls))
    if looked:
        try:
            rec["models"] = _models()
        except Exception as e:  # noqa: BLE001
            rec["models_error"] = repr(e)
    qwen2 = sys.modules.get("transformers.models.qwen2.modeling_qwen2")
    if qwen2 is not None and hasattr(qwen2, "apply_rotary_pos_emb"):
        rec["qwen2_rotary_from_liger"] = _from_liger(qwen2.apply_rotary_pos_emb)
    dynamo = sys.modules.get("torch._dynamo.utils")
    if dynamo is not None:
        try:
            rec["dynamo_counters"] = {k: dict(v) for k, v in dynamo.counters.items() if k in ("stats", "frames")}
        except Exception:  # noqa: BLE001
            pass
    path = out_dir / f"probe_{os.getpid()}.json"
    old = json.loads(path.read_text()) if path.is_file() else {}
    if "models" not in rec and "models" in old:
        rec["models"] = old["models"]  # at exit the models may be gone: keep what the last look saw
    tmp = path.with_suffix(f".{threading.get_ident()}.tmp")
    tmp.write_text(json.dumps(rec))
    tmp.replace(path)


class AfterImport:
    """A ``sys.meta_path`` finder that lets module ``name`` load as usual, then calls ``hook(module)`` at once, before
    any other code can use the module (and leaves ``sys.meta_path``). Also used by ``verl_critic_attn.py``."""

    def __init__(self, name: str, hook):
        self.name, self.hook = name, hook

    def find_spec(self, fullname, path, target=None):
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)
        import importlib.util

        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            sys.modules[fullname] = module
            self.hook(module)

        spec.loader.exec_module = exec_module  # this spec's own loader object
        return spec


def _watch(out_dir: Path, at: list[float]) -> None:
    wrapped_at = time.monotonic()
    while not _first_call:  # a framework that registers an attention function later is wrapped within a second
        time.sleep(0.05)
        if time.monotonic() - wrapped_at > 1.0:
            _wrap_registry()
            wrapped_at = time.monotonic()
    looks, written = list(at), time.monotonic()
    while True:
        now = time.monotonic()
        if looks and now >= _first_call[0] + looks[0]:
            looks.pop(0)
            _wrap_registry()
            _record(out_dir, looked=False)  # the counts first: a look at the models takes a moment
            _record(out_dir, looked=True)
            written = time.monotonic()
        elif now - written >= 30.0:
            _record(out_dir, looked=False)
            written = now
        time.sleep(0.05)


def start() -> None:
    out_dir = Path(os.environ[ENV_DIR])
    out_dir.mkdir(parents=True, exist_ok=True)
    at = sorted(float(x) for x in os.environ.get(ENV_AT, "20,120,400").split(",") if x.strip())
    import atexit

    atexit.register(lambda: _calls and _record(out_dir, looked=False))
    real_exit = os._exit

    def _exit(code):  # ranks that leave through os._exit (hybrid_rl's, vLLM's workers) skip atexit
        try:
            if _calls:
                _record(out_dir, looked=False)
        finally:
            real_exit(code)

    os._exit = _exit
    if "transformers.modeling_utils" in sys.modules:
        _on_modeling_utils(sys.modules["transformers.modeling_utils"])
    else:
        # the attention registry wrapped, and models noted as they are built, as soon as transformers' modeling_utils
        # loads: before any model can be built or call attention
        sys.meta_path.insert(0, AfterImport("transformers.modeling_utils", _on_modeling_utils))
    threading.Thread(target=_watch, args=(out_dir, at), name="peers-probe", daemon=True).start()


# -- in the harness -------------------------------------------------------------------------------------------------
def site(folder: Path, prelude: str = "") -> Path:
    """``folder`` with ``sitecustomize.py`` (``prelude``, then the probe's hook) and this module as ``peers_probe``."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "sitecustomize.py").write_text(prelude + ("\n" if prelude and not prelude.endswith("\n") else "") + HOOK)
    (folder / "peers_probe.py").write_text(Path(__file__).read_text())
    return folder


def env_for(env: dict, folder: Path, out_dir: Path) -> dict:
    """``env`` with the probe's site first on ``PYTHONPATH`` and its output folder set (emptied first)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    for old in out_dir.glob("probe_*.json"):
        old.unlink()
    return {**env, "PYTHONPATH": os.pathsep.join(filter(None, [str(folder), env.get("PYTHONPATH", "")])),
            ENV_DIR: str(out_dir)}


def collect(out_dir: Path, seq_cap: int, asked: dict | None = None) -> dict:
    """Merge a run's probe files: ``took_effect``. ``seq_cap``: the longest single sequence (prompt + response
    caps); a training pass on one row longer than that ran packed rows. ``asked``: the run's options (``liger``,
    ``attn_implementation``, ``remove_padding``), each compared with what ran under ``checks``."""
    files = []
    for path in sorted(Path(out_dir).glob("probe_*.json")):
        try:
            files.append(json.loads(path.read_text()))
        except ValueError:
            continue
    attention: dict[str, dict] = {}
    for f in files:
        for name, c in f.get("attention", {}).items():
            a = attention.setdefault(name, {"processes": 0, "calls": 0, "grad_calls": 0, "batch1_calls": 0,
                                            "batch1_grad_calls": 0, "max_q_len": 0, "max_q_len_grad": 0,
                                            "mask_types": []})
            a["processes"] += 1
            for k in ("calls", "grad_calls", "batch1_calls", "batch1_grad_calls"):
                a[k] += c.get(k, 0)
            for k in ("max_q_len", "max_q_len_grad"):
                a[k] = max(a[k], c.get(k, 0))
            a["mask_types"] = sorted(set(a["mask_types"]) | set(c.get("mask_types", [])))
    models, seen = [], set()
    for f in files:
        for m in f.get("models", []):
            key = (m["module"], m["class"], m["attn_implementation"], m["liger_modules"], m["params"])
            if key not in seen:
                seen.add(key)
                models.append(m)
    trained = {k: a for k, a in attention.items() if a["grad_calls"]}
    out = {"processes": len(files), "attention": attention, "models": models,
           "attention_in_training": sorted(trained),
           "packed_rows_in_training": any(a["batch1_grad_calls"] and a["max_q_len_grad"] > seq_cap
                                          for a in trained.values()) if trained else None,
           "liger_modules": max((m["liger_modules"] for m in models if not m["module"].startswith("vllm")), default=0),
           "qwen2_rotary_from_liger": any(f.get("qwen2_rotary_from_liger") for f in files),
           "dynamo_unique_graphs": sum(f.get("dynamo_counters", {}).get("stats", {}).get("unique_graphs", 0)
                                       for f in files)}
    if asked is not None and files:
        checks = {}
        if "liger" in asked:
            ran = out["liger_modules"] > 0 or out["qwen2_rotary_from_liger"]
            checks["liger"] = {"asked": bool(asked["liger"]), "ran": ran}
        if asked.get("attn_implementation"):
            checks["attn_implementation"] = {"asked": asked["attn_implementation"], "ran": out["attention_in_training"]}
        if "remove_padding" in asked and out["packed_rows_in_training"] is not None:
            checks["remove_padding"] = {"asked": bool(asked["remove_padding"]), "ran": out["packed_rows_in_training"]}
        out["checks"] = checks
        out["mismatches"] = [k for k, c in checks.items()
                             if (c["asked"] not in c["ran"] if isinstance(c["ran"], list) else c["asked"] != c["ran"])]
    return out
