"""What every decode weight's call shares (`CompactWeight`): its compact form multiplies up to
`max_rows` rows; a call of more takes the float matrix `w` where one is kept, else the compact
form in pieces of `max_rows` rows.

The weights read from a file's blocks keep no float matrix where their activations are rounded
to integers (int4a16, int4a8): a row's bits do not depend on how many rows share the kernel's
call (tests/test_amx.py, test_kquant.py), so pieces give every row what a prefill chunk gives
it, and a 4-bit model's memory is its blocks, not eight times them in float32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


class CompactWeight:
    """x @ w.T (+ bias) for x [rows, K], through `multiply` up to `max_rows` rows."""

    w: Tensor | None = None  # the float weights [N, K] for calls past max_rows, if kept
    max_rows: int

    def __call__(self, x: Tensor, bias: Tensor | None = None) -> Tensor:
        if x.shape[0] > self.max_rows:
            if self.w is not None:
                return F.linear(x, self.w, bias)
            return torch.cat([self(piece, bias) for piece in x.split(self.max_rows)])
        y = self.multiply(x).to(x.dtype)
        return y + bias if bias is not None else y

    def multiply(self, x: Tensor) -> Tensor:
        """x @ w.T through the compact form, x at most `max_rows` rows."""
        raise NotImplementedError
