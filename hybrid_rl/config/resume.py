"""Resuming under a changed config: which keys may differ from the checkpoint's run, and the key-by-key diff."""

from __future__ import annotations

import dataclasses
from typing import Any

from hybrid_rl.config.rollout import MOVED_KEYS
from hybrid_rl.config.tree import Config

RESUME_IGNORED = frozenset({"trainer.output_dir", "trainer.resume", "trainer.allow_config_change"})
"""Where a run lives and how it resumes, not what it trains: never compared on resume."""

RESUME_HARMLESS = frozenset({
    # how long, how often, where to log and what to diagnose
    "trainer.total_steps", "trainer.total_epochs", "trainer.test_freq", "trainer.val_before_train", "trainer.logger",
    "trainer.save_freq", "trainer.keep_last", "trainer.max_skipped_updates", "trainer.stale_policy",
    "trainer.profile_steps", "trainer.validation_data_dir", "trainer.imports", "trainer.stall_dump_s", "trainer.peak_tflops", "trainer.collective_timeout_s", "trainer.expandable_segments", "trainer.check_memory", "trainer.device", "reward.on_error",
    "reward.timeout_s", "reward.num_workers",
    # validation only
    "data.val_path", "data.val_split", "data.max_val_samples", "data.val_batch_size", "rollout.val_temperature",
    # memory/speed knobs that compute the same update (micro-batching, recomputation, offload, engine memory)
    "model.enable_gradient_checkpointing", "model.use_liger", "model.trust_remote_code",
    "actor.ppo_micro_batch_size_per_device", "actor.log_prob_micro_batch_size_per_device", "actor.use_dynamic_bsz",
    "actor.max_token_len_per_device", "actor.use_remove_padding", "actor.fused_logprob", "actor.share_prompts", "actor.use_torch_compile", "actor.accumulate_unsharded", "actor.param_offload",
    "actor.optimizer_offload", "ref.log_prob_micro_batch_size_per_device", "ref.offload",
    "critic.enable_gradient_checkpointing", "critic.ppo_micro_batch_size_per_device",
    "critic.forward_micro_batch_size_per_device", "critic.use_dynamic_bsz", "critic.max_token_len_per_device",
    "critic.use_remove_padding",
    "critic.param_offload", "critic.optimizer_offload",
    "rollout.max_num_seqs", "rollout.weight_sync_bucket_mb", "rollout.weight_load_replay", "rollout.free_cache_engine",
    "rollout.sleep_level", "rollout.cuda_stream", "rollout.vllm.gpu_memory_utilization",
    "rollout.vllm.max_num_batched_tokens", "rollout.vllm.max_model_len", "rollout.vllm.enforce_eager",
    "rollout.vllm.enable_prefix_caching", "rollout.vllm.engine_process",
})
"""Keys that may differ between a checkpoint's run and the run resuming it (each difference is warned about).
Every other key changes what is trained or the data order/shapes (model, data, algorithm, optimiser, sampling,
mode, placement, seed) and stops the resume unless ``trainer.allow_config_change=true``; a key added to the tree
is in that strict class until it is listed here."""


def resume_config_diff(saved: dict[str, Any], cfg: Config) -> tuple[list[str], list[str]]:
    """Compare a checkpoint's resolved config (a nested dict) with ``cfg``, key by key.

    Returns (differences that change what is trained, harmless differences), each as
    ``"key (checkpoint: old, now: new)"``. A key the saved config lacks (written before the key existed) is
    compared as its default; a key that moved is compared at its new place; keys the tree no longer has are skipped.
    """
    now = _flatten(cfg.to_dict())
    before = {**_flatten(Config().to_dict()), **{MOVED_KEYS.get(k, k): v for k, v in _flatten(saved).items()}}
    strict, harmless = [], []
    for key, value in now.items():
        if key in RESUME_IGNORED or before[key] == value:
            continue
        line = f"{key} (checkpoint: {_fmt_value(before[key])}, now: {_fmt_value(value)})"
        (harmless if key in RESUME_HARMLESS else strict).append(line)
    return strict, harmless


def _flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Dotted key → value; a mapping that is a value (``rollout.vllm.engine_kwargs``) stays one value."""
    out: dict[str, Any] = {}
    for k, v in tree.items():
        if isinstance(v, dict) and f"{prefix}{k}" in _SECTIONS:
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _sections(cls: type, prefix: str = "") -> set[str]:
    """The dotted keys of the tree's sections (its nested dataclasses)."""
    out: set[str] = set()
    for f in dataclasses.fields(cls):
        value = getattr(cls(), f.name)
        if dataclasses.is_dataclass(value):
            out |= {f"{prefix}{f.name}", *_sections(type(value), f"{prefix}{f.name}.")}
    return out


_SECTIONS = _sections(Config)


def _fmt_value(v: Any) -> str:
    """A value as it is spelt in an override (``sync``, ``[jsonl]``, ``null``)."""
    if isinstance(v, str):
        return v
    if isinstance(v, list):
        return "[" + ",".join(_fmt_value(x) for x in v) + "]"
    if isinstance(v, bool) or v is None:
        return {True: "true", False: "false", None: "null"}[v]
    return repr(v)

