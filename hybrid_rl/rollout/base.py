"""The rollout-engine interface every backend implements, and the shared post-processing.

An engine owns its own copy of the weights (as vLLM does) and never trains:
``load_weights`` receives tensors pushed by the sharding manager, ``sleep``
releases its memory while the trainer works, ``wake_up`` takes it back, and
``generate`` turns left-padded prompt ids into responses plus the log-probs of
the sampled tokens. ``assemble_rollout`` is the one place that builds the
trainer-facing tensors (``input_ids``, ``attention_mask``, ``position_ids``,
``response_mask``) so every backend hands the trainer identical layouts.

``generate_interruptible`` is the optional second way in, for partial rollouts
(``trainer.partial_rollouts``, ``hybrid_rl/modes/partial.py``): one request per sample
(a prompt plus the response tokens it already has, and how many more it may
take), stoppable through a ``threading.Event``; it returns raw ``Segment``s
(new tokens, their log-probs, finished or not) and leaves the stitching to the
caller. An engine that lacks it says so naming that key. ``turn_stream`` builds on it for the asynchronous agent
loop (``stream.py``): continuations added while others generate.
"""

from __future__ import annotations

import abc
import functools
import itertools
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Callable, Iterable, Iterator, Mapping, Protocol, Sequence

import numpy as np
import torch

from hybrid_rl.batch import Batch


@dataclass(frozen=True)
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    """0 means greedy."""
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int = 256
    response_lengths: tuple[int, ...] | None = None
    """Benchmarks only: force each of the B·n responses to exactly this many tokens, ignoring EOS
    (random-init models never stop on their own, so lengths must be imposed to be realistic)."""
    stop: tuple[str, ...] = ()
    """``generate_interruptible``: strings that end a continuation besides EOS (the end of a tool call), kept in its
    tokens; checked on the text of the tokens it sampled in this call."""
    stop_token_ids: tuple[int, ...] = ()
    """``generate_interruptible``: token ids that end a continuation like EOS (a stop string that is one token)."""
    logprobs: bool = True
    """``generate``: return the sampled tokens' log-probs (``rollout_log_probs``); false, the batch has none and the
    engine skips computing and returning them (``rollout.logprobs``)."""

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def logprob_temperature(self) -> float:
        # Log-probs are reported under the distribution actually sampled from
        # (temperature-scaled, before top-k/top-p truncation), which is what the
        # trainer recomputes. Greedy decoding reports the plain T=1 log-probs.
        return 1.0 if self.greedy else self.temperature


@dataclass(frozen=True)
class Continuation:
    """One sample for ``generate_interruptible``: generate after ``prompt + tokens`` (a fresh sample has no tokens)."""

    prompt: Sequence[int]
    """The real prompt tokens (no padding)."""
    tokens: Sequence[int] = ()
    """Response tokens sampled in earlier rounds: context now, not output."""
    max_tokens: int = 1
    """New tokens this sample may still take (what is left of the response budget or of its forced length)."""
    ignore_eos: bool = False
    """Forced lengths (benchmarks): EOS is an ordinary token and the sample ends after ``max_tokens``."""


@dataclass
class Segment:
    """What ``generate_interruptible`` produced for one ``Continuation``."""

    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    """Log-prob of each new token under the weights that sampled it (``SamplingParams.logprob_temperature``)."""
    finished: bool = False
    """EOS (or a stop string or id) sampled or no tokens left; False when the interrupt stopped it first."""


class Interrupt(Protocol):
    """What ``generate_interruptible`` polls: a ``threading.Event`` (anything with ``is_set``)."""

    def is_set(self) -> bool: ...


OnFinish = Callable[[list[int]], None]
"""Called (from the generating thread) with the indices of the continuations that just finished."""


STREAM_MODES = ("shared", "own", "high")


