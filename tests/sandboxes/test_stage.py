"""Staging host files for sandboxes (sandboxes/stage.py): once per content, safe to run at once."""

import os
import stat
import subprocess
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
    try:
        with ThreadPoolExecutor(16) as pool:
            stages = list(pool.map(lambda _: stage_files(files), range(32)))
        _check(stages)
    finally:  # as root the stages are a tmpfs (stage_root): not left mounted in pytest's folder
        if os.path.ismount(tmp_path / "agentrl-stages"):
            subprocess.run(["umount", "-l", str(tmp_path / "agentrl-stages")], check=True)


def test_stages_are_a_tmpfs_of_their_own_as_root(tmp_path, monkeypatch):
    """As root the staged folders live in one tmpfs (mounted once, under a lock), so a sandbox's
    mountinfo names them "/<hash>" of a filesystem "stage", never by their host path."""
    if os.geteuid() != 0:
        import pytest
        pytest.skip("unprivileged: the stages are a plain folder")
    monkeypatch.setenv("AGENTRL_SANDBOX_DIR", str(tmp_path / "state"))
    try:
        with ThreadPoolExecutor(8) as pool:
            stages = set(pool.map(lambda i: stage_files({"a.py": b"A = %d\n" % (i % 2)}), range(16)))
        assert len(stages) == 2 and {s.parent for s in stages} == {tmp_path / "agentrl-stages"}
        mounts = [line.split() for line in open("/proc/self/mountinfo")]
        ours = [m for m in mounts if m[4] == str(tmp_path / "agentrl-stages")]
        assert len(ours) == 1 and ours[0][3] == "/" and ours[0][-3:-1] == ["tmpfs", "stage"], ours
    finally:
        if os.path.ismount(tmp_path / "agentrl-stages"):
            subprocess.run(["umount", "-l", str(tmp_path / "agentrl-stages")], check=True)


def _check(stages):
    assert len(set(stages)) == 1
    stage = stages[0]
    assert (stage / "pkg3" / "mod3.py").read_text() == "X = 3\n" * 50 and (stage / "data.bin").read_bytes() == b"\x00\x01"
    assert stat.S_IMODE(stage.stat().st_mode) == 0o755
    assert not [p for p in stage.parent.iterdir() if p.name.endswith(".tmp")]  # the losers' copies are gone
