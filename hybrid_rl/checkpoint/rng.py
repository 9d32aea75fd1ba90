"""RNG state as tensors and primitives (checkpoint ``extra``): Python, numpy, torch CPU/CUDA and named generators;
and the seeding of the global ones at a run's start (``seed_everything``)."""

from __future__ import annotations

import json
import random
from typing import Any, Mapping

import numpy as np
import torch

from .layout import CheckpointError


def capture_rng(generators: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Python ``random``, numpy's global RNG, torch CPU, this device's CUDA RNG, and named generators.

    ``generators`` maps names to ``torch.Generator`` (any device) or
    ``numpy.random.Generator`` objects. The result holds only tensors and
    primitives, so it can go into ``extra``.
    """
    version, mt, gauss = random.getstate()
    np_state = np.random.get_state(legacy=False)
    state: dict[str, Any] = {
        "python": [version, list(mt), gauss],
        "numpy": {"bit_generator": np_state["bit_generator"], "key": torch.from_numpy(np_state["state"]["key"].astype(np.int64)),
                  "pos": int(np_state["state"]["pos"]), "has_gauss": int(np_state["has_gauss"]), "gauss": float(np_state["gauss"])},
        "torch": torch.get_rng_state(),
        "cuda": None,
        "generators": {},
    }
    if torch.cuda.is_available():
        state["cuda"] = {"device": torch.cuda.current_device(), "state": torch.cuda.get_rng_state()}
    for name, g in (generators or {}).items():
        if isinstance(g, torch.Generator):
            state["generators"][name] = {"kind": "torch", "state": g.get_state()}
        elif isinstance(g, np.random.Generator):
            state["generators"][name] = {"kind": "numpy", "state": json.dumps(g.bit_generator.state)}
        else:
            raise TypeError(f"capture_rng: generator {name!r} is a {type(g).__name__}, not a torch.Generator or numpy.random.Generator")
    return state


def restore_rng(state: Mapping[str, Any], generators: Mapping[str, Any] | None = None) -> None:
    """Inverse of :func:`capture_rng`; every name in ``generators`` must be in ``state``."""
    version, mt, gauss = state["python"]
    random.setstate((version, tuple(mt), gauss))
    n = state["numpy"]
    np.random.set_state({"bit_generator": n["bit_generator"], "state": {"key": n["key"].numpy().astype(np.uint32), "pos": n["pos"]},
                         "has_gauss": n["has_gauss"], "gauss": n["gauss"]})
    torch.set_rng_state(state["torch"])
    cuda = state.get("cuda")
    if cuda is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(cuda["state"])
    saved = state.get("generators", {})
    for name, g in (generators or {}).items():
        if name not in saved:
            raise CheckpointError(f"RNG state has no generator {name!r} (it has {sorted(saved)}); capture it with capture_rng({{{name!r}: ...}})")
        entry = saved[name]
        if isinstance(g, torch.Generator) and entry["kind"] == "torch":
            g.set_state(entry["state"])
        elif isinstance(g, np.random.Generator) and entry["kind"] == "numpy":
            g.bit_generator.state = json.loads(entry["state"])
        else:
            raise CheckpointError(f"RNG state for {name!r} is a {entry['kind']} generator but a {type(g).__name__} was passed")


def seed_everything(seed: int) -> None:
    """Seed Python's ``random``, numpy's global RNG and torch's (every device's)."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
