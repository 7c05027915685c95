"""Context parallelism on CPU: the split of packed sequences (context_parallel.split), the CP
attention against whole-sequence attention, the refusals, and gloo ranks with
--context-parallel-size 2 (megatron_worker.py) against the one-process trainer on the same
rollout of uneven lengths: the same logprobs, loss, grad norm and logprobs after one optimizer
step, and the same exported HF tensors. CP=2 in the fast lane; CP=2 with token-budget
micro-batches, x TP=2+SP, x PP=2, and x EP=2 on Qwen3-MoE in the e2e lane (more ranks, minutes)."""

import json

import pytest
import torch

pytest.importorskip("agentrl.trainers.megatron.trainer")

import megatron_cpu_shim  # noqa: E402

megatron_cpu_shim.apply()

from agentrl.trainers.megatron import context_parallel  # noqa: E402
from agentrl.trainers.megatron.packing import pack  # noqa: E402
from megatron_helpers import make_samples, one_process_reference, run_ranks  # noqa: E402
from test_megatron_parallel import ALGO, compare  # noqa: E402


def test_split_gives_each_rank_an_early_and_a_late_chunk_of_every_sequence():
    samples = make_samples()
    cp = 2
    whole = pack(samples, [0, 3, 5], seq_pad=2 * cp, pad_to=2 * cp * 2)
    routing = torch.arange(whole.num_tokens * 3 * 2).reshape(whole.num_tokens, 3, 2)  # [T, layers, top-k] (R3)
    parts = []
    for r in range(cp):
        mb = pack(samples, [0, 3, 5], seq_pad=2 * cp, pad_to=2 * cp * 2)
        mb.routing = routing.clone()
        parts.append(context_parallel.split(mb, cp, r, None))
    cu = whole.cu_seqlens.tolist()
    assert all((b - a) % (2 * cp) == 0 for a, b in zip(cu[:-1], cu[1:]))
    # sequence 0 (14 tokens -> 16): chunks of 4; rank 0 has chunks 0 and 3, rank 1 chunks 1 and 2
    assert parts[0].position_ids[0, :8].tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert parts[1].position_ids[0, :8].tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    # every token exactly once over the ranks; every response token's logprob computed on exactly one
    assert sum(p.num_tokens for p in parts) == whole.num_tokens
    got = torch.cat([p.cp.resp_index for p in parts]).sort().values
    assert torch.equal(got, torch.arange(whole.targets.numel()))
    for p in parts:
        assert torch.equal(p.targets, whole.targets[p.cp.resp_index])
        # each response token's logit row: the same position and token as in the whole batch
        rows = whole.logit_index[p.cp.resp_index]
        assert torch.equal(p.position_ids[0, p.logit_index], whole.position_ids[0, rows])
        assert torch.equal(p.tokens[0, p.logit_index], whole.tokens[0, rows])
    # the recorded experts follow their tokens
    for r, p in enumerate(parts):
        rows = torch.cat([torch.arange(a, b) for a, b in context_parallel.chunk_rows(whole.cu_seqlens.tolist(), cp, r)])
        assert torch.equal(p.routing, routing[rows]) and torch.equal(p.tokens[0], whole.tokens[0, rows])
    # the local token count is a multiple of TP (sequence parallelism cuts it again)
    assert all(p.num_tokens % 2 == 0 for p in parts)


def test_split_refuses_sequences_not_padded_for_it():
    with pytest.raises(ValueError, match="multiple of 2 x CP"):
        context_parallel.split(pack(make_samples(), [0, 1]), 2, 0, None)


def test_prefix_attention_matches_whole_sequence_attention():
    """The CP attention's two calls (early chunks, late chunks over their key prefixes), run for
    both ranks with the all-gather done by hand, equal causal attention over whole sequences."""
    from agentrl.trainers.megatron import layers

    samples = make_samples()
    cp, heads, kv_heads, d = 2, 4, 2, 8
    whole = pack(samples, [1, 2, 4], seq_pad=2 * cp)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(whole.num_tokens, h, d, generator=g) for h in (heads, kv_heads, kv_heads))
    ref = torch.cat([layers._sdpa(*(x[a:b].transpose(0, 1)[None] for x in (q, k, v)), 0.0, d ** -0.5)[0]
                     .transpose(0, 1) for a, b in zip(whole.cu_seqlens[:-1].tolist(), whole.cu_seqlens[1:].tolist())])
    shares = [context_parallel.split(pack(samples, [1, 2, 4], seq_pad=2 * cp), cp, r, None).cp for r in range(cp)]
    rows = [torch.cat([torch.arange(a, b) for a, b in context_parallel.chunk_rows(whole.cu_seqlens.tolist(), cp, r)])
            for r in range(cp)]
    k_all, v_all = torch.cat([k[r] for r in rows]), torch.cat([v[r] for r in rows])  # the all-gather
    for r, share in enumerate(shares):
        qr = q[rows[r]]
        outs = [layers._prefix_loop(qr[share.q_rows[h]], k_all[share.kv_rows[h]], v_all[share.kv_rows[h]],
                                    share.cu_q[h], share.cu_k[h], 0.0, d ** -0.5) for h in (0, 1)]
        out = torch.cat(outs)[share.unperm]
        torch.testing.assert_close(out, ref[rows[r]], rtol=1e-5, atol=1e-6)


