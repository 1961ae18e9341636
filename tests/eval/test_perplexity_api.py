"""The README's per-token Python example runs as written, from the one-line import, and its values are the model's
own: the NLL of each scored token from a float64 log-softmax of the model's full forward."""

import re
from pathlib import Path

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


def _readme_block() -> str:
    from tests.manual import manual

    after = manual().split("In Python, per-token values of any loaded model", 1)[1]
    return re.search(r"```python\n(.*?)```", after, re.S).group(1)


def test_the_readme_per_token_example():
    from outlierscope.data.running_text import lambada_path
    from outlierscope.quant.apply import quantize_model
    from outlierscope.quant.specs.spec import QuantSpec

    if not lambada_path().exists():
        pytest.skip("outlierscope data fetch has not run")
    ns: dict = {}
    exec(_readme_block(), ns)  # noqa: S102 - the README's own lines
    lm, windows, base, w8a8 = ns["lm"], ns["windows"], ns["base"], ns["w8a8"]
    assert len(windows) == 8 and len(w8a8) == sum(len(w.targets) for w in windows) == 8 * 255
    want, want_q = [], []
    for w in windows:
        ids = torch.tensor([w.input_ids])
        with torch.no_grad():
            for spec, out in ((QuantSpec(), want), (QuantSpec.parse("w8a8"), want_q)):
                with quantize_model(lm.model, spec):
                    lp = torch.log_softmax(lm.model(input_ids=ids).logits[0].double(), -1)  # (T, V)
                out += [-float(lp[w.first + j, t]) for j, t in enumerate(w.targets)]
    np.testing.assert_allclose(base.nll, want, rtol=1e-5)
    np.testing.assert_allclose(w8a8.nll, want_q, rtol=1e-5)
    assert not base.kld.any() and w8a8.kld.mean() > 0
    assert w8a8.summary()["ppl"] == pytest.approx(np.exp(np.mean(want_q)), rel=1e-5)
