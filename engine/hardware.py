"""Which device catalog entry (sim/catalog/devices.yaml) describes the visible GPU."""
from __future__ import annotations

import torch

# Substrings of torch's device name -> catalog entry (A100 is told apart by its memory).
DEVICE_NAMES = (("H200", "h200"), ("H100", "h100-sxm"), ("L40S", "l40s"), ("L4", "l4"), ("4090", "rtx-4090"))


def catalog_device_for_cuda() -> str:
    """The catalog entry matching GPU 0, or a ValueError asking for an explicit one."""
    props = torch.cuda.get_device_properties(0)
    if "A100" in props.name:
        return "a100-80g" if props.total_memory > 50 * 2**30 else "a100-40g"
    for token, name in DEVICE_NAMES:
        if token in props.name:
            return name
    raise ValueError(f"no device catalog entry matches '{props.name}'; name one explicitly "
                     f"(--catalog-device NAME, or a device mapping in a scenario)")
