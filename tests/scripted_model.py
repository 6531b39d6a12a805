"""A scripted policy with a causal-LM forward signature, for exact mask/alignment tests.

It writes predetermined assistant turns: for each row it finds its script by the row's prompt
text, counts how many assistant generation prompts its context holds (one per turn started) and
how many tokens it has written since the last one, and puts all probability on the next scripted
token (or on the stop token when the turn's script is exhausted). The rollout engine runs
unchanged on it: left padding, KV-cache calls, sampling, tools and rendering are all real.
"""

from __future__ import annotations

import json
import random

import torch


def call_text(name: str, arguments: dict) -> str:
    """A Hermes tool call as a script turn."""
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


class ScriptedPolicy(torch.nn.Module):
    def __init__(self, tokenizer, scripts: dict[str, list[str]], stop_token_id: int,
                 assistant_prefix: str):
        super().__init__()
        self.anchor = torch.nn.Parameter(torch.zeros(1))
        self.vocab_size = len(tokenizer)
        self.stop_token_id = stop_token_id
        self.tokenizer = tokenizer
        self.prefix_ids = tokenizer(assistant_prefix, add_special_tokens=False)["input_ids"]
        self.scripts = {key: [tokenizer(turn, add_special_tokens=False)["input_ids"]
                              for turn in turns] for key, turns in scripts.items()}

    def _next_token(self, history: list[int]) -> int:
        text = self.tokenizer.decode(history)
        turns = next(turns for key, turns in self.scripts.items() if key in text)
        n, starts = len(self.prefix_ids), []
        for i in range(len(history) - n + 1):
            if history[i:i + n] == self.prefix_ids:
                starts.append(i + n)
        turn, written = len(starts) - 1, len(history) - starts[-1]
        script = turns[turn] if turn < len(turns) else []
        return script[written] if written < len(script) else self.stop_token_id

    def forward(self, input_ids, attention_mask=None, cache=None, **_):
        if cache is None:
            mask = attention_mask if attention_mask is not None else torch.ones_like(input_ids)
            histories = [row[m.bool()].tolist() for row, m in zip(input_ids, mask)]
        else:
            histories = [h + row.tolist() for h, row in zip(cache, input_ids)]
        logits = torch.full((len(histories), 1, self.vocab_size), -1e4)
        for b, history in enumerate(histories):
            logits[b, 0, self._next_token(history)] = 1e4
        return {"logits": logits, "cache": histories}


class ScriptedEngine(ScriptedPolicy):
    """The same scripts served the way opd.sampling.vllm_engine.VLLMEngine serves turns to the rollout:
    each turn submitted on its own and returned by a later `step`, after a number of steps drawn
    from the request's seed, so turns finish out of submission order and the per-conversation
    schedule (tools on their lane while other turns generate) runs without vLLM installed. Still
    a model, for the callers (eval) that take one."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._running: dict[str, tuple[int, list[int]]] = {}
        self._clock = 0
        self._submitted = 0

    def submit(self, request, sampling) -> str:
        tokens: list[int] = []
        while len(tokens) < request.max_tokens:
            tokens.append(self._next_token(list(request.context) + tokens))
            if tokens[-1] in sampling.stop_token_ids:
                break
        request_id, self._submitted = str(self._submitted), self._submitted + 1
        due = self._clock + 1 + random.Random(request.seed).randrange(4)
        self._running[request_id] = (due, tokens)
        return request_id

    @property
    def running(self) -> bool:
        return bool(self._running)

    def step(self) -> list[tuple[str, list[int], list[float]]]:
        self._clock += 1
        finished = [(request_id, tokens, [0.0] * len(tokens))
                    for request_id, (due, tokens) in self._running.items() if due <= self._clock]
        for request_id, _, _ in finished:
            del self._running[request_id]
        return finished

    def abort(self) -> None:
        self._running.clear()
