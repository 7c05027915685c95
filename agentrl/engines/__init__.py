"""agentrl.engines: the embedded engine, SGLang launches, sglang-router, engine groups."""

# Every engine agentrl starts names itself in this response header (the embedded engine;
# SGLang through agentrl.engines.sglang_server); sglang-router passes it through, and the
# client reads it to tell which engine served a turn (agentrl.rollout.affinity).
ENGINE_HEADER = "X-Agentrl-Engine"
