"""What a step reports: ``metrics`` (data metrics of a finished batch), ``perf`` (throughput, MFU and memory) and
``tracking`` (the sinks: progress bar, tensorboard, ``metrics.jsonl``; and the phase timers)."""
