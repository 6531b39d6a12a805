"""Peak extra memory and forward+backward time of distillation losses, one JSON line per case.

Every case runs in a fresh subprocess that builds the same inputs (student hidden states and
lm_head weight, teacher hidden states and lm_head weight, a 70% target mask), runs one untimed
warm-up step (torch.compile, thread pools), resets the peak-RSS mark (/proc/self/clear_refs),
then times `--repeats` forward+backward steps. Memory is the ru_maxrss rise over the RSS after
warm-up (peak RSS, not tracemalloc); time is the median wall time and the median CPU time
(user + sys, steadier on a shared machine). Logits-based cases include forming the logits from
the hidden states, as a trainer must. Ratios are to the seed's loss measured in the same run.
A case whose estimated memory exceeds `--max-gb` is reported as skipped, not run.

    python bench/kl.py            # T=4096, V=32768, H_s=256, H_t=512, 70% targets
    python bench/kl.py --large    # T=8192, V=151936
"""

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def _reference_loss():
    """The seed's loss, kept as the tests' reference (tests/reference_loss.py)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("reference_loss",
                                                  ROOT / "tests" / "reference_loss.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.distillation_loss

CASES = ("seed", "ours_logits", "ours_fused", "ours_fused_top64", "liger", "liger_compiled")
# Peak extra bytes per [T, V] fp32 element, measured at the default size (seed 2.8 GB,
# ours_logits 1.7 GB over 0.54 GB of logits); used only to skip cases that cannot fit.
BYTES_PER_LOGIT = {"seed": 22.0, "ours_logits": 13.5}
LIGER_CHUNK_ROWS = 1024


def build_inputs(args):
    gen = torch.Generator().manual_seed(0)
    student_hidden = torch.randn(args.tokens, args.student_hidden, generator=gen)
    student_weight = torch.randn(args.vocab, args.student_hidden, generator=gen)
    student_weight *= 2.0 / args.student_hidden ** 0.5
    teacher_hidden = torch.randn(args.tokens, args.teacher_hidden, generator=gen)
    teacher_weight = torch.randn(args.vocab, args.teacher_hidden, generator=gen)
    teacher_weight *= 3.0 / args.teacher_hidden ** 0.5
    mask = torch.rand(args.tokens, generator=gen) < args.target_fraction
    return (student_hidden.requires_grad_(), student_weight.requires_grad_(), teacher_hidden,
            teacher_weight, mask)


def make_step(case, inputs):
    """A closure that runs forward + backward once and returns the loss value, and extra figures."""
    student_hidden, student_weight, teacher_hidden, teacher_weight, mask = inputs
    if case in ("seed", "ours_logits"):
        seed_loss = _reference_loss()

        from opd.loss import distillation_loss
        loss_fn = seed_loss if case == "seed" else distillation_loss

        def step():
            student_logits = (student_hidden @ student_weight.t())[None]
            with torch.no_grad():
                teacher_logits = (teacher_hidden @ teacher_weight.t())[None]
            loss = loss_fn(student_logits, teacher_logits, mask[None])
            loss.backward()
            return loss.item()
        return step, {}
    if case.startswith("ours_fused"):
        from opd.loss import TopKTeacher, fused_distillation_loss
        teacher = dict(teacher_hidden=teacher_hidden, teacher_lm_head_weight=teacher_weight)
        extra = {}
        if case == "ours_fused_top64":
            # A teacher server sends top-k log-probs; forming them is not part of this step.
            with torch.no_grad():
                topk = TopKTeacher.from_logits(teacher_hidden @ teacher_weight.t(), 64)
            teacher = dict(teacher_topk=topk)
            extra["teacher_top64_mass"] = round(float(topk.logprobs[mask].exp().sum(-1).mean()), 4)

        def step():
            loss = fused_distillation_loss(student_hidden, student_weight, target_mask=mask,
                                           **teacher)
            loss.backward()
            return loss.item()
        return step, extra
    from liger_kernel.chunked_loss import LigerFusedLinearJSDLoss
    liger = LigerFusedLinearJSDLoss(weight_hard_loss=0.0, weight_soft_loss=1.0, beta=0.0,
                                    compiled=case == "liger_compiled",
                                    chunk_size=LIGER_CHUNK_ROWS)
    labels = torch.where(mask, 0, -100)

    def step():
        loss = liger(student_hidden, student_weight, teacher_hidden, teacher_weight, labels)
        loss.backward()
        return loss.item()
    return step, {}


def cpu_seconds():
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def run_case(case, args):
    torch.set_num_threads(args.threads)
    inputs = build_inputs(args)
    step, extra = make_step(case, inputs)
    start = time.perf_counter()
    step()
    first_step_s = time.perf_counter() - start
    wall, cpu, loss = [], [], None
    for tensor in inputs[:2]:
        tensor.grad = None
    Path("/proc/self/clear_refs").write_text("5")  # peak RSS := current RSS
    baseline_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    for _ in range(args.repeats):
        for tensor in inputs[:2]:
            tensor.grad = None
        start, start_cpu = time.perf_counter(), cpu_seconds()
        loss = step()
        wall.append(time.perf_counter() - start)
        cpu.append(cpu_seconds() - start_cpu)
    peak_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"case": case, "loss": loss, "peak_extra_mb": round((peak_kb - baseline_kb) / 1024, 1),
            "time_s": round(statistics.median(wall), 3), "cpu_s": round(statistics.median(cpu), 3),
            "times_s": [round(t, 3) for t in wall], "first_step_s": round(first_step_s, 3), **extra}


def estimated_gb(case, args):
    logits = args.tokens * args.vocab * 4
    if case in BYTES_PER_LOGIT:
        return BYTES_PER_LOGIT[case] * logits / 4 / 2 ** 30
    if case.startswith("liger"):
        return 8 * LIGER_CHUNK_ROWS * args.vocab * 4 / 2 ** 30
    return 0.0


def available_gb():
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) / 2 ** 20
    return float("inf")


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--large", action="store_true", help="T=8192, V=151936")
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=CASES)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--student-hidden", type=int, default=256)
    parser.add_argument("--teacher-hidden", type=int, default=512)
    parser.add_argument("--target-fraction", type=float, default=0.7)
    parser.add_argument("--max-gb", type=float, default=None,
                        help="skip cases estimated above this (default: half of MemAvailable)")
    parser.add_argument("--case", help=argparse.SUPPRESS)  # run one case in this process
    args = parser.parse_args()
    if args.large:
        args.tokens, args.vocab = 8192, 151936
    if args.case:
        print(json.dumps(run_case(args.case, args)))
        return
    max_gb = args.max_gb if args.max_gb is not None else available_gb() / 2
    size = {"T": args.tokens, "V": args.vocab, "H_s": args.student_hidden,
            "H_t": args.teacher_hidden, "target_fraction": args.target_fraction,
            "threads": args.threads}
    seed = None
    for case in ["seed"] + [c for c in args.cases if c != "seed"]:
        if estimated_gb(case, args) > max_gb:
            reason = f"needs ~{estimated_gb(case, args):.0f} GB, more than --max-gb {max_gb:.1f}"
            print(json.dumps({"case": case, **size, "skipped": reason}), flush=True)
            continue
        command = [sys.executable, __file__, "--case", case, "--repeats", str(args.repeats),
                   "--threads", str(args.threads), "--tokens", str(args.tokens),
                   "--vocab", str(args.vocab), "--student-hidden", str(args.student_hidden),
                   "--teacher-hidden", str(args.teacher_hidden),
                   "--target-fraction", str(args.target_fraction)]
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            lines = done.stderr.strip().splitlines() or [f"exit status {done.returncode}"]
            print(json.dumps({"case": case, **size, "skipped": lines[-1]}), flush=True)
            continue
        result = json.loads(done.stdout.strip().splitlines()[-1])
        if case == "seed":
            seed = result
        elif seed is not None:
            for figure, key in [("memory", "peak_extra_mb"), ("time", "time_s"), ("cpu", "cpu_s")]:
                result[f"{figure}_ratio_to_seed"] = round(result[key] / seed[key], 4)
            result["loss_rel_diff_to_seed"] = float(
                f"{abs(result['loss'] - seed['loss']) / abs(seed['loss']):.3g}")
        print(json.dumps({**result, **size}), flush=True)


if __name__ == "__main__":
    main()
