"""Placement of trainer ranks and engines: which GPU slots each gets (disjoint, colocated,
shared, CPU), and a real placement group reserved on a local Ray with fake GPUs, engine
servers owned by Ray actors."""

import os
import urllib.request

import pytest

from agentrl.config import parse_config
from agentrl.errors import ConfigError
from agentrl.cluster.placement import CPU_SLICE, plan_placement


def slots(gpus):
    return {g for gs in gpus for g in gs}


def test_disjoint_gpus_for_trainer_and_engines():
    # --actor-num-nodes 2 --actor-num-gpus-per-node 2 --rollout-num-gpus 4 --rollout-num-gpus-per-engine 2
    p = plan_placement(gpus=8, trainer_ranks=4, trainer_on_gpu=True, num_engines=2, gpus_per_engine=2,
                       rollout_gpus=4, colocate=False)
    assert p.trainer_gpus == [[0], [1], [2], [3]] and p.engine_gpus == [[4, 5], [6, 7]]
    assert not slots(p.trainer_gpus) & slots(p.engine_gpus)
    assert p.bundles == [{"GPU": 1.0, "CPU": CPU_SLICE}] * 8
    assert p.engine_bundles == [4, 6] and p.trainer_bundles == [0, 1, 2, 3]
    assert not any(p.shares(b) for b in p.trainer_bundles)
    # the rollout GPUs default to what the trainer leaves
    p = plan_placement(gpus=4, trainer_ranks=1, trainer_on_gpu=True, num_engines=3, gpus_per_engine=1,
                       rollout_gpus=None, colocate=False)
    assert p.trainer_gpus == [[0]] and p.engine_gpus == [[1], [2], [3]]


def test_colocated_engines_share_the_trainers_gpus():
    p = plan_placement(gpus=4, trainer_ranks=4, trainer_on_gpu=True, num_engines=2, gpus_per_engine=2,
                       rollout_gpus=None, colocate=True)
    assert p.engine_gpus == [[0, 1], [2, 3]] and slots(p.engine_gpus) == slots(p.trainer_gpus)
    assert len(p.bundles) == 4 and all(p.shares(b) for b in p.trainer_bundles)


def test_more_engines_than_gpus_share_them_and_too_few_gpus_is_an_error():
    p = plan_placement(gpus=3, trainer_ranks=1, trainer_on_gpu=True, num_engines=4, gpus_per_engine=1,
                       rollout_gpus=2, colocate=False)
    assert p.engine_gpus == [[1], [2], [1], [2]] and p.engine_bundles == [1, 2, 1, 2]
    with pytest.raises(ConfigError, match="needs 5 GPUs.*--colocate"):
        plan_placement(gpus=4, trainer_ranks=1, trainer_on_gpu=True, num_engines=2, gpus_per_engine=2,
                       rollout_gpus=4, colocate=False)
    with pytest.raises(ConfigError, match="multiple of --rollout-num-gpus-per-engine"):
        plan_placement(gpus=8, trainer_ranks=1, trainer_on_gpu=True, num_engines=1, gpus_per_engine=2,
                       rollout_gpus=3, colocate=False)


def test_cpu_actors_get_a_sliver_of_a_cpu_each():
    p = plan_placement(gpus=0, trainer_ranks=1, trainer_on_gpu=False, num_engines=2, gpus_per_engine=0,
                       rollout_gpus=None, colocate=False)
    assert p.bundles == [{"CPU": CPU_SLICE}] * 3
    assert p.trainer_bundles == [0] and p.engine_bundles == [1, 2] and p.engine_gpus == [[], []]


