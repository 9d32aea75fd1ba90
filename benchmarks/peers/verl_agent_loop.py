"""verl's single-turn agent loop with a per-sample response length, for the peer benchmark's forced lengths.

verl 0.9.1 sends every request of a step with the same sampling parameters (temperature, top_p, top_k, logprobs); its
vLLM server reads ``max_tokens`` from a request's sampling parameters when it is there and ignores EOS when
``rollout.ignore_eos`` is set. This loop adds one thing to verl's ``SingleTurnAgentLoop``: the request of sample j of
a prompt row gets ``max_tokens = extra_info.forced_lengths[j]``, the length hybrid_rl's ``rollout.forced_lengths`` draws
for that sample (benchmarks/peers/workload.py ``row_lengths``), so the response is exactly that long.

run_verl.py copies this file into the run's site folder as ``peers_verl_agent_loop`` (on the PYTHONPATH of verl's Ray
workers) and registers the class through ``actor_rollout_ref.rollout.agent.agent_loop_config_path`` (a registry file
of ``name`` + ``_target_``, verl's own mechanism for custom agent loops) with
``actor_rollout_ref.rollout.agent.default_agent_loop``.
"""

from __future__ import annotations

from typing import Any

from verl.experimental.agent_loop.single_turn_agent_loop import SingleTurnAgentLoop


def forced_length(sample: dict[str, Any]) -> int | None:
    """The response length of this sample: entry j of its row's ``extra_info.forced_lengths``, j the sample's index
    among the row's n samples (verl passes the row's fields and that index as keyword arguments); None when the row
    has none."""
    lengths = (sample.get("extra_info") or {}).get("forced_lengths")
    if lengths is None:
        return None
    return int(lengths[int(sample.get("session_id", 0))])


class ForcedLengthAgentLoop(SingleTurnAgentLoop):
    async def run(self, sampling_params: dict[str, Any], **kwargs):
        length = forced_length(kwargs)
        if length is not None:
            sampling_params = {**sampling_params, "max_tokens": length}
        return await super().run(sampling_params, **kwargs)
