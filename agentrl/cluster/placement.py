"""Where every trainer rank and every engine runs: one Ray placement group for the run.

`plan_placement` decides where: with GPUs, one bundle per GPU; trainer ranks take the first
`--actor-num-nodes x --actor-num-gpus-per-node` GPUs and the engines the next
`--rollout-num-gpus` (`--rollout-num-gpus-per-engine` each; more engines than that share
them), disjoint; `--colocate` puts the engines on the trainer's GPUs (time-shared). On the
CPU each actor gets a bundle with a sliver of a CPU (the CPU default goes through the same
code: the trainer actors just get no GPU; several Megatron ranks talk gloo there).
`reserve_placement` reserves the plan on the cluster.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from agentrl.config import Config
from agentrl.errors import ConfigError


CPU_SLICE = 0.01  # what a bundle and an actor ask of a CPU: placed, never waiting for a core


@dataclass
class Placement:
    """Bundles of one placement group and who sits in which. With GPUs, bundle i is GPU slot
    i; CPU-only actors get their own bundles after the GPU ones."""

    bundles: list[dict[str, float]]
    trainer_bundles: list[int]  # one per trainer rank
    trainer_gpus: list[list[int]]  # GPU slots of each rank ([] on the CPU)
    engine_bundles: list[int]  # one per engine: its first GPU's bundle
    engine_gpus: list[list[int]]  # GPU slots of each engine ([] on the CPU)
    pg: Any = None  # the reserved ray placement group
    slot_gpu_ids: list[int] = field(default_factory=list)  # physical GPU id of each slot, once reserved
    gpu_sharing: str | None = None  # why engines share the trainer's GPUs (gpu_sharing()); None: they do not
    bundle_nodes: list[tuple[str, str]] = field(default_factory=list)  # (node id, host) of each bundle, reserved

    def describe(self) -> dict:
        """Who got which physical GPU, for the run's run.json."""
        def physical(slots):
            return [self.slot_gpu_ids[g] for g in slots] if self.slot_gpu_ids else slots

        out = {"trainer_gpus": [physical(g) for g in self.trainer_gpus],
               "engine_gpus": [physical(g) for g in self.engine_gpus], "gpu_sharing": self.gpu_sharing}
        if self.bundle_nodes:
            out |= {"trainer_nodes": [self.node_of(b) for b in self.trainer_bundles],
                    "engine_nodes": [self.node_of(b) for b in self.engine_bundles]}
        return out

    def node_of(self, bundle: int) -> str:
        """'HOST (node ID…)' of a bundle, as run.json and error messages name it."""
        if bundle >= len(self.bundle_nodes):
            return "?"
        nid, host = self.bundle_nodes[bundle]
        return f"{host} (node {nid[:12]})"

    def shares(self, bundle: int) -> bool:
        """Does a trainer rank share this bundle's GPU with an engine (--colocate)?"""
        return any(bundle in gpus for gpus in self.engine_gpus)

    def strategy(self, bundle: int):
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        return PlacementGroupSchedulingStrategy(placement_group=self.pg, placement_group_bundle_index=bundle)

    def engine_rank_sources(self, index: int, tp_size: int) -> list[int] | None:
        """For the per-rank colocated weight sync: the trainer rank on the GPU of each of engine
        `index`'s `tp_size` TP ranks (TP rank k runs on the engine's k-th GPU: SGLang's order of
        CUDA_VISIBLE_DEVICES); None when one of them has no trainer rank there (not colocated).
        On the CPU (no GPUs; an embedded engine emulating TP ranks) rank k % trainer ranks."""
        ranks = len(self.trainer_bundles)
        gpus = self.engine_gpus[index] if index < len(self.engine_gpus) else []
        if not gpus:
            return None if any(self.trainer_gpus) else [k % ranks for k in range(tp_size)]
        if len(gpus) != tp_size:
            return None
        by_slot = {g[0]: rank for rank, g in enumerate(self.trainer_gpus) if g}
        sources = [by_slot.get(g) for g in gpus]
        return None if None in sources else sources

    def rollout_gpu_ids(self) -> list[int]:
        """Physical GPU ids of the engines' slots, in slot order (for SGLang's plan)."""
        slots = sorted({g for gpus in self.engine_gpus for g in gpus})
        return [self.slot_gpu_ids[g] for g in slots]

    def release(self) -> None:
        if self.pg is not None:
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(self.pg)
            self.pg = None


