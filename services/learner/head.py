"""The LM head and the log-probs the loss reads, a chunk of tokens at a time, recomputed in the backward pass.

Owns the step from the body's last hidden states to each completion
token's log-prob and the sampling distribution's entropy. The head's
logits are ``[tokens, vocabulary]``: at a vocabulary of 151,936 a float32
row is 0.6 MB, and the logits, their log-softmax and its exponential, held
for the backward pass, were most of a GPU learner's memory. Here they live
one chunk at a time (``HEAD_CHUNK_BYTES``) and are computed again in the
backward pass; only the hidden states, the targets and two floats a token
are kept.

Two precisions, as the generator's engines compute the head:

- ``fp32``: float32 operands and accumulation (vLLM's head on the CPU and
  in a float32 engine);
- ``bf16_fp32_acc``: bf16 operands with float32 accumulation and float32
  logits, log-softmax and entropy (vLLM's FP32 head of a bf16 engine on
  GPUs). The operands are rounded to bf16 and multiplied exactly (a product
  of two bf16 numbers fits a float32), summed in float32; on CUDA with
  ``torch.mm(..., out_dtype=torch.float32)``.

The gradient treats the bf16 rounding as the identity (straight through).
"""

from __future__ import annotations

from typing import Any, Literal

import torch

from services.learner.activations import chunk_rows

HeadPrecision = Literal["fp32", "bf16_fp32_acc"]


def _operands(
    hidden: torch.Tensor, weight: torch.Tensor, precision: HeadPrecision
) -> tuple[torch.Tensor, torch.Tensor, torch.dtype]:
    """The matmul's operands and its accumulation dtype (float64 stays float64: gradcheck)."""
    if hidden.dtype == torch.float64:
        return hidden, weight.double(), torch.float64
    if precision == "bf16_fp32_acc":
        return hidden.to(torch.bfloat16), weight.to(torch.bfloat16), torch.float32
    return hidden.float(), weight.float(), torch.float32


def _logits(h: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, acc: torch.dtype) -> torch.Tensor:
    """``h @ w.T (+ bias)`` accumulated and returned in ``acc``."""
    if h.dtype == torch.bfloat16:
        if h.is_cuda:
            out = torch.mm(h, w.t(), out_dtype=acc)
        else:  # the same numbers: bf16 values multiply exactly in float32
            out = h.to(acc) @ w.to(acc).t()
    else:
        out = h @ w.t()
    return out if bias is None else out + bias.to(acc)


class _ChunkedHead(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        targets: torch.Tensor,
        inv_temperature: torch.Tensor,
        precision: HeadPrecision,
        rows: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        h_all, w, acc = _operands(hidden, weight, precision)
        logp = torch.empty(hidden.shape[0], dtype=acc, device=hidden.device)
        entropy = torch.empty_like(logp)
        for start in range(0, hidden.shape[0], rows):
            end = min(start + rows, hidden.shape[0])
            z = _logits(h_all[start:end], w, bias, acc) * inv_temperature[start:end, None].to(acc)
            logsm = torch.log_softmax(z, dim=-1)
            del z  # one chunk's tensors at a time: freed before the next chunk's are made
            logp[start:end] = logsm.gather(-1, targets[start:end, None]).squeeze(-1)
            entropy[start:end] = -(logsm.exp() * logsm).sum(-1)
            del logsm
        ctx.save_for_backward(hidden, weight, bias, targets, inv_temperature)
        ctx.precision, ctx.rows = precision, rows
        ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    def backward(ctx: Any, grad_logp: torch.Tensor, _: torch.Tensor | None) -> tuple[Any, ...]:
        hidden, weight, bias, targets, inv_temperature = ctx.saved_tensors
        h_all, w, acc = _operands(hidden, weight, ctx.precision)
        w_acc = w.to(acc)
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        grad_weight = torch.zeros(weight.shape, dtype=acc, device=weight.device) if ctx.needs_input_grad[1] else None
        grad_bias = (
            torch.zeros(bias.shape, dtype=acc, device=bias.device)
            if bias is not None and ctx.needs_input_grad[2]
            else None
        )
        for start in range(0, hidden.shape[0], ctx.rows):
            end = min(start + ctx.rows, hidden.shape[0])
            scale = inv_temperature[start:end, None].to(acc)
            z = _logits(h_all[start:end], w, bias, acc) * scale
            g = grad_logp[start:end, None].to(acc)
            # d logp_target / d z = onehot(target) - softmax(z); then through z = scale * logits.
            dz = torch.softmax(z, dim=-1).mul_(-g)
            dz.scatter_add_(-1, targets[start:end, None], g)
            del z
            dlogits = dz.mul_(scale)
            if grad_hidden is not None:
                grad_hidden[start:end] = (dlogits @ w_acc).to(hidden.dtype)
            if grad_weight is not None:
                grad_weight.addmm_(dlogits.t(), h_all[start:end].to(acc))  # in place: no [vocab, hidden] temporary
            if grad_bias is not None:
                grad_bias += dlogits.sum(0)
            del dz, dlogits
        return (
            grad_hidden,
            None if grad_weight is None else grad_weight.to(weight.dtype),
            None if grad_bias is None else grad_bias.to(bias.dtype),
            None,
            None,
            None,
            None,
        )


def head_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    inv_temperature: torch.Tensor,
    precision: HeadPrecision = "fp32",
    rows: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's log-prob of ``targets`` and the distribution's entropy, both float32 ``[tokens]``.

    ``hidden`` is ``[tokens, hidden_size]``, ``weight`` the head's ``[vocab,
    hidden_size]``, ``inv_temperature`` each token's 1 / temperature (the
    logits are divided by the temperature the generator sampled at). Only
    the log-probs carry a gradient. ``rows``: tokens a chunk (default: as
    many as ``HEAD_CHUNK_BYTES`` of float32 logits hold).
    """
    chunk = rows if rows is not None else chunk_rows(weight.shape[0])
    out: tuple[torch.Tensor, torch.Tensor] = _ChunkedHead.apply(
        hidden, weight, bias, targets, inv_temperature, precision, chunk
    )
    return out
