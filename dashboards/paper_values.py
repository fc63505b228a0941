"""Numbers stated in the paper (shared/papers/cem-paper.md), by figure, to show beside ours.

The paper prints no perplexity (or RMSE) for any figure: its results live in the plots only,
and plots are never read here. What it does state, and what is kept:

* Table 1 (App. C.1): the parameter count heading each model-size column (86M, 108M, 134M,
  162M): the Llama baseline of that size, filed under the figures that plot parameters
  (fig2a, fig2b, fig3a).
* Table 2 (App. C.3) with Sec. 4.1: the learning rate 0.002, "the optimal Llama
  hyperparameters from grid search" (one value for all sizes), filed under fig3a.
* Sec. 4.1 and 4.3 text and the Fig. 3a caption: parameter ratios stated in words ("about
  half", "two-thirds", "one-third"), CEM block / Llama block.

Figs. 2c, 2d, 3b, 3c and 4 state no numbers. Table 3 (GP regression RMSE, App. D) is not in
this text of the paper (App. D ends with Fig. 4), so ``gp-table`` has no entries.

A value whose ``note`` contains "not a grid cell" keeps the paper's own label in ``variant``
or ``size``; every other value names a (variant, size) cell of its figure's spec.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PaperValue:
    """One number the paper states. ``figure``: spec stem (``fig2a`` ... ``gp-table``);
    ``variant``/``size`` (and ``dataset`` for gp-table, else ""): our spec's names where the
    number maps onto a grid cell; ``metric``: ``test_perplexity``, ``rmse``, ``opt_lr``,
    ``params_total``, ... ; ``source``: where in the paper (e.g. "Table 3", "Sec. 4.1 text");
    ``note``: anything a reader must know (e.g. "validation perplexity", "read as stated")."""
    figure: str
    variant: str
    size: str
    metric: str
    value: float
    source: str
    dataset: str = ""
    note: str = ""


_SIZES = {"llama-86m": 86e6, "llama-108m": 108e6, "llama-134m": 134e6, "llama-162m": 162e6}
_PARAMS_NOTE = "Table 1 column heading, rounded to millions; the Llama baseline's total"
_ALL = "all sizes"
_WORDS = "stated in words; per block, CEM / Llama; not a grid cell"


def _llama_params(figure: str) -> tuple[PaperValue, ...]:
    return tuple(PaperValue(figure, "llama", size, "params_total", n, "Table 1",
                            note=_PARAMS_NOTE) for size, n in _SIZES.items())


PAPER_VALUES: tuple[PaperValue, ...] = (
    *_llama_params("fig2a"),
    PaperValue("fig2a", "cem-attn", _ALL, "attn_param_ratio", 0.5, "Sec. 4.1 text",
               note=f"'about half' the parameters of Llama MHA; {_WORDS}"),
    *_llama_params("fig2b"),
    PaperValue("fig2b", "cem-mlp", _ALL, "mlp_param_ratio", 2 / 3, "Sec. 4.1 text",
               note=f"'about two-thirds' of the Llama gated MLP; {_WORDS}"),
    *_llama_params("fig3a"),
    PaperValue("fig3a", "llama", _ALL, "opt_lr", 0.002, "Table 2; Sec. 4.1 text",
               note="the one learning rate of Table 2, called the optimal Llama hyperparameter "
                    "from grid search; not per size, and not Fig. 3a's Akima optima (those are "
                    "only plotted); not a grid cell"),
    PaperValue("fig3a", "cem", _ALL, "attn_param_ratio", 0.5, "Fig. 3a caption; Sec. 4.3 text",
               note=f"'roughly half the MHA' parameters; {_WORDS}"),
    PaperValue("fig3a", "cem", _ALL, "mlp_param_ratio", 2 / 3, "Sec. 4.3 text",
               note=f"'CEM MLPs about two-thirds'; {_WORDS}"),
    PaperValue("fig3a", "cem", _ALL, "mlp_param_ratio", 1 / 3, "Fig. 3a caption",
               note="'one-third the MLP parameters', read as stated: it contradicts the "
                    f"two-thirds of Sec. 4.1 and 4.3 (likely 'one-third fewer'); {_WORDS}"),
)


def paper_values(figure: str) -> list[PaperValue]:
    """The stated numbers of ``figure`` (a spec stem; a ``-cpu`` suffix is ignored), in table
    order."""
    stem = figure.removesuffix("-cpu")
    return [v for v in PAPER_VALUES if v.figure == stem]
