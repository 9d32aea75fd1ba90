"""The vLLM rollout engine, colocated with the trainer in the same process (tested: vllm 0.26.0).

One ``vllm.LLM`` per rank, started inside torchrun with
``distributed_executor_backend="external_launcher"``: torchrun's ranks are cut
into tensor-parallel groups of ``rollout.vllm.tensor_parallel_size`` consecutive
ranks, each group one engine replica (vLLM's "external DP"), seeded per
data-parallel rank. The engine starts from ``load_format="dummy"`` weights and
refuses to generate until the sharding manager has pushed real ones.

The hybrid cycle, driven by ``ShardingManager``: ``sleep(level)`` (1 offloads
the weights to CPU, 2 discards them and clears ``weights_version``) →
``wake_up(["weights"])`` → ``load_weights`` buckets, each handed to every
worker through ``collective_rpc`` → prefix cache reset (stale KV of the old
weights must never be reused) → ``wake_up(["kv_cache"])`` → ``generate``.
``torch.cuda.empty_cache()`` runs after sleeping (the engine's activation
blocks go back to the trainer) and before waking (the trainer's cached blocks
go back to the driver, so vLLM's cuMem allocations fit).

Prompts go in as token ids (left padding removed with the attention mask),
responses come back as token ids plus the log-prob of each sampled token under
``logprobs_mode="processed_logprobs"``: the temperature-scaled distribution the
token was drawn from, which is what the trainer recomputes with ``logits / T``
(greedy reports T=1). Stopping is on the tokenizer's EOS or ``max_tokens`` (and, for the turns of multi-turn
rollouts, on ``SamplingParams.stop_token_ids`` and ``stop``, the latter matched on detokenized text with the stop
string kept: the token ids stay those sampled, the one completing the string the last):
``generation_config="vllm"`` keeps the checkpoint's generation config (extra
EOS ids, sampling defaults) out, so vLLM and the hf engine stop alike.
Everything trainer-facing is built by ``assemble_rollout``.

vLLM internals are touched in exactly one place, ``engine_model`` (worker →
torch model), which the weight push and the read-back go through. vLLM's
*output* format is read in one place too, ``sampled_logprobs``: with
``SamplingParams.flat_logprobs`` (in 0.26; ``supports_flat_logprobs`` checks
for the field, and without it the option is left out) each sequence's
log-probs arrive as one ``FlatLogprobs`` whose flat ``logprobs`` list, under
``logprobs=0``, already *is* the sampled tokens' log-probs (one entry per
position, the sampled token first), so it is taken as is after a check of the
token ids and the layout; anything else falls back to the per-position
``dict[token_id, Logprob]`` lookup. Host-side post-processing (un-padding,
``collect_outputs``, ``assemble_rollout``) builds each tensor with one call
over flat data, no per-token Python work beyond vLLM's own.

``generate_interruptible`` (partial rollouts, ``trainer.partial_rollouts``)
drives ``LLM.llm_engine`` itself: one n=1 request per continuation (prompt +
earlier response tokens as the prompt, the remaining budget as ``max_tokens``;
prefix caching shares the group's prompt), ``step()`` until every request is
done or the interrupt is set, then ``abort_request`` for the unfinished ones,
keeping the tokens and sampled log-probs of their latest ``CUMULATIVE``
output. Tensor parallelism is refused there (the ranks of an engine would have
to agree on the step of the interrupt).

With ``rollout.vllm.engine_process=true`` the engine core runs in a process of its own, handed the weights as
CUDA IPC handles: ``vllm_process``.

Left out: vLLM's native LoRA (with LoRA the trainer pushes merged, HF-named
full weights), quantised or multimodal models, pipeline parallelism,
async/streaming, per-request seeds, and scoring given
tokens with the engine (log-prob parity is measured by the trainer). With ``top_p < 1`` or
``top_k > 0`` vLLM's processed log-probs are those of the *truncated*
distribution, while the trainer's recomputation (and the hf engine) use the
untruncated one: they then differ by log(kept mass) per token.
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import io
import os
import socket
import time
from contextlib import contextmanager
from typing import Any, Callable, Iterable, Iterator, Optional, Sequence

import torch

from hybrid_rl.batch import Batch
from hybrid_rl.models import ModelLoadError, resolve_dtype, resolve_model_path
from hybrid_rl.planner.shape import ShapeError, read_shape
from hybrid_rl.rollout.base import (Continuation, GenerationStream, Interrupt, OnFinish, RolloutEngine, SamplingParams,
                                    Segment, assemble_rollout, on_generation_stream, pad_rows)
from hybrid_rl.rollout.vllm_process import (_rpc_die_with_parent, cuda_ipc_handle, engine_process_env, rebuild_ipc,
                                            signals_blocked)

VLLM_MISSING = "rollout.name=vllm needs vLLM: pip install -e '.[vllm]' (tested: vllm 0.26), or use rollout.name=hf"

# Environment vLLM needs when it runs inside the trainer's process: the
# external-launcher executor asserts in-process engine cores; the FlashInfer
# sampler cannot return processed log-probs (and may not be installed).
_VLLM_ENV_DEFAULTS = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_USE_FLASHINFER_SAMPLER": "0",
    "VLLM_NO_USAGE_STATS": "1",
}


def import_vllm():
    """Import vLLM lazily; a missing install becomes a one-line ``ModelLoadError``."""
    for key, value in _VLLM_ENV_DEFAULTS.items():
        os.environ.setdefault(key, value)
    try:
        import vllm
    except ModuleNotFoundError as e:
        if e.name in (None, "vllm"):  # vLLM itself is absent (a missing piece of it is a broken install)
            raise ModelLoadError(VLLM_MISSING) from None
        raise ModelLoadError(f"rollout.name=vllm: importing vLLM failed ({e}); reinstall it with "
                             f"pip install -e '.[vllm]' (tested: vllm 0.26), or use rollout.name=hf") from e
    except ImportError as e:
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ModelLoadError(f"rollout.name=vllm: importing vLLM failed ({first}); reinstall it with "
                             f"pip install -e '.[vllm]' (tested: vllm 0.26), or use rollout.name=hf") from e
    return vllm


# --------------------------------------------------------------------------- the one adapter
def engine_model(worker: Any) -> torch.nn.Module:
    """The torch model held by a vLLM worker: the single place that knows vLLM's internals.

    ``LLM.collective_rpc(fn, args)`` calls ``fn(worker, *args)`` on every worker.
    In vLLM 0.26 ``worker`` is a ``WorkerWrapperBase`` (it forwards attribute
    access to the real ``Worker``, also reachable as ``.worker``); the Worker
    holds ``model_runner`` (``GPUModelRunner`` V1 or the default V2 runner for
    dense models), whose ``get_model()`` unwraps CUDA-graph wrappers. Releases
    before ~0.10 exposed only ``model_runner.model``; the path moved between
    releases, so when it moves again, this is the function to change (and
    ``tests/gpu/test_vllm_gpu.py::test_adapter_and_pushed_weights`` says so).
    """
    runner = model_runner(worker)
    get_model = getattr(runner, "get_model", None)
    model = get_model() if callable(get_model) else getattr(runner, "model", None)
    if not isinstance(model, torch.nn.Module):
        raise RuntimeError(f"vLLM model runner {type(runner).__name__} holds no torch model; "
                           "hybrid_rl.rollout.vllm.engine_model needs updating for this vLLM version")
    return model


def model_runner(worker: Any) -> Any:
    """The worker's model runner (see ``engine_model``)."""
    runner = getattr(worker, "model_runner", None)
    if runner is None and getattr(worker, "worker", None) is not None:
        runner = getattr(worker.worker, "model_runner", None)
    if runner is None:
        raise RuntimeError(f"vLLM worker {type(worker).__name__} has no model_runner; "
                           "hybrid_rl.rollout.vllm.engine_model needs updating for this vLLM version")
    return runner


