"""Start to model ready, with the model cached: a fresh interpreter, from launch to the moment it says ready."""

from __future__ import annotations

import subprocess
import sys
import time

from pagedchat.bench.options import BenchError

TIMEOUT_S = 300
# What a probe prints once its model is ready: the wall clock then, which the parent subtracts its launch from.
READY = 'print("ready", repr(__import__("time").time()), flush=True)'

# pagedchat's probe: the imports and Engine() a chat program pays before its first request.
ENGINE_READY = f"""\
import json, sys
from pagedchat.engine.engine import Engine
engine = Engine(**json.loads(sys.argv[1]))
{READY}
engine.shutdown()
"""


def time_to_ready(args: list[str]) -> float:
    """Seconds from launching `python *args` until it prints its ready line (what follows is not timed)."""
    launched = time.time()
    try:
        done = subprocess.run([sys.executable, *args], capture_output=True, text=True, stdin=subprocess.DEVNULL,
                              timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise BenchError(f"the startup probe did not finish in {TIMEOUT_S} s") from None
    words = (done.stdout.strip().splitlines() or [""])[0].split()
    if done.returncode != 0 or len(words) != 2 or words[0] != "ready":
        last = (done.stderr.strip().splitlines() or [done.stdout.strip() or "no output"])[-1]
        raise BenchError(f"the startup probe failed: {last}")
    return float(words[1]) - launched
