"""Everything that runs inside a Ray worker: models, data, the training loop.

Nothing here imports ``ray`` or ``orchestrator`` at module level, so the models import and
run with torch alone (e.g. on a GPU box that only has torch).
"""
