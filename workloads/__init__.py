"""Everything that runs inside a Ray worker: the ``Workload`` interface and its two
implementations (``language_model``, ``gp``), models, data, engines and sessions.

Nothing here imports ``ray``, ``deepspeed``, ``mlflow`` or ``orchestrator`` at module level, so
the models import and run with torch alone, and ``python -m workloads.bench`` with torch and
tabulate (e.g. on a GPU box whose image has no spec, data or tracking packages), and
``python -m workloads.train`` runs a trial with no services at all. The one exception is the
MLflow flavour of registered models (``serving``, ``serving_model``), which imports mlflow.
"""
