"""The step protocol between the scheduler (trio, no torch) and the engine (torch, no trio).

Every message is a small frozen value that pickles, so the engine can live in a worker
process and be restarted without the scheduler knowing anything about tensors.
"""

from __future__ import annotations

import operator
import pickle

import attrs


def message(cls):
    """A frozen attrs class that pickles as (class, field values): half the bytes and the
    time of attrs' own per-field state, for a pipe that carries a step every few ms."""
    cls = attrs.frozen(cls)
    names = tuple(a.name for a in attrs.fields(cls))
    if len(names) > 1:
        values = operator.attrgetter(*names)  # one C call for all of them
    else:

        def values(self):
            return tuple(getattr(self, name) for name in names)

    cls.__reduce__ = lambda self: (cls, values(self))
    return cls


def send(conn, msg) -> None:
    """`conn.send(msg)` (a multiprocessing Connection) with the plain pickler: the messages
    carry no file descriptors, and multiprocessing's ForkingPickler copies its dispatch table
    for every message, ~12 us of a cold step boundary that the engine waits through."""
    conn.send_bytes(pickle.dumps(msg, pickle.HIGHEST_PROTOCOL))


@message
class SamplingParams:
    """How to pick each new token; temperature 0 is greedy."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    # (token id, bias) pairs added to those logits before penalties and sampling (OpenAI's).
    logit_bias: tuple[tuple[int, float], ...] = ()
    seed: int = 0
    # Log-probabilities with each sampled token: -1 none, 0 the sampled token's alone, k also
    # the k likeliest tokens' (the model's log-softmax, before temperature, bias, penalties).
    logprobs: int = -1
    # Also each prompt token's after the first, with as many likeliest (OpenAI's `echo`): the
    # request then prefills its whole prompt itself, none of it from a cache.
    prompt_logprobs: bool = False
    # An llguidance grammar (text/constraint.py) the answer must follow; "" for none.
    grammar: str = ""


@message
class Admit:
    """Start a new sequence in `slot`: reset its sampling state (penalties see the prompt)."""

    slot: int
    params: SamplingParams
    prompt_ids: tuple[int, ...]


@message
class Prefill:
    """Write KV for `token_ids` at positions start.. of `slot`; sample after the last if asked."""

    slot: int
    start: int
    token_ids: tuple[int, ...]
    sample: bool
    pool: bool = False  # embeddings: add this chunk's final hidden states to the slot's sum
    # A long decision question's piece (`Batch._read`): run in a forward of its own, so its
    # rows' bits depend on nothing else the step holds (sgemm rounds by the row count).
    alone: bool = False


# A Decode's token_id when the scheduler planned the step before it had the one before's
# result: the engine feeds the token it sampled for that slot in the previous step.
PREVIOUS = -1


@message
class Decode:
    """Feed one token at `position` of `slot` and sample the next; token_id may be PREVIOUS."""

    slot: int
    token_id: int
    position: int


@message
class Save:
    """Copy the KV of positions 0..n-1 of `slot` to host memory as prompt-cache `entry`."""

    slot: int
    entry: int
    n: int


@message
class Restore:
    """Copy the first `n` positions of prompt-cache `entry` back into `slot`. An entry on
    disk is read from `file` (a name in --cache-dir); should that file not hold `tokens`
    (the n restored) whole, the engine prefills them into the slot instead."""

    slot: int
    entry: int
    n: int
    file: str = ""
    tokens: tuple[int, ...] = ()


@message
class Persist:
    """Write the KV of `slot`'s first len(tokens) positions (they hold `tokens`) to the disk
    cache as file `name`, for `tenant`: a prefix that repeats, kept across restarts."""

    slot: int
    name: str
    tenant: str
    tokens: tuple[int, ...]


@message
class DiskEntry:
    """A prefix the disk cache holds, as the engine found it at start."""

    name: str
    tenant: str
    tokens: tuple[int, ...]


@message
class Share:
    """Copy the KV of positions 0..n-1 of slot `source` (in use) into slot `slot`: requests
    that share a prefix with one running now (parallel calls under one system prompt)."""

    source: int
    slot: int
    n: int


@message
class Branch:
    """Tokens read after a slot's prefix and never written to it (a typed decision's question).

    The suffix is causal; each leaf is a one-token continuation of the whole suffix, read
    side by side with the others (a tree). `candidates` name the tokens whose log-probs come
    back: first those after the suffix, then those after each leaf in turn.
    """

    token_ids: tuple[int, ...]
    candidates: tuple[tuple[int, ...], ...]
    leaves: tuple[int, ...] = ()


@message
class Decide:
    """Read `branches` after the first `prefix` positions of `slot` (filled by now)."""

    slot: int
    prefix: int
    branches: tuple[Branch, ...]


@message
class Step:
    """One engine step: cache moves, admissions, prefill chunks, then one batched decode."""

    index: int = 0  # the scheduler's step number (counts across worker restarts)
    admits: tuple[Admit, ...] = ()
    prefills: tuple[Prefill, ...] = ()
    decodes: tuple[Decode, ...] = ()
    saves: tuple[Save, ...] = ()  # run first: a slot is saved before it is overwritten
    restores: tuple[Restore, ...] = ()
    shares: tuple[Share, ...] = ()  # after the saves, before the restores
    drops: tuple[int, ...] = ()  # prompt-cache entries to forget (after the restores)
    decides: tuple[Decide, ...] = ()  # run after the prefills that fill their prefixes
    # New work for requests that arrived while step `joins` (decodes only, sent ahead) waited
    # in the pipe: if that step has not started when this one is there, they run as one.
    joins: int = 0
    persists: tuple[Persist, ...] = ()  # after the restores: the slots hold their prefixes
    disk_drops: tuple[str, ...] = ()  # disk cache files to remove
    # Decodes only: the batch runs this many times back to back, each run after the first
    # feeding back the token it sampled one position on (`run`); the results come back
    # together (`StepResult.more`). The server then wakes once for that many tokens.
    repeat: int = 1
    # Tokens that end every answer this step decodes (the ends of turn; empty where a row
    # ignores them): a row fed one back is over, and the engine leaves it out of the step
    # and of the runs after; when no row is left, the step ends there.
    ends: tuple[int, ...] = ()

    def run(self, i: int) -> Step:
        """Run i (from 0) of a repeated step: its decodes i positions on, each fed the token
        the run before sampled for its slot."""
        if i == 0:
            return self
        decodes = tuple(Decode(d.slot, PREVIOUS, d.position + i) for d in self.decodes)
        return Step(self.index, decodes=decodes, ends=self.ends)

    def with_join(self, join: Step) -> Step:
        """This step (decodes only) and `join` (new work on other slots) run as one; a
        repeated step's later runs are its own decodes alone."""
        return Step(
            self.index,
            admits=join.admits,
            prefills=join.prefills,
            decodes=self.decodes,
            saves=join.saves,
            restores=join.restores,
            shares=join.shares,
            drops=join.drops,
            persists=join.persists,
            disk_drops=join.disk_drops,
            decides=join.decides,
            repeat=self.repeat,
            ends=self.ends,
        )


