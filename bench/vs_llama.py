"""Side-by-side: mashbox and llama.cpp (llama-cpp-python's server, or llama-server) on the
same GGUF.

Installs llama-cpp-python into its own venv on first use (a native CPU build of llama.cpp),
or runs a llama-server binary given with --llama-server; then starts both servers and lets
them take turns (--rounds, the order flipping each round; the idle one sleeps), measuring
decode tok/s through HTTP with decode_http.py's client and time to first token on a long
cold prompt. The table holds each server's medians, and its ratio column is mashbox /
baseline for rates and baseline / mashbox for times (rows ending ", s"), so above 1 always
means mashbox is better. The targets take the median of each round's paired ratio, printed
beside their range: this host's speed moves by tens of percent within minutes.

    .venv/bin/python bench/vs_llama.py                  # default model, 1/4/8 streams + TTFT
    .venv/bin/python bench/vs_llama.py --server-args "--decode-weights float"
    .venv/bin/python bench/vs_llama.py --install-only   # just build llama-cpp-python
    .venv/bin/python bench/vs_llama.py --llama-server PATH/llama-server   # llama.cpp's own
    .venv/bin/python bench/vs_llama.py --llama-server PATH --model qwen2.5-coder-0.5b-instruct
    .venv/bin/python bench/vs_llama.py --llama-server PATH --model qwen2.5-coder-0.5b-instruct \
        --streams 1 --long-decode 16000    # also: decoding after an agent-sized prompt

After the table: issue 28's targets (vs_llama_targets.py), each ratio against its target,
and the roofline: mashbox's 1-stream rate as a share of the machine's limit (measured read
bandwidth over the bytes one decode step reads).

llama-server is built from the llama.cpp sources in llama-cpp-python's sdist (docs/NOTES.md:
`cmake -B build -DGGML_NATIVE=ON -DLLAMA_CURL=OFF` then `cmake --build build --target
llama-server`); it runs one slot per stream (`-np`), continuous batching, and honours
`ignore_eos` itself.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import decode_http  # puts tests/ on sys.path for serverproc
import httpx
import trio
import vs_llama_targets

BENCH = Path(__file__).resolve().parent
LLAMA_PACKAGE = "llama-cpp-python[server]"


def venv_python(venv: Path) -> Path:
    return venv / "bin" / "python"


def has_llama(venv: Path) -> bool:
    py = venv_python(venv)
    if not py.exists():
        return False
    check = [str(py), "-c", "import llama_cpp, llama_cpp.server"]
    return subprocess.run(check, capture_output=True).returncode == 0


def build_env(venv: Path) -> dict:
    """Environment for pip's build of llama.cpp: a native CPU build on all cores here."""
    if not (shutil.which("c++") or shutil.which("g++")):
        raise SystemExit("no C++ compiler (c++/g++) on PATH: llama-cpp-python builds from source")
    env = dict(os.environ)
    env["CMAKE_ARGS"] = env.get("CMAKE_ARGS", "-DGGML_NATIVE=ON")
    env["CMAKE_BUILD_PARALLEL_LEVEL"] = str(os.cpu_count() or 2)
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env['PATH']}"  # the venv's cmake, if installed
    return env


def install_llama(venv: Path) -> float:
    """Create the venv and build llama-cpp-python into it; return the seconds it took."""
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    log = venv / "install.log"
    print(f"installing {LLAMA_PACKAGE} into {venv} (log: {log}); the build takes a while")
    pip = [str(venv_python(venv)), "-m", "pip", "install"]
    env = build_env(venv)
    with open(log, "w") as out:
        # PyPI serves only the sdist: pip runs cmake, which must exist before the build.
        if not shutil.which("cmake"):
            subprocess.run([*pip, "cmake"], check=True, stdout=out, stderr=subprocess.STDOUT)
        done = subprocess.run([*pip, "-v", LLAMA_PACKAGE], env=env, stdout=out, stderr=out)
    if done.returncode != 0:
        raise SystemExit(f"pip install {LLAMA_PACKAGE} failed; see {log}")
    seconds = time.perf_counter() - t0
    (venv / "install-seconds").write_text(f"{seconds:.0f}\n")  # for later runs' reports
    print(f"installed {LLAMA_PACKAGE} in {seconds:.0f} s")
    return seconds


