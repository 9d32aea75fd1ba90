"""Weight transport: get the actor's current weights into the rollout engine, and nothing else.

Everything between "the optimizer stepped" and "the engine samples with θ_k"
lives here; the training engine only exposes ``iter_full_params`` and the
rollout engine only ``load_weights`` plus its version bookkeeping
(``begin_weight_update`` / ``finish_weight_update``).

- ``plan``: the gather/push planner. Full tensors out of FSDP2 a few module
  groups per all-gather (layout computed once), HF names, LoRA merged on the
  fly, frozen outputs marked static. ``TrainingEngine.iter_full_params`` runs it.
- ``buckets``: groups the stream of full tensors into byte-bounded buckets, so
  the full state dict never exists at once.
- ``replay``: record-and-replay of the engine's ``load_weights`` per bucket
  layout (one ``_foreach_copy_`` instead of the engine's Python loader).
- ``sharding_manager``: the colocated hybrid switch (push, offload, wake/sleep
  the engine) and ``sync_weights`` for a push without waking the KV cache.
- ``broadcast``: split placement's transport, trainer ranks → rollout ranks
  over NCCL, bucket by bucket.

Left out: what the weights are used for (generation, the training step), when
to push (the driver decides), and checkpoints (``hybrid_rl.checkpoint``).
"""
