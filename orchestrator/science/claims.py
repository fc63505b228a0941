"""The paper's claims that CEM Lab tests, each a set of comparisons between variants of one
paper spec (``experiments/paper/<figure>[-cpu].yaml``), and the questions of the recursion
study (``experiments/studies/``): does T=2 beat T=1 under each reading of the paper's
Algorithm 1, in fp32, and with more tokens. Each set is a ``ClaimSet``.

A comparison's effect is a log ratio of the test metric (perplexity, GP RMSE) of models trained
at each arm's learning rate chosen on validation, pooled over the spec's sizes
(``verdicts.pooled_fit``): ``log(treatment / control)`` (negative: the treatment is better), or,
with base arms, the log ratio of two gains ``log((treatment / treatment_base) / (control /
control_base))`` (negative: the treatment's gain is the larger). Margins are relative changes
(0.05 for 5 %), compared as ``log(1 + margin)``, fixed here before any run. Data only:
``orchestrator.science.report`` evaluates them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Kind = Literal["better", "not_worse", "equivalent"]
EQUIVALENCE = 0.01  # the equivalence margin (relative, ±) of a claim that states no other


@dataclass(frozen=True)
class Comparison:
    """``treatment`` against ``control`` (variant names of the claim's spec).

    An arm ``<variant>@<setting>`` is test-time recursion (``training.eval_steps``): the model
    of ``variant`` at the learning rate chosen on validation (the nearest one trained), on the
    test split again with its CEM sublayers at setting ``T<t>_kept`` or ``T<t>_scaled``
    (``workloads.lm.recursion.settings``).

    ``kind``: ``better`` (the claim: effect < 0), ``not_worse`` (the claim: effect <
    ``log(1 + margin)``, ``margin`` a relative tolerance such as 0.05 for "within 5 %") or
    ``equivalent`` (the claim: |effect| < ``log(1 +`` the equivalence margin ``)``; its test is
    TOST). ``equivalence``: the margin inside which the arms count as equal (relative, ±), when
    it differs from its claim's (``Claim.equivalence``); fixed here, before the trials run.
    """

    treatment: str
    control: str
    kind: Kind = "better"
    margin: float = 0.0
    treatment_base: str | None = None
    control_base: str | None = None
    equivalence: float | None = None

    @property
    def tost(self) -> bool:
        """Whether the comparison's own test is equivalence (TOST)."""
        return self.kind == "equivalent"

    @property
    def threshold(self) -> float:
        """The relative change the claim must stay below: 0 (``better``) or ``margin``
        (the report compares the log ratio with ``log(1 + threshold)``)."""
        return self.margin if self.kind == "not_worse" else 0.0

    @property
    def arms(self) -> tuple[str, ...]:
        return tuple(a for a in (self.treatment, self.control, self.treatment_base,
                                 self.control_base) if a)

    @property
    def variants(self) -> set[str]:
        """The spec's variants the arms name (a test-time arm names its trained variant)."""
        return {arm.split("@")[0] for arm in self.arms}

    def describe(self) -> str:
        """e.g. ``cem-attn vs llama (not worse by 5%)``, ``cem-attn-t2/cem-attn-t1 vs ...``."""
        t = (f"{self.treatment}/{self.treatment_base}" if self.treatment_base
             else self.treatment)
        c = f"{self.control}/{self.control_base}" if self.control_base else self.control
        goal = {"better": "lower", "equivalent": "equal within the margin"}.get(
            self.kind, f"not worse by {self.margin:.0%}")
        return f"{t} vs {c} ({goal})"


@dataclass(frozen=True)
class Claim:
    """One sentence of the paper and the comparisons that test it on ``figure``'s spec."""

    key: str
    title: str
    quote: str
    source: str
    figure: str  # spec stem: <directory>/<figure>.yaml and its -cpu twin
    comparisons: tuple[Comparison, ...]
    equivalence: float = EQUIVALENCE  # the margin (relative, ±) inside which arms count equal
    equivalence_why: str = ""  # one line: why that margin

    def margin_of(self, comparison: Comparison) -> float:
        """``comparison``'s equivalence margin (relative, ±): its own, else the claim's."""
        return (comparison.equivalence if comparison.equivalence is not None
                else self.equivalence)


@dataclass(frozen=True)
class ClaimSet:
    """Claims reported together (``cemlab report DIR --claims KEY``).

    ``ladder``: keys of claims whose specs differ only in training tokens; the report draws
    each of their arms' test metric against tokens per trial (``report.ladder_figure``).
    """

    key: str
    title: str  # the report's heading
    claims: tuple[Claim, ...]
    ladder: tuple[str, ...] = ()


CLAIMS: tuple[Claim, ...] = (  # the paper's, on experiments/paper/
    Claim("a", "CEM attention (T=1) is within a few % of Llama with about half the attention "
          "parameters",
          "Replacing attention with the CEM variant has only a small effect on test perplexity "
          "despite halving the parameter count", "Sec. 4.1, Fig. 2a", "fig2a",
          (Comparison("cem-attn", "llama", "not_worse", 0.05),
           # the control: the same position encoding (ALiBi) on untied attention, so that the
           # effect is the tying's, not ALiBi's
           Comparison("cem-attn", "llama-alibi", "not_worse", 0.05)),
          equivalence=0.05, equivalence_why="the claim's own 'small effect': its 5 % not-worse "
          "margin"),
    Claim("b", "Within-layer recursion T=2 beats T=1",
          "Results in Figure 2 show consistent gains when increasing recursion from T=1 to T=2.",
          "Sec. 4.2, Fig. 2c", "fig2c",
          (Comparison("cem-attn-diag-t2", "cem-attn-diag-t1"),
           Comparison("cem-attn-dlr-t2", "cem-attn-dlr-t1"),
           # the controls: T=2 against one step of 2 eta, the step size it takes in all
           Comparison("cem-attn-diag-t2", "cem-attn-diag-t1-eta2"),
           Comparison("cem-attn-dlr-t2", "cem-attn-dlr-t1-eta2")),
          equivalence=0.01, equivalence_why="a gain under 1 % of perplexity is not the "
          "'consistent gain' the paper reports"),
    Claim("c", "A shared KQ diagonal is close to per-head diagonals, and both beat none",
          "Including a diagonal term proves essential for good performance, and our "
          "shared-diagonal strategy provides performance close to per-head diagonals",
          "Sec. 4.4, Fig. 3b", "fig3b",
          (Comparison("cem-attn-shared", "cem-attn-per-head", "not_worse", 0.02),
           Comparison("cem-attn-shared", "cem-attn-nodiag"),
           Comparison("cem-attn-per-head", "cem-attn-nodiag")),
          equivalence=0.02, equivalence_why="'close to' is the claim's 2 % not-worse margin"),
    Claim("d", "Within-layer recursion beats plain layer reuse",
          "naive reuse of the same MHA block offers no benefit and can even degrade performance "
          "in the case of MHA. In contrast, within-layer recursion in CEM attention yields clear "
          "and consistent perplexity improvements.", "App., Fig. 4", "fig4",
          (Comparison("cem-attn-t2", "llama-reuse-t2", treatment_base="cem-attn-t1",
                      control_base="llama-t1"),
           Comparison("cem-attn-t2", "cem-attn-t1-eta2")),  # the control: one step of 2 eta
          equivalence=0.01, equivalence_why="'no benefit' of reuse: gains under 1 % of "
          "perplexity"),
    Claim("e", "Full CEM at its optimal learning rate matches or beats Llama with fewer "
          "parameters",
          "Overall, full CEM Transformers achieve slightly better performance at their optimal "
          "learning rate while using considerably fewer parameters.", "Sec. 4.3, Fig. 3a",
          "fig3a", (Comparison("cem", "llama", "not_worse", 0.01),
                    Comparison("cem", "llama-alibi", "not_worse", 0.01)),  # control: ALiBi
          equivalence=0.01, equivalence_why="'matches': within the claim's 1 % not-worse "
          "margin"),
    Claim("f", "GP regression: RMSE falls from T=1 to T=2",
          "moving from T=1 to T=2 often improves RMSE (Table 3, as summarised in "
          "shared/papers/cem-explainer.md)", "App. D, Table 3", "gp-table",
          (Comparison("t2", "t1"), Comparison("t2", "t1-eta2")),  # control: one step of 2 eta
          equivalence=0.01, equivalence_why="an RMSE change under 1 % is below what Table 3 "
          "reports as an improvement"),
    Claim("g", "A CEM MLP (T=1) trails Llama's gated MLP, and the parameter-matched one closes "
          "part of the gap",
          "For CEM-MLPs, perplexity is higher due to parameter sharing, but increasing the "
          "hidden dimension to match parameter count yields consistent, albeit modest, "
          "improvements in perplexity", "Sec. 4.1, Fig. 2b", "fig2b",
          (Comparison("llama", "cem-mlp"), Comparison("cem-mlp-pm", "cem-mlp")),
          equivalence=0.01, equivalence_why="'modest improvements': 1 % of perplexity is the "
          "least that counts"),
    Claim("h", "Within-layer recursion T=2 beats T=1 in CEM MLPs",
          "Results in Figure 2 show consistent gains when increasing recursion from T=1 to T=2. "
          "[...] For MLPs, CEM variants still underperform the baseline, but the gap narrows "
          "considerably with T=2 and a diagonal-plus-low-rank preconditioner.",
          "Sec. 4.2, Fig. 2d", "fig2d",
          (Comparison("cem-mlp-diag-t2", "cem-mlp-diag-t1"),
           Comparison("cem-mlp-dlr-t2", "cem-mlp-dlr-t1"),
           Comparison("cem-mlp-diag-t2", "cem-mlp-diag-t1-eta2"),  # the controls: 2 eta
           Comparison("cem-mlp-dlr-t2", "cem-mlp-dlr-t1-eta2")),
          equivalence=0.01, equivalence_why="as (b): a gain under 1 % is not a consistent gain"),
    Claim("i", "Within-layer recursion beats plain layer reuse in MLPs",
          "Simply reapplying the same residual block yields little or no perplexity gain. [...] "
          "In contrast, CEM-based within-layer recursion produces consistent improvements in "
          "both dimension- and parameter-matched settings.", "Sec. 4.4, Fig. 3c", "fig3c",
          (Comparison("cem-mlp-t2", "llama-reuse-t2", treatment_base="cem-mlp-t1",
                      control_base="llama-t1"),
           Comparison("cem-mlp-t2", "cem-mlp-t1"), Comparison("cem-mlp-pm-t2", "cem-mlp-pm-t1"),
           Comparison("cem-mlp-t2", "cem-mlp-t1-eta2")),  # the control: one step of 2 eta
          equivalence=0.01, equivalence_why="as (d): 'little or no gain' is under 1 %"),
    Claim("j", "More recursion steps at test time lower perplexity (the paper's future work)",
          "This within-layer recursion thus offers a distinct mechanism that could provide a "
          "new dimension for test-time scaling, which we leave for future work.",
          "Sec. 2.3, Sec. 5.2", "fig3a",
          # full CEM trained at T=2, evaluated at T=4 (eta per step scaled by 2/4, the total
          # step of training, or as trained) against T=2; and T=2 against T=1 at 2 eta
          (Comparison("cem@T4_scaled", "cem@T2_kept"), Comparison("cem@T4_kept", "cem@T2_kept"),
           Comparison("cem@T2_kept", "cem@T1_scaled")),
          equivalence=0.01, equivalence_why="a test-time gain under 1 % of perplexity is no "
          "scaling dimension"),
)

# The recursion study (docs/recursion.md): each question is claim (b), T=2 beats T=1, under one
# reading of Algorithm 1 (quoted: the sentence the reading takes literally), in fp32, or at
# another training length; "supports" means the paper's claim holds there.
_T2_BEATS_T1 = (Comparison("t2", "t1"),)
# every recursion question keeps claim (b)'s margin and its reason
_STUDY_MARGIN = {"equivalence": 0.01, "equivalence_why": "as (b): a gain under 1 % of "
                 "perplexity is not the 'consistent gain' the paper reports"}
_BUDGET = ("All models are trained on SlimPajama for the compute-optimal number of tokens of the "
           "corresponding Llama baselines")
_STEP_SIZES = ("Hyperparameters: Recursive steps T_eps, T_xi, step sizes eta_eps, eta_xi "
               "(Algorithm 1 never gives their values)")
_ITERATIONS = ("A natural extension is therefore to apply multiple recursive updates within the "
               "same layer, analogous to running several iterations of an optimization "
               "algorithm")
_FP32 = Claim("fp32", "T=2 beats T=1 in fp32 (the readings' precision is auto: bf16 where "
               "supported)", "Precision: bf16-mixed", "Table 2", "recursion-fp32", _T2_BEATS_T1,
               **_STUDY_MARGIN)
RECURSION_CLAIMS: tuple[Claim, ...] = (
    Claim("eta1", "T=2 beats T=1 with eta = 1 per step (our default reading)",
          "starting from x_i^(0) = h_i, we perform T updates of the form x_i^(t+1) = x_i^(t) - "
          "eta_eps Delta x_i; ... the residual update corresponds exactly to a single gradient "
          "descent step (with step size eta = 1)", "Sec. 2.1, 2.3", "recursion-readings",
          _T2_BEATS_T1, **_STUDY_MARGIN),
    Claim("vs-2eta", "T=2 at eta = 1 beats a single step of 2 eta (the recursion adds more than "
          "step size)", _ITERATIONS, "Sec. 2.3", "recursion-readings",
          (Comparison("t2", "t1-eta2"),), **_STUDY_MARGIN),
    Claim("eta-half", "T=2 with eta / T per step beats T=1 (two steps no larger than one)",
          _STEP_SIZES, "Algorithm 1", "recursion-readings",
          (Comparison("t2-eta-half", "t1"),), **_STUDY_MARGIN),
    _FP32,
    Claim("tokens-x1", "T=2 beats T=1 on 1/16 of the Chinchilla budget (the token ladder's "
          "base)", _BUDGET, "Sec. 4", "recursion-budget-x1", _T2_BEATS_T1, **_STUDY_MARGIN),
    Claim("tokens-x16", "T=2 beats T=1 on the full Chinchilla budget (16x the base)", _BUDGET,
          "Sec. 4", "recursion-budget-x16", _T2_BEATS_T1, **_STUDY_MARGIN),
)

# Algorithm 1's other readings, each a model option against its own T=1 twin, and the
# precisions side by side (fp32 and bf16 trained on one machine): reported apart
# (docs/results/recursion-options/) from the step sizes and token ladder above.
RECURSION_OPTION_CLAIMS: tuple[Claim, ...] = (
    Claim("eta-learn", "T=2 with a learnable eta (from eta / T) beats T=1", _STEP_SIZES,
          "Algorithm 1", "recursion-eta-learn", (Comparison("t2-eta-learn", "t1"),),
          **_STUDY_MARGIN),
    Claim("unit-p", "T=2 beats T=1 when the preconditioner starts at P = I (not 1.31 I)",
          "p is initialized to 1/sqrt(D_h). This ensures that d starts at 1, but still yielding "
          "an appropriate effective gradient step size (softplus(1) = 1.31)", "App. C.4",
          "recursion-unit-p", (Comparison("t2-unit-p", "t1-unit-p"),), **_STUDY_MARGIN),
    Claim("norm-start", "T=2 beats T=1 when the recursion starts at x(0) = RMSNorm(h)",
          "h_{1:i} <- RMSNorm(h_{1:i}); x_i <- h_i (Algorithm 1 read literally, against Sec. "
          "2.3's 'starting from x_i^(0) = h_i')", "Algorithm 1", "recursion-norm-start",
          (Comparison("t2-norm-start", "t1-norm-start"),), **_STUDY_MARGIN),
    Claim("norm-start-vs-2eta", "With x(0) = RMSNorm(h), T=2 beats a single step of 2 eta",
          _ITERATIONS, "Sec. 2.3", "recursion-norm-start",
          (Comparison("t2-norm-start", "t1-eta2-norm-start"),), **_STUDY_MARGIN),
    Claim("raw-keys", "T=2 beats T=1 when the keys read the raw stream h (not RMSNorm(h))",
          "eps(x_i | h_{1:i}) = -tau sum_k log sum_j exp(beta_kj^T x_i / tau) where beta_kj = "
          "A_k h_j", "Eq. 1", "recursion-raw-keys",
          (Comparison("t2-raw-keys", "t1-raw-keys"),), **_STUDY_MARGIN),
    Claim("raw-keys-vs-2eta", "With raw keys, T=2 beats a single step of 2 eta (the recursion "
          "adds more than step size)", _ITERATIONS, "Sec. 2.3", "recursion-raw-keys",
          (Comparison("t2-raw-keys", "t1-eta2-raw-keys"),), **_STUDY_MARGIN),
    _FP32,
    Claim("bf16", "T=2 beats T=1 in bf16 (the paper's precision, pinned: the fp32 twin)",
          "Precision: bf16-mixed", "Table 2", "recursion-bf16", _T2_BEATS_T1, **_STUDY_MARGIN),
)

CLAIM_SETS: dict[str, ClaimSet] = {s.key: s for s in (
    ClaimSet("paper", "The paper's claims", CLAIMS),
    ClaimSet("recursion", "Within-layer recursion, T=2 against T=1 by step size, precision and "
             "training length,",
             RECURSION_CLAIMS, ladder=("tokens-x1", "eta1", "tokens-x16")),
    ClaimSet("recursion-options", "Within-layer recursion, T=2 against T=1 under Algorithm 1's "
             "other readings and in fp32 and bf16,", RECURSION_OPTION_CLAIMS),
)}
