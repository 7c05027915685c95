"""Test-only. With this folder on PYTHONPATH, a Python process that imports agentrl's Megatron
trainer applies megatron_cpu_shim right after that import: how tests run megatron-core on CPU in
trainer processes they do not start themselves (the Ray actors of `agentrl train`).
Python imports `sitecustomize` at start-up; this one stands in for the system's (an apport hook)."""

import importlib.abc
import importlib.util
import sys
from pathlib import Path

TRAINER = "agentrl.trainers.megatron.trainer"


class ShimAfterTrainerImport(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != TRAINER:
            return None
        sys.meta_path.remove(self)  # once, and the trainer itself is found the usual way
        spec = importlib.util.find_spec(name)
        exec_trainer = spec.loader.exec_module

        def exec_module(module):
            exec_trainer(module)
            sys.path.append(str(Path(__file__).resolve().parents[1]))
            import megatron_cpu_shim

            megatron_cpu_shim.apply()

        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, ShimAfterTrainerImport())
