"""Modules imported on first use.

`pd = lazy_import("pandas")` at the top of a module reads like `import pandas as pd`, but pandas
is only imported when the module first touches `pd.<something>`. Command-line help (`simrun
COMMAND -h`) builds parsers that live in modules full of pandas, numpy or torch code; with
their heavy imports lazy, `-h` answers in a fraction of a second. The module is not placed in
sys.modules until it is really imported, so `"pandas" in sys.modules` stays an honest test.
"""
from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any


class LazyModule(ModuleType):
    """Stands in for a module until an attribute is read; then imports it and copies its names."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.__dict__["_lazy_target"] = name

    def __getattr__(self, attr: str) -> Any:           # only called for names not yet copied
        module = importlib.import_module(self.__dict__["_lazy_target"])
        self.__dict__.update({k: v for k, v in vars(module).items() if not k.startswith("__")})
        return getattr(module, attr)


def lazy_import(name: str) -> ModuleType:
    return LazyModule(name)
