"""What runs any workload in a worker: the session (a Ray Train worker, or this process), the
engine (DeepSpeed or plain PyTorch), the optimizer and its schedule, checkpoints, metrics,
phase timing, hardware peaks and the entry points (``worker``)."""
