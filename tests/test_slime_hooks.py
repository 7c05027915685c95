"""slime's rollout hooks: --custom-generate-function-path and --rollout-function-path with
functions written as for slime (HTTP /generate at args.sglang_router_ip/port), through the
real CLI on the embedded engine; and wrongly shaped functions named in the error."""

import asyncio
import json
import subprocess

import pytest

from spine_helpers import agentrl_cli, run_env

SMALL = ["--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--global-batch-size", "4",
         "--rollout-max-response-len", "12", "--no-progress"]

# A multi-part answer as a slime agent writes one: generated tokens set directly, a masked
# "tool output" of 3 tokens, then generated tokens again through append_response_tokens.
GENERATE = '''
import aiohttp

async def post(args, payload):
    url = f"http://{args.sglang_router_ip}:{args.sglang_router_port}/generate"
    async with aiohttp.ClientSession() as session:
        async with session.post(url, json=payload) as resp:
            return await resp.json()

async def generate(args, sample, sampling_params):
    assert sample.status == sample.Status.PENDING and sample.response_length == 0
    first = dict(sampling_params, max_new_tokens=5, stop_token_ids=[], ignore_eos=True)
    out = await post(args, {"input_ids": sample.tokens, "sampling_params": first, "return_logprob": True})
    pairs = out["meta_info"]["output_token_logprobs"]
    sample.tokens = sample.tokens + [p[1] for p in pairs]
    sample.response_length = len(pairs)
    sample.loss_mask = [1] * len(pairs)
    sample.rollout_log_probs = [p[0] for p in pairs]
    sample.response = out["text"]
    sample.append_response_tokens(args, tokens=sample.tokens[:3], trainable=False)  # the "tool output"
    rest = dict(first, max_new_tokens=sampling_params["max_new_tokens"] - sample.response_length)
    out = await post(args, {"input_ids": sample.tokens, "sampling_params": rest, "return_logprob": True})
    pairs = out["meta_info"]["output_token_logprobs"]
    sample.append_response_tokens(args, tokens=[p[1] for p in pairs], log_probs=[p[0] for p in pairs],
                                  meta_info=out["meta_info"], text=out["text"])
    sample.metadata.update(max_new_tokens=sampling_params["max_new_tokens"], n=args.n_samples_per_prompt,
                           model=args.hf_checkpoint)
    return sample
'''

# slime's rollout function: sync, runs its own event loop, sends text (as slime's examples do).
ROLLOUT = '''
import asyncio
import aiohttp

def generate_rollout(args, rollout_id, data_source, evaluation=False):
    assert not evaluation
    groups = data_source.get_samples(args.rollout_batch_size)
    url = f"http://{args.sglang_router_ip}:{args.sglang_router_port}/generate"

    async def one(session, k, sample):
        params = {"temperature": args.rollout_temperature, "max_new_tokens": args.rollout_max_response_len}
        async with session.post(url, json={"text": sample.prompt, "sampling_params": params,
                                           "return_logprob": True}) as resp:
            out = await resp.json()
        pairs = out["meta_info"]["output_token_logprobs"]
        sample.append_response_tokens(args, tokens=[p[1] for p in pairs], log_probs=[p[0] for p in pairs],
                                      meta_info=out["meta_info"], text=out["text"])
        if k == 0:
            sample.reward = 0.25  # a reward the function gives is kept; the others are the env's

    async def run():
        async with aiohttp.ClientSession() as session:
            await asyncio.gather(*[one(session, k, s) for group in groups for k, s in enumerate(group)])

    asyncio.run(run())
    return groups
'''


def train(*args):
    return subprocess.run([agentrl_cli(), "train", *args], capture_output=True, text=True, timeout=600,
                          env=run_env())


def rows(path):
    return [json.loads(x) for x in path.read_text().splitlines()]


