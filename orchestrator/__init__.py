"""Spec -> plan -> Ray Train launch -> MLflow tracking; the ``cemlab`` command (also
``python -m orchestrator``)."""
