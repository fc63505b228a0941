"""What CEM attention's GPU kernel spends on the shared KQ diagonal's scores, per call.

    python -m workloads.lm.attention_bench [--preset cem-134m] [--batch 8] [--json-out FILE]

At a preset's sizes (batch x n_head x context_length x d_head, bf16, as ``cem-134m`` trains),
times one call of compiled FlexAttention, forward alone and forward with backward, for each way
of reading c_ij = h~_jᵀ D u_i / sqrt(d_head), the (B, T, T) term the shared diagonal adds to
every head's scores (``workloads.models.flex``):

- ``no shared scores``: the ALiBi ``score_mod`` alone, the floor under any read of c_ij;
- ``c bf16, head-major grid``: c read per score, with the heads as the kernel's batch
  dimension, as ``alibi_flex_attention`` calls it: the programs in flight are one sequence's
  heads, which share each tile of c in the L2 cache;
- ``c bf16, batch-major grid``: the same with (B, K, T, E) as given, so that the programs in
  flight are one head's, and every head reads all of c again;
- ``c fp32, batch-major grid``: that with an fp32 copy of c (twice the bytes);
- ``c bf16, head-major, no gradient``: c read but not differentiated, so the backward makes no
  atomic adds into its gradient;
- ``alibi_flex_attention``: the whole function (the head-major kernel and the own key's merge);
- ``c product (u D) h~ᵀ``: the (B, T, D) x (B, D, T) product that computes c, outside the kernel;
- ``Triton kernel``: ``models.kernels.cem_attention`` (``CEMAttention.kernel: triton``), the
  whole step's attention in its own kernels, c from its factors (u D, h~) and the own key
  inside; ``Triton kernel (no shared scores)``: the same without c.

``--sweep`` times instead the floors of any attention at these sizes (``SDPA flash, causal``:
Llama's kernel; ``SDPA cuDNN, causal``; ``FlexAttention, causal``: no ``score_mod``) and, for
the head-major kernel that trains, one row per set of FlexAttention tuning options (``SWEEP``:
flags, forward and backward tiles, as ``CEMLAB_FLEX_KERNEL_OPTIONS`` takes them), then one row
merging each group's best that beats the default; ``--best-out FILE`` writes the fastest set
(forward with backward) as that variable's JSON.

Each time is Triton's ``do_bench`` (the median of repeated calls, the L2 cache cleared before
each); the first call, which compiles, is timed apart. Needs a CUDA GPU: FlexAttention trains
only there.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import sys
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from tabulate import tabulate
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.flex_attention import AuxRequest

from workloads.models import ModelConfig
from workloads.models.flex import (
    _compiled_flex_attention,
    alibi_flex_attention,
    strictly_causal_block_mask,
)
from workloads.models.position import alibi_slopes


def inputs(cfg: ModelConfig, batch: int, device: torch.device, dtype: torch.dtype,
           seed: int = 0) -> dict[str, torch.Tensor]:
    """Random q, k (= v) (B, K, T, E) as ``CEMAttention`` makes them (views of (B, T, K, E)),
    a = u D (B, T, D), h~ (B, T, D), the slopes (K,), self/cross biases (1,), each needing a
    gradient but the slopes."""
    gen = torch.Generator(device).manual_seed(seed)
    b, t, k, e, d = batch, cfg.context_length, cfg.n_head, cfg.d_head, cfg.d_model

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device=device).to(dtype)

    return {"q": rand(b, t, k, e).transpose(1, 2).requires_grad_(),
            "k": rand(b, t, k, e).transpose(1, 2).requires_grad_(),
            "a": rand(b, t, d).requires_grad_(), "h": rand(b, t, d).requires_grad_(),
            "slopes": alibi_slopes(k).to(device),
            "self_bias": torch.zeros(1, device=device, dtype=dtype, requires_grad=True),
            "cross_bias": torch.zeros(1, device=device, dtype=dtype, requires_grad=True)}


def _tiles(prefix: str, blocks: tuple[int, ...], warps: int, stages: int) -> dict:
    names = ("BLOCK_M", "BLOCK_N") if prefix == "fwd" else ("BLOCK_M1", "BLOCK_N1", "BLOCK_M2",
                                                             "BLOCK_N2")
    return {**{f"{prefix}_{n}": b for n, b in zip(names, blocks, strict=True)},
            f"{prefix}_num_warps": warps, f"{prefix}_num_stages": stages}


# ``{group: {row: kernel options}}`` for ``--sweep``: each row against Inductor's default (on an
# H100 in bf16 at d_head 64: forward tiles 128 x 128, 4 warps, 3 stages; backward 64/128/128/64,
# 8 warps, 3 stages). Tiles divide the block mask's 128.
SWEEP: dict[str, dict[str, dict]] = {
    "flags": {"blocks contiguous": {"BLOCKS_ARE_CONTIGUOUS": True},
              "dq written in the dk loop": {"WRITE_DQ": False},
              "TMA loads": {"USE_TMA": True}},
    "forward": {"fwd 128x64 w4 s3": _tiles("fwd", (128, 64), 4, 3),
                "fwd 64x64 w4 s3": _tiles("fwd", (64, 64), 4, 3),
                "fwd 128x128 w8 s3": _tiles("fwd", (128, 128), 8, 3)},
    "backward": {"bwd 64x64 w4 s3": _tiles("bwd", (64, 64, 64, 64), 4, 3),
                 "bwd 32x128 w4 s3": _tiles("bwd", (32, 128, 128, 32), 4, 3),
                 "bwd 64x128 w4 s2": _tiles("bwd", (64, 128, 128, 64), 4, 2)},
}


def floors(x: dict[str, torch.Tensor], attend: Callable) -> dict[str, Callable[[], torch.Tensor]]:
    """``{row: call}``: causal attention over q, k (= v) of ``x`` with no bias at all, by
    SDPA's flash and cuDNN kernels and by FlexAttention (``attend``) with no ``score_mod``."""
    q, k = x["q"], x["k"]

    def sdpa(backend: SDPBackend) -> torch.Tensor:
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, k, is_causal=True)

    mask = strictly_causal_block_mask(q.shape[-2], q.device)
    return {"SDPA flash, causal": lambda: sdpa(SDPBackend.FLASH_ATTENTION),
            "SDPA cuDNN, causal": lambda: sdpa(SDPBackend.CUDNN_ATTENTION),
            "FlexAttention, causal": lambda: attend(q, k, k, block_mask=mask)}


