"""The GPU microbenchmark runs tiny on the CPU, on the connector's own code, with only
torch and transformers (the GPU machine it is meant for has nothing else)."""

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "gpu_injection_microbench.py"
PROBE = """
import runpy, sys
sys.argv = [{script!r}, "--tiny", "--device", "cpu", "--dtype", "float32", "--k", "5", "--repeats", "2",
            "--tiers", "device,host"]
runpy.run_path({script!r}, run_name="__main__")
print("IMPORTED " + " ".join(m for m in ("vllm", "chromadb", "sentence_transformers", "langchain_core",
                                          "llama_index") if m in sys.modules))
"""


def test_microbenchmark_times_prefill_and_injection_per_storage_dtype_and_tier_with_only_torch_and_transformers():
    out = subprocess.run([sys.executable, "-c", PROBE.format(script=str(SCRIPT))], capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(next(line for line in out.stdout.splitlines() if line.startswith("RESULT "))[7:])
    assert result["shapes"] == "tiny" and result["tokens"] == 34 + 5 * 31
    assert result["prefill_median_ms"] > 0 and result["inject_median_ms"] > 0
    assert set(result["inject_ms"]) == {f"{s}-{t}" for s in ("auto", "int8", "int4") for t in ("device", "host")}
    assert all(ms > 0 for ms in result["inject_ms"].values())
    # the bytes the facts are stored in shrink with the storage dtype
    assert result["fact_mib"]["int4"] < result["fact_mib"]["int8"] < result["fact_mib"]["auto"]
    assert out.stdout.strip().splitlines()[-1] == "IMPORTED", "the script must need nothing but torch and transformers"


def test_microbenchmark_refuses_bad_arguments():
    out = subprocess.run([sys.executable, str(SCRIPT), "--tiny", "--k", "-1"], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 2 and "--k must be >= 0" in out.stderr
