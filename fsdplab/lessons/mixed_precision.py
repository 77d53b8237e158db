"""Lesson 04 (mixed precision pitfalls) only: the claims' verdicts as functions of what the lesson measured,
and the exercise checker that answers with the lab's own gradients.

Claim 9: "fp16 MixedPrecision; the optimizer keeps fp32". Claim 10: "`mixed_precision=torch.float16`; keep
LayerNorm in fp32 via `reduce_dtype=torch.float32`".
"""

from __future__ import annotations

import torch

from ..exercises import exercise
from ..precision import underflow_fraction

FP16_MAX = torch.finfo(torch.float16).max
FP16_SMALLEST = torch.finfo(torch.float16).smallest_normal * torch.finfo(torch.float16).eps   # subnormal


def claim9_verdict(adam: dict) -> str:
    """TRUE when AdamW kept fp32 state for the model wrapped in fp32 and for the one loaded in fp16, WRONG
    when for neither, PARTLY TRUE in between (`adam` is `precision.adam_state_dtypes()`)."""
    kept = [adam[name]["state_dtype"] == "float32" for name in ("fp32", "fp16")]
    return "TRUE" if all(kept) else "PARTLY TRUE" if any(kept) else "WRONG"


def claim10_verdict(posts_call: str, norm_weight_dtypes) -> str:
    """TRUE when the posts' `mixed_precision=torch.float16` is accepted and every norm weight ran in fp32
    with reduce_dtype=fp32; WRONG when neither holds; PARTLY TRUE otherwise."""
    accepted = posts_call == "no error"
    fp32_norms = all(d == "float32" for d in norm_weight_dtypes)
    return "TRUE" if accepted and fp32_norms else "WRONG" if not (accepted or fp32_norms) else "PARTLY TRUE"


def safe_loss_scales(grads: torch.Tensor, shrink: float = 1.0) -> tuple:
    """(smallest power of two that flushes none of `grads * shrink` to 0 in fp16, largest scale before the
    biggest of them passes fp16's max) for these gradients."""
    k = -30
    while underflow_fraction(grads, "fp16", 2.0 ** k, shrink) > 0 and k < 120:
        k += 1
    return 2.0 ** k, FP16_MAX / float(grads.abs().max() * shrink)


@exercise("04-loss-scale")
def _loss_scale(answer, *, grads, shrink):
    """A loss scale under which the gradients (x shrink) neither flush to 0 nor overflow in fp16."""
    try:
        scale = float(answer)
    except (TypeError, ValueError):
        return False, f"expected a number (a loss scale such as 2.0 ** 10), got {answer!r}."
    low, high = safe_loss_scales(grads, shrink)
    flushed = underflow_fraction(grads, "fp16", scale, shrink)
    biggest = float(grads.abs().max() * shrink * scale)
    if flushed > 0:
        return False, (f"{flushed:.2%} of the gradients still become 0 in fp16 at scale {scale:g}: scale up. Hint: "
                       f"the smallest |gradient| is {float(grads.abs().min() * shrink):.2e} and fp16's smallest "
                       f"subnormal is {FP16_SMALLEST:.2e}.")
    if biggest > FP16_MAX:
        return False, (f"the largest gradient times {scale:g} is {biggest:.3g}, above fp16's max {FP16_MAX:g}: "
                       "it would be inf and the scaler would skip the step. Scale down.")
    return True, (f"at {scale:g} no gradient flushes to 0 and the largest is {biggest:.3g} < {FP16_MAX:g}; "
                  f"the safe window for these gradients runs from {low:g} to {high:.3g}.")
