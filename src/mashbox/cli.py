"""The `mashbox` command line."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

import attrs
import cattrs

from . import __version__
from .options import ServeOptions
from .registry import DEFAULT_MODEL

DEFAULTS = ServeOptions()


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
    d = DEFAULTS
    run.add_argument("--host", default=d.host, help=f"address to bind (default {d.host})")
    run.add_argument("--port", type=int, default=d.port, help=f"port (default {d.port}; 0 = any)")
    run.add_argument(
        "--ctx", type=int, default=d.ctx, help="tokens per slot (default: the model's, up to 8192)"
    )
    run.add_argument(
        "--slots", type=int, default=d.slots, help=f"requests decoded together (default {d.slots})"
    )
    run.add_argument(
        "--models-dir",
        type=Path,
        default=d.models_dir,
        help="weights cache (default $MASHBOX_MODELS_DIR or ~/.cache/mashbox/models)",
    )
    run.add_argument("--device", default=d.device, help="cpu, cuda, cuda:N or auto (default)")
    run.add_argument(
        "--threads",
        type=int,
        default=d.threads,
        help="CPU threads: torch's, and the kernels' decode helpers (default: all cores)",
    )
    run.add_argument(
        "--prefill-chunk",
        type=int,
        default=d.prefill_chunk,
        help="prompt tokens prefilled per step, so long prompts never stall streams "
        f"(default {d.prefill_chunk})",
    )
    run.add_argument(
        "--stall-timeout",
        type=float,
        default=float(os.environ.get("MASHBOX_STALL_TIMEOUT", d.stall_timeout)),
        help="seconds a client's connection may take nothing while its answer waits, before it "
        f"is disconnected (default {d.stall_timeout:g}, or $MASHBOX_STALL_TIMEOUT)",
    )
    run.add_argument(
        "--decode-weights",
        choices=["auto", "float", "int8", "int4", "int4a16", "int4a8"],
        default=d.decode_weights,
        help="what decode steps read: int4 (CPU only: the GGUF's own Q4_0/Q4_1/Q8_0 blocks, "
        "exactly; int8 for other matrices), int4a16 / int4a8 (int4, the 4-bit blocks taking "
        "activations rounded to int16 / int8 per block of 32: faster; int4a8 is llama.cpp's "
        "rounding), int8 (every matrix int8 per channel), or float (the reference); int4a8 "
        "and int8 greedy text can part from float's at near-ties, see README (default auto: "
        "int4a16 on a CPU where mashbox's kernels build, float elsewhere)",
    )
    run.add_argument(
        "--kv-dtype",
        choices=["auto", "float16", "float32"],
        default=d.kv_dtype,
        help="what the KV cache holds on a CPU: float16 (half the memory, and half the bytes a "
        "decode step reads at long context; llama-server's default) or float32 (exact: keys and "
        "values as computed) (default auto: float16 where mashbox's kernels attend, the "
        "model's dtype elsewhere)",
    )
    run.add_argument(
        "--cache-ram",
        type=int,
        dest="cache_ram_mib",
        default=d.cache_ram_mib,
        metavar="MIB",
        help="host memory for saved prompt prefixes, LRU; 0 = off "
        f"(default {d.cache_ram_mib}, as llama-server's)",
    )
    run.add_argument(
        "--cache-dir",
        type=Path,
        default=d.cache_dir,
        metavar="DIR",
        help="keep prompt prefixes that repeat (an agent's system prompt and tools) on disk "
        "here, so a restarted server does not prefill them again (default: off)",
    )
    run.add_argument(
        "--cache-dir-size",
        type=int,
        dest="cache_dir_mib",
        default=d.cache_dir_mib,
        metavar="MIB",
        help=f"most disk --cache-dir holds, LRU (default {d.cache_dir_mib})",
    )
    run.add_argument(
        "--api-key-file",
        type=Path,
        default=d.api_key_file,
        help="keys clients must send: one 'KEY [TENANT]' a line (also $MASHBOX_API_KEY)",
    )
    run.add_argument(
        "--allowed-host",
        action="append",
        dest="allowed_hosts",
        default=list(d.allowed_hosts),
        metavar="NAME",
        help="another host name clients may use for this server (repeatable)",
    )
    run.add_argument(
        "--tenant-slots",
        type=int,
        default=d.tenant_slots,
        metavar="N",
        help="slots one tenant's requests may hold at once (default: an equal share of --slots "
        "among the key file's tenants, rounded up; 0 = no cap)",
    )
    run.add_argument(
        "--step-timeout",
        type=float,
        default=d.step_timeout,
        help="seconds one engine step may take before the engine counts as hung "
        f"(default {d.step_timeout:g})",
    )
    run.add_argument(
        "--decode-burst",
        dest="decode_burst_ms",
        type=float,
        default=d.decode_burst_ms,
        metavar="MS",
        help="decode steps the engine runs back to back, without the server between them, up "
        f"to this many ms (default {d.decode_burst_ms:g}): fewer server wake-ups a token, so "
        "more CPU decodes; streams get their tokens in bursts at most this long (0 = one "
        "step at a time)",
    )
    run.add_argument(
        "--ui",
        action="store_true",
        help="serve the MASHBOX Chat page on / (health stays on /health and /v1/health)",
    )
    run.add_argument(
        "--keep-alive",
        type=float,
        default=d.keep_alive,
        help=f"seconds an idle keep-alive connection stays open (default {d.keep_alive:g})",
    )
    run.add_argument(
        "--drain-timeout",
        type=float,
        default=d.drain_timeout,
        metavar="SECONDS",
        help="on SIGTERM, refuse new requests (503; /health says draining) and give running "
        "ones this long to finish before exiting (default 0: end them at once, as SIGINT)",
    )
    run.add_argument(
        "--vllm-metrics",
        action="store_true",
        help="/metrics also exports the load gauges under vLLM's names (vllm:num_requests_"
        "waiting, ...), so llm-d's endpoint picker can score this server",
    )
    sub.add_parser(
        "kernels",
        help="build the CPU kernels now (once per machine; scripts/setup.sh runs it) and say "
        "which compiler target is used and why others were not",
    )
    what = (
        "check a running server (mashbox or another): reproducible seeded sampling and "
        "protocol conformance; exits 1 when a case fails"
    )
    check = sub.add_parser("check", help=what, description=what)
    check.add_argument("url", help="the server's address, e.g. http://127.0.0.1:8000")
    check.add_argument("--model", help="the model to ask for (default: the first of /v1/models)")
    check.add_argument(
        "--api-key",
        default=os.environ.get("MASHBOX_API_KEY"),
        help="sent as Bearer and x-api-key (default $MASHBOX_API_KEY)",
    )
    check.add_argument("--seed", type=int, default=1234, help="the seed asked for (default 1234)")
    check.add_argument(
        "--restart-cmd",
        metavar="CMD",
        help="a shell command that restarts the server, returning once the old one has "
        "stopped; the check then waits for /health and asks for the seeded text again",
    )
    check.add_argument(
        "--timeout",
        type=float,
        default=120.0,
        help="seconds for one answer, and for the server to answer again after --restart-cmd "
        "(default 120)",
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
        from .launch import run

        if args.slots < 1:
            _parser().error("--slots must be at least 1")
        if args.ctx is not None and args.ctx < 16:
            _parser().error("--ctx must be at least 16")
        if args.tenant_slots is not None and args.tenant_slots < 0:
            _parser().error("--tenant-slots must be 0 (no cap) or more")
        if args.cache_ram_mib < 0:
            _parser().error("--cache-ram must be 0 (off) or more MiB")
        if args.cache_dir_mib < 1:
            _parser().error("--cache-dir-size must be at least 1 MiB")
        if args.decode_burst_ms < 0:
            _parser().error("--decode-burst must be 0 (one step at a time) or more ms")
        if args.drain_timeout < 0:
            _parser().error("--drain-timeout must be 0 (none) or more seconds")
        # Every option's flag has the option's name (dest): the values become ServeOptions.
        fields = attrs.fields_dict(ServeOptions)
        opts = cattrs.structure({name: getattr(args, name) for name in fields}, ServeOptions)
        return run(args.model, opts)
    if args.command == "kernels":
        return kernels()
    if args.command == "check":
        from .check.runner import check

        logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per request
        return check(
            args.url,
            model=args.model,
            api_key=args.api_key,
            seed=args.seed,
            restart_cmd=args.restart_cmd,
            timeout=args.timeout,
        )
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
