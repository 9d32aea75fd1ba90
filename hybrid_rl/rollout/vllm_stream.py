"""vLLM's stream of continuations: each one a request added to the running ``LLMEngine``, one engine step per ``step``.

The asynchronous agent loop (``env.scheduler=async``) adds a trajectory's next turn as soon as its environment
answered, while the other trajectories decode: vLLM's scheduler takes the new request into the next step's batch
(continuous batching), and its prefix cache serves the context the previous turn left. Requests are n=1 with
CUMULATIVE outputs, as ``generate_interruptible``'s; ``abort`` keeps what the unfinished ones sampled.
"""

from __future__ import annotations

from typing import Any

from hybrid_rl.rollout.base import Continuation, Interrupt, SamplingParams, Segment
from hybrid_rl.rollout.stream import TurnStream


class VLLMTurnStream(TurnStream):
    """``rollout`` is a ``VLLMRolloutEngine`` (its ``_add_continuations`` renders and adds the requests)."""

    def __init__(self, rollout: Any, params: SamplingParams, interrupt: Interrupt | None):
        super().__init__(rollout, params, interrupt)
        self.llm_engine = rollout.llm.llm_engine
        self._live: dict[str, int] = {}
        """Request id → key, for the requests not yet returned."""
        self._latest: dict[str, Any] = {}
        """Request id → its latest (cumulative) ``CompletionOutput``, for an abort."""

    def add(self, request: Continuation) -> int:
        if request.max_tokens < 1:
            raise ValueError(f"a continuation with max_tokens={request.max_tokens} is finished: leave it out")
        key = self._key()
        rid = self.engine._add_continuations(self.llm_engine, [request], self.params)[0]
        self._live[rid] = key
        return key

    @property
    def running(self) -> int:
        return len(self._live)

    def step(self) -> list[tuple[int, Segment]]:
        """One engine step over the running requests; the ones that finished in it come back."""
        from hybrid_rl.rollout.vllm import segment_of

        if not self._live:
            return []
        done = []
        for out in self.llm_engine.step():
            key = self._live.get(out.request_id)
            if key is None:
                continue
            if out.finished:
                del self._live[out.request_id]
                self._latest.pop(out.request_id, None)
                self.cached_tokens += int(getattr(out, "num_cached_tokens", None) or 0)
                done.append((key, segment_of(out.outputs[0], True)))
            else:
                self._latest[out.request_id] = out.outputs[0]
        if self._live and not self.llm_engine.has_unfinished_requests():
            raise RuntimeError(f"vLLM has no unfinished requests but {len(self._live)} continuations never finished")
        self._returned([seg for _, seg in done])
        return done

    def abort(self) -> list[tuple[int, Segment]]:
        from hybrid_rl.rollout.vllm import segment_of

        if not self._live:
            return []
        self.llm_engine.abort_request(list(self._live))
        out = [(key, segment_of(self._latest.get(rid), False)) for rid, key in self._live.items()]
        self._live.clear()
        self._latest.clear()
        self._returned([seg for _, seg in out])
        return out
