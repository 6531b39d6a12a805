"""opd.rewards on hand-made rewards and hand-made packed trajectories."""

from types import SimpleNamespace

import pytest
import torch

from opd.packing import pack_varlen
from opd.rewards import group_advantages, token_advantages

# Two prompts, interleaved: a has rewards 1, 0, 0, 1 and b has 0.5, 0.5 (all equal).
REWARDS = [1.0, 0.5, 0.0, 0.0, 0.5, 1.0]
GROUPS = ["a", "b", "a", "a", "b", "a"]


def test_mean_std_is_grpo():
    # group a: mean 0.5, sample std sqrt(1/3) -> +-0.5 * sqrt(3); group b: all equal -> 0
    half_root3 = 0.5 * 3 ** 0.5
    assert group_advantages(REWARDS, GROUPS, "mean_std") == pytest.approx(
        [half_root3, 0.0, -half_root3, -half_root3, 0.0, half_root3], rel=1e-5)


def test_mean_and_leave_one_out_and_none():
    assert group_advantages(REWARDS, GROUPS, "mean") == [0.5, 0.0, -0.5, -0.5, 0.0, 0.5]
    # leave-one-out for the first episode of a: 1 - mean(0, 0, 1) = 2/3
    assert group_advantages(REWARDS, GROUPS, "leave_one_out") == pytest.approx(
        [2 / 3, 0.0, -2 / 3, -2 / 3, 0.0, 2 / 3])
    assert group_advantages(REWARDS, GROUPS, "none") == REWARDS


@pytest.mark.parametrize("norm", ["mean_std", "mean", "leave_one_out"])
def test_a_group_of_one_gets_zero(norm):
    assert group_advantages([0.7, 1.0, 0.0], [0, 1, 1], norm)[0] == 0.0


def test_three_rewards_by_hand():
    # mean 2, sample std 1: (1 - 2) / 1, 0, (3 - 2) / 1
    assert group_advantages([1.0, 2.0, 3.0], [7, 7, 7]) == pytest.approx([-1.0, 0.0, 1.0],
                                                                          rel=1e-5)
    assert group_advantages([1.0, 2.0, 3.0], [7, 7, 7], "leave_one_out") == [-1.5, 0.0, 1.5]


def test_errors():
    with pytest.raises(ValueError, match="advantage norm must be one of mean_std, mean, "
                                         "leave_one_out, none, got 'z'"):
        group_advantages([1.0], [0], "z")
    with pytest.raises(ValueError, match="2 rewards and 1 group ids must pair up"):
        group_advantages([1.0, 2.0], [0])


def _trajectory(ids, assistant):
    return SimpleNamespace(input_ids=ids, assistant_mask=assistant)


def test_advantages_only_on_assistant_tokens():
    """Prompt, tool-observation and padding-free packing: exactly 0 where no assistant token is
    predicted; each sequence's own advantage where one is."""
    trajectories = [
        # prompt (3), assistant (2), tool observation (2), assistant (2)
        _trajectory(list(range(9)), [False] * 3 + [True] * 2 + [False] * 2 + [True] * 2),
        _trajectory(list(range(5)), [False] * 2 + [True] * 3),
        _trajectory(list(range(4)), [False] * 4),  # nothing sampled: no target at all
    ]
    (batch,) = pack_varlen(trajectories, 64)
    advantages = [1.5, -2.0, 9.0]
    per_token = token_advantages(advantages, batch.cu_seqlens, batch.trajectory_index,
                                 batch.target_mask)
    assert per_token.shape == batch.target_mask.shape
    assert (per_token[~batch.target_mask] == 0).all()
    expected = torch.zeros_like(per_token)
    for index, values in batch.unpack(torch.arange(batch.num_tokens)).items():
        positions = values[torch.tensor(trajectories[index].assistant_mask[1:] + [False])]
        expected[0, positions] = advantages[index]
    assert torch.equal(per_token, expected)
    assert (per_token != 0).sum() == 7  # 4 + 3 targets, the third sequence none


def test_token_advantages_checks_the_layout():
    (batch,) = pack_varlen([_trajectory([1, 2, 3], [False, True, True])], 8)
    with pytest.raises(ValueError, match="2 trajectory ids and cu_seqlens ending at 3 must"):
        token_advantages([1.0], batch.cu_seqlens, [0, 0], batch.target_mask)