@pytest.mark.e2e
def test_reserved_on_ray_with_fake_gpus_and_engines_owned_by_actors(tmp_path, tiny_model, monkeypatch):
    ray = pytest.importorskip("ray")
    from agentrl.config import RolloutConfig
    from agentrl.engines.group import start_engines
    from agentrl.cluster.placement import reserve_placement

    if ray.is_initialized():
        pytest.skip("Ray already runs in this process")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(num_cpus=1, num_gpus=4, include_dashboard=False, log_to_driver=False, logging_level="ERROR",
             _node_ip_address="127.0.0.1")
    try:
        cfg, _ = parse_config(["--rollout-engine", "sglang", "--rollout-num-gpus", "2",
                               "--rollout-num-gpus-per-engine", "2"])
        plan = reserve_placement(cfg, "cuda", trainer=True, engines=True, timeout_s=60)
        try:
            assert sorted(plan.slot_gpu_ids) == [0, 1, 2] and len(plan.engine_gpus) == 1
            trainer_gpu = plan.slot_gpu_ids[plan.trainer_gpus[0][0]]
            assert trainer_gpu not in plan.rollout_gpu_ids() and len(plan.rollout_gpu_ids()) == 2
        finally:
            plan.release()
        # the CPU default: one trainer and two embedded engines, each engine server under an actor;
        # the driver seen as another node, so the actors bind their node's address on ports of their own
        from agentrl.cluster import engine_actor
        monkeypatch.setattr(engine_actor, "node_ip", lambda: "10.255.255.1")
        cfg, _ = parse_config(["--num-engines", "2", "--engine-num-threads", "1", "--use-router", "never"])
        plan = reserve_placement(cfg, "cpu", trainer=True, engines=True, timeout_s=60)
        group = None
        try:
            assert plan.bundles == [{"CPU": CPU_SLICE}] * 3
            group = start_engines(RolloutConfig(num_engines=2, engine_num_threads=1, use_router="never",
                                                engine_restart=False), model_path=str(tiny_model), device="cpu",
                                  seed=0, log_dir=tmp_path, placement=plan)
            for e in group.engines:
                with urllib.request.urlopen(e.url + "/health", timeout=10) as r:
                    assert r.status == 200
                pid = e.server.pid()
                parent = open(f"/proc/{pid}/stat").read().split(") ")[1].split()[1]
                assert "EngineServer" in open(f"/proc/{parent}/cmdline").read()  # owned by the actor
                argv = open(f"/proc/{pid}/cmdline").read().split("\0")
                node = ray.util.get_node_ip_address()
                assert e.url == f"http://{node}:{argv[argv.index('--port') + 1]}"  # the actor's address and port
                assert argv[argv.index("--host") + 1] == node and argv[argv.index("--engine-id") + 1] == e.url
            group.engines[0].server.kill()
            assert not group.engines[0].server.alive()
            group.engines[0].server.restart()  # the monitor's restart path: through the actor
            group.engines[0].server.wait_healthy(120)
            assert group.engines[0].server.restarts == 1
            with urllib.request.urlopen(group.engines[0].url + "/health", timeout=10) as r:  # same place
                assert r.status == 200
        finally:
            if group is not None:
                group.stop()
            plan.release()
    finally:
        ray.shutdown()


def test_trainer_ranks_megatron_only():
    from agentrl.cluster.placement import trainer_ranks

    cfg, _ = parse_config(["--trainer", "megatron", "--actor-num-nodes", "2", "--actor-num-gpus-per-node", "4"])
    assert trainer_ranks(cfg) == 8
    assert trainer_ranks(parse_config([])[0]) == 1
    with pytest.raises(ConfigError, match="plain-PyTorch trainer runs on one device: use --trainer megatron"):
        trainer_ranks(parse_config(["--actor-num-gpus-per-node", "2"])[0])


