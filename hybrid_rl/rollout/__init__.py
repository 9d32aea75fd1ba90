"""Rollout engines behind one interface (``base.RolloutEngine``)."""
