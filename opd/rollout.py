"""Batched multi-turn student rollouts.

B conversations sample concurrently, each row with its own turn state. A *phase* is one
assistant turn for every row still talking: the rows' full contexts are left-padded into one
batch, prefilled once, then decoded token by token with a KV cache until each row hits a stop
token or its own budget. Rows that called tools get their observations (executed together in the
tool sandbox) appended and join the next phase. Left padding with explicit attention masks and
position ids means no row's tokens depend on another row's padding.

The seed's rules hold exactly: sampled IDs are kept and never re-tokenised; targets are the
sampled tokens including each turn's first stop token; prompt and observations are context with
no loss; truncation by `max_new_tokens`, `max_total_len` and `max_turns` as the seed does it.

Every loop iteration of `rollout` is exactly one forward call of the model. With `sync` (the
trainer passes an all-reduce over data-parallel ranks) a rank whose conversations ended early
runs a one-token dummy forward until every rank is done, so ZeRO-3's per-forward collectives stay
in lockstep.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch

from opd.chat import ChatFormat, restrict_to_tools
from opd.config import RolloutConfig
from opd.tools import ToolCallCounts, parse_hermes_tool_calls


@dataclass
class AgentTrajectory:
    """One conversation as the student saw and wrote it (seed fields first)."""

    input_ids: list[int]
    assistant_mask: list[bool]
    turns: int
    tool_calls: int
    truncated: bool
    truncation_reason: str | None = None  # max_new_tokens | max_total_len | max_turns | empty
    spans: list[tuple[int, int, str]] = field(default_factory=list)  # prompt|assistant|observation
    counts: ToolCallCounts = field(default_factory=ToolCallCounts)
    logprobs: list[float] = field(default_factory=list)  # one per target token, in order

    def assistant_spans(self) -> list[tuple[int, int]]:
        return [(start, end) for start, end, kind in self.spans if kind == "assistant"]


@dataclass
class _Row:
    """Turn state of one conversation in a batch."""

    prompt_index: int
    tools: list | None
    trajectory: AgentTrajectory
    turn_start: int = 0
    budget: int = 0
    done: bool = False  # finished or truncated: no more turns


class _Sampler:
    """Temperature / top-k / top-p sampling that also returns the sampled token's log-prob.

    The recorded log-prob is under the temperature-scaled distribution before top-k/top-p
    truncation: the distribution the loss sees, not the truncated proposal.
    """

    def __init__(self, cfg: RolloutConfig, generator: torch.Generator,
                 vocab_size: int | None = None):
        self.cfg, self.generator, self.vocab_size = cfg, generator, vocab_size

    def __call__(self, logits_BV: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # Rows past the shared vocabulary are embedding padding (Qwen: 151,936 vs 152,064): an
        # id there has no row in the teacher and no text in the tokenizer, so it is never drawn.
        logits_BV = logits_BV[:, :self.vocab_size]
        logprobs_BV = torch.log_softmax(logits_BV.float() / self.cfg.temperature, dim=-1)
        if self.cfg.top_k == 1:  # greedy: no sampling over the whole vocabulary
            tokens_B = logprobs_BV.argmax(-1)
            return tokens_B, logprobs_BV.gather(-1, tokens_B[:, None]).squeeze(-1)
        filtered_BV = logprobs_BV
        if self.cfg.top_k and self.cfg.top_k < filtered_BV.shape[-1]:
            kth = torch.topk(filtered_BV, self.cfg.top_k, dim=-1).values[:, -1:]
            filtered_BV = filtered_BV.masked_fill(filtered_BV < kth, float("-inf"))
        if self.cfg.top_p < 1.0:
            sorted_BV, order_BV = torch.sort(filtered_BV, descending=True, dim=-1)
            cumulative_BV = sorted_BV.exp().cumsum(-1)
            drop_sorted_BV = cumulative_BV - sorted_BV.exp() >= self.cfg.top_p
            drop_BV = torch.zeros_like(drop_sorted_BV).scatter(-1, order_BV, drop_sorted_BV)
            filtered_BV = filtered_BV.masked_fill(drop_BV, float("-inf"))
        probs_BV = filtered_BV.exp()
        tokens_B = torch.multinomial(probs_BV.cpu(), 1, generator=self.generator).squeeze(-1)
        tokens_B = tokens_B.to(logits_BV.device)
        return tokens_B, logprobs_BV.gather(-1, tokens_B[:, None]).squeeze(-1)


class _Phase:
    """One assistant turn for a set of rows: left-padded prefill, then cached decode steps."""

    def __init__(self, rows: list[_Row], pad_token_id: int, device: torch.device):
        self.rows = rows
        contexts = [row.trajectory.input_ids for row in rows]
        width = max(len(ids) for ids in contexts)
        ids_BT = torch.full((len(rows), width), pad_token_id, dtype=torch.long)
        mask_BT = torch.zeros((len(rows), width), dtype=torch.long)
        for b, ids in enumerate(contexts):
            ids_BT[b, width - len(ids):] = torch.tensor(ids)
            mask_BT[b, width - len(ids):] = 1
        self.input_ids = ids_BT.to(device)
        self.attention_mask = mask_BT.to(device)
        self.position_ids = (mask_BT.cumsum(-1) - 1).clamp(min=0).to(device)
        self.cache = None
        self.generating = [True] * len(rows)

    @property
    def active(self) -> bool:
        return any(self.generating)

    def forward(self, model, cache_name: str) -> torch.Tensor:
        out = model(input_ids=self.input_ids, attention_mask=self.attention_mask,
                    position_ids=self.position_ids, use_cache=True, logits_to_keep=1,
                    **{cache_name: self.cache})
        self.cache = out[cache_name]
        return out["logits"][:, -1, :]

    def advance(self, tokens_B: torch.Tensor) -> None:
        """Feed the sampled tokens as the next step's input (finished rows feed padding)."""
        self.input_ids = tokens_B[:, None]
        self.position_ids = self.position_ids[:, -1:] + 1
        self.attention_mask = torch.cat(
            [self.attention_mask, torch.ones_like(self.attention_mask[:, :1])], dim=-1)


