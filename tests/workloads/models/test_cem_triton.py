"""The Triton CEM attention kernels (``workloads.models.kernels.cem_attention``, ``CEMAttention``
``kernel: triton``) against the math kernel (``position.sdpa_math``, ``kernel: math``).

On a CPU the kernels run under Triton's interpreter, which must be on before ``triton`` is
first imported; a pytest process has usually imported it already (``torch.utils.flop_counter``
does), so the cases run in one child Python per module started with ``TRITON_INTERPRET=1``
(``_Interpreter``), or in this process when it interprets already. On a GPU each case runs
here too, on CUDA tensors, with the compiled kernels (and bf16).

What is compared: the forward output; the gradient of every input (q, k, v, the shared scores'
factors cq and ck, b_self, b_cross; for the layer, its input h and every parameter); c's own
gradient (with ck the identity, c = scale cq, so cq's gradient is scale dL/dc); at sequence lengths
1, 16 (one tile), 37 and 100 (not a multiple of the tile), for one and two recursion steps and each
KQ-diagonal mode; in fp32 and fp64 under the interpreter, fp32 and bf16 on a GPU (the kernel's own
cases against the math kernel in fp64 on the same input values, the layer's against the math kernel
in the same dtype). Tolerances, per dtype, bound the largest absolute difference relative to the
reference's largest magnitude (``TOLERANCE``). ``make test-fast`` runs one small shape of the kernel
and of the layer, the kernel's causality and the argument checks; the rest is ``slow``.
"""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

from tests.workloads.models.test_causality import assert_causal  # noqa: E402
from workloads.models import ModelConfig, build_model  # noqa: E402
from workloads.models import cem as cem_module  # noqa: E402
from workloads.models.cem import CEMAttention  # noqa: E402
from workloads.models.kernels import cem_attention as kernels  # noqa: E402
from workloads.models.position import alibi_bias, alibi_slopes, sdpa_math  # noqa: E402

ROOT = Path(__file__).resolve().parents[3]
# max |kernel - reference| <= TOLERANCE * max(1, max |reference|), per dtype: fp64 and fp32
# accumulate alike in both (the differences are summation orders, ~1e-15 and ~1e-6 here);
# bf16 (GPU only) rounds p and dS to bf16 before their products, as FlashAttention does.
TOLERANCE = {"float64": 1e-10, "float32": 2e-5, "bfloat16": 3e-2}
CUDA = torch.cuda.is_available()
NO_GPU = pytest.mark.skipif(not CUDA, reason="no GPU")
DEVICES = ["cpu", pytest.param("cuda", marks=NO_GPU)]
# bf16 runs on a GPU only: a CPU's bf16 matrix products differ between machines; fp64, the
# interpreter's near-exact check, on a CPU only.
CPU_DTYPES, GPU_DTYPES = ("float32", "float64"), ("float32", "bfloat16")


def _device_dtypes(cpu=CPU_DTYPES, gpu=GPU_DTYPES) -> list:
    """(device, dtype) parameters: ``cpu``'s dtypes under the interpreter, ``gpu``'s on CUDA."""
    return ([pytest.param("cpu", d, id=f"cpu-{d}") for d in cpu]
            + [pytest.param("cuda", d, id=f"cuda-{d}", marks=NO_GPU) for d in gpu])
_MARKER = "@@cem-triton "


# -- running a case: here, or in a child Python under Triton's interpreter -------------------

