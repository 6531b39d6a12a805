"""The student's loss on one micro-batch, given the teacher's signal: the one head every
divergence goes through.

The student engine calls the head inside its forward with its final hidden states and lm_head
(opd.backends: ZeRO-3 gathers the head for that forward), so the loss never holds [N, V] logits.
The direction's registry entry (opd.divergences) says what it reads. A full-distribution signal
brings the teacher's hidden states and its opened head; a top-k signal its ids, log-probs and the
rest's mass; SFT reads the labels (the cross-entropy is forward KL to a one-hot teacher, through
the same chunked pass); a sampled-token signal (or none, for pure RL)
goes to the policy-gradient estimator (opd.loss_sampled) with the sampler's log-probs and the
episodes' reward advantages.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from opd import divergences
from opd.config import LossConfig
from opd.loss import TopKTeacher, fused_cross_entropy_loss, fused_distillation_loss
from opd.loss_sampled import fused_sampled_kl_loss
from opd.teachers.base import FullDistribution, SampledLogprobs, TeacherSignal


@dataclass
class DistillationHead:
    signal: TeacherSignal | None  # None: SFT, or pure RL (loss.distill_weight = 0)
    teacher_head: tuple[torch.Tensor | None, torch.Tensor | None]  # opened by open_head(signal)
    target_mask_N: torch.Tensor
    config: LossConfig  # the loss section
    vocab_size: int
    # sft and sampled_reverse_kl: the token each position predicts; sampled_reverse_kl: the
    # sampler's log-prob of it and the episode's reward advantage on each target token
    labels_N: torch.Tensor | None = None
    sampler_logprobs_N: torch.Tensor | None = None
    advantages_N: torch.Tensor | None = None
    # Per call: the sampled estimator's statistics, or hybrid_kl's forward-KL token count
    stats: dict[str, torch.Tensor] = field(default_factory=dict)

    def loss(self, hidden_NH, weight_VH, bias_V) -> tuple[torch.Tensor, torch.Tensor]:
        """Sum of the per-token loss over targets, and the target count.

        The student engine gets this bound method, not the head: FSDP2 rebuilds dataclass
        arguments of a forward when it casts inputs, which would cast the teacher's signal and
        leave `stats` on a copy."""
        loss, signal = self.config, self.signal
        reads = divergences.get(loss.direction).signal
        common = dict(student_bias=bias_V, vocab_size=self.vocab_size,
                      chunk_size=loss.chunk_size or None, temperature=loss.temperature,
                      reduction="sum")
        if reads == "labels":
            assert self.labels_N is not None
            loss_sum = fused_cross_entropy_loss(hidden_NH, weight_VH, self.labels_N,
                                                self.target_mask_N, **common)
        elif reads == "sampled":
            assert self.labels_N is not None
            assert signal is None or isinstance(signal, SampledLogprobs)
            loss_sum, stats = fused_sampled_kl_loss(
                hidden_NH, weight_VH, self.labels_N, self.target_mask_N,
                None if signal is None else signal.logprobs_N,
                sampler_logprobs=self.sampler_logprobs_N, advantages=self.advantages_N,
                estimator=loss.kl_estimator, distill_weight=loss.distill_weight,
                reward_weight=loss.reward_weight, importance_cap=loss.importance_cap,
                advantage_clip=loss.advantage_clip, **common)
            self.stats = stats
        elif isinstance(signal, FullDistribution):
            teacher_weight, teacher_bias = self.teacher_head
            counts: dict[str, torch.Tensor] = {}
            loss_sum = fused_distillation_loss(hidden_NH, weight_VH, signal.hidden_NH,
                                               teacher_weight, self.target_mask_N,
                                               teacher_bias=teacher_bias,
                                               direction=loss.direction, beta=loss.beta,
                                               forward_kl_above=loss.forward_kl_above,
                                               counts=counts, **common)
            self.stats = counts
        else:
            assert isinstance(signal, TopKTeacher)
            loss_sum = fused_distillation_loss(hidden_NH, weight_VH,
                                               target_mask=self.target_mask_N,
                                               teacher_topk=signal, direction=loss.direction,
                                               beta=loss.beta,
                                               forward_kl_above=loss.forward_kl_above, **common)
        return loss_sum, self.target_mask_N.sum()
