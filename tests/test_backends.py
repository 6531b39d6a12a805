"""Backend pieces that need no process group: DeepSpeed config filling, memory estimates,
the distillation root module, vocabulary checks. The engines themselves run on 2 ranks in
test_trainer.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from opd.backends import DistillModule, resolve_precision
from opd.backends.deepspeed import read_json_config, zero3_config
from opd.backends.memory import student_memory

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("name", ["zero3.json", "zero_inference.json"])
def test_shipped_deepspeed_configs_hold_no_recipe_values(name):
    data = read_json_config(str(REPO / "configs" / "deepspeed" / name), "student.deepspeed_config")
    assert "zero_optimization" in data


@pytest.mark.parametrize("key,where", [("gradient_clipping", {}), ("train_batch_size", {}),
                                       ("offload_optimizer", "zero_optimization")])
def test_deepspeed_config_that_repeats_a_recipe_value_is_rejected(tmp_path, key, where):
    data = {"zero_optimization": {}}
    (data["zero_optimization"] if where else data)[key] = 1
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=rf"{path}: remove '(zero_optimization\.)?{key}'"):
        read_json_config(str(path), "student.deepspeed_config")


def test_missing_deepspeed_config_names_the_key(tmp_path):
    with pytest.raises(FileNotFoundError, match="teacher.deepspeed_config"):
        read_json_config(str(tmp_path / "none.json"), "teacher.deepspeed_config")


def test_zero3_config_is_filled_from_the_recipe():
    base = {"zero_optimization": {"reduce_bucket_size": 7}}
    filled = zero3_config(base, world_size=8, bf16=True, offload_optimizer="cpu",
                          offload_param="nvme", nvme_path="/nvme")
    assert filled["train_micro_batch_size_per_gpu"] == 1
    assert filled["gradient_accumulation_steps"] == 1
    assert filled["train_batch_size"] == 8
    assert filled["bf16"] == {"enabled": True}
    zero = filled["zero_optimization"]
    assert zero["stage"] == 3 and zero["reduce_bucket_size"] == 7
    assert zero["offload_optimizer"]["device"] == "cpu"
    assert zero["offload_param"] == {"device": "nvme", "pin_memory": True, "nvme_path": "/nvme"}
    assert base == {"zero_optimization": {"reduce_bucket_size": 7}}  # the file's dict is untouched


def test_precision_on_cpu_is_fp32_and_sdpa():
    precision = resolve_precision("auto", "auto", torch.device("cpu"))
    assert precision.dtype == torch.float32 and precision.attn_implementation == "sdpa"
    assert resolve_precision("bf16", "eager", torch.device("cpu")).dtype == torch.bfloat16


def test_zero3_memory_matches_the_16_bytes_per_parameter_rule():
    n, world = 7_000_000_000, 8
    mixed = student_memory(n, 0, world, bf16=True, backend="deepspeed", offload_optimizer="none")
    assert mixed["params"] + mixed["grads"] + mixed["optimizer"] == pytest.approx(16 * n / world)
    assert mixed["gather_once"] == 2 * n
    offloaded = student_memory(n, 0, world, bf16=True, backend="deepspeed",
                               offload_optimizer="cpu")
    assert offloaded["device"] == pytest.approx(2 * n / world)  # only bf16 parameter shards stay
    assert offloaded["host"] == pytest.approx(14 * n / world)
    fsdp = student_memory(n, 0, world, bf16=True, backend="fsdp", offload_optimizer="none")
    assert fsdp["device"] == pytest.approx(16 * n / world)  # fp32 shards are the master


def tiny_model(vocab: int = 64, hidden: int = 16, seed: int = 0, tie: bool = True):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    return Qwen2ForCausalLM(Qwen2Config(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=tie))


def test_distill_module_loss_is_the_loss_of_the_model_logits():
    from opd.loss import distillation_loss, fused_distillation_loss

    student, teacher = tiny_model(seed=0), tiny_model(hidden=32, seed=1)
    ids = torch.randint(0, 64, (1, 12))
    mask = torch.zeros(12, dtype=torch.bool)
    mask[3:9] = True
    with torch.no_grad():
        teacher_logits = teacher(input_ids=ids).logits
        teacher_hidden = teacher.model(input_ids=ids).last_hidden_state[0]

    def head_loss(hidden, weight, bias):
        total = fused_distillation_loss(hidden, weight, teacher_hidden, teacher.lm_head.weight,
                                        mask, reduction="sum")
        return total, mask.sum()

    loss_sum, count = DistillModule(student)(ids, torch.arange(12)[None], head_loss)
    expected = distillation_loss(student(input_ids=ids).logits, teacher_logits, mask[None])
    assert count == 6
    torch.testing.assert_close(loss_sum / count, expected, rtol=1e-5, atol=1e-6)


def test_micro_batch_without_targets_still_reaches_every_parameter():
    """ZeRO-3 and FSDP reduce gradients in collectives: a rank whose micro-batch has no target
    must still produce a gradient (of zeros) for every parameter, or the ranks fall out of step."""
    from opd.loss import fused_distillation_loss

    student, teacher = tiny_model(seed=0), tiny_model(seed=1)
    ids = torch.zeros((1, 2), dtype=torch.long)
    mask = torch.zeros(2, dtype=torch.bool)
    with torch.no_grad():
        teacher_hidden = teacher.model(input_ids=ids).last_hidden_state[0]

    def head_loss(hidden, weight, bias):
        return fused_distillation_loss(hidden, weight, teacher_hidden, teacher.lm_head.weight,
                                       mask, reduction="sum"), mask.sum()

    loss_sum, count = DistillModule(student)(ids, torch.arange(2)[None], head_loss)
    loss_sum.backward()
    assert count == 0 and loss_sum.item() == 0.0
    for name, param in student.named_parameters():
        assert param.grad is not None, name
        assert not param.grad.any(), name


def save(model, path: Path, tokenizer=None) -> str:
    model.save_pretrained(path)
    if tokenizer is not None:
        tokenizer.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def toolcalc_tokenizer():
    from worlds.toolcalc.tokenizer import TOKENIZER_DIR, load_tokenizer
    return load_tokenizer(TOKENIZER_DIR)


def test_vocabulary_padding_is_shared_and_mismatches_are_named(tmp_path, toolcalc_tokenizer):
    from opd.config import ModelConfig
    from opd.errors import VocabularyError
    from opd.inputs import check_vocabulary

    tokens = len(toolcalc_tokenizer)
    tokenizer_dir = tmp_path / "tokenizer"
    toolcalc_tokenizer.save_pretrained(tokenizer_dir)
    student = save(tiny_model(vocab=tokens), tmp_path / "student")
    padded = save(tiny_model(vocab=tokens + 64, seed=1), tmp_path / "padded", toolcalc_tokenizer)
    models = ModelConfig(student=student, teacher=padded, tokenizer=str(tokenizer_dir))
    assert check_vocabulary(models, toolcalc_tokenizer) == tokens

    small = save(tiny_model(vocab=tokens - 1, seed=1), tmp_path / "small")
    with pytest.raises(VocabularyError, match=r"model.teacher: the vocabulary of .*small has "
                                              r"%d entries" % (tokens - 1)):
        check_vocabulary(ModelConfig(student=student, teacher=small,
                                     tokenizer=str(tokenizer_dir)), toolcalc_tokenizer)

    from conftest import build_tokenizer
    other = build_tokenizer(toolcalc_tokenizer.chat_template)
    other_dir = save(tiny_model(vocab=tokens + 64, seed=1), tmp_path / "other", other)
    with pytest.raises(VocabularyError, match=r"model.teacher: the tokenizer in .*other differs "
                                              r"from model.tokenizer \("):
        check_vocabulary(ModelConfig(student=student, teacher=other_dir,
                                     tokenizer=str(tokenizer_dir)), toolcalc_tokenizer)