class _Interpreter:
    """A child Python that imports this module with ``TRITON_INTERPRET=1`` and runs its
    ``case_*`` functions on request (one JSON line each way); a failing case's traceback is
    raised here as an AssertionError."""

    def __init__(self) -> None:
        env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1",
               "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
        code = ("import importlib, json, sys, traceback\n"
                "import torch\n"
                "torch.set_num_threads(1)\n"
                f"module = importlib.import_module({__name__!r})\n"
                "for line in sys.stdin:\n"
                "    request = json.loads(line)\n"
                "    try:\n"
                "        getattr(module, request['case'])(**request['kwargs'])\n"
                "        reply = {'ok': True}\n"
                "    except BaseException:\n"
                "        reply = {'ok': False, 'error': traceback.format_exc()}\n"
                f"    print({_MARKER!r} + json.dumps(reply), flush=True)\n")
        self.proc = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True)
        self.lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put(None)

    def run(self, case: str, timeout_s: float = 900, **kwargs) -> None:
        self.proc.stdin.write(json.dumps({"case": case, "kwargs": kwargs}) + "\n")
        self.proc.stdin.flush()
        output = []
        while True:
            try:
                line = self.lines.get(timeout=timeout_s)
            except queue.Empty:
                raise AssertionError(f"{case}: no answer from the interpreter within "
                                     f"{timeout_s:.0f} s") from None
            if line is None:
                raise AssertionError(f"{case}: the interpreter's process ended:\n"
                                     + "".join(output[-50:]))
            if line.startswith(_MARKER):
                reply = json.loads(line[len(_MARKER):])
                if not reply["ok"]:
                    raise AssertionError(f"{case} under Triton's interpreter:\n"
                                         f"{reply['error']}")
                return
            output.append(line)

    def close(self) -> None:
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture(scope="module")
def run_case():
    """``run_case(case_name, device, **kwargs)``: the case in this process (CUDA tensors, or
    a process that interprets Triton already), else in the interpreter's child process."""
    child = None

    def run(case: str, device: str, **kwargs) -> None:
        nonlocal child
        if device == "cuda" or kernels.interpreted():
            globals()[case](device=device, **kwargs)
            return
        if child is None:
            child = _Interpreter()
        child.run(case, device=device, **kwargs)

    yield run
    if child is not None:
        child.close()


# -- the cases (plain functions: they run in the child too) ------------------------------------

def _close(name: str, got: torch.Tensor, want: torch.Tensor, dtype: str) -> None:
    got, want = got.double(), want.double()
    assert got.shape == want.shape, (name, got.shape, want.shape)
    assert torch.isfinite(got).all(), f"{name}: not finite"
    err = (got - want).abs().max().item() if got.numel() else 0.0
    bound = TOLERANCE[dtype] * max(1.0, want.abs().max().item() if want.numel() else 0.0)
    assert err <= bound, f"{name}: max |kernel - math| {err:.3g} > {bound:.3g} ({dtype})"


def _inputs(device: str, dtype: str, seq_len: int, shared: bool, seed: int = 0,
            n_head: int = 3, e: int = 8, dc: int = 12) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    b, dt = 2, getattr(torch, dtype)

    def leaf(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float64).to(device, dt)

    x = {"q": leaf(b, n_head, seq_len, e), "k": leaf(b, n_head, seq_len, e),
         "v": leaf(b, n_head, seq_len, e + 4), "self_bias": leaf(1), "cross_bias": leaf(1)}
    if shared:
        x["cq"], x["ck"] = leaf(b, seq_len, dc), leaf(b, seq_len, dc)
    return {name: t.requires_grad_() for name, t in x.items()}


def _math(x: dict[str, torch.Tensor], slopes: torch.Tensor, scale: float,
          c: torch.Tensor | None = None) -> torch.Tensor:
    """The math kernel on the same scores: ALiBi + self/cross bias (+ c) as SDPA's float mask."""
    dtype = x["q"].dtype
    bias = alibi_bias(slopes.to(dtype), x["q"].shape[-2], x["self_bias"], x["cross_bias"])
    if c is None and "cq" in x:
        c = scale * x["cq"] @ x["ck"].transpose(-1, -2)
    if c is not None:
        bias = bias + c[:, None]
    return sdpa_math(x["q"], x["k"], x["v"], bias, scale)


def _triton(x: dict[str, torch.Tensor], slopes: torch.Tensor, scale: float,
            block: int) -> torch.Tensor:
    return kernels.cem_attention(x["q"], x["k"], x["v"], slopes, x["self_bias"],
                                 x["cross_bias"], scale, x.get("cq"), x.get("ck"), block=block)


