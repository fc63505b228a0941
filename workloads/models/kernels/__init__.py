"""Hand-written GPU kernels of the models (Triton), each behind a model option with a plain-torch
reference that stays the fallback: ``cem_attention`` (CEM attention, ``CEMAttention.kernel:
triton``)."""