def ensure_llama(venv: Path) -> None:
    """Install llama-cpp-python unless the venv already has it."""
    if not has_llama(venv):
        install_llama(venv)
        return
    took = venv / "install-seconds"
    when = f"; its install took {took.read_text().strip()} s" if took.exists() else ""
    print(f"llama-cpp-python already in {venv}{when}")


# Dead ends of a turn in common chat vocabularies; those that are one token in this GGUF are
# banned on llama-cpp-python, which drops mashbox's ignore_eos field and stops at any of them.
END_MARKERS = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|end_of_text|>", "<end_of_turn>")
# llama-server on issue 13's machine, as the issue quotes it (pp512 for prefill).
REFERENCE = {"1 stream": 86, "4 streams total": 109, "8 streams total": 135, "prefill": 243}
SEA = ("north", "east", "south", "west", "north-east", "south-east", "south-west", "north-west")
DEFAULT_MODEL = "smollm2-135m-instruct"  # the REFERENCE row's and most targets' model
TOKENS_PER_SENTENCE = 30  # of long_prompt's sentences in SmolLM2's tokenizer, measured


def model_file(name: str) -> Path:
    """The GGUF both servers load: mashbox's registry resolves (and fetches) the id."""
    from mashbox import registry

    return registry.fetch(registry.resolve(name), registry.default_models_dir())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_llama(args, model: Path, log: Path) -> tuple[subprocess.Popen, str]:
    """Start llama-cpp-python's OpenAI server; requests queue rather than interrupt."""
    port = free_port()
    # interrupt_requests (default on) ends a running stream when another request arrives.
    cmd = [
        str(venv_python(args.llama_venv)), "-m", "llama_cpp.server", "--model", str(model),
        "--n_ctx", str(args.ctx), "--n_threads", str(args.threads),
        "--n_threads_batch", str(args.threads), "--port", str(port),
        "--interrupt_requests", "False",
    ]  # fmt: skip
    return launch(cmd, port, "/v1/models", log)


def start_llama_server(args, model: Path, log: Path) -> tuple[subprocess.Popen, str]:
    """Start llama.cpp's own server: a slot per stream, each with the whole --ctx."""
    port, slots = free_port(), max(args.streams)
    cmd = [
        str(args.llama_server), "-m", str(model), "-c", str(args.ctx * slots), "-np", str(slots),
        "-t", str(args.threads), "-tb", str(args.threads), "--host", "127.0.0.1",
        "--port", str(port),
    ]  # fmt: skip
    return launch(cmd, port, "/health", log)


def launch(cmd: list[str], port: int, ready: str, log: Path) -> tuple[subprocess.Popen, str]:
    """Start a baseline server, logging to `log`; return it once `ready` answers 200."""
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=out)
    url = f"http://127.0.0.1:{port}"
    wait_http(url + ready, proc, log)
    return proc, url


