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
    out = Path(argv[0])
    out.mkdir(parents=True, exist_ok=True)
    for env in argv[1:] or list(SFT_DEMOS):
        t0 = time.time()
        path, part = out / f"demos_{env}.jsonl", out / f"demos_{env}.jsonl.part"
        concurrency = os.environ.get("AGENTRL_DEMOS_CONCURRENCY")  # the last --concurrency counts
        subprocess.run([sys.executable, "-m", "agentrl.cli", "demos", "--env", env, *SFT_DEMOS[env], "--out",
                        str(part), *(["--concurrency", concurrency] if concurrency else [])], check=True, timeout=3600)
        part.replace(path)  # whole or absent: the SFT scenario takes a file it finds as done
        print(f"{env}: {sum(1 for _ in path.open())} demonstrations in {time.time() - t0:.0f} s -> {path}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
