"""A deterministic, resumable sampler of prompt indices, sharded across ranks.

Every rank builds the same ``PromptSampler`` (same seed), so all ranks agree on
each global batch without communicating; each takes its own contiguous slice.
The order depends only on ``(seed, epoch)``, which is why resuming needs only
``{"epoch", "step_in_epoch"}``. Left out: the incomplete tail of an epoch (it
is dropped, so every step has exactly ``data.train_batch_size`` prompts) and
weighted or curriculum sampling.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .tasks import DataError


class PromptSampler:
    """Yields this rank's indices of successive global batches, rolling over epochs.

    After the last batch of an epoch the sampler moves to the next epoch at
    once, so ``epoch`` and ``state_dict()`` always describe the *next* batch.
    """

    def __init__(self, num_items: int, global_batch_size: int, rank: int, world_size: int, seed: int,
                 shuffle: bool = True) -> None:
        if world_size <= 0 or not 0 <= rank < world_size:
            raise DataError(f"rank {rank} is not in a world of {world_size} ranks")
        if global_batch_size <= 0:
            raise DataError(f"data.train_batch_size={global_batch_size} must be a positive number of prompts")
        if global_batch_size % world_size:
            raise DataError(f"data.train_batch_size={global_batch_size} must be divisible by the {world_size} ranks; "
                            f"set it to a multiple of {world_size}")
        if global_batch_size > num_items:
            raise DataError(f"data.train_batch_size={global_batch_size} is larger than the {num_items} prompts in the "
                            f"training data (after filtering); lower data.train_batch_size or add data")
        self.num_items = num_items
        self.global_batch_size = global_batch_size
        self.rank = rank
        self.world_size = world_size
        self.seed = seed
        self.shuffle = shuffle
        self._epoch = 0
        self._step = 0
        self._perm_epoch = -1
        self._perm = np.arange(num_items)

    @property
    def epoch(self) -> int:
        """The epoch the next batch comes from (0-based)."""
        return self._epoch

    @property
    def step_in_epoch(self) -> int:
        return self._step

    @property
    def steps_per_epoch(self) -> int:
        return self.num_items // self.global_batch_size

    @property
    def local_batch_size(self) -> int:
        return self.global_batch_size // self.world_size

    def _permutation(self, epoch: int) -> np.ndarray:
        if self._perm_epoch != epoch:
            # A fresh generator per epoch: the order of epoch e never depends on
            # how many batches were drawn before, which is what makes resume exact.
            self._perm = np.random.default_rng(self.seed + epoch).permutation(self.num_items) if self.shuffle \
                else np.arange(self.num_items)
            self._perm_epoch = epoch
        return self._perm

    def next_indices(self) -> list[int]:
        """This rank's slice of the next global batch; advances the sampler."""
        perm = self._permutation(self._epoch)
        start = self._step * self.global_batch_size + self.rank * self.local_batch_size
        out = [int(i) for i in perm[start:start + self.local_batch_size]]
        self._step += 1
        if self._step >= self.steps_per_epoch:
            self._epoch += 1
            self._step = 0
        return out

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self._epoch, "step_in_epoch": self._step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        try:
            epoch, step = int(state["epoch"]), int(state["step_in_epoch"])
        except (KeyError, TypeError, ValueError):
            raise DataError(f"sampler state {state!r} needs integer 'epoch' and 'step_in_epoch'; the checkpoint is not a sampler state") from None
        if epoch < 0 or not 0 <= step < self.steps_per_epoch:
            raise DataError(f"sampler state epoch={epoch}, step_in_epoch={step} does not fit {self.steps_per_epoch} steps per epoch; "
                            f"resume with the data.train_batch_size and data of the original run")
        self._epoch, self._step = epoch, step
