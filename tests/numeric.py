"""Numeric comparison for tests: closeness with a failure message that reports the size of the error."""
from __future__ import annotations

import torch


def assert_close(actual: torch.Tensor, expected: torch.Tensor, atol: float = 1e-4, rtol: float = 1e-4,
                 what: str = 'tensor') -> None:
    """Element-wise closeness; the failure message reports max-abs error and the RMS error ratio."""
    actual, expected = actual.detach().float().cpu(), expected.detach().float().cpu()
    assert actual.shape == expected.shape, f'{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}'
    diff = (actual - expected).abs()
    max_abs = diff.max().item() if diff.numel() else 0.0
    rms_ratio = (diff.pow(2).mean().sqrt() / expected.pow(2).mean().sqrt().clamp(min=1e-12)).item() \
        if diff.numel() else 0.0
    ok = torch.allclose(actual, expected, atol=atol, rtol=rtol)
    assert ok, f'{what}: max abs err {max_abs:.3e}, rms ratio {rms_ratio:.3e} (atol {atol}, rtol {rtol})'
