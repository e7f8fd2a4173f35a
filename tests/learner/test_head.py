"""The chunked LM head: the generator's formula, exact gradients, and any chunking the same.

Against a float64 reference (``log_softmax`` of float64 logits), the
float32 head within 1e-5 and the bf16-operand head within 2e-2 (logits of a
trained model's scale: standard deviation about 1.6, temperatures 0.7-1.3); the
bf16-operand head against a reference of vLLM's formula (bf16 operands,
float32 accumulation and log-softmax) within 1e-4; gradients against
autograd (float64 ``gradcheck`` for the function itself, and autograd
through each reference formula); one chunk or many give the same numbers.
Memory: ``python -m benchmarks.head``.
"""

from __future__ import annotations

import pytest
import torch

from services.learner.head import head_logprobs

TOKENS, HIDDEN, VOCAB = 37, 64, 1000


def inputs(dtype: torch.dtype = torch.float32, bias: bool = True, seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    # A trained model's scale: a normed hidden state, logits of standard deviation about 1.6.
    hidden = torch.randn(TOKENS, HIDDEN, generator=g, dtype=dtype)
    weight = torch.randn(VOCAB, HIDDEN, generator=g, dtype=dtype) * 0.2
    b = torch.randn(VOCAB, generator=g, dtype=dtype) * 0.1 if bias else None
    targets = torch.randint(0, VOCAB, (TOKENS,), generator=g)
    inv_t = 1.0 / torch.tensor([0.7, 1.0, 1.3], dtype=dtype).repeat(TOKENS)[:TOKENS]
    return hidden, weight, b, targets, inv_t  # type: ignore[return-value]


def reference(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    inv_t: torch.Tensor,
    operands: torch.dtype,
    acc: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The obvious formula: operands rounded to ``operands``, everything else in ``acc``. The rounding passes
    gradients through unchanged (straight through), as the head's does; a plain cast would round them too."""

    def rounded(x: torch.Tensor) -> torch.Tensor:
        return x.to(acc) + (x.to(operands).to(acc) - x.to(acc)).detach()

    logits = rounded(hidden) @ rounded(weight).T
    if bias is not None:
        logits = logits + bias.to(acc)
    logsm = torch.log_softmax(logits * inv_t.to(acc)[:, None], -1)
    return logsm.gather(-1, targets[:, None]).squeeze(-1), -(logsm.exp() * logsm).sum(-1)


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
def test_log_probs_and_entropy_match_the_references(bias: bool) -> None:
    h, w, b, t, inv_t = inputs(bias=bias)
    exact, exact_entropy = reference(h, w, b, t, inv_t, torch.float64, torch.float64)
    fp32, fp32_entropy = head_logprobs(h, w, b, t, inv_t, "fp32")
    assert fp32.dtype == torch.float32
    assert float((fp32 - exact).abs().max()) <= 1e-5
    assert float((fp32_entropy - exact_entropy).abs().max()) <= 1e-4
    acc, acc_entropy = head_logprobs(h, w, b, t, inv_t, "bf16_fp32_acc")
    vllm, vllm_entropy = reference(h, w, b, t, inv_t, torch.bfloat16, torch.float32)
    gap_exact, gap_vllm = float((acc - exact).abs().max()), float((acc - vllm).abs().max())
    print(f"bf16_fp32_acc: {gap_exact:.2e} from float64, {gap_vllm:.2e} from vLLM's formula")
    assert gap_exact <= 2e-2 and gap_vllm <= 1e-4
    assert gap_exact > 1e-4  # the operands really were rounded
    assert float((acc_entropy - vllm_entropy).abs().max()) <= 1e-4


def test_the_function_s_gradients_are_autograd_s_in_float64() -> None:
    h, w, b, t, inv_t = inputs(torch.float64)
    h, w, b = (x[:5].clone().requires_grad_() if x is h else x.clone().requires_grad_() for x in (h, w, b))  # type: ignore[union-attr]
    small_w = w[:50].detach().clone().requires_grad_()
    small_b = b[:50].detach().clone().requires_grad_()  # type: ignore[index]
    targets = t[:5] % 50

    def logp(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        return head_logprobs(hidden, weight, bias, targets, inv_t[:5], "fp32", rows=2)[0]

    assert torch.autograd.gradcheck(logp, (h, small_w, small_b))


@pytest.mark.parametrize("precision", ["fp32", "bf16_fp32_acc"])
def test_gradients_match_autograd_through_the_reference_and_any_chunking(precision: str) -> None:
    h, w, b, t, inv_t = inputs()
    operands = torch.bfloat16 if precision == "bf16_fp32_acc" else torch.float32
    upstream = torch.randn(TOKENS, generator=torch.Generator().manual_seed(1))
    grads = []
    for rows in (None, 5):
        leaves = [x.clone().requires_grad_() for x in (h, w, b)]  # type: ignore[union-attr]
        out, _ = head_logprobs(leaves[0], leaves[1], leaves[2], t, inv_t, precision, rows=rows)  # type: ignore[arg-type]
        (out * upstream).sum().backward()
        grads.append([x.grad for x in leaves])
    leaves = [x.clone().requires_grad_() for x in (h, w, b)]  # type: ignore[union-attr]
    want, _ = reference(leaves[0], leaves[1], leaves[2], t, inv_t, operands, torch.float32)
    (want * upstream).sum().backward()
    for got in grads:
        for mine, theirs in zip(got, (x.grad for x in leaves), strict=True):
            assert mine is not None and theirs is not None
            torch.testing.assert_close(mine, theirs, rtol=1e-4, atol=1e-5)
    for whole, chunked in zip(grads[0], grads[1], strict=True):
        torch.testing.assert_close(whole, chunked, rtol=1e-5, atol=1e-6)  # one chunk or eight: the same step


def test_entropy_carries_no_gradient() -> None:
    h, w, b, t, inv_t = inputs()
    h.requires_grad_()
    _, entropy = head_logprobs(h, w, b, t, inv_t)
    assert not entropy.requires_grad
