"""A wheel install (not editable) carries everything agentrl reads at run time: each built-in
env's data and `agentrl inspect`'s templates load from the installed package, not from this
checkout. scripts/setup.sh's editable install prints nothing of setuptools' (no banner, no
'Package would be ignored')."""

import os
import shlex
import shutil
import subprocess
import sys
import textwrap
import zipfile
from importlib import metadata

import pytest

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def copy_of_clone(src: Path) -> None:
    """What a clone has (no egg-info or build/ left by the editable install: their SOURCES.txt
    would smuggle in files the packaging config forgets)."""
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, capture_output=True,
                           text=True, check=True).stdout.split()
    for f in files:
        if (ROOT / f).is_file():
            (src / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / f, src / f)


CHECK = textwrap.dedent("""
    import itertools, sys
    import agentrl
    from agentrl.registry import get_spec, list_envs
    assert agentrl.__file__.startswith(sys.argv[1]), agentrl.__file__
    # agentrl's own envs (tests/test_gym.py may have a third-party package's installed meanwhile)
    names = sorted(s.name for s in list_envs() if not s.source.startswith("entry point of ")
                   or s.source == "entry point of agentrl")
    for name in names:
        cls = get_spec(name).load()
        assert cls.__module__.startswith("agentrl."), cls
        if hasattr(cls, "dataset"):
            tasks = list(itertools.islice(cls.dataset(seed=0), 2))
            assert tasks and all(t.get("prompt") for t in tasks), (name, tasks)
        env = agentrl.make(name)
        env.close()
    print("loaded", " ".join(names))
    # `agentrl inspect` renders its page from the installed templates and static files
    import json, pathlib, tempfile
    from agentrl.inspect import build_report
    run = pathlib.Path(tempfile.mkdtemp()) / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text(json.dumps({"rollout_id": 0, "reward_mean": 0.5}) + "\\n")
    page = build_report(run)[0].read_text()
    assert 'data-key="reward"' in page and "--trained:" in page and "applyFilters" in page, page[:2000]
    print("report rendered")
""")
INSPECT_FILES = ["agentrl/inspect/templates/report.html", "agentrl/inspect/templates/chart.html",
                 "agentrl/inspect/static/report.css", "agentrl/inspect/static/report.js"]


@pytest.mark.timeout(300)
def test_wheel_install_loads_every_builtin_envs_data(tmp_path):
    wheels, site, src = tmp_path / "wheels", tmp_path / "site", tmp_path / "src"
    copy_of_clone(src)
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                            "-w", str(wheels), str(src)], capture_output=True, text=True, timeout=240)
    assert build.returncode == 0, build.stderr[-2000:]
    (wheel,) = wheels.glob("agentrl-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        assert not set(INSPECT_FILES) - set(zf.namelist()), "the inspect report's templates/static files did not ship"
    inst = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site),
                           str(wheel)], capture_output=True, text=True, timeout=120)
    assert inst.returncode == 0, inst.stderr[-2000:]
    # the installed copy comes first on the path (the editable install's finder comes after it)
    env = {"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    proc = subprocess.run([sys.executable, "-c", CHECK, str(site)], capture_output=True, text=True, timeout=120,
                          env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for name in ("search-r1", "code", "math", "target-token"):
        assert name in proc.stdout
    assert "report rendered" in proc.stdout


@pytest.mark.timeout(300)
def test_setups_editable_install_prints_nothing_of_setuptools(tmp_path):
    """The pip line of scripts/setup.sh, run as it is there (its environment, its flags) on a
    copy of the clone, installed under a throwaway prefix (no deps, no build isolation: offline;
    --ignore-installed: pip would otherwise uninstall this venv's agentrl first)."""
    (line,) = [x for x in (ROOT / "scripts" / "setup.sh").read_text().splitlines() if " install -q -e " in x]
    command, env = shlex.split(line), {}
    while "=" in command[0]:  # VAR=value before the command
        key, value = command.pop(0).split("=", 1)
        env[key] = value
    assert command[0].endswith("pip") and command[1:3] == ["install", "-q"], line
    src = tmp_path / "src"
    copy_of_clone(src)
    before = metadata.distribution("agentrl").locate_file("")
    proc = subprocess.run([sys.executable, "-m", "pip", *command[1:], "--no-deps", "--no-build-isolation",
                           "--ignore-installed", "--prefix", str(tmp_path / "prefix")], cwd=src, capture_output=True,
                          text=True, timeout=240, env={**os.environ, **env})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout + proc.stderr == "", proc.stdout + proc.stderr  # setuptools' warnings would show here
    assert metadata.distribution("agentrl").locate_file("") == before  # this venv's install untouched
    assert list((tmp_path / "prefix").glob("lib/python*/site-packages/__editable__*agentrl*"))
