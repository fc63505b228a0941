"""Wall-time estimates from a short measured calibration step on this machine."""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from orchestrator.plan import Trial
from orchestrator.spec import ExperimentSpec
from workloads.gp import GPRegressor, gp_flops_per_sample
from workloads.models import ModelConfig, build_model, flops_per_token

# Ray Tune/Train start-up, DeepSpeed initialisation, checkpoints, the final evaluations and the
# model upload of one trial: fig3a-cpu on 2 cores (20 trials, 2 at once) took 1099 s against
# 640 s of calibrated compute, about 45 s per trial. Added to every trial's estimate.
TRIAL_OVERHEAD_S = 45.0
CALIBRATION_SEQ_LEN = 128  # short sequences keep a paper-size calibration step to seconds


def _measure(step, flops: float, repeats: int = 2) -> float:
    step()  # warm-up: allocations, kernel selection
    start = time.perf_counter()
    for _ in range(repeats):
        step()
    return flops * repeats / (time.perf_counter() - start)


def achieved_flops_per_s(cfg: ModelConfig, micro_batch_size: int, threads: int,
                         gp_input_dim: int | None = None) -> float:
    """Forward + backward FLOP/s that one worker with ``threads`` CPU threads (or this machine's
    GPU) achieves on ``cfg``: one warm-up and two timed steps of a micro-batch of
    ``micro_batch_size`` sequences of at most ``CALIBRATION_SEQ_LEN`` tokens (of
    ``micro_batch_size`` x 64 examples for a ``GPRegressor``), fp32."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        if gp_input_dim is None:
            seq = min(cfg.context_length, CALIBRATION_SEQ_LEN)
            model = build_model(cfg).to(device)
            idx = torch.randint(cfg.vocab_size, (micro_batch_size, seq + 1), device=device)

            def step():
                logits = model(idx[:, :-1])
                F.cross_entropy(logits.flatten(0, 1), idx[:, 1:].flatten()).backward()
            flops = flops_per_token(cfg, seq) * micro_batch_size * seq
        else:
            n = micro_batch_size * 64
            model = GPRegressor(cfg, gp_input_dim).to(device)
            x = torch.randn(n, gp_input_dim, device=device)

            def step():
                model(x).square().mean().backward()
            flops = gp_flops_per_sample(cfg, gp_input_dim) * n
        return _measure(step, flops)
    finally:
        torch.set_num_threads(previous)


def estimate_wall_s(spec: ExperimentSpec, trials: list[Trial]) -> dict[str, float]:
    """Estimated wall seconds of every trial: its FLOPs over the calibrated FLOP/s of one worker
    times the workers, plus ``TRIAL_OVERHEAD_S``. One calibration per distinct model."""
    gp_dim = spec.gp.input_dim if spec.workload == "gp_regression" else None
    rates: dict[ModelConfig, float] = {}
    out = {}
    for t in trials:
        if t.model not in rates:
            rates[t.model] = achieved_flops_per_s(t.model, t.micro_batch_size,
                                                  spec.resources.cpus_per_worker, gp_dim)
        out[t.trial_id] = (t.flops / (rates[t.model] * spec.resources.num_workers)
                           + TRIAL_OVERHEAD_S)
    return out
