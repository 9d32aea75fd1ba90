"""Driver phases: the thin glue between a ``Batch`` and the pure functions of ``hybrid_rl.algorithms``.

Each phase reads a batch's tensors and the config, runs registered functions, and returns a batch with its
results added. No communication: a prompt's samples live on one rank.
"""
