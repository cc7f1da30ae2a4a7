"""The `mashbox` command line."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from . import __version__
from .prompt_cache import DEFAULT_CACHE_RAM_MIB
from .registry import DEFAULT_MODEL


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mashbox", description=__doc__)
    parser.add_argument("--version", action="version", version=f"mashbox {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="serve one model over HTTP")
    run.add_argument(
        "model",
        nargs="?",
        default=DEFAULT_MODEL,
        help=f"a model id from models.json, a .gguf file or an HF folder (default {DEFAULT_MODEL})",
    )
    run.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    run.add_argument("--port", type=int, default=8000, help="port (default 8000; 0 = any free)")
    run.add_argument(
        "--ctx", type=int, default=None, help="tokens per slot (default: the model's, at most 8192)"
    )
    run.add_argument("--slots", type=int, default=4, help="requests decoded together (default 4)")
    run.add_argument(
        "--models-dir",
        type=Path,
        default=None,
        help="weights cache (default $MASHBOX_MODELS_DIR or ~/.cache/mashbox/models)",
    )
    run.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto (default)")
    run.add_argument(
        "--threads", type=int, default=0, help="torch CPU threads (default: all cores)"
    )
    run.add_argument(
        "--prefill-chunk",
        type=int,
        default=256,
        help="prompt tokens prefilled per step, so long prompts never stall streams (default 256)",
    )
    run.add_argument(
        "--stall-timeout",
        type=float,
        default=float(os.environ.get("MASHBOX_STALL_TIMEOUT", 30)),
        help="seconds a streaming client may read nothing before it is dropped (default 30)",
    )
    run.add_argument(
        "--decode-weights",
        choices=["auto", "float", "int8", "int4", "int4a16", "int4a8"],
        default="auto",
        help="what decode steps read: int4 (CPU only: the GGUF's own Q4_0/Q4_1/Q8_0 blocks, "
        "exactly; int8 for other matrices), int4a16 / int4a8 (int4, the 4-bit blocks taking "
        "activations rounded to int16 / int8 per block of 32: faster; int4a8 is llama.cpp's "
        "rounding), int8 (every matrix int8 per channel), or float (the reference); int4a8 "
        "and int8 greedy text can part from float's at near-ties, see README (default auto: "
        "int4a16 on a CPU where mashbox's kernels build, float elsewhere)",
    )
    run.add_argument(
        "--cache-ram",
        type=int,
        default=DEFAULT_CACHE_RAM_MIB,
        metavar="MIB",
        help="host memory for saved prompt prefixes, LRU; 0 = off "
        f"(default {DEFAULT_CACHE_RAM_MIB}, as llama-server's)",
    )
    run.add_argument(
        "--api-key-file",
        type=Path,
        default=None,
        help="keys clients must send: one 'KEY [TENANT]' a line (also $MASHBOX_API_KEY)",
    )
    run.add_argument(
        "--allowed-host",
        action="append",
        default=[],
        metavar="NAME",
        help="another host name clients may use for this server (repeatable)",
    )
    run.add_argument(
        "--tenant-slots",
        type=int,
        default=None,
        metavar="N",
        help="slots one tenant's requests may hold at once (default: an equal share of --slots "
        "among the key file's tenants, rounded up; 0 = no cap)",
    )
    run.add_argument(
        "--step-timeout",
        type=float,
        default=120.0,
        help="seconds one engine step may take before the engine counts as hung (default 120)",
    )
    run.add_argument(
        "--ui",
        action="store_true",
        help="serve the MASHBOX Chat page on / (health stays on /health and /v1/health)",
    )
    run.add_argument(
        "--keep-alive",
        type=float,
        default=5.0,
        help="seconds an idle keep-alive connection stays open (default 5)",
    )
    sub.add_parser(
        "kernels",
        help="build the CPU kernels now (once per machine; scripts/setup.sh runs it) and say "
        "which compiler target is used and why others were not",
    )
    return parser


def kernels() -> int:
    """Walk the kernel ladder and print it; 1 where a machine that can build them did not."""
    from .engine import cpu_kernels, kernel_build

    report = cpu_kernels.report()
    print(f"compiler: {kernel_build.compiler() or 'none'}")
    print(f"cache: {kernel_build.root()}")
    for a in report.attempts:
        took = f"{a.seconds:6.1f} s" if a.seconds else " " * 8
        print(f"  {a.target:<15} {a.outcome:<14} {took}  {a.why or a.where}")
    if report.chosen is not None:
        print(f"using: {report.kernels}")
        return 0
    print(f"none: {report.fallback}", file=sys.stderr)
    return 1 if kernel_build.machine_lacks() is None else 0


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="mashbox: %(message)s")
    logging.getLogger("hypercorn.error").setLevel(logging.WARNING)
    if args.command == "run":
        from .serve import ServeOptions, run

        if args.slots < 1:
            _parser().error("--slots must be at least 1")
        if args.ctx is not None and args.ctx < 16:
            _parser().error("--ctx must be at least 16")
        if args.tenant_slots is not None and args.tenant_slots < 0:
            _parser().error("--tenant-slots must be 0 (no cap) or more")
        if args.cache_ram < 0:
            _parser().error("--cache-ram must be 0 (off) or more MiB")
        opts = ServeOptions(
            host=args.host,
            port=args.port,
            ctx=args.ctx,
            slots=args.slots,
            models_dir=args.models_dir,
            device=args.device,
            threads=args.threads,
            prefill_chunk=args.prefill_chunk,
            stall_timeout=args.stall_timeout,
            step_timeout=args.step_timeout,
            keep_alive=args.keep_alive,
            api_key_file=args.api_key_file,
            cache_ram_mib=args.cache_ram,
            decode_weights=args.decode_weights,
            allowed_hosts=tuple(args.allowed_host),
            ui=args.ui,
            tenant_slots=args.tenant_slots,
        )
        return run(args.model, opts)
    if args.command == "kernels":
        return kernels()
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
