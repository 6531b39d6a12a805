"""Real engines on 2 ranks, pinned against a single-process reference; then a short training run.

    torchrun --nproc_per_node 2 tests/dist_scripts/check_step.py WORLD_DIR OUT_JSON [key=value ...]

1. Rollouts of the sharded student gathered once equal those gathered per forward (lockstep).
2. One optimizer step on fixed, unevenly split trajectories (rank 0 gets twice rank 1's, packed
   into several micro-batches, so rank 1 runs empty ones): loss, gradient norm and the updated
   weights must equal plain PyTorch on one process over all trajectories. Adam's eps is 1, so
   the first update is ~lr * gradient and the weights check every gradient element.
3. `train` for the recipe's steps (rollout, teacher, loss, checkpoint, export).
Rank 0 writes the figures to OUT_JSON; the test asserts on them.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as launch/train.py does

import torch

from opd.config import load_config
from opd.dist import barrier, init_world, shutdown


def same_rollouts(run) -> bool:
    from opd.dist import all_gather_objects, lockstep
    from opd.rollout import RolloutConfig, rollout

    prompts = run.inputs.prompts[run.world.rank::run.world.world_size][:3 - run.world.rank]
    cfg = RolloutConfig(max_turns=2, max_new_tokens=8, max_total_len=256, batch_size=2)
    with run.student.generation_context(True) as model:
        once = rollout(model, run.inputs.chat, run.executor, prompts, cfg, seed=5)
    with run.student.generation_context(False) as model:
        stepped = rollout(model, run.inputs.chat, run.executor, prompts, cfg, seed=5,
                          sync=lockstep())
    equal = [a.input_ids == b.input_ids and a.assistant_mask == b.assistant_mask
             for a, b in zip(once, stepped)]
    return all(all(flags) for flags in all_gather_objects(equal))


def reference_step(config, trajectories, lr: float) -> tuple[float, float, torch.nn.Module]:
    """Mean loss over every target token, its gradient norm, and the model after one AdamW step."""
    from transformers import AutoModelForCausalLM

    from opd.backends import adamw_param_groups
    from opd.loss import distillation_loss
    from opd.packing import pack_trajectories

    student = AutoModelForCausalLM.from_pretrained(config.model.student, dtype=torch.float32)
    teacher = AutoModelForCausalLM.from_pretrained(config.model.teacher, dtype=torch.float32)
    ids, attention, targets = pack_trajectories(trajectories, 0, "cpu")
    with torch.no_grad():
        teacher_logits = teacher(input_ids=ids, attention_mask=attention).logits[:, :-1]
    student_logits = student(input_ids=ids, attention_mask=attention).logits[:, :-1]
    loss = distillation_loss(student_logits, teacher_logits, targets,
                             temperature=config.loss.temperature, direction=config.loss.direction)
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(student.parameters(), float("inf"))
    optimizer = torch.optim.AdamW(adamw_param_groups(student, config.optim.weight_decay), lr=lr,
                                  betas=tuple(config.optim.betas), eps=config.optim.eps)
    optimizer.step()
    return float(loss), float(norm), student


def main() -> None:
    world_dir, out_path, overrides = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3:]
    from opd.data import completion_trajectory, load_jsonl
    from opd.inputs import load_inputs
    from opd.plugins import resolve_plugins
    from opd.steps import learning_rate
    from opd.trainer import optimize, start, train

    config = load_config(world_dir / "recipe.yaml", None, overrides)
    world = init_world("cpu", "gloo", 1)
    check = replace(config, optim=replace(config.optim, eps=1.0, grad_clip=0.0,
                                          schedule="constant", warmup_steps=0),
                    checkpoint=replace(config.checkpoint, resume="never"))
    plugins = resolve_plugins(check)
    run = start(check, plugins, load_inputs(check), world)
    figures = {"same_rollouts": same_rollouts(run)}

    everyone = [completion_trajectory(run.inputs.chat, r["messages"], r.get("tools"))
                for r in load_jsonl(world_dir / "completions.jsonl")[:6]]
    mine = everyone[:4] if world.rank == 0 else everyone[4:6]
    # A budget of the longest conversation: rank 0's four need several micro-batches.
    longest = max(len(t.input_ids) for t in everyone)
    run.config = replace(check, train=replace(check.train, micro_batch_tokens=longest))
    learned = optimize(run, mine, step=1)
    with tempfile.TemporaryDirectory() as scratch:
        exported = Path(scratch) / "student"
        run.student.export_hf(exported)
        barrier()
        if world.is_main:
            from transformers import AutoModelForCausalLM

            ref_loss, ref_norm, reference = reference_step(
                check, everyone, learning_rate(1, check.optim, check.train.steps))
            trained = AutoModelForCausalLM.from_pretrained(exported, dtype=torch.float32)
            initial = AutoModelForCausalLM.from_pretrained(check.model.student, dtype=torch.float32)
            expected = dict(reference.named_parameters())
            before = dict(initial.named_parameters())
            figures.update(
                loss=learned["loss"], ref_loss=ref_loss, grad_norm=learned["grad_norm"],
                ref_grad_norm=ref_norm, micro_batches=learned["micro_batches"],
                target_tokens=learned["target_tokens"],
                max_weight_error=max(float((p - expected[n]).abs().max())
                                     for n, p in trained.named_parameters()),
                max_weight_update=max(float((p - before[n]).abs().max())
                                      for n, p in trained.named_parameters()))
        barrier()
    run.executor.close()
    run.log.close()

    final = train(config, plugins, load_inputs(config), world)
    if world.is_main:
        figures["final"] = str(final)
        out_path.write_text(json.dumps(figures, indent=2))
    shutdown()


if __name__ == "__main__":
    main()