def test_gpu_sharing_is_a_fact_of_the_run_not_a_config_rewrite():
    from agentrl.cluster.placement import gpu_sharing

    cfg, _ = parse_config([])
    # embedded engines on one GPU with the trainer: they share it, and say why
    why = gpu_sharing(cfg, gpus=1, trainer_ranks=1, num_engines=1, gpus_per_engine=1)
    assert why and "share the trainer's GPUs" in why and cfg.run.colocate is False
    assert gpu_sharing(cfg, gpus=2, trainer_ranks=1, num_engines=1, gpus_per_engine=1) is None  # room for both
    assert gpu_sharing(cfg, gpus=0, trainer_ranks=1, num_engines=1, gpus_per_engine=0) is None  # on the CPU
    sglang, _ = parse_config(["--rollout-engine", "sglang"])
    assert gpu_sharing(sglang, gpus=1, trainer_ranks=1, num_engines=1, gpus_per_engine=1) is None  # refused later
    colocated, _ = parse_config(["--rollout-engine", "sglang", "--colocate"])
    assert gpu_sharing(colocated, gpus=1, trainer_ranks=1, num_engines=1, gpus_per_engine=1) == "--colocate"
    p = plan_placement(gpus=1, trainer_ranks=1, trainer_on_gpu=True, num_engines=1, gpus_per_engine=1,
                       rollout_gpus=None, colocate=True)
    p.slot_gpu_ids, p.gpu_sharing = [3], why
    assert p.describe() == {"trainer_gpus": [[3]], "engine_gpus": [[3]], "gpu_sharing": why}


def test_each_engine_tp_rank_is_fed_by_the_trainer_rank_on_its_gpu():
    from agentrl.cluster.placement import pin_to_resources

    # TP=2 x DP=2 trainer colocated with two TP=2 engines: engine 1's TP ranks sit on slots 2, 3
    p = plan_placement(gpus=4, trainer_ranks=4, trainer_on_gpu=True, num_engines=2, gpus_per_engine=2,
                       rollout_gpus=None, colocate=True)
    assert [p.engine_rank_sources(i, 2) for i in range(2)] == [[0, 1], [2, 3]]
    assert p.engine_rank_sources(0, 1) is None  # the engine says another TP size than it was placed with
    # engines on GPUs of their own: no trainer rank there, no per-rank path
    apart = plan_placement(gpus=4, trainer_ranks=2, trainer_on_gpu=True, num_engines=1, gpus_per_engine=2,
                           rollout_gpus=2, colocate=False)
    assert apart.engine_rank_sources(0, 2) is None
    # the CPU: engines emulating TP ranks take them from the trainer ranks in turn
    cpu = plan_placement(gpus=0, trainer_ranks=2, trainer_on_gpu=False, num_engines=1, gpus_per_engine=0,
                         rollout_gpus=None, colocate=False)
    assert cpu.engine_rank_sources(0, 2) == [0, 1] and cpu.engine_rank_sources(0, 3) == [0, 1, 0]
    # custom resources pin trainer bundles and every GPU slot of every engine
    pin_to_resources(apart, trainer="tr", engines="en")
    assert [b.get("tr") for b in apart.bundles] == [0.001, 0.001, None, None]
    assert [b.get("en") for b in apart.bundles] == [None, None, 0.001, 0.001]
    pin_to_resources(cpu, trainer=None, engines="en")
    assert cpu.bundles == [{"CPU": CPU_SLICE}, {"CPU": CPU_SLICE}, {"CPU": CPU_SLICE, "en": 0.001}]


def test_an_engine_split_across_nodes_is_refused_and_nodes_are_named():
    from agentrl.cluster.placement import check_engines_on_one_node

    p = plan_placement(gpus=4, trainer_ranks=2, trainer_on_gpu=True, num_engines=1, gpus_per_engine=2,
                       rollout_gpus=2, colocate=False)
    a, b = ("a" * 20, "10.0.0.1"), ("b" * 20, "10.0.0.2")
    p.bundle_nodes = [a, a, b, b]  # the trainer on node a, the engine (slots 2, 3) on node b
    check_engines_on_one_node(p)
    assert p.describe()["trainer_nodes"] == ["10.0.0.1 (node aaaaaaaaaaaa)"] * 2
    assert p.describe()["engine_nodes"] == ["10.0.0.2 (node bbbbbbbbbbbb)"]
    p.bundle_nodes = [a, a, a, b]  # Ray packed one engine GPU beside the trainer
    with pytest.raises(ConfigError, match=r"engine 0's 2 GPUs landed on different nodes .*10\.0\.0\.1 .*10\.0\.0\.2"):
        check_engines_on_one_node(p)