def cases(x: dict[str, torch.Tensor], attend: Callable,
          options: dict[str, dict] | None = None) -> dict[str, Callable[[], torch.Tensor]]:
    """``{row: call}``: each call computes its row's output from ``x`` (``inputs``) with
    ``attend`` (FlexAttention, compiled on a GPU), c included, so that a backward from it
    reaches every input it reads. With ``options`` (``{row: kernel options}``), the rows are
    instead the head-major kernel with c under each set of options."""
    q, k, slopes = x["q"], x["k"], x["slopes"]
    scale = 1 / math.sqrt(q.shape[-1])
    mask = strictly_causal_block_mask(q.shape[-2], q.device)

    def shared() -> torch.Tensor:  # (B, T, T)
        return x["a"] @ x["h"].transpose(-1, -2) * scale

    def kernel(c: torch.Tensor | None, head_major: bool, tuning: dict | None = None,
               ) -> torch.Tensor:
        def score_mod(score, z, h, q_idx, kv_idx):
            head, batch = (z, h) if head_major else (h, z)
            biased = score - slopes[head] * (q_idx - kv_idx)
            return biased if c is None else biased + c[batch, q_idx, kv_idx]

        qkv = [t.transpose(0, 1) if head_major else t for t in (q, k, k)]
        out, _ = attend(*qkv, score_mod=score_mod, scale=scale, block_mask=mask,
                        return_aux=AuxRequest(lse=True), kernel_options=tuning or None)
        return out.transpose(0, 1) if head_major else out

    def kernel_with_c(tuning: dict) -> torch.Tensor:
        return kernel(shared(), head_major=True, tuning=tuning)

    if options is not None:
        return {name: functools.partial(kernel_with_c, tuning=tuning)
                for name, tuning in options.items()}
    def triton_kernel(with_c: bool) -> torch.Tensor:
        from workloads.models.kernels.cem_attention import cem_attention  # imports triton

        factors = (x["a"], x["h"]) if with_c else (None, None)
        return cem_attention(q, k, k, slopes, x["self_bias"], x["cross_bias"], scale, *factors)

    return {
        "no shared scores": lambda: kernel(None, head_major=True),
        "c bf16, head-major grid": lambda: kernel(shared(), head_major=True),
        "c bf16, batch-major grid": lambda: kernel(shared(), head_major=False),
        "c fp32, batch-major grid": lambda: kernel(shared().float(), head_major=False),
        "c bf16, head-major, no gradient": lambda: kernel(shared().detach(), head_major=True),
        "alibi_flex_attention": lambda: alibi_flex_attention(
            q, k, k, slopes, x["self_bias"], x["cross_bias"], scale, shared()),
        "c product (u D) h~ᵀ": shared,
        "Triton kernel": lambda: triton_kernel(with_c=True),
        "Triton kernel (no shared scores)": lambda: triton_kernel(with_c=False),
    }


