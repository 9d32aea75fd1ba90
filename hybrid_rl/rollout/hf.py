"""The transformers rollout engine: runs anywhere torch runs (CPU CI, one GPU, no vLLM).

It holds its own copy of the model, like vLLM does, so the sharding manager's
push is real and testable. Decoding is a plain KV-cache loop rather than
``model.generate`` for two reasons: the per-step log-prob of each sampled token
is recorded without keeping [B, R, V] logits alive, and sampling draws from the
engine's own seeded ``torch.Generator`` so runs repeat regardless of what else
consumed the global RNG. ``generate_interruptible`` (partial rollouts) runs the
same loop over continuations (prompt + earlier response tokens as one left-padded
context, each row with its own token budget) and polls the interrupt once per
decoding step; it also stops a row at ``SamplingParams.stop_token_ids`` and, checking
the decoded tail of the row's new tokens each step, at ``SamplingParams.stop``
(multi-turn rollouts end a turn there). Left out: continuous batching, paged attention and CUDA graphs
(that is what the vLLM backend is for), and KV reuse across an interrupt (a
continuation prefills its context again).
"""

from __future__ import annotations

import inspect
from typing import Any, Iterable, Mapping, Sequence

import torch

from hybrid_rl.batch import Batch
from hybrid_rl.models import load_causal_lm, resolve_dtype
from hybrid_rl.rollout.base import (Continuation, GenerationStream, Interrupt, OnFinish, RolloutEngine, SamplingParams,
                                    Segment, assemble_rollout, on_generation_stream, position_ids_from_mask)


