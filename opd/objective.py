"""The student's loss on one micro-batch, given the teacher's signal: the one head every
divergence goes through.

The student engine calls the head inside its forward with its final hidden states and lm_head
(opd.backends: ZeRO-3 gathers the head for that forward), so the loss never holds [N, V] logits.
A full-distribution signal brings the teacher's hidden states and its opened head; a top-k signal
its ids, log-probs and the rest's mass; SFT is a one-hot top-k teacher on the labels
(`opd.loss.one_hot_teacher`), not a head of its own.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from opd.config import LossConfig
from opd.loss import TopKTeacher, fused_distillation_loss
from opd.teachers.base import FullDistribution, SampledLogprobs, TeacherSignal


@dataclass
class DistillationHead:
    signal: TeacherSignal
    teacher_head: tuple[torch.Tensor | None, torch.Tensor | None]  # opened by open_head(signal)
    target_mask_N: torch.Tensor
    loss: LossConfig
    vocab_size: int

    def __call__(self, hidden_NH, weight_VH, bias_V) -> tuple[torch.Tensor, torch.Tensor]:
        """Sum of the per-token loss over targets, and the target count."""
        loss, signal = self.loss, self.signal
        # SFT is forward KL to the one-hot teacher: the labels' cross-entropy.
        direction = "forward_kl" if loss.direction == "sft" else loss.direction
        common = dict(student_bias=bias_V, vocab_size=self.vocab_size,
                      chunk_size=loss.chunk_size or None, temperature=loss.temperature,
                      direction=direction, beta=loss.beta, reduction="sum")
        if isinstance(signal, FullDistribution):
            teacher_weight, teacher_bias = self.teacher_head
            loss_sum = fused_distillation_loss(hidden_NH, weight_VH, signal.hidden_NH,
                                               teacher_weight, self.target_mask_N,
                                               teacher_bias=teacher_bias, **common)
        elif isinstance(signal, TopKTeacher):
            loss_sum = fused_distillation_loss(hidden_NH, weight_VH,
                                               target_mask=self.target_mask_N,
                                               teacher_topk=signal, **common)
        else:
            assert isinstance(signal, SampledLogprobs)
            raise NotImplementedError("sampled-token loss")
        return loss_sum, self.target_mask_N.sum()
