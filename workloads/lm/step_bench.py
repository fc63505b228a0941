"""Forward+backward throughput of every variant at equal dimensions.

    python -m workloads.lm.step_bench --preset micro [--batch 8] [--seconds 6] [--rounds 3]
                              [--precision fp32] [--cem-kernel auto] [--compile]
                              [--variants "llama,cem-best T=2"] [--profile N]
                              [--json-out FILE]
    python -m workloads.lm.step_bench --stack 1,2,4,8 [--presets pico,nano,tiny]
                              [--variants "llama,cem-attn T=1"] [--budget-scale 0.25]

Every variant takes the preset's sizes (vocabulary, d_model, layers, heads, d_mlp, context), so
``--preset cem-134m`` and ``--preset llama-134m`` give the same table, whose ``cem-best T=2`` row is
``cem-134m``; ``--variants`` measures a subset. On the GPU when there is one, else the CPU, with the
model cast to ``--precision`` (``auto``: bf16 where supported, as the trials train). Prints a table
(tokens/s, step time relative to Llama, achieved GFLOP/s from the analytic ``flops_per_token``, MFU
over ``workloads.runtime.hardware.peak_flops``, peak memory: the allocator's per variant on a GPU,
the process's high-water mark so far on a CPU, the first step's seconds: the compile with
``--compile``, which runs every variant's model and the loss through ``torch.compile``) and the same
rows as JSON; ``--profile N`` adds each variant's N longest kernels (operators on a CPU) over 2
profiled steps. ``--stack`` prints trials per hour of stacked trials instead, per preset of
``--presets``, variant and stack size K (``workloads.lm.stack_bench``, which needs the trial
stack's packages; the rest needs torch and tabulate alone). Targets on CPU: CEM
attention at T = 1 no slower than 0.9x Llama's step time, the full ``cem-*`` configuration
(T = 2) no slower than 1.5x.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from statistics import median_high

import torch
from tabulate import tabulate

from workloads.core.architecture import CEM_BEST
from workloads.core.precision import resolve_precision
from workloads.models import (
    ModelConfig,
    build_model,
    count_parameters,
    flops_per_token,
    next_token_loss,
)
from workloads.models.cem import KERNELS, CEMAttention
from workloads.runtime.allocator import reuse_freed_memory
from workloads.runtime.hardware import DTYPES, device_name, peak_flops, peak_memory_bytes
from workloads.runtime.timing import format_kernels, kernel_rows, profiler, timed_calls

VARIANTS: dict[str, dict] = {
    "llama": {},
    "llama-alibi": {"position": "alibi"},
    "cem-attn T=1": {"attention": "cem"},
    "cem-mlp T=1": {"mlp": "cem"},
    "cem T=1": {"attention": "cem", "mlp": "cem"},
    "cem-best T=2": CEM_BEST,
}


SIZES = ("vocab_size", "d_model", "n_layer", "n_head", "d_mlp", "context_length")


def variant_configs(preset: str, names: list[str] | None = None) -> dict[str, ModelConfig]:
    """``{variant: config}`` for ``names`` (default: all of ``VARIANTS``, in its order): each
    variant's fields over the defaults, at the preset's sizes only, so a preset's own
    architecture fields (a ``cem-*`` preset's) do not leak into the Llama row.

    Raises:
        KeyError: on an unknown preset or variant name.
    """
    unknown = set(names or ()) - set(VARIANTS)
    if unknown:
        raise KeyError(f"unknown variant(s) {sorted(unknown)}; known: {list(VARIANTS)}")
    base = ModelConfig.from_preset(preset)
    sizes = {field: getattr(base, field) for field in SIZES}
    return {name: ModelConfig(**sizes, **overrides) for name, overrides in VARIANTS.items()
            if names is None or name in names}


def measure(cfg: ModelConfig, batch: int, seconds: float, device: torch.device,
            precision: str, compiled: bool = False, profile_top: int = 0
            ) -> tuple[float, list[float], list[dict]]:
    """The first warm-up step's seconds (it compiles, with ``compiled``: ``torch.compile`` of the
    whole model and of the loss, fixed shapes), the seconds of each forward+backward step on
    (batch, context_length) tokens, timed for about ``seconds`` (at least 3 steps) after 2
    warm-up steps, and with ``profile_top`` the ``kernel_table`` of 2 more steps (else [])."""
    dtype = DTYPES[precision]
    with device:  # initialised where it runs: 1 s of CPU per 134M model otherwise
        model = build_model(cfg).to(dtype=dtype)
    idx = torch.randint(0, cfg.vocab_size, (batch, cfg.context_length + 1), device=device)

    loss_of = next_token_loss
    if compiled:  # as a compiled trial does (``engine.compile``): the model and the loss
        model.compile(dynamic=False)  # in place: the same module, its forward compiled
        loss_of = torch.compile(next_token_loss, dynamic=False)

    def step() -> None:
        loss_of(model(idx[:, :-1]), idx[:, 1:]).backward()
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    start = time.perf_counter()
    step()  # the first warm-up step: the compile, if any
    first = time.perf_counter() - start
    step()
    times = timed_calls(step, seconds)
    return first, times, kernel_table(step, device, profile_top) if profile_top else []


def kernel_table(step, device: torch.device, top: int, steps: int = 2) -> list[dict]:
    """Where a step's time goes: ``steps`` calls of ``step`` under ``torch.profiler``, and its
    ``top`` longest GPU kernels (on a GPU) or torch operators (on a CPU), as
    ``workloads.runtime.timing.kernel_rows``."""
    cuda = device.type == "cuda"
    with profiler(cuda) as prof:
        for _ in range(steps):
            step()
    return kernel_rows([prof], cuda, top, steps)


def run(preset: str, batch: int, seconds: float, device: torch.device, precision: str,
        rounds: int = 3, compiled: bool = False, variants: list[str] | None = None,
        profile_top: int = 0) -> list[dict]:
    """One row per variant (``variants``: a subset of ``VARIANTS``' names; default all): the
    median step time over ``rounds`` rounds that visit every variant in turn (``seconds`` per
    variant in all), so that a machine's drift does not favour the variant measured first;
    ``first_step_s``, the longest first step of a round (with ``compiled``, the compile: every
    variant is compiled alike); ``step_time_vs_llama`` is None where Llama was not measured."""
    peak = peak_flops(device, precision, remeasure=True)[0]  # a slow first measurement rises
    configs = variant_configs(preset, variants)
    times: dict[str, list[float]] = {name: [] for name in configs}
    memory = dict.fromkeys(configs, 0.0)
    first = dict.fromkeys(configs, 0.0)
    kernels: dict[str, list[dict]] = {}
    for r in range(rounds):
        for name, cfg in configs.items():
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            first_s, step_s, kernels[name] = measure(
                cfg, batch, seconds / rounds, device, precision, compiled,
                profile_top if r == rounds - 1 else 0)
            print(f"[bench] round {r + 1}/{rounds} {name}: first step {first_s:.1f} s, "
                  f"{len(step_s)} steps, median {1000 * median_high(step_s):.1f} "
                  "ms", file=sys.stderr, flush=True)  # a run cut short still shows its steps
            times[name] += step_s
            first[name] = max(first[name], first_s)
            memory[name] = max(memory[name], peak_memory_bytes(device) / 2**20)
    median = {name: median_high(t) for name, t in times.items()}
    rows = []
    for name, cfg in configs.items():
        t, tokens = median[name], batch * cfg.context_length
        flops = flops_per_token(cfg, cfg.context_length) * tokens / t
        rows.append({"variant": name, "params": count_parameters(build_model(cfg))["total"],
                     "step_ms": 1000 * t, "tokens_per_s": tokens / t,
                     "step_time_vs_llama": t / median["llama"] if "llama" in median else None,
                     "gflops_per_s": flops / 1e9, "mfu": flops / peak,
                     "peak_memory_mib": memory[name],
                     "first_step_s": first[name],
                     **({"kernels": kernels[name]} if profile_top else {})})
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m workloads.lm.step_bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="micro")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=6.0, help="timing per variant, "
                        "spread over --rounds rounds")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--precision", choices=["auto", "bf16", "fp32"], default="fp32")
    parser.add_argument("--cem-kernel", choices=KERNELS,
                        default="auto", help="CEMAttention.kernel (auto: compiled FlexAttention "
                        "on a GPU, SDPA elsewhere; explicit: faster in bf16 on a CPU, scores "
                        "rounded to bf16; flex needs a GPU to train; triton: the Triton kernels, "
                        "on a CPU under TRITON_INTERPRET=1)")
    parser.add_argument("--compile", action="store_true", help="torch.compile every variant's "
                        "model and the loss (all alike); first_step_s is then the compile")
    parser.add_argument("--variants", type=lambda s: [v.strip() for v in s.split(",")],
                        help="comma-separated subset of: " + ", ".join(VARIANTS)
                        + " (default: all)")
    parser.add_argument("--profile", type=int, default=0, metavar="N",
                        help="also profile 2 steps of each variant and print its N longest "
                        "kernels (GPU) or operators (CPU)")
    parser.add_argument("--json-out", help="also write the rows to this JSON file")
    parser.add_argument("--stack", type=lambda s: [int(k) for k in s.split(",")],
                        help="comma-separated stack sizes K, 1 among them: trials per hour of "
                        "K trials trained as one stacked model against K = 1")
    parser.add_argument("--presets", type=lambda s: [p.strip() for p in s.split(",")],
                        default=["pico", "nano", "tiny"], help="with --stack: the sizes")
    parser.add_argument("--budget-scale", type=float, default=0.25,
                        help="with --stack: a trial's fraction of its Chinchilla budget")
    args = parser.parse_args(argv)
    presets = args.presets if args.stack else [args.preset]
    try:
        configs = {p: variant_configs(p, args.variants or (["llama", "cem-attn T=1"]
                                                          if args.stack else None))
                   for p in presets}
    except KeyError as e:
        parser.error(str(e.args[0]))
    if args.stack is not None and (1 not in args.stack or min(args.stack) < 1):
        parser.error(f"--stack needs K = 1 (the trials alone) and K >= 1, got {args.stack}")
    CEMAttention.kernel = args.cem_kernel
    reuse_freed_memory()  # as the trials' sessions do
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    precision = resolve_precision(args.precision)
    if args.stack:  # the trial stack's optimizer config: imported only here (see the docstring)
        from workloads.lm.stack_bench import stack_rows

        rows = stack_rows(presets, configs, sorted(args.stack), args.batch, args.seconds,
                          precision == "bf16", args.budget_scale)
        print(f"train steps (forward, backward, clipping, AdamW) of a batch of {args.batch}, "
              f"{precision} on {device_name(device)} ({torch.get_num_threads()} threads), a "
              f"trial at {args.budget_scale:g} of its Chinchilla budget")
        print(tabulate(rows, headers="keys", floatfmt=",.2f", intfmt=","))
        print(json.dumps(rows))
        return
    rows = run(args.preset, args.batch, args.seconds, device, precision, args.rounds,
               args.compile, args.variants, args.profile)
    cfg = ModelConfig.from_preset(args.preset)
    compiled = ", torch.compile" if args.compile else ""
    peak, source = peak_flops(device, precision)
    print(f"forward+backward, preset {args.preset} (d_model {cfg.d_model}, {cfg.n_layer} layers, "
          f"context {cfg.context_length}), batch {args.batch}, {precision} on {device_name(device)}"
          f" ({torch.get_num_threads()} threads){compiled}, MFU against {peak / 1e9:,.0f} "
          f"GFLOP/s ({source})")
    print(tabulate([{k: v for k, v in row.items() if k != "kernels"} for row in rows],
                   headers="keys", floatfmt=",.3f", intfmt=","))
    if any(row["mfu"] > 1 for row in rows):
        print("MFU above 100 %: the peak was measured in a slower moment than these steps ran "
              "(a shared machine); each bench run measures it again and keeps the higher",
              file=sys.stderr)
    for row in rows if args.profile else ():
        print(f"\n{row['variant']}: its {args.profile} longest "
              f"{'kernels' if device.type == 'cuda' else 'operators'}, of 2 profiled steps")
        print(format_kernels(row["kernels"]))
    print(json.dumps(rows))
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