def _rpc_pin_main_stream(worker: Any, stream: Any) -> bool:
    """Runs on each vLLM worker: make ``stream`` the model runner's ``main_stream`` (None: vLLM's own again).

    vLLM 0.26's V2 runner caches the stream of its first call there (a ``functools.cached_property``), waits on it
    before copying outputs to the host and sets it as current after every step; left alone, generation on
    ``rollout.cuda_stream`` would hand its outputs over from the wrong stream. The V1 runner reads the current stream
    on every call: nothing to pin (False)."""
    runner = model_runner(worker)
    if not isinstance(getattr(type(runner), "main_stream", None), functools.cached_property):
        return False
    if stream is None:  # back to vLLM's own: the next call caches its caller's stream again
        vars(runner).pop("main_stream", None)
    else:
        vars(runner)["main_stream"] = stream  # shadows the cached_property's cached value
    return True


def _rpc_load_weights(worker: Any, weights: list[tuple[str, torch.Tensor]]) -> int:
    """Runs on each vLLM worker: copy HF-named full tensors into the model (vLLM shards/stacks them)."""
    loaded = engine_model(worker).load_weights(weights=weights)
    return len(loaded) if loaded is not None else len(weights)


def _rpc_load_ipc_weights(worker: Any, weights: list[tuple[str, tuple]]) -> int:
    """Runs on the vLLM worker of an engine process: open the pushed tensors' IPC handles, copy them in, let go."""
    device = torch.cuda.current_device()
    count = _rpc_load_weights(worker, [(name, rebuild_ipc(handle, device)) for name, handle in weights])
    torch.cuda.current_stream().synchronize()  # the copies are done before the trainer may free or reuse its buffers
    return count


