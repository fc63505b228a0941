"""The orchestrator's settings: local state (``workloads.core.paths.Paths``), the MLflow tracking
URI and the ledger's database, from the environment (pydantic-settings)."""

from __future__ import annotations

import logging

from pydantic import AliasChoices, Field

from workloads.core.paths import Paths
from workloads.core.storage import StorageRoot

log = logging.getLogger(__name__)

_DATABASES = ("sqlite:", "postgresql", "mysql", "mssql")


class Settings(Paths):
    """``CEMLAB_HOME``, ``CEMLAB_STORAGE`` (+ ``CEMLAB_S3_ENDPOINT_URL``),
    ``MLFLOW_TRACKING_URI``, ``CEMLAB_LEDGER_URL`` and ``CEMLAB_LEASE_S`` (seconds a trial's
    lease lasts without a heartbeat: how long a dead submission's trials wait to be taken over).

    The storage root (``workloads.core.storage``) defaults to the home: on a laptop everything stays
    local; on a cluster set ``CEMLAB_STORAGE=s3://bucket/prefix`` so that every node reaches the
    corpus, the checkpoints and the Tune state.

    Without ``MLFLOW_TRACKING_URI`` tracking goes to an embedded SQLite store under the home
    (works without services, e.g. on a laptop); without ``CEMLAB_LEDGER_URL`` the ledger lives
    in MLflow's database when the tracking URI is one, else in that embedded store.
    """

    mlflow_tracking_uri: str | None = Field(
        None, validation_alias=AliasChoices("MLFLOW_TRACKING_URI", "mlflow_tracking_uri"))
    ledger_url_env: str | None = Field(
        None, validation_alias=AliasChoices("CEMLAB_LEDGER_URL", "ledger_url"))
    storage_uri: str | None = Field(
        None, validation_alias=AliasChoices("CEMLAB_STORAGE", "storage"))
    s3_endpoint_url: str | None = None
    lease_s: float = Field(120.0, gt=0, le=86400)  # CEMLAB_LEASE_S: a trial lease's life

    @property
    def storage(self) -> StorageRoot:
        """The storage root: ``CEMLAB_STORAGE``, else the home directory."""
        return StorageRoot(uri=self.storage_uri or str(self.cemlab_home),
                           endpoint_url=self.s3_endpoint_url or None)

    def _embedded_store(self) -> str:
        path = self.cemlab_home / "mlflow.db"
        path.parent.mkdir(parents=True, exist_ok=True)
        return f"sqlite:///{path}"

    @property
    def tracking_uri(self) -> str:
        if self.mlflow_tracking_uri:
            return self.mlflow_tracking_uri
        store = self._embedded_store()
        log.warning("MLFLOW_TRACKING_URI is not set: tracking to %s", store)
        return store

    @property
    def ledger_url(self) -> str:
        """SQLAlchemy URL of the experiment ledger."""
        if self.ledger_url_env:
            return self.ledger_url_env
        if self.mlflow_tracking_uri and self.mlflow_tracking_uri.startswith(_DATABASES):
            return self.mlflow_tracking_uri
        return self._embedded_store()

    def existing_ledger_url(self) -> str | None:
        """``ledger_url``, or None when that is the embedded store and it does not exist yet;
        creates nothing (for readers such as ``plan``)."""
        if self.ledger_url_env or (self.mlflow_tracking_uri
                                   and self.mlflow_tracking_uri.startswith(_DATABASES)):
            return self.ledger_url
        path = self.cemlab_home / "mlflow.db"
        return f"sqlite:///{path}" if path.exists() else None

    def existing_tracking_uri(self) -> str | None:
        """``tracking_uri``, or None when that is the embedded store and it does not exist
        yet; creates nothing (for readers such as ``export``)."""
        if self.mlflow_tracking_uri:
            return self.mlflow_tracking_uri
        path = self.cemlab_home / "mlflow.db"
        return f"sqlite:///{path}" if path.exists() else None
