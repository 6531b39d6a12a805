"""Batched multi-turn student rollouts.

B conversations sample concurrently, each row with its own turn state. A *phase* is one
assistant turn for every row still talking: the rows' full contexts are left-padded into one
batch, prefilled once, then decoded token by token with a KV cache until each row hits a stop
token or its own budget. Rows that called tools get their observations (executed together in the
tool sandbox) appended and join the next phase. Left padding with explicit attention masks and
position ids means no row's tokens depend on another row's padding.

With the vLLM engine (rollout.engine=vllm) conversations are scheduled one by one instead: a
conversation's next turn is submitted as soon as its observations (or next user turn) are in,
tool calls run on background threads while the engine generates for the others, and vLLM's
continuous batching and prefix cache do the rest. The HF engine stays phase-synchronous on
purpose: its rows share one sampling generator, so a row joining mid-phase would make samples
depend on tool timing, and joining a left-padded KV cache mid-phase is continuous batching,
which is what vLLM is for.

Each conversation is an episode of the executor (opd.tools, opd.environments): opened when its
batch starts (a stateful environment constructed from the record's "environment"), fed each
turn's calls, its final state read into `AgentTrajectory.environment_state` and closed as soon
as the conversation ends. A record's further user turns (opd.data.user_turns) are appended, by
the same boundary rendering as observations, when the student ends a turn without tool calls;
a record's `tools_by_turn` grows the offered tools at those turns.

The seed's rules hold exactly: sampled IDs are kept and never re-tokenised; targets are the
sampled tokens including each turn's first stop token; prompt, observations and user turns are
context with no loss; truncation by `max_new_tokens`, `max_total_len` and `max_turns` as the
seed does it, over the whole episode: `max_turns` counts assistant turns across all user turns,
`max_total_len` the whole conversation. Truncation reasons: "max_new_tokens", "max_total_len",
"max_turns" (a turn that called tools, or ended with user turns left, was the last allowed),
"empty" (a turn of no tokens), "environment_start_failed" (the environment's constructor raised
or hung: no turn was sampled), "environment_died" (a call hung or crashed the episode's
process: the turn's observation is not appended); `environment_error` says why for the last two.

Every loop iteration of `rollout` is exactly one forward call of the model. With `sync` (the
trainer passes an all-reduce over data-parallel ranks) a rank whose conversations ended early
runs a one-token dummy forward until every rank is done, so ZeRO-3's per-forward collectives stay
in lockstep.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch

from opd.chat import ChatFormat, restrict_to_tools
from opd.config import RolloutConfig
from opd.data import prompt_record, tools_at_turn, user_turns, withheld_tools
from opd.sampling.base import (
    OnFinished,
    TurnEngine,
    TurnRequest,
    TurnSampling,
    request_seed,
)
from opd.tool_calls import parse_hermes_tool_calls
from opd.tools import Episode, ToolResult
from opd.trajectory import AgentTrajectory


@dataclass
class _Row:
    """Turn state of one conversation in a batch."""

    prompt_index: int
    tools: list | None
    trajectory: AgentTrajectory
    environment: dict = field(default_factory=dict)  # the record's environment config
    user_turns: list[dict] = field(default_factory=list)  # further user turns not yet shown
    tools_by_turn: list | None = None
    user_turn: int = 0  # the user turn the conversation is in (0: the prompt's)
    episode: Episode | None = None
    next_user: dict | None = None  # the user turn to append after this phase
    turn_start: int = 0
    budget: int = 0
    done: bool = False  # finished or truncated: no more turns

    @property
    def live_episode(self) -> Episode:
        """The episode of a row that samples turns (opened before its first one)."""
        assert self.episode is not None, "a row samples only once its episode is open"
        return self.episode


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


def _new_row(chat: ChatFormat, record: dict, index: int, cfg: RolloutConfig) -> _Row:
    prompt = prompt_record(record)
    tools = tools_at_turn(prompt.get("tools"), prompt.get("tools_by_turn"), 0) \
        if prompt.get("tools_by_turn") else prompt.get("tools")
    ids = _prompt_ids(chat, {"messages": prompt["messages"], "tools": tools}, index,
                      cfg.max_total_len)
    trajectory = AgentTrajectory.from_prompt(ids)
    return _Row(prompt_index=index, tools=tools, trajectory=trajectory,
                environment=prompt.get("environment") or {}, user_turns=user_turns(record),
                tools_by_turn=prompt.get("tools_by_turn"))


def _count_unexecuted(counts, calls: list, executor, episode: Episode) -> None:
    """Calls of a turn cut by max_turns never run, but their validity still counts."""
    for call in calls:
        if call.error is None and executor.validate_call(episode, call) is None:
            counts.valid += 1
        else:
            counts.invalid += 1


def _truncate(row: _Row, reason: str) -> None:
    row.trajectory.truncated, row.trajectory.truncation_reason, row.done = True, reason, True


class _BatchRollout:
    """Rollout state of one batch of conversations; `step` runs exactly one forward call."""

    def __init__(self, model, chat: ChatFormat, executor, parser, cfg: RolloutConfig,
                 rows: list[_Row], sampler: _Sampler, device: torch.device,
                 engine: TurnEngine | None = None, seed: int = 0,
                 tool_lanes: ThreadPoolExecutor | None = None,
                 on_finished: OnFinished | None = None):
        self.model, self.chat, self.executor, self.parser = model, chat, executor, parser
        self.on_finished = on_finished
        self.cfg, self.rows, self.sampler, self.device = cfg, rows, sampler, device
        self.engine, self.seed = engine, seed
        if engine is None:
            self.cache_name = cache_argument_name(getattr(model, "module", model))
        self.phase: _Phase | None = None
        # vLLM engine only (see _advance_conversations)
        self.sampling = TurnSampling(tuple(sorted(chat.stop_token_ids)), cfg.temperature,
                                     cfg.top_p, cfg.top_k, sampler.vocab_size)
        self.tool_lanes, self.overlap = tool_lanes, cfg.vllm_schedule == "conversation"
        self.ready: list[_Row] | None = None  # conversations whose next turn is not submitted
        self.in_flight: dict[str, _Row] = {}  # by the engine's request ID
        self.waiting_calls: list[tuple[_Row, list]] = []  # turns ended, tools not started
        self.tool_batches: list[tuple[Future, list[tuple[_Row, list]]]] = []  # on the lanes

    @property
    def finished(self) -> bool:
        return self.phase is None and all(row.done for row in self.rows)

    def open_episodes(self) -> None:
        """Open the rows' episodes (once); a row whose environment cannot start ends at once."""
        if any(row.episode is not None for row in self.rows):
            return
        episodes = self.executor.open_episodes(
            [row.environment for row in self.rows], [row.tools for row in self.rows],
            [withheld_tools(row.tools_by_turn) for row in self.rows])
        for row, episode in zip(self.rows, episodes):
            row.episode = episode
            if episode.end_reason is not None:
                row.trajectory.environment_error = episode.error
                _truncate(row, episode.end_reason)
        self.finish_episodes()

    def finish_episodes(self) -> None:
        """Read the final state of every ended row's live environment, then close its episode:
        its trajectory is final, and `on_finished` hears of it."""
        for row in self.rows:
            if row.done and row.episode is not None and not row.episode.closed:
                if row.episode.alive:
                    row.trajectory.environment_state = self.executor.episode_state(row.episode)
                self.executor.close_episode(row.episode)
                if self.on_finished is not None:
                    self.on_finished(row.prompt_index, row.trajectory)

    def close_episodes(self) -> None:
        """Close every episode still open (the rollout is interrupted)."""
        if self.engine is not None:
            self.engine.abort()
        wait([future for future, _ in self.tool_batches])  # their calls hold episodes
        for row in self.rows:
            if row.episode is not None:
                self.executor.close_episode(row.episode)

    def step(self) -> None:
        """HF engine: one forward call (prefill or one decode step) of the current phase. vLLM
        engine: one engine iteration, then every conversation whose turn or tools are done moves
        on (`_advance_conversations`)."""
        if self.engine is not None:
            self._advance_conversations(self.engine)
            return
        if self.phase is None:
            self.phase = _Phase(self._start_turn(), self.chat.pad_token_id, self.device)
        phase = self.phase
        logits_BV = phase.forward(self.model, self.cache_name)
        tokens_B, logprobs_B = self.sampler(logits_BV)
        self._record(phase, tokens_B.tolist(), logprobs_B.tolist())
        if phase.active:
            phase.advance(tokens_B)
        else:
            self.phase = None
            self._end_phase(phase.rows)

    def _start_turn(self) -> list[_Row]:
        talking = [row for row in self.rows if not row.done]
        for row in talking:
            self._begin_turn(row)
        return talking

    def _begin_turn(self, row: _Row) -> None:
        row.turn_start = len(row.trajectory.input_ids)
        row.budget = min(self.cfg.max_new_tokens, self.cfg.max_total_len - row.turn_start)

    def _advance_conversations(self, engine: TurnEngine) -> None:
        """Per-conversation scheduling: a conversation's next turn is submitted as soon as its
        tools (or its next user turn) are in, and the calls of the conversations whose turns an
        engine iteration ended start at once on the tool lanes (threads: the executor runs
        calls from several at the same time) while the engine keeps generating for the others.
        A turn's sample depends only on its request's seed, so the trajectories do not depend
        on this timing. `rollout.vllm_schedule=rounds` is the turn-synchronous schedule: every
        turn of a round, then every tool call, then the next round (the reference the tests
        compare against)."""
        if self.ready is None:  # the batch's first call
            self.ready = [row for row in self.rows if not row.done]
        else:
            if engine.running:
                for request_id, tokens, logprobs in engine.step():
                    row = self.in_flight.pop(request_id)
                    row.trajectory.input_ids.extend(tokens)
                    row.trajectory.assistant_mask.extend([True] * len(tokens))
                    row.trajectory.logprobs.extend(logprobs)
                    calls = self._end_turn(row)
                    if calls is None:
                        self._turn_done(row)
                    else:
                        self.waiting_calls.append((row, calls))
            # Nothing to generate until tools return (in rounds, ready turns wait for them too).
            if self.tool_batches and not engine.running and not (self.ready and self.overlap):
                wait([future for future, _ in self.tool_batches], return_when=FIRST_COMPLETED)
            for future, batch in [entry for entry in self.tool_batches if entry[0].done()]:
                self.tool_batches.remove((future, batch))
                self._append_observations(batch, future.result())
                for row, _ in batch:
                    self._turn_done(row)
            self.finish_episodes()
            if self.waiting_calls and (self.overlap
                                       or not (engine.running or self.tool_batches)):
                batch, self.waiting_calls = self.waiting_calls, []
                assert self.tool_lanes is not None
                self.tool_batches.append((self.tool_lanes.submit(self._run_calls, batch), batch))
        if self.ready and (self.overlap or not (engine.running or self.tool_batches
                                                or self.waiting_calls)):
            for row in self.ready:
                self._begin_turn(row)
                request = TurnRequest(row.trajectory.input_ids, row.budget,
                                      request_seed(self.seed, row.prompt_index,
                                                   row.trajectory.turns))
                self.in_flight[engine.submit(request, self.sampling)] = row
            self.ready = []

    def _turn_done(self, row: _Row) -> None:
        """A vLLM-engine conversation whose turn (and tools) ended: queue its next turn."""
        if row.next_user is not None:
            self._append_user_turn(row)
        if not row.done:
            assert self.ready is not None
            self.ready.append(row)

    def _record(self, phase: _Phase, tokens: list[int], logprobs: list[float]) -> None:
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

    def _end_phase(self, rows: list[_Row]) -> None:
        waiting: list[tuple[_Row, list]] = []
        for row in rows:
            calls = self._end_turn(row)
            if calls is not None:
                waiting.append((row, calls))
        if waiting:
            self._append_observations(waiting, self._run_calls(waiting))
        for row in rows:
            if row.next_user is not None:
                self._append_user_turn(row)
        self.finish_episodes()

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
        calls = restrict_to_tools(self.parser(text), row.tools, row.live_episode.withheld)
        trajectory.tool_calls += len(calls)
        if not calls:
            trajectory.calls_by_turn[-1].append([])
        if not calls and not row.user_turns:
            row.done = True
            return None
        if trajectory.turns == self.cfg.max_turns:
            _count_unexecuted(trajectory.counts, calls, self.executor, row.live_episode)
            _truncate(row, "max_turns")
            return None
        if not calls:
            row.next_user = row.user_turns.pop(0)
            return None
        return calls

    def _run_calls(self, waiting: list[tuple[_Row, list]]) -> dict[Episode, list[ToolResult]]:
        return self.executor.run_episode_calls(
            {row.live_episode: calls for row, calls in waiting})

    def _append_observations(self, waiting: list[tuple[_Row, list]],
                             results: dict[Episode, list[ToolResult]]) -> None:
        for row, calls in waiting:
            trajectory, episode = row.trajectory, row.live_episode
            trajectory.counts.add(results[episode])
            trajectory.calls_by_turn[-1].append(
                [{"name": call.name, "arguments": call.arguments}
                 for call, result in zip(calls, results[episode]) if result.status == "ok"])
            if episode.end_reason is not None:
                trajectory.environment_error = episode.error
                _truncate(row, episode.end_reason)
                continue
            observation = self.chat.observation_ids(
                [result.content for result in results[episode]], row.tools,
                trajectory.input_ids[-1])
            self._append_context(row, observation, "observation")
            if any(result.status != "ok" for result in results[episode]):
                trajectory.refusal_ends.append(len(trajectory.input_ids))

    def _append_user_turn(self, row: _Row) -> None:
        """The next user message, with the tools offered from its turn on."""
        message, row.next_user = row.next_user, None
        assert message is not None and row.episode is not None
        row.user_turn += 1
        by_turn = row.tools_by_turn or []
        extra = list(by_turn[row.user_turn] or []) if row.user_turn < len(by_turn) else []
        if extra:
            row.tools = [*(row.tools or []), *extra]
            row.episode.offer(extra)
        ids = self.chat.user_turn_ids([message], row.tools, row.trajectory.input_ids[-1])
        self._append_context(row, ids, "user")
        if not row.trajectory.truncated:
            row.trajectory.calls_by_turn.append([])

    def _append_context(self, row: _Row, ids: list[int], kind: str) -> None:
        if len(row.trajectory.input_ids) + len(ids) >= self.cfg.max_total_len:
            _truncate(row, "max_total_len")
            return
        row.trajectory.append(ids, kind)


