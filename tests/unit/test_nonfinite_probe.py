"""check_for_nan_in_grad's per-bucket probe: one sum, exact counts on CPU, no false alarm on overflow."""
import pytest
import torch

from megatron_opt.distributed.grad_sync import nonfinite_probe


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_probe_counts_nonfinite_elements(dtype):
    grad = torch.randn(10_000).to(dtype)
    assert int(nonfinite_probe(grad)) == 0
    grad[17], grad[4000], grad[9999] = float("nan"), float("inf"), float("-inf")  # inf + -inf = nan
    assert int(nonfinite_probe(grad)) == 3


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_probe_finite_values_that_overflow_the_sum_are_not_flagged(dtype):
    big = torch.finfo(dtype).max / 2
    grad = torch.full((1000,), big, dtype=dtype)
    assert not torch.isfinite(grad.sum()), "the case must overflow the plain sum"
    assert int(nonfinite_probe(grad)) == 0
