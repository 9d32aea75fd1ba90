"""DAPO's soft overlong punishment (Yu et al. 2025, sec. 3.4): a response that runs into the last
``buffer_len`` tokens before ``max_response_length`` loses up to ``penalty_factor`` of reward, linearly, and one
cut at the cap loses all of it. Without it a rambling response cut at the cap is scored like a finished one, and a
flexible answer extractor (the last number in the text) pays it whenever that number happens to match: SmolLM2 on
GSM8K learned to ramble to the cap (benchmarks/results/learning_smollm2_H200x1.json). Same rule as verl's
``reward_model.overlong_buffer`` and OpenRLHF's ``--overlong_buffer_len`` / ``--overlong_penalty_factor``.
"""

from __future__ import annotations

import torch


def overlong_penalty(response_lengths: torch.Tensor, max_response_length: int, buffer_len: int,
                     penalty_factor: float) -> torch.Tensor:
    """Per-sequence penalty (<= 0), [B]: 0 up to ``max_response_length - buffer_len`` tokens, then falling
    linearly to ``-penalty_factor`` at ``max_response_length``."""
    expected = max_response_length - buffer_len
    exceed = (response_lengths.float() - expected).clamp(min=0.0)
    return -(exceed / buffer_len).clamp(max=1.0) * penalty_factor
