"""Chat-template rendering for student-owned trajectories.

The student's sampled token IDs are never re-tokenised, so a conversation is only ever extended
by appending: the prompt is rendered once through the tokenizer's own template, and each tool
observation, and each further user turn, is rendered by the *boundary technique* (from the seed):
render a throwaway assistant turn whose content is a marker, followed by the tool (or user)
messages and the next generation prompt, and keep only the text after the marker. That text is
exactly what the template would put between the end of the assistant turn and the next
assistant turn, whatever the template does to earlier turns (Qwen3 rewrites earlier think
blocks; we never re-render history).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence

from opd.errors import ChatTemplateError
from opd.plugins import resolve
from opd.tool_calls import ToolCall
from opd.tools import ToolExecutor

BOUNDARY_MARKER = "<|opd_observation_boundary|>"



def stop_token_ids(tokenizer, generation_config=None) -> frozenset[int]:
    """The tokenizer's EOS plus every id in `generation_config.eos_token_id`.

    Qwen-family models stop on several tokens (`<|im_end|>` and `<|endoftext|>`); stopping on
    the tokenizer's EOS alone lets a turn run on past its real end.
    """
    ids = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    configured = getattr(generation_config, "eos_token_id", None) if generation_config else None
    if isinstance(configured, int):
        ids.add(configured)
    elif configured is not None:
        ids.update(int(i) for i in configured)
    if not ids:
        raise ChatTemplateError(
            f"Tokenizer {_template_name(tokenizer)} has no eos_token and the model's generation "
            "config names no eos_token_id; set one so turns can end.")
    return frozenset(ids)


def _template_name(tokenizer) -> str:
    return repr(getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__)


class ChatFormat:
    """A tokenizer's chat template plus the template keyword arguments of a recipe.

    `template_kwargs` pass straight through to `apply_chat_template` (Qwen3's
    `enable_thinking`, the seed's `open_thinking`, anything a template reads).
    """

    def __init__(self, tokenizer, template_kwargs: dict | None = None, generation_config=None):
        if not getattr(tokenizer, "chat_template", None):
            raise ChatTemplateError(
                f"Tokenizer {_template_name(tokenizer)} has no chat_template; set "
                "tokenizer.chat_template (see shared fixtures for a Qwen3 template).")
        self.tokenizer = tokenizer
        self.template_kwargs = dict(template_kwargs or {})
        self.stop_token_ids = stop_token_ids(tokenizer, generation_config)
        pad = tokenizer.pad_token_id
        self.pad_token_id = int(pad) if pad is not None else min(self.stop_token_ids)
        self._token_text_cache: dict[int, str] = {}

    @property
    def name(self) -> str:
        return _template_name(self.tokenizer)

    def render(self, messages: Sequence[dict], tools: Sequence[dict] | None,
               add_generation_prompt: bool = True) -> str:
        return self.tokenizer.apply_chat_template(
            list(messages), tokenize=False, add_generation_prompt=add_generation_prompt,
            tools=list(tools) if tools else None, **self.template_kwargs)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def prompt_ids(self, messages: Sequence[dict], tools: Sequence[dict] | None) -> list[int]:
        """Token IDs of the conversation so far plus the assistant generation prompt."""
        return self.encode(self.render(messages, tools, add_generation_prompt=True))

    def observation_text(self, tool_contents: Iterable[str], tools: Sequence[dict] | None) -> str:
        """What the template puts after an assistant turn: tool responses + next assistant prefix."""
        return self.context_text([{"role": "tool", "content": content}
                                  for content in tool_contents], tools)

    def context_text(self, messages: Sequence[dict], tools: Sequence[dict] | None) -> str:
        """What the template puts after an assistant turn: `messages` (tool responses, a user
        turn) + the next assistant prefix, by boundary rendering."""
        rendered = self.render([{"role": "assistant", "content": BOUNDARY_MARKER}, *messages],
                               tools, add_generation_prompt=True)
        _, found, context = rendered.partition(BOUNDARY_MARKER)
        if not found:
            raise ChatTemplateError(
                f"Chat template of {self.name} drops the assistant content marker, so tool "
                "observations and user turns cannot be appended by boundary rendering; use a "
                "template that keeps assistant message content verbatim.")
        return context

    def observation_ids(self, tool_contents: Iterable[str], tools: Sequence[dict] | None,
                        last_token_id: int | None = None) -> list[int]:
        """Token IDs to append after a finished assistant turn ending in `last_token_id`.

        The template closes the assistant turn itself (`<|im_end|>` ...); when the student's
        sampled IDs already end with a stop token, that leading stop token is dropped so it is
        never duplicated. Raises ChatTemplateError when appending these IDs would differ from
        tokenising the joined text (the observation would merge with the previous token).
        """
        return self._context_ids(self.observation_text(tool_contents, tools), last_token_id)

    def user_turn_ids(self, messages: Sequence[dict], tools: Sequence[dict] | None,
                      last_token_id: int | None = None) -> list[int]:
        """Token IDs of a further user turn (`messages`: the user message, or several context
        messages) appended after a finished assistant turn ending in `last_token_id`, up to the
        next assistant prefix; by the same boundary rendering and checks as `observation_ids`.
        `tools`: the tools offered from this turn on."""
        return self.context_ids(messages, tools, last_token_id)

    def context_ids(self, messages: Sequence[dict], tools: Sequence[dict] | None,
                    last_token_id: int | None = None) -> list[int]:
        """Token IDs of any messages between two assistant turns (see `observation_ids`)."""
        return self._context_ids(self.context_text(messages, tools), last_token_id)

    def _context_ids(self, text: str, last_token_id: int | None) -> list[int]:
        if last_token_id in self.stop_token_ids:
            for stop_id in self.stop_token_ids:
                stop_text = self._token_text(stop_id)
                if stop_text and text.startswith(stop_text):
                    text = text[len(stop_text):]
                    break
        ids = self.encode(text)
        if last_token_id is not None:
            self._check_boundary_safe(last_token_id, text, ids)
        return ids

    def _token_text(self, token_id: int) -> str:
        if token_id not in self._token_text_cache:
            self._token_text_cache[token_id] = self.tokenizer.decode(
                [token_id], skip_special_tokens=False, clean_up_tokenization_spaces=False)
        return self._token_text_cache[token_id]

    def _check_boundary_safe(self, last_token_id: int, text: str, ids: list[int]) -> None:
        joint = self.encode(self._token_text(last_token_id) + text)
        if joint != [last_token_id, *ids]:
            raise ChatTemplateError(
                f"Chat template of {self.name} is not boundary-safe: its boundary text "
                f"{text[:40]!r} tokenises differently when joined to the previous token "
                f"{self._token_text(last_token_id)!r}; make the template close the assistant "
                "turn with a special token (e.g. <|im_end|>) before tool responses and user turns.")


# The seed's `tool_observation` executes its own built-in tools when given no executor; those
# tools are the toolcalc world's, the one place the library reaches for a world (seed contract).
SEED_TOOLS = "worlds.toolcalc.tools:registry"


def _default_executor():
    """A process-wide executor over the seed's built-in tools, for the seed-compatible API."""
    global _DEFAULT_EXECUTOR
    if _DEFAULT_EXECUTOR is None:
        _DEFAULT_EXECUTOR = ToolExecutor(resolve(SEED_TOOLS, "the seed's built-in tools")())
    return _DEFAULT_EXECUTOR


_DEFAULT_EXECUTOR = None


def as_tool_calls(calls: Iterable) -> list:
    """Seed-style call dicts ({"name", "arguments"}) to `ToolCall`s; ToolCalls pass through."""
    converted = []
    for call in calls:
        if isinstance(call, ToolCall):
            converted.append(call)
            continue
        name, arguments = call.get("name"), call.get("arguments", {})
        error = None
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                arguments, error = None, "arguments are not valid JSON"
        if not isinstance(arguments, dict) and error is None:
            arguments, error = None, "arguments must be a JSON object"
        converted.append(ToolCall(name=name if isinstance(name, str) else None,
                                  arguments=arguments, error=error, raw=json.dumps(call, default=str)))
    return converted


def restrict_to_tools(calls: list, tools: Sequence[dict] | None,
                      withheld: Sequence[dict] = ()) -> list:
    """Mark calls to tools not offered in this conversation as invalid (seed: `allowed` names),
    but those to `withheld` tools, which its environment runs before they are offered
    (opd.environments, RUNS_WITHHELD_TOOLS); the error names only the offered tools."""
    offered = {tool["function"]["name"] for tool in (tools or [])}
    callable_names = offered | {tool["function"]["name"] for tool in withheld}
    for call in calls:
        if call.error is None and call.name not in callable_names:
            call.error = f"unknown tool {call.name!r}; available: {sorted(offered)}"
    return calls


def tool_observation(tokenizer, calls, tools, open_thinking=False, *, executor=None,
                     **template_kwargs) -> list[int]:
    """Seed-compatible: execute `calls` and render only the tool responses + next assistant prefix.

    Returns the observation IDs as the template renders them (including the template's own
    turn-closing token, which the rollout drops when the student already sampled it).
    """
    executor = executor or _default_executor()
    chat = ChatFormat(tokenizer, {"open_thinking": open_thinking, **template_kwargs})
    tool_calls = restrict_to_tools(as_tool_calls(calls), tools)
    results = executor.run_batch([tool_calls])[0]
    return chat.encode(chat.observation_text([r.content for r in results], tools))
