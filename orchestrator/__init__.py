"""Spec -> plan -> Ray Train launch -> MLflow tracking; the ``python -m orchestrator`` CLI."""
