"""The documents that say what this server is and how it is doing: health, the model list
(OpenAI's, Anthropic's and seed 004's shapes), one model's card, the routes it serves, and
seed 001's status. Read from the server's state at the moment they are asked for."""

from __future__ import annotations

from .. import __version__
from ..protocol import SamplingParams
from .state import ServerState
from .systemone_api import model_entries


def health(state: ServerState, *, draining: bool = False) -> dict:
    """The `Health` document; draining: SIGTERM's grace period has begun (serve.py)."""
    snap = state.statistics()
    stats, engine, ids = snap.scheduler, snap.engine, snap.identity
    info = engine.info if engine else None
    return {
        "status": "draining" if draining else "ok" if snap.ready else "loading",
        "live_rows": stats.running if stats else None,
        "waiting": stats.waiting if stats else 0,
        # Every saved prefix is one host copy; there are no separate snapshots.
        "cache_bytes": stats.cache_bytes if stats else 0,
        "host_cache_bytes": stats.cache_bytes if stats else 0,
        "snapshot_bytes": 0,
        "host_cache_cap_bytes": stats.cache_cap_bytes if stats else 0,
        "host_cache_evictions": stats.cache_evictions if stats else 0,
        "cache_namespace": ids.cache_namespace if ids else None,
        "deployment_id": ids.deployment_id if ids else None,
        "component_set_sha": ids.component_set_sha if ids else None,
        "certification": "not_certified",  # no certification gate exists
        # Kernels are built (or loaded) before the engine reports ready; anything compiled
        # later would stall a step. Null before ready.
        "compiles_after_ready": engine.compiles_after_ready if snap.ready else None,
        "routed_experts": None,  # every supported architecture is dense
        "decode": info.decode if info else None,
        "kernels_fallback": info.kernels_fallback or None if info else None,
        "batch_invariant": info.batch_invariant if info else None,
        "worker_pid": engine.pid if engine else None,
        "worker_restarts": engine.restarts if engine else 0,
    }


def model_card(state: ServerState) -> dict:
    """OpenAI's model object, with what a client may want to know of this one."""
    snap = state.statistics()
    info = snap.engine.info if snap.engine else None
    return {
        "id": state.model_id,
        "object": "model",
        "owned_by": "mashbox-labs",
        "created": 0,
        "max_model_len": state.ctx,
        "weights": state.loaded.weights_name if state.loaded else "",
        "gb": round(info.held_bytes / 1e9, 3) if info else 0,
        "bpw": info.bits_per_weight if info else 0,
        "decode_gb": round(info.decode_bytes / 1e9, 6) if info else 0,
        "decode_weights": info.decode_weights if info else None,
        "kv_dtype": info.kv_dtype or None if info else None,
        "decode_kernels": info.kernels or None if info else None,
        "kernels_fallback": info.kernels_fallback or None if info else None,
        "batch_invariant": info.batch_invariant if info else None,
        "prefix_cache": True,
        # `suffix` on /v1/completions: the vocabulary has fill-in-the-middle markers.
        "fill_in_the_middle": bool(state.tokenizer and state.tokenizer.fim_ids),
        "slots": state.slots,
        "cache_ram_mib": snap.scheduler.cache_cap_bytes // 2**20 if snap.scheduler else 0,
    }


def model_list(state: ServerState) -> dict:
    """OpenAI's list, with seed 004's `models` beside `data`."""
    return {"object": "list", "data": [model_card(state)], "models": model_entries(state)}


def anthropic_model_list(state: ServerState) -> dict:
    """Anthropic's list shape (asked for with an anthropic-version header)."""
    entry = {
        "type": "model",
        "id": state.model_id,
        "display_name": state.model_id,
        "created_at": "1970-01-01T00:00:00Z",
    }
    return {"data": [entry], "has_more": False, "first_id": entry["id"], "last_id": entry["id"]}


def capabilities(url_map) -> dict:
    """The routes this server registers, read from its own routing table."""
    routes = sorted(
        {
            (method, rule.rule.replace("<path:", "{").replace("<", "{").replace(">", "}"))
            for rule in url_map.iter_rules()
            if rule.endpoint != "static"
            for method in rule.methods
            if method != "OPTIONS"
        },
        key=lambda r: (r[1], r[0]),
    )
    return {
        "app": "mashbox",
        "version": __version__,
        "routes": [{"method": m, "path": p} for m, p in routes],
    }


def local_status(state: ServerState) -> dict:
    """Seed 001's Status. Its enum names LocalEngine's runtimes: mashbox runs GGUF files as
    its llama runtime does, and its clients accept nothing else."""
    body = {"runtime": "localengine-llama", "ready": state.ready, "local_api": "running"}
    if state.model_id:
        body["active_model"] = state.model_id
    return body


def llama_props(state: ServerState) -> dict:
    """llama-server's `GET /props`, for the clients that read a server's context, slots, chat
    template and special tokens there. The default settings are mashbox's own: greedy, and
    to the end of the context."""
    tok, template = state.tokenizer, state.template
    default = SamplingParams()
    params = {"n_predict": -1, "temperature": default.temperature, "top_k": default.top_k,
              "top_p": default.top_p, "min_p": default.min_p,
              "repeat_penalty": default.repetition_penalty}  # fmt: skip
    return {
        "default_generation_settings": {"n_ctx": state.ctx, "params": params},
        "total_slots": state.slots,
        "model_alias": state.model_id,
        "model_path": state.loaded.weights_name if state.loaded else "",
        "modalities": {"vision": False, "video": False, "audio": False},
        "chat_template": template.source if template else "",
        "bos_token": tok.bos_token if tok else "",
        "eos_token": tok.eos_token if tok else "",
        "build_info": f"mashbox {__version__}",
        "is_sleeping": False,
    }
