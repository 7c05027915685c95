"""The data that crosses component boundaries: one `Sample` per trajectory.

A Sample's token arrays are written only through `append_prompt`, `append_generated`
and `append_observation`, which keep them aligned; `validate()` checks the invariants
wherever a Sample is built or loaded.
"""

from __future__ import annotations

import enum
from dataclasses import asdict, dataclass, field
from typing import Any

from agentrl.errors import SampleInvariantError


class SampleStatus(str, enum.Enum):
    COMPLETED = "completed"  # the env terminated the episode
    TRUNCATED = "truncated"  # a turn, token or time limit cut it off
    ABORTED = "aborted"  # the engine aborted the generation (e.g. at a weight update)
    FAILED = "failed"  # infrastructure failure: masked out of the loss, never scored


@dataclass
class TurnTiming:
    generate_s: float = 0.0
    env_s: float = 0.0


@dataclass
class Sample:
    prompt_tokens: list[int]  # [num_prompt_tokens]
    response_tokens: list[int] = field(default_factory=list)  # [num_response_tokens]
    loss_mask: list[int] = field(default_factory=list)  # [num_response_tokens]; 1 = sampled by the policy
    rollout_logprobs: list[float] = field(default_factory=list)  # [num_response_tokens]; 0.0 where masked
    policy_versions: list[int] = field(default_factory=list)  # [num_response_tokens]; -1 where masked
    # MoE routing replay (R3): the experts the engine routed each token to, [num_tokens - 1][layers][top-k]
    # (every token but the last, as SGLang's return_routed_experts gives them); None when not asked for
    routed_experts: list[list[list[int]]] | None = None
    # a vision-language model's prompt images, as PNG data URLs in placeholder order (agentrl/vision.py):
    # every request of the trajectory carries them, and the trainer's forward sees them
    images: list[str] = field(default_factory=list)
    reward: float | dict[str, float] = 0.0
    status: SampleStatus = SampleStatus.COMPLETED
    group_id: int = 0
    trajectory_id: str = ""
    env_name: str = ""
    num_turns: int = 0
    turn_timings: list[TurnTiming] = field(default_factory=list)
    messages: list[dict[str, Any]] = field(default_factory=list)
    metadata: dict[str, Any] = field(default_factory=dict)

    # -- the only writers of the token arrays ----------------------------------------------
    def append_generated(self, tokens: list[int], logprobs: list[float], policy_version: int) -> None:
        """Tokens the policy sampled: trained on (mask 1), logprobs kept as the engine gave them."""
        if len(tokens) != len(logprobs):
            raise SampleInvariantError(
                f"trajectory {self.trajectory_id}: {len(tokens)} generated tokens but {len(logprobs)} logprobs"
            )
        self.response_tokens += tokens
        self.loss_mask += [1] * len(tokens)
        self.rollout_logprobs += map(float, logprobs)
        self.policy_versions += [policy_version] * len(tokens)

    def retract_generated(self, n: int) -> None:
        """Take back the last `n` sampled tokens (a turn's stop token, when the env's text continues the turn)."""
        keep = len(self.loss_mask) - n
        if n < 0 or keep < 0 or not all(self.loss_mask[keep:]):
            raise SampleInvariantError(f"trajectory {self.trajectory_id}: cannot retract {n} tokens: "
                                       "only the policy's last sampled tokens can be taken back")
        for name in ("response_tokens", "loss_mask", "rollout_logprobs", "policy_versions"):
            del getattr(self, name)[keep:]

    def append_observation(self, tokens: list[int]) -> None:
        """Tokens the env or the chat template added: context only (mask 0)."""
        self.response_tokens += tokens
        self.loss_mask += [0] * len(tokens)
        self.rollout_logprobs += [0.0] * len(tokens)
        self.policy_versions += [-1] * len(tokens)

    # -- derived views ---------------------------------------------------------------------
    @property
    def tokens(self) -> list[int]:
        return self.prompt_tokens + self.response_tokens

    @property
    def label(self) -> Any:
        """The task's label (slime's `sample.label`)."""
        return self.metadata.get("label")

    @property
    def response(self) -> str:
        """The assistant's text, all turns joined (slime's `sample.response`)."""
        return "".join(str(m["content"]) for m in self.messages if m.get("role") == "assistant")

    @property
    def response_length(self) -> int:
        return len(self.response_tokens)

    @property
    def num_trained_tokens(self) -> int:
        return sum(self.loss_mask)

    @property
    def reward_value(self) -> float:
        """The scalar the advantage uses: a dict reward contributes its "score" key."""
        if isinstance(self.reward, dict):
            return float(self.reward.get("score", 0.0))
        return float(self.reward)

    def get_reward_value(self, args) -> float:
        """slime's accessor, which its filters call (check_reward_nonzero_std): the dict reward's
        --reward-key entry when one is set (args: agentrl's Config or slime's flat args), else reward_value."""
        key = getattr(getattr(args, "algo", args), "reward_key", None)
        if key and isinstance(self.reward, dict):
            return float(self.reward[key])
        return self.reward_value

    @property
    def trainable(self) -> bool:
        """Failed (infrastructure) and aborted (cut off, unscored) trajectories are not trained on."""
        return self.status not in (SampleStatus.FAILED, SampleStatus.ABORTED) and self.num_trained_tokens > 0

    def mask_older_than(self, version: int) -> int:
        """Stop training on policy tokens sampled by a version older than `version` (their
        generation was resumed under newer weights); returns how many were masked."""
        masked = 0
        for i, (m, v) in enumerate(zip(self.loss_mask, self.policy_versions)):
            if m and v < version:
                self.loss_mask[i] = 0
                masked += 1
        return masked

    @property
    def oldest_policy_version(self) -> int:
        versions = [v for v in self.policy_versions if v >= 0]
        return min(versions) if versions else -1

    def validate(self) -> None:
        n = len(self.response_tokens)
        for name in ("loss_mask", "rollout_logprobs", "policy_versions"):
            if len(getattr(self, name)) != n:
                raise SampleInvariantError(
                    f"trajectory {self.trajectory_id}: {name} has {len(getattr(self, name))} entries, "
                    f"response_tokens has {n}"
                )
        if self.loss_mask.count(0) + self.loss_mask.count(1) != n:
            raise SampleInvariantError(f"trajectory {self.trajectory_id}: loss_mask holds values other than 0/1")
        if not self.prompt_tokens:
            raise SampleInvariantError(f"trajectory {self.trajectory_id}: empty prompt")

    # -- serialization ---------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["status"] = self.status.value
        return out

    #: keys RunLog adds to saved trajectories for reading; ignored when loading them back
    DERIVED_KEYS = ("prompt_text", "response_text")

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Sample":
        known = {f for f in cls.__dataclass_fields__}
        data = {k: v for k, v in data.items() if k not in cls.DERIVED_KEYS}
        unknown = set(data) - known
        if unknown:
            raise SampleInvariantError(f"unknown Sample fields: {sorted(unknown)}")
        data = dict(data)
        data["status"] = SampleStatus(data.get("status", "completed"))
        data["turn_timings"] = [TurnTiming(**t) for t in data.get("turn_timings", [])]
        sample = cls(**data)
        sample.validate()
        return sample