def time_call(call: Callable[[], torch.Tensor], leaves: list[torch.Tensor], backward: bool,
              ) -> tuple[float, float]:
    """(first call's seconds, median ms per call) of ``call``, or of it and the gradient of its
    output's sum in ``leaves`` when ``backward``, by ``triton.testing.do_bench``."""
    from triton.testing import do_bench

    def run() -> None:
        out = call()
        if backward:
            torch.autograd.grad(out.sum(), leaves, allow_unused=True)

    start = time.perf_counter()
    run()
    torch.cuda.synchronize()
    first = time.perf_counter() - start
    return first, do_bench(run, warmup=10, rep=50, return_mode="median")


def _row(name: str, call: Callable[[], torch.Tensor], leaves: list[torch.Tensor],
         **extra) -> dict:
    first_fwd, fwd = time_call(call, leaves, backward=False)
    first_bwd, both = time_call(call, leaves, backward=True)
    print(f"[bench_attention] {name}: {fwd:.3f} ms forward, {both:.3f} ms with backward "
          f"(compiled in {first_fwd + first_bwd:.1f} s)", file=sys.stderr, flush=True)
    return {"case": name, "forward_ms": fwd, "forward_backward_ms": both,
            "first_calls_s": first_fwd + first_bwd, **extra}


def _tried(name: str, call: Callable[[], torch.Tensor], leaves: list[torch.Tensor],
           **extra) -> dict | None:
    """``_row``, or None (with the reason on stderr) where the kernel does not build or run
    with these options on this card."""
    try:
        return _row(name, call, leaves, **extra)
    except Exception as error:  # noqa: BLE001 - a candidate that fails is a result, not a stop
        print(f"[bench_attention] {name}: failed: {type(error).__name__}: "
              f"{str(error).splitlines()[0] if str(error) else ''}", file=sys.stderr, flush=True)
        return None


def merged_options(timed: dict[str, float]) -> dict:
    """The union of each ``SWEEP`` group's fastest option set among those faster than
    ``timed["default options"]`` (``timed``: ms per row name; a row missing failed), or {}."""
    default = timed.get("default options", math.inf)
    merged = {}
    for group in SWEEP.values():
        better = {n: timed[n] for n in group if timed.get(n, math.inf) < default}
        if better:
            merged |= group[min(better, key=better.get)]
    return merged