def plan_placement(*, gpus: int, trainer_ranks: int, trainer_on_gpu: bool, num_engines: int, gpus_per_engine: int,
                   rollout_gpus: int | None, colocate: bool) -> Placement:
    """Bundles for `trainer_ranks` trainer ranks and `num_engines` engines. `gpus`: the GPUs
    there are (0: none); `gpus_per_engine` 0: engines on the CPU. Without colocate the trainer
    gets slots [0, T) and the engines [T, T + R); with it the engines use the trainer's slots."""
    t_gpu = trainer_ranks if trainer_on_gpu else 0
    e_gpu = gpus_per_engine if num_engines else 0
    if colocate:
        r = rollout_gpus or max(t_gpu, e_gpu)
        base, slots = 0, max(t_gpu, r)
    else:
        r = rollout_gpus or (max(gpus - t_gpu, e_gpu) if e_gpu else 0)
        base, slots = t_gpu, t_gpu + (r if e_gpu else 0)
    if slots > gpus:
        raise ConfigError(f"placement needs {slots} GPUs (trainer {t_gpu}, engines {r if e_gpu else 0}"
                          f"{', colocated' if colocate else ''}) but {gpus} are available: lower "
                          "--rollout-num-gpus / --actor-num-gpus-per-node, or --colocate to share them")
    if e_gpu and (r < e_gpu or r % e_gpu):
        raise ConfigError(f"--rollout-num-gpus {r} is not a multiple of --rollout-num-gpus-per-engine {e_gpu}")
    bundles: list[dict[str, float]] = [{"GPU": 1.0, "CPU": CPU_SLICE} for _ in range(slots)]
    trainer_gpus = [[i] for i in range(t_gpu)]
    trainer_bundles = list(range(t_gpu))
    for _ in range(trainer_ranks - t_gpu):  # a trainer on the CPU
        trainer_gpus.append([])
        trainer_bundles.append(len(bundles))
        bundles.append({"CPU": CPU_SLICE})
    engine_gpus, engine_bundles = [], []
    for i in range(num_engines):
        if e_gpu:
            engine_gpus.append([base + (i * e_gpu + j) % r for j in range(e_gpu)])
            engine_bundles.append(engine_gpus[-1][0])
        else:
            engine_gpus.append([])
            engine_bundles.append(len(bundles))
            bundles.append({"CPU": CPU_SLICE})
    return Placement(bundles, trainer_bundles, trainer_gpus, engine_bundles, engine_gpus)


