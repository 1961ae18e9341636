"""The inputs a third review found breaking (issue #63): each is a one-line error naming the flag or file, a
non-zero exit, before any work; the values a spec's constructor accepts are the ones its text can say."""

import math
import warnings

import pytest

from outlierscope.cli import main
from outlierscope.errors import OutlierscopeError, ParamError


@pytest.fixture()
def bad_texts(tmp_path):
    (tmp_path / "latin1.txt").write_bytes("caf\xe9 au lait\n".encode("latin-1"))
    (tmp_path / "dir.txt").mkdir()
    (tmp_path / "broken.parquet").write_bytes(b"PAR1 not really parquet")
    return tmp_path


@pytest.mark.parametrize("name, says", [("latin1.txt", "is not UTF-8 text"), ("dir.txt", "a directory, not a file"),
                                        ("broken.parquet", "cannot be read as parquet")])
def test_unreadable_running_text_is_one_line(bad_texts, name, says):
    from outlierscope.data.running_text import load_text

    with pytest.raises(OutlierscopeError, match=says) as e:
        load_text(str(bad_texts / name))
    assert "\n" not in str(e.value) and name in str(e.value)


@pytest.mark.parametrize("name", ["latin1.txt", "broken.parquet"])
def test_perplexity_with_an_unreadable_text_exits_before_loading(bad_texts, name, capsys, tmp_path):
    rc = main(["perplexity", "--model", "pair-tiny:diff", "--text", str(bad_texts / name), "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1 and name in err
    assert not (tmp_path / "o").exists()


def test_sweep_kld_text_is_read_before_any_item_cell(bad_texts, capsys, tmp_path):
    out = tmp_path / "sweep"
    rc = main(["sweep", "--model", "pair-tiny:diff", "--bits", "16", "8", "--limit", "4", "--kld-text",
               str(bad_texts / "latin1.txt"), "--out", str(out)])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and "latin1.txt" in err and "not UTF-8" in err
    assert not list(out.rglob("*.npz")) and not list(out.rglob("*.json"))


def test_kld_length_zero_names_its_flag(capsys, tmp_path):
    rc = main(["sweep", "--model", "pair-tiny:diff", "--kld-text", "lambada", "--kld-length", "0", "--out",
               str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert rc == 2 and "--kld-length must be >= 2" in err


def test_huge_layer_ranges_fail_at_once():
    from outlierscope.quant.specs.parts import MAX_LAYERS, parse_layers
    from outlierscope.quant.specs.spec import QuantSpec

    with pytest.raises(ValueError, match="below 65536"):
        parse_layers("0-3000000000")
    with pytest.raises(OutlierscopeError, match="layer indices must be below 65536"):
        QuantSpec.parse("w8a8; layers:0-3000000000")
    with pytest.raises(OutlierscopeError, match="look like 0-3 or 0,2,5"):
        QuantSpec.parse("w8a8; layers:zero")
    assert parse_layers(f"0-{MAX_LAYERS - 1}")[-1] == MAX_LAYERS - 1


@pytest.mark.parametrize("text, says", [("gptq:order=desc,order=none", "sets order twice"),
                                        ("awq:grid=10,grid=20", "sets grid twice"),
                                        ("gptq:damp=0", "0 < X < 1")])
def test_weight_algorithm_settings_given_twice_or_zero_damping(text, says):
    from outlierscope.quant.specs.spec import QuantSpec

    with pytest.raises(OutlierscopeError, match=says):
        QuantSpec.parse(f"w=int4/per_group:64; {text}")


@pytest.mark.parametrize("argv", [
    ["perplexity", "--model", "pair-tiny:diff", "--seed", "-1"],
    ["sweep", "--model", "pair-tiny:diff", "--seed", "-1"],
    ["sensitivity", "--model", "pair-tiny:diff", "--seed", "-1"],
    ["profile", "--model", "pair-tiny:diff", "--seed", str(2**32)],
])
def test_a_negative_or_huge_seed_is_refused_first(argv, capsys, tmp_path):
    rc = main([*argv, "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert rc == 2 and "--seed must be an integer from 0 to 4294967295" in err and not (tmp_path / "o").exists()


def test_rank_agreement_on_a_missing_directory_says_so(tmp_path, capsys):
    from outlierscope.io import read_record

    with pytest.raises(OutlierscopeError, match="the directory does not exist") as e:
        read_record(tmp_path / "nowhere" / "sweep.json", what="sweep record")
    assert "permission" not in str(e.value)


@pytest.mark.parametrize("kw, field", [(dict(rotate=1.5), "rotate"), (dict(smooth=True), "smooth"),
                                       (dict(layers=(0.5,)), "layers"), (dict(calib=" x "), "calib"),
                                       (dict(hadamard=True), "hadamard"), (dict(outliers=math.nan), "outliers"),
                                       (dict(linears=("o_proj ",)), "linears")])
def test_the_constructor_refuses_what_the_text_cannot_say(kw, field):
    from outlierscope.quant.specs.spec import QuantSpec

    with pytest.raises(ParamError) as e:
        QuantSpec(**kw)
    assert e.value.param == field


def test_weight_algorithm_configs_check_their_types():
    from outlierscope.quant.specs.calibrated import AWQConfig, GPTQConfig

    for cfg, kw in ((GPTQConfig, dict(block=1.5)), (GPTQConfig, dict(static=1)), (GPTQConfig, dict(order=3)),
                    (AWQConfig, dict(shrink=True)), (AWQConfig, dict(grid=2.0))):
        with pytest.raises(OutlierscopeError, match="needs"):
            cfg(**kw)


@pytest.mark.parametrize("text", ["w8a8; smooth:0.5; layers:0-3", "k=int4/per_token; rotate:7",
                                  "w=int4/per_group:64; gptq:damp=0.05,order=desc,static; calib:hellaswag",
                                  "w=int4/per_group:64; awq:grid=10,shrink=0.25", "kivi-2bit", "w4a8"])
def test_every_built_spec_reads_back_as_itself(text):
    from outlierscope.quant.specs.spec import QuantSpec

    spec = QuantSpec.parse(text)
    again = QuantSpec(spec.parts, **{k: getattr(spec, k) for k in ("smooth_k", "smooth_q", "hadamard", "layers",
                                                                    "smooth", "rotate", "outliers", "linears",
                                                                    "bnb_outliers", "calib", "gptq", "awq")})
    assert again == spec and QuantSpec.parse(str(again)) == spec


def test_deprecated_names_warn_at_the_users_line():
    import outlierscope

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        outlierscope.AttnQuant  # noqa: B018 - the access is the test
        line = test_deprecated_names_warn_at_the_users_line.__code__.co_firstlineno + 5
    assert [w.filename for w in caught] == [__file__] and caught[0].lineno == line
    assert issubclass(caught[0].category, DeprecationWarning)
    from outlierscope import as_attn_quant  # still resolves, and warns when called

    with pytest.warns(DeprecationWarning, match="as_attn_quant is deprecated"):
        as_attn_quant("w8a8")


def test_compare_perplexity_refuses_runs_of_different_tokenizers(tmp_path):
    from outlierscope.runs.perplexity_compare import check_pairable

    def rec(tok):
        return {"text": {"sha256": "t"}, "settings": {"protocol": "gptq"}, "length": 512, "windows": 4,
                "scored_tokens": 2044, "tokenizer": {"files_sha256": tok}}

    check_pairable(rec("a" * 64), rec("a" * 64), tmp_path / "a", tmp_path / "b")
    with pytest.raises(OutlierscopeError, match="different tokenizers"):
        check_pairable(rec("a" * 64), rec("b" * 64), tmp_path / "a", tmp_path / "b")


def test_gptq_damping_averages_a_contiguous_copy_of_the_diagonal():
    """GPT-QModel (and IST-DASLab's GPTQ, llm-compressor) damp with ``damp * torch.mean(torch.diag(H))``: the mean of
    a contiguous copy. The Hessian (SmolLM2's hidden size) is the first of 64 seeded ones whose strided mean differs from
    the contiguous one in its last bit on this processor (which ones do depends on the processor's summation: about
    half of them on an Intel Xeon and on an AMD EPYC)."""
    import torch

    from outlierscope.quant.weights.gptq import inverse_hessian_factor

    def hessian(seed):
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(256, 576, generator=g) * torch.rand(576, generator=g) * 10
        return x.T @ x  # (576, 576)

    h = next((h for h in map(hessian, range(64)) if torch.mean(h.diagonal()) != torch.mean(torch.diag(h))), None)
    assert h is not None  # the case exists
    ref = h.clone()  # GPT-QModel 7.6's lines, written out
    diag = torch.arange(576)
    ref[diag, diag] += 0.01 * torch.mean(torch.diag(ref))
    ref = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(ref)), upper=True)
    assert torch.equal(inverse_hessian_factor(h, 0.01), ref)


def test_awq_weight_statistic_is_float64_in_a_float64_model():
    """AutoAWQ takes the statistic in the weights' dtype: float64 weights give float64 values equal to a float64
    computation written here (float32 rounding was 1e-7 off, enough to flip a tie on a full-range grid)."""
    import torch

    from outlierscope.quant.weights.awq import weight_mean

    g = torch.Generator().manual_seed(1)
    ws = [torch.randn(48, 64, generator=g, dtype=torch.float64), torch.randn(16, 64, generator=g, dtype=torch.float64)]
    got = weight_mean(ws, 16)
    w = torch.cat(ws).abs().reshape(64, 4, 16)  # (O, I/G, G)
    want = (w / (w.amax(-1, keepdim=True) + 1e-6)).reshape(64, 64).mean(0)  # (I,)
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, want, rtol=1e-15, atol=0)


@pytest.mark.parametrize("kind", ["gptq", "awq"])
def test_calibration_text_too_short_or_fewer_samples_names_the_file(tmp_path, kind):
    """A calibration text shorter than one sequence is a one-line error naming calib:FILE and the seqlen setting; one
    that gives fewer sequences than samples is calibrated on those, with a warning saying how many."""
    from outlierscope.models.loading import load_model
    from outlierscope.quant.specs.spec import QuantSpec
    from outlierscope.quant.weights.sequential import calibration_sequences

    lm = load_model("pair-tiny:transformer")
    short = tmp_path / "short.txt"
    short.write_text("the cat sat")
    spec = QuantSpec.parse(f"w=int4/per_group:32; {kind}:samples=4,seqlen=48; calib:{short}")
    cfg = getattr(spec, kind)
    with pytest.raises(OutlierscopeError) as e:
        calibration_sequences(lm.tokenizer, str(short), cfg, None)
    msg = str(e.value)
    assert f"calib:{short}: too short" in msg and f"{kind}:seqlen=48" in msg and "\n" not in msg
    some = tmp_path / "some.txt"
    some.write_text(" ".join(["the cat sat on the mat"] * 30))  # about 180 tokens: 3 sequences of 48, not 4
    n = len(lm.tokenizer(some.read_text(), add_special_tokens=False)["input_ids"]) + 1  # + EOS after the document
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        seqs = calibration_sequences(lm.tokenizer, str(some), cfg, None)
    assert len(seqs) == n // 48 < 4
    (w,) = [w for w in seen if "fewer than" in str(w.message)]
    assert f"calib:{some} gives {n // 48} sequences of 48 tokens, fewer than {kind}:samples=4" in str(w.message)


def test_under_torchrun_the_error_line_is_what_its_failure_report_shows(tmp_path, monkeypatch, capsys):
    """torchrun's launcher reads each failed worker's TORCHELASTIC_ERROR_FILE: read back by torch's own ProcessFailure,
    the root cause is outlierscope's one line (before: "To enable traceback see: ..." after the line)."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    err = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(err))
    assert main(["sweep", "--model", "pair-tiny:diff", "--bits", "1", "--out", str(tmp_path / "o")]) == 2
    line = capsys.readouterr().err.strip()
    assert line.startswith("outlierscope: error: ") and "--bits" in line
    failure = ProcessFailure(local_rank=0, pid=1, exitcode=2, error_file=str(err))
    report = ChildFailedError("outlierscope", {0: failure}).format_msg()  # what torchrun prints
    assert f"traceback : {line}\n" in report and "To enable traceback" not in report
