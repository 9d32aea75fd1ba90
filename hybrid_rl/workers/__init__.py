"""Per-GPU workers and the training engine they hold."""
