"""Packages whose exports import on first use, so that importing one module of them imports no other."""
from __future__ import annotations

import importlib


def lazy_getattr(package: str, exports: dict[str, str], modules: tuple[str, ...]):
    """A module `__getattr__` (PEP 562) for `package`: each name of `exports` is read from the module of it that
    `exports` names, and each of `modules` is that module."""
    def __getattr__(name):
        if name in exports:
            return getattr(importlib.import_module(f"{package}.{exports[name]}"), name)
        if name in modules:
            return importlib.import_module(f"{package}.{name}")
        raise AttributeError(f"module {package!r} has no attribute {name!r}")
    return __getattr__
