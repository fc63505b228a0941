"""Spec -> plan -> Ray Train launch -> MLflow tracking; the ``cemlab`` command (also
``python -m orchestrator``). In layers, each importing only those below it: ``cli`` and
``bench``; ``execution``; ``science``; ``records``; ``planning``; ``settings`` and ``table``."""
