"""How soon a request starts beside a running stream: the latency of one-token completions
sent while another request decodes, with every engine step slowed to --step-ms so a step is
long next to HTTP. A request that joins the step queued behind the running one (decode-ahead)
answers one step sooner than one admitted in a step planned after it.

Builds the tests' tiny model (tests/tinymodels.py) and starts `mashbox run` on it. Compare
two revisions side by side with bench/against_rev.sh:

    ROUNDS=2 bash bench/against_rev.sh HEAD~1 bench/join_latency.py
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from support.serverproc import serving  # noqa: E402
from support.tinymodels import build_tiny_llama  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--step-ms", type=float, default=50)
    ap.add_argument("--requests", type=int, default=15)
    args = ap.parse_args()
    step_s = args.step_ms / 1000
    with tempfile.TemporaryDirectory() as tmp:
        model = build_tiny_llama(Path(tmp), quantize=True)
        env = {"MASHBOX_FAULTS": f"slow={step_s}"}
        with serving(str(model), "--ctx", "2048", "--slots", "2", "--threads", "1", env=env) as p:
            url = p.url
            long = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 100000}
            long["ignore_eos"] = True
            stream = threading.Thread(
                target=lambda: httpx.post(url + "/v1/chat/completions", json=long, timeout=600),
                daemon=True,
            )
            stream.start()
            time.sleep(1)
            latencies = []
            for i in range(args.requests):
                time.sleep(step_s * (i % 7) / 7)  # arrive at every point of a step
                t0 = time.monotonic()
                r = httpx.post(url + "/v1/completions", json={"prompt": f"q{i}", "max_tokens": 1})
                r.raise_for_status()
                latencies.append((time.monotonic() - t0) * 1000)
    q = statistics.quantiles(latencies, n=10)
    print(
        f"{args.requests} one-token requests beside a stream, {args.step_ms:g} ms steps: "
        f"median {statistics.median(latencies):.0f} ms, p10 {q[0]:.0f}, p90 {q[-1]:.0f} "
        f"({statistics.median(latencies) / args.step_ms:.2f} steps)"
    )


if __name__ == "__main__":
    main()