@pytest.fixture(scope="module")
def reference(tiny_model):
    return one_process_reference(tiny_model, ALGO)


@pytest.mark.slow
def test_context_parallel_2_equals_cp1(reference, tmp_path):
    megatron = {"context_parallel_size": "2"}
    result = run_ranks(2, ["--megatron", json.dumps(megatron), "--algo", json.dumps(ALGO)], tmp_path / "cp2.json")
    compare(result, reference, "CP=2")


@pytest.mark.slow  # ~20-150 s each on a shared CPU
def test_context_parallel_2_with_token_budget_equals_cp1(reference, tmp_path):
    """--max-tokens-per-gpu with CP: micro-batches of several packed sequences, cut per sequence."""
    megatron = {"context_parallel_size": "2"}
    result = run_ranks(2, ["--megatron", json.dumps(megatron), "--algo", json.dumps(ALGO), "--max-tokens", "24"],
                       tmp_path / "cp2b.json")
    compare(result, reference, "CP=2, token budget")


@pytest.mark.slow  # four CPU ranks: ~90 s on a shared two-core machine
def test_context_parallel_2_with_tensor_parallel_2_and_sequence_parallel_equals_cp1(reference, tmp_path):
    megatron = {"context_parallel_size": "2", "tensor_model_parallel_size": "2", "sequence_parallel": None}
    result = run_ranks(4, ["--megatron", json.dumps(megatron), "--algo", json.dumps(ALGO)], tmp_path / "cp2tp2.json")
    compare(result, reference, "CP=2 x TP=2 + SP")


@pytest.mark.slow  # four CPU ranks
def test_context_parallel_2_with_pipeline_parallel_2_equals_cp1(reference, tmp_path):
    megatron = {"context_parallel_size": "2", "pipeline_model_parallel_size": "2"}
    result = run_ranks(4, ["--megatron", json.dumps(megatron), "--algo", json.dumps(ALGO), "--max-tokens", "40"],
                       tmp_path / "cp2pp2.json", timeout=400)
    compare(result, reference, "CP=2 x PP=2")


@pytest.mark.slow
def test_context_parallel_2_with_expert_parallel_2_on_qwen3_moe_equals_one_process(tiny_model, tmp_path):
    """Qwen3-MoE (8 experts, top-2): EP=2 spans the two CP ranks (megatron-core folds EP over DP x CP)."""
    from megatron_helpers import tiny_family_model

    model = tiny_family_model(tmp_path / "qwen3_moe", "qwen3_moe", tokenizer_from=tiny_model)
    args = ["--model", str(model), "--algo", json.dumps(ALGO)]
    one = run_ranks(1, args, tmp_path / "moe1.json")
    megatron = {"context_parallel_size": "2", "expert_model_parallel_size": "2"}
    compare(run_ranks(2, [*args, "--megatron", json.dumps(megatron)], tmp_path / "moecp2.json"), one, "MoE CP=2 x EP=2")


def test_context_parallel_forms_it_does_not_do_are_refused_by_name():
    from agentrl.errors import ConfigError
    from agentrl.trainers.megatron.args import parse_megatron_args

    parse_megatron_args({"--context-parallel-size": "2", "--cp-comm-type": "all_gather"}).check_context_parallel(False)
    with pytest.raises(ConfigError, match="--transformer-impl local"):
        parse_megatron_args({"--context-parallel-size": "2"}).check_context_parallel(True)
    with pytest.raises(ConfigError, match="--cp-comm-type p2p"):
        parse_megatron_args({"--context-parallel-size": "2", "--cp-comm-type": "p2p"}).check_context_parallel(False)
    with pytest.raises(ConfigError, match="--hierarchical-context-parallel-sizes"):
        parse_megatron_args({"--context-parallel-size": "4",
                             "--hierarchical-context-parallel-sizes": "2 2"}).check_context_parallel(False)
    parse_megatron_args({"--cp-comm-type": "p2p"}).check_context_parallel(True)  # CP 1: nothing to refuse


@pytest.mark.slow
@pytest.mark.parametrize("megatron", [{"context_parallel_size": "2"}, {}], ids=["CP=2", "DP=2"])
def test_ppo_critic_with_context_or_data_parallel_equals_one_process(tmp_path, megatron):
    """The critic's values gathered over CP ranks; its fresh value head the same on every rank
    (each rank drew its own before: DP=2's critic then differed from one process's)."""
    algo = json.dumps({**ALGO, "advantage_estimator": "ppo"})
    one = run_ranks(1, ["--algo", algo], tmp_path / "ppo1.json")
    two = run_ranks(2, ["--algo", algo, "--megatron", json.dumps(megatron)], tmp_path / "ppo2.json")
    compare(two, one, f"PPO {megatron}")
    for key in ("value_loss", "critic_grad_norm"):
        assert two["metrics"][key] == pytest.approx(one["metrics"][key], rel=1e-5), key
