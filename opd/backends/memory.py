"""Per-rank memory of the student and the teacher, for `--dry-run`.

Sizes come from each model's config (parameters counted on the meta device: nothing is loaded).
Every figure is a product a reader can redo by hand (docs/qwen3.md works one through), with c the
compute dtype's bytes (bf16 2, fp32 4), W the ranks and T = train.micro_batch_tokens:

  model states   N x (params + grads + Adam bytes) / W          (see `student_memory`)
  gathered       2 x largest layer (or lm_head) x c              (the gathered and the prefetched)
  activations    T x L x layer_bytes, or with gradient checkpointing T x (L x H x c + layer_bytes)
                 layer_bytes = c x (4 H + 2 Q + 2 KV + 3 I): per token, a decoder layer keeps its
                 two norm inputs and residuals (4 H), q and the attention output (2 Q), k and v
                 (2 KV) and the MLP's gate, up and their product (3 I); Q, KV = heads, kv heads x
                 head_dim. Attention is flash / SDPA: no T x T term.
  loss           3 [chunk, V] fp32 buffers (4 for jsd) + the lm_head's fp32 gradient V x H x 4
                 (opd.loss), chunk = loss.chunk_size or max(128, 12,582,912 // V)
  rollout        the whole student x c (gather once) + KV cache B x S x L x 2 KV x c
                 (B = rollout.batch_size, S = rollout.max_total_len)
  teacher        N_t x c_t / W (replicated: N_t x c_t; tensor_parallel: (N_t - E_t) x c_t / W +
                 E_t x c_t, AutoTP keeps the input embedding E_t = V x H whole on every rank)
                 + largest layer x c_t + T x layer_bytes_t (no grad: one layer at a time);
                 served: on the teacher's own GPUs (served_teacher_memory)
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from opd import divergences
from opd.backends import check_model_dir, decoder_layers, resolve_precision
from opd.loss import CHUNK_ELEMENTS, MIN_CHUNK_ROWS


@dataclass(frozen=True)
class ModelShape:
    parameters: int
    largest_layer: int  # parameters of the largest decoder layer or of the lm_head
    layers: int  # L
    hidden: int  # H
    q_dim: int  # Q = attention heads x head_dim
    kv_dim: int  # KV = key/value heads x head_dim
    intermediate: int  # I
    vocab: int  # V, the lm_head's rows
    embedding: int  # parameters of the input embedding
    kv_heads: int

    def layer_bytes(self, compute: int) -> int:
        """Activation bytes one decoder layer keeps per token for backward (module docstring)."""
        return compute * (4 * self.hidden + 2 * self.q_dim + 2 * self.kv_dim
                          + 3 * self.intermediate)


def model_shape(path: str, key: str = "model") -> ModelShape | None:
    """The shape of a model directory (config.json alone is enough), or None when absent."""
    if not (Path(path) / "config.json").is_file():
        return None
    from transformers import AutoConfig, AutoModelForCausalLM

    check_model_dir(path, key)  # a damaged config.json: one sentence, not a traceback

    config = AutoConfig.from_pretrained(path)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    head = model.get_output_embeddings().weight
    layers = list(decoder_layers(model))
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    return ModelShape(
        parameters=sum(p.numel() for p in model.parameters()),
        largest_layer=max([sum(p.numel() for p in layer.parameters()) for layer in layers]
                          + [head.numel()]),
        layers=len(layers), hidden=config.hidden_size, q_dim=heads * head_dim,
        kv_dim=kv_heads * head_dim, intermediate=config.intermediate_size, vocab=head.shape[0],
        embedding=model.get_input_embeddings().weight.numel(), kv_heads=kv_heads)


def _size(num_bytes: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if num_bytes >= scale:
            return f"{num_bytes / scale:.3g} {unit}"
    return f"{num_bytes:.0f} B"


def student_memory(parameters: int, largest_layer: int, world_size: int, *, bf16: bool,
                   backend: str, offload_optimizer: str) -> dict[str, float]:
    """Bytes per rank of the student's model states, and where they live.

    DeepSpeed keeps bf16 parameter and gradient partitions plus an fp32 master and two fp32 Adam
    moments (2 + 2 + 12 bytes per parameter over the world); FSDP2 keeps fp32 shards as the
    master (4 + 4 + 8). Training in fp32 needs no separate master (4 + 4 + 8). A gathered layer
    (and the one being prefetched) adds two full layers on the device.
    """
    compute = 2 if bf16 else 4
    master = 4 if bf16 and backend == "deepspeed" else 0
    shard_bytes = compute if backend == "deepspeed" else 4
    states = {"params": parameters * shard_bytes / world_size,
              "grads": parameters * shard_bytes / world_size,
              "optimizer": parameters * (8 + master) / world_size}
    working = 2 * largest_layer * compute
    offloaded = states["optimizer"] + states["grads"] if offload_optimizer == "cpu" else 0.0
    return {**states, "device": states["params"] + states["grads"] + states["optimizer"]
            - offloaded + working, "host": offloaded,
            "gather_once": parameters * compute}


def activation_bytes(shape: ModelShape, tokens: int, compute: int, checkpointing: bool) -> int:
    """Activations the student keeps for the backward of one packed micro-batch."""
    if checkpointing:  # layer inputs kept; one layer's intermediates recomputed at a time
        return tokens * (shape.layers * shape.hidden * compute + shape.layer_bytes(compute))
    return tokens * shape.layers * shape.layer_bytes(compute)


def loss_chunk_rows(vocab: int, chunk_size: int) -> int:
    return chunk_size or max(MIN_CHUNK_ROWS, CHUNK_ELEMENTS // vocab)


def loss_bytes(shape: ModelShape, chunk_rows: int, direction: str) -> tuple[int, int]:
    """(the fused loss's fp32 [chunk, V] buffers, its fp32 lm_head gradient [V, H])."""
    buffers = divergences.get(direction).chunk_buffers
    return buffers * chunk_rows * shape.vocab * 4, shape.vocab * shape.hidden * 4


def kv_cache_bytes(shape: ModelShape, batch: int, length: int, compute: int) -> int:
    return batch * length * shape.layers * 2 * shape.kv_dim * compute


def _missing(role: str, path: str) -> str:
    return f"{role}: {path} not found (the recipe's prepare step has not built it yet)"


def memory_estimate(config, world_size: int, device: str, tp_size: int | None = None) -> list[str]:
    """Lines of per-rank memory for the student and the teacher (dry run)."""
    def compute_bytes(precision: str) -> int:
        dtype = resolve_precision(precision, "sdpa", torch.device(device)).dtype
        return 2 if dtype == torch.bfloat16 else 4

    lines = []
    tokens = config.train.micro_batch_tokens
    student, teacher = model_shape(config.model.student, "model.student"), \
        model_shape(config.model.teacher, "model.teacher")
    train_peak = rollout_peak = 0.0
    if student is None:
        lines.append(_missing("student", config.model.student))
    else:
        n, c = student.parameters, compute_bytes(config.student.precision)
        lines.append(f"student: {n / 1e6:.1f}M parameters, {config.student.backend} sharded over "
                     f"{world_size} ranks, {'bf16' if c == 2 else 'fp32'}")
        for offload in ("none", "cpu"):
            m = student_memory(n, student.largest_layer, world_size, bf16=c == 2,
                               backend=config.student.backend, offload_optimizer=offload)
            chosen = offload == config.student.offload_optimizer
            lines.append(f"  optimizer offload {offload}{' (chosen)' if chosen else ''}: params "
                         f"{_size(m['params'])} + grads {_size(m['grads'])} + Adam "
                         f"{_size(m['optimizer'])} -> device {_size(m['device'])}, host "
                         f"{_size(m['host'])} per rank")
            if chosen:
                states, gather_once = m["device"], m["gather_once"]
        checkpointing = config.student.gradient_checkpointing
        activations = activation_bytes(student, tokens, c, checkpointing)
        rows = loss_chunk_rows(student.vocab, config.loss.chunk_size)
        buffers, head_grad = loss_bytes(student, rows, config.loss.direction)
        lines.append(f"  one micro-batch of {tokens} tokens: activations {_size(activations)} "
                     f"(gradient checkpointing {'on' if checkpointing else 'off'}) + loss "
                     f"{_size(buffers)} ([{rows}, {student.vocab}] fp32 buffers) + lm_head fp32 "
                     f"gradient {_size(head_grad)}")
        kv = kv_cache_bytes(student, config.rollout.batch_size, config.rollout.max_total_len, c)
        lines.append(f"  rollout gather-once holds the whole student: +{_size(gather_once)} "
                     f"on device, + KV cache {_size(kv)} ({config.rollout.batch_size} x "
                     f"{config.rollout.max_total_len} tokens) (student.generation_gather="
                     "per_step if that does not fit)")
        train_peak = states + activations + buffers + head_grad
        rollout_peak = states + kv + (gather_once if config.student.generation_gather == "once"
                                      else 2 * student.largest_layer * c)
    if not config.loss.needs_teacher:
        lines.append(f"teacher: none started (loss.direction={config.loss.direction}, "
                     f"loss.distill_weight={config.loss.distill_weight:g})")
    elif teacher is None:
        lines.append(_missing("teacher", config.model.teacher))
    elif config.teacher.engine == "served":  # on its own GPUs: the trainer's peak is the student's
        lines += served_teacher_memory(config, teacher, world_size)
    else:
        n, b = teacher.parameters, compute_bytes(config.teacher.precision)
        engine = config.teacher.engine
        share = {"replicated": n * b, "zero_inference": n * b / world_size,
                 "tensor_parallel": (n - teacher.embedding) * b / (tp_size or world_size)
                 + teacher.embedding * b}[engine]
        where = {"cpu": "host", "nvme": "NVMe"}.get(config.teacher.offload_param, "device")
        gathered, activations = teacher.largest_layer * b, tokens * teacher.layer_bytes(b)
        lines.append(f"teacher: {n / 1e6:.1f}M parameters, {engine}: {_size(share)} per rank on "
                     f"{where}, + {_size(gathered)} for the largest gathered layer or lm_head, + "
                     f"activations {_size(activations)} (one layer, {tokens} tokens, no grad)")
        tp = tp_size or world_size
        if engine == "tensor_parallel" and tp > teacher.kv_heads:
            lines.append(f"  AutoTP splits attention by KV heads: {teacher.kv_heads} over "
                         f"{tp} ranks leaves {tp - teacher.kv_heads} ranks without "
                         "attention weights (uneven memory and compute)")
        on_device = (share if where == "device" else 0.0) + gathered
        train_peak += on_device + activations
        rollout_peak += share if where == "device" else 0.0
    if student is not None and (teacher is not None or not config.loss.needs_teacher):
        lines.append(f"device peak per rank: training {_size(train_peak)}, rollout "
                     f"{_size(rollout_peak)}")
    return lines


PREFILL_CHUNK = 8192  # vLLM's prefill chunk (max_num_batched_tokens), an assumption


# Per-GPU memory of a served teacher (`teacher.engine: served`), for `--dry-run`.
#
# The teacher runs in vLLM servers of `tp` GPUs each (opd.slurm_teachers.server_tp_size), not on
# the trainer's ranks. From the teacher's config.json alone (nothing loaded), with b its weights'
# bytes per parameter (bf16 2, fp32 4, teacher.quantization=fp8 1) and c the KV cache's (the
# dtype's: 2 or 4):
#
#   weights     N_t x b / tp            vLLM shards every layer, embedding and head over the tp
#                                       GPUs (a MoE teacher's experts too, sliced or, with
#                                       teacher.expert_parallel, whole experts per GPU)
#   KV cache    per token: L x 2 x max(1, KV_heads / tp) x head_dim x c (tp beyond the KV heads
#               replicates them), for the conversations in flight: each trainer rank keeps
#               teacher.in_flight requests per server, of up to rollout.max_total_len tokens
#               (vLLM queues what does not fit its share)
#   log-probs   the fp32 logits and their log-softmax of one prefill chunk: 2 x C x V x 4 / tp
#               (vocabulary-parallel head), C = 8192 tokens (vLLM's chunk, max_num_batched_tokens)
def served_teacher_memory(config, teacher: ModelShape, trainer_ranks: int) -> list[str]:
    """Lines of the teacher servers' layout and memory per teacher GPU."""
    from opd.slurm_teachers import replicas_per_node, server_tp_size

    served, cluster = config.teacher, config.cluster
    tp = server_tp_size(config)
    c = 4 if served.precision == "fp32" else 2
    b = 1 if served.quantization == "fp8" else c
    if cluster.teacher_nodes:
        replicas = cluster.teacher_nodes * replicas_per_node(config)
        where = (f"{replicas} server(s) of tp {tp} on the job's {cluster.teacher_nodes} teacher "
                 f"node(s) ({replicas_per_node(config)} per node, cluster.teacher_nodes)")
    else:
        replicas = max(1, len(served.urls))
        where = (f"{replicas} server(s) of tp {tp} outside this job (teacher.urls; "
                 "launch/teacher_server.sh --tensor-parallel-size)")
    weights = teacher.parameters * b / tp
    head_dim = teacher.kv_dim // teacher.kv_heads
    kv_token = teacher.layers * 2 * max(1, teacher.kv_heads // tp) * head_dim * c
    in_flight = trainer_ranks * served.in_flight  # per server: every rank's requests to it
    kv = in_flight * config.rollout.max_total_len * kv_token
    logits = 2 * PREFILL_CHUNK * teacher.vocab * 4 / tp
    quantized = ", fp8 weights" if served.quantization == "fp8" else ""
    experts = ", expert parallel" if served.expert_parallel else ""
    return [
        f"teacher: {teacher.parameters / 1e6:.1f}M parameters, served: {where}{quantized}"
        f"{experts}; nothing of it on the trainer's ranks",
        f"  per teacher GPU: weights {_size(weights)} + KV cache {_size(kv_token)} per token, "
        f"{_size(kv)} for {in_flight} conversations in flight ({trainer_ranks} ranks x "
        f"teacher.in_flight={served.in_flight}) of {config.rollout.max_total_len} tokens + "
        f"prompt log-probs {_size(logits)} (fp32 logits and log-softmax of a "
        f"{PREFILL_CHUNK}-token prefill chunk)",
        f"  teacher GPU peak: {_size(weights + kv + logits)} of the "
        f"teacher.gpu_memory_utilization={served.gpu_memory_utilization:g} share vLLM takes "
        f"(weights + logits alone: {_size(weights + logits)}; vLLM queues conversations "
        "beyond its KV cache)",
    ]
