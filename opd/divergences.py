"""Every training loss declared once: its name, the teacher signal it reads, its kernel.

`loss.direction` names an entry. Config validation (opd.config), the losses (opd.loss,
opd.loss_parallel, opd.loss_sampled) and the trainer read what they need from here, so adding a
divergence is one kernel function in opd/loss_parallel.py plus one `Divergence(...)` line below.
This module imports no torch: the config layer reads it.

Teacher signals, from the richest to the poorest:
    distribution  the teacher's whole next-token distribution (hidden states + lm_head, or logits)
    topk          its top-k ids and log-probs plus the log of the mass outside them (TopKTeacher)
    sampled       its log-prob of each sampled token only (what a served teacher returns cheaply)
    labels        no teacher: the data's tokens are a one-hot teacher (SFT)
A loss that reads a richer signal cannot run from a poorer one; `topk` says whether a
full-distribution loss may run from a top-k teacher instead (see `topk_refusal` when not).
"""

from __future__ import annotations

from dataclasses import dataclass

from opd.errors import ConfigError

SIGNALS = ("distribution", "topk", "sampled", "labels")

# Measured in opd/loss.py's docstring (V = 32768, Gaussian teacher logits).
_TOPK_TAIL = ("{name} over a top-k teacher weighs the student's own mass in the teacher's unknown "
              "tail and loses 55-90% of the loss even at top-k mass 0.999; use forward_kl with a "
              "top-k teacher")


@dataclass(frozen=True)
class Divergence:
    name: str  # the value of loss.direction
    signal: str  # the teacher signal it reads, one of SIGNALS
    # Function of opd.loss_parallel giving a chunk's row losses and student-logit gradients.
    kernel: str
    topk: bool  # may run from a top-k teacher (an approximation; a lower bound of the loss)
    topk_refusal: str  # why not, when `topk` is False and the signal is a distribution
    needs_sampler_logprobs: bool  # the sampler must record its log-prob of each sampled token
    # The mean loss divided by temperature ** 2 is this divergence's value per target token.
    kl_reported: bool
    chunk_buffers: int  # [chunk, vocab] fp32 buffers the chunked loss keeps live
    doc: str

    @property
    def needs_teacher(self) -> bool:
        """Whether some teacher must score the student's samples (SFT needs none)."""
        return self.signal != "labels"


_ENTRIES = (
    Divergence("forward_kl", "distribution", "forward_kl_rows", topk=True, topk_refusal="",
               needs_sampler_logprobs=False, kl_reported=True, chunk_buffers=3,
               doc="KL(teacher || student) over the full vocabulary (mass-covering)"),
    Divergence("reverse_kl", "distribution", "reverse_kl_rows", topk=False,
               topk_refusal=_TOPK_TAIL.format(name="reverse_kl"), needs_sampler_logprobs=False,
               kl_reported=True, chunk_buffers=3,
               doc="KL(student || teacher) over the full vocabulary (mode-seeking)"),
    Divergence("jsd", "distribution", "jsd_rows", topk=False,
               topk_refusal=_TOPK_TAIL.format(name="jsd"), needs_sampler_logprobs=False,
               kl_reported=False, chunk_buffers=4,
               doc="generalised Jensen-Shannon divergence with mix loss.beta (0: forward_kl, "
                   "1: reverse_kl)"),
    Divergence("hybrid_kl", "distribution", "hybrid_kl_rows", topk=False,
               topk_refusal=_TOPK_TAIL.format(name="hybrid_kl"), needs_sampler_logprobs=False,
               kl_reported=True, chunk_buffers=4,
               doc="forward_kl on the tokens where the teacher's top token has probability >= "
                   "loss.forward_kl_above, reverse_kl on the others"),
    Divergence("sft", "labels", "cross_entropy_rows", topk=False, topk_refusal="",
               needs_sampler_logprobs=False, kl_reported=False, chunk_buffers=2,
               doc="cross-entropy of data.completions' tokens: forward_kl to a one-hot teacher"),
    Divergence("sampled_reverse_kl", "sampled", "cross_entropy_rows", topk=False,
               topk_refusal="", needs_sampler_logprobs=True, kl_reported=False,
               chunk_buffers=2,
               doc="reverse KL in policy-gradient form from the teacher's log-prob of each "
                   "sampled token, plus an optional task reward (opd.loss_sampled)"),
)
REGISTRY = {entry.name: entry for entry in _ENTRIES}
NAMES = tuple(REGISTRY)


def names(signal: str) -> tuple[str, ...]:
    """The directions that read `signal`, in registry order."""
    return tuple(entry.name for entry in _ENTRIES if entry.signal == signal)


def unknown_direction(name: object) -> str:
    """The one sentence that refuses a direction not in the registry."""
    return f"loss.direction must be one of {', '.join(NAMES)}, got {name!r}."


def get(name: str) -> Divergence:
    """The registry entry of `name`; ConfigError naming loss.direction when there is none."""
    if name not in REGISTRY:
        raise ConfigError(unknown_direction(name))
    return REGISTRY[name]
