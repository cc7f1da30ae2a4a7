"""Decode step time per compiler target of the CPU kernels, against native, side by side.

    python bench/kernel_targets.py [--targets native x86-64-v4 x86-64-v3] [--rounds 2]

The kernel ladder (`mashbox kernels`) falls back from `native` to smaller targets where a
compiler cannot build native code; this measures what that costs. Each target runs in its own
process (MASHBOX_CPU_KERNELS=TARGET, built first if it is not yet: the compile time is
printed), with bench/step_profile.py's engine steps on the default model; targets take turns
for --rounds rounds, so a drifting machine shows in every column alike. Prints the minimum
step time per batch size and its ratio to native's in the same round.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).parent
ONE_TARGET = """
import json, sys, time
sys.path.insert(0, {here!r})
import step_profile
from mashbox.engine import cpu_kernels
t0 = time.perf_counter()
report = cpu_kernels.report()
built = time.perf_counter() - t0
engine = step_profile.prepare(step_profile.DEFAULT, {kind!r}, max({batches!r}))
out, position = {{}}, len(step_profile.PROMPT)
for batch in {batches!r}:
    out[batch] = min(step_profile.time_steps(engine, batch, position, {steps}))
    position += {steps} + 1
print(json.dumps({{"kernels": report.kernels, "fallback": report.fallback,
                  "load_s": built, "steps": out}}))
"""


def run_target(target: str, kind: str, batches: list[int], steps: int) -> dict:
    code = ONE_TARGET.format(here=str(HERE), kind=kind, batches=batches, steps=steps)
    env = {**os.environ, "MASHBOX_CPU_KERNELS": target}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--targets", nargs="+", default=["native", "x86-64-v4", "x86-64-v3"])
    parser.add_argument("--kind", default="int4a16", help="--decode-weights of the steps")
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 8])
    parser.add_argument("--steps", type=int, default=20, help="timed steps per batch size")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    print(f"{args.kind} decode steps, min of {args.steps}, load {os.getloadavg()}")
    for r in range(args.rounds):
        results = {t: run_target(t, args.kind, args.batches, args.steps) for t in args.targets}
        base = results[args.targets[0]]["steps"]
        for target, res in results.items():
            if res["fallback"]:
                print(f"  round {r + 1} {target:<15} no kernels: {res['fallback']}")
                continue
            cells = "  ".join(
                f"batch {b}: {s * 1e3:5.2f} ms ({s / base[b]:.3f}x)"
                for b, s in res["steps"].items()
            )
            print(
                f"  round {r + 1} {target:<15} {cells}  [{res['kernels']}, "
                f"load {res['load_s']:.1f} s]"
            )


if __name__ == "__main__":
    main()
