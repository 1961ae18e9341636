"""What a per-layer sensitivity study ranks layers by: one column of a cell's change against the unquantized
model, its sign (which way hurts) and its unit. ``gold_ll`` reads items of a task; ``kld`` and ``ppl`` read running
text (``outlierscope.eval.perplexity``)."""

from __future__ import annotations

from dataclasses import dataclass

TEXT_METRICS = ("kld", "ppl")


@dataclass(frozen=True)
class RankBy:
    """What a sensitivity run ranks layers by and bounds its greedy with: ``column`` of a cell's change against the
    unquantized model, harm = ``harm_sign`` x it (> 0 hurts), ``tolerance`` in ``unit``."""

    name: str
    column: str
    harm_sign: int
    unit: str
    label: str  # the column in words (tables and figures)

    @property
    def on_text(self) -> bool:
        return self.name in TEXT_METRICS

    def harm(self, value):
        return self.harm_sign * value

    def within(self, change: dict, tolerance: float) -> bool:
        """A harm bound: at most ``tolerance`` (a gain of any size passes)."""
        return self.harm(change[self.column]) <= tolerance


RANK_BY = {"gold_ll": RankBy("gold_ll", "delta_gold_ll", -1, "nats of mean gold log-likelihood lost",
                             "Δ mean gold log-likelihood (nats)"),
           "kld": RankBy("kld", "kld_mean", 1, "nats of mean KL divergence to the unquantized model",
                         "mean KLD to the unquantized model (nats)"),
           "ppl": RankBy("ppl", "ln_ppl_ratio", 1, "ln(PPL / PPL of the unquantized model)", "ln(PPL / PPL base)")}


def rank_by_of(settings: dict) -> RankBy:
    """The ``RankBy`` of a sensitivity record's settings (records before the text metrics: gold_ll)."""
    return RANK_BY[settings.get("metric", "gold_ll")]
