"""Grammar masks on the engine's side: a constrained row's logits are cut to the tokens its
grammar allows next, and each token it samples moves its matcher on.

The matcher lives here, beside the row's sampling state, because the mask for a token
depends on the token sampled just before it: the engine has that token the moment it is
sampled, so a constrained row decodes a step ahead like any other (the scheduler plans its
next step with PREVIOUS, and the mask is computed when that step samples).
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path

import numpy as np
import torch

from ..text.constraint import Grammars
from ..text.tokenizer import Tokenizer

log = logging.getLogger("mashbox.engine")


class GrammarMasks:
    """The model's vocabulary for llguidance, read from the model's own files once (~0.4 s
    for 50k tokens, 1.3 s for 152k), and the grammars compiled against it.

    The worker reads it in a thread once the weights are loaded (`read_soon`), so the
    engine is ready that much sooner: a constrained step that comes first waits for it.
    (Read beside the weights it gained nothing on 2 cores, and the two raced on protobuf's
    first imports: the readers' modules are imported before the thread starts.)"""

    def __init__(self, model_path: Path):
        self._path = model_path
        self._grammars: Grammars | None = None
        self._reading = threading.Lock()

    def grammars(self) -> Grammars:
        if self._grammars is None:
            with self._reading:  # one reader; a step waits for the thread's
                if self._grammars is None:
                    self._grammars = Grammars(Tokenizer.for_model(self._path))
        return self._grammars

    def read_soon(self) -> None:
        """Read the vocabulary in a thread, from now."""
        import_readers()
        threading.Thread(target=self._read, name="mashbox-vocabulary", daemon=True).start()

    def _read(self) -> None:
        try:
            self.grammars()
        except Exception:  # the first constrained step tries again, and fails its worker
            log.exception("cannot read %s's vocabulary for grammars", self._path.name)

    def matcher(self, grammar: str):
        """A fresh matcher at the start of `grammar`."""
        return self.grammars().matcher(grammar)


def import_readers() -> None:
    """Import what reading a vocabulary imports, on the calling thread: a module's first
    import racing another thread's was seen to fail (protobuf, under sentencepiece)."""
    import sentencepiece  # noqa: F401
    import tokenizers  # noqa: F401
    from sentencepiece import sentencepiece_model_pb2  # noqa: F401

    from ..engine import gguf_file  # noqa: F401


def allowed(logits: torch.Tensor, matcher, ends) -> torch.Tensor:
    """logits [V] with every token the matcher refuses set to -inf. A matcher that allows
    nothing (an error it cannot leave) allows only the end of the answer."""
    bits = np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8)
    n = min(logits.shape[-1], bits.size * 8)
    keep = np.zeros(logits.shape[-1], dtype=bool)
    keep[:n] = np.unpackbits(bits, count=n, bitorder="little").view(bool)
    if not keep.any():
        log.warning("a grammar allows no next token (%s): ending the answer", matcher.get_error())
        keep[[e for e in ends if e < keep.size]] = True
    if logits.device.type == "cpu":  # numpy: torch's ops over a vocabulary wake OpenMP
        return torch.from_numpy(np.where(keep, logits.numpy(), np.float32(-np.inf)))
    mask = torch.from_numpy(keep).to(logits.device)
    return logits.masked_fill(~mask, float("-inf"))
