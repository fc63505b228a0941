"""Everything that runs inside a Ray worker, in layers, each importing only those below it:

- ``lm`` and ``gp``: the two workloads (language modelling; GP regression, paper App. D);
- ``models`` (the CEM and Llama layers, torch alone) and ``runtime`` (sessions, engines, the
  optimizer, checkpoints, metrics, timing);
- ``core``: the ``Trial``, the ``Workload`` interface and its registry, the spec sections, the
  ``ModelConfig``; the only part the orchestrator imports.

Nothing here imports ``ray``, ``deepspeed``, ``mlflow`` or ``orchestrator`` at module level, so
the models import and run with torch alone, ``python -m workloads.lm.step_bench`` with torch and
tabulate (e.g. on a GPU box whose image has no spec, data or tracking packages), and
``cemlab train`` runs a trial with no services at all. The one exception is the MLflow flavour
of registered models (``lm.serving``, ``lm.serving_model``), which imports mlflow.
"""
