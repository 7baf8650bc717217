"""Benchmark mode names (``inferscale bench quality`` and ``latency``): the text tail."""

from __future__ import annotations

import pytest


def test_benchmark_modes_name_a_text_tail():
    """``inject-w5-tail2`` (bench quality and latency): encoded KV at w=5, the 2 best memories as text."""
    from inferscale.bench import latency, quality

    assert quality.parse_mode("inject-w5-tail2") == ("inject", 5) and quality.text_tail_of("inject-w5-tail2") == 2
    assert latency.parse_mode("inject-w5-tail2") == ("inject", 5) and quality.text_tail_of("inject-w20") == 0
    for bad in ("inject-w5-tail", "inject-w5-tailx", "inject-w-tail2", "text-tail1"):
        with pytest.raises(ValueError, match="tail<M>"):
            quality.parse_mode(bad)
        with pytest.raises(ValueError, match="tail<M>"):
            latency.parse_mode(bad)


def test_benchmark_modes_name_a_memory_order():
    """``-bestfirst`` ends any mode (bench quality and latency): the best memory first, not last."""
    from inferscale.bench import latency, quality

    assert quality.parse_mode("inject-w5-bestfirst") == ("inject", 5)
    assert quality.memory_order_of("inject-w5-bestfirst") == "best_first"
    assert quality.memory_order_of("inject-w5") == "best_last"
    assert quality.parse_mode("text-bestfirst") == ("text", None) and latency.parse_mode("text-bestfirst") == ("text", 0)
    assert quality.text_tail_of("inject-w5-tail2-bestfirst") == 2
    assert latency.parse_mode("inject-w20-bestfirst") == ("inject", 20)
    for bad in ("inject-w5-bestlast", "bestfirst", "inject-w5-bestfirst-tail2"):
        with pytest.raises(ValueError, match="bestfirst"):
            quality.parse_mode(bad)
    with pytest.raises(ValueError, match="latency benchmark"):
        latency.parse_mode("captured")
