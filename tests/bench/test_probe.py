"""The forward-cost probe's accounting (no timing is asserted)."""

from tiny_models import KERNEL_FRIENDLY, tiny_llama

from fastdecode.backends import make_target
from fastdecode.backends.base import PagedSequence
from fastdecode.bench.probe import ForwardCost, forward_cost


def _model(tied):
    return tiny_llama(0, **KERNEL_FRIENDLY, tie_word_embeddings=tied)


def test_weight_bytes_agree_across_backends_and_shrink_with_precision():
    for tied in (False, True):
        model = _model(tied)
        params = sum(p.numel() * 4 for p in model.parameters())  # parameters() yields a tied tensor once
        embed = model.model.embed_tokens.weight.numel() * 4
        expected = params if tied else params - embed
        assert make_target(model, "hf").weight_bytes() == expected
        assert make_target(model, "native").weight_bytes() == expected
        int8 = make_target(model, "native", "int8").weight_bytes()
        int4 = make_target(model, "native", "int4").weight_bytes()
        assert int4 < int8 < expected / 2


def test_forward_cost_restores_nothing_and_reports_positive_times():
    model = _model(False)
    target = make_target(model, "native")
    sequence = PagedSequence(target)
    cost = forward_cost(sequence, "float32", context=16, repeats=3)
    assert isinstance(cost, ForwardCost) and cost.forward_1_ms > 0 and cost.forward_8_ms > 0
    assert cost.weight_bytes == target.weight_bytes()
    assert sequence.cache_len == 16 + 8


def test_probe_cli_times_the_cache_type_asked_for_on_native_targets_only(tmp_path):
    from tiny_models import save_tiny_llama

    from fastdecode.cli import main

    model_dir = save_tiny_llama(tmp_path / "model")
    out = tmp_path / "probe.md"
    assert (
        main(
            [
                "probe",
                "--model",
                str(model_dir),
                "--backend",
                "hf,native",
                "--weights",
                "float",
                "--kv-cache-dtype",
                "float16",
                "--markdown",
                str(out),
            ]
        )
        == 0
    )
    text = out.read_text()
    assert "float16 KV cache" in text
    rows = [line for line in text.splitlines() if line.startswith("| native") or line.startswith("| hf")]
    assert [row.split("|")[1].strip() for row in rows] == ["native"]  # transformers keeps the model's dtype: no hf row
