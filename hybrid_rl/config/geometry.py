"""The batch geometry of an update, shared by validation, the actor and the critic.

An update section (``actor`` or ``critic``) cuts ``data.train_batch_size`` prompts into mini-batches of
``ppo_mini_batch_size`` prompts, shared by the training ranks, each prompt bringing ``rollout.n`` samples, and
takes one optimizer step per mini-batch, ``ppo_epochs`` times per trainer step.
"""

from __future__ import annotations

from typing import Any


def mini_batch_seqs(section: Any, world_size: int, n: int) -> int:
    """Sequences of one mini-batch on each of ``world_size`` training ranks: ``ppo_mini_batch_size / ranks × n``."""
    return section.ppo_mini_batch_size // world_size * n


def lr_schedule_steps(section: Any, train_batch_size: int, total_training_steps: int) -> int:
    """Optimizer steps over the run, the length of ``section``'s LR schedule: ``ppo_epochs`` passes of
    ``train_batch_size / ppo_mini_batch_size`` mini-batches per trainer step."""
    return total_training_steps * (section.ppo_epochs * (train_batch_size // section.ppo_mini_batch_size))
