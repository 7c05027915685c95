"""Staging host files for sandboxes (sandboxes/stage.py): once per content, safe to run at once."""

import stat
from concurrent.futures import ThreadPoolExecutor

from agentrl.sandboxes.stage import stage_files


def test_threads_staging_the_same_files_at_once_all_get_the_stage(tmp_path, monkeypatch):
    # a pool's sandboxes start together, each staging the tool servers' files from its own thread:
    # with one temp folder per process they removed each other's copies half-way (FileNotFoundError)
    monkeypatch.setenv("AGENTRL_SANDBOX_DIR", str(tmp_path / "state"))
    src = tmp_path / "src"
    files = {}
    for i in range(200):
        f = src / f"pkg{i % 7}" / f"mod{i}.py"
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text(f"X = {i}\n" * 50)
        files[f"pkg{i % 7}/mod{i}.py"] = f
    files["data.bin"] = b"\x00\x01"
    with ThreadPoolExecutor(16) as pool:
        stages = list(pool.map(lambda _: stage_files(files), range(32)))
    assert len(set(stages)) == 1
    stage = stages[0]
    assert (stage / "pkg3" / "mod3.py").read_text() == "X = 3\n" * 50 and (stage / "data.bin").read_bytes() == b"\x00\x01"
    assert stat.S_IMODE(stage.stat().st_mode) == 0o755
    assert not [p for p in stage.parent.iterdir() if p.name.endswith(".tmp")]  # the losers' copies are gone
