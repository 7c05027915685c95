import pytest

from agentrl.errors import SampleInvariantError
from agentrl.types import Sample, SampleStatus


def test_append_keeps_arrays_aligned_and_masks_env_tokens():
    s = Sample(prompt_tokens=[1, 2])
    s.append_generated([5, 6], [-0.1, -0.2], policy_version=3)
    s.append_observation([7, 8, 9])
    s.append_generated([10], [-0.3], policy_version=4)
    assert s.response_tokens == [5, 6, 7, 8, 9, 10]
    assert s.loss_mask == [1, 1, 0, 0, 0, 1]
    assert s.rollout_logprobs == [-0.1, -0.2, 0.0, 0.0, 0.0, -0.3]
    assert s.policy_versions == [3, 3, -1, -1, -1, 4]
    assert s.tokens == [1, 2, 5, 6, 7, 8, 9, 10]
    assert s.oldest_policy_version == 3
    s.validate()


def test_mismatched_logprobs_rejected_with_lengths_named():
    s = Sample(prompt_tokens=[1], trajectory_id="t1")
    with pytest.raises(SampleInvariantError, match="t1: 2 generated tokens but 1 logprobs"):
        s.append_generated([1, 2], [0.0], 0)


def test_validate_catches_direct_tampering_and_roundtrip():
    s = Sample(prompt_tokens=[1])
    s.append_generated([2], [-1.0], 0)
    s.loss_mask.append(1)
    with pytest.raises(SampleInvariantError, match="loss_mask has 2 entries"):
        s.validate()
    s.loss_mask.pop()
    s.status, s.reward = SampleStatus.TRUNCATED, {"score": 0.5, "f1": 0.7}
    back = Sample.from_dict(s.to_dict())
    assert back == s and back.reward_value == 0.5
    with pytest.raises(SampleInvariantError, match="unknown Sample fields"):
        Sample.from_dict({**s.to_dict(), "bogus": 1})


def test_failed_samples_are_not_trainable():
    s = Sample(prompt_tokens=[1])
    s.append_generated([2], [-1.0], 0)
    assert s.trainable
    s.status = SampleStatus.FAILED
    assert not s.trainable


def test_validate_rejects_a_mask_value_other_than_0_or_1():
    s = Sample(prompt_tokens=[1], trajectory_id="t1")
    s.append_generated([2, 3], [-1.0, -1.0], 0)
    s.loss_mask[1] = True  # equal to 1: accepted, as `m in (0, 1)` always did
    s.validate()
    s.loss_mask[1] = 2
    with pytest.raises(SampleInvariantError, match="t1: loss_mask holds values other than 0/1"):
        s.validate()
