"""One hierarchy for the errors agentrl raises on purpose. Each names what is wrong and
where (file, line, field, env id) and, where it can, how to fix it."""


class AgentRLError(Exception):
    """Base of every error agentrl raises on purpose."""


class ConfigError(AgentRLError):
    """A configuration value is missing, malformed or inconsistent."""


class DatasetError(AgentRLError):
    """A dataset file is missing or a row is malformed (the message names file and line)."""


class EnvNotFoundError(AgentRLError):
    """No env is registered under the requested name."""


class EnvRegistrationError(AgentRLError):
    """Two different objects claim the same env name."""


class ModelLoadError(AgentRLError):
    """A model folder is missing, incomplete, or lacks its tokenizer."""


class TemplateDriftError(AgentRLError):
    """The chat template re-rendered earlier tokens differently from what the model saw."""


class EngineError(AgentRLError):
    """An inference engine failed, answered badly, or did not answer in time."""


class SampleInvariantError(AgentRLError):
    """A Sample's arrays disagree in length or content."""


class AgentFault(AgentRLError):
    """Something the agent's own actions broke (it killed or wedged a tool server or the sandbox's
    exec server, or left a file the grader cannot read). Not infrastructure: the trajectory is
    scored 0 with the reason recorded, instead of being masked as FAILED (which would let a
    policy veto its group)."""
