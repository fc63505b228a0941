"""The code MLflow runs to load a CEM Lab pyfunc model ("models from code": nothing unpickled).

``mlflow.pyfunc.save_model(python_model=<this file>)`` copies it into the model; loading runs it
with the model's ``code/`` directory on ``sys.path``.
"""

import mlflow.models

from workloads.lm.serving import CEMLabLM

mlflow.models.set_model(CEMLabLM())