@pytest.mark.e2e
def test_custom_generate_function_trains_with_its_masks_and_logprobs(tmp_path):
    fn = tmp_path / "my_generate.py"
    fn.write_text(GENERATE)
    out = tmp_path / "run"
    proc = train("--custom-generate-function-path", f"{fn}:generate", "--num-rollout", "2", "--output-dir", str(out),
                 *SMALL)
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = rows(out / "metrics.jsonl")
    assert [m["rollout_id"] for m in metrics] == [0, 1] and metrics[-1]["policy_version"] == 2
    # the trainer recomputed the logprobs of exactly the trained tokens: they match the engine's
    assert metrics[0]["train_rollout_logprob_abs_diff"] < 1e-3 and abs(metrics[0]["ppo_kl"]) < 1e-4
    for it in (0, 1):
        traj = rows(out / "trajectories" / f"rollout_{it:05d}.jsonl")
        assert len(traj) == 4 and len({t["group_id"] for t in traj}) == 2
        for t in traj:
            n = len(t["response_tokens"])
            assert n == 12 and t["metadata"]["max_new_tokens"] == 12 and t["metadata"]["n"] == 2
            assert t["loss_mask"] == [1] * 5 + [0] * 3 + [1] * 4
            assert t["response_tokens"][5:8] == t["prompt_tokens"][:3]  # the masked "tool output"
            assert all(lp == 0.0 for lp in t["rollout_logprobs"][5:8])
            assert all(lp < 0 for lp, m in zip(t["rollout_logprobs"], t["loss_mask"]) if m)
            # every trained token carries the weights it was sampled with
            assert set(v for v, m in zip(t["policy_versions"], t["loss_mask"]) if m) == {it}
            assert t["status"] in ("completed", "truncated") and isinstance(t["reward"], float)
            assert t["metadata"]["label"] and t["prompt_text"].count("Repeat the word:") == 1


@pytest.mark.e2e
def test_rollout_function_drives_the_run(tmp_path):
    fn = tmp_path / "my_rollout.py"
    fn.write_text(ROLLOUT)
    out = tmp_path / "run"
    proc = train("--rollout-function-path", f"{fn}:generate_rollout", "--num-rollout", "2",
                 "--output-dir", str(out), *SMALL)
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = rows(out / "metrics.jsonl")
    assert [m["rollout_id"] for m in metrics] == [0, 1]
    assert metrics[0]["train_rollout_logprob_abs_diff"] < 1e-3
    for it in (0, 1):
        traj = rows(out / "trajectories" / f"rollout_{it:05d}.jsonl")
        assert len(traj) == 4
        groups = [[t for t in traj if t["group_id"] == g] for g in sorted({t["group_id"] for t in traj})]
        assert [len(g) for g in groups] == [2, 2]
        for group in groups:
            assert group[0]["reward"] == 0.25  # given by the function
            assert group[0]["prompt_tokens"] == group[1]["prompt_tokens"]
            assert all(t["loss_mask"] == [1] * len(t["response_tokens"]) for t in group)
            assert {v for t in group for v in t["policy_versions"]} == {it}
    state = json.loads((out / "checkpoints" / "iter_000002" / "trainer_state.json").read_text())
    assert state["data"]["consumed"] == 4  # the data source advanced the run's data position


