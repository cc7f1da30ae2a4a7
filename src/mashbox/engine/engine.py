"""The engine: a model, its KV slots and per-slot sampling state, driven by `Step`s."""

from __future__ import annotations

import logging
import sys
import time
from pathlib import Path

import attrs
import torch

from ..protocol import (
    PREVIOUS,
    Admit,
    Decide,
    EngineInfo,
    Prefill,
    Restore,
    SamplingParams,
    Step,
    StepResult,
)
from ..text.constraint import NOTHING, GrammarError
from . import cpu_kernels, disk_cache, int4
from . import graph_decode as graph_decode_mod
from . import weights as weights_mod
from .grammar_mask import GrammarMasks, allowed
from .kv_cache import KVCache
from .model import Model
from .sampling import apply_logit_bias, apply_penalties, finite_rows, log_probs, sample

log = logging.getLogger("mashbox.engine")


class _SlotState:
    """What sampling needs to remember about the sequence in one slot."""

    def __init__(self, admit: Admit, vocab_size: int, device, masks: GrammarMasks):
        self.params: SamplingParams = admit.params
        # The tokens echo's log-probs are read for (each a row's next token).
        self.prompt_ids = admit.prompt_ids if admit.params.prompt_logprobs else ()
        self.prompt_mask = torch.zeros(vocab_size, dtype=torch.bool, device=device)
        if admit.prompt_ids:
            self.prompt_mask[torch.tensor(admit.prompt_ids, device=device)] = True
        self.counts = torch.zeros(vocab_size, dtype=torch.int32, device=device)
        # Greedy without penalties reads nothing but the logits: such rows are picked by one
        # argmax over the batch, and their counts are never needed.
        p = admit.params
        # A grammar's matcher: what the row may sample next follows from what it sampled.
        self.matcher = _matcher(masks, p.grammar) if p.grammar else None
        self.plain_greedy = (
            self.matcher is None
            and p.temperature <= 0.0
            and p.repetition_penalty == 1.0
            and not (p.frequency_penalty or p.presence_penalty or p.logit_bias)
        )
        self.last: int | None = None  # the token sampled last: what a PREVIOUS decode feeds


def _matcher(masks: GrammarMasks, grammar: str):
    """The row's matcher. The server compiled the grammar before queueing it; one that fails
    here anyway ends its answer at once rather than failing the step for every row."""
    try:
        return masks.matcher(grammar)
    except GrammarError as exc:
        log.warning("a grammar the server accepted does not compile in the engine: %s", exc)
        return masks.matcher(NOTHING)


def default_dtype(device: str) -> torch.dtype:
    """bf16 on accelerators, float32 on the CPU (bf16 matmuls are slow there)."""
    return torch.float32 if torch.device(device).type == "cpu" else torch.bfloat16


DEFAULT_MAX_CTX = 8192


def resolve_decode_weights(kind: str, device: str) -> str:
    """ "auto": on a CPU where mashbox's kernels build, int4a16 (the file's own Q4_0/Q4_1/Q8_0
    blocks where it has them, int8 for other matrices, the 4-bit ones taking activations
    rounded to int16 per block of 32: greedy text as float32's on the test prompts; a whole
    decode step in one call, ~10x float32 here); float elsewhere (bf16 on an accelerator).
    Not int4a8, faster still: its int8 activations, as llama.cpp's, turn the default model's
    answer to "What is the capital of France?" from Paris into "L'Étoile, la Marseillaise,
    ..." (llama-server's answer too)."""
    if kind != "auto":
        return kind
    return "int4a16" if torch.device(device).type == "cpu" and cpu_kernels.load() else "float"


KV_DTYPES = ("auto", "float16", "float32")


def resolve_kv_dtype(kind: str, model: Model) -> torch.dtype:
    """ "auto": float16 where the CPU kernels run the decode step (its attention and a prefill
    chunk's read float16 keys and values, widened exactly: half the memory, and half the
    bytes a decode step reads past ~16k positions, where they outweigh a 0.5B model's
    weights; llama-server's default too); the model's dtype elsewhere (the torch paths would
    widen the whole cache every step). float16 or float32 on a CPU computing in float32."""
    if kind not in KV_DTYPES:
        raise ValueError(f"kv_dtype must be one of {', '.join(KV_DTYPES)}, not {kind!r}")
    if kind == "auto":
        return torch.float16 if model.decode_stack is not None else model.dtype
    dtype = getattr(torch, kind)
    if dtype != model.dtype and (model.device.type != "cpu" or model.dtype != torch.float32):
        raise ValueError(f"a {kind} KV cache needs a CPU computing in float32")
    return dtype