def cache_argument_name(module) -> str:
    """transformers 5 names the KV cache `cache`; earlier releases `past_key_values`."""
    parameters = inspect.signature(module.forward).parameters
    return "cache" if "cache" in parameters else "past_key_values"


def _prompt_ids(chat: ChatFormat, prompt: dict, index: int, max_total_len: int) -> list[int]:
    ids = chat.prompt_ids(prompt["messages"], prompt.get("tools"))
    if not ids or len(ids) >= max_total_len:
        raise ValueError(
            f"Prompt {index} has {len(ids)} tokens, which leaves no generation space under "
            f"rollout.max_total_len={max_total_len}; increase rollout.max_total_len")
    return ids


def _new_row(chat: ChatFormat, prompt: dict, index: int, cfg: RolloutConfig) -> _Row:
    ids = _prompt_ids(chat, prompt, index, cfg.max_total_len)
    trajectory = AgentTrajectory(input_ids=list(ids), assistant_mask=[False] * len(ids), turns=0,
                                 tool_calls=0, truncated=False, spans=[(0, len(ids), "prompt")])
    return _Row(prompt_index=index, tools=prompt.get("tools"), trajectory=trajectory)


def _count_unexecuted(counts, calls: list, registry) -> None:
    """Calls of a turn cut by max_turns never run, but their validity still counts."""
    for call in calls:
        if call.error is None and registry.validate(call) is None:
            counts.valid += 1
        else:
            counts.invalid += 1


def _truncate(row: _Row, reason: str) -> None:
    row.trajectory.truncated, row.trajectory.truncation_reason, row.done = True, reason, True


class _BatchRollout:
    """Rollout state of one batch of conversations; `step` runs exactly one forward call."""

    def __init__(self, model, chat: ChatFormat, executor, parser, cfg: RolloutConfig,
                 rows: list[_Row], sampler: _Sampler, device: torch.device):
        self.model, self.chat, self.executor, self.parser = model, chat, executor, parser
        self.cache_name = cache_argument_name(getattr(model, "module", model))
        self.cfg, self.rows, self.sampler, self.device = cfg, rows, sampler, device
        self.phase: _Phase | None = None

    @property
    def finished(self) -> bool:
        return self.phase is None and all(row.done for row in self.rows)

    def step(self) -> None:
        if self.phase is None:
            self.phase = self._start_phase()
        logits_BV = self.phase.forward(self.model, self.cache_name)
        tokens_B, logprobs_B = self.sampler(logits_BV)
        self._record(tokens_B.tolist(), logprobs_B.tolist())
        if self.phase.active:
            self.phase.advance(tokens_B)
        else:
            self._end_phase()

    def _start_phase(self) -> _Phase:
        talking = [row for row in self.rows if not row.done]
        for row in talking:
            row.turn_start = len(row.trajectory.input_ids)
            row.budget = min(self.cfg.max_new_tokens, self.cfg.max_total_len - row.turn_start)
        return _Phase(talking, self.chat.pad_token_id, self.device)

    def _record(self, tokens: list[int], logprobs: list[float]) -> None:
        phase = self.phase
        for b, row in enumerate(phase.rows):
            if not phase.generating[b]:
                continue
            trajectory = row.trajectory
            trajectory.input_ids.append(tokens[b])
            trajectory.assistant_mask.append(True)
            trajectory.logprobs.append(logprobs[b])
            written = len(trajectory.input_ids) - row.turn_start
            if tokens[b] in self.chat.stop_token_ids or written >= row.budget:
                phase.generating[b] = False

    def _end_phase(self) -> None:
        waiting: list[tuple[_Row, list]] = []
        for row in self.phase.rows:
            calls = self._end_turn(row)
            if calls is not None:
                waiting.append((row, calls))
        self.phase = None
        if waiting:
            self._append_observations(waiting)

    def _end_turn(self, row: _Row) -> list | None:
        """Close the row's turn by the seed's rules; return its tool calls if it continues."""
        trajectory = row.trajectory
        end = len(trajectory.input_ids)
        if end == row.turn_start:
            _truncate(row, "empty")
            return None
        trajectory.spans.append((row.turn_start, end, "assistant"))
        trajectory.turns += 1
        if trajectory.input_ids[-1] not in self.chat.stop_token_ids:
            reached_total = end >= self.cfg.max_total_len
            _truncate(row, "max_total_len" if reached_total else "max_new_tokens")
            return None
        # Special tokens stay in the text: a template may register <tool_call> as special.
        text = self.chat.tokenizer.decode(trajectory.input_ids[row.turn_start:],
                                          skip_special_tokens=False)
        calls = restrict_to_tools(self.parser(text), row.tools)
        trajectory.tool_calls += len(calls)
        if not calls:
            row.done = True
            return None
        if trajectory.turns == self.cfg.max_turns:
            _count_unexecuted(trajectory.counts, calls, self.executor.registry)
            _truncate(row, "max_turns")
            return None
        return calls

    def _append_observations(self, waiting: list[tuple[_Row, list]]) -> None:
        results = self.executor.run_batch([calls for _, calls in waiting])
        for (row, _), row_results in zip(waiting, results):
            trajectory = row.trajectory
            trajectory.counts.add(row_results)
            observation = self.chat.observation_ids(
                [result.content for result in row_results], row.tools, trajectory.input_ids[-1])
            start = len(trajectory.input_ids)
            if start + len(observation) >= self.cfg.max_total_len:
                _truncate(row, "max_total_len")
                continue
            trajectory.input_ids.extend(observation)
            trajectory.assistant_mask.extend([False] * len(observation))
            trajectory.spans.append((start, len(trajectory.input_ids), "observation"))


