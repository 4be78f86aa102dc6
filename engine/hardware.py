"""Which device catalog entry (sim/catalog/devices.yaml) describes the visible GPU."""
from __future__ import annotations

from sim.core.lazy import lazy_import

torch = lazy_import("torch")   # imported on first use: `simrun COMMAND -h` builds parsers without torch

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


def pick_device(choice: str | None) -> str:
    """'cuda' or 'cpu': the user's choice, checked, else CUDA when one is visible."""
    if choice == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device is visible here (use --device cpu)")
    return choice or ("cuda" if torch.cuda.is_available() else "cpu")


def add_device_args(parser) -> None:
    """--device and --threads, shared by the commands that run the engine."""
    parser.add_argument("--device", choices=["cuda", "cpu"], default=None,
                        help="where the engine runs (default: cuda when available, else cpu)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch CPU threads (default on CPU: 1, fastest for small models on a shared "
                             "machine, where spinning OpenMP threads fight each other)")


def set_cpu_threads(device: str, threads: int | None) -> None:
    if device == "cpu" or threads is not None:
        torch.set_num_threads(threads or 1)
