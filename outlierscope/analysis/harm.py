"""What a per-layer sensitivity study ranks layers by: one column of a cell's change against the unquantized
model, its sign (which way hurts) and its unit. ``gold_ll`` reads items of a task; ``kld`` and ``ppl`` read running
text (``outlierscope.eval.perplexity``)."""

from __future__ import annotations

from dataclasses import dataclass

TEXT_METRICS = ("kld", "ppl")


@dataclass(frozen=True)
class RankBy:
    """What a sensitivity run ranks layers by and bounds its greedy with.

    Attributes:
        name: the metric's name (``--metric``).
        column: the column of a cell's change against the unquantized model.
        harm_sign: harm = ``harm_sign`` x the change (> 0 hurts).
        unit: the tolerance's unit.
        label: the column in words (tables and figures)."""

    name: str
    column: str
    harm_sign: int
    unit: str
    label: str

    @property
    def on_text(self) -> bool:
        return self.name in TEXT_METRICS

    def harm(self, value):
        """The harm of a change (> 0 hurts).

        Args:
            value: the change."""
        return self.harm_sign * value

    def within(self, change: dict, tolerance: float) -> bool:
        """Whether a change's harm is at most a tolerance (a gain of any size passes).

        Args:
            change: a cell's change (its ``column``).
            tolerance: the bound."""
        return self.harm(change[self.column]) <= tolerance


RANK_BY = {"gold_ll": RankBy("gold_ll", "delta_gold_ll", -1, "nats of mean gold log-likelihood lost",
                             "Δ mean gold log-likelihood (nats)"),
           "kld": RankBy("kld", "kld_mean", 1, "nats of mean KL divergence to the unquantized model",
                         "mean KLD to the unquantized model (nats)"),
           "ppl": RankBy("ppl", "ln_ppl_ratio", 1, "ln(PPL / PPL of the unquantized model)", "ln(PPL / PPL base)")}


def rank_by_of(settings: dict) -> RankBy:
    """The ``RankBy`` of a sensitivity record's settings (a record without a metric: gold_ll).

    Args:
        settings: the record's settings."""
    return RANK_BY[settings.get("metric", "gold_ll")]