def compiles_so_far() -> int:
    """Programs this process has compiled or loaded just in time: mashbox's CPU kernels, any
    torch.compile graphs and captured CUDA graphs. The server checks that none happen after
    it reports ready."""
    dynamo = sys.modules.get("torch._dynamo")
    graphs = dynamo.utils.counters["stats"]["unique_graphs"] if dynamo else 0
    return cpu_kernels.builds + graphs + graph_decode_mod.captures


BRANCH_ROWS = 4096  # rows per decision forward: bounds activation memory
PROMPT_READ_ROWS = 64  # echo's prompt rows projected at once: 39 MB of qwen2.5's logits


def _batches(branches, budget: int):
    """Consecutive groups of branches with at most `budget` rows each (one if larger)."""
    group, rows = [], 0
    for b in branches:
        size = len(b.token_ids) + len(b.leaves)
        if group and rows + size > budget:
            yield group
            group, rows = [], 0
        group.append(b)
        rows += size
    if group:
        yield group


class PlainDecoder:
    """Decode through the model's own path (the CPU decode stack, or op by op) on one cache:
    what an engine without fixed-shape decode (graph_decode.GraphDecoder) calls."""

    def __init__(self, model: Model, cache: KVCache):
        self.model, self.cache = model, cache

    def decode(self, slots: list[int], token_ids: torch.Tensor, positions: torch.Tensor):
        """Feed one token per slot; return hidden states [len(slots), d_model]."""
        return self.model.decode(self.cache, slots, token_ids, positions)

    def logits(self, slots: list[int], token_ids: list[int], positions: list[int]):
        """Feed one token per slot; return float32 logits [len(slots), vocab], each row's
        greedy pick and finiteness (DecodeLogits)."""
        return self.model.decode_logits(self.cache, slots, token_ids, positions)


