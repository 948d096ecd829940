"""The chunked soft cross-entropy equals -(p . log_softmax(z)) in value and gradient, on any chunking."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from specheads.training.soft_cross_entropy import rows_per_chunk, soft_cross_entropy


def _case(rows: int = 10, vocab: int = 37, labels: int = 4, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=g) * 3
    probs = torch.softmax(torch.randn(labels, vocab, generator=g) * 2, -1)
    label_rows = torch.randint(0, labels, (rows,), generator=g)  # rows share labels, as TTT steps do
    return logits, probs, label_rows


def _reference(logits, probs, label_rows):
    return -(probs[label_rows] * F.log_softmax(logits.float(), -1)).sum(-1)


@pytest.mark.parametrize("chunk_rows", [1, 3, 10, None])
def test_value_gradient_and_argmax_match_the_plain_expression(chunk_rows):
    logits, probs, label_rows = _case()
    logits[4, 5] = logits[4, 9] = logits[4].max() + 1  # a tie: the first index wins, as in argmax
    a, b = logits.clone().requires_grad_(), logits.clone().requires_grad_()
    loss, argmax = soft_cross_entropy(a, probs, label_rows, chunk_rows)
    expected = _reference(b, probs, label_rows)
    torch.testing.assert_close(loss, expected)
    assert torch.equal(argmax, logits.argmax(-1)) and argmax[4] == 5
    weights = torch.arange(1.0, 11.0)  # a non-uniform upstream gradient
    (loss * weights).sum().backward()
    (expected * weights).sum().backward()
    torch.testing.assert_close(a.grad, b.grad)


def test_gradcheck_in_float64():
    logits, probs, label_rows = _case(rows=5, vocab=7)
    logits = logits.double().requires_grad_()
    assert torch.autograd.gradcheck(
        lambda z: soft_cross_entropy(z, probs.double(), label_rows, 2)[0], (logits,)
    )


def test_bf16_logits_get_bf16_gradients_of_the_float32_loss():
    logits, probs, label_rows = _case()
    low = logits.to(torch.bfloat16).requires_grad_()
    loss, _ = soft_cross_entropy(low, probs, label_rows, 4)
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss, _reference(low.detach().float(), probs, label_rows))
    loss.sum().backward()
    assert low.grad.dtype == torch.bfloat16
    reference = low.detach().float().requires_grad_()
    _reference(reference, probs, label_rows).sum().backward()
    torch.testing.assert_close(low.grad.float(), reference.grad, atol=1e-2, rtol=1e-2)


def test_no_rows_and_bad_input():
    logits, probs, _ = _case()
    empty = logits[:0].clone().requires_grad_()
    loss, argmax = soft_cross_entropy(empty, probs, torch.zeros(0, dtype=torch.long))
    assert loss.shape == (0,) and argmax.shape == (0,)
    loss.sum().backward()
    assert empty.grad.shape == (0, 37)
    with pytest.raises(ValueError, match="same V"):
        soft_cross_entropy(logits, probs[:, :5], torch.zeros(10, dtype=torch.long))
    with pytest.raises(ValueError, match="label_rows"):
        soft_cross_entropy(logits, probs, torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match="constants"):
        soft_cross_entropy(logits, probs.clone().requires_grad_(), torch.zeros(10, dtype=torch.long))
    with pytest.raises(ValueError, match="chunk_rows=0"):
        soft_cross_entropy(logits, probs, torch.zeros(10, dtype=torch.long), 0)


def test_chunks_stay_small_on_the_cpu():
    assert rows_per_chunk(torch.empty(0, 8192)) * 8192 * 4 <= 8 << 20  # 8 MiB of float32 logits a chunk
    assert rows_per_chunk(torch.empty(0, 10**8)) == 1
