"""hybrid_rl: a colocated hybrid-engine RL trainer for LLMs."""

__version__ = "0.1.0"