def engines_to_launch(cfg: Config, gpus: int, trainer_gpus: int) -> tuple[int, int]:
    """(engines, GPUs per engine) this run launches: (0, 0) when it attaches to running ones."""
    r = cfg.rollout
    if r.rollout_engine_urls:
        return 0, 0
    if r.rollout_engine == "sglang":
        avail = r.rollout_num_gpus or (gpus if cfg.run.colocate else gpus - trainer_gpus)
        return r.num_engines or max(1, avail // r.rollout_num_gpus_per_engine), r.rollout_num_gpus_per_engine
    return r.num_engines or 1, 0


def trainer_ranks(cfg: Config) -> int:
    """Trainer ranks (one Ray actor each): --actor-num-nodes x --actor-num-gpus-per-node for the
    Megatron trainer (on the CPU too: gloo ranks, as the tests run it); the plain-PyTorch
    trainer has one."""
    ranks = cfg.run.actor_num_nodes * cfg.run.actor_num_gpus_per_node
    if ranks > 1 and cfg.train.trainer != "megatron":
        raise ConfigError(f"--actor-num-nodes {cfg.run.actor_num_nodes} x --actor-num-gpus-per-node "
                          f"{cfg.run.actor_num_gpus_per_node} asks for {ranks} trainer ranks, but the plain-PyTorch "
                          "trainer runs on one device: use --trainer megatron, or leave both at 1")
    return ranks if cfg.train.trainer == "megatron" else 1


def gpu_sharing(cfg: Config, *, gpus: int, trainer_ranks: int, num_engines: int, gpus_per_engine: int) -> str | None:
    """Why the engines sit on the trainer's GPUs (None: they do not). Besides --colocate, embedded
    engines on too few GPUs share the trainer's, as on one GPU: a placement fact of this run, kept
    in its run.json (agentrl.metrics.RunContext), never written back into its config."""
    if cfg.run.colocate:
        return "--colocate"
    if gpus_per_engine and cfg.rollout.rollout_engine == "embedded" and gpus < trainer_ranks + num_engines:
        return (f"{num_engines} embedded engine(s) and {trainer_ranks} trainer rank(s) on {gpus} GPU(s): the engines "
                "share the trainer's GPUs (no handover: an embedded engine keeps its weights beside the trainer)")
    return None


def reserve_placement(cfg: Config, device: str, *, trainer: bool, engines: bool,
                      timeout_s: float = 300.0) -> Placement:
    """The run's placement group, reserved (and each GPU slot's physical id probed)."""
    import ray
    from ray.util.placement_group import placement_group

    gpus = int(ray.available_resources().get("GPU", 0))
    ranks = trainer_ranks(cfg) if trainer else 0
    n, per = engines_to_launch(cfg, gpus, ranks if device == "cuda" else 0) if engines else (0, 0)
    if n and device == "cuda" and cfg.rollout.rollout_engine == "embedded":
        per = 1  # an embedded engine on the GPU: one each
    shared = gpu_sharing(cfg, gpus=gpus, trainer_ranks=ranks, num_engines=n, gpus_per_engine=per)
    plan = plan_placement(gpus=gpus, trainer_ranks=ranks, trainer_on_gpu=device == "cuda", num_engines=n,
                          gpus_per_engine=per, rollout_gpus=cfg.rollout.rollout_num_gpus, colocate=shared is not None)
    plan.gpu_sharing = shared
    pin_to_resources(plan, trainer=cfg.run.ray_trainer_resource, engines=cfg.run.ray_engine_resource)
    plan.pg = placement_group(plan.bundles, strategy="PACK")
    try:
        ray.get(plan.pg.ready(), timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        plan.release()
        raise ConfigError(f"Ray could not reserve the bundles {plan.bundles} within {timeout_s:.0f} s (cluster: "
                          f"{ray.cluster_resources()})") from None
    plan.bundle_nodes = bundle_nodes(plan.pg)
    try:
        check_engines_on_one_node(plan)
    except ConfigError:
        plan.release()
        raise
    gpu_slots = sum(1 for b in plan.bundles if "GPU" in b)
    if gpu_slots:  # which physical GPU each slot holds
        probe = ray.remote(num_cpus=0, num_gpus=0.01)(lambda: int(ray.get_gpu_ids()[0]))
        plan.slot_gpu_ids = ray.get([probe.options(scheduling_strategy=plan.strategy(i)).remote()
                                     for i in range(gpu_slots)], timeout=timeout_s)
    return plan


RESOURCE_SLICE = 0.001  # what a bundle asks of --ray-trainer-resource / --ray-engine-resource


def pin_to_resources(plan: Placement, *, trainer: str | None, engines: str | None) -> None:
    """Each trainer bundle asks for a sliver of `trainer`, each engine bundle (every GPU slot of
    an engine) of `engines`: custom resources that only the nodes meant for them were started
    with, so Ray puts the trainer and the engines where the operator said."""
    def ask(bundle: int, name: str | None) -> None:
        if name:
            plan.bundles[bundle] = {**plan.bundles[bundle], name: RESOURCE_SLICE}

    for b in plan.trainer_bundles:
        ask(b, trainer)
    for index, b in enumerate(plan.engine_bundles):
        for slot in plan.engine_gpus[index] or [b]:
            ask(slot, engines)


def check_engines_on_one_node(plan: Placement) -> None:
    """An engine's TP ranks talk over its node's GPUs (SGLang's one process group per engine)."""
    for index, slots in enumerate(plan.engine_gpus):
        if len({plan.node_of(g) for g in slots}) > 1:
            raise ConfigError(f"engine {index}'s {len(slots)} GPUs landed on different nodes "
                              f"({[plan.node_of(g) for g in slots]}): an engine's TP ranks share one node; give "
                              "each node a multiple of --rollout-num-gpus-per-engine GPUs")


def bundle_nodes(pg) -> list[tuple[str, str]]:
    """(node id, host) of each bundle of a reserved placement group."""
    import ray
    from ray.util.placement_group import placement_group_table

    hosts = {n["NodeID"]: n.get("NodeManagerAddress", "?") for n in ray.nodes()}
    where = placement_group_table(pg).get("bundles_to_node_id", {})
    return [(str(where.get(i, "?")), hosts.get(where.get(i), "?")) for i in range(len(where))]
