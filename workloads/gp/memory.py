"""How much memory one worker of a GP-regression trial needs: the regressor's states, one
micro-batch's activations, and the data, whose draw from the GP is the one quadratic cost.

The regressor (``workloads.gp.regressor.GPRegressor``) is a small network, not an exact GP: it
keeps no kernel matrix. The data are drawn once per trial, before the model is built
(``workloads.gp.data.sample_gp_regression``): one function sampled jointly at all
N = n_train + n_val + n_test inputs, through the N x N kernel matrix and its Cholesky factor in
float64, on the CPU. At its peak the draw holds 3 N x N float64 matrices for ``rbf`` (the
kernel, its jittered copy, the factor) and 4 for ``nonstationary`` (the Gibbs kernel's length
scales take one more), as the process's peak resident memory measures it where each matrix is
a mapping of its own (glibc maps blocks above 32 MiB, N > 2,048, and unmaps them when freed;
smaller ones come from its heap, which can keep freed blocks and peak up to twice as high);
afterwards the splits are kept as float32, N (d + 1) x 4 bytes.

Training runs on the plain PyTorch engine (DDP under Ray Train with more than one worker), with
fp32 weights in either precision (bf16 runs the forward under autocast): Ψ parameters take 4Ψ
bytes of weights, 4Ψ of gradients (8Ψ under DDP, which reduces them through bucket copies of
its own) and 8Ψ of AdamW's two moments. ZeRO does not apply: every worker holds all of them.

Activations kept for the backward pass, per example, with e bytes per element of the compute
dtype (4 fp32, 2 bf16) and the D-wide stream kept in fp32 under autocast (input_dim d, d_model
D, d_mlp F, T = ``mlp_steps`` per layer):
    input d·4 + per layer (F e + D (4 + e)) (gamma and the fixed input)
              + per step (3 F e + D (8 + e)) (the iterate, its norm, V u, SiLU, the product)
              + with ``layer_reuse`` (T - 1) (F e + D (4 + e)) (gamma again at every step)
              + head 2 D·4;
in bf16, plus 2Ψ for autocast's bf16 copies of the weights. An evaluation pass (a whole split,
no gradients) holds a few (N_split, F) temporaries, not counted.
"""

from __future__ import annotations

from dataclasses import dataclass

from workloads.core.architecture import ModelConfig

KERNEL_MATRICES = {"rbf": 3, "nonstationary": 4}  # N x N float64 matrices at the draw's peak


@dataclass(frozen=True)
class GPMemoryEstimate:
    """Bytes one worker of a GP-regression trial holds: ``parameters``, ``gradients``,
    ``optimizer`` and ``activations`` while it trains (on its device), ``data`` (the splits,
    host memory) and ``draw`` (the peak of drawing them, host memory, before training starts);
    ``on_gpu``: the worker trains on a GPU."""

    parameters: float
    gradients: float
    optimizer: float
    activations: float
    data: float
    draw: float
    on_gpu: bool

    @property
    def training(self) -> float:
        """Bytes on the training device: weights, gradients, optimizer states, activations."""
        return self.parameters + self.gradients + self.optimizer + self.activations

    @property
    def total(self) -> float:
        """The worker's peak in bytes where it trains: on a GPU, ``training`` (the data and
        their draw are host memory); on a CPU, the larger of the draw and ``training`` plus
        the kept data (the draw is over before the model is built)."""
        if self.on_gpu:
            return self.training
        return max(self.draw, self.training + self.data)

    def describe(self) -> str:
        """``1.2 GiB (weights 0.0, gradients 0.0, optimizer 0.0, activations 0.0 GiB; drawing
        the data 1.2 GiB of host memory first)``."""
        gib = 2**30
        return (f"{self.total / gib:.1f} GiB (weights {self.parameters / gib:.1f}, gradients "
                f"{self.gradients / gib:.1f}, optimizer {self.optimizer / gib:.1f}, activations "
                f"{self.activations / gib:.1f} GiB; drawing the data {self.draw / gib:.1f} GiB "
                "of host memory first)")


def activation_bytes(model: ModelConfig, input_dim: int, micro_batch_size: int, precision: str,
                     parameters: int) -> float:
    """Bytes of activations one micro-batch of ``micro_batch_size`` examples keeps for the
    backward pass of a ``GPRegressor`` with ``parameters`` parameters (module docstring).

    Raises:
        KeyError: ``precision`` is neither ``bf16`` nor ``fp32``.
    """
    e = {"bf16": 2, "fp32": 4}[precision]
    d, f, steps = model.d_model, model.d_mlp, model.mlp_steps
    fixed = f * e + d * (4 + e)  # gamma = W h~ and the fixed input h~
    per_layer = fixed + steps * (3 * f * e + d * (8 + e))
    if model.layer_reuse:
        per_layer += (steps - 1) * fixed
    per_example = input_dim * 4 + model.n_layer * per_layer + 2 * d * 4
    return micro_batch_size * per_example + (2 * parameters if precision == "bf16" else 0)


def draw_bytes(n: int, kernels: list[str]) -> float:
    """Peak bytes of drawing ``n`` points jointly from the GP of the costliest of ``kernels``
    (``KERNEL_MATRICES`` N x N float64 matrices; module docstring).

    Raises:
        KeyError: a kernel other than ``rbf`` or ``nonstationary``.
    """
    return max(KERNEL_MATRICES[k] for k in kernels) * 8.0 * n * n


def estimate_memory(model: ModelConfig, parameters: int, input_dim: int, n_points: int,
                    kernels: list[str], micro_batch_size: int, world_size: int, precision: str,
                    on_gpu: bool) -> GPMemoryEstimate:
    """Memory per worker of training a ``GPRegressor`` of ``model`` (``parameters``
    parameters, ``input_dim`` inputs) with AdamW on ``world_size`` DDP workers in
    ``precision`` (``bf16``: autocast over fp32 weights; ``fp32``) at ``micro_batch_size``
    examples per pass, on data of ``n_points`` points drawn from the costliest of ``kernels``.

    Raises:
        KeyError: ``precision`` is neither ``bf16`` nor ``fp32``, or an unknown kernel.
    """
    psi = float(parameters)
    return GPMemoryEstimate(
        parameters=4 * psi, gradients=(8 if world_size > 1 else 4) * psi, optimizer=8 * psi,
        activations=activation_bytes(model, input_dim, micro_batch_size, precision, parameters),
        data=4.0 * n_points * (input_dim + 1), draw=draw_bytes(n_points, kernels),
        on_gpu=on_gpu)
