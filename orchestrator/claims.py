"""The paper's claims that CEM Lab tests (issue 10 §3), each a set of paired comparisons between
variants of one paper spec (``experiments/paper/<figure>[-cpu].yaml``).

A comparison's effect, per seed, is the relative difference of the test metric (perplexity, GP
RMSE) at each arm's learning rate chosen on validation: ``treatment / control - 1`` (negative:
the treatment is better), or, with base arms, the difference of two relative gains
``treatment / treatment_base - control / control_base`` (negative: the treatment's gain is the
larger). Data only: ``orchestrator.report`` evaluates them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Kind = Literal["better", "not_worse"]


@dataclass(frozen=True)
class Comparison:
    """``treatment`` against ``control`` (variant names of the claim's spec).

    ``kind``: ``better`` (the claim: effect < 0) or ``not_worse`` (the claim: effect <
    ``margin``, a relative tolerance such as 0.05 for "within 5 %").
    """

    treatment: str
    control: str
    kind: Kind = "better"
    margin: float = 0.0
    treatment_base: str | None = None
    control_base: str | None = None

    @property
    def arms(self) -> tuple[str, ...]:
        return tuple(a for a in (self.treatment, self.control, self.treatment_base,
                                 self.control_base) if a)

    def describe(self) -> str:
        """e.g. ``cem-attn vs llama (not worse by 5%)``, ``cem-attn-t2/cem-attn-t1 vs ...``."""
        t = (f"{self.treatment}/{self.treatment_base}" if self.treatment_base
             else self.treatment)
        c = f"{self.control}/{self.control_base}" if self.control_base else self.control
        goal = ("lower" if self.kind == "better"
                else f"not worse by {self.margin:.0%}")
        return f"{t} vs {c} ({goal})"


@dataclass(frozen=True)
class Claim:
    """One sentence of the paper and the comparisons that test it on ``figure``'s spec."""

    key: str
    title: str
    quote: str
    source: str
    figure: str  # spec stem: experiments/paper/<figure>.yaml and its -cpu twin
    comparisons: tuple[Comparison, ...]


CLAIMS: tuple[Claim, ...] = (
    Claim("a", "CEM attention (T=1) is within a few % of Llama with about half the attention "
          "parameters",
          "Replacing attention with the CEM variant has only a small effect on test perplexity "
          "despite halving the parameter count", "Sec. 4.1, Fig. 2a", "fig2a",
          (Comparison("cem-attn", "llama", "not_worse", 0.05),)),
    Claim("b", "Within-layer recursion T=2 beats T=1",
          "Results in Figure 2 show consistent gains when increasing recursion from T=1 to T=2.",
          "Sec. 4.2, Fig. 2c", "fig2c",
          (Comparison("cem-attn-diag-t2", "cem-attn-diag-t1"),
           Comparison("cem-attn-dlr-t2", "cem-attn-dlr-t1"))),
    Claim("c", "A shared KQ diagonal is close to per-head diagonals, and both beat none",
          "Including a diagonal term proves essential for good performance, and our "
          "shared-diagonal strategy provides performance close to per-head diagonals",
          "Sec. 4.4, Fig. 3b", "fig3b",
          (Comparison("cem-attn-shared", "cem-attn-per-head", "not_worse", 0.02),
           Comparison("cem-attn-shared", "cem-attn-nodiag"),
           Comparison("cem-attn-per-head", "cem-attn-nodiag"))),
    Claim("d", "Within-layer recursion beats plain layer reuse",
          "naive reuse of the same MHA block offers no benefit and can even degrade performance "
          "in the case of MHA. In contrast, within-layer recursion in CEM attention yields clear "
          "and consistent perplexity improvements.", "App., Fig. 4", "fig4",
          (Comparison("cem-attn-t2", "llama-reuse-t2", treatment_base="cem-attn-t1",
                      control_base="llama-t1"),)),
    Claim("e", "Full CEM at its optimal learning rate matches or beats Llama with fewer "
          "parameters",
          "Overall, full CEM Transformers achieve slightly better performance at their optimal "
          "learning rate while using considerably fewer parameters.", "Sec. 4.3, Fig. 3a",
          "fig3a", (Comparison("cem", "llama", "not_worse", 0.01),)),
    Claim("f", "GP regression: RMSE falls from T=1 to T=2",
          "moving from T=1 to T=2 often improves RMSE (Table 3, as summarised in "
          "shared/papers/cem-explainer.md)", "App. D, Table 3", "gp-table",
          (Comparison("t2", "t1"),)),
)