def case_kernel_matches_math(device: str, dtype: str, seq_len: int, shared: bool,
                             block: int = 16) -> None:
    """The output and the gradients of q, k, v, cq, ck, b_self and b_cross, against the math
    kernel in fp64 on the same input values: in bf16 the math kernel's own rounding of the
    biases' gradients (a sum over every score) exceeds the kernel's, which sums in fp32."""
    x = _inputs(device, dtype, seq_len, shared)
    x64 = {n: t.detach().double().requires_grad_() for n, t in x.items()}
    slopes, scale = alibi_slopes(x["q"].shape[1]).to(device), x["q"].shape[-1] ** -0.5
    out, ref = _triton(x, slopes, scale, block), _math(x64, slopes, scale)
    _close("o", out, ref, dtype)
    weight = torch.randn(ref.shape, generator=torch.Generator().manual_seed(1),
                         dtype=torch.float64).to(ref)
    names = list(x)
    grads = torch.autograd.grad((out * weight.to(out)).sum(), [x[n] for n in names])
    ref_grads = torch.autograd.grad((ref * weight).sum(), [x64[n] for n in names])
    for name, got, want in zip(names, grads, ref_grads):
        _close(f"d{name}", got, want, dtype)


def case_c_gradient_matches_math(device: str, dtype: str, seq_len: int,
                                 block: int = 16) -> None:
    """dL/dc_ij = sum_k dS_ijk, read through ck = the identity: c = scale cq, dcq = scale dc."""
    x = _inputs(device, dtype, seq_len, shared=True, dc=seq_len)
    with torch.no_grad():
        x["ck"].copy_(torch.eye(seq_len).expand_as(x["ck"]))
    slopes, scale = alibi_slopes(x["q"].shape[1]).to(device), x["q"].shape[-1] ** -0.5
    c = (scale * x["cq"]).detach().requires_grad_()
    out, ref = _triton(x, slopes, scale, block), _math(x, slopes, scale, c)
    _close("o", out, ref, dtype)
    weight = torch.randn(ref.shape, generator=torch.Generator().manual_seed(2),
                         dtype=torch.float64).to(ref)
    (dcq,) = torch.autograd.grad((out * weight).sum(), [x["cq"]])
    (dc,) = torch.autograd.grad((ref * weight).sum(), [c])
    _close("dc", dcq / scale, dc, dtype)
    assert not dcq.triu(1).any(), "c's gradient above the diagonal"


def case_kernel_is_causal(device: str, dtype: str, seq_len: int = 37, block: int = 16) -> None:
    """Changing q, k, v, cq and ck at positions >= p leaves o before p bit-identical (and
    changes o at p), for p at a tile's start, inside a tile and at the last position; the
    gradients of o before p with respect to the inputs from p on are exactly zero."""
    x = _inputs(device, dtype, seq_len, shared=True)
    slopes, scale = alibi_slopes(x["q"].shape[1]).to(device), x["q"].shape[-1] ** -0.5
    out = _triton(x, slopes, scale, block)
    for p in (block, block + 5, seq_len - 1):
        changed = _inputs(device, dtype, seq_len, shared=True, seed=3)
        for name, t in changed.items():
            if t.dim() > 1:  # positions are dim -2
                with torch.no_grad():
                    t[..., :p, :] = x[name][..., :p, :]
            else:
                with torch.no_grad():
                    t.copy_(x[name])
        moved = _triton(changed, slopes, scale, block)
        assert torch.equal(moved[..., :p, :], out[..., :p, :]), f"o before {p} moved"
        assert not torch.equal(moved[..., p, :], out[..., p, :]), f"o at {p} did not move"
    p = block + 5
    names = ["q", "k", "v", "cq", "ck"]
    grads = torch.autograd.grad(out[..., :p, :].sum(), [x[n] for n in names])
    for name, g in zip(names, grads):
        assert not g[..., p:, :].any(), f"d(o before {p}) / d{name} after it is not zero"
        assert g[..., :p, :].any(), f"no gradient reaches {name} before {p}"


def _layer_config(attn_steps: int, kq_diag: str, energy_exact: bool) -> ModelConfig:
    return ModelConfig(vocab_size=512, d_model=32, n_layer=1, n_head=2, d_mlp=96,
                       context_length=128, attention="cem", attn_steps=attn_steps,
                       kq_diag=kq_diag, energy_exact=energy_exact,
                       attn_preconditioner="diag_lowrank", learn_step_size=True)


