"""The synthetic Gaussian-process regression workload (paper App. D, Table 3)."""

from workloads.gp.data import GPData, sample_gp_regression
from workloads.gp.regressor import GPRegressor, gp_flops_per_sample

__all__ = ["GPData", "GPRegressor", "gp_flops_per_sample", "sample_gp_regression"]
