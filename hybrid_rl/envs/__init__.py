"""Environments and tools for multi-turn, tool-using rollouts.

An environment starts from a data row and answers each model turn with an observation, an optional reward and
whether the trajectory is done; a tool is a typed Python function the model calls in its chat template's tool format.
The multi-turn rollout loop keeps a trajectory as one token sequence: the engine's sampled ids as sampled, each
observation encoded once and appended, with a response mask that is 1 on sampled tokens only.
"""