def wait_http(url: str, proc: subprocess.Popen, log: Path, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the baseline server exited; see {log}")
        try:
            if httpx.get(url, timeout=5).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise SystemExit(f"the baseline server was not ready in {timeout} s; see {log}")


@contextlib.contextmanager
def one_slot_each(llama_server: Path, model: str, ctx: int, threads: int, name: str):
    """mashbox and llama-server on the same GGUF (the registry id `model`), one slot of `ctx`
    tokens each and `threads` threads; yields their URLs (mashbox's, llama-server's) and
    stops both. llama-server's log goes to a temporary folder named after `name`."""
    from mashbox.registry import default_models_dir, known_models
    from support.serverproc import ServerProcess

    gguf = default_models_dir() / model / known_models()[model]["filename"]
    logs = Path(tempfile.mkdtemp(prefix=f"{name}-"))
    mashbox = ServerProcess(model, "--ctx", str(ctx), "--slots", "1")
    port = free_port()
    llama_cmd = [
        str(llama_server), "-m", str(gguf), "-c", str(ctx), "-np", "1",
        "-t", str(threads), "-tb", str(threads), "--host", "127.0.0.1", "--port", str(port),
    ]  # fmt: skip
    try:
        llama, llama_url = launch(llama_cmd, port, "/health", logs / "llama.log")
        try:
            yield mashbox.wait_ready(900), llama_url
        finally:
            stop(llama)
    finally:
        mashbox.stop()


def stop(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(5)


def end_token_bias(url: str) -> dict:
    """logit_bias banning the end markers that are single tokens in the served vocabulary."""
    bias = {}
    for marker in END_MARKERS:
        ids = httpx.post(url + "/extras/tokenize", json={"input": marker}).json()["tokens"]
        if len(ids) == 1:
            bias[str(ids[0])] = -1e9
    return bias


def stream_rates(results: list[dict]) -> dict:
    """Client-clock rates, the same for both servers (llama-cpp-python sends no timings)."""
    counts = [r["usage"]["completion_tokens"] if r["usage"] else r["pieces"] for r in results]
    # Decode speed: every token after a stream's first, over first-to-last token time.
    per_stream = [(c - 1) / (r["last"] - r["first"]) for c, r in zip(counts, results, strict=True)]
    wall = max(r["last"] for r in results) - min(r["first"] for r in results)
    spans = sorted((r["first"], r["last"]) for r in results)
    overlap = any(b[0] < a[1] for a, b in zip(spans, spans[1:], strict=False))
    return {
        "per_stream": sum(per_stream) / len(results),
        "total": sum(c - 1 for c in counts) / wall,
        "counts": counts,
        # A server that queues streams shows it here, not in its per-stream rate.
        "first_spread": max(r["first"] for r in results) - min(r["first"] for r in results),
        "one_at_a_time": len(results) > 1 and not overlap,
    }


def long_prompt(nonce: int, tokens: int) -> str:
    """About `tokens` tokens of plain prose, opening with nonce so no cached prefix applies."""
    lines = [f"{nonce}: the keeper's log."]  # digits are single tokens: differs at token 1
    for i in range(tokens // TOKENS_PER_SENTENCE):
        lines.append(
            f"Entry {i}: the keeper saw wind from the {SEA[i % 8]}, waves of {i % 7 + 1} feet,"
            f" and {(i * 37) % 101} gulls near the rocks."
        )
    return " ".join(lines) + "\nSummarise the log in one line:"


def time_to_first_token(url: str, prompt: str) -> tuple[float, int]:
    """Seconds until a 1-token completion of prompt is back, and the prompt's token count."""
    body = {"prompt": prompt, "max_tokens": 1, "temperature": 0}
    t0 = time.perf_counter()
    r = httpx.post(url + "/v1/completions", json=body, timeout=900)
    seconds = time.perf_counter() - t0
    r.raise_for_status()
    return seconds, r.json()["usage"]["prompt_tokens"]


def decode_round(url: str, args, extra: dict) -> dict:
    """One stream_rates per stream count: the same requests for either server."""
    out = {}
    for n in args.streams:
        out[n] = stream_rates(trio.run(decode_http.gather_streams, url, n, args.tokens, extra))
    return out


def ttft_round(url: str, args, nonces: range) -> list[tuple[float, int]]:
    return [time_to_first_token(url, long_prompt(nonce, args.prompt_tokens)) for nonce in nonces]


def long_decode(url: str, args, extra: dict) -> dict:
    """One stream's decode after an agent-sized prompt (its KV read whole)."""
    messages = [{"role": "user", "content": long_prompt(99, args.long_decode)}]
    body = {**extra, "messages": messages}
    return stream_rates(trio.run(decode_http.gather_streams, url, 1, args.tokens, body))


def median_rates(rounds: list[dict]) -> dict:
    """Each stream count's rates, the median over rounds (counts from the first)."""
    out = {}
    for n in rounds[0]:
        runs = [r[n] for r in rounds]
        out[n] = {
            **runs[0],
            **{k: statistics.median(r[k] for r in runs) for k in ("per_stream", "total")},
            "first_spread": statistics.median(r["first_spread"] for r in runs),
            "one_at_a_time": any(r["one_at_a_time"] for r in runs),
        }
    return out


def measure_both(args, baseline, mashbox, probe) -> tuple[dict, dict, list[dict], list]:
    """Both servers up at once (the idle one sleeps), taking turns round by round, so both
    see the same host: on a shared machine its speed moves by tens of percent within minutes,
    and one server's whole run after the other's compared two different machines. Each
    round measures every stream count, then cold first tokens; the order of the two flips
    every round. The machine's read rates (`probe`) are read just before and just after
    mashbox decodes, while both servers sleep, and the faster of the two is that round's
    limit: on a host whose cache others share, a step-sized read moved from 27 to 49 GB/s
    between rounds, and a read taken minutes before (at the round's start) judged mashbox
    against another moment's machine. Returns each server's medians, each round's paired
    ratios, and each round's ({buffer: read rate}, {"base": 1-stream rate, "mash": 1-stream
    rate}) for the roofline."""
    servers = {"base": baseline, "mash": mashbox}
    for url, extra in servers.values():
        trio.run(decode_http.gather_streams, url, 1, 8, extra)  # warm-up
    decode = {k: [] for k in servers}
    ttft = {k: [] for k in servers}
    load = {k: [] for k in servers}
    paired, rooflines = [], []
    for i in range(args.rounds):
        order = ("base", "mash") if i % 2 == 0 else ("mash", "base")
        nonces = range(1 + i * args.ttft_runs, 1 + (i + 1) * args.ttft_runs)  # cold each time
        for who in order:
            url, extra = servers[who]
            load[who].append(os.getloadavg()[0])
            before = probe.read() if who == "mash" else {}  # {buffer: bytes/s}
            decode[who].append(decode_round(url, args, extra))
            if who == "mash":  # the limit at the moment mashbox decoded: the faster read
                after = probe.read()
                read_rates = {name: max(rate, after[name]) for name, rate in before.items()}
            ttft[who] += ttft_round(url, args, nonces)
        last = {who: (decode[who][-1], ttft[who][-args.ttft_runs :]) for who in servers}
        got = round_ratios(last["base"], last["mash"])
        paired.append(got)
        ratios = ", ".join(f"{k}: {v:.2f}" for k, v in got.items())
        read = vs_llama_targets.reads(read_rates)
        print(f"  round {i + 1} ({read}): ratios {ratios}", flush=True)
        if 1 in args.streams:
            rates = {who: decode[who][-1][1]["total"] for who in servers}
            rooflines.append((read_rates, rates))
    out = {}
    for who, (url, extra) in servers.items():
        runs = ttft[who]
        out[who] = {
            **median_rates(decode[who]),
            "ttft": statistics.median(s for s, _ in runs),
            "prompt_tokens": runs[0][1],
            "load": [min(load[who]), max(load[who])],
        }
        if args.long_decode:
            out[who]["long"] = long_decode(url, args, extra)
    return out["base"], out["mash"], paired, rooflines


def round_ratios(base: tuple[dict, list], mash: tuple[dict, list]) -> dict:
    """One round's ratios, mashbox against the baseline (> 1: mashbox better): each stream
    count's total rate, and "ttft" (the baseline's median first token over mashbox's)."""
    (base_rates, base_ttft), (mash_rates, mash_ttft) = base, mash
    out = {n: mash_rates[n]["total"] / base_rates[n]["total"] for n in base_rates}
    out["ttft"] = statistics.median(s for s, _ in base_ttft) / statistics.median(
        s for s, _ in mash_ttft
    )
    return out


@contextlib.contextmanager
def llama_running(args, model: Path):
    """(url, extra request fields) of the baseline server while the block runs."""
    if args.llama_server:
        log = Path(str(args.llama_server) + ".log")
        proc, url = start_llama_server(args, model, log)
        print(f"llama-server at {url} (log {log})", flush=True)
        extra = {}
    else:
        log = args.llama_venv / "server.log"
        proc, url = start_llama(args, model, log)
        extra = {} if args.llama_keep_eos else {"logit_bias": end_token_bias(url)}
        print(f"llama-cpp-python at {url} (log {log}); extra request fields {extra}", flush=True)
    try:
        yield url, extra
    finally:
        stop(proc)


@contextlib.contextmanager
def mashbox_running(args):
    """(url, the bytes one decode step reads) of mashbox while the block runs."""
    from support.serverproc import ServerProcess

    slots = str(max(args.streams))
    flags = ["--slots", slots, "--ctx", str(args.ctx), "--threads", str(args.threads)]
    proc = ServerProcess(args.model, *flags, *args.server_args.split(), log=args.server_log)
    try:
        url = proc.wait_ready(900)
        print(
            f"mashbox at {url} ({' '.join(flags)} {args.server_args}; log {args.server_log})",
            flush=True,
        )
        card = httpx.get(url + "/v1/models").json()["data"][0]
        # decode_gb is the engine's decode_bytes (the weights one step reads), in GB.
        yield url, round(card["decode_gb"] * 1e9)
    finally:
        proc.stop()


def rows(args, base: dict, mash: dict) -> list[tuple]:
    """(metric, llama-cpp-python, mashbox, reference) for each line of the table."""
    out = []
    for n in args.streams:
        label = "1 stream" if n == 1 else f"{n} streams total"
        ref = REFERENCE.get(label) if args.model == DEFAULT_MODEL else None
        out.append((f"decode {label} tok/s", base[n]["total"], mash[n]["total"], ref))
        if n > 1:
            per = (base[n]["per_stream"], mash[n]["per_stream"])
            out.append((f"decode {n} streams tok/s/stream", *per, None))
            wait = (base[n]["first_spread"], mash[n]["first_spread"])
            out.append((f"{n} streams: last first token after first one, s", *wait, None))
    prefill = [r["prompt_tokens"] / r["ttft"] for r in (base, mash)]
    name = f"prefill tok/s, {base['prompt_tokens']}-token prompt (ref: pp512)"
    out.append((name, *prefill, REFERENCE["prefill"] if args.model == DEFAULT_MODEL else None))
    ttft = (base["ttft"], mash["ttft"])
    out.append((f"TTFT, {base['prompt_tokens']}-token prompt, s", *ttft, None))
    if args.long_decode:
        long = (base["long"]["total"], mash["long"]["total"])
        out.append((f"decode 1 stream after a ~{args.long_decode}-token prompt tok/s", *long, None))
    return out


def is_time(name: str) -> bool:
    return name.endswith(", s")  # the rows in seconds


def ratio(name: str, baseline: float, mashbox: float) -> float:
    # A time is better when smaller: its ratio is baseline / mashbox, so > 1 favours mashbox.
    return baseline / mashbox if is_time(name) else mashbox / baseline


def print_table(args, base: dict, mash: dict) -> None:
    name = baseline_name(args)
    print(f"\n| metric | {name} | mashbox | ratio (> 1: mashbox better) | ", end="")
    print("llama-server (issue 13) |\n|---|---|---|---|---|")
    for metric, b, m, ref in rows(args, base, mash):
        fmt = ".2f" if is_time(metric) else ".1f"
        refs = "-" if ref is None else f"{ref}"
        print(f"| {metric} | {b:{fmt}} | {m:{fmt}} | {ratio(metric, b, m):.2f} | {refs} |")
    runs = args.rounds * args.ttft_runs
    print(f"medians of {args.rounds} rounds ({runs} cold first tokens each); ", end="")
    print(f"prompt tokens: {name} ", end="")
    print(f"{base['prompt_tokens']}, mashbox {mash['prompt_tokens']}")
    for n in args.streams:
        print(f"tokens per stream at {n}: {name} {base[n]['counts']}, ", end="")
        print(f"mashbox {mash[n]['counts']}")
        if base[n]["one_at_a_time"]:
            print(f"  {name} served the {n} streams one after another (serialized)")
    runs = {name: base["load"], "mashbox": mash["load"]}
    loads = ", ".join(f"{who} {a:.2f}-{b:.2f}" for who, (a, b) in runs.items())
    print(f"1-min load average as each server's turns began: {loads}")
    print(f"  ({os.cpu_count()} cores; the benchmark itself keeps about 2 busy, and the average")
    print("  lags by a minute: above ~2.5 means other jobs)")


def baseline_name(args) -> str:
    return "llama-server" if args.llama_server else "llama-cpp-python"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model", default=DEFAULT_MODEL, help="registry id (qwen2.5-coder-0.5b-instruct too)"
    )
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 4, 8])
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--prompt-tokens", type=int, default=2000, help="of the TTFT prompt")
    parser.add_argument(
        "--rounds", type=int, default=3, help="turns each server takes; medians count"
    )
    parser.add_argument("--ttft-runs", type=int, default=1, help="cold first tokens a round")
    parser.add_argument("--ctx", type=int, default=2560, help="both servers' context")
    parser.add_argument(
        "--long-decode",
        type=int,
        default=0,
        metavar="TOKENS",
        help="also decode one stream after a prompt of about this many tokens (--ctx grows to "
        "hold it): what an agent's turn costs once its context is long",
    )
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    parser.add_argument(
        "--server-args", default="", help='more `mashbox run` flags, e.g. "--decode-weights int8"'
    )
    parser.add_argument("--llama-venv", type=Path, default=BENCH / ".venv-llama")
    parser.add_argument(
        "--llama-keep-eos", action="store_true", help="do not ban end tokens on llama-cpp-python"
    )
    parser.add_argument("--install-only", action="store_true")
    parser.add_argument("--llama-server", type=Path, help="a llama-server binary: the baseline")
    parser.add_argument(
        "--server-log",
        type=Path,
        default=Path(tempfile.gettempdir()) / "mashbox-vs-llama.log",
        help="where mashbox's log goes (kept after the run)",
    )
    decode_http.add_client_flag(parser)
    args = parser.parse_args()
    decode_http.use_client(args)
    if args.long_decode:
        # long_prompt's token count is a guess (30 a sentence): up to ~3% more, then a template
        args.ctx = max(args.ctx, int(args.long_decode * 1.05) + args.tokens + 256)
    if not args.llama_server:
        ensure_llama(args.llama_venv)
    if args.install_only:
        return
    model = model_file(args.model)
    print(f"model file {model}; {args.tokens} tokens a stream; streams {args.streams}; "
          f"{args.rounds} rounds; client {args.client}")  # fmt: skip
    probe = vs_llama_targets.ReadProbe(args.threads)  # before the servers: 2 GiB, touched
    with llama_running(args, model) as baseline, mashbox_running(args) as (url, decode_bytes):
        probe.also_step(decode_bytes)
        base, mash, paired, rooflines = measure_both(args, baseline, (url, {}), probe)
    print_table(args, base, mash)
    vs_llama_targets.print_targets(args.model, baseline_name(args), paired)
    if rooflines:
        name = baseline_name(args)
        rounds = [(rr, {name: r["base"], "mashbox": r["mash"]}) for rr, r in rooflines]
        vs_llama_targets.print_roofline(decode_bytes, rounds)


if __name__ == "__main__":
    main()
