"""Ray: every trainer rank and every engine run as Ray actors placed in one placement group;
the driver holds the rollout loop (and the router). One module per part:

- `ray_session`: Ray started locally or joined (`--ray-address`), stopped; the signals that
  end a run; what each actor asks of its node.
- `placement`: where each trainer rank and engine runs (`plan_placement`), reserved as one
  placement group (`reserve_placement`).
- `node_watch`: the run ends, naming the node, when a node holding its actors dies.
- `engine_actor`: an engine's server process owned by an actor on its bundle (`EngineServer`),
  and the driver's handle on it (`ActorServer`).
- `trainer_actor`: the trainer in one actor per rank (`TrainerWorker`), and the driver's handle
  on them (`RemoteTrainer`); the weight sync it runs is agentrl.weight_sync.TrainerSync.

Nothing is imported here: each caller names the module it needs.
"""