class GenerationStream:
    """``rollout.cuda_stream``: which CUDA stream the engine's kernels run on.

    ``shared`` (no stream here): the calling thread's current stream. In overlap mode that is the trainer's stream too
    (read from vLLM 0.26's code: its V2 model runner caches the stream of its first call as ``main_stream`` and sets
    it as current after every output copy; ``tests/gpu/test_vllm_gpu.py`` prints which stream), so generation and
    training kernels queue on one stream and never run at the same time: the overlap then hides only host work.
    ``own``: a stream of the engine's own, so the GPU can run both; ``high``: the same at the highest priority, so
    decoding kernels (small, latency-bound) are scheduled before training's when both wait. Either way every generate
    call waits for the caller's stream and for the last push or wake (recorded where it ran: the push may come from
    another thread), and ends synchronised, so its outputs are complete for whichever thread reads them. On CPU every
    mode is ``shared``.
    """

    def __init__(self, device: torch.device, mode: str = "shared"):
        if mode not in STREAM_MODES:
            raise ValueError(f"rollout.cuda_stream={mode!r}: expected one of {', '.join(STREAM_MODES)}")
        self.mode = mode
        self.stream = None
        if mode != "shared" and device.type == "cuda":
            # torch maps a priority beyond the device's range to the nearest end: -100 is the highest there is
            self.stream = torch.cuda.Stream(device, priority=-100 if mode == "high" else 0)
        self._ready: Any = None

    def mark_ready(self) -> None:
        """After a push or a wake-up, in the thread that did it: generation waits for this point of its stream."""
        if self.stream is not None:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self.stream.device))
            self._ready = event

    @contextmanager
    def active(self) -> Iterator[None]:
        """Run the body's kernels on the engine's stream (a no-op for ``shared``)."""
        if self.stream is None:
            yield
            return
        self.stream.wait_stream(torch.cuda.current_stream(self.stream.device))
        if self._ready is not None:
            self.stream.wait_event(self._ready)
        try:
            with torch.cuda.stream(self.stream):
                yield
        finally:
            self.stream.synchronize()


def on_generation_stream(method: Callable) -> Callable:
    """Run an engine method inside ``self.gen_stream.active()`` (generate, generate_interruptible)."""
    @functools.wraps(method)
    def wrapped(self, *args: Any, **kwargs: Any) -> Any:
        with self.gen_stream.active():
            return method(self, *args, **kwargs)
    return wrapped


