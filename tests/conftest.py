from __future__ import annotations

import os

# Ranks share two cores; keep each process to one thread so tests don't thrash.
os.environ.setdefault("OMP_NUM_THREADS", "1")
