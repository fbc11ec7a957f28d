"""``benchmarks/gpu_calibration.py`` runs (here on the CPU, at toy sizes) and writes a hardware
file ``--hardware`` loads and a per-op table of predicted and measured times."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from memshard.core.hardware import load_hardware

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_calibration.py"


def test_the_calibration_writes_a_loadable_device_and_its_op_table(tmp_path):
    out, table = tmp_path / "calibration.json", tmp_path / "ops.json"
    done = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--gpu", "a100-80gb", "--out", str(out),
                           "--table", str(table)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    hardware = load_hardware(str(out))
    assert hardware.name == "a100-80gb-measured" and hardware.peak_flops == 312e12
    assert 0 < hardware.matmul_efficiency <= 1 and 0 < hardware.memory_efficiency <= 1
    ops = json.loads(table.read_text())["ops"]
    kinds = {row["kind"] for row in ops}
    assert {"linear", "matmul", "layernorm", "rmsnorm", "softmax", "silu"} <= kinds
    assert {row["tp"] for row in ops} == {1, 2}
    assert all(len(row["predicted_s"]) == 2 and min(row["predicted_s"]) > 0 and min(row["measured_s"]) > 0
               for row in ops)
