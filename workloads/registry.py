"""The registry of workloads: the name a spec's ``workload:`` gives -> its ``Workload``.

A new workload is one module with a ``Workload`` subclass and one ``register`` line here (or, for
a workload living elsewhere, one ``register(MyWorkload)`` call before its specs are read).
"""

from __future__ import annotations

from typing import TypeVar

from workloads.base import Workload
from workloads.gp.workload import GPRegression
from workloads.language_model import LanguageModel

WORKLOADS: dict[str, Workload] = {}

W = TypeVar("W", bound=type[Workload])


def register(cls: W) -> W:
    """Make workload ``cls`` available to specs under ``cls.name`` (usable as a decorator).

    Raises:
        ValueError: another workload already has that name or spec section.
    """
    for other in WORKLOADS.values():
        if (cls.name == other.name or cls.section == other.section) and type(other) is not cls:
            raise ValueError(f"workload {cls.name!r} (section {cls.section!r}) clashes with "
                             f"{other.name!r} (section {other.section!r})")
    WORKLOADS[cls.name] = cls()
    return cls


def get_workload(name: str) -> Workload:
    """The registered workload ``name``.

    Raises:
        KeyError: no such workload (the message lists the known ones).
    """
    try:
        return WORKLOADS[name]
    except KeyError:
        raise KeyError(f"unknown workload {name!r}; known: {', '.join(sorted(WORKLOADS))}"
                       ) from None


register(LanguageModel)
register(GPRegression)