def _dummy_forward(model, pad_token_id: int, device: torch.device) -> None:
    """One-token forward that keeps a rank with no work in collective lockstep."""
    model(input_ids=torch.full((1, 1), pad_token_id, dtype=torch.long, device=device),
          use_cache=False, logits_to_keep=1)


@torch.no_grad()
def rollout(model, chat: ChatFormat, executor, prompts: Sequence[dict], cfg: RolloutConfig, *,
            seed: int = 0, parser: Callable | None = None,
            sync: Callable[[bool], bool] | None = None, vocab_size: int | None = None,
            engine: TurnEngine | None = None,
            on_finished: OnFinished | None = None) -> list[AgentTrajectory]:
    """Sample multi-turn conversations for `prompts`: dataset records (opd.data; their prompt,
    further user turns, `tools`, `tools_by_turn` and `environment` are read from them).

    Deterministic for a fixed seed, prompts and batch size. `sync(has_work) -> any_has_work`
    keeps ranks in lockstep (see module docstring); without it the loop stops when this rank's
    work is done. `vocab_size` (the vocabulary student and teacher share) bounds the ids drawn.
    With `engine` (opd.sampling.vllm_engine) vLLM samples each turn and `model` is not used: a rank has
    an engine of its own (or drives its group's, whose other ranks mirror the calls), so no
    collective of the student runs and `sync` is not needed; `cfg.vllm_schedule`
    chooses per-conversation scheduling or turn-synchronous rounds (the same trajectories).
    `on_finished(index, trajectory)` is called as each conversation ends (opd.sampling.base).
    """
    cfg.validate()
    parser = parser or parse_hermes_tool_calls
    generator = torch.Generator().manual_seed(seed)
    sampler = _Sampler(cfg, generator, vocab_size)
    rows = [_new_row(chat, prompt, i, cfg) for i, prompt in enumerate(prompts)]
    module = getattr(model, "module", model) if engine is None else torch.nn.Module()
    device = next(module.parameters()).device if engine is None else torch.device("cpu")
    # One lane per conversation that can wait for tools at once.
    tool_lanes = ThreadPoolExecutor(cfg.batch_size, thread_name_prefix="opd-tools") \
        if engine is not None else None
    batches = [_BatchRollout(model, chat, executor, parser, cfg, rows[i:i + cfg.batch_size],
                             sampler, device, engine, seed, tool_lanes, on_finished)
               for i in range(0, len(rows), cfg.batch_size)]
    was_training = module.training
    module.eval()
    try:
        while True:
            while batches:
                batches[0].open_episodes()
                if not batches[0].finished:
                    break
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
        for batch in batches:
            batch.close_episodes()
        if tool_lanes is not None:
            tool_lanes.shutdown()
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
