"""What `mashbox run` is asked to do: every option and its default, in one place (the command
line reads its defaults from here)."""

from __future__ import annotations

from pathlib import Path

import attrs

from .prompt_cache import DEFAULT_CACHE_DIR_MIB, DEFAULT_CACHE_RAM_MIB


@attrs.frozen
class ServeOptions:
    host: str = "127.0.0.1"
    port: int = 8000
    ctx: int | None = None  # None: the model's, at most 8192
    slots: int = 4
    models_dir: Path | None = None  # None: $MASHBOX_MODELS_DIR or ~/.cache/mashbox/models
    device: str = "auto"
    threads: int = 0  # 0: all cores
    prefill_chunk: int = 256
    stall_timeout: float = 30.0
    step_timeout: float = 120.0
    decode_burst_ms: float = 10.0  # decode steps run back to back between the server's turns
    keep_alive: float = 5.0
    api_key_file: Path | None = None
    cache_ram_mib: int = DEFAULT_CACHE_RAM_MIB
    cache_dir: Path | None = None  # the prompt cache on disk, kept across restarts; None: off
    cache_dir_mib: int = DEFAULT_CACHE_DIR_MIB
    decode_weights: str = "auto"
    kv_dtype: str = "auto"
    allowed_hosts: tuple[str, ...] = ()
    ui: bool = False  # the chat page on /
    tenant_slots: int | None = None  # None: an equal share among the key file's tenants
    drain_timeout: float = 0.0  # SIGTERM's grace period for running requests; 0: none
    vllm_metrics: bool = False  # /metrics also under vLLM's names (for llm-d's picker)
