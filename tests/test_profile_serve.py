"""scripts/profile_serve.py folds py-spy's collapsed stacks into the shares it reports."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def load_script():
    spec = importlib.util.spec_from_file_location("profile_serve", ROOT / "scripts" / "profile_serve.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_fold_gives_each_sample_to_its_first_matching_category(tmp_path):
    raw = tmp_path / "worker.txt"
    step = "run (vllm/worker.py:1);execute_model (gpu_model_runner.py:9)"
    raw.write_text("\n".join([
        # the connector's load runs inside execute_model: it counts as the connector
        f"{step};KVConnectorModelRunnerMixin._get_kv_connector_output (m.py:3);start_load_kv (connector.py:5) 3",
        # attention inside the model's forward counts as attention, not as the forward
        f"{step};LlamaModel.forward (llama.py:1);unified_attention_with_output (attention.py:2) 5",
        f"{step};LlamaModel.forward (llama.py:1);RowParallelLinear.forward (linear.py:4) 1",
        "run (vllm/worker.py:1);acquire_read (shm_broadcast.py:8) 1",
        "",
    ]))
    shares = load_script().fold(raw)
    assert shares["connector load (rotate + write)"] == pytest.approx(0.3)
    assert shares["attention"] == pytest.approx(0.5)
    assert shares["linear layers + MLP"] == pytest.approx(0.1)
    assert shares["idle / waiting for the scheduler"] == pytest.approx(0.1)
    assert sum(shares.values()) == pytest.approx(1.0)
