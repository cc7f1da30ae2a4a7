"""What the routes share: the model's identity, its text pipeline and the scheduler."""

from __future__ import annotations

import attrs

from ..protocol import EngineInfo
from ..scheduler import Scheduler
from ..text.chat_template import ChatTemplate
from ..text.tokenizer import Tokenizer
from ..worker_client import Supervisor


@attrs.define(eq=False)
class ServerState:
    """Filled in as the model loads; `ready` once the engine answers steps."""

    model_id: str
    ctx: int
    slots: int
    weights_name: str = ""
    tokenizer: Tokenizer | None = None
    template: ChatTemplate | None = None
    scheduler: Scheduler | None = None
    supervisor: Supervisor | None = None

    @property
    def info(self) -> EngineInfo | None:
        return self.supervisor.info if self.supervisor else None

    @property
    def ready(self) -> bool:
        return self.scheduler is not None and self.scheduler.ready
