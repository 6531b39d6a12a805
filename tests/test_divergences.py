"""opd.divergences: one registry that config validation, the losses and the trainer read."""

from __future__ import annotations

import pytest
import yaml

from opd import divergences, loss, loss_parallel
from opd.config import ConfigError, LossConfig, load_config


@pytest.fixture
def recipe(tmp_path):
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump({
        "name": "r", "model": {"student": "s", "teacher": "t"}, "data": {"prompts": "p.jsonl"},
        "loss": {"direction": "forward_kl"}, "eval": {"checker": "m:check"}}))
    return path


def test_unknown_direction_is_refused_in_one_sentence_naming_the_key(recipe):
    sentence = ("loss.direction must be one of forward_kl, reverse_kl, jsd, hybrid_kl, sft, "
                "sampled_reverse_kl, got 'kl'.")
    with pytest.raises(ConfigError) as error:
        divergences.get("kl")
    assert str(error.value) == sentence
    with pytest.raises(ConfigError) as error:
        load_config(recipe, None, ["loss.direction=kl"])
    assert str(error.value) == f"command line: {sentence}"


def test_every_entry_is_complete_and_its_kernel_exists():
    for entry in divergences.REGISTRY.values():
        assert entry.signal in divergences.SIGNALS and entry.doc
        assert callable(getattr(loss_parallel, entry.kernel)), entry.name
        assert entry.topk or entry.signal != "distribution" or entry.topk_refusal
    assert loss.DIRECTIONS == ("forward_kl", "reverse_kl", "jsd", "hybrid_kl")
    assert "55-90%" in divergences.get("reverse_kl").topk_refusal
    assert divergences.get("forward_kl").topk and not divergences.get("jsd").topk
    assert divergences.get("sampled_reverse_kl").needs_sampler_logprobs
    assert not divergences.get("sft").needs_teacher


def test_needs_teacher_is_off_for_sft_and_pure_rl():
    assert LossConfig().needs_teacher
    assert not LossConfig(direction="sft").needs_teacher
    assert not LossConfig(direction="sampled_reverse_kl", distill_weight=0.0,
                          reward_weight=1.0).needs_teacher


@pytest.mark.parametrize("overrides, message", [
    (["loss.reward_weight=1"], "command line: loss.reward_weight applies only to "
     "loss.direction=sampled_reverse_kl (a full-vocabulary or sft loss takes no task reward or "
     "sampled-token options); leave it at 0.0 with loss.direction=forward_kl."),
    (["loss.direction=reverse_kl", "loss.kl_estimator=k3"], "loss.kl_estimator applies only"),
    (["loss.direction=sampled_reverse_kl", "loss.distill_weight=0"],
     "command line: loss.distill_weight and loss.reward_weight are both 0, so nothing would be "
     "trained; set one of them above 0."),
    (["loss.direction=sampled_reverse_kl", "loss.importance_cap=0.5"],
     "loss.importance_cap must be 0 (off) or at least 1, got 0.5."),
    (["loss.direction=sampled_reverse_kl", "loss.kl_estimator=k2"],
     "loss.kl_estimator must be one of k1, k3, got 'k2'."),
    (["loss.direction=sampled_reverse_kl", "loss.off_policy_fraction=0.5",
      "data.completions=c.jsonl"], "loss.off_policy_fraction must be 0 with "
     "loss.direction=sampled_reverse_kl"),
])
def test_sampled_keys_are_checked(recipe, overrides, message):
    with pytest.raises(ConfigError) as error:
        load_config(recipe, None, overrides)
    assert message in str(error.value)


def test_the_three_modes_load(recipe):
    with pytest.raises(ConfigError, match="needs rollout.samples_per_prompt of at least 2"):
        load_config(recipe, None, ["loss.direction=sampled_reverse_kl", "loss.reward_weight=1"])
    for overrides in (["loss.direction=sampled_reverse_kl"],
                      ["loss.direction=sampled_reverse_kl", "loss.reward_weight=0.5",
                       "loss.importance_cap=2", "loss.advantage_norm=leave_one_out",
                       "rollout.samples_per_prompt=4"],
                      ["loss.direction=sampled_reverse_kl", "loss.distill_weight=0",
                       "loss.reward_weight=1", "rollout.samples_per_prompt=4"]):
        load_config(recipe, None, overrides)


def test_forward_kl_above_belongs_to_hybrid_kl(recipe):
    with pytest.raises(ConfigError) as error:
        load_config(recipe, None, ["loss.forward_kl_above=0.5"])
    assert str(error.value) == (
        "command line: loss.forward_kl_above applies only to loss.direction=hybrid_kl; leave it "
        "at 0.9 with loss.direction=forward_kl.")
    with pytest.raises(ConfigError, match="loss.forward_kl_above must be"):
        load_config(recipe, None, ["loss.direction=hybrid_kl", "loss.forward_kl_above=2"])
    config = load_config(recipe, None, ["loss.direction=hybrid_kl", "loss.forward_kl_above=0.5"])
    assert config.loss.forward_kl_above == 0.5 and config.loss.needs_teacher
