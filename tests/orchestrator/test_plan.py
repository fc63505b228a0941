"""Grids, Chinchilla budgets, batch geometry, wall estimates, and every paper spec's plan."""

import dataclasses
from pathlib import Path

import pytest
import yaml

from orchestrator.cli import main
from orchestrator.planning.calibrate import TRIAL_OVERHEAD_S, estimate_wall_s
from orchestrator.planning.plan import (
    SUMMARY_ABOVE,
    batch_geometry,
    cells,
    format_plan,
    format_summary,
    plan,
    trial_id,
)
from orchestrator.planning.spec import PAPER_LEARNING_RATES, load_spec, parse_spec
from workloads.core.provenance import code_fingerprint
from workloads.lm.workload import token_budget

ROOT = Path(__file__).resolve().parents[2]
PAPER = sorted((ROOT / "experiments" / "paper").glob("*.yaml"))
PAPER_SCALE = [p for p in PAPER if not p.stem.endswith("-cpu")]

GRID = {"name": "grid", "data": {"vocab_size": 512}, "sizes": ["nano", "micro"],
        "variants": {"llama": {}, "cem": {"attention": "cem", "mlp": "cem", "attn_steps": 2}},
        "seeds": [0, 1], "budget": {"budget_scale": 0.01}, "training": {"batch_size": 16},
        "resources": {"num_workers": 2}}


def llama_params(v: int, d: int, n_layer: int, f: int) -> int:
    """Untied embedding and head, per layer q/k/v/o + SwiGLU + two RMSNorm gains, final norm."""
    return 2 * v * d + n_layer * (4 * d * d + 3 * d * f + 2 * d) + d