class RolloutEngine(abc.ABC):
    """Narrow interface: generate, load_weights, sleep, wake_up.

    Around them, with defaults here: the weight version the engine holds (read
    ``weights_version``; a push brackets its ``load_weights`` calls with
    ``begin_weight_update``/``finish_weight_update``), the sampling RNG for
    checkpoints (``rng_state``/``set_rng_state``; None = not capturable),
    ``last_generate_stats`` and ``shutdown``.
    """

    _weights_version: int | None = None
    gen_stream: GenerationStream = GenerationStream(torch.device("cpu"))
    """Where generation runs (``rollout.cuda_stream``); engines set their own in ``from_config``."""
    last_generate_stats: Mapping[str, float] = MappingProxyType({})
    """Figures of the latest ``generate`` call (seconds, num_tokens, num_sequences; for an interruptible round,
    cached_tokens: context read from a prefix cache) where the backend reports them."""
    in_process: bool = True
    """Whether ``load_weights`` copies in this process (False: the engine runs in a process of its own, so the
    sharding manager's record-and-replay of those copies cannot see them)."""

    @property
    def weights_version(self) -> int | None:
        """The actor weight version resident in the engine: None before the first push, while a push is under
        way (or failed half-way), and after the weights were discarded (sleep level 2)."""
        return self._weights_version

    def begin_weight_update(self) -> None:
        """A push starts (or what the engine holds can no longer be trusted): no known version until it finishes."""
        self._weights_version = None

    def finish_weight_update(self, version: int) -> None:
        """Every tensor of version ``version`` was loaded."""
        self._weights_version = version
        self.gen_stream.mark_ready()

    def rng_state(self) -> dict[str, Any] | None:
        """The sampling RNG's state for a checkpoint (``{"kind": "torch", "state": tensor}``, as
        ``checkpoint.capture_rng`` stores a generator), or None when it cannot be captured."""
        return None

    def set_rng_state(self, state: Mapping[str, Any]) -> None:
        """Restore what ``rng_state`` returned."""
        raise NotImplementedError(f"{type(self).__name__} has no capturable sampling RNG (rng_state() is None)")

    def shutdown(self) -> None:
        """Release the engine for good (its memory, its process-wide state); nothing to do by default."""

    @classmethod
    def from_config(cls, cfg: Any, dist: Any, tokenizer: Any) -> "RolloutEngine":
        """Build the engine from the ``Config``, this rank's ``DistInfo`` and the tokenizer: how the worker builds
        whichever class ``rollout.name`` names in ``hybrid_rl.rollout.ROLLOUT_ENGINES``."""
        raise NotImplementedError(f"{cls.__name__} does not implement from_config(cfg, dist, tokenizer)")

    @abc.abstractmethod
    def generate(self, prompts: Batch, params: SamplingParams) -> Batch:
        """``prompts`` holds left-padded ``input_ids``/``attention_mask`` [B, P]; returns a batch of
        B·n samples (each prompt repeated n times, consecutively) from ``assemble_rollout``."""

    def generate_interruptible(self, requests: Sequence[Continuation], params: SamplingParams,
                               interrupt: Interrupt | None = None, on_finish: OnFinish | None = None) -> list[Segment]:
        """Generate each continuation (n=1; ``params`` gives temperature/top-p/top-k, its ``n`` and ``max_tokens``
        are ignored) until it finishes or ``interrupt`` is set; every request gets a ``Segment`` in order, the
        unfinished ones holding the tokens sampled so far. ``on_finish`` hears of each request as it finishes."""
        raise NotImplementedError(f"rollout.name engine {type(self).__name__} cannot interrupt generation, which "
                                  f"trainer.partial_rollouts=true needs; set trainer.partial_rollouts=false")

    streams_requests: bool = False
    """Whether ``turn_stream`` adds each continuation to the running engine (vLLM), not only batches of them."""

    @contextmanager
    def turn_stream(self, params: SamplingParams, interrupt: Interrupt | None = None) -> Iterator[Any]:
        """A ``stream.TurnStream`` for one rollout's continuations under ``params`` (as ``generate_interruptible``'s);
        on exit the continuations still running are aborted and ``last_generate_stats`` holds the stream's
        figures. This default batches: each ``step`` generates what was added since the last one."""
        from hybrid_rl.rollout.stream import TurnStream  # stream.py imports this module

        stream = TurnStream(self, params, interrupt)
        start = time.perf_counter()
        try:
            yield stream
        finally:
            stream.abort()
            self.last_generate_stats = stream.stats(time.perf_counter() - start)

    @abc.abstractmethod
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy (name, full tensor) pairs into the engine's weights."""

    @abc.abstractmethod
    def sleep(self, level: int = 1) -> None:
        """Release memory: level 1 keeps the weights (offloaded), level 2 discards them."""

    def pool_bytes(self) -> int:
        """Bytes of the engine's own CUDA pool in this process that torch's allocator statistics count whether it is
        awake or asleep (vLLM's sleep-mode pool); 0 for an engine without one."""
        return 0

    @abc.abstractmethod
    def wake_up(self, tags: list[str] | None = None) -> None:
        """Re-acquire memory for ``tags`` (``weights``, ``kv_cache``; None = both)."""


