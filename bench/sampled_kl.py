"""Sampled-token reverse KL against the full-vocabulary reverse KL: cost and gradient variance.

One JSON line per (vocabulary, case). Cases: `full_reverse_kl` (fused_distillation_loss,
direction reverse_kl, the teacher's hidden states and lm_head in the loss), `sampled_k1` and
`sampled_k3` (opd.loss_sampled with only the teacher's log-prob of each sampled token). Each
case runs in a fresh subprocess on the same inputs: a student lm_head W [V, H], a teacher lm_head
W + D (teacher hidden states = the student's), and BATCHES independent batches, each T fresh
prefixes (hidden states ~ N(0, 1)) with a 70% target mask and, for the sampled cases, one token
per position drawn from the student (drawing and the teacher's scoring are the rollout's and the
served teacher's work, done before the timed step, as in training).

Cost: forward + backward of the loss from hidden states (the loss's share of an optimizer step;
the model body is the same for every case), median wall and CPU time over --repeats steps after
a warm-up, and the peak extra memory (ru_maxrss rise after /proc/self/clear_refs).
Variance: the per-target-token mean gradient of W and of the hidden states in each batch; the
reported figure is the total variance across batches (sum over elements of the unbiased
per-element variance), and `*_var_ratio_to_full` its ratio to full_reverse_kl's in the same run.
At fixed prefixes full_reverse_kl's gradient has no sampling noise at all; its variance here is
the prefixes' alone, so the ratio is what sampling the token adds.

    python bench/sampled_kl.py                        # V = 1024 (toolcalc) and 151,936 (Qwen3)
    python bench/sampled_kl.py --vocab 1024 --batches 8
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

CASES = ("full_reverse_kl", "sampled_k1", "sampled_k3")
TARGET_FRACTION = 0.7
SCORE_ROWS = 256  # rows per chunk when drawing tokens and scoring them outside the timed step


def cpu_seconds():
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def weights(args):
    gen = torch.Generator().manual_seed(0)
    student = torch.randn(args.vocab, args.hidden, generator=gen) * (2.0 / args.hidden ** 0.5)
    teacher = student + torch.randn(args.vocab, args.hidden, generator=gen) / args.hidden ** 0.5
    return student.requires_grad_(), teacher


def batch(args, index, student, teacher, sampled):
    """Hidden states, mask, and for sampled cases the drawn tokens and their teacher log-probs."""
    gen = torch.Generator().manual_seed(1000 + index)
    hidden = torch.randn(args.tokens, args.hidden, generator=gen)
    mask = torch.rand(args.tokens, generator=gen) < TARGET_FRACTION
    if not sampled:
        return hidden.requires_grad_(), mask, None, None
    labels, teacher_logprobs = [], []
    with torch.no_grad():
        for start in range(0, args.tokens, SCORE_ROWS):
            rows = hidden[start:start + SCORE_ROWS]
            probs = (rows @ student.t()).softmax(-1)
            drawn = torch.multinomial(probs, 1, generator=gen).squeeze(1)
            teacher_logp = (rows @ teacher.t()).log_softmax(-1)
            labels.append(drawn)
            teacher_logprobs.append(teacher_logp.gather(1, drawn[:, None]).squeeze(1))
    return hidden.requires_grad_(), mask, torch.cat(labels), torch.cat(teacher_logprobs)


def loss_of(case, student, teacher, inputs):
    from opd.loss import fused_distillation_loss
    from opd.loss_sampled import fused_sampled_kl_loss

    hidden, mask, labels, teacher_logprobs = inputs
    if case == "full_reverse_kl":
        loss = fused_distillation_loss(hidden, student, hidden.detach(), teacher, mask,
                                       direction="reverse_kl", reduction="sum")
        return loss, float(loss)
    loss, stats = fused_sampled_kl_loss(hidden, student, labels, mask, teacher_logprobs,
                                        estimator=case.removeprefix("sampled_"))
    return loss, float(stats["kl_k3_sum"])


def run_case(case, args):
    torch.set_num_threads(args.threads)
    student, teacher = weights(args)
    sampled = case != "full_reverse_kl"
    batches = [batch(args, index, student, teacher, sampled) for index in range(args.batches)]

    kl_sums = []

    def step(inputs):
        student.grad = inputs[0].grad = None
        loss, kl_sum = loss_of(case, student, teacher, inputs)
        loss.backward()
        kl_sums.append(kl_sum / float(inputs[1].sum()))

    step(batches[0])  # warm-up: thread pools, allocator
    Path("/proc/self/clear_refs").write_text("5")  # peak RSS := current RSS
    baseline_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    wall, cpu = [], []
    for index in range(args.repeats):
        start, start_cpu = time.perf_counter(), cpu_seconds()
        step(batches[index % len(batches)])
        wall.append(time.perf_counter() - start)
        cpu.append(cpu_seconds() - start_cpu)
    peak_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    count = len(batches)
    sums = {name: None for name in ("lm_head", "hidden")}
    squares = dict(sums)
    for inputs in batches:
        step(inputs)
        targets = float(inputs[1].sum())
        for name, grad in zip(sums, (student.grad, inputs[0].grad)):
            grad = grad.double() / targets
            sums[name] = grad if sums[name] is None else sums[name] + grad
            squares[name] = grad.square() if squares[name] is None \
                else squares[name] + grad.square()
    result = {"case": case, "time_s": round(statistics.median(wall), 3),
              "cpu_s": round(statistics.median(cpu), 3),
              "peak_extra_mb": round((peak_kb - baseline_kb) / 1024, 1),
              # KL(p || q) per target token: exact (full), the k3 estimate (sampled)
              "kl_per_token": round(statistics.mean(kl_sums[-count:]), 4)}
    for name in sums:
        mean = sums[name] / count
        variance = (squares[name] / count - mean.square()) * count / (count - 1)
        result[f"{name}_grad_var"] = float(f"{float(variance.clamp(min=0).sum()):.4g}")
        result[f"{name}_grad_mean_sq"] = float(f"{float(mean.square().sum()):.4g}")
    return result


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vocab", type=int, nargs="+", default=[1024, 151936])
    parser.add_argument("--tokens", type=int, nargs="+", default=None,
                        help="tokens per batch, one per vocabulary (default 2048 at V <= 32768, "
                             "else 512)")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--batches", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--case", help=argparse.SUPPRESS)  # run one case in this process
    args = parser.parse_args()
    if args.case:
        args.vocab, args.tokens = args.vocab[0], args.tokens[0]
        print(json.dumps(run_case(args.case, args)))
        return
    tokens = args.tokens or [2048 if vocab <= 32768 else 512 for vocab in args.vocab]
    for vocab, count in zip(args.vocab, tokens):
        size = {"V": vocab, "T": count, "H": args.hidden, "batches": args.batches,
                "target_fraction": TARGET_FRACTION, "threads": args.threads}
        full = None
        for case in CASES:
            command = [sys.executable, __file__, "--case", case, "--vocab", str(vocab),
                       "--tokens", str(count), "--hidden", str(args.hidden),
                       "--batches", str(args.batches), "--repeats", str(args.repeats),
                       "--threads", str(args.threads)]
            done = subprocess.run(command, capture_output=True, text=True)
            if done.returncode != 0:
                lines = done.stderr.strip().splitlines() or [f"exit status {done.returncode}"]
                print(json.dumps({"case": case, **size, "failed": lines[-1]}), flush=True)
                continue
            result = json.loads(done.stdout.strip().splitlines()[-1])
            if case == "full_reverse_kl":
                full = result
            elif full is not None:
                for key in ("time_s", "cpu_s", "peak_extra_mb"):
                    result[f"{key}_ratio_to_full"] = round(result[key] / full[key], 3)
                for name in ("lm_head", "hidden"):
                    result[f"{name}_var_ratio_to_full"] = round(
                        result[f"{name}_grad_var"] / full[f"{name}_grad_var"], 2)
            print(json.dumps({**result, **size}), flush=True)


if __name__ == "__main__":
    main()
