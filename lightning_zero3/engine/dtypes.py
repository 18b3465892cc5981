"""The dtype names a user may write (`param_dtype="bf16"`, `consolidate --dtype fp16`)."""

from __future__ import annotations

import torch

DTYPE_NAMES: dict[str, torch.dtype] = {
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
    "16": torch.float16,
    "half": torch.float16,
    "fp32": torch.float32,
    "float32": torch.float32,
    "32": torch.float32,
    "fp64": torch.float64,
    "float64": torch.float64,
    "64": torch.float64,
}


def parse_dtype(value: object, where: str) -> torch.dtype | None:
    """`value` (None, a floating dtype or a name, any case) as a dtype, else `ValueError` naming `where`."""
    if value is None or isinstance(value, torch.dtype) and value.is_floating_point:
        return value
    if isinstance(value, str) and value.lower() in DTYPE_NAMES:
        return DTYPE_NAMES[value.lower()]
    raise ValueError(f"{where} must be a floating torch.dtype or one of {sorted(DTYPE_NAMES)}; got {value!r}.")


__all__ = ["DTYPE_NAMES", "parse_dtype"]
