"""A teacher server: one vLLM engine that scores finished conversations over HTTP.

    python -m opd.teachers.server --model DIR --port 8800 [--max-top-k 64] [--host 0.0.0.0]
                                  [--payload logprobs|hidden] [--temperature 1.0]

Started next to the trainer (launch/teacher_server.sh) or on its own GPUs or nodes; the trainer
reaches it with `teacher.engine: served` and `teacher.urls` (opd.teachers.served). It answers

    GET  /health   a small JSON object: the vocabulary size, a hash of the tokenizer's
                   vocabulary, the longest conversation and the largest top-k it scores,
                   the payloads it serves, their temperature and its head's shape and hash
                   (opd.teachers.wire.Health); it listens only once the engine is ready
    POST /score    a binary request of one or more conversations (token ids and target
                   positions) -> a binary answer: each target token's log-prob and, for topk,
                   the top-k ids and log-probs and the log of the rest's mass; or, with
                   `--payload hidden`, the final hidden states where each target is predicted
                   (opd.teachers.wire)
    GET  /stats    JSON counters since the start: tokens_scored, tokens_computed (the rest
                   came from the prefix cache), conversations_rescored (see below)

vLLM scores a prompt with `SamplingParams(max_tokens=1, prompt_logprobs=k)`: the log-prob of
every prompt token and the top k at each position. Its prompt log-probs are the log-softmax of
the model's logits as its head leaves them (vLLM applies no sampling processor to prompt
tokens, whatever `logprobs_mode`), so `--temperature T` divides those logits by T in the head
itself: the scale of vLLM's LogitsProcessor, which every decoder's `compute_logits` applies
after the head (and after a soft cap), is multiplied by 1/T in each worker once the engine is
up. The answers are then log-softmax(logits / T) over the whole vocabulary, as the in-process
teacher computes them, and /health says T: the trainer refuses a server whose temperature is
not its `loss.temperature`. Requests that arrive together are scored in one `generate` call
(one engine thread; HTTP threads only parse and wait).

`--payload hidden` starts vLLM's pooling runner instead (one engine per process, so one payload
family per server): `encode` with `token_embed` pooling over every token and no activation
returns the decoder's output after the final norm, which the trainer turns into the exact full
distribution with the teacher's output head (opd.teachers.output_head) inside its fused loss.
They travel in the engine's precision: bfloat16 from a bf16 engine (vLLM hands them back as
float32, but every value is a bf16 one, so nothing is lost), float32 otherwise.

Prefix reuse: vLLM skips reading its prefix cache for a request with prompt log-probs unless
the request says `skip_reading_prefix_cache=False`; then the rows of the answer a cache hit
covers are left unfilled (`num_cached_tokens` of them), and the rest are exact. A conversation's
targets start after its prompt, so a hit that ends at or before its first target position costs
nothing, and the samples of one prompt and BFCL's long shared system prompt are computed once
(bench/served_teacher.py prefix); a conversation whose hit reaches past its first target (a
duplicate, or samples that agree for a whole cache block) is scored again without reading the
cache.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import queue
import sys
import threading
from concurrent.futures import Future
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np

from opd.teachers.wire import (
    Health,
    ScoreAnswer,
    ScoreRequest,
    WireError,
    decode_request,
    encode_answer,
    vocabulary_hash,
)


class RequestError(ValueError):
    """A request this server cannot score (answered 400 with the sentence)."""


PAYLOADS = {"logprobs": ["sampled", "topk"], "hidden": ["distribution"]}  # --payload: kinds


class ScoringEngine:
    """The vLLM engine and what `/health` reports about it."""

    def __init__(self, model: str, tokenizer: str, *, payload: str, max_model_len: int,
                 max_top_k: int, dtype: str, tensor_parallel_size: int,
                 gpu_memory_utilization: float, quantization: str | None = None,
                 enable_expert_parallel: bool = False, temperature: float = 1.0):
        # One process: a killed server leaves no engine core behind.
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        from transformers import AutoConfig, AutoTokenizer
        from vllm import LLM

        text_config = AutoConfig.from_pretrained(model).get_text_config()
        head_sha256, self.hidden_dtype = "", "float32"
        if payload == "hidden":
            from opd.teachers.output_head import head_hash, load_output_head

            head_sha256 = head_hash(load_output_head(model, "--model")[0])
        self.health = Health(vocab_size=int(text_config.vocab_size),
                             tokenizer_sha256=vocabulary_hash(AutoTokenizer.from_pretrained(
                                 tokenizer, local_files_only=True)),
                             max_model_len=max_model_len, max_top_k=max_top_k, model=model,
                             payloads=PAYLOADS[payload],
                             hidden_size=int(text_config.hidden_size), head_sha256=head_sha256,
                             temperature=temperature)
        common = dict(model=model, dtype=dtype, seed=0, max_model_len=max_model_len,
                      enforce_eager=True,
                      tensor_parallel_size=tensor_parallel_size,
                      gpu_memory_utilization=gpu_memory_utilization,
                      quantization=quantization, enable_expert_parallel=enable_expert_parallel)
        if payload == "hidden":
            from vllm.config import PoolerConfig

            # Every token's final hidden state, as the decoder leaves it (no normalisation);
            # the pooling runner needs a tokenizer, though it is given token ids only.
            self.llm = LLM(runner="pooling", tokenizer=tokenizer, enable_prefix_caching=False,
                           **common,
                           pooler_config=PoolerConfig(task="token_embed", tok_pooling_type="ALL",
                                                      use_activation=False))
            import torch

            self.hidden_dtype = "bfloat16" if self.llm.llm_engine.model_config.dtype \
                == torch.bfloat16 else "float32"
        else:
            # Prefix reuse: see the module's docstring.
            self.llm = LLM(skip_tokenizer_init=True, max_logprobs=max_top_k,
                           enable_prefix_caching=True, **common)
            if temperature != 1.0:
                scaled = self.llm.apply_model(functools.partial(scale_logits, 1.0 / temperature))
                if not all(scaled):
                    raise SystemExit(f"--temperature: {model}'s vLLM model has no "
                                     "LogitsProcessor to scale; serve it at temperature 1.")
        self.stats = {"tokens_scored": 0, "tokens_computed": 0, "conversations_rescored": 0}

    def check(self, request: ScoreRequest) -> None:
        """Refuse, in one sentence, what the engine would fail on."""
        if request.kind not in self.health.payloads:
            raise RequestError(f"this server answers {' and '.join(self.health.payloads)} "
                               f"requests, not {request.kind} (its --payload)")
        if request.kind == "topk" and not 1 <= request.top_k <= self.health.max_top_k:
            raise RequestError(f"top_k={request.top_k} is outside 1..{self.health.max_top_k} "
                               "(the server's --max-top-k)")
        for ids in request.token_ids:
            # max_tokens=1: vLLM needs room for the one token it generates.
            if len(ids) + 1 > self.health.max_model_len:
                raise RequestError(f"a conversation of {len(ids)} tokens does not fit the "
                                   f"server's --max-model-len={self.health.max_model_len} "
                                   "(it needs one more)")
            if len(ids) and (ids.min() < 0 or ids.max() >= self.health.vocab_size):
                raise RequestError("a token id is outside the served vocabulary of "
                                   f"{self.health.vocab_size}")

    def score(self, requests: list[ScoreRequest]) -> list[ScoreAnswer]:
        """Every request's answer, from one engine call over all their conversations."""
        if self.health.payloads == PAYLOADS["hidden"]:
            return self._hidden(requests)
        from vllm.inputs import TokensPrompt

        prompts, kinds, first_targets = [], [], []
        for request in requests:
            for ids, positions in zip(request.token_ids, request.positions):
                prompts.append(TokensPrompt(prompt_token_ids=ids.tolist()))
                kinds.append(request)
                first_targets.append(int(positions.min()) if len(positions) else len(ids))
        outputs = self.llm.generate(prompts, [_params(r, read_cache=True) for r in kinds],
                                    use_tqdm=False)
        # Rows below a cache hit are unfilled: score again where the hit covers a target.
        again = [i for i, output in enumerate(outputs)
                 if (output.num_cached_tokens or 0) > first_targets[i]]
        lengths = [len(prompt["prompt_token_ids"]) for prompt in prompts]
        self.stats["tokens_scored"] += sum(lengths)
        self.stats["tokens_computed"] += sum(lengths) - sum(
            output.num_cached_tokens or 0 for output in outputs) + sum(lengths[i] for i in again)
        self.stats["conversations_rescored"] += len(again)
        if again:
            redone = self.llm.generate([prompts[i] for i in again],
                                       [_params(kinds[i], read_cache=False) for i in again],
                                       use_tqdm=False)
            for i, output in zip(again, redone):
                outputs[i] = output
        flat = iter(output.prompt_logprobs for output in outputs)
        return [self._answer(request, [next(flat) for _ in request.token_ids])
                for request in requests]

    def _hidden(self, requests: list[ScoreRequest]) -> list[ScoreAnswer]:
        import torch
        from vllm.inputs import TokensPrompt

        prompts = [TokensPrompt(prompt_token_ids=ids.tolist())
                   for request in requests for ids in request.token_ids]
        outputs = iter(self.llm.encode(prompts, pooling_task="token_embed", use_tqdm=False))
        answers = []
        for request in requests:
            # Row i is the state that predicts token i + 1: the target positions' rows.
            hidden_TH = torch.cat([torch.zeros(0, self.health.hidden_size)] + [
                next(outputs).outputs.data[torch.from_numpy(positions).long()].float()
                for positions in request.positions])
            if self.hidden_dtype == "bfloat16":  # exact: the engine's values are bf16 ones
                hidden = hidden_TH.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
            else:
                hidden = hidden_TH.numpy()
            answers.append(ScoreAnswer("distribution", 0, np.zeros(0, np.float32),
                                       hidden_TH=hidden, hidden_dtype=self.hidden_dtype))
        return answers

    def _answer(self, request: ScoreRequest, prompt_logprobs: list) -> ScoreAnswer:
        k = request.top_k if request.kind == "topk" else 0
        # Empty first rows: a request may hold no target token.
        sampled = [np.zeros(0, np.float32)]
        ids, logprobs = [np.zeros((0, k), np.int32)], [np.zeros((0, k), np.float32)]
        for positions, flat in zip(request.positions, prompt_logprobs):
            # Position j holds the distribution of token j given the tokens before it: first
            # the prompt token's entry, then the top k in descending order (vLLM's
            # gather_logprobs; position 0 holds nothing).
            first_J = np.asarray(flat.start_indices, dtype=np.int64)[positions + 1]
            values = np.asarray(flat.logprobs, dtype=np.float32)
            sampled.append(values[first_J])
            if k:
                columns_JK = first_J[:, None] + 1 + np.arange(k)
                ids.append(np.asarray(flat.token_ids, dtype=np.int32)[columns_JK])
                logprobs.append(values[columns_JK])
        answer = ScoreAnswer(request.kind, request.top_k, np.concatenate(sampled))
        if k:
            answer.topk_ids_TK = np.concatenate(ids).reshape(-1, k)
            answer.topk_logprobs_TK = np.concatenate(logprobs).reshape(-1, k)
            answer.topk_rest_T = _rest_logprob(answer.topk_logprobs_TK,
                                               k >= self.health.vocab_size)
        return answer


