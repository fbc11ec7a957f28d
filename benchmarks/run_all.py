"""Run every benchmark in turn and write its table into BENCHMARKS.md: ``make bench``."""

import os
import subprocess
import sys
from pathlib import Path

here = Path(__file__).parent
for script in ("plan_speed.py", "solver_vs_cbc.py", "paper_table.py", "runtime_accuracy.py",
               "runtime_vs_handwritten.py", "traced_models.py", "recompute.py", "recompute_gap.py", "recompute_vs_megatron.py", "conformance.py",
               "ddp_autocast.py", "sdpa_backends.py"):
    print(f"== {script}", flush=True)
    subprocess.run([sys.executable, str(here / script), "--write"], check=True,
                   env={**os.environ, "OMP_NUM_THREADS": "1"})
