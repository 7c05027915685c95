"""The design card's folders install as subpackages of `agentrl`, so every import starts
with `agentrl` (`envs/` -> `agentrl.envs`, ...). Metadata lives in pyproject.toml.
A package's data/ folder is listed as a package of its own (its files ship through
pyproject's package-data), as setuptools wants data in importable folders to be."""
from pathlib import Path

from setuptools import find_namespace_packages, find_packages, setup

ROOTS = {
    "agentrl": "agentrl",
    "agentrl.envs": "envs",
    "agentrl.tools": "tools",
    "agentrl.sandboxes": "sandboxes",
    "agentrl.trainers": "trainers",
}
packages, package_dir = [], {}
for package, folder in ROOTS.items():
    package_dir[package] = folder
    packages += [package] + [f"{package}.{sub}" for sub in find_packages(folder)]
    packages += [f"{package}.{sub}" for sub in find_namespace_packages(folder, include=["data", "*.data"])
                 if Path(folder, *sub.split(".")).is_dir()]

setup(packages=packages, package_dir=package_dir, include_package_data=True)
