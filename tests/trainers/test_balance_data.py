"""--balance-data (slime's): each global batch split across data-parallel ranks by a
Karmarkar-Karp partition of token counts (agentrl/balance.py). On skewed lengths every rank's
token count is within one sample's length of every other's (the in-order split is far off);
and which rank trains a sample changes nothing: two data-parallel ranks give the same loss,
grad norm and updated logprobs with and without it."""

import json
import random

import pytest

from agentrl.balance import karmarkar_karp
from agentrl.config import parse_config
from megatron_helpers import assert_same_step, make_samples, run_ranks


def skewed(n: int, seed: int) -> list[int]:
    """Mostly short responses, a few at the length limit (an agent rollout's usual shape)."""
    rng = random.Random(seed)
    return [rng.randint(2000, 8000) if rng.random() < 0.15 else rng.randint(50, 400) for _ in range(n)]


@pytest.mark.parametrize("parts", [2, 4, 8])
def test_token_counts_per_rank_are_near_equal_on_skewed_lengths(parts):
    for seed in range(20):
        lengths = skewed(64, seed)
        groups = karmarkar_karp(lengths, parts)
        assert sorted(i for g in groups for i in g) == list(range(64)) and all(g == sorted(g) for g in groups)
        loads = [sum(lengths[i] for i in g) for g in groups]
        assert max(loads) - min(loads) <= max(lengths), (seed, loads)
        if seed == 0:  # slime's default, consecutive shares in order, for scale
            size = 64 // parts
            ordered = [sum(lengths[k * size:(k + 1) * size]) for k in range(parts)]
            print(f"{parts} ranks: spread {max(loads) - min(loads)} tokens balanced, "
                  f"{max(ordered) - min(ordered)} in order")
    equal = karmarkar_karp(skewed(64, 0), parts, equal_size=True)
    assert all(len(g) == 64 // parts for g in equal)
    assert karmarkar_karp([5, 4, 3], 4) == [[0], [1], [2], []]  # fewer samples than ranks: a rank gets none
    with pytest.raises(ValueError, match="do not split into"):
        karmarkar_karp([1, 2, 3], 2, equal_size=True)


def test_the_flag_reaches_the_trainer_config():
    assert parse_config(["--balance-data"])[0].train.balance_data
    assert not parse_config([])[0].train.balance_data


@pytest.mark.slow
def test_two_data_parallel_ranks_give_the_same_step_balanced_or_not(tmp_path):
    pytest.importorskip("megatron.core")
    from agentrl.trainers.megatron.packing import balanced_split

    lengths = [len(s.tokens) for s in make_samples()]
    assert karmarkar_karp(lengths, 2) != balanced_split(lengths, 2)  # the ranks do get other samples
    runs = {balance: run_ranks(2, ["--train", json.dumps({"balance_data": balance}), "--max-tokens", "40",
                                   "--algo", json.dumps({"entropy_coef": 0.01})],  # a loss that is not ~0
                               tmp_path / f"balance_{balance}.json")
            for balance in (False, True)}
    assert_same_step(runs[False], runs[True])
