"""Packing: seed-identical padding, varlen bins, shifted target mask, packed == unpacked forward."""

from __future__ import annotations

import random

import pytest
import torch
from conftest import build_tiny_model

from opd.packing import first_fit_decreasing, pack_trajectories, pack_varlen
from opd.trajectory import AgentTrajectory


def seed_pack_trajectories(trajectories, pad_token_id, device):
    """The seed's function, verbatim: the reference."""
    if not trajectories:
        raise ValueError("At least one trajectory is required")
    if any(len(t.input_ids) != len(t.assistant_mask) for t in trajectories):
        raise ValueError("Trajectory tokens and masks must have the same length")
    length = max(len(t.input_ids) for t in trajectories)
    ids, attention, targets = [], [], []
    for trajectory in trajectories:
        size = len(trajectory.input_ids)
        ids.append(trajectory.input_ids + [pad_token_id] * (length - size))
        attention.append([1] * size + [0] * (length - size))
        targets.append(trajectory.assistant_mask + [False] * (length - size))
    return (
        torch.tensor(ids, dtype=torch.long, device=device),
        torch.tensor(attention, dtype=torch.long, device=device),
        torch.tensor(targets, dtype=torch.bool, device=device)[:, 1:],
    )


def random_trajectories(n: int, vocab: int, seed: int = 0) -> list[AgentTrajectory]:
    rng = random.Random(seed)
    trajectories = []
    for _ in range(n):
        prompt, spans = rng.randint(3, 12), []
        ids = [rng.randrange(vocab) for _ in range(prompt)]
        mask = [False] * prompt
        for turn in range(rng.randint(1, 3)):
            sampled, observed = rng.randint(1, 9), rng.randint(2, 6)
            ids += [rng.randrange(vocab) for _ in range(sampled + observed)]
            mask += [True] * sampled + [False] * observed
        trajectories.append(AgentTrajectory(ids, mask, 1, 0, False, spans=spans))
    return trajectories


def test_padded_packing_is_identical_to_the_seed():
    trajectories = random_trajectories(7, vocab=50)
    for ours, seeds in zip(pack_trajectories(trajectories, 0, "cpu"),
                           seed_pack_trajectories(trajectories, 0, "cpu")):
        assert ours.dtype == seeds.dtype and torch.equal(ours, seeds)
    with pytest.raises(ValueError, match="At least one trajectory"):
        pack_trajectories([], 0, "cpu")
    broken = AgentTrajectory([1, 2], [True], 1, 0, False)
    with pytest.raises(ValueError, match="same length"):
        pack_trajectories([broken], 0, "cpu")


def test_first_fit_decreasing_respects_the_budget_and_places_every_item():
    lengths = [random.Random(i).randint(1, 50) for i in range(40)]
    bins = first_fit_decreasing(lengths, 64)
    assert sorted(i for b in bins for i in b) == list(range(40))
    assert all(sum(lengths[i] for i in b) <= 64 for b in bins)
    assert len(bins) <= 2 * sum(lengths) / 64 + 1


def test_varlen_target_mask_selects_exactly_the_sampled_tokens():
    trajectories = random_trajectories(9, vocab=50, seed=1)
    batches = pack_varlen(trajectories, max_tokens=60)
    seen = []
    for batch in batches:
        assert batch.num_tokens <= 60
        assert batch.position_ids[0].tolist() == [p for i in batch.trajectory_index
                                                  for p in range(len(trajectories[i].input_ids))]
        predicted = batch.input_ids[0, 1:][batch.target_mask[0, :-1]].tolist()
        expected = [t for i in batch.trajectory_index for t, m in
                    zip(trajectories[i].input_ids, trajectories[i].assistant_mask) if m]
        assert predicted == expected
        ends = batch.cu_seqlens[1:] - 1
        assert not batch.target_mask[0, ends].any()  # no sequence predicts its neighbour
        for index, ids in batch.unpack(batch.input_ids[0]).items():
            assert ids.tolist() == trajectories[index].input_ids
        seen += batch.trajectory_index
    assert sorted(seen) == list(range(9))
    assert sum(b.num_targets for b in batches) == sum(sum(t.assistant_mask) for t in trajectories)


def test_trajectory_over_the_budget_is_a_clear_error():
    with pytest.raises(ValueError, match="exceeds packing.max_tokens=4"):
        pack_varlen(random_trajectories(2, vocab=50), max_tokens=4)


@pytest.mark.parametrize("architecture", ["qwen2", "llama"])
def test_packed_forward_equals_unpacked_forward(architecture, qwen3_tokenizer, tmp_path):
    model = build_tiny_model(qwen3_tokenizer, tmp_path, architecture=architecture).eval()
    trajectories = random_trajectories(5, vocab=len(qwen3_tokenizer), seed=2)
    (batch,) = pack_varlen(trajectories, max_tokens=1000)
    with torch.no_grad():
        packed = model(input_ids=batch.input_ids, position_ids=batch.position_ids,
                       use_cache=False).logits[0]
        for index, logits in batch.unpack(packed).items():
            alone = model(input_ids=torch.tensor([trajectories[index].input_ids])).logits[0]
            torch.testing.assert_close(logits, alone, atol=1e-5, rtol=1e-5)