@pytest.mark.e2e
def test_wrongly_shaped_functions_are_named(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("def generate(sample):\n    return sample\n\ndef rollout(args):\n    return []\n")
    proc = train("--custom-generate-function-path", f"{bad}:generate", "--output-dir", str(tmp_path / "a"), *SMALL)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert f"--custom-generate-function-path {bad}:generate: generate(sample) does not take slime's arguments " \
           "(args, sample, sampling_params)" in proc.stderr
    proc = train("--rollout-function-path", f"{bad}:rollout", "--output-dir", str(tmp_path / "b"), *SMALL)
    assert proc.returncode == 2 and "--rollout-function-path" in proc.stderr and "rollout(args)" in proc.stderr


def test_wrong_returns_are_named(tokenizer, tmp_path):
    from agentrl.data import PromptSource
    from agentrl.errors import ConfigError
    from agentrl.rollout.agent_loop import Renderer
    from agentrl.rollout.slime import DataSource, RolloutHook, Sample, SlimeArgs, to_agentrl

    renderer = Renderer(tokenizer)
    where = "--custom-generate-function-path x.py:gen"
    kw = dict(where=where, trajectory_id="g0-s0", group_id=0, env_name="target-token", version=0, renderer=renderer)
    with pytest.raises(ConfigError, match=r"x.py:gen returned dict, not a slime Sample"):
        to_agentrl({"tokens": [1, 2]}, **kw)
    s = Sample(tokens=[5, 6, 7, 8], response_length=2, loss_mask=[1], rollout_log_probs=[-1.0, -1.0])
    with pytest.raises(ConfigError, match="x.py:gen: sample g0-s0: loss_mask has 1 entries"):
        to_agentrl(s, **kw)
    s.loss_mask, s.rollout_log_probs = [1, 1], None
    with pytest.raises(ConfigError, match="no rollout_log_probs for its trained tokens"):
        to_agentrl(s, **kw)
    s.rollout_log_probs, s.status = [-0.5, -1.5], Sample.Status.TRUNCATED
    done = to_agentrl(s, **kw)
    assert done.prompt_tokens == [5, 6] and done.response_tokens == [7, 8] and done.status.value == "truncated"

    fns = tmp_path / "r.py"
    fns.write_text("def a_dict(args, rollout_id, data_source):\n    return {'samples': 1}\n\n"
                   "def three(args, rollout_id, data_source):\n"
                   "    return [s for g in data_source.get_samples(2) for s in g][:3]\n")
    args = SlimeArgs(n_samples_per_prompt=2, env="target-token")

    def returns(name):
        hook = RolloutHook(f"{fns}:{name}", args=args, renderer=renderer, make_env=None, reward_fn=None, run_seed=0,
                           data_source=DataSource(PromptSource([{"prompt": "Repeat: of"}]), renderer, 2))
        return asyncio.run(hook.next_batch(0, 0))

    with pytest.raises(ConfigError, match=r"r.py:a_dict returned dict; expected slime's list\[list\[Sample\]\]"):
        returns("a_dict")
    with pytest.raises(ConfigError, match="flat list of 3 samples, not a multiple of --n-samples-per-prompt"):
        returns("three")
    with pytest.raises(AttributeError, match="slime's argument 'sglang_dp_sz' has no agentrl counterpart"):
        args.sglang_dp_sz


# -- slime's shapes without slime installed ---------------------------------------------------------
def test_stand_in_sample_follows_slimes_append_response_tokens():
    """slime/utils/types.py at 624b824: non-trainable tokens take no logprobs; meta_info sets the
    status and weight version only with update_terminal_info; finish_reason is {"type": ...}."""
    from agentrl.errors import SampleInvariantError
    from agentrl.rollout.slime import Sample

    s = Sample(tokens=[1, 2])
    s.append_response_tokens(None, tokens=[3, 4], log_probs=[-0.5, -0.25], text="ab",
                             meta_info={"finish_reason": {"type": "length"}, "weight_version": "3"},
                             update_terminal_info=False)
    assert s.status == Sample.Status.PENDING and s.weight_versions == []
    s.append_response_tokens(None, tokens=[5], trainable=False)
    s.append_response_tokens(None, tokens=[6], log_probs=[-1.0], text="c",
                             meta_info={"finish_reason": {"type": "stop"}, "weight_version": "3"})
    assert (s.tokens, s.response, s.response_length) == ([1, 2, 3, 4, 5, 6], "abc", 4)
    assert s.loss_mask == [1, 1, 0, 1] and s.rollout_log_probs == [-0.5, -0.25, 0.0, -1.0]
    assert s.status == Sample.Status.COMPLETED and s.weight_versions == ["3"]
    with pytest.raises(SampleInvariantError, match="non-trainable"):
        s.append_response_tokens(None, tokens=[7], log_probs=[-1.0], trainable=False)
    with pytest.raises(SampleInvariantError, match="need their rollout log_probs"):
        s.append_response_tokens(None, tokens=[7])


def test_args_and_sampling_params_carry_what_slimes_rollout_reads():
    """The fields slime's sglang_rollout.py / http_utils.py read, and GenerateState's params."""
    from agentrl.config import Config
    from agentrl.rollout.slime import slime_args, slime_sampling_params

    args = slime_args(Config(), engine_url="http://127.0.0.1:30123", model_path="/m")
    assert (args.sglang_router_ip, args.sglang_router_port, args.hf_checkpoint) == ("127.0.0.1", 30123, "/m")
    engines = args.rollout_num_gpus // args.rollout_num_gpus_per_engine  # slime's get_rollout_num_engines
    assert engines == 1 and args.sglang_server_concurrency * engines > 0  # slime's semaphore size
    cfg = Config().model_copy(update={"rollout": Config().rollout.model_copy(
        update={"rollout_num_gpus": 4, "rollout_num_gpus_per_engine": 1, "max_concurrency": 256})})
    four = slime_args(cfg, engine_url="http://127.0.0.1:30123", model_path="/m")
    # slime's semaphore (concurrency x engines) is the run's --max-concurrency, not 4x it
    assert four.sglang_server_concurrency * four.rollout_num_gpus // four.rollout_num_gpus_per_engine == 256
    for name in ("partial_rollout", "mask_offpolicy_in_partial_rollout", "use_distributed_post", "group_rm",
                 "rollout_global_dataset", "over_sampling_batch_size", "dynamic_sampling_filter_path",
                 "rollout_sample_filter_path", "rollout_all_samples_process_path", "custom_rm_path", "rm_type",
                 "rollout_temperature", "rollout_top_p", "rollout_top_k", "rollout_max_response_len"):
        getattr(args, name)  # present (AttributeError otherwise)
    params = slime_sampling_params(args, {"temperature": 1.0, "top_p": 1.0, "top_k": -1}, 16)
    assert params["no_stop_trim"] is True and params["skip_special_tokens"] is False
    assert params["spaces_between_special_tokens"] is False and params["max_new_tokens"] == 16
    with pytest.raises(AttributeError, match="no agentrl counterpart"):
        args.no_such_slime_flag
    # slime's model name -> router (its get_model_url): the run's one model, at the URL rollouts use
    assert args.sglang_model_routers == {"default": ("127.0.0.1", 30123)}
    named = cfg.model_copy(update={"rollout": cfg.rollout.model_copy(update={"engine_model_name": "actor"})})
    assert slime_args(named, engine_url="http://127.0.0.1:4000", model_path="/m").sglang_model_routers == {
        "actor": ("127.0.0.1", 4000)}


def test_async_calls_the_rollout_function_for_the_next_batch_while_this_one_trains(tokenizer, tmp_path):
    """slime's train_async.py: generate(rollout_id + 1) starts before training on rollout_id;
    agentrl's --async with --rollout-function-path does the same."""
    import time

    from agentrl.batches import rollout_metrics
    from agentrl.config import parse_config
    from agentrl.data import PromptSource
    from agentrl.rollout.agent_loop import Renderer
    from agentrl.rollout.slime import DataSource, RolloutHook, SlimeArgs

    fns = tmp_path / "r.py"
    fns.write_text("import time\n\nCALLS = []\n\n"
                   "def rollout(args, rollout_id, data_source):\n"
                   "    CALLS.append(rollout_id)\n"
                   "    time.sleep(0.1)  # its requests\n"
                   "    groups = data_source.get_samples(1)\n"
                   "    for s in groups[0]:\n"
                   "        s.tokens, s.response_length, s.loss_mask = s.tokens + [5, 6], 2, [1, 1]\n"
                   "        s.rollout_log_probs, s.reward, s.status = [-1.0, -1.0], 1.0, type(s).Status.COMPLETED\n"
                   "    return groups\n")
    renderer = Renderer(tokenizer)

    def run(async_rollout: bool) -> list[list[int]]:
        hook = RolloutHook(f"{fns}:rollout", args=SlimeArgs(n_samples_per_prompt=2, env="target-token",
                                                            async_rollout=async_rollout, num_rollout=3),
                           renderer=renderer, make_env=None, reward_fn=None, run_seed=0,
                           data_source=DataSource(PromptSource([{"prompt": "Repeat: of"}] * 4), renderer, 2))
        calls = hook.fn.__globals__["CALLS"]
        seen = []

        async def loop():
            for rollout_id in range(3):
                t0 = time.perf_counter()
                batch = await hook.next_batch(rollout_id, rollout_id)
                m = rollout_metrics(rollout_id, batch, time.perf_counter() - t0)
                # tok/s over the call's span (0.1 s), also when the call ran ahead and the wait was ~0 (#34)
                assert 0.1 <= m["generation_span_s"] < 0.3 and m["tokens_per_s"] <= 4 / 0.1, m
                if async_rollout and rollout_id:
                    assert m["rollout_s"] < 0.05, m
                assert len(batch) == 2 and all(s.reward == 1.0 for s in batch)
                await asyncio.sleep(0.3)  # "training": the prefetched call runs meanwhile
                seen.append(list(calls))

        asyncio.run(loop())
        calls.clear()
        return seen

    assert run(async_rollout=True) == [[0, 1], [0, 1, 2], [0, 1, 2]]  # one ahead, none past the last
    assert run(async_rollout=False) == [[0], [0, 1], [0, 1, 2]]
    cfg, _ = parse_config(["--async", "--rollout-function-path", f"{fns}:rollout", "--num-rollout", "2"])
    assert cfg.rollout.async_rollout  # no longer refused
