"""Mixed precision as a memory relief: activations saved for backward in 16 bits.

bf16 where the device has it (CPU; CUDA from Ampere on): same range as fp32, no loss
scaling needed. fp16 on older CUDA devices, with a gradient scaler (fp16's range would let
small gradients underflow to zero).

Owns the autocast plan (dtype, whether a scaler is needed). Touches nothing: the step core applies it.
"""

from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass(frozen=True)
class AutocastPlan:
    """How to autocast on a device: `dtype`, and whether a gradient scaler is needed."""

    device_type: str
    dtype: torch.dtype
    needs_scaler: bool

    def context(self) -> torch.autocast:
        return torch.autocast(device_type=self.device_type, dtype=self.dtype)


def autocast_plan(device: torch.device) -> AutocastPlan | None:
    """The autocast for `device`, or None where it has none."""
    if device.type == "cuda":
        if torch.cuda.is_bf16_supported():
            return AutocastPlan("cuda", torch.bfloat16, needs_scaler=False)
        return AutocastPlan("cuda", torch.float16, needs_scaler=True)
    if device.type == "cpu":
        return AutocastPlan("cpu", torch.bfloat16, needs_scaler=False)
    return None


def precision_plan(precision: str, device: torch.device) -> AutocastPlan | None:
    """The autocast for a precision the user chose: None for "fp32"; "fp16" needs a gradient scaler."""
    if precision == "fp32":
        return None
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    return AutocastPlan(device.type, dtype, needs_scaler=dtype is torch.float16)