def _rpc_read_weights(worker: Any, names: list[str] | None) -> bytes:
    """Runs on each vLLM worker: CPU copies of the engine's own parameters (vLLM names, this rank's shard), saved
    with ``torch.save``: an engine process's RPC replies go through msgpack, which turns nested tensors into lists."""
    wanted = set(names) if names is not None else None
    buf = io.BytesIO()
    torch.save([(n, p.detach().to("cpu", copy=True)) for n, p in engine_model(worker).named_parameters()
                if wanted is None or n in wanted], buf)
    return buf.getvalue()


# --------------------------------------------------------------------------- pure helpers
def unpad_prompts(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> list[list[int]]:
    """Token-id lists of the real prompt tokens (padding, left or right, dropped by the mask).

    One boolean gather and one ``tolist`` for the whole batch, then list slices per row.
    """
    if input_ids.shape != attention_mask.shape:
        raise ValueError(f"input_ids {tuple(input_ids.shape)} and attention_mask {tuple(attention_mask.shape)} differ")
    ids, mask = input_ids.cpu(), attention_mask.cpu().bool()
    lengths = mask.sum(dim=1).tolist()
    empty = [i for i, n in enumerate(lengths) if n == 0]
    if empty:
        raise ValueError(f"prompt rows {empty[:8]} have no tokens (attention_mask all 0); drop them before generating")
    flat = ids[mask].tolist() if not bool(mask.all()) else ids.reshape(-1).tolist()
    out, pos = [], 0
    for n in lengths:
        out.append(flat[pos:pos + n])
        pos += n
    return out


def supports_flat_logprobs(sampling_params_cls: Any) -> bool:
    """Whether ``vllm.SamplingParams`` has the ``flat_logprobs`` field (a msgspec Struct in vLLM 0.26)."""
    fields = getattr(sampling_params_cls, "__struct_fields__", None)
    if fields is None:
        fields = getattr(sampling_params_cls, "__dataclass_fields__", {})
    return "flat_logprobs" in fields


def sampling_kwargs(params: SamplingParams, eos_token_ids: Sequence[int], ignore_eos: bool = False,
                    flat_logprobs: bool = True) -> dict[str, Any]:
    """``vllm.SamplingParams`` arguments for ``params``: token ids in/out, one log-prob per sampled token."""
    greedy = params.greedy
    kw = dict(
        n=params.n,
        temperature=0.0 if greedy else float(params.temperature),
        top_p=1.0 if greedy else float(params.top_p),
        top_k=0 if greedy or params.top_k <= 0 else int(params.top_k),  # vLLM: 0 = off
        max_tokens=int(params.max_tokens),
        # vLLM's ignore_eos leaves stop ids active
        stop_token_ids=[] if ignore_eos else list(eos_token_ids) + list(params.stop_token_ids),
        ignore_eos=bool(ignore_eos),
        logprobs=0 if params.logprobs else None,  # the sampled token's log-prob only (or none)
        flat_logprobs=True,  # one flat list per sequence instead of a dict per token
        detokenize=False,
    )
    if params.stop and not ignore_eos:  # stop strings are matched on text: vLLM detokenizes for them
        # special tokens kept in that text, as the transformers engine matches it
        kw.update(stop=list(params.stop), include_stop_str_in_output=True, detokenize=True, skip_special_tokens=False)
    if not flat_logprobs or not params.logprobs:  # a vLLM without the field: the classic list of dicts comes back
        del kw["flat_logprobs"]
    return kw


_STEPS: list[int] = [0]
"""0, 1, 2, ...: grown to the longest sequence seen, sliced for ``_one_entry_per_position``."""


def _one_entry_per_position(starts: Sequence[int], ends: Sequence[int], n: int) -> bool:
    """``[starts[i], ends[i]) == [i, i + 1)`` for every position: checked by its ends, then exactly.

    ``FlatLogprobs.append`` makes every range start where the previous one ended,
    so with ``n`` entries over ``n`` positions the ends already decide it; the
    exact comparison runs when they agree (list equality in C: a few µs per sequence).
    """
    if n == 0:
        return True
    if starts[0] != 0 or ends[-1] != n or starts[-1] != n - 1:
        return False
    if len(_STEPS) <= n:
        _STEPS.extend(range(len(_STEPS), n + 1))
    return (starts if isinstance(starts, list) else list(starts)) == _STEPS[:n] and \
        (ends if isinstance(ends, list) else list(ends)) == _STEPS[1:n + 1]


def sampled_logprobs(token_ids: Sequence[int], logprobs: Any) -> list[float]:
    """The log-prob of each sampled token from a vLLM ``CompletionOutput.logprobs``: the output-format adapter.

    Accepts vLLM's ``FlatLogprobs`` (flat ``token_ids``/``logprobs`` lists with
    per-position ``[start_indices[i], end_indices[i])`` ranges; the sampled token
    comes first at each position) and the classic ``list[dict[token_id, Logprob]]``.
    Fast path: with ``logprobs=0`` every position holds exactly the sampled token,
    so once the layout and the token ids check out the flat ``logprobs`` list is
    returned as is (the engine's own list: read it, don't mutate it).
    """
    if logprobs is None:
        raise RuntimeError("vLLM returned no log-probs; SamplingParams.logprobs must be 0")
    n = len(token_ids)
    if len(logprobs) != n:
        raise RuntimeError(f"vLLM returned {len(logprobs)} log-prob positions for {n} tokens")
    starts = getattr(logprobs, "start_indices", None)
    if starts is None:  # list[dict[int, Logprob]]
        return [float(pos[tok].logprob) for pos, tok in zip(logprobs, token_ids)]
    flat_ids, flat_lps, ends = logprobs.token_ids, logprobs.logprobs, logprobs.end_indices
    if len(flat_lps) == n and len(flat_ids) == n and _one_entry_per_position(starts, ends, n):
        ids = token_ids if isinstance(token_ids, list) else list(token_ids)
        if flat_ids == ids:
            return flat_lps if isinstance(flat_lps, list) else list(flat_lps)
    out = []
    for i, tok in enumerate(token_ids):  # top-k alternatives present: find the sampled token at each position
        s, e = starts[i], ends[i]
        j = s if s < e and flat_ids[s] == tok else next((k for k in range(s, e) if flat_ids[k] == tok), None)
        if j is None:
            raise RuntimeError(f"vLLM log-probs at position {i} do not include the sampled token {tok}")
        out.append(float(flat_lps[j]))
    return out


def collect_outputs(request_outputs: Sequence[Any], n: int, pad_token_id: int,
                    logprobs: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """vLLM ``RequestOutput``s (one per prompt, n completions each) → right-padded responses and log-probs.

    Returns ``responses`` [B·n, R] (pad id past each sequence's end) and
    ``logprobs`` [B·n, R] (0 there), rows ordered prompt by prompt, sample by
    sample (``repeat_interleave(n)`` order), R = the longest response; ``logprobs`` False: None for them (the
    requests asked for none).
    """
    tokens: list[list[int]] = []
    lps: list[list[float]] = []
    for ro in request_outputs:
        outs = ro.outputs
        if len(outs) != n:
            raise RuntimeError(f"vLLM returned {len(outs)} completions for a prompt, expected n={n}")
        if any(o.index != j for j, o in enumerate(outs)):
            outs = sorted(outs, key=lambda o: o.index)
        for o in outs:
            toks = o.token_ids if isinstance(o.token_ids, list) else list(o.token_ids)
            tokens.append(toks)
            if logprobs:
                lps.append(sampled_logprobs(toks, o.logprobs))
    return pad_rows(tokens, lps if logprobs else None, pad_token_id)


def drive_engine(engine: Any, ids: list[str], interrupt: Interrupt | None,
                 on_finish: OnFinish | None) -> tuple[dict[str, Any], set[str], int]:
    """``LLMEngine.step()`` until the requests ``ids`` are done or ``interrupt`` is set (polled before every step;
    then the unfinished ones are aborted). Returns each request's latest ``CompletionOutput`` (CUMULATIVE: every
    token so far, a request aborted before its first token has none), the ids that finished, and the context
    tokens vLLM served from its prefix cache (``RequestOutput.num_cached_tokens``, summed over the requests)."""
    index = {rid: i for i, rid in enumerate(ids)}
    latest: dict[str, Any] = {}
    cached: dict[str, int] = {}
    done: set[str] = set()
    while len(done) < len(ids):
        if interrupt is not None and interrupt.is_set():
            engine.abort_request([rid for rid in ids if rid not in done])
            break
        ended = []
        for out in engine.step():
            if out.request_id not in index:
                continue
            latest[out.request_id] = out.outputs[0]
            cached[out.request_id] = int(getattr(out, "num_cached_tokens", None) or 0)
            if out.finished and out.request_id not in done:
                done.add(out.request_id)
                ended.append(index[out.request_id])
        if ended and on_finish is not None:
            on_finish(ended)
        if len(done) < len(ids) and not engine.has_unfinished_requests():
            raise RuntimeError(f"vLLM has no unfinished requests but {len(ids) - len(done)} continuations never finished")
    return latest, done, sum(cached.values())


def segment_of(output: Any, finished: bool) -> Segment:
    """A cumulative ``CompletionOutput`` → ``Segment`` (None, aborted before its first token: an empty one)."""
    if output is None:
        return Segment(finished=finished)
    toks = list(output.token_ids)
    return Segment(toks, [float(x) for x in sampled_logprobs(toks, output.logprobs)], finished)


def engine_kwargs(cfg, dist, gpu_bytes: Optional[int] = None) -> dict[str, Any]:
    """``vllm.LLM`` arguments for this rank from the config tree (pure: no vLLM needed); ``rollout.vllm.engine_kwargs``
    is given over them. ``gpu_bytes``: the GPU's memory, for ``rollout.vllm.fit_kv_cache`` (None: not fitted)."""
    r, o, d = cfg.rollout, cfg.rollout.vllm, cfg.data
    tp = o.tensor_parallel_size
    if tp < 1 or dist.world_size % tp:
        raise ValueError(f"rollout.vllm.tensor_parallel_size={tp} must divide the {dist.world_size} ranks")
    dtype = resolve_dtype(cfg.rollout_dtype, dist.device)
    dp_rank = dist.rank // tp
    # A multi-turn turn ends at its tool call, a stop string that vLLM matches on the text its detokenizer makes: the
    # engine then loads the tokenizer. Single-turn rollouts pass token ids in and out and start without it.
    multi_turn = getattr(getattr(cfg, "env", None), "name", None) is not None
    built = dict(
        model=resolve_model_path(cfg.model.path),
        skip_tokenizer_init=not multi_turn,
        trust_remote_code=cfg.model.trust_remote_code,
        dtype=str(dtype).replace("torch.", ""),
        load_format="dummy",  # the sharding manager pushes the real weights
        # in this process inside torchrun, or one engine process on this rank's GPU alone
        distributed_executor_backend="uni" if o.engine_process else "external_launcher",
        tensor_parallel_size=tp,
        enable_sleep_mode=True,
        gpu_memory_utilization=o.gpu_memory_utilization,
        max_num_seqs=r.max_num_seqs,
        max_num_batched_tokens=o.max_num_batched_tokens,
        max_model_len=o.max_model_len or (d.max_prompt_length + d.max_response_length),
        enforce_eager=o.enforce_eager,
        enable_prefix_caching=o.enable_prefix_caching,
        logprobs_mode="processed_logprobs",  # temperature-scaled, as the trainer recomputes
        generation_config="vllm",  # stop on our EOS only; no sampling defaults from the checkpoint
        seed=cfg.trainer.seed + 1000 * dp_rank,  # one stream per engine replica, shared inside a TP group
    )
    if multi_turn:
        built["tokenizer"] = resolve_model_path(cfg.model.tokenizer_path or cfg.model.path)
    kv_bytes = fitted_kv_cache_bytes(cfg, built["model"], gpu_bytes) if gpu_bytes else None
    if kv_bytes is not None:
        built["kv_cache_memory_bytes"] = kv_bytes  # vLLM then takes this, not the share, for its KV cache
    return {**built, **o.engine_kwargs}


def fitted_kv_cache_bytes(cfg, model_dir: str, gpu_bytes: int) -> Optional[int]:
    """``rollout.vllm.fit_kv_cache``'s KV cache for the model in ``model_dir`` (the one the engine loads) on a GPU of
    ``gpu_bytes`` (None: the share, also for a model whose shape cannot be read)."""
    try:
        shape = read_shape(model_dir)
    except ShapeError:
        return None
    return cfg.rollout.vllm.fitted_kv_cache_bytes(cfg, shape, gpu_bytes)


def check_memory_budget(utilization: float, free_bytes: int, total_bytes: int) -> None:
    """vLLM claims ``utilization × total`` of the GPU; with the actor already resident that must fit in what is free."""
    want = utilization * total_bytes
    if want > free_bytes:
        fits = max(0.05, int(free_bytes / total_bytes * 100 - 5) / 100)
        raise ModelLoadError(
            f"rollout.vllm.gpu_memory_utilization={utilization} asks for {want / 2**30:.1f} GiB but only {free_bytes / 2**30:.1f} GiB "
            f"of {total_bytes / 2**30:.1f} GiB is free next to the actor; lower it (e.g. {fits}) or set "
            f"actor.param_offload=true / ref.offload=true")


def _ensure_launcher_env(dist) -> None:
    """The external launcher reads torchrun's variables; a plain one-process run gets a world of one."""
    if "MASTER_ADDR" in os.environ:
        return
    if dist.world_size != 1:
        raise RuntimeError("rollout.name=vllm with several ranks needs torchrun (MASTER_ADDR is not set)")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for key, value in dict(RANK="0", LOCAL_RANK=str(dist.local_rank), WORLD_SIZE="1",
                           MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)).items():
        os.environ.setdefault(key, value)


# --------------------------------------------------------------------------- the engine
class VLLMRolloutEngine(RolloutEngine):
    def __init__(self, llm: Any, eos_token_ids: Sequence[int], pad_token_id: int, device: torch.device,
                 make_sampling_params: Callable[..., Any], tp_group: Any = None, ignore_eos: bool = False,
                 flat_logprobs: bool = True):
        self.llm = llm
        self.eos_token_ids = list(eos_token_ids)
        self.pad_token_id = int(pad_token_id)
        self.device = device
        self.make_sampling_params = make_sampling_params
        self.flat_logprobs = flat_logprobs  # ask for FlatLogprobs (False: this vLLM lacks the field)
        self.tp_group = tp_group  # torch.distributed group of this engine's TP ranks (None for TP=1)
        self.ignore_eos = ignore_eos  # benchmarks: fixed-length responses
        self._asleep: set[str] = set()  # tags currently released
        self._weights_real = False  # False while the engine holds dummy or discarded weights
        self._prefix_cache_stale = False
        self.last_generate_stats: dict[str, float] = {}
        self.runner_stream_pinned = False  # vLLM's runner generates on gen_stream's stream (use_stream)

    @classmethod
    def from_config(cls, cfg, dist, tokenizer, **llm_overrides: Any) -> "VLLMRolloutEngine":
        vllm = import_vllm()
        own_process = cfg.rollout.vllm.engine_process
        if not own_process:
            _ensure_launcher_env(dist)
        total = None
        if dist.device.type == "cuda":
            torch.cuda.set_device(dist.device)
            torch.cuda.empty_cache()  # vLLM sizes itself from the free memory
            free, total = torch.cuda.mem_get_info(dist.device)
        kwargs = {**engine_kwargs(cfg, dist, total), **llm_overrides}
        if total is not None:
            check_memory_budget(kwargs["gpu_memory_utilization"], free, total)
        if own_process:
            # an in-process engine built earlier in this process froze vLLM's environment (vllm.envs' cache)
            getattr(getattr(vllm, "envs", None), "disable_envs_cache", lambda: None)()
            with engine_process_env(dist.device), signals_blocked():
                llm = vllm.LLM(**kwargs)
            llm.collective_rpc(_rpc_die_with_parent, args=(os.getpid(),))
        else:
            llm = vllm.LLM(**kwargs)
        tp_group = None
        tp = kwargs["tensor_parallel_size"]
        if tp > 1:
            import torch.distributed as tdist

            for start in range(0, dist.world_size, tp):  # every rank creates every group, in order
                group = tdist.new_group(list(range(start, start + tp)), backend="gloo")
                if start <= dist.rank < start + tp:
                    tp_group = group
        engine = cls(llm, [tokenizer.eos_token_id], tokenizer.pad_token_id, dist.device, vllm.SamplingParams, tp_group,
                     flat_logprobs=supports_flat_logprobs(vllm.SamplingParams))
        engine.in_process = not own_process
        if engine.in_process:  # an engine process runs on its own streams: nothing to pin
            engine.use_stream(GenerationStream(dist.device, cfg.rollout.cuda_stream))
        return engine

    def use_stream(self, gen_stream: GenerationStream) -> None:
        """Generate on ``gen_stream`` (``rollout.cuda_stream``), with vLLM's runner pinned to it."""
        if gen_stream.stream is not None or self.gen_stream.stream is not None:
            self.runner_stream_pinned = any(self.llm.collective_rpc(_rpc_pin_main_stream, args=(gen_stream.stream,)))
        self.gen_stream = gen_stream

    # -- weights / memory --------------------------------------------------------------
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        if "weights" in self._asleep:
            raise RuntimeError("load_weights on a sleeping engine: call wake_up(['weights']) first")
        items = list(weights)
        if not items:
            return
        if self.in_process:
            self.llm.collective_rpc(_rpc_load_weights, args=(items,))
        else:  # handles, not bytes: the engine process maps the tensors (kept alive here until it returns)
            torch.cuda.current_stream(self.device).synchronize()
            self.llm.collective_rpc(_rpc_load_ipc_weights, args=([(n, cuda_ipc_handle(t)) for n, t in items],))
            torch.cuda.ipc_collect()  # free the blocks the engine process has let go of
        self._weights_real = True
        self._prefix_cache_stale = True  # KV computed with the old weights must not be reused

    def named_weights(self, names: list[str] | None = None) -> list[tuple[str, torch.Tensor]]:
        """CPU copies of the engine's parameters under vLLM's names (fused ``qkv_proj``/``gate_up_proj``;
        this rank's shard under TP). For tests and parity checks."""
        if "weights" in self._asleep:
            raise RuntimeError("named_weights on a sleeping engine: wake it up first")
        saved = self.llm.collective_rpc(_rpc_read_weights, args=(names,))[0]
        return [tuple(pair) for pair in torch.load(io.BytesIO(saved), weights_only=True)]

    def sleep(self, level: int = 1) -> None:
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 (offload weights) or 2 (discard weights), got {level}")
        if self._asleep >= {"weights", "kv_cache"}:
            return
        if self._asleep:  # half awake: vLLM only sleeps a fully awake engine
            self.wake_up(None)
        self.llm.sleep(level=level)
        self._asleep = {"weights", "kv_cache"}
        self._prefix_cache_stale = False  # vLLM drops the prefix cache when it sleeps
        if level >= 2:
            self._weights_real = False
            self._weights_version = None  # discarded: the next push is a full one
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def pool_bytes(self) -> int:
        # in-process engine (VLLM_ENABLE_V1_MULTIPROCESSING=0): its weights and KV cache live in the sleep-mode pool,
        # which torch's max_memory_allocated/reserved keep counting while it sleeps (unmapped, not freed); an engine
        # process holds its pool in its own process
        if not self.in_process:
            return 0
        from vllm.device_allocator.cumem import CuMemAllocator

        return CuMemAllocator.get_instance().get_current_usage()

    def wake_up(self, tags: list[str] | None = None) -> None:
        wanted = {"weights", "kv_cache"} if tags is None else set(tags)
        unknown = wanted - {"weights", "kv_cache"}
        if unknown:
            raise ValueError(f"wake_up tags must be 'weights' and/or 'kv_cache', got {sorted(unknown)}")
        todo = sorted(wanted & self._asleep)
        if not todo:
            return
        if self.device.type == "cuda":
            torch.cuda.empty_cache()  # hand the trainer's cached blocks back before vLLM maps its pools
        self.llm.wake_up(tags=todo)
        self._asleep -= set(todo)
        self.gen_stream.mark_ready()
        if "kv_cache" in todo:
            self._reset_prefix_cache_if_stale()

    def _reset_prefix_cache_if_stale(self) -> None:
        if self._prefix_cache_stale and "kv_cache" not in self._asleep:
            if self.llm.reset_prefix_cache() is False:
                raise RuntimeError("vLLM refused to reset its prefix cache after a weight update (requests running?)")
            self._prefix_cache_stale = False

    # -- generation -------------------------------------------------------------------
    @on_generation_stream
    @torch.no_grad()
    def generate(self, prompts: Batch, params: SamplingParams) -> Batch:
        self._check_ready()
        own = unpad_prompts(prompts.tensors["input_ids"], prompts.tensors["attention_mask"])
        if params.response_lengths is not None:
            # Forced lengths (benchmarks): one request per sample with its own
            # max_tokens and EOS ignored; prefix caching still shares the prompt.
            lengths = list(params.response_lengths)
            own = [(p, lengths[i * params.n + j]) for i, p in enumerate(own) for j in range(params.n)]
        batch_prompts, offset = self._gather_tp(own)
        start = time.perf_counter()
        if params.response_lengths is not None:
            sps = self._forced_length_params(params, [length for _, length in batch_prompts])
            outputs = self.llm.generate([{"prompt_token_ids": p} for p, _ in batch_prompts], sps, use_tqdm=False)
            n_per_request = 1
        else:
            sp = self.make_sampling_params(**self._sampling_kwargs(params, self.ignore_eos))
            outputs = self.llm.generate([{"prompt_token_ids": p} for p in batch_prompts], sp, use_tqdm=False)
            n_per_request = params.n
        seconds = time.perf_counter() - start
        outputs = outputs[offset:offset + len(own)]
        responses, logprobs = collect_outputs(outputs, n_per_request, self.pad_token_id, params.logprobs)
        self.last_generate_stats = {"seconds": seconds,
                                    "num_tokens": float(sum(len(o.token_ids) for ro in outputs for o in ro.outputs)),
                                    "num_sequences": float(responses.shape[0])}
        return assemble_rollout(prompts.to(self.device), responses.to(self.device),
                                None if logprobs is None else logprobs.to(self.device),
                                params.n, self.eos_token_ids, self.pad_token_id, params.response_lengths)

    # -- interruptible generation (partial rollouts) -----------------------------------
    @on_generation_stream
    @torch.no_grad()
    def generate_interruptible(self, requests: Sequence[Continuation], params: SamplingParams,
                               interrupt: Interrupt | None = None, on_finish: OnFinish | None = None) -> list[Segment]:
        """Step vLLM's engine over one request per continuation; on interrupt abort the unfinished ones, keeping
        what they sampled. ``on_finish`` is called from this thread as requests finish. A round after a weight push
        starts on a reset prefix cache: a carried sample's context is prefilled again under the new weights."""
        self._check_ready()
        if self.tp_group is not None:
            raise NotImplementedError("trainer.partial_rollouts=true with rollout.vllm.tensor_parallel_size > 1: the ranks of "
                                      "one vLLM engine would have to agree on the step of the interrupt; use "
                                      "rollout.vllm.tensor_parallel_size=1 or trainer.partial_rollouts=false")
        short = [i for i, r in enumerate(requests) if r.max_tokens < 1]
        if short:
            raise ValueError(f"continuations {short[:8]} have max_tokens < 1: they are finished, leave them out")
        engine = self.llm.llm_engine
        start = time.perf_counter()
        ids = self._add_continuations(engine, requests, params)
        latest, done, cached = drive_engine(engine, ids, interrupt, on_finish)
        segments = [segment_of(latest.get(rid), rid in done) for rid in ids]
        self.last_generate_stats = {"seconds": time.perf_counter() - start,
                                    "num_tokens": float(sum(len(s.tokens) for s in segments)),
                                    "num_sequences": float(len(segments)),
                                    "cached_tokens": float(cached)}
        return segments

    streams_requests = True

    @contextmanager
    def turn_stream(self, params: SamplingParams, interrupt: Interrupt | None = None) -> Iterator[Any]:
        """A ``vllm_stream.VLLMTurnStream`` on the running engine, all its steps inside the generation stream."""
        from hybrid_rl.rollout.vllm_stream import VLLMTurnStream

        self._check_ready()
        if self.tp_group is not None:
            raise NotImplementedError("env.scheduler=async with rollout.vllm.tensor_parallel_size > 1: the ranks of one "
                                      "vLLM engine would have to add the same requests at the same step; use "
                                      "rollout.vllm.tensor_parallel_size=1")
        stream = VLLMTurnStream(self, params, interrupt)
        start = time.perf_counter()
        with self.gen_stream.active(), torch.no_grad():
            try:
                yield stream
            finally:
                stream.abort()
                self.last_generate_stats = stream.stats(time.perf_counter() - start)

    def _add_continuations(self, engine: Any, requests: Sequence[Continuation], params: SamplingParams) -> list[str]:
        """One n=1 request per continuation, ids unique to this call (``LLM.generate`` numbers its own)."""
        if params.stop and getattr(engine, "tokenizer", True) is None:  # vLLM would ignore the stop strings
            raise ValueError("stop strings need vLLM's tokenizer, and this engine was started without it "
                             "(skip_tokenizer_init): start it with env.name set, or without "
                             "rollout.vllm.engine_kwargs.skip_tokenizer_init")
        from vllm.sampling_params import RequestOutputKind

        self._calls = getattr(self, "_calls", 0) + 1
        # LLM.generate's own rendering (vLLM 0.26: token ids → EngineInput); a raw prompt dict works too (deprecated)
        render = getattr(self.llm, "_preprocess_cmpl_one", lambda prompt: prompt)
        made: dict[tuple[int, bool], Any] = {}
        ids = []
        for i, r in enumerate(requests):
            key = (r.max_tokens, r.ignore_eos)
            if key not in made:  # vLLM clones the params of every request it adds: sharing them is safe
                one = dataclasses.replace(params, n=1, max_tokens=r.max_tokens, response_lengths=None)
                made[key] = self.make_sampling_params(**self._sampling_kwargs(one, r.ignore_eos),
                                                      output_kind=RequestOutputKind.CUMULATIVE)
            rid = f"partial-{self._calls}-{i}"
            engine.add_request(rid, render({"prompt_token_ids": list(r.prompt) + list(r.tokens)}), made[key])
            ids.append(rid)
        return ids

    def _check_ready(self) -> None:
        if self._asleep:
            raise RuntimeError(f"generate on a sleeping engine ({sorted(self._asleep)} released): wake it up first")
        if not self._weights_real:
            raise RuntimeError("generate before any weights were pushed (the engine holds dummy or discarded "
                               "weights): run it inside the sharding manager")
        self._reset_prefix_cache_if_stale()

    def _sampling_kwargs(self, params: SamplingParams, ignore_eos: bool) -> dict[str, Any]:
        return sampling_kwargs(params, self.eos_token_ids, ignore_eos, flat_logprobs=self.flat_logprobs)

    def _forced_length_params(self, params: SamplingParams, lengths: list[int]) -> list[Any]:
        """One n=1, EOS-ignoring ``SamplingParams`` per request, one object per distinct length
        (vLLM clones the params of every request it adds, so sharing them is safe)."""
        one = dataclasses.replace(params, n=1, response_lengths=None)
        made: dict[int, Any] = {}
        for length in set(lengths):
            made[length] = self.make_sampling_params(**self._sampling_kwargs(dataclasses.replace(one, max_tokens=length),
                                                                              ignore_eos=True))
        return [made[length] for length in lengths]

    def _gather_tp(self, own: list[list[int]]) -> tuple[list[list[int]], int]:
        """Under TP every rank of an engine must submit the same requests: generate the group's union,
        keep this rank's slice. Returns (all prompts, offset of this rank's prompts)."""
        if self.tp_group is None:
            return own, 0
        import torch.distributed as tdist

        parts: list[Any] = [None] * tdist.get_world_size(self.tp_group)
        tdist.all_gather_object(parts, own, group=self.tp_group)
        me = tdist.get_rank(self.tp_group)
        return [p for part in parts for p in part], sum(len(part) for part in parts[:me])

    def shutdown(self) -> None:
        """Drop the engine and its GPU memory (one vLLM engine per process at a time; an engine process is ended)."""
        if not self.in_process and self.llm is not None:
            core = getattr(getattr(self.llm, "llm_engine", None), "engine_core", None)
            if callable(getattr(core, "shutdown", None)):
                core.shutdown()
        self.llm = None
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
