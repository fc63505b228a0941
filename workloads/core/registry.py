"""The registry of workloads: the name a spec's ``workload:`` gives -> its ``Workload``.

The built-in workloads are named here by import path and imported when first asked for, so
that this core module imports none of them (they build on it). A workload living elsewhere is
one ``register(MyWorkload)`` call before its specs are read.
"""

from __future__ import annotations

import importlib
from typing import TypeVar

from workloads.core.workload import Workload

# name -> "module:class" of the workloads that ship with CEM Lab
BUILTIN = {"language_model": "workloads.lm.workload:LanguageModel",
           "gp_regression": "workloads.gp.workload:GPRegression"}

_REGISTERED: dict[str, Workload] = {}

W = TypeVar("W", bound=type[Workload])


def register(cls: W) -> W:
    """Make workload ``cls`` available to specs under ``cls.name`` (usable as a decorator).

    Raises:
        ValueError: another workload already has that name or spec section.
    """
    for other in _REGISTERED.values():
        if (cls.name == other.name or cls.section == other.section) and type(other) is not cls:
            raise ValueError(f"workload {cls.name!r} (section {cls.section!r}) clashes with "
                             f"{other.name!r} (section {other.section!r})")
    _REGISTERED[cls.name] = cls()
    return cls


def _load_builtins() -> None:
    for name, where in BUILTIN.items():
        if name not in _REGISTERED:
            module, _, cls = where.partition(":")
            register(getattr(importlib.import_module(module), cls))


def workloads() -> dict[str, Workload]:
    """Every registered workload by name, the built-in ones included."""
    _load_builtins()
    return dict(_REGISTERED)


def get_workload(name: str) -> Workload:
    """The registered workload ``name``.

    Raises:
        KeyError: no such workload (the message lists the known ones).
    """
    known = workloads()
    try:
        return known[name]
    except KeyError:
        raise KeyError(f"unknown workload {name!r}; known: {', '.join(sorted(known))}"
                       ) from None