def case_layer_matches_math(device: str, dtype: str, attn_steps: int, kq_diag: str,
                            energy_exact: bool = False, seq_len: int = 100) -> None:
    """CEMAttention with ``kernel: triton`` against ``kernel: math``: x^(T) and the gradients
    of h and of every parameter, every parameter moved off its initialisation."""
    dt = getattr(torch, dtype)
    torch.manual_seed(0)
    layers = {}
    for kernel in ("math", "triton"):
        torch.manual_seed(0)
        layer = CEMAttention(_layer_config(attn_steps, kq_diag, energy_exact))
        with torch.no_grad():
            for p in layer.parameters():
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())),
                       alpha=0.1)
        layer.kernel = kernel
        layers[kernel] = layer.to(device, dt)
    gen = torch.Generator().manual_seed(4)
    h = torch.randn(2, seq_len, 32, generator=gen, dtype=torch.float64).to(device, dt)
    weight = torch.randn(h.shape, generator=gen, dtype=torch.float64).to(device, dt)
    results = {}
    for kernel, layer in layers.items():
        h_leaf = h.clone().requires_grad_()
        x = layer(h_leaf)
        names = [n for n, _ in layer.named_parameters()]
        grads = torch.autograd.grad((x * weight).sum(), [h_leaf, *layer.parameters()])
        results[kernel] = (x, dict(zip(["h", *names], grads)))
    (x_t, g_t), (x_m, g_m) = results["triton"], results["math"]
    _close("x^(T)", x_t, x_m, dtype)
    assert g_t.keys() == g_m.keys()
    for name in g_m:
        _close(f"d{name}", g_t[name], g_m[name], dtype)


def case_model_is_causal(device: str, dtype: str, name: str) -> None:
    """``test_causality.assert_causal`` (logits and their gradient) on a two-layer model whose
    CEM attention runs the Triton kernel."""
    overrides = {"cem-best": {"attention": "cem", "mlp": "cem", "attn_steps": 2,
                              "kq_diag": "shared", "attn_preconditioner": "diag_lowrank"},
                 "per-head-exact": {"attention": "cem", "kq_diag": "per_head",
                                    "energy_exact": True}}[name]
    cfg = ModelConfig.from_preset("nano", context_length=40, **overrides)
    torch.manual_seed(0)
    model = build_model(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p), alpha=0.1)
    for module in model.modules():
        if isinstance(module, CEMAttention):
            module.kernel = "triton"
    assert_causal(model.to(device, getattr(torch, dtype)), grad=True, seq_len=40)


def case_custom_ops_pass_opcheck(device: str, dtype: str) -> None:
    """``torch.library.opcheck``: the ops' schemas, fake (meta) kernels, and autograd
    registration, as ``torch.compile`` relies on them."""
    x = _inputs(device, dtype, 20, shared=True)
    acc = torch.float64 if dtype == "float64" else torch.float32
    slopes = alibi_slopes(3).to(device, acc)
    own = (x["self_bias"] - x["cross_bias"]).detach().to(acc).requires_grad_()
    c = (x["cq"] @ x["ck"].transpose(-1, -2)).detach().requires_grad_()
    args = (x["q"], x["k"], x["v"], c, slopes, own, 8 ** -0.5, 16)
    torch.library.opcheck(kernels._forward_op, args,
                          test_utils=("test_schema", "test_autograd_registration",
                                      "test_faketensor"))


def case_autocast_layer_matches_math(device: str, dtype: str) -> None:
    """x^(T) and dh of a CEM-best attention layer (fp32 weights) under autocast to ``dtype``,
    ``kernel: triton`` against ``kernel: math``."""
    out = {}
    for kernel in ("math", "triton"):
        torch.manual_seed(0)
        layer = CEMAttention(_layer_config(2, "shared", False))
        with torch.no_grad():
            for p in layer.parameters():
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())),
                       alpha=0.1)
        layer.kernel = kernel
        layer = layer.to(device)
        h = torch.randn(2, 100, 32, generator=torch.Generator().manual_seed(5)).to(device)
        h.requires_grad_()
        with torch.autocast(device, dtype=getattr(torch, dtype)):
            x = layer(h)
        out[kernel] = (x, torch.autograd.grad(x.float().square().sum(), h)[0])
    _close("x^(T)", out["triton"][0], out["math"][0], dtype)
    _close("dh", out["triton"][1], out["math"][1], dtype)


