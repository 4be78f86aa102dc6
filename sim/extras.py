"""Optional packages: which pyproject extra installs each, and one clear line when one is missing.

Commands that need the engine (torch) or the HTTP stack (fastapi, uvicorn, httpx) check right
after parsing their flags, before any work, so a light install gets the pip command instead of
a traceback minutes in (`simrun -h` and `simrun COMMAND -h` need none of them)."""
from __future__ import annotations

import importlib.util

from sim.errors import UserError

# optional dependencies -> the pyproject extra that installs them
EXTRA_OF = {"torch": "engine", "triton": "engine", "safetensors": "engine", "scipy": "engine",
            "fastapi": "serve", "uvicorn": "serve", "httpx": "serve", "ray": "ray", "tokenizers": "text"}


def installed(package: str) -> bool:
    try:
        return importlib.util.find_spec(package) is not None
    except (ImportError, ValueError):          # a broken install, or a module without a spec
        return False


def install_hint(packages: list[str]) -> str:
    extras = ",".join(dict.fromkeys(EXTRA_OF.get(p.split(".")[0], "engine,serve") for p in packages))
    return f"pip install 'kvtwin[{extras}]' (from a clone: pip install -e '.[{extras}]')"


def require(command: str, *packages: str) -> None:
    """A UserError naming the missing packages and the extra that brings them."""
    missing = [p for p in packages if not installed(p)]
    if missing:
        raise UserError(f"`{command}` needs the optional package{'s' if len(missing) > 1 else ''} "
                        f"{', '.join(missing)}, not installed here: {install_hint(missing)}")