def sweep(x: dict[str, torch.Tensor], attend: Callable, leaves: list[torch.Tensor],
          ) -> list[dict]:
    """The rows of ``--sweep``: the floors, then the head-major kernel with c under the default
    and each ``SWEEP`` option set, then under the merge of each group's fastest set that beats
    the default (forward with backward), when one does."""
    rows = [r for name, call in floors(x, attend).items() if (r := _tried(name, call, leaves))]
    tuned = {"default options": {}} | {n: o for group in SWEEP.values() for n, o in group.items()}
    timed = {}
    for name, call in cases(x, attend, tuned).items():
        if row := _tried(name, call, leaves, kernel_options=tuned[name]):
            rows.append(row)
            timed[name] = row["forward_backward_ms"]
    if merged := merged_options(timed):
        call = cases(x, attend, {"merged": merged})["merged"]
        if row := _tried("merged best of each group", call, leaves, kernel_options=merged):
            rows.append(row)
    return rows


def run(preset: str, batch: int, with_sweep: bool = False,
        only: list[str] | None = None) -> list[dict]:
    """One row per ``cases`` entry at ``preset``'s sizes on the GPU, in bf16 (``only``: those
    named, in ``cases``' order; ``with_sweep``: the rows of ``sweep`` instead): forward ms,
    forward+backward ms, each relative to the first row timed (``no shared scores``; in a sweep
    ``SDPA flash, causal``), and the first calls' seconds.

    Raises:
        ValueError: a name in ``only`` that is no row of ``cases``.
    """
    torch._dynamo.config.recompile_limit = 64  # one FlexAttention compile per row and mode
    cfg = ModelConfig.from_preset(preset)
    x = inputs(cfg, batch, torch.device("cuda"), torch.bfloat16)
    leaves = [t for t in x.values() if t.requires_grad]
    attend = _compiled_flex_attention()
    calls = cases(x, attend)
    if unknown := set(only or ()) - set(calls):
        raise ValueError(f"--cases: no row named {sorted(unknown)}; the rows: {list(calls)}")
    rows = (sweep(x, attend, leaves) if with_sweep
            else [_row(name, call, leaves) for name, call in calls.items()
                  if not only or name in only])
    floor = rows[0]
    for row in rows:
        row["forward_vs_floor"] = row["forward_ms"] / floor["forward_ms"]
        row["forward_backward_vs_floor"] = row["forward_backward_ms"] / floor["forward_backward_ms"]
    return rows


def best_options(rows: list[dict]) -> dict:
    """The kernel options of the fastest (forward with backward) swept row of ``rows``."""
    swept = [row for row in rows if "kernel_options" in row]
    return min(swept, key=lambda row: row["forward_backward_ms"])["kernel_options"] if swept else {}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m workloads.lm.attention_bench",
                                     description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="cem-134m")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--json-out", help="also write the rows to this JSON file")
    parser.add_argument("--cases", type=lambda s: [c.strip() for c in s.split(",")],
                        help="time only these rows (comma-separated names, as printed)")
    parser.add_argument("--sweep", action="store_true",
                        help="time the floors and the kernel tuning options' rows instead")
    parser.add_argument("--best-out", help="write the fastest swept kernel options (JSON, as "
                        "CEMLAB_FLEX_KERNEL_OPTIONS takes them) to this file")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("error: python -m workloads.lm.attention_bench needs a CUDA GPU (FlexAttention "
                 "compiles and trains only there)")
    cfg = ModelConfig.from_preset(args.preset)
    rows = run(args.preset, args.batch, with_sweep=args.sweep or bool(args.best_out),
               only=args.cases)
    print(f"one CEM attention kernel call, preset {args.preset}: batch {args.batch} x "
          f"{cfg.n_head} heads x {cfg.context_length} tokens x d_head {cfg.d_head}, bf16, on "
          f"{torch.cuda.get_device_name()} (torch {torch.__version__})")
    print(tabulate([{k: v for k, v in row.items() if k != "kernel_options"} for row in rows],
                   headers="keys", floatfmt=",.3f"))
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(rows, f, indent=2)
    if args.best_out:
        best = best_options(rows)
        with open(args.best_out, "w") as f:
            json.dump(best, f)
        print(f"fastest kernel options: {json.dumps(best)}")


if __name__ == "__main__":
    main()
