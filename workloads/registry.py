"""The built-in workloads. A new workload is one module with a ``Workload`` subclass and one
``register`` line here."""

from workloads.base import register
from workloads.gp.workload import GPRegression
from workloads.language_model import LanguageModel

register(LanguageModel)
register(GPRegression)
