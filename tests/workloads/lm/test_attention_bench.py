"""``python -m workloads.lm.attention_bench``: one CEM attention kernel call, by how it reads the
shared diagonal's scores."""

import pytest
import torch
import torch.nn.attention.flex_attention as flex_attention_module
from torch.nn.attention.flex_attention import flex_attention

from workloads.lm import attention_bench
from workloads.models import ModelConfig


def test_every_way_of_reading_the_shared_scores_computes_the_same_attention(monkeypatch):
    """The rows differ only in how the kernel reads c_ij (grid order, dtype, gradient), so on
    a CPU, with FlexAttention's eager implementation (the device-independent one), their
    outputs and gradients are equal; without c, and with the own key merged in, they are not.
    Batch 3 against 2 heads: an index of the batch taken for the head's would show."""
    monkeypatch.setattr(flex_attention_module, "_validate_device", lambda *_: None)
    cfg = ModelConfig(d_model=8, n_head=2, d_mlp=12, context_length=16)
    x = attention_bench.inputs(cfg, 3, torch.device("cpu"), torch.float32)
    leaves = [x["q"], x["k"]]
    results = {}
    for name, call in attention_bench.cases(x, flex_attention).items():
        if name.startswith("Triton kernel"):  # CPU tensors need Triton's interpreter: the
            continue  # kernel's equality to the math kernel is test_cem_triton's
        out = call()
        results[name] = [out, *(torch.autograd.grad(out.square().sum(), leaves, allow_unused=True)
                                if out.dim() == 4 else ())]
    assert results.pop("c product (u D) h~ᵀ")[0].shape == (3, 16, 16)
    reference = results["c bf16, head-major grid"]
    assert reference[0].shape == (3, 2, 16, 4)
    for name in ("c bf16, batch-major grid", "c fp32, batch-major grid",
                 "c bf16, head-major, no gradient"):
        for a, b in zip(results[name], reference, strict=True):
            torch.testing.assert_close(a, b)
    for name in ("no shared scores", "alibi_flex_attention"):
        assert not torch.allclose(results[name][0], reference[0])


def test_without_a_gpu_the_bench_says_so_in_one_line(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        attention_bench.main([])


def test_every_swept_kernel_option_computes_the_same_attention(monkeypatch):
    """Every swept row is the head-major kernel with c under its options: on a CPU, where eager
    FlexAttention takes the options and ignores them, each equals the head-major row with c,
    output and gradients (the GPU test holds the tuned compiled kernel to the explicit path)."""
    monkeypatch.setattr(flex_attention_module, "_validate_device", lambda *_: None)
    cfg = ModelConfig(d_model=8, n_head=2, d_mlp=12, context_length=16)
    x = attention_bench.inputs(cfg, 3, torch.device("cpu"), torch.float32)
    options = {n: o for group in attention_bench.SWEEP.values() for n, o in group.items()}
    swept = attention_bench.cases(x, flex_attention, options)
    assert swept.keys() == options.keys()
    reference = attention_bench.cases(x, flex_attention)["c bf16, head-major grid"]()
    expected = torch.autograd.grad(reference.square().sum(), [x["q"], x["a"]])
    for call in swept.values():
        out = call()
        torch.testing.assert_close(out, reference)
        for a, b in zip(torch.autograd.grad(out.square().sum(), [x["q"], x["a"]]), expected,
                        strict=True):
            torch.testing.assert_close(a, b)


def test_the_merged_options_take_each_groups_fastest_that_beats_the_default():
    fwd, bwd = attention_bench.SWEEP["forward"], attention_bench.SWEEP["backward"]
    (f1, f2, f3), (b1, _, b3) = fwd, bwd
    timed = {"default options": 2.0, "blocks contiguous": 2.5, f1: 1.9, f2: 1.7, f3: 2.1,
             b1: 2.2, b3: 1.5}  # b2 failed to build: no time
    assert attention_bench.merged_options(timed) == {**fwd[f2], **bwd[b3]}
    assert attention_bench.merged_options({"default options": 1.0, f1: 1.1}) == {}
    rows = [{"forward_backward_ms": 1.0}, {"forward_backward_ms": 3.0, "kernel_options": {}},
            {"forward_backward_ms": 2.0, "kernel_options": fwd[f1]}]
    assert attention_bench.best_options(rows) == fwd[f1]
    assert attention_bench.best_options(rows[:1]) == {}
