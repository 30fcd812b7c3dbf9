from __future__ import annotations

import os

from hypothesis import settings

# Ranks share two cores; keep each process to one thread so tests don't thrash.
os.environ.setdefault("OMP_NUM_THREADS", "1")

# CI replays a fixed set of examples (no flaky landings); local runs explore anew.
settings.register_profile("ci", derandomize=True, print_blob=True)
if os.environ.get("CI"):
    settings.load_profile("ci")
