"""Per-GPU memory of a served teacher (`teacher.engine: served`), for `--dry-run`.

The teacher runs in vLLM servers of `tp` GPUs each (opd.slurm_teachers.server_tp_size), not on
the trainer's ranks. From the teacher's config.json alone (nothing loaded), with b its weights'
bytes per parameter (bf16 2, fp32 4, teacher.quantization=fp8 1) and c the KV cache's (the
dtype's: 2 or 4):

  weights     N_t x b / tp            vLLM shards every layer, embedding and head over the tp
                                      GPUs (a MoE teacher's experts too, sliced or, with
                                      teacher.expert_parallel, whole experts per GPU)
  KV cache    per token: L x 2 x max(1, KV_heads / tp) x head_dim x c (tp beyond the KV heads
              replicates them), for the conversations in flight: each trainer rank keeps
              teacher.in_flight requests per server, of up to rollout.max_total_len tokens
              (vLLM queues what does not fit its share)
  log-probs   the fp32 logits and their log-softmax of one prefill chunk: 2 x C x V x 4 / tp
              (vocabulary-parallel head), C = 8192 tokens (vLLM's chunk, max_num_batched_tokens)
"""

from __future__ import annotations

from opd.backends.memory import ModelShape
from opd.backends.memory import _size as size

PREFILL_CHUNK = 8192


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
        f"  per teacher GPU: weights {size(weights)} + KV cache {size(kv_token)} per token, "
        f"{size(kv)} for {in_flight} conversations in flight ({trainer_ranks} ranks x "
        f"teacher.in_flight={served.in_flight}) of {config.rollout.max_total_len} tokens + "
        f"prompt log-probs {size(logits)} (fp32 logits and log-softmax of a "
        f"{PREFILL_CHUNK}-token prefill chunk)",
        f"  teacher GPU peak: {size(weights + kv + logits)} of the "
        f"teacher.gpu_memory_utilization={served.gpu_memory_utilization:g} share vLLM takes "
        f"(weights + logits alone: {size(weights + logits)}; vLLM queues conversations "
        "beyond its KV cache)",
    ]
