"""``workloads.lm.step_bench``'s rows with CEM attention on a chosen kernel, any value of
``CEMAttention.kernel`` (``workloads.models.cem.KERNELS``; the bench's own ``--cem-kernel``
offers those it had before the Triton kernel):

    python3 infra/gpu/kernel_bench.py --kernel triton [--preset llama-134m]
        [--variants "cem-best T=2"] [--precision bf16] [--compile] [--rounds 1] [--seconds 3]
        [--profile N] [--json-out FILE]

Prints step_bench's table (a ``kernel`` column added) and, with ``--profile``, each variant's
longest kernels; ``--json-out`` writes the rows.
"""

from __future__ import annotations

import argparse
import json

import torch
from tabulate import tabulate

from workloads.core.precision import resolve_precision
from workloads.lm import step_bench
from workloads.models.cem import KERNELS, CEMAttention
from workloads.runtime.timing import format_kernels


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kernel", choices=KERNELS, default="triton")
    parser.add_argument("--preset", default="llama-134m")
    parser.add_argument("--variants", default="cem-best T=2",
                        type=lambda s: [v.strip() for v in s.split(",")])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--precision", choices=["auto", "bf16", "fp32"], default="bf16")
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--profile", type=int, default=0, metavar="N")
    parser.add_argument("--json-out")
    args = parser.parse_args(argv)
    CEMAttention.kernel = args.kernel
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    rows = step_bench.run(args.preset, args.batch, args.seconds, device,
                          resolve_precision(args.precision), args.rounds, args.compile,
                          args.variants, args.profile)
    for row in rows:  # the variants without CEM attention run no CEM kernel
        cem = step_bench.VARIANTS[row["variant"]].get("attention") == "cem"
        row["kernel"] = args.kernel if cem else "-"
    print(tabulate([{k: v for k, v in row.items() if k != "kernels"} for row in rows],
                   headers="keys", floatfmt=",.3f", intfmt=","))
    for row in rows if args.profile else ():
        print(f"\n{row['variant']} ({args.kernel}): its {args.profile} longest kernels")
        print(format_kernels(row["kernels"]))
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
