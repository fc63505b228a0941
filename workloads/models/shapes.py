"""Build modules for their shapes alone: parameter counts without initialisation."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch.overrides import TorchFunctionMode

# In-place initialisers that nn modules call from their constructors and reset_parameters.
_INITIALISERS = frozenset({"normal_", "uniform_", "trunc_normal_", "kaiming_uniform_",
                           "kaiming_normal_", "xavier_uniform_", "xavier_normal_",
                           "zeros_", "ones_", "constant_", "zero_", "fill_"})


class _SkipInitialisers(TorchFunctionMode):
    """Returns an initialiser's tensor untouched, so a parameter's pages are never written."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__name__", "") in _INITIALISERS:
            return args[0] if args else kwargs["tensor"]
        return func(*args, **kwargs)


@contextlib.contextmanager
def shapes_only() -> Iterator[None]:
    """Modules built inside get uninitialised CPU parameters: right shapes and dtypes, values
    garbage, memory reserved but never touched (a 134M model adds no resident memory). Use them
    for counting, never for computing.

    Not the meta device: PyTorch runs meta tensors' factories and random initialisers through
    its Python reference decompositions, whose first use imports TorchDynamo (seconds).
    """
    with torch.device("cpu"), _SkipInitialisers():
        yield