def case_compiled_layer_matches_eager(device: str, dtype: str) -> None:
    """A compiled (``torch.compile``) CEM-best layer with the Triton kernel: the same x^(T)
    and input gradient as eager."""
    torch.manual_seed(0)
    layer = CEMAttention(_layer_config(2, "shared", False))
    with torch.no_grad():
        for p in layer.parameters():
            p.add_(torch.randn_like(p), alpha=0.1)
    layer.kernel = "triton"
    layer = layer.to(device, getattr(torch, dtype))
    h = torch.randn(2, 100, 32, device=device, dtype=getattr(torch, dtype))
    out = {}
    for name, fn in (("eager", layer), ("compiled", torch.compile(layer, dynamic=False))):
        h_leaf = h.clone().requires_grad_()
        x = fn(h_leaf)
        out[name] = (x, torch.autograd.grad(x.square().sum(), h_leaf)[0])
    _close("x^(T)", out["compiled"][0], out["eager"][0], dtype)
    _close("dh", out["compiled"][1], out["eager"][1], dtype)


# -- the tests ---------------------------------------------------------------------------------

@pytest.mark.parametrize("device", DEVICES)
def test_kernel_matches_math_fast(run_case, device):
    """One small shape for ``make test-fast``: shared scores, 37 positions in 16-wide tiles."""
    run_case("case_kernel_matches_math", device, dtype="float32", seq_len=37, shared=True)


@pytest.mark.slow
@pytest.mark.parametrize("shared", [False, True], ids=["no-c", "shared-c"])
@pytest.mark.parametrize("seq_len", [1, 16, 37])
@pytest.mark.parametrize(("device", "dtype"), _device_dtypes())
def test_kernel_matches_math(run_case, device, dtype, seq_len, shared):
    run_case("case_kernel_matches_math", device, dtype=dtype, seq_len=seq_len, shared=shared)


@pytest.mark.slow
@pytest.mark.parametrize("seq_len", [16, 37])
@pytest.mark.parametrize(("device", "dtype"), _device_dtypes(("float64",), ("float32", "bfloat16")))
def test_c_gradient_matches_math(run_case, device, dtype, seq_len):
    run_case("case_c_gradient_matches_math", device, dtype=dtype, seq_len=seq_len)


@pytest.mark.parametrize("device", DEVICES)
def test_kernel_is_causal(run_case, device):
    run_case("case_kernel_is_causal", device, dtype="float32")


@pytest.mark.parametrize("device", DEVICES)
def test_layer_matches_math_fast(run_case, device):
    """One layer case for ``make test-fast``: CEM-best's attention (T = 2, shared diagonal,
    per-head preconditioner), 100 positions (the 64-wide tile's second one partial)."""
    run_case("case_layer_matches_math", device, dtype="float32", attn_steps=2,
             kq_diag="shared")


@pytest.mark.slow
@pytest.mark.parametrize(("kq_diag", "energy_exact"),
                         [("none", False), ("shared", False), ("per_head", False),
                          ("shared", True), ("per_head", True)],
                         ids=["no-diag", "shared", "per-head", "shared-exact", "per-head-exact"])
@pytest.mark.parametrize("attn_steps", [1, 2], ids=["T1", "T2"])
@pytest.mark.parametrize(("device", "dtype"), _device_dtypes(("float64",), ("float32", "bfloat16")))
def test_layer_matches_math(run_case, device, dtype, attn_steps, kq_diag, energy_exact):
    run_case("case_layer_matches_math", device, dtype=dtype, attn_steps=attn_steps,
             kq_diag=kq_diag, energy_exact=energy_exact)


