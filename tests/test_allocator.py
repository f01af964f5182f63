"""services.allocator: the process-wide malloc tuning only ever raises its thresholds.
Run in a fresh interpreter, against the real C library (this test process has been tuned
by every Client it made)."""

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

SCRIPT = """
from services import allocator
server = allocator.tune(64 << 20, 256 << 20)
client = allocator.tune(4 << 20, 32 << 20)        # lower: nothing to do
trim = allocator.tune(4 << 20, 512 << 20)         # only the trim threshold grows
print(server, client, trim, allocator.applied() == (64 << 20, 512 << 20))
"""


def test_tune_only_raises_and_glibc_accepts_it():
    done = subprocess.run([sys.executable, "-c", SCRIPT], cwd=REPO, capture_output=True,
                          text=True, timeout=60, check=True)
    assert done.stdout.split() == ["True", "False", "True", "True"]
