"""The design card's folders install as subpackages of `agentrl`, so every import starts
with `agentrl` (`envs/` -> `agentrl.envs`, ...). Metadata lives in pyproject.toml."""
from setuptools import find_packages, setup

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

setup(packages=packages, package_dir=package_dir, include_package_data=True)
