"""A trial's trained model as an MLflow 3 logged model of the trial's run.

A logged model (``MlflowClient.create_logged_model``) is an entity of its experiment beside the
runs: the experiment's Models view lists it with its source run, its parameters (the run's) and
the registered versions made from it, and ``models:/<model_id>`` names it. Its files live at its
own artifact location (``<experiment>/models/<model_id>/artifacts``), not among the run's
artifacts; through a tracking server with proxied artifacts they go through the server, so a
worker needs the tracking URI alone. Every trial's model is named ``NAME``.

MLflow is imported inside the functions: workloads import it only where a model is kept.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mlflow import MlflowClient
    from mlflow.entities import LoggedModel

NAME = "model"  # every trial's logged model, as MLflow names a model logged with name="model"


def log_model(client: MlflowClient, run_id: str, write: Callable[[str], None],
              step: int = 0) -> LoggedModel:
    """Log the MLflow model that ``write(path)`` saves as a new directory ``path`` as a logged
    model ``NAME`` of run ``run_id``: in the run's experiment, with the run as its source, the
    run's params as its own, an output of the run at ``step``, its ``MLmodel`` naming it
    (``model_id``, ``run_id``, ``artifact_path``: its artifact location) as
    ``mlflow.<flavor>.log_model`` writes one. It is ``READY`` once every file is uploaded.

    Returns the logged model (``READY``).

    Raises:
        mlflow.exceptions.MlflowException: the tracking server refused a call or stayed
            unreachable through MLflow's retries.
        Exception: whatever ``write`` raises. In both cases the logged model, once created, is
            marked ``FAILED`` where the server can still be told.
    """
    from mlflow.entities import LoggedModelOutput, LoggedModelStatus
    from mlflow.models import Model

    run = client.get_run(run_id)
    model = client.create_logged_model(run.info.experiment_id, name=NAME, source_run_id=run_id,
                                       params=dict(run.data.params))
    try:
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, NAME)
            write(path)
            mlmodel = Model.load(path)
            mlmodel.model_id = mlmodel.model_uuid = model.model_id
            mlmodel.run_id, mlmodel.artifact_path = run_id, model.artifact_location
            mlmodel.save(os.path.join(path, "MLmodel"))
            client.log_model_artifacts(model.model_id, path)
        client.log_outputs(run_id, [LoggedModelOutput(model.model_id, step)])
    except Exception:
        client.finalize_logged_model(model.model_id, LoggedModelStatus.FAILED)
        raise
    return client.finalize_logged_model(model.model_id, LoggedModelStatus.READY)


def model_of_run(client: MlflowClient, run_id: str) -> LoggedModel | None:
    """The newest ``READY`` logged model ``NAME`` whose source run is ``run_id``; None where
    the run has none (a run that kept no model, or one that kept it among its own artifacts)."""
    from mlflow.entities import LoggedModelStatus

    experiment = client.get_run(run_id).info.experiment_id
    found = client.search_logged_models(  # the status is no filter: stores keep it as a number
        [experiment], filter_string=f"source_run_id = '{run_id}' AND name = '{NAME}'",
        order_by=[{"field_name": "creation_timestamp", "ascending": False}])
    return next((m for m in found if m.status == LoggedModelStatus.READY), None)
