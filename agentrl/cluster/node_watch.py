"""Ends a run, naming the node, when a Ray node that holds its trainer ranks or engines dies."""

from __future__ import annotations

import logging
import os
import signal
import threading

from agentrl.cluster.placement import Placement
from agentrl.errors import AgentRLError

log = logging.getLogger("agentrl.cluster")


class NodeLost(AgentRLError):
    """A Ray node holding the run's trainer ranks or engines left the cluster."""


class NodeWatch:
    """Ends the run, naming the node, when a Ray node holding its trainer ranks or engines dies
    (a machine lost, a raylet killed, a preempted pod): a thread polls the cluster's node table
    and raises NodeLost in the main thread (through SIGUSR1, as SIGTERM ends a run), instead of
    the run hanging on calls into actors that are gone."""

    def __init__(self, placement: Placement, interval_s: float = 2.0):
        self.interval_s, self.lost = interval_s, None
        self.held: dict[str, list[str]] = {}  # node id -> who of the run is there
        for rank, b in enumerate(placement.trainer_bundles):
            self._hold(placement, b, f"trainer rank {rank}")
        for i, b in enumerate(placement.engine_bundles):
            self._hold(placement, b, f"engine {i}")
        self.hosts = {nid: host for nid, host in placement.bundle_nodes}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="agentrl-node-watch", daemon=True)

    def _hold(self, placement: Placement, bundle: int, who: str) -> None:
        if bundle < len(placement.bundle_nodes):
            self.held.setdefault(placement.bundle_nodes[bundle][0], []).append(who)

    def start(self) -> "NodeWatch":
        if self.held and threading.current_thread() is threading.main_thread():
            def raise_lost(signum, frame):
                raise NodeLost(self.lost or "a Ray node of this run died")

            signal.signal(signal.SIGUSR1, raise_lost)
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive() or self.lost:
            self._thread.join(timeout=10)
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGUSR1, signal.SIG_IGN)  # a late report from the thread: nothing to stop

    def check(self) -> str | None:
        """What is lost: a sentence naming the node and who was on it; None while all are alive."""
        import ray

        alive = {n["NodeID"]: n.get("Alive", False) for n in ray.nodes()}
        for nid, who in self.held.items():
            if not alive.get(nid, False):
                return (f"Ray node {self.hosts.get(nid, '?')} (node id {nid}) left the cluster; it held "
                        f"{', '.join(who)}. The run stops here: resume with --load from the last checkpoint "
                        "once the cluster has the node's resources again")
        return None

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.lost = self.check()
            except Exception as exc:  # the GCS itself unreachable: the driver's own Ray calls fail too
                log.warning("node watch: %r", exc)
                continue
            if self.lost:
                log.error("%s", self.lost)
                os.kill(os.getpid(), signal.SIGUSR1)
                return
