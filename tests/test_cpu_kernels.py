"""mashbox's CPU int8 kernel against a plain float matmul of the same int8 weights."""

from __future__ import annotations

import pytest
import torch

from mashbox.engine import cpu_kernels
from mashbox.engine.model import Int8Weight

kernel = cpu_kernels.load()
pytestmark = pytest.mark.skipif(kernel is None, reason="no AVX2 or no compiler here")


@pytest.mark.parametrize("m", range(1, 17))
@pytest.mark.parametrize(("n", "k"), [(960, 576), (37, 64), (8, 8)])
def test_int8_linear_is_the_dequantized_matmul(m, n, k):
    """Every batch size a decode step can have (1-16 rows: blocks of 4, 3, 2 and 1 rows)
    and output sizes that are not a multiple of the kernel's row blocks."""
    g = torch.Generator().manual_seed(m * 1000 + n)
    q = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g)
    scale = torch.rand(n, generator=g) / 100
    x = torch.randn(m, k, generator=g)
    expected = (x.double() @ (q.double() * scale.double()[:, None]).T).float()
    torch.testing.assert_close(kernel.int8_linear(x, q, scale), expected, rtol=1e-5, atol=1e-5)


def test_int8_weights_use_it_with_float32_activations():
    w = torch.randn(64, 128)
    weight = Int8Weight(w)
    assert weight.kernel is kernel
    x = torch.randn(3, 128)
    dequantized = weight.q.float() * weight.scale[:, None]
    torch.testing.assert_close(weight(x), x @ dequantized.T, rtol=1e-5, atol=1e-5)
    assert Int8Weight(torch.randn(16, 12)).kernel is None  # K not a multiple of 8: torch's
