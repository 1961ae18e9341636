import pytest
import torch

from outlierscope.models.presets import PRESETS, PairConfig


@pytest.mark.parametrize("name", ["pair-test", "pair-tiny"])
def test_pair_differs_only_in_lambda(name):
    cfg = PairConfig.from_name(name)
    t, d = cfg.build("transformer", seed=1), cfg.build("diff", seed=1)
    st, sd = t.state_dict(), d.state_dict()
    extra = set(sd) - set(st)
    assert set(st) <= set(sd)
    assert extra and all(".self_attn.lambda_" in k for k in extra)
    assert len(extra) == 4 * cfg.n_layers
    for k in st:  # identical init of every shared weight
        assert st[k].shape == sd[k].shape
        assert torch.equal(st[k], sd[k]), k
    count = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
    assert count(d) - count(t) == 4 * cfg.head_dim * cfg.n_layers
    assert type(t).__name__ == "LlamaForCausalLM" and type(d).__name__ == "DiffLlamaForCausalLM"


@pytest.mark.parametrize("name", list(PRESETS))
def test_n_params_matches_built_model(name):
    from transformers import AutoModelForCausalLM

    cfg = PairConfig.from_name(name)
    for role in ("transformer", "diff"):
        with torch.device("meta"):
            m = AutoModelForCausalLM.from_config(cfg.hf_config(role))
        assert cfg.n_params(role) == sum(p.numel() for p in m.parameters())


def test_presets_are_frozen_and_derived():
    cfg = PairConfig.from_name("pair-tiny")
    import dataclasses

    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.hidden_size = 3
    assert cfg.head_dim == cfg.hidden_size // cfg.n_heads
    assert cfg.n_kv_heads == cfg.n_heads
    assert PairConfig.from_dict(cfg.to_dict()) == cfg


def test_unknown_preset_did_you_mean():
    with pytest.raises(ValueError, match="did you mean pair-tiny"):
        PairConfig.from_name("pair-tny")


@pytest.mark.parametrize("kw,msg", [(dict(n_heads=5, hidden_size=40), "even"), (dict(hidden_size=30, n_heads=4), "divisible")])
def test_invalid_config(kw, msg):
    with pytest.raises(ValueError, match=msg):
        PairConfig(name="x", **kw)


def test_bad_role():
    with pytest.raises(ValueError, match="role must be one of"):
        PairConfig.from_name("pair-test").hf_config("gpt")
