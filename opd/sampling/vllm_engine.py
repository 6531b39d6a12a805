"""The vLLM engine behind `rollout.engine: vllm` (opd.sampling.vllm drives it).

Each training rank holds its own in-process vLLM engine over a copy of the student's weights
(colocated; on GPU it shares the device with the training engine); with
rollout.vllm_tensor_parallel_size > 1 each group of ranks holds the shards of one engine, driven
by the group's first rank (`MirroredEngine`). The rollout state machine
stays opd.rollout's: this module only samples assistant turns, each submitted on its own as soon
as its conversation is ready (`submit`) and returned by the engine iteration that finishes it
(`step`), token IDs in and token IDs out (vLLM never sees text, and is started without a
tokenizer), stopping at the chat format's stop IDs or the turn's token budget, with the sampled
token's log-prob. Each request carries its own seed, so a turn's sample depends on
(rollout seed, conversation, turn) and not on what else is running.

After every optimizer step the sampler streams the student's weights in, one module's parameters
at a time (`StudentEngine.full_parameters`: ZeRO-3 gathers a module, FSDP2 one full tensor), and
vLLM loads them by their Hugging Face names in place; its prefix cache is reset so no cached key
or value of the old weights is reused.

vLLM's CPU attention serves a few head sizes only: opd.sampling.vllm refuses a student with another
before any engine starts.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from opd.sampling.base import TurnRequest, TurnSampling


def _unlink_cpu_shared_memory() -> None:
    """Remove this rank's name of vLLM's CPU tensor-parallel buffer; the mapping stays valid.

    vLLM's CPU communicator creates a /dev/shm file per shard for its all-reduce and never
    unlinks it: every tensor-parallel run on CPU left 4 MiB per rank behind, under a name that is
    the same for every run under the external launcher. vLLM's set-up ends with a barrier after
    every shard opened its peers' files, so the name is no longer needed once the engine exists.
    """
    from vllm.distributed.device_communicators.cpu_communicator import _CPUSHMDistributed
    from vllm.distributed.parallel_state import get_tp_group

    communicator = get_tp_group().device_communicator
    shm = getattr(communicator, "dist_module", None)
    if not isinstance(shm, _CPUSHMDistributed):  # GPUs, or vLLM fell back to torch.distributed
        return
    # shm_open drops the leading slashes of an "env://" launcher's identifier ("//").
    name = f"{shm.group_name.lstrip('/')}_{communicator.rank}"
    try:
        os.unlink(os.path.join("/dev/shm", name))
    except FileNotFoundError:
        pass


class VLLMEngine:
    """One in-process vLLM engine holding the student's weights."""

    def __init__(self, model_path: str, *, max_model_len: int, dtype: torch.dtype, seed: int,
                 gpu_memory_utilization: float = 0.3, tensor_parallel_size: int = 1,
                 enable_sleep_mode: bool = False):
        # The engine core runs in this process: weight loading is a direct call, not an RPC.
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; the CPU default is 4
        from transformers import AutoConfig
        from vllm import LLM

        self.vocab_size = AutoConfig.from_pretrained(model_path).vocab_size
        # Tensor parallel over training ranks: each rank holds a shard of one engine and joins
        # the process group the trainer started (vLLM's "external launcher").
        executor = "external_launcher" if tensor_parallel_size > 1 else None
        self.llm = LLM(model=model_path, skip_tokenizer_init=True, dtype=dtype, seed=seed,
                       max_model_len=max_model_len, enable_prefix_caching=True,
                       gpu_memory_utilization=gpu_memory_utilization,
                       tensor_parallel_size=tensor_parallel_size, enforce_eager=True,
                       distributed_executor_backend=executor,
                       enable_sleep_mode=enable_sleep_mode,
                       # After temperature, as the HF engine records; with top-k or top-p also
                       # after their truncation (the HF engine records before it).
                       logprobs_mode="processed_logprobs")
        self._running: dict[str, str] = {}  # submitted, unfinished turns: ID -> vLLM's own ID
        self._allowed: list[int] = []
        if tensor_parallel_size > 1:
            _unlink_cpu_shared_memory()

    def submit(self, request: TurnRequest, sampling: TurnSampling) -> str:
        """Queue one assistant turn: it ends at a stop ID (kept) or after `max_tokens`; `step`
        returns it, under the returned ID, with each token's log-prob under the
        temperature-scaled distribution. `sampling.vocab_size` below the model's (embedding
        padding) keeps padded IDs from being drawn."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        allowed = None
        if sampling.vocab_size and sampling.vocab_size < self.vocab_size:
            if len(self._allowed) != sampling.vocab_size:
                self._allowed = list(range(sampling.vocab_size))
            allowed = self._allowed
        # top_k == 1 is the HF engine's greedy: temperature 0 is vLLM's.
        greedy = sampling.top_k == 1
        params = SamplingParams(max_tokens=request.max_tokens,
                                temperature=0.0 if greedy else sampling.temperature,
                                top_p=sampling.top_p,
                                top_k=-1 if greedy or sampling.top_k <= 0 else sampling.top_k,
                                seed=request.seed, stop_token_ids=list(sampling.stop_token_ids),
                                logprobs=0, detokenize=False, ignore_eos=True,
                                allowed_token_ids=allowed,
                                output_kind=RequestOutputKind.FINAL_ONLY)
        (internal_id,) = self.llm.enqueue([TokensPrompt(prompt_token_ids=list(request.context))],
                                          [params], use_tqdm=False)
        # Outputs carry the ID before vLLM's uniqueness suffix ("<counter>-<8 random chars>").
        request_id = internal_id.rsplit("-", 1)[0]
        self._running[request_id] = internal_id
        return request_id

    @property
    def running(self) -> bool:
        """Whether a submitted turn has not come back from `step` yet."""
        return bool(self._running)

    def step(self) -> list[tuple[str, list[int], list[float]]]:
        """One engine iteration (one forward over the running turns): the turns it finished, as
        (ID from `submit`, token IDs, log-probs)."""
        finished = []
        for output in self.llm.llm_engine.step():
            if not output.finished:
                continue
            del self._running[output.request_id]
            sample = output.outputs[0]
            tokens = list(sample.token_ids)
            logprobs = [float(step[token].logprob) for token, step in zip(tokens, sample.logprobs)]
            finished.append((output.request_id, tokens, logprobs))
        return finished

    def abort(self) -> None:
        """Drop every turn still running (an interrupted rollout)."""
        if self._running:
            self.llm.llm_engine.abort_request(list(self._running.values()), internal=True)
            self._running.clear()

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Stream Hugging Face-named tensors into the engine's model, in place."""
        def load(worker) -> None:
            from vllm.model_executor.layers.vocab_parallel_embedding import (
                VocabParallelEmbedding,
            )
            from vllm.platforms import current_platform

            # reload_weights, not the model's load_weights: it redoes the processing after
            # loading (kernel-format repacking) the served weights went through.
            worker.reload_weights(weights_iterator=iter(named_tensors))
            if current_platform.is_cpu():
                # On CPU the output embedding computes logits from a packed copy of its weight;
                # a tied lm_head is never loaded by name, so that copy would stay stale (a
                # log-prob gap of 0.12 after scaling the embedding). Repack every one.
                for module in worker.model_runner.model.modules():
                    if isinstance(module, VocabParallelEmbedding):
                        module.quant_method.process_weights_after_loading(module)

        self.llm.collective_rpc(load)
        self.llm.reset_prefix_cache()

    def sequence_logprobs(self, ids: Sequence[int]) -> list[float]:
        """log p(ids[t] | ids[:t]) for t >= 1 under the engine's current weights."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = SamplingParams(max_tokens=1, prompt_logprobs=0, detokenize=False)
        output = self.llm.generate([TokensPrompt(prompt_token_ids=list(ids))], [params],
                                   use_tqdm=False)[0]
        return [float(step[token].logprob)
                for token, step in zip(ids[1:], output.prompt_logprobs[1:])]

    def sleep(self) -> None:
        """Release the KV cache (and offload weights) while the student trains (GPU only)."""
        self.llm.sleep(level=1)

    def wake_up(self) -> None:
        self.llm.wake_up()


class MirroredEngine:
    """A tensor-parallel engine whose shards live on a group of ranks, driven by the group's
    first rank.

    Every shard's scheduler must see the same requests in the same order and step with the
    others (each forward all-reduces across the shards). The leader runs the rollout and sends
    every call that changes the engine (submit, step, abort) to the other ranks, which make the
    same call on their shard (`follow`) until the leader says it is done (`finish`). So the
    group's schedule, per-conversation or rounds, may depend on tool timing on the leader alone.
    The leader also tells the group when a conversation of another rank's share is final
    (`announce`), so that rank hears of it (`follow(on_finished)`) while the rollout goes on, as
    the leader hears of its own: a served teacher scores every rank's conversations as they end.
    """

    def __init__(self, engine: VLLMEngine, group, leader: int, is_leader: bool):
        self.engine, self.group, self.leader, self.is_leader = engine, group, leader, is_leader

    def _send(self, *command) -> None:
        import torch.distributed as dist

        dist.broadcast_object_list([command], src=self.leader, group=self.group)

    def submit(self, request: TurnRequest, sampling: TurnSampling) -> str:
        self._send("submit", request, sampling)
        return self.engine.submit(request, sampling)

    @property
    def running(self) -> bool:
        return self.engine.running

    def step(self) -> list[tuple[str, list[int], list[float]]]:
        self._send("step")
        return self.engine.step()

    def abort(self) -> None:
        self._send("abort")
        self.engine.abort()

    def announce(self, owner: int, index: int, trajectory) -> None:
        """Conversation `index` of group rank `owner`'s share is final."""
        self._send("finished", owner, index, trajectory)

    def finish(self) -> None:
        self._send("done")

    def follow(self, on_finished: Callable[[int, Any], None] | None = None) -> None:
        """Another rank of the group: repeat the leader's calls until it is done, and pass the
        conversations of this rank's share to `on_finished` as the leader announces them."""
        import torch.distributed as dist

        rank = dist.get_rank(self.group)
        while True:
            box: list = [None]
            dist.broadcast_object_list(box, src=self.leader, group=self.group)
            name, *args = box[0]
            if name == "done":
                return
            if name == "finished":
                owner, index, trajectory = args
                if owner == rank and on_finished is not None:
                    on_finished(index, trajectory)
                continue
            getattr(self.engine, name)(*args)