def scale_logits(factor: float, model) -> int:
    """Multiply the scale of every vLLM LogitsProcessor in `model` by `factor` (in a worker,
    through `LLM.apply_model`); how many there were."""
    from vllm.model_executor.layers.logits_processor import LogitsProcessor

    heads = [module for module in model.modules() if isinstance(module, LogitsProcessor)]
    for head in heads:
        head.scale *= factor
    return len(heads)


def _params(request: ScoreRequest, *, read_cache: bool):
    """Prompt log-probs of a request's kind: 0 is the prompt token's own log-prob only. Flat:
    plain lists instead of a dict of objects per position, each position's entries in a fixed
    order (`ScoringEngine._answer`)."""
    from vllm import SamplingParams

    return SamplingParams(max_tokens=1, detokenize=False, flat_logprobs=True,
                          prompt_logprobs=request.top_k if request.kind == "topk" else 0,
                          skip_reading_prefix_cache=not read_cache)


def _rest_logprob(top_logprobs_TK: np.ndarray, whole_vocabulary: bool) -> np.ndarray:
    """log(1 - the top k's mass) per row, summed in float64; -inf where nothing is outside them
    (rounding can push the sum of a whole vocabulary past 1)."""
    mass_T = np.exp(top_logprobs_TK.astype(np.float64)).sum(axis=1)
    with np.errstate(divide="ignore"):
        rest_T = np.log1p(-np.minimum(mass_T, 1.0))
    if whole_vocabulary:
        rest_T[:] = -np.inf
    return rest_T.astype(np.float32)