class Engine:
    """Owns every tensor; knows nothing of requests, text or time limits."""

    def __init__(
        self,
        path: Path,
        *,
        slots: int,
        ctx: int = 0,
        device: str = "cpu",
        dtype=None,
        decode_weights: str = "float",
        kv_dtype: str = "auto",
        graph_decode: bool | None = None,
        grammar_masks: GrammarMasks | None = None,
        cache_dir: Path | None = None,
        cache_dir_bytes: int = 0,
        model_sha: str = "",
    ):
        """graph_decode: decode as fixed-shape steps, CUDA graphs on a GPU (graph_decode.py);
        None: as $MASHBOX_GRAPH_DECODE says, else on CUDA with float decode weights.
        cache_dir: the prompt cache on disk, at most cache_dir_bytes; its files are valid for
        model_sha (the registry's sha256; "": what identity.weights_sha hashes of `path`).
        kv_dtype: what the KV cache holds (resolve_kv_dtype)."""
        # A CPU engine asked for anything but float runs on mashbox's kernels, or says why not.
        kernels = (
            cpu_kernels.report()
            if torch.device(device).type == "cpu" and decode_weights != "float"
            else cpu_kernels.Report()
        )
        decode_weights = resolve_decode_weights(decode_weights, device)
        # The int4 kinds load the file's own Q4_0/Q4_1/Q8_0 blocks; the rest use float tensors.
        keep = int4.KEPT_QTYPES if decode_weights in int4.BLOCK_KINDS else ()
        loaded = weights_mod.load(Path(path), keep_blocks=keep)
        self.cfg = loaded.config
        # ctx 0: the model's trained context, capped so the default KV cache stays modest.
        ctx = ctx or min(self.cfg.max_context, DEFAULT_MAX_CTX)
        self.device = torch.device(device)
        self.on_cuda = self.device.type == "cuda"  # read once: ~15 us cold a step (stop 40)
        self.slow_s = 0.0  # seconds added to every step (MASHBOX_FAULTS slow=S, the tests')
        self.dtype = dtype or default_dtype(device)
        self.model = Model(
            self.cfg,
            loaded.tensors,
            self.device,
            self.dtype,
            n_positions=ctx,
            decode_weights=decode_weights,
            blocks=loaded.blocks,
        )
        self.ctx = ctx
        fixed_shape = graph_decode_mod.wanted(graph_decode, self.model)
        self.cache = KVCache(
            self.cfg,
            slots,
            ctx,
            self.device,
            resolve_kv_dtype(kv_dtype, self.model),
            scratch_slot=fixed_shape,
        )
        # Decode goes one way for the engine's life, chosen here: a GraphDecoder captures its
        # graphs now, before the server reports ready.
        self.decoder: graph_decode_mod.GraphDecoder | PlainDecoder = (
            graph_decode_mod.GraphDecoder(self.model, self.cache)
            if fixed_shape
            else PlainDecoder(self.model, self.cache)
        )
        self.slots: list[_SlotState | None] = [None] * slots
        self.grammar_masks = grammar_masks or GrammarMasks(Path(path))
        self.host_cache: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # prompt cache
        self.disk = (
            disk_cache.for_engine(
                cache_dir, cache_dir_bytes, model_sha, Path(path), self, kernels.kernels
            )
            if cache_dir is not None and cache_dir_bytes > 0
            else None
        )
        self.pooled: dict[int, torch.Tensor] = {}  # embeddings: hidden-state sums so far
        self.info = EngineInfo(
            arch=self.cfg.arch,
            n_params=loaded.n_params,
            weight_bytes=loaded.file_bytes,
            bits_per_weight=round(loaded.bits_per_weight, 2),
            device=str(self.device),
            dtype=str(self.dtype).removeprefix("torch."),
            n_layers=self.cfg.n_layers,
            vocab_size=self.cfg.vocab_size,
            max_context=self.cfg.max_context,
            ctx=ctx,
            kv_dtype=str(self.cache.k.dtype).removeprefix("torch."),
            kv_bytes_per_token=self.cache.bytes_per_token,
            decode_bytes=self.model.decode_nbytes,
            held_bytes=self.model.held_nbytes,
            decode_weights=self.model.decode_kind,
            kernels=kernels.kernels,
            kernels_fallback=kernels.fallback,
            batch_invariant=self.model.batch_invariant and not fixed_shape,
            compiles=compiles_so_far(),
            disk_key=self.disk.key if self.disk else "",
            disk_entries=self.disk.scan() if self.disk else (),
        )

    def step(self, step: Step) -> StepResult:
        """Admit, prefill each chunk, decode the batch; return one token per sampling slot
        (and a repeated step's later runs' in `more`)."""
        # The worker's loop runs in inference mode: torch's context costs ~30 us at a step's
        # cold boundary (stop 40), so a step enters it only for callers outside it.
        if torch.is_inference_mode_enabled():
            return self._runs(step)
        with torch.inference_mode():
            return self._runs(step)

    def _runs(self, step: Step) -> StepResult:
        first = self._step(self._unended(step))
        more = []
        for i in range(1, step.repeat):
            run = self._unended(step.run(i))
            if not run.decodes:  # every row's answer is over
                break
            more.append(self._step(run))
        return attrs.evolve(first, more=tuple(more)) if more else first

    def _unended(self, step: Step) -> Step:
        """The step without its rows fed back an end of turn (`Step.ends`): their answers are
        over, so computing them would only be thrown away."""
        if not step.ends:
            return step
        decodes = tuple(
            d
            for d in step.decodes
            if d.token_id != PREVIOUS or self.slots[d.slot].last not in step.ends
        )
        return step if len(decodes) == len(step.decodes) else attrs.evolve(step, decodes=decodes)

    def _step(self, step: Step) -> StepResult:
        t0 = time.perf_counter()
        if self.slow_s:  # MASHBOX_FAULTS slow=S: a slower device, for the tests
            time.sleep(self.slow_s)
        for save in step.saves:
            self.host_cache[save.entry] = self.cache.copy_out(save.slot, save.n)
        for share in step.shares:
            self.cache.copy_prefix(share.source, share.slot, share.n)
        disk_failed = tuple(r.file for r in step.restores if not self._restore(r))
        # After the restores: one round of placements may restore an entry for one request
        # and, saving a longer prefix of it for the next, drop it (PromptCache.add).
        for entry in step.drops:
            self.host_cache.pop(entry, None)
        for name in step.disk_drops:  # before the writes: the directory stays under its cap
            self.disk.remove(name)
        for persist in step.persists:  # copied now, written in the background
            k, v = self.cache.copy_out(persist.slot, len(persist.tokens))
            self.disk.write(persist.name, persist.tenant, persist.tokens, k, v)
        for admit in step.admits:
            self.slots[admit.slot] = _SlotState(
                admit, self.cfg.vocab_size, self.device, self.grammar_masks
            )
        tokens: dict[int, int] = {}
        logprobs: dict[int, tuple] = {}
        prompt_logprobs: dict[int, tuple] = {}
        embeddings: dict[int, tuple[float, ...]] = {}
        nonfinite: list[int] = []
        generation = [p for p in step.prefills if not (p.pool or p.alone)]
        self._prefill(generation, tokens, logprobs, prompt_logprobs, nonfinite)
        pieces = [p for p in step.prefills if p.alone]
        for p in pieces:
            ids = torch.tensor(p.token_ids, dtype=torch.long, device=self.device)
            self.model.prefill(self.cache, p.slot, p.start, ids)
        pooling = [p for p in step.prefills if p.pool]
        for p in pooling:
            ids = torch.tensor(p.token_ids, dtype=torch.long, device=self.device)
            hidden = self.model.prefill(self.cache, p.slot, p.start, ids, all_rows=True)
            if p.start == 0:
                self.pooled[p.slot] = torch.zeros(hidden.shape[1], dtype=torch.float64)
            self.pooled[p.slot] += hidden.double().sum(0).cpu()
            if p.sample:  # the input's last chunk: mean over positions, L2-normalized
                mean = self.pooled.pop(p.slot) / (p.start + len(p.token_ids))
                embeddings[p.slot] = tuple((mean / mean.norm().clamp_min(1e-12)).tolist())
        if step.decodes:
            slots = [d.slot for d in step.decodes]
            ids = [self._input(d) for d in step.decodes]
            out = self.decoder.logits(slots, ids, [d.position for d in step.decodes])
            logits = out.values
            for row, d in enumerate(step.decodes):
                if not out.finite[row]:
                    self._overflowed(d.slot, nonfinite)
                    continue
                if self.slots[d.slot].plain_greedy:
                    tokens[d.slot] = self.slots[d.slot].last = out.best[row]
                else:
                    tokens[d.slot] = self._sample(d.slot, logits[row], d.position + 1)
                self._read_logprobs(d.slot, logits, row, tokens[d.slot], logprobs)
        decisions, forwards = {}, bool(generation) + len(pooling) + len(pieces) + bool(step.decodes)
        for d in step.decides:
            read, reads = self._decide(d)
            forwards += reads
            if read is None:
                nonfinite.append(d.slot)
            else:
                decisions[d.slot] = read
        if self.on_cuda:
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - t0
        return StepResult(
            tokens,
            elapsed,
            embeddings,
            decisions,
            forwards,
            compiles_so_far(),
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            disk_failed=disk_failed,
            nonfinite=tuple(nonfinite),
        )

    def _restore(self, restore: Restore) -> bool:
        """A saved prefix back into its slot: from host memory, or from disk if the file is
        whole; else (False) prefilled from its tokens, so the slot holds what the scheduler
        planned."""
        if not restore.file:
            self.cache.copy_in(restore.slot, self.host_cache[restore.entry], restore.n)
            return True
        saved = self.disk.read(restore.file, restore.tokens)
        if saved is not None:
            self.cache.copy_in(restore.slot, saved, restore.n)
            return True
        ids = torch.tensor(restore.tokens, dtype=torch.long, device=self.device)
        for start in range(0, restore.n, disk_cache.FALLBACK_CHUNK):
            chunk = ids[start : start + disk_cache.FALLBACK_CHUNK]
            self.model.prefill(self.cache, restore.slot, start, chunk)
        return False

    def _prefill(
        self, prefills: list, tokens: dict, logprobs: dict, prompt_logprobs: dict, nonfinite: list
    ) -> None:
        """Every generation prefill of the step in one forward; sample where a prompt ends."""
        if not prefills:
            return
        chunks = [
            (p.slot, p.start, torch.tensor(p.token_ids, dtype=torch.long, device=self.device))
            for p in prefills
        ]
        hidden = self.model.prefill_many(self.cache, chunks)
        last, rows = 0, []
        for p in prefills:
            if self.slots[p.slot].prompt_ids:
                rows_of_p = hidden[last : last + len(p.token_ids)]
                self._read_prompt(p, rows_of_p, prompt_logprobs, nonfinite)
            last += len(p.token_ids)
            if p.sample:
                rows.append((p, last - 1))
        if rows:
            logits = self.model.logits(hidden[[row for _, row in rows]])
            finite = finite_rows(logits)
            for i, (p, _) in enumerate(rows):
                if not finite[i]:
                    self._overflowed(p.slot, nonfinite)
                    continue
                tokens[p.slot] = self._sample(p.slot, logits[i], p.start + len(p.token_ids))
                self._read_logprobs(p.slot, logits, i, tokens[p.slot], logprobs)

    def _decide(self, decide: Decide) -> tuple[tuple | None, int]:
        """Each branch's candidate log-probs (float32, over the whole vocabulary), and the
        forwards run: at most BRANCH_ROWS rows each, so a large request cannot exhaust memory.
        None for the reads where a row's logits were NaN or infinite."""
        out, forwards = [], 0
        for group in _batches(decide.branches, BRANCH_ROWS):
            forwards += 1
            pairs = [(list(b.token_ids), list(b.leaves)) for b in group]
            hidden = self.model.branch(self.cache, decide.slot, decide.prefix, pairs)
            rows, start = [], 0
            for b in group:  # the suffix's last row, then each leaf's
                n = len(b.token_ids)
                rows += [start + n - 1, *range(start + n, start + n + len(b.leaves))]
                start += n + len(b.leaves)
            logits = self.model.logits(hidden[rows], row_invariant=True)
            if not all(finite_rows(logits)):
                return None, forwards
            logprobs = torch.log_softmax(logits, dim=-1).cpu()
            r = 0
            for b in group:
                reads = []
                for candidates in b.candidates:
                    reads.append(tuple(logprobs[r, list(candidates)].tolist()))
                    r += 1
                out.append(tuple(reads))
        return tuple(out), forwards

    def _overflowed(self, slot: int, nonfinite: list[int]) -> None:
        """A row whose logits are NaN or infinite samples nothing: the scheduler ends its
        request. A decode planned ahead may still feed back its token: it gets token 0, a
        wasted row in a slot that is no longer its request's."""
        nonfinite.append(slot)
        self.slots[slot].last = 0

    def _input(self, decode) -> int:
        if decode.token_id != PREVIOUS:
            return decode.token_id
        last = self.slots[decode.slot].last
        if last is None:
            raise ValueError(f"slot {decode.slot} has sampled nothing to feed back")
        return last

    def _read_prompt(self, p: Prefill, hidden: torch.Tensor, out: dict, nonfinite: list) -> None:
        """Echo's log-probs: each prompt token a chunk's rows predict (row i: the token at
        start + i + 1; the last prompt token's row predicts the answer, sampled instead), with
        the likeliest tokens'. Projected PROMPT_READ_ROWS rows at a time (memory: rows times
        the vocabulary), each row's bits whatever the chunk (`row_invariant`)."""
        state = self.slots[p.slot]
        targets = state.prompt_ids[p.start + 1 : p.start + len(p.token_ids) + 1]
        entries = []
        for at in range(0, len(targets), PROMPT_READ_ROWS):
            some = targets[at : at + PROMPT_READ_ROWS]
            logits = self.model.logits(hidden[at : at + len(some)], row_invariant=True).cpu()
            if not all(finite_rows(logits)):  # an overflow: the request ends, as in sampling
                self._overflowed(p.slot, nonfinite)
                return
            for i, token in enumerate(some):
                entries.append((token, *log_probs(logits[i], token, state.params.logprobs)))
        out[p.slot] = tuple(entries)

    def _read_logprobs(self, slot: int, logits: torch.Tensor, row: int, token: int, out: dict):
        """The sampled token's log-prob and the likeliest tokens', where the slot asks: the
        model's float32 log-softmax of logits[row], before temperature and penalties (as
        OpenAI and vLLM). The row is indexed only then: a tensor view costs ~10 us cold."""
        top = self.slots[slot].params.logprobs
        if top >= 0:
            out[slot] = log_probs(logits[row], token, top)

    def _sample(self, slot: int, logits: torch.Tensor, position: int) -> int:
        state = self.slots[slot]
        logits = apply_logit_bias(logits, state.params)  # before penalties, as vLLM
        logits = apply_penalties(logits, state.params, state.prompt_mask, state.counts)
        if state.matcher is not None:
            ends = self.grammar_masks.grammars().vocab.eos_tokens
            logits = allowed(logits, state.matcher, ends)
        token = sample(logits, state.params, position)
        if state.matcher is not None:
            state.matcher.consume_token(token)  # an end of turn after the answer stops it
        state.counts[token] += 1
        state.last = token
        return token