def assemble_rollout(prompts: Batch, responses: torch.Tensor, logprobs: torch.Tensor | None, n: int,
                     eos_token_ids: list[int], pad_token_id: int,
                     response_lengths: tuple[int, ...] | None = None) -> Batch:
    """Build the trainer-facing rollout batch.

    prompts: the original B prompts (left padded). responses [B·n, R] and
    logprobs [B·n, R] are row-aligned with ``prompts.repeat_interleave(n)`` (None: the batch has no
    ``rollout_log_probs``).
    The response mask covers tokens up to and including the first EOS; tokens
    after it are replaced by pad and masked out. With ``response_lengths`` the
    mask covers exactly that many tokens instead (EOS ignored). Whole-tensor
    operations only (a few kernels on GPU, no per-row Python).
    """
    rep = prompts.repeat_interleave(n)
    prompt_ids = rep.tensors["input_ids"]  # [B·n, P]
    prompt_mask = rep.tensors["attention_mask"]  # [B·n, P]
    device, width = responses.device, responses.shape[1]
    steps = torch.arange(width, device=device)[None, :]
    if response_lengths is not None:
        lengths = torch.tensor(response_lengths, device=device)[:, None]
        inside = steps < lengths
    else:
        is_eos = responses == eos_token_ids[0] if len(eos_token_ids) == 1 else \
            torch.isin(responses, torch.tensor(list(eos_token_ids), device=device, dtype=responses.dtype))
        # a token is inside the response if no EOS came strictly before it
        eos_count = torch.cumsum(is_eos, dim=1)
        inside = (eos_count - is_eos.long()) == 0
    response_mask = inside.long()  # [B·n, R]
    responses = responses.masked_fill(~inside, pad_token_id)
    logged = {} if logprobs is None else dict(rollout_log_probs=logprobs.float() * response_mask)
    attention_mask = torch.cat([prompt_mask, response_mask], dim=1)  # [B·n, P+R]
    # Prompt positions count real tokens (left pads get 0); response positions
    # continue after the prompt even where the mask is 0, so padded tail tokens
    # cannot alias an earlier position.
    prompt_len = prompt_mask.sum(dim=1, keepdim=True)
    position_ids = torch.cat([(torch.cumsum(prompt_mask, dim=1) - 1).clamp(min=0), prompt_len + steps], dim=1)
    # group id: one per prompt within this batch, so the n samples of a prompt share it
    uid = np.repeat(np.arange(len(prompts)), n)
    if "uid" in prompts.non_tensors:
        uid = np.repeat(prompts.non_tensors["uid"], n)
    return rep.union(
        tensors=dict(
            prompts=prompt_ids,
            responses=responses,
            response_mask=response_mask,
            input_ids=torch.cat([prompt_ids, responses], dim=1),
            attention_mask=attention_mask,
            position_ids=position_ids,
            **logged,
        ),
        non_tensors=dict(uid=uid),
    )


def pad_rows(tokens: Sequence[Sequence[int]], logprobs: Sequence[Sequence[float]] | None,
             pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Ragged rows → right-padded ``[N, R]`` long tokens (pad id) and float32 log-probs (0), R = longest row
    (log-probs None when ``logprobs`` is).

    Each tensor comes from one flat array (``np.fromiter`` over the chained rows)
    scattered through a length mask, so the cost is one pass over the tokens.
    """
    lengths = np.fromiter((len(t) for t in tokens), dtype=np.int64, count=len(tokens))
    total = int(lengths.sum())
    width = int(lengths.max()) if len(lengths) else 0
    responses = torch.full((len(tokens), width), pad_token_id, dtype=torch.long)
    out_lps = None if logprobs is None else torch.zeros((len(tokens), width), dtype=torch.float32)
    if total:
        mask = torch.arange(width)[None, :] < torch.from_numpy(lengths)[:, None]  # row-major = concatenation order
        responses.masked_scatter_(mask, torch.from_numpy(np.fromiter(itertools.chain.from_iterable(tokens), np.int64,
                                                                     count=total)))
        if out_lps is None:
            return responses, None
        # float64 → float32 rounds exactly as torch.tensor(list, dtype=float32) does
        out_lps.masked_scatter_(mask, torch.from_numpy(np.fromiter(itertools.chain.from_iterable(logprobs), np.float32,
                                                                   count=total)))
    return responses, out_lps


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Left-padded prompt positions: 0 at the first real token (pads get 0 too)."""
    return (torch.cumsum(attention_mask, dim=1) - 1).clamp(min=0)
