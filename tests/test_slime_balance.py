"""slime's --balance-by-flops (and --balance-data's weighing): samples weighed by estimated
forward FLOPs, whose attention term grows with the square of the length, not by token counts.
On a batch that mixes long and short sequences, equal tokens per rank leave the rank with the
long ones far more compute; Karmarkar-Karp on FLOPs brings the peak down. Micro-batches by
FLOPs, as many as the token budget needs, likewise beat first-fit packing by tokens. The flag
passes through the parse and the dry run of a slime script, and needs the token budget, as in
slime; two Megatron data-parallel ranks give the same step with it as without."""

import json
import random
from pathlib import Path

import pytest

from slime_scripts import HF_CONFIGS, checked_in
from test_slime_scripts import hooks_importable, localize, slime  # noqa: F401 (fixtures)

from agentrl.balance import cost_micro_batches, forward_flops, karmarkar_karp
from agentrl.cli import dry_run_checks
from agentrl.config import parse_config
from agentrl.errors import ConfigError

QWEN3_4B = HF_CONFIGS["qwen3-4B"]


def mixed(n: int, seed: int) -> list[int]:
    """Many short sequences and a few near a long response limit (an agent rollout's shape)."""
    rng = random.Random(seed)
    return [rng.randint(12000, 32000) if rng.random() < 0.2 else rng.randint(200, 3000) for _ in range(n)]


def peak(groups: list[list[int]], costs: list[int]) -> int:
    return max(sum(costs[i] for i in g) for g in groups)


def test_the_cost_is_linear_plus_attentions_square():
    c = [forward_flops(n, QWEN3_4B) for n in (1000, 2000, 3000)]
    assert c[1] > 2 * c[0] and c[2] > 1.5 * c[1]  # superlinear
    # the second difference leaves the quadratic term alone: f(3k) - 2 f(2k) + f(1k) = 2a * 1000^2
    # for f = aL^2 + bL, a = 2 * heads * head_dim per layer
    quad = (c[2] - 2 * c[1] + c[0]) / (2 * 1000 ** 2)
    assert quad == pytest.approx(2 * 32 * 128 * 36, rel=1e-3)
    # per token, ~2 x the parameters the matmuls touch (Qwen3-4B: ~4B with the LM head)
    assert 7e9 < forward_flops(1, QWEN3_4B) < 1e10
    moe = HF_CONFIGS["qwen3-30B-A3B"]  # 3B active: the routed experts a token goes to, not all 128
    assert 5e9 < forward_flops(1, moe) < 8e9


@pytest.mark.parametrize("ranks", [2, 4, 8])
def test_flops_balance_lowers_the_busiest_ranks_compute_on_mixed_lengths(ranks):
    """The busiest rank's FLOPs over an even split's (the step waits for that rank): Karmarkar-
    Karp on token counts leaves 1-30 % extra on these batches, on FLOPs under half of that."""
    excess = {"tokens": [], "flops": []}
    for seed in range(10):
        lengths = mixed(64, seed)
        costs = [forward_flops(n, QWEN3_4B) for n in lengths]
        by_tokens, by_flops = karmarkar_karp(lengths, ranks), karmarkar_karp(costs, ranks)
        assert sorted(i for g in by_flops for i in g) == list(range(64))
        even = sum(costs) / ranks
        excess["tokens"].append(peak(by_tokens, costs) / even - 1)
        excess["flops"].append(peak(by_flops, costs) / even - 1)
        assert excess["flops"][-1] < excess["tokens"][-1], seed
    mean = {k: sum(v) / len(v) for k, v in excess.items()}
    print(f"{ranks} ranks, busiest rank over an even split: {mean['tokens']:.2%} balanced by tokens, "
          f"{mean['flops']:.3%} by FLOPs")
    assert mean["flops"] < mean["tokens"] / 2


def test_micro_batches_by_flops_beat_first_fit_by_tokens():
    from agentrl.trainers.megatron.packing import token_budget_batches

    budget = 40000
    gains = []
    for seed in range(10):
        lengths = mixed(24, seed)
        costs = [forward_flops(n, QWEN3_4B) for n in lengths]
        by_flops, by_tokens = cost_micro_batches(costs, lengths, budget), token_budget_batches(lengths, budget)
        assert sorted(i for g in by_flops for i in g) == list(range(24)) and all(by_flops)
        assert len(by_flops) == -(-sum(lengths) // budget)  # as many as the budget needs
        gains.append(peak(by_tokens, costs) / peak(by_flops, costs))
    assert min(gains) > 0.95 and sum(gains) / len(gains) > 1.05, gains
    # no more samples than micro-batches needed: each its own
    assert cost_micro_batches([5, 9], [30000, 30000], budget) == [[0], [1]]
    assert cost_micro_batches([5, 9, 1], [10, 10, 10], budget) == [[0, 1, 2]]


def test_the_flag_passes_the_dry_run_and_needs_the_token_budget(tmp_path, hooks_importable):  # noqa: F811
    args = localize(checked_in("qwen3-4B"), tmp_path, "qwen3-4B")
    cfg, ns = parse_config(args + ["--balance-by-flops"])
    assert cfg.train.balance_by_flops and cfg.train.balance_data and cfg.train.max_tokens_per_gpu
    assert not any("balance" in n for n in ns.slime_notices)  # the Megatron trainer honours it
    dry_run_checks(cfg)
    budget = args.index("--max-tokens-per-gpu")
    without = args[:budget] + args[budget + 2:]
    without.remove("--use-dynamic-batch-size")
    with pytest.raises(ConfigError, match="--balance-by-flops needs --use-dynamic-batch-size with --max-tokens-per-gpu"):
        parse_config(without + ["--balance-by-flops"])
    cfg, ns = parse_config(["--balance-by-flops", "--max-tokens-per-gpu", "100"])  # the torch trainer: one rank
    assert cfg.train.balance_data  # implied, as in slime
    assert any(n.startswith("--balance-data/--balance-by-flops: accepted, no effect here") for n in ns.slime_notices)


@pytest.mark.slow
def test_two_megatron_ranks_give_the_same_step_by_flops(tmp_path, monkeypatch):
    pytest.importorskip("megatron.core")
    monkeypatch.syspath_prepend(str(Path(__file__).parent / "trainers"))
    from megatron_helpers import assert_same_step, run_ranks

    runs = {flops: run_ranks(2, ["--train", json.dumps({"balance_by_flops": flops}), "--max-tokens", "40",
                                 "--algo", json.dumps({"entropy_coef": 0.01})], tmp_path / f"flops_{flops}.json")
            for flops in (False, True)}
    assert_same_step(runs[False], runs[True])
