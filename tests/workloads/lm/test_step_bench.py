"""``python -m workloads.lm.step_bench``: step times of every variant, with MFU against this
machine."""

import pytest
import torch

from workloads.lm import step_bench
from workloads.models import ModelConfig
from workloads.runtime import hardware


def test_the_bench_reports_mfu_against_the_measured_peak(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    rows = step_bench.run("nano", 2, 0.05, torch.device("cpu"), "fp32")
    peak = hardware.peak_flops("cpu", "fp32")[0]
    assert [r["variant"] for r in rows] == list(step_bench.VARIANTS)
    assert rows[0]["step_time_vs_llama"] == 1.0
    for row in rows:
        assert row["tokens_per_s"] == pytest.approx(2 * 64 / (row["step_ms"] / 1000))
        assert row["mfu"] == pytest.approx(row["gflops_per_s"] * 1e9 / peak)
        assert 0 < row["mfu"] < 1 and row["peak_memory_mib"] > 100


def test_every_variant_takes_only_the_presets_sizes():
    """``--preset cem-134m`` benches the same variants as ``llama-134m``: its Llama row is
    Llama, and its ``cem-best T=2`` row is the ``cem-134m`` preset itself."""
    for preset in ("llama-134m", "cem-134m"):
        configs = step_bench.variant_configs(preset)
        assert configs["llama"] == ModelConfig.from_preset("llama-134m")
        assert configs["cem-best T=2"] == ModelConfig.from_preset("cem-134m")
        assert configs["cem-attn T=1"].mlp == "llama"
    assert list(step_bench.variant_configs("nano", ["cem T=1", "llama"])) == ["llama", "cem T=1"]
    with pytest.raises(KeyError, match="lama"):
        step_bench.variant_configs("nano", ["lama"])


def test_a_subset_without_llama_has_no_ratio(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    rows = step_bench.run("nano", 2, 0.01, torch.device("cpu"), "fp32", rounds=1,
                     variants=["cem T=1"])
    assert [r["variant"] for r in rows] == ["cem T=1"]
    assert rows[0]["step_time_vs_llama"] is None and rows[0]["tokens_per_s"] > 0


def test_the_profile_names_where_a_step_goes(tmp_path, monkeypatch):
    """``--profile``: the longest operators first, the matrix products among them for Llama at
    ``nano`` (about half its FLOPs are the projections and the MLP), per-step calls that match
    the model (forward and backward each call the 2 layers' attention once), shares of one
    whole."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    (row,) = step_bench.run("nano", 2, 0.01, torch.device("cpu"), "fp32", rounds=1,
                       variants=["llama"], profile_top=8)
    kernels = row["kernels"]
    assert len(kernels) == 8
    times = [k["ms_per_step"] for k in kernels]
    assert times == sorted(times, reverse=True) and times[-1] > 0
    assert "aten::mm" in [k["kernel"] for k in kernels[:3]]
    assert 0 < sum(k["share"] for k in kernels) <= 1 + 1e-9
    assert step_bench.kernel_table(lambda: None, torch.device("cpu"), 5) == []  # nothing ran
    n_layer = step_bench.variant_configs("nano", ["llama"])["llama"].n_layer
    (row,) = step_bench.run("nano", 2, 0.01, torch.device("cpu"), "fp32", rounds=1,
                       variants=["llama"], profile_top=100)
    calls = {k["kernel"]: k["calls_per_step"] for k in row["kernels"]}
    assert calls["aten::_scaled_dot_product_flash_attention_for_cpu"] == n_layer
    assert calls["aten::_scaled_dot_product_flash_attention_for_cpu_backward"] == n_layer


@pytest.mark.slow
def test_a_compiled_model_computes_what_the_eager_one_does_and_only_it_goes_through_dynamo():
    """``--compile`` times the same function: the compiled full CEM layer (T = 2, shared
    diagonal, preconditioners; one layer, half the compile of two) gives eager's logits and
    gradients in fp32, and only with ``compiled`` does the bench's measured model go through
    Dynamo."""
    import copy

    import torch.nn.functional as F
    from torch._dynamo.utils import counters

    from workloads.core.architecture import CEM_BEST
    from workloads.models import ModelConfig, build_model

    cfg = ModelConfig.from_preset("nano", **CEM_BEST, n_layer=1)  # one layer: half the compile
    torch.manual_seed(0)
    eager = build_model(cfg)
    fused = copy.deepcopy(eager)
    fused.compile(dynamic=False)
    idx = torch.randint(0, cfg.vocab_size, (2, cfg.context_length + 1))
    logits = {}
    for name, model in (("eager", eager), ("compiled", fused)):
        logits[name] = model(idx[:, :-1])
        F.cross_entropy(logits[name].flatten(0, 1), idx[:, 1:].flatten()).backward()
    torch.testing.assert_close(logits["compiled"], logits["eager"], rtol=1e-5, atol=1e-5)
    for (name, p), q in zip(eager.named_parameters(), fused.parameters(), strict=True):
        scale = p.grad.abs().max().item()
        assert (q.grad - p.grad).abs().max().item() <= 1e-5 * scale + 1e-8, name

    for compiled, grows in ((False, False), (True, True)):
        graphs = counters["stats"]["unique_graphs"]
        first_s, times, kernels = step_bench.measure(cfg, 2, 0.01, torch.device("cpu"), "fp32",
                                                     compiled=compiled)
        assert len(times) >= 3 and first_s > 0 and kernels == []
        assert (counters["stats"]["unique_graphs"] > graphs) == grows


def test_the_stack_bench_prints_trials_per_hour_per_k_against_k_1(capsys):
    """``--stack 1,2``: a row per K whose trials per hour follow from its step time and the
    trial's steps at its budget, K = 1 the reference; a list without K = 1 is refused."""
    import json
    import math

    from workloads.lm.workload import baseline_model, steps_for
    from workloads.models import parameter_counts

    step_bench.main(["--stack", "1,2", "--presets", "pico", "--variants", "llama",
                     "--seconds", "0.2", "--batch", "4", "--budget-scale", "0.5"])
    rows = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert [(r["preset"], r["variant"], r["K"]) for r in rows] == [("pico", "llama", 1),
                                                                    ("pico", "llama", 2)]
    cfg = ModelConfig.from_preset("pico")
    tokens = round(20 * parameter_counts(baseline_model("pico", cfg.vocab_size))["total"] * 0.5)
    steps = steps_for(tokens, 4, cfg.context_length)
    for r in rows:
        assert r["steps_per_trial"] == steps
        assert math.isclose(r["trials_per_hour"], 3600 / (steps * r["step_ms"] / 1000 / r["K"]))
        assert math.isclose(r["vs_alone"], r["trials_per_hour"] / rows[0]["trials_per_hour"])
    with pytest.raises(SystemExit):
        step_bench.main(["--stack", "2,4", "--presets", "pico"])