@message
class StepResult:
    """The token sampled for each slot that asked for one, and the step's device time."""

    tokens: dict[int, int]
    elapsed_s: float
    # Embeddings: slot -> the pooled vector, for slots whose last pooled chunk ran.
    embeddings: dict[int, tuple[float, ...]] = attrs.Factory(dict)
    # Decisions: slot -> per branch, per read, the candidates' float32 log-probs.
    decisions: dict[int, tuple[tuple[tuple[float, ...], ...], ...]] = attrs.Factory(dict)
    forwards: int = 0  # model forward passes the step ran (prefill chunks, decode, reads)
    compiles: int = 0  # programs the engine process has compiled so far, this step included
    joined: bool = False  # the step sent after this one (its join) ran inside it
    # slot -> (the sampled token's log-prob, ((token, log-prob), ...) the likeliest first),
    # for slots whose SamplingParams ask for log-probs.
    logprobs: dict[int, tuple[float, tuple[tuple[int, float], ...]]] = attrs.Factory(dict)
    # slot -> (token, its log-prob, the likeliest) for each prompt token a prefill chunk's rows
    # predict (row i: the token at start + i + 1), where SamplingParams ask prompt_logprobs.
    prompt_logprobs: dict[int, tuple[tuple[int, float, tuple[tuple[int, float], ...]], ...]] = (
        attrs.Factory(dict)
    )
    # Disk cache files a restore found damaged or gone (removed; their tokens prefilled).
    disk_failed: tuple[str, ...] = ()
    # Slots whose logits held NaN or infinity (a numerical overflow): nothing was sampled
    # or read for them (no token, no decision).
    nonfinite: tuple[int, ...] = ()
    # A repeated step's later runs (`Step.repeat`), in order: this result is its first's.
    # Fewer than asked where every row's answer ended (`Step.ends`).
    more: tuple[StepResult, ...] = ()


@message
class EngineInfo:
    """What the loaded engine tells the server once it is ready."""

    arch: str
    n_params: int
    weight_bytes: int
    bits_per_weight: float
    device: str
    dtype: str
    n_layers: int
    vocab_size: int
    max_context: int  # what the model was trained for
    ctx: int  # tokens per slot this engine runs
    kv_dtype: str = ""  # what the KV cache holds: float16 where the CPU kernels attend
    kv_bytes_per_token: int = 0  # K and V of one position, all layers
    decode_bytes: int = 0  # weight bytes one decode step reads
    held_bytes: int = 0  # weight bytes the engine holds: every form kept, the embedding
    decode_weights: str = "float"  # float, int8, int4, int4a16, int4a8, q8_0
    kernels: str = ""  # the CPU kernels decode runs on, e.g. "avx512+vnni (native)"
    kernels_fallback: str = ""  # why decode fell back to torch's ops on a CPU, with the remedy
    batch_invariant: bool = False  # a row's bits the same alone or in any batch (Model's)
    compiles: int = 0  # programs compiled just in time so far (engine.compiles_so_far)
    disk_key: str = ""  # what the disk cache's files must be made for (disk_cache.disk_key)
    disk_entries: tuple[DiskEntry, ...] = ()  # what --cache-dir holds, least recently used first

    @property
    def decode(self) -> str:
        """What a decode step runs, as people read it: "int4a16 avx512+vnni (native)"."""
        return f"{self.decode_weights} {self.kernels}".strip()


@message
class Load:
    """The weights a worker process loads, sent once it is spawned: it imports torch and the
    engine meanwhile, while the server starts and finds (and checks) the weights."""

    path: str
    slots: int
    ctx: int  # 0: the model's own, up to the engine's default
    decode_weights: str = "float"
    kv_dtype: str = "auto"
    cache_dir: str | None = None  # the prompt cache on disk, or None
    cache_dir_bytes: int = 0  # its cap
    model_sha: str = ""  # what its files are made for: the weights' checksum


@message
class Shutdown:
    """Ask the worker process to exit."""


@message
class WorkerFailed:
    """The worker could not load or run a step; `message` is safe to log."""

    message: str
