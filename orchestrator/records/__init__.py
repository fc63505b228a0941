"""What is kept of an experiment's trials: the ledger of their status (``ledger``, with its
Alembic ``migrations/``), their MLflow runs (``tracking``), the registered models
(``model_registry``) and the result bundles that outlive the machine (``bundles``).
Built on ``planning``; judges nothing and launches nothing."""