class HFRolloutEngine(RolloutEngine):
    def __init__(self, model: torch.nn.Module, eos_token_ids: list[int], pad_token_id: int, device: torch.device,
                 max_num_seqs: int = 256, seed: int = 0, tokenizer: Any = None):
        self.model = model.to(device).eval()
        self.tokenizer = tokenizer
        """Decodes the tail of each continuation for ``SamplingParams.stop`` (None: stop strings are refused)."""
        for p in self.model.parameters():
            p.requires_grad_(False)
        self.device = device
        self.eos_token_ids = list(eos_token_ids)
        self.pad_token_id = pad_token_id
        self.max_num_seqs = max_num_seqs
        self.generator = torch.Generator(device=device).manual_seed(seed)
        self._params = dict(self.model.named_parameters(remove_duplicate=False))
        self._shapes = {id(p): (p.shape, p.dtype) for p in self._params.values()}
        self._weights_present = True
        # transformers renamed `past_key_values` to `cache` (5.2x); accept both.
        forward_args = inspect.signature(self.model.forward).parameters
        self._cache_kw = "cache" if "cache" in forward_args else "past_key_values"

    @classmethod
    def from_config(cls, cfg, dist, tokenizer) -> "HFRolloutEngine":
        """The engine ``rollout.name=hf`` builds: the checkpoint in ``rollout.dtype``, seeded per rank."""
        # The engine starts from the checkpoint too (like vLLM's load on init); the
        # sharding manager overwrites it with the actor's weights before first use.
        model = load_causal_lm(cfg.model.path, resolve_dtype(cfg.rollout_dtype, dist.device), cfg.model.trust_remote_code)
        engine = cls(model, [tokenizer.eos_token_id], tokenizer.pad_token_id, dist.device,
                     max_num_seqs=cfg.rollout.max_num_seqs, seed=cfg.trainer.seed + 1000 * dist.rank,
                     tokenizer=tokenizer)
        engine.gen_stream = GenerationStream(dist.device, cfg.rollout.cuda_stream)
        return engine

    # -- weights / memory --------------------------------------------------------------
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        if not self._weights_present:
            raise RuntimeError("load_weights on a sleeping engine: call wake_up(['weights']) first")
        with torch.no_grad():
            for name, tensor in weights:
                param = self._params.get(name)
                if param is None:
                    raise KeyError(f"rollout engine has no weight named {name!r}")
                param.copy_(tensor, non_blocking=True)

    def rng_state(self) -> dict[str, Any]:
        return {"kind": "torch", "state": self.generator.get_state()}

    def set_rng_state(self, state: Mapping[str, Any]) -> None:
        self.generator.set_state(state["state"])

    def named_weights(self) -> Iterable[tuple[str, torch.Tensor]]:
        """The engine's weights (for tests and parity checks)."""
        return self.model.named_parameters()

    def sleep(self, level: int = 1) -> None:
        if level >= 2:
            # Discard weights: the next wake_up allocates uninitialised storage and
            # the sharding manager must push again (weights_version says so).
            for p in {id(p): p for p in self._params.values()}.values():
                p.data = torch.empty(0, dtype=p.dtype, device=self.device)
            self._weights_present = False
            self._weights_version = None
        elif self.device.type == "cuda":
            self.model.to("cpu")
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def wake_up(self, tags: list[str] | None = None) -> None:
        if tags is None or "weights" in tags:
            if not self._weights_present:
                for p in {id(p): p for p in self._params.values()}.values():
                    shape, dtype = self._shapes[id(p)]
                    p.data = torch.empty(shape, dtype=dtype, device=self.device)
                self._weights_present = True
            elif self.device.type == "cuda":
                self.model.to(self.device)
        self.gen_stream.mark_ready()

    # -- generation -------------------------------------------------------------------
    @on_generation_stream
    @torch.no_grad()
    def generate(self, prompts: Batch, params: SamplingParams) -> Batch:
        if not self._weights_present:
            raise RuntimeError("generate on a sleeping engine: wake it up first")
        ids = prompts.tensors["input_ids"].to(self.device)
        mask = prompts.tensors["attention_mask"].to(self.device)
        ids = ids.repeat_interleave(params.n, dim=0)
        mask = mask.repeat_interleave(params.n, dim=0)
        lengths = None
        if params.response_lengths is not None:
            lengths = torch.tensor(params.response_lengths, device=self.device)
        outs, lps = [], []
        for start in range(0, ids.shape[0], self.max_num_seqs):
            chunk = slice(start, start + self.max_num_seqs)
            o, lp = self._decode(ids[chunk], mask[chunk], params, None if lengths is None else lengths[chunk])
            outs.append(o)
            lps.append(lp)
        width = max(o.shape[1] for o in outs)
        responses = torch.cat([torch.nn.functional.pad(o, (0, width - o.shape[1]), value=self.pad_token_id) for o in outs])
        logprobs = torch.cat([torch.nn.functional.pad(lp, (0, width - lp.shape[1])) for lp in lps])
        return assemble_rollout(prompts.to(self.device), responses, logprobs if params.logprobs else None, params.n,
                                self.eos_token_ids, self.pad_token_id, params.response_lengths)

    def _decode(self, ids: torch.Tensor, mask: torch.Tensor, params: SamplingParams,
                lengths: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        limits = lengths if lengths is not None else torch.full((ids.shape[0],), params.max_tokens, device=self.device)
        tokens, logprobs, _, _ = self._decode_rows(ids, mask, params, limits, stop_on_eos=lengths is None)
        return tokens, logprobs

    def _decode_rows(self, ids: torch.Tensor, mask: torch.Tensor, params: SamplingParams, limits: torch.Tensor,
                     stop_on_eos: bool | torch.Tensor, interrupt: Interrupt | None = None,
                     on_finish: OnFinish | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """KV-cache decoding of left-padded contexts, row i for at most ``limits[i]`` tokens (EOS ends a row where
        ``stop_on_eos``). Returns tokens and log-probs [b, s] (pad / 0 after a row ends), the token count [b] and
        whether each row finished [b]; ``interrupt`` is polled after every step."""
        b = ids.shape[0]
        pos = position_ids_from_mask(mask)
        next_pos = mask.sum(dim=1)  # [b] position of the first generated token
        eos = torch.tensor(self.eos_token_ids + list(params.stop_token_ids), device=self.device)
        stop_text = _StopText(params.stop, self.tokenizer, b) if params.stop else None
        finished = torch.zeros(b, dtype=torch.bool, device=self.device)
        counts = torch.zeros(b, dtype=torch.long, device=self.device)
        tokens, logprobs = [], []
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True)
        cache = getattr(out, self._cache_kw)
        logits = out.logits[:, -1, :]
        for step in range(int(limits.max())):
            tok, lp = self._sample(logits.float(), params)
            tok = torch.where(finished, torch.full_like(tok, self.pad_token_id), tok)
            tokens.append(tok)
            logprobs.append(torch.where(finished, torch.zeros_like(lp), lp))
            counts += (~finished).long()
            before = finished
            # forced lengths (benchmarks): EOS is just another token
            finished = finished | (torch.isin(tok, eos) & stop_on_eos) | (limits <= step + 1)
            if stop_text is not None:
                finished = finished | stop_text.hit(tok, before, self.device)
            if on_finish is not None and bool((finished & ~before).any()):
                on_finish(torch.nonzero(finished & ~before).flatten().tolist())
            if bool(finished.all()) or (interrupt is not None and interrupt.is_set()):
                break
            mask = torch.cat([mask, torch.ones(b, 1, dtype=mask.dtype, device=self.device)], dim=1)
            out = self.model(input_ids=tok[:, None], attention_mask=mask, position_ids=next_pos[:, None],
                             use_cache=True, **{self._cache_kw: cache})
            cache = getattr(out, self._cache_kw)
            logits = out.logits[:, -1, :]
            next_pos = next_pos + 1
        return torch.stack(tokens, dim=1), torch.stack(logprobs, dim=1), counts, finished

    # -- interruptible generation (partial rollouts) -----------------------------------
    @on_generation_stream
    @torch.no_grad()
    def generate_interruptible(self, requests: Sequence[Continuation], params: SamplingParams,
                               interrupt: Interrupt | None = None, on_finish: OnFinish | None = None) -> list[Segment]:
        """Continuations in chunks of ``max_num_seqs``; once interrupted, the chunks not started yet get empty
        unfinished segments."""
        if not self._weights_present:
            raise RuntimeError("generate on a sleeping engine: wake it up first")
        short = [i for i, r in enumerate(requests) if r.max_tokens < 1]
        if short:
            raise ValueError(f"continuations {short[:8]} have max_tokens < 1: they are finished, leave them out")
        segments = [Segment() for _ in requests]
        for start in range(0, len(requests), self.max_num_seqs):
            if interrupt is not None and interrupt.is_set():
                break
            chunk = list(requests[start:start + self.max_num_seqs])
            report = None if on_finish is None else (lambda rows, s=start: on_finish([s + r for r in rows]))
            for i, seg in enumerate(self._decode_chunk(chunk, params, interrupt, report)):
                segments[start + i] = seg
        return segments

    def _decode_chunk(self, chunk: list[Continuation], params: SamplingParams, interrupt: Interrupt | None,
                      on_finish: OnFinish | None) -> list[Segment]:
        contexts = [list(r.prompt) + list(r.tokens) for r in chunk]
        width = max(len(c) for c in contexts)
        ids = torch.full((len(chunk), width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(chunk), width), dtype=torch.long)
        for row, c in enumerate(contexts):  # left padding, as the prompts come
            ids[row, width - len(c):] = torch.as_tensor(c, dtype=torch.long)
            mask[row, width - len(c):] = 1
        limits = torch.tensor([r.max_tokens for r in chunk], device=self.device)
        stop_on_eos = torch.tensor([not r.ignore_eos for r in chunk], device=self.device)
        toks, lps, counts, finished = self._decode_rows(ids.to(self.device), mask.to(self.device), params, limits,
                                                        stop_on_eos, interrupt, on_finish)
        toks, lps, counts, finished = toks.tolist(), lps.tolist(), counts.tolist(), finished.tolist()
        return [Segment(toks[i][:counts[i]], lps[i][:counts[i]], bool(finished[i])) for i in range(len(chunk))]

    def _sample(self, logits: torch.Tensor, params: SamplingParams) -> tuple[torch.Tensor, torch.Tensor]:
        logp = torch.log_softmax(logits / params.logprob_temperature, dim=-1)  # [b, V]
        if params.greedy:
            tok = logits.argmax(dim=-1)
        else:
            filtered = logp.clone()
            if params.top_k > 0:
                kth = torch.topk(filtered, min(params.top_k, filtered.shape[-1]), dim=-1).values[:, -1:]
                filtered[filtered < kth] = float("-inf")
            if params.top_p < 1.0:
                sorted_lp, order = torch.sort(filtered, dim=-1, descending=True)
                cum = torch.cumsum(sorted_lp.softmax(-1), dim=-1)
                drop_sorted = (cum - sorted_lp.softmax(-1)) >= params.top_p  # keep the token that crosses top_p
                drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
                filtered[drop] = float("-inf")
            tok = torch.multinomial(filtered.softmax(-1), 1, generator=self.generator).squeeze(-1)
        return tok, logp.gather(-1, tok[:, None]).squeeze(-1)


class _StopText:
    """``SamplingParams.stop`` for the decoding loop: each row's tokens of this call, and whether the text of its
    last few tokens holds a stop string (a string spans at most as many tokens as it has characters, plus one for a
    token that ends in its first character)."""

    def __init__(self, stops: Sequence[str], tokenizer: Any, rows: int):
        if tokenizer is None:
            raise ValueError("SamplingParams.stop needs the engine's tokenizer (HFRolloutEngine(tokenizer=...))")
        self.stops, self.tokenizer = tuple(stops), tokenizer
        self.window = max(len(s) for s in self.stops) + 1
        self.rows: list[list[int]] = [[] for _ in range(rows)]

    def hit(self, tok: torch.Tensor, done: torch.Tensor, device: torch.device) -> torch.Tensor:
        """[b] bool: the rows not ``done`` before this step whose latest tokens complete a stop string."""
        out = [False] * len(self.rows)
        for i, (t, d) in enumerate(zip(tok.tolist(), done.tolist())):
            if d:
                continue
            row = self.rows[i]
            row.append(t)
            tail = self.tokenizer.decode(row[-self.window:], skip_special_tokens=False)
            out[i] = any(s in tail for s in self.stops)
        return torch.tensor(out, dtype=torch.bool, device=device)