class Batcher:
    """One engine thread: each round scores every request waiting, in one call."""

    def __init__(self, engine: ScoringEngine):
        self.engine = engine
        self.waiting: queue.Queue[tuple[ScoreRequest, Future]] = queue.Queue()
        threading.Thread(target=self._run, name="engine", daemon=True).start()

    def submit(self, request: ScoreRequest) -> Future:
        future: Future = Future()
        self.waiting.put((request, future))
        return future

    def _run(self) -> None:
        while True:
            batch = [self.waiting.get()]
            while not self.waiting.empty():
                batch.append(self.waiting.get_nowait())
            try:
                answers = self.engine.score([request for request, _ in batch])
            except Exception as error:  # the engine failed: every waiting request hears it
                for _, future in batch:
                    future.set_exception(error)
                continue
            for (_, future), answer in zip(batch, answers):
                future.set_result(answer)


def handler(engine: ScoringEngine, batcher: Batcher) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            if self.path == "/stats":
                return self._reply(200, json.dumps(engine.stats).encode(), "application/json")
            if self.path != "/health":
                return self._reply(404, b"no such path; GET /health or POST /score", "text/plain")
            self._reply(200, engine.health.to_json(), "application/json")

        def do_POST(self):
            if self.path != "/score":
                return self._reply(404, b"no such path; GET /health or POST /score", "text/plain")
            body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
            try:
                request = decode_request(body)
                engine.check(request)
            except (WireError, RequestError) as error:
                return self._reply(400, f"{error}.".encode(), "text/plain")
            try:
                answer = batcher.submit(request).result()
            except Exception as error:
                return self._reply(500, f"the engine failed: {error!r}".encode(), "text/plain")
            self._reply(200, encode_answer(answer), "application/octet-stream")

        def _reply(self, status: int, body: bytes, content_type: str) -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format, *args):
            pass  # one line per request would flood the log

    return Handler


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="Hugging Face model directory")
    parser.add_argument("--tokenizer", default="",
                        help="directory of the tokenizer the trainer uses (default: --model)")
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to listen on (0.0.0.0 for trainers on other nodes)")
    parser.add_argument("--port", type=int, default=8800)
    parser.add_argument("--payload", choices=sorted(PAYLOADS), default="logprobs",
                        help="logprobs: sampled and top-k log-probs (generate runner); hidden: "
                             "the final hidden states for teacher.signal=distribution (pooling "
                             "runner)")
    parser.add_argument("--max-model-len", type=int, default=4096,
                        help="the longest conversation scored, plus one")
    parser.add_argument("--max-top-k", type=int, default=64,
                        help="the largest teacher.top_k answered (the vocabulary size serves "
                             "the whole distribution)")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.85,
                        help="the share of device memory vLLM takes (of host RAM on CPU)")
    parser.add_argument("--quantization", choices=["fp8"], default=None,
                        help="quantize the weights at load (fp8: half of bf16's bytes)")
    parser.add_argument("--enable-expert-parallel", action="store_true",
                        help="a MoE teacher's experts split over the GPUs instead of sliced")
    parser.add_argument("--temperature", type=float, default=1.0,
                        help="the log-probs' temperature, the recipe's loss.temperature (logprobs "
                             "payload; the hidden one leaves it to the trainer)")
    args = parser.parse_args(argv)
    if not args.temperature > 0:
        parser.error(f"--temperature must be positive, got {args.temperature:g}")
    if args.temperature != 1.0 and args.payload == "hidden":
        parser.error("--temperature applies to --payload logprobs; with hidden states the "
                     "trainer applies the head at loss.temperature itself")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    tokenizer = args.tokenizer or args.model
    if not any((Path(tokenizer) / name).is_file()
               for name in ("tokenizer.json", "tokenizer_config.json")):
        sys.exit(f"--tokenizer: {tokenizer} holds no tokenizer; the trainer checks the served "
                 "vocabulary against its own, so pass the tokenizer directory it uses.")
    engine = ScoringEngine(args.model, tokenizer, payload=args.payload,
                           max_model_len=args.max_model_len,
                           max_top_k=args.max_top_k, dtype=args.dtype,
                           tensor_parallel_size=args.tensor_parallel_size,
                           gpu_memory_utilization=args.gpu_memory_utilization,
                           quantization=args.quantization,
                           enable_expert_parallel=args.enable_expert_parallel,
                           temperature=args.temperature)
    server = ThreadingHTTPServer((args.host, args.port), handler(engine, Batcher(engine)))
    server.daemon_threads = True
    print(f"teacher server: {args.model} on http://{args.host}:{server.server_port}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
