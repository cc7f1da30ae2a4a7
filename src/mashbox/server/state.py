"""What the routes share: the model's identity, its text pipeline, the scheduler and the engine
process, and one snapshot of how they are doing."""

from __future__ import annotations

import attrs

from ..observer import Stats
from ..protocol import EngineInfo
from ..scheduler import Scheduler
from ..text.chat_template import ChatTemplate
from ..text.constraint import Grammars
from ..text.tokenizer import Tokenizer
from ..worker_client import Supervisor, SupervisorStatistics
from .identity import Identity
from .metrics import Metrics
from .security import Guard


@attrs.frozen
class Loaded:
    """What the server has once the model is loaded: set once, never undone (an engine
    restart replaces the process, not these)."""

    weights_name: str
    tokenizer: Tokenizer
    template: ChatTemplate
    identity: Identity
    scheduler: Scheduler


@attrs.frozen
class ServerStatistics:
    """The server at one moment, for /health and /metrics."""

    ready: bool
    scheduler: Stats | None  # None until the model is loaded
    engine: SupervisorStatistics | None  # None until the engine process is first started
    identity: Identity | None


@attrs.define(eq=False)
class ServerState:
    """The served model's name and shape, the access rules, then the engine process once it
    starts and everything else once the model is loaded; `ready` while the engine answers."""

    model_id: str
    ctx: int  # what was asked for (0: the model's), then what the engine runs
    slots: int
    guard: Guard = attrs.Factory(lambda: Guard("127.0.0.1"))
    supervisor: Supervisor | None = None
    loaded: Loaded | None = None
    grammars: Grammars | None = None  # built at the first constrained request (structured.py)
    metrics: Metrics = attrs.field(
        init=False,
        default=attrs.Factory(
            lambda self: Metrics(self.model_id, self.statistics), takes_self=True
        ),
    )

    # What the routes use once `ready`.

    @property
    def tokenizer(self) -> Tokenizer | None:
        return self.loaded.tokenizer if self.loaded else None

    @property
    def template(self) -> ChatTemplate | None:
        return self.loaded.template if self.loaded else None

    @property
    def scheduler(self) -> Scheduler | None:
        return self.loaded.scheduler if self.loaded else None

    @property
    def info(self) -> EngineInfo | None:
        return self.supervisor.info if self.supervisor else None

    @property
    def ready(self) -> bool:
        return self.loaded is not None and self.loaded.scheduler.ready

    def statistics(self) -> ServerStatistics:
        loaded = self.loaded
        return ServerStatistics(
            ready=self.ready,
            scheduler=loaded.scheduler.statistics() if loaded else None,
            engine=self.supervisor.statistics() if self.supervisor else None,
            identity=loaded.identity if loaded else None,
        )
