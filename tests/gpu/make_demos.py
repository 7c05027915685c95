"""The SFT scenarios' demonstrations made ahead, on any machine with agentrl (scripts/gpu/build_kit.sh d):
`agentrl demos` for each env of test_learning_gpu.SFT_DEMOS, with the same arguments, into OUT_DIR.
Carried to the GPU (run.sh unpacks them into $AGENTRL_KIT/demos), they spare the device the demos step.

Usage: python tests/gpu/make_demos.py OUT_DIR [ENV ...]
AGENTRL_DEMOS_CONCURRENCY=N: episodes at once (the scenarios' 16-32 suit the GPU machine's 16 cores; a
2-core machine starts that many sandboxed tool servers too slowly)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from test_learning_gpu import SFT_DEMOS  # noqa: E402 (the scenarios' own arguments)


def main(argv: list[str]) -> int:
    """Every env's demonstrations at once (one `agentrl demos` each): on the GPU machine's 16 cores
    code's 512 took 294 s and math-python's 1024 507 s one after the other (2026-12-03)."""
    out = Path(argv[0])
    out.mkdir(parents=True, exist_ok=True)
    concurrency = os.environ.get("AGENTRL_DEMOS_CONCURRENCY")  # the last --concurrency counts
    t0, running = time.time(), {}
    for env in argv[1:] or list(SFT_DEMOS):
        part = out / f"demos_{env}.jsonl.part"
        running[env] = subprocess.Popen([sys.executable, "-m", "agentrl.cli", "demos", "--env", env, *SFT_DEMOS[env],
                                         "--out", str(part), *(["--concurrency", concurrency] if concurrency else [])])
    failed = []
    for env, proc in running.items():
        try:
            rc = proc.wait(timeout=max(1.0, 3600 - (time.time() - t0)))
        except subprocess.TimeoutExpired:
            proc.kill()
            rc = "timed out"
        if rc != 0:
            failed.append(f"{env} ({rc})")
            continue
        path = out / f"demos_{env}.jsonl"
        (out / f"demos_{env}.jsonl.part").replace(path)  # whole or absent: the SFT scenario takes a file it finds as done
        print(f"{env}: {sum(1 for _ in path.open())} demonstrations in {time.time() - t0:.0f} s -> {path}", flush=True)
    if failed:
        print(f"demonstrations failed: {', '.join(failed)}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
