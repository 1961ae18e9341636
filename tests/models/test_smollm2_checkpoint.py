"""On SmolLM2-135M (issue #40): a compressed-tensors W8A8 checkpoint (int8 per-channel RTN weights, dynamic int8
per-token activations, the LM head ignored) made here with compressed-tensors' own API from the fetched weights,
against our emulation of its scheme on the same float weights: 32 seeded HellaSwag items (four batches; equality
is exact, so more items add time, not proof).

The reference is the checkpoint as compressed-tensors runs it (its own quantized forward); the emulation is ours.
``make test`` fetches the model first (``outlierscope models fetch smollm2-135m``); run alone without it, the test
is skipped and says so. docs/checkpoints/ holds the same comparison on 500 items and ARC-Easy, with an
llm-compressor-made checkpoint."""

import numpy as np
import pytest

from outlierscope.models.fetch import fetched_path, is_fetched

pytest.importorskip("compressed_tensors")
pytestmark = pytest.mark.skipif(not is_fetched("smollm2-135m"),
                                reason="SmolLM2-135M is not fetched (make test fetches it: outlierscope models fetch)")


def test_smollm2_w8a8_checkpoint_scores_as_the_emulation(hellaswag_cached, tmp_path):
    """Every choice of every item gets the same log-likelihood from the checkpoint and from the float model under
    ``a=fint8/per_token; w=fint8/per_channel`` (compressed-tensors' full-range grid), so every prediction is the
    same; the scheme is the one read back from the checkpoint's quantization_config."""
    from outlierscope.eval.evaluate import evaluate
    from outlierscope.models.loading import load_model, meta_model
    from outlierscope.quant.apply import quantize_model
    from outlierscope.quant.export import spec_from_config
    from tests.models.test_quantized_checkpoints import _w8a8_checkpoint

    path = _w8a8_checkpoint(str(fetched_path("smollm2-135m")), tmp_path / "w8a8")
    real = load_model(str(path), device="cpu")
    spec = spec_from_config(real.quantization_config(), meta_model(real.model.config))
    assert str(spec) == "a=fint8/per_token; w=fint8/per_channel"
    got = evaluate(real, sample=32, seed=0, batch_size=8, progress=False)
    del real
    plain = load_model("smollm2-135m", device="cpu")
    with quantize_model(plain.model, spec):
        want = evaluate(plain, sample=32, seed=0, batch_size=8, progress=False)
    cols = got.score_columns
    assert len(got.items) == 32 and list(got.items["index"]) == list(want.items["index"])
    np.testing.assert_array_equal(got.items[cols].to_numpy(), want.items[cols].to_numpy())
    for p in ("pred", "pred_norm"):
        assert (got.items[p].to_numpy() == want.items[p].to_numpy()).all()