def _dummy_forward(model, pad_token_id: int, device: torch.device) -> None:
    """One-token forward that keeps a rank with no work in collective lockstep."""
    model(input_ids=torch.full((1, 1), pad_token_id, dtype=torch.long, device=device),
          use_cache=False, logits_to_keep=1)


@torch.no_grad()
def rollout(model, chat: ChatFormat, executor, prompts: Sequence[dict], cfg: RolloutConfig, *,
            seed: int = 0, parser: Callable | None = None,
            sync: Callable[[bool], bool] | None = None,
            vocab_size: int | None = None) -> list[AgentTrajectory]:
    """Sample multi-turn conversations for `prompts` (dataset records with `messages`, `tools`).

    Deterministic for a fixed seed, prompts and batch size. `sync(has_work) -> any_has_work`
    keeps ranks in lockstep (see module docstring); without it the loop stops when this rank's
    work is done. `vocab_size` (the vocabulary student and teacher share) bounds the ids drawn.
    """
    cfg.validate()
    parser = parser or parse_hermes_tool_calls
    module = getattr(model, "module", model)
    device = next(module.parameters()).device
    generator = torch.Generator().manual_seed(seed)
    sampler = _Sampler(cfg, generator, vocab_size)
    rows = [_new_row(chat, prompt, i, cfg) for i, prompt in enumerate(prompts)]
    batches = [_BatchRollout(model, chat, executor, parser, cfg, rows[i:i + cfg.batch_size],
                             sampler, device) for i in range(0, len(rows), cfg.batch_size)]
    was_training = module.training
    module.eval()
    try:
        while True:
            while batches and batches[0].finished:
                batches.pop(0)
            has_work = bool(batches)
            if not (sync(has_work) if sync is not None else has_work):
                break
            if has_work:
                batches[0].step()
            else:
                _dummy_forward(model, chat.pad_token_id, device)
    finally:
        module.train(was_training)
    return [row.trajectory for row in rows]


def collect_trajectory(student, tokenizer, messages, tools=None, *, max_turns=3,
                       max_new_tokens=256, max_total_len=2048, temperature=1.0,
                       open_thinking=False, autocast_ctx=None, executor=None, seed=0,
                       **template_kwargs) -> AgentTrajectory:
    """Seed-compatible: one conversation through the batched engine (batch of one).

    Tools run in the sandboxed executor (the built-in toy tools unless `executor` is given).
    """
    from opd.chat import _default_executor
    cfg = RolloutConfig(max_turns=max_turns, max_new_tokens=max_new_tokens,
                        max_total_len=max_total_len, temperature=temperature, batch_size=1)
    cfg.validate()
    module = getattr(student, "module", student)
    chat = ChatFormat(tokenizer, {"open_thinking": open_thinking, **template_kwargs},
                      getattr(module, "generation_config", None))
    prompt = {"messages": messages, "tools": tools}
    with autocast_ctx if autocast_ctx is not None else nullcontext():
        return rollout(student, chat, executor or _default_executor(), [prompt], cfg,
                       seed=seed)[0]
