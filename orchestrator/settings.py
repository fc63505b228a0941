"""Where CEM Lab keeps its state and which MLflow tracking server it talks to."""

from __future__ import annotations

import logging
import os
from pathlib import Path

log = logging.getLogger(__name__)


def cemlab_home() -> Path:
    """``$CEMLAB_HOME``, else ``./.cemlab``: data cache, Ray results, local service state."""
    return Path(os.environ.get("CEMLAB_HOME") or Path.cwd() / ".cemlab").resolve()


def data_dir() -> Path:
    """Cache of downloaded corpora, tokenizers and token streams."""
    return cemlab_home() / "data"


def tracking_uri() -> str:
    """``$MLFLOW_TRACKING_URI`` (the local server started by ``make up``), else an embedded
    SQLite store under ``cemlab_home()`` (works without services, e.g. on a laptop)."""
    uri = os.environ.get("MLFLOW_TRACKING_URI")
    if uri:
        return uri
    path = cemlab_home() / "mlflow.db"
    path.parent.mkdir(parents=True, exist_ok=True)
    log.warning("MLFLOW_TRACKING_URI is not set: tracking to %s", path)
    return f"sqlite:///{path}"


def ledger_url() -> str:
    """SQLAlchemy URL of the experiment ledger: ``$CEMLAB_LEDGER_URL`` (``make up`` sets it to
    MLflow's backend store), else the tracking URI when it is a database, else the embedded
    SQLite store under ``cemlab_home()``."""
    url = os.environ.get("CEMLAB_LEDGER_URL")
    if url:
        return url
    uri = tracking_uri()
    if uri.startswith(("sqlite:", "postgresql", "mysql", "mssql")):
        return uri
    path = cemlab_home() / "mlflow.db"
    path.parent.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{path}"
