"""The attention implementation of verl's critic, where the flash-attn package is missing.

verl 0.9.1 loads its critic through ``verl.utils.model.load_valuehead_model``, which passes
``attn_implementation="flash_attention_2"`` to ``AutoModelForTokenClassification.from_pretrained`` (and to its
TRL value-head fallback) written into the call: no config key reaches it, and without the flash-attn package
(no wheel exists for torch 2.11+cu130) transformers refuses the load, so verl cannot run a workload with a critic.
The actor has ``model.override_config.attn_implementation`` for the same choice.

``install(attn)`` makes ``load_valuehead_model`` load with ``attn`` instead (the actor's implementation, e.g.
``flex_attention``): for the duration of that one call, the auto classes' ``from_pretrained`` reads
``attn_implementation="flash_attention_2"`` as ``attn``; every other argument, and every other load, is untouched.
verl's code is not edited: ``run_verl.py`` copies this file into the run's site folder as ``peers_verl_critic_attn``,
and the folder's ``sitecustomize.py`` calls ``install`` in every process of the run (verl's Ray workers included)
when ``HYBRID_RL_PEERS_VERL_CRITIC_ATTN`` is set. The result records it (``settings.critic_attn_implementation``).
"""

from __future__ import annotations

import functools
import sys

ENV = "HYBRID_RL_PEERS_VERL_CRITIC_ATTN"
MODULE = "verl.utils.model"
HARD_CODED = "flash_attention_2"
AUTO_CLASSES = ("AutoModelForTokenClassification", "AutoModelForCausalLM", "AutoModelForVision2Seq")


def wrap(load, attn: str):
    """``load`` (verl's ``load_valuehead_model``) with ``attn`` in place of the hard-coded flash attention."""

    @functools.wraps(load)
    def load_valuehead_model(*args, **kwargs):
        import transformers

        saved = {}
        for name in AUTO_CLASSES:
            cls = getattr(transformers, name, None)
            if cls is None:
                continue
            saved[cls] = cls.__dict__.get("from_pretrained")  # the class's own attribute, or None when inherited
            bound = cls.from_pretrained

            def from_pretrained(*a, _bound=bound, **kw):
                if kw.get("attn_implementation") == HARD_CODED:
                    kw["attn_implementation"] = attn
                return _bound(*a, **kw)

            cls.from_pretrained = from_pretrained  # reached through the class: called without a bound first argument
        try:
            return load(*args, **kwargs)
        finally:
            for cls, attr in saved.items():
                if attr is None:
                    del cls.from_pretrained
                else:
                    cls.from_pretrained = attr

    load_valuehead_model.__peers_critic_attn__ = attn
    return load_valuehead_model


def _patch(module, attn: str) -> None:
    fn = getattr(module, "load_valuehead_model", None)
    if fn is not None and not hasattr(fn, "__peers_critic_attn__"):
        module.load_valuehead_model = wrap(fn, attn)


def install(attn: str) -> None:
    """Wrap verl's loader now if ``verl.utils.model`` is loaded, else as soon as it loads (before verl's engine can
    import the name)."""
    try:
        from peers_probe import AfterImport  # the run's site folder holds the probe under this name
    except ImportError:
        from probe import AfterImport  # beside this file
    if MODULE in sys.modules:
        _patch(sys.modules[MODULE], attn)
    elif not any(getattr(f, "name", None) == MODULE for f in sys.meta_path):
        sys.meta_path.insert(0, AfterImport(MODULE, lambda module: _patch(module, attn)))


SITE_HOOK = f"""\
# verl's critic loads with this attention implementation instead of its hard-coded flash attention, when asked
# (benchmarks/peers/verl_critic_attn.py)
import os as _os
if _os.environ.get("{ENV}"):
    try:
        import peers_verl_critic_attn as _peers_critic_attn
        _peers_critic_attn.install(_os.environ["{ENV}"])
    except Exception as _e:
        print(f"peers_verl_critic_attn: not installed ({{_e!r}})")
"""