@pytest.mark.slow
@pytest.mark.parametrize("seq_len", [16, 64])
@pytest.mark.parametrize(("device", "dtype"), _device_dtypes(("float64",), ("float32",)))
def test_layer_matches_math_at_whole_tiles(run_case, device, dtype, seq_len):
    run_case("case_layer_matches_math", device, dtype=dtype, attn_steps=2, kq_diag="shared",
             seq_len=seq_len)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["cem-best", "per-head-exact"])
@pytest.mark.parametrize("device", DEVICES)
def test_model_is_causal(run_case, device, name):
    run_case("case_model_is_causal", device, dtype="float32", name=name)


@pytest.mark.slow
@pytest.mark.parametrize(("device", "dtype"), _device_dtypes(("float64",), ("float32",)))
def test_custom_ops_pass_opcheck(run_case, device, dtype):
    run_case("case_custom_ops_pass_opcheck", device, dtype=dtype)


@pytest.mark.parametrize(("device", "dtype"), _device_dtypes((), ("float32", "bfloat16")))
def test_compiled_layer_matches_eager(run_case, device, dtype):
    """On a GPU only: a CPU compile of the interpreted op would time the C++ compiler alone."""
    run_case("case_compiled_layer_matches_eager", device, dtype=dtype)


@pytest.mark.parametrize(("device", "dtype"), _device_dtypes((), ("bfloat16",)))
def test_autocast_layer_matches_math(run_case, device, dtype):
    """An fp32 layer under bf16 autocast (the plain engine's mixed precision): the kernel takes
    autocast's dtype for q, k, v and the shared scores' factors."""
    run_case("case_autocast_layer_matches_math", device, dtype=dtype)


def test_cpu_tensors_need_the_interpreter(monkeypatch):
    """Without Triton's interpreter a CPU call is refused, naming the fix."""
    x = _inputs("cpu", "float32", 8, shared=False)
    slopes = alibi_slopes(3)
    if kernels.interpreted():
        assert _triton(x, slopes, 0.5, 16).shape == x["v"].shape
    else:
        with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
            _triton(x, slopes, 0.5, 16)


def test_bad_arguments_are_refused():
    x = _inputs("cpu", "float32", 8, shared=True)
    slopes = alibi_slopes(3)
    args = (x["q"], x["k"], x["v"], slopes, x["self_bias"], x["cross_bias"], 0.5)
    with pytest.raises(ValueError, match="both cq and ck"):
        kernels.cem_attention(*args, cq=x["cq"])
    with pytest.raises(ValueError, match="power of two"):
        kernels.cem_attention(*args, block=24)
    with pytest.raises(ValueError, match="share one dtype"):
        kernels.cem_attention(x["q"], x["k"], x["v"].double(), *args[3:])
    with pytest.raises(ValueError, match="do not match"):
        kernels.cem_attention(x["q"], x["k"][:, :2], x["v"], *args[3:])


def test_the_default_kernel_comes_from_the_environment(monkeypatch):
    monkeypatch.delenv("CEMLAB_CEM_KERNEL", raising=False)
    assert cem_module._kernel_from_env() == "auto"
    for kernel in cem_module.KERNELS:
        monkeypatch.setenv("CEMLAB_CEM_KERNEL", kernel)
        assert cem_module._kernel_from_env() == kernel
    monkeypatch.setenv("CEMLAB_CEM_KERNEL", "cuda")
    with pytest.raises(ValueError, match="^CEMLAB_CEM_KERNEL: expected one of"):
        cem_module._kernel_from_env()


def test_the_newton_step_keeps_the_explicit_path():
    """``kernel: triton`` leaves the Newton step, which needs the probabilities, on the
    explicit path: the layer runs on a CPU without the interpreter."""
    cfg = ModelConfig(vocab_size=512, d_model=32, n_layer=1, n_head=2, d_mlp=96,
                      attention="cem", kq_diag="shared", energy_exact=True, update="newton")
    torch.manual_seed(0)
    layer, reference = CEMAttention(cfg), CEMAttention(cfg)
    reference.load_state_dict(layer.state_dict())
    layer.kernel, reference.kernel = "triton", "explicit"
    h = torch.randn(2, 12, 32)
    assert not layer.uses_triton()
    assert torch.equal(layer(h), reference(h))
