"""A reward server over HTTP (``reward.remote.url``), in OpenRLHF's remote reward model protocol.

Each batch is posted as JSON in chunks of ``reward.remote.batch_size`` (up to ``max_concurrency`` at once):
``{"query": [prompt + response], "prompts": [prompt], "responses": [response], "labels": [ground truth]}``, the
prompt as the chat template wrote it (special tokens kept, as OpenRLHF sends it), the response as decoded text.
The server answers ``{"rewards": [one number per query]}`` (OpenRLHF's ``serve_rm`` does). The score times
``reward.remote.weight`` adds to the reward function's; ``reward/remote_mean`` logs it before the weight. A chunk
that fails (no connection, an HTTP error, a timeout past ``timeout_s``, an answer of the wrong length or with a
non-finite number) is tried ``retries`` more times, then stops the run with one line naming the key and what went
wrong, or with ``reward.on_error=zero`` scores 0 and counts in ``reward/errors``.

Any judge can sit behind it: a reward model server, an LLM judge behind a small wrapper, a rule engine in another
language. Standard library only (``urllib``); no connection pooling.
"""

from __future__ import annotations

import json
import math
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from .registry import RewardError


class RemoteReward:
    """``reward.remote``'s client: ``score`` posts a batch and returns one number per sample."""

    def __init__(self, cfg: Any):
        if not str(cfg.url).startswith(("http://", "https://")):
            raise RewardError(f"reward.remote.url={cfg.url!r} is not an http:// or https:// URL; give the reward "
                              f"server's endpoint, e.g. http://localhost:5000/get_reward")
        self.cfg = cfg

    def score(self, prompts: list[str], responses: list[str], labels: list[str],
              on_error: str = "raise") -> tuple[list[float], int]:
        """The server's reward per sample, and how many samples scored 0 after a failed chunk
        (``on_error=zero``)."""
        n, size = len(responses), self.cfg.batch_size
        chunks = [(i, min(i + size, n)) for i in range(0, n, size)]
        with ThreadPoolExecutor(max_workers=max(1, min(self.cfg.max_concurrency, len(chunks) or 1))) as pool:
            results = list(pool.map(lambda c: self._chunk(prompts[c[0]:c[1]], responses[c[0]:c[1]],
                                                          labels[c[0]:c[1]]), chunks))
        scores: list[float] = []
        failed = 0
        for (lo, hi), (values, error) in zip(chunks, results):
            if error is None:
                scores += values
                continue
            if on_error == "raise":
                raise RewardError(f"reward.remote.url={self.cfg.url!r}: {error} (samples {lo}-{hi - 1}, after "
                                  f"{self.cfg.retries + 1} tries); start or fix the reward server, raise "
                                  f"reward.remote.timeout_s, or set reward.on_error=zero to score such samples 0")
            scores += [0.0] * (hi - lo)
            failed += hi - lo
        return scores, failed

    def _chunk(self, prompts: list[str], responses: list[str], labels: list[str]) -> tuple[list[float], str | None]:
        body = json.dumps({"query": [p + r for p, r in zip(prompts, responses)], "prompts": prompts,
                           "responses": responses, "labels": labels}).encode()
        error = "no attempt"
        for attempt in range(self.cfg.retries + 1):
            if attempt:
                time.sleep(min(2.0 ** attempt * 0.25, 5.0))
            try:
                values = self._post(body, len(responses))
                return values, None
            except (urllib.error.URLError, OSError, ValueError) as e:
                error = _describe(e)
        return [], error

    def _post(self, body: bytes, n: int) -> list[float]:
        request = urllib.request.Request(self.cfg.url, data=body, headers={"Content-Type": "application/json"},
                                         method="POST")
        with urllib.request.urlopen(request, timeout=self.cfg.timeout_s) as reply:
            answer = json.loads(reply.read().decode("utf-8"))
        rewards = answer.get("rewards") if isinstance(answer, dict) else None
        if not isinstance(rewards, list) or len(rewards) != n:
            raise ValueError(f"the answer has no list 'rewards' of {n} numbers (got {str(answer)[:80]!r})")
        values = [float(v) for v in rewards]
        if not all(math.isfinite(v) for v in values):
            raise ValueError("the answer's 'rewards' hold a non-finite number")
        return values


def _describe(e: BaseException) -> str:
    if isinstance(e, urllib.error.HTTPError):
        return f"HTTP {e.code} {e.reason}"
    if isinstance(e, urllib.error.URLError):
        return f"cannot connect ({e.reason})"
    return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