def test_grid_is_sizes_x_variants_x_lrs_x_seeds_under_a_chinchilla_budget():
    spec = parse_spec(GRID)
    trials = plan(spec)
    assert spec.learning_rates == PAPER_LEARNING_RATES  # the paper's grid by default
    assert len(trials) == 2 * 2 * 5 * 2
    assert len({t.trial_id for t in trials}) == len(trials)
    for size, (d, n_layer, f, ctx) in {"nano": (32, 2, 96, 64),
                                       "micro": (128, 4, 384, 256)}.items():
        budget = 20 * llama_params(512, d, n_layer, f) * 0.01
        assert token_budget(spec.budget, size, 512) == round(budget)
        same_size = [t for t in trials if t.size == size]
        # The CEM twin trains on the Llama baseline's tokens, rounded up to whole steps.
        assert {t.tokens for t in same_size} == {-(-round(budget) // (16 * ctx)) * 16 * ctx}
        llama = next(t for t in same_size if t.variant == "llama")
        assert llama.params["total"] == llama_params(512, d, n_layer, f)
        cem = next(t for t in same_size if t.variant == "cem")
        assert cem.params["total"] < llama.params["total"]
        assert cem.budget.flops > llama.budget.flops  # T = 2 attention costs more per token


def test_a_bracket_that_adapts_plans_its_grid_and_says_how_far_it_may_extend():
    """``learning_rates: {grid, max_points}`` plans the grid alone (an extension is decided on
    validation, during the run); ``plan`` says how far: (max_points - grid) x arms x seeds."""
    spec = parse_spec({**GRID, "learning_rates": {"grid": [0.004, 0.001, 0.002],
                                                  "max_points": 5}})
    fixed = parse_spec({**GRID, "learning_rates": [0.001, 0.002, 0.004]})
    assert spec.lr_grid == [0.001, 0.002, 0.004] and spec.lr_max_points == 5
    assert fixed.lr_max_points is None
    assert [t.trial_id for t in plan(spec)] == [t.trial_id for t in plan(fixed)]
    head = format_plan(spec, plan(spec)).splitlines()[1]
    arms = 2 * 2  # sizes x variants
    assert head == ("learning rates adapt: an arm whose validation optimum sits at an edge of "
                    "0.001..0.004 gets the next point beyond it (a factor 2 below, 2 above), "
                    f"round after round, up to 5 per arm: at most {2 * arms * 2} more trial(s)")
    assert "adapt" not in format_plan(fixed, plan(fixed))


def test_more_deepspeed_config_is_part_of_a_trial_s_identity():
    """``engine.deepspeed`` can change the numbers (the accumulation dtype, the overflow
    check): set, it gives new trial ids; empty, the ids are those of a spec without it."""
    plain = [t.trial_id for t in plan(parse_spec(GRID))]
    empty = parse_spec({**GRID, "engine": {"deepspeed": {}}})
    tuned = parse_spec({**GRID, "engine": {"deepspeed": {"data_types": {
        "grad_accum_dtype": "fp32"}}}})
    assert [t.trial_id for t in plan(empty)] == plain
    assert not set(t.trial_id for t in plan(tuned)) & set(plain)


def test_a_budget_scale_per_size_scales_each_size_s_chinchilla_budget():
    spec = parse_spec({**GRID, "budget": {"budget_scale": {"nano": 1.0, "micro": 0.25}},
                       "training": {"batch_size": 16}})
    for size, (d, n_layer, f), scale in [("nano", (32, 2, 96), 1.0),
                                         ("micro", (128, 4, 384), 0.25)]:
        assert token_budget(spec.budget, size, 512) == round(
            20 * llama_params(512, d, n_layer, f) * scale)


def test_an_edited_corpus_or_changed_code_never_reuses_a_trial_id(tmp_path):
    from tests.conftest import write_corpus
    from workloads.lm.data import CorpusConfig, prepare_corpus

    pattern = write_corpus(tmp_path / "c", n_docs=6, words_per_doc=300)
    spec = parse_spec({**GRID, "data": {"source": "text_files", "paths": pattern,
                                        "vocab_size": 300}})
    cfg = CorpusConfig(source="text_files", paths=pattern, vocab_size=300)
    before = [t.trial_id for t in plan(spec, prepare_corpus(cfg, tmp_path / "cache"))]
    assert before == [t.trial_id for t in plan(spec, prepare_corpus(cfg, tmp_path / "cache"))]
    with open(tmp_path / "c" / "doc03.txt", "a") as f:
        f.write("one more line.\n")  # same glob, same config: new content
    after = [t.trial_id for t in plan(spec, prepare_corpus(cfg, tmp_path / "cache"))]
    assert not set(before) & set(after)
    t = plan(spec)[0]
    args = (spec, t.model, t.dataset, t.lr, t.seed, t.tokens)
    assert trial_id(*args) == trial_id(*args, code=code_fingerprint()) != trial_id(*args,
                                                                                    code="x")


@pytest.mark.parametrize(("batch", "micro", "workers", "expected"), [
    (128, 8, 8, (8, 2)), (128, 8, 4, (8, 4)), (16, 8, 1, (8, 2)), (12, 8, 1, (6, 2)),
    (16, 32, 2, (8, 1)), (14, 4, 2, (1, 7))])
def test_micro_batch_and_accumulation_come_from_the_global_batch(batch, micro, workers,
                                                                   expected):
    spec = parse_spec({**GRID, "training": {"batch_size": batch, "micro_batch_size": micro},
                       "resources": {"num_workers": workers}})
    m, accum = batch_geometry(spec.training, spec.resources)
    assert (m, accum) == expected and m * accum * workers == batch
    assert (plan(spec)[0].micro_batch_size, plan(spec)[0].grad_accum) == expected


def test_trials_at_once_are_limited_by_cpus_gpus_and_host_memory():
    from workloads.core.config import TRIAL_ACTORS_GB, ResourcesConfig

    r = ResourcesConfig(num_workers=2, cpus_per_worker=1, memory_per_worker_gb=1.5)
    assert r.memory_gb == pytest.approx(2 * 1.5 + TRIAL_ACTORS_GB)
    assert r.trials_that_fit(cpus=16) == 8  # memory not counted
    assert r.trials_that_fit(cpus=16, memory_gb=3 * r.memory_gb + 0.1) == 3
    assert r.trials_that_fit(cpus=16, memory_gb=0.5) == 1  # one always runs (and waits)
    gpu = ResourcesConfig(num_workers=2, use_gpu=True)
    assert gpu.trials_that_fit(cpus=64, gpus=8, memory_gb=1000) == 4


def test_calibrated_wall_estimate_and_plan_table():
    spec = parse_spec({**GRID, "sizes": ["nano"], "learning_rates": [0.002], "seeds": [0]})
    trials = plan(spec)
    wall = estimate_wall_s(trials, spec.workload_impl)
    assert set(wall) == {t.trial_id for t in trials}
    # the per-trial overhead plus a measured compute time
    assert all(TRIAL_OVERHEAD_S < w < 3600 for w in wall.values())
    text = format_plan(spec, trials, wall, spec.resources.trials_that_fit(cpus=4))
    assert "est. wall" in text and "2 trial(s) at once" in text
    assert "8 per micro-batch x 1 accumulation x 2 worker(s)" in text
    # The total runs trials in order on the free slots: 100 s and 300 s on one slot, or two.
    fixed = dict(zip([t.trial_id for t in trials], [100.0, 300.0]))
    assert "est. wall 7m (1 trial(s) at once)" in format_plan(spec, trials, fixed, 1)
    assert "est. wall 5m (2 trial(s) at once)" in format_plan(spec, trials, fixed, 2)


def test_the_plan_shows_the_stacks_its_trials_train_in_and_their_share_of_its_wall():
    one_worker = {**GRID, "sizes": ["nano"], "variants": {"llama": {}},
                  "learning_rates": [0.002, 0.004], "seeds": [0, 1, 2],
                  "resources": {"num_workers": 1}}
    spec = parse_spec(one_worker)
    trials = plan(spec)
    text = format_plan(spec, trials, slots=1)
    assert "stacks: 6 of 6 trial(s) to train in 1 stack(s) of 6" in text
    assert text.splitlines()[1].split()[-1] == "stack"  # the table's last column
    assert "stack(s) of 3" in format_plan(spec, trials, slots=2)  # split: no slot idles
    cached = {t.trial_id for t in trials[:2]}
    assert "stacks: 4 of 4 trial(s)" in format_plan(spec, trials, slots=1, cached=cached)
    wall = estimate_wall_s(trials, spec.workload_impl, slots=1)
    assert len(set(wall.values())) == 1  # one stack: each trial an equal share of its wall
    alone = parse_spec({**one_worker, "resources": {"num_workers": 1, "stack": 1}})
    assert "stacks:" not in format_plan(alone, plan(alone), slots=1)


def test_a_grid_of_more_than_a_thousand_trials_plans_as_a_summary(tmp_path, capsys):
    lrs = [round(0.001 + 0.0001 * i, 6) for i in range(26)]
    grid = {**GRID, "learning_rates": lrs, "seeds": list(range(10))}  # 2 x 2 x 26 x 10 trials
    path = tmp_path / "big.yaml"
    path.write_text(yaml.safe_dump(grid))
    assert main(["plan", "--no-calibrate", str(path)]) == 0
    out = capsys.readouterr().out
    spec = load_spec(path)
    trials = plan(spec)  # the whole grid, planned the slow way
    assert len(trials) == 1040 > SUMMARY_ABOVE
    assert len(out.splitlines()) < 15  # not a row per trial
    assert f"{len(trials):,} trial(s)" in out
    assert trials[0].trial_id in out and trials[-1].trial_id in out
    assert f"{len(trials) - 1:,}" in out  # the last trial's row number
    for variant in ("llama", "cem"):
        for size in ("nano", "micro"):
            cell = [t for t in trials if (t.variant, t.size) == (variant, size)]
            row = next(line.split() for line in out.splitlines()
                       if line.split()[:2] == [variant, size])
            assert row[2] == f"{len(cell):,}" and row[5] == "10"  # trials, seeds
            assert row[6] == f"{cell[0].params['total']:,}"
    assert (f"total: {sum(t.tokens for t in trials):,} tokens, "
            f"{sum(t.steps for t in trials):,} steps, "
            f"{sum(t.budget.flops for t in trials):.3g} FLOPs") in out
    # Each cell's trials take its first trial's wall time; the total schedules them all.
    firsts = {(t.variant, t.size): t.trial_id for t in reversed(trials)}
    wall_of = {cell: 10.0 * (i + 1) for i, cell in enumerate(sorted(firsts))}
    every = {t.trial_id: wall_of[t.variant, t.size] for t in trials}
    summary = format_summary(spec, cells(spec), {firsts[c]: w for c, w in wall_of.items()}, 3)
    assert summary.splitlines()[-1] == format_plan(spec, trials, every, 3).splitlines()[-1]


@pytest.mark.parametrize("path", PAPER, ids=lambda p: p.stem)
def test_every_paper_spec_plans(path, capsys):
    assert main(["plan", "--no-calibrate", str(path)]) == 0
    out = capsys.readouterr().out
    spec = load_spec(path)
    trials = plan(spec)
    for t in trials:
        assert t.trial_id in out
    if spec.workload == "gp_regression":
        assert {t.dataset for t in trials} == {"gp-rbf", "gp-nonstationary"}
        assert {t.model.mlp_steps for t in trials} == {1, 2, 4, 8}
        assert spec.workload_config.input_dim == 10
        # A GP worker takes its share of the batch whole: no micro-batches, no accumulation.
        assert {(t.micro_batch_size, t.grad_accum) for t in trials} == {
            (spec.training.batch_size // spec.resources.num_workers, 1)}
    elif not path.stem.endswith("-cpu"):  # the paper's scale: Table 1 and 2, App. C
        assert spec.workload_config.source == "slimpajama"
        assert spec.workload_config.tokenizer == "hf-internal-testing/llama-tokenizer"
        assert {t.model.context_length for t in trials} == {2048}
        assert {t.model.vocab_size for t in trials} == {32000}
        assert spec.resources.num_workers == 8 and spec.resources.use_gpu
        assert spec.training.batch_size == 128 and spec.budget.tokens_per_param == 20
        assert spec.budget.budget_scale == 1


@pytest.mark.parametrize("path", PAPER_SCALE, ids=lambda p: p.stem)
def test_every_paper_spec_has_a_cpu_twin_with_the_same_comparison(path):
    twin = path.with_name(f"{path.stem}-cpu.yaml")
    assert twin.exists()
    paper, cpu = yaml.safe_load(path.read_text()), yaml.safe_load(twin.read_text())
    assert cpu["variants"] == paper["variants"]
    assert cpu.get("workload") == paper.get("workload")
    assert load_spec(twin).resources.use_gpu is False


def test_fig3b_varies_only_the_kq_diagonal_with_a_fixed_diagonal_preconditioner():
    # Sec. 4.4: Llama MLPs, CEM attention with one step and a simple diagonal preconditioner.
    spec = load_spec(ROOT / "experiments" / "paper" / "fig3b.yaml")
    models = {t.variant: t.model for t in plan(spec) if t.size == spec.sizes[0]}
    cem = {v: m for v, m in models.items() if m.attention == "cem"}
    assert sorted(m.kq_diag for m in cem.values()) == ["none", "per_head", "shared"]
    for m in cem.values():
        assert (m.attn_preconditioner, m.mlp, m.attn_steps) == ("diag", "llama", 1)
    # Nothing else differs between the three.
    others = [dataclasses.replace(m, kq_diag="none") for m in cem.values()]
    assert all(o == others[0] for o in others)


def test_parameter_matched_cem_mlp_restores_the_llama_mlp_parameters():
    spec = load_spec(ROOT / "experiments" / "paper" / "fig2b.yaml")
    trials = plan(spec)
    for size in spec.sizes:
        counts = {t.variant: t.params["mlp"] for t in trials if t.size == size}
        assert counts["cem-mlp"] == pytest.approx(2 / 3 * counts["llama"], rel=0.01)
        assert counts["cem-mlp-pm"] == pytest.approx(counts["llama"], rel=0.01)


def test_paper_fig3a_budget_is_chinchilla_on_table_1():
    spec = load_spec(ROOT / "experiments" / "paper" / "fig3a.yaml")
    for t in plan(spec):
        baseline = llama_params(32000, *{"llama-86m": (672, 8, 1792),
                                         "llama-108m": (672, 12, 1792),
                                         "llama-134m": (768, 12, 2048),
                                         "llama-162m": (864, 12, 2304)}[t.size])
        assert 20 * baseline <= t.tokens < 20 * baseline + 128 * 2048


def test_precision_auto_is_fixed_when_planned_and_is_part_of_the_trial_id():
    """``auto`` trains in bf16 on one machine and fp32 on another: a trial carries (and its id
    hashes) the precision it trains in, bf16 on GPUs and this machine's choice on CPUs."""
    from workloads.core.precision import bf16_supported

    here = "bf16" if bf16_supported() else "fp32"
    auto = parse_spec(GRID)
    assert auto.engine.precision == "auto"
    assert {t.engine.precision for t in plan(auto)} == {here}
    gpu = parse_spec({**GRID, "resources": {"num_workers": 2, "use_gpu": True}})
    assert {t.engine.precision for t in plan(gpu)} == {"bf16"}

    def ids(precision: str) -> list[str]:
        pinned = {**GRID, "training": {**GRID["training"]}, "engine": {"precision": precision}}
        return [t.trial_id for t in plan(parse_spec(pinned))]

    other = "fp32" if here == "bf16" else "bf16"
    assert [t.trial_id for t in plan(auto)] == ids(here)
    assert not set(ids(here)) & set(ids(other))


GP = {"name": "gp", "workload": "gp_regression",
      "gp": {"kernels": ["rbf"], "input_dim": 6, "n_train": 1500, "n_val": 250, "n_test": 250,
             "steps": 2},
      "sizes": ["gp-base"], "variants": {"t2": {"mlp_steps": 2}}, "learning_rates": [0.004],
      "training": {"batch_size": 64}, "engine": {"precision": "fp32"},
      "resources": {"num_workers": 1}}


def _gp(**overrides) -> dict:
    return {**GP, **{k: {**GP[k], **v} if isinstance(v, dict) else v
                     for k, v in overrides.items()}}


def _gp_memory(spec_dict: dict):
    spec = parse_spec(spec_dict)
    t = plan(spec)[0]
    return t, spec.workload_impl.memory(t.model, t.engine, t.resources, t.micro_batch_size,
                                        t.config)


def test_the_gp_plan_shows_a_worker_s_memory_the_data_draw_dominates(tmp_path, capsys):
    """2,000 points from the RBF kernel: 3 N x N float64 matrices at the draw's peak, 96 MB,
    far above gp-base's states; the plan's row says so instead of '-'."""
    path = tmp_path / "gp.yaml"
    path.write_text(yaml.safe_dump(GP))
    assert main(["plan", "--no-calibrate", str(path)]) == 0
    out = capsys.readouterr().out
    assert f"{3 * 8 * 2000**2 / 2**20:.0f} MiB" in out  # 92 MiB
    _, est = _gp_memory(GP)
    assert est.total == est.draw == 3 * 8 * 2000**2
    assert est.data == 4 * 2000 * (6 + 1)  # x (N, 6) and y (N,) kept as float32
    _, both = _gp_memory(_gp(gp={"kernels": ["rbf", "nonstationary"]}))
    assert both.draw == 4 * 8 * 2000**2  # the Gibbs kernel's draw holds one matrix more
    # On a GPU the data never reach it: the device holds the training states alone.
    _, gpu = _gp_memory(_gp(resources={"use_gpu": True}))
    assert gpu.total == gpu.training < gpu.draw


@pytest.mark.parametrize("workers", [1, 2])
def test_gp_states_match_the_tensors_of_a_real_adamw_step(workers):
    """Weights, gradients and AdamW's moments as the tensors of a trained step hold them; two
    workers' DDP reduces gradients through bucket copies of the same size."""
    import torch

    from workloads.gp.regressor import GPRegressor

    t, est = _gp_memory(_gp(resources={"num_workers": workers}))
    net = GPRegressor(t.model, t.config.input_dim)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
    net(torch.randn(4, t.config.input_dim)).square().mean().backward()
    opt.step()

    def nbytes(tensors) -> int:
        return sum(x.numel() * x.element_size() for x in tensors)

    assert est.parameters == nbytes(net.parameters())
    assert est.gradients == workers * nbytes(p.grad for p in net.parameters())
    assert est.optimizer == nbytes(s[k] for s in opt.state.values()
                                   for k in ("exp_avg", "exp_avg_sq"))


# bf16 autocast runs the regressor's RMSNorm on bf16 inputs with fp32 weights, unfused (torch
# says so each time): the path a bf16 GP trial takes.
@pytest.mark.filterwarnings("ignore:Mismatch dtype between input and weight:UserWarning")
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("variant", [{"mlp_steps": 1}, {"mlp_steps": 4},
                                     {"mlp_steps": 3, "layer_reuse": True}])
def test_gp_activations_match_what_autograd_keeps(precision, variant):
    """The estimate against the bytes autograd saves for the backward pass of one micro-batch
    (``saved_tensors_hooks``; the parameters' own storage is counted with the weights)."""
    import torch

    from workloads.gp.regressor import GPRegressor

    t, est = _gp_memory(_gp(variants={"t": variant}, engine={"precision": precision}))
    net = GPRegressor(t.model, t.config.input_dim)
    weights = {p.untyped_storage().data_ptr() for p in net.parameters()}
    saved: dict[int, int] = {}

    def keep(x):
        storage = x.untyped_storage()
        if storage.data_ptr() not in weights:
            saved[storage.data_ptr()] = storage.nbytes()
        return x

    x = torch.randn(t.micro_batch_size, t.config.input_dim)
    with torch.autograd.graph.saved_tensors_hooks(keep, lambda x: x), \
            torch.autocast("cpu", torch.bfloat16, enabled=precision == "bf16"):
        net(x)
    assert est.activations == pytest.approx(sum(saved.values()), rel=0.12)


@pytest.mark.slow
def test_the_gp_data_draw_peaks_where_the_estimate_says():
    """The draw's peak resident memory over the process's memory before it, in a fresh
    interpreter, after a first draw of the same size (its code paths and the linear algebra
    library's workspaces in place): 4 N x N float64 matrices for the Gibbs kernel, 3 for the
    RBF kernel, at the paper specs' N = 2,816 (matrices of 63 MB, each a mapping of its own,
    returned when freed)."""
    import subprocess
    import sys

    from workloads.gp.memory import draw_bytes

    script = (
        "from workloads.gp.data import sample_gp_regression\n"
        "def status(key):\n"
        "    line = next(s for s in open('/proc/self/status') if s.startswith(key + ':'))\n"
        "    return int(line.split()[1]) * 1024\n"
        "sample_gp_regression('{k}', 6, 2048, 256, 512, 0.05, 0)\n"
        "with open('/proc/self/clear_refs', 'w') as f:\n"
        "    f.write('5')\n"  # the peak resident memory (VmHWM) starts again from here
        "now = status('VmRSS')\n"
        "sample_gp_regression('{k}', 6, 2048, 256, 512, 0.05, 1)\n"
        "print(status('VmHWM') - now)\n")
    for kernel in ("rbf", "nonstationary"):
        out = subprocess.run([sys.executable, "-c", script.format(k=kernel)], cwd=ROOT,
                             capture_output=True, text=True, check=True, timeout=120)
        assert int(out.stdout) == pytest.approx(draw_bytes(2816, [kernel]), rel=0.05)
