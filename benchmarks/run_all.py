"""Run every benchmark in turn: ``make bench``."""

import subprocess
import sys
from pathlib import Path

here = Path(__file__).parent
for script in ("plan_speed.py", "solver_vs_cbc.py"):
    print(f"== {script}", flush=True)
    subprocess.run([sys.executable, str(here / script)], check=True)
