"""The batch geometry of an update, shared by validation, the actor and the critic.

An update section (``actor`` or ``critic``) cuts ``data.train_batch_size`` prompts into mini-batches of
``ppo_mini_batch_size`` prompts, shared by the data-parallel ranks, each prompt bringing ``rollout.n`` samples, and
takes one optimizer step per mini-batch, ``ppo_epochs`` times per trainer step. Under Ulysses sequence parallelism
(``actor.ulysses_sequence_parallel_size``) each group of that many ranks holds one share of the batch, so the
data-parallel size is the training ranks / the group size.
"""

from __future__ import annotations

from typing import Any


def data_parallel_size(cfg: Any, world_size: int) -> int:
    """Distinct shares of the batch on ``world_size`` training ranks: a sequence-parallel group of
    ``actor.ulysses_sequence_parallel_size`` ranks holds one share (the actor's and the critic's passes alike)."""
    return world_size // cfg.actor.ulysses_sequence_parallel_size


def mini_batch_seqs(section: Any, dp_size: int, n: int) -> int:
    """Sequences of one mini-batch on each of ``dp_size`` data-parallel shares: ``ppo_mini_batch_size / dp × n``."""
    return section.ppo_mini_batch_size // dp_size * n


def lr_schedule_steps(section: Any, train_batch_size: int, total_training_steps: int) -> int:
    """Optimizer steps over the run, the length of ``section``'s LR schedule: ``ppo_epochs`` passes of
    ``train_batch_size / ppo_mini_batch_size`` mini-batches per trainer step."""
    return total_training_steps * (section.ppo_epochs * (train_batch_size // section.ppo_mini_batch_size))
