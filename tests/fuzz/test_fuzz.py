"""The short fuzz run of issue 31: each target of fuzz_targets.py for a few seconds, with a fixed
seed (hypothesis derandomized). The long run: python bench/fuzz.py --minutes N."""

import pytest

from fuzz_targets import FACTORIES, run_target, target


@pytest.mark.parametrize("name", list(FACTORIES))
@pytest.mark.slow
def test_fuzz(name):
    t = target(name)
    run_target(t, max_examples=t.suite_examples)
