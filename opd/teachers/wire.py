"""The served teacher's wire format: binary requests and answers of `POST /score`.

Both directions are a fixed header followed by raw little-endian arrays (int32 ids, float32
log-probs, float32 or bfloat16 hidden states), never JSON lists of floats:

    header     magic b"OPDT", version (u16), kind (u16: 0 sampled, 1 topk, 2 distribution),
               top_k (u32), count (u32): conversations in a request, target tokens in an answer
    request    lengths int32[C], target counts int32[C], token ids int32[sum lengths],
               target positions int32[sum targets] (position i: score token i + 1 given the
               tokens up to i, so 0 <= i < length - 1)
    answer     logprobs float32[T] (the log-prob of each target token), then for topk
               top-k ids int32[T, k], top-k log-probs float32[T, k], rest float32[T] (the log
               of the mass outside the top k; -inf when k covers the vocabulary); for
               distribution instead hidden size (u32), dtype (u16: 0 float32, 1 bfloat16), 0
               (u16), then the final hidden states [T, H] (after the final norm; the trainer
               applies the teacher's output head)

An answer costs 4 bytes per target token for `sampled`, 8k + 8 for `topk` (k = 20: 168),
whatever the vocabulary, and 2H for `distribution` from a bf16 engine (4H from an fp32 one:
the server ships the engine's own precision, so neither loses a bit); a request 4 bytes per
token plus 4 per target.

`GET /health` answers a small JSON object (`Health`): what the trainer checks before it sends
anything.
"""

from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import dataclass

import numpy as np

MAGIC = b"OPDT"
VERSION = 1
KINDS = ("sampled", "topk", "distribution")  # the teacher.signal each answers
HIDDEN_DTYPES = ("float32", "bfloat16")
_HEADER = struct.Struct("<4sHHII")
_HIDDEN = struct.Struct("<IHH")  # hidden size, dtype (HIDDEN_DTYPES), reserved
_INT = np.dtype("<i4")
_FLOAT = np.dtype("<f4")
_BFLOAT = np.dtype("<u2")  # bfloat16 bits: numpy has no bfloat16


class WireError(ValueError):
    """Bytes that are not a well-formed request or answer of this version."""


@dataclass
class ScoreRequest:
    """Conversations to score: token ids and the positions whose next token is a target."""

    kind: str  # one of KINDS
    top_k: int  # kind == "topk"
    token_ids: list[np.ndarray]  # int32 [L_c] per conversation
    positions: list[np.ndarray]  # int32 [T_c] per conversation


@dataclass
class ScoreAnswer:
    """Every target token of a request, conversation after conversation, in order."""

    kind: str
    top_k: int
    logprobs_T: np.ndarray  # float32 [T]; empty for distribution (the head gives them)
    topk_ids_TK: np.ndarray | None = None  # int32 [T, k]
    topk_logprobs_TK: np.ndarray | None = None  # float32 [T, k]
    topk_rest_T: np.ndarray | None = None  # float32 [T]
    hidden_TH: np.ndarray | None = None  # float32, or uint16 bfloat16 bits [T, H]
    hidden_dtype: str = "float32"  # one of HIDDEN_DTYPES

    @property
    def targets(self) -> int:
        """Target tokens answered."""
        if self.kind == "distribution":
            assert self.hidden_TH is not None
            return len(self.hidden_TH)
        return len(self.logprobs_T)


@dataclass
class Health:
    """What a teacher server serves (`GET /health`)."""

    vocab_size: int  # rows of the model's output head (the config's vocab_size)
    tokenizer_sha256: str  # `vocabulary_hash` of the tokenizer it was started with
    max_model_len: int  # the longest conversation it scores
    max_top_k: int  # the largest top_k it answers
    model: str
    payloads: list[str]  # the KINDS it answers (its --payload)
    hidden_size: int  # columns of the output head, the width of a distribution answer
    head_sha256: str  # output_head.head_hash of its head if it serves distribution, else ""
    temperature: float = 1.0  # of its sampled and top-k log-probs (--temperature)

    def to_json(self) -> bytes:
        return json.dumps(vars(self)).encode()

    @classmethod
    def from_json(cls, body: bytes) -> Health:
        return cls(**json.loads(body))


def vocabulary_hash(tokenizer) -> str:
    """A digest of a tokenizer's token -> id map: equal exactly when `get_vocab()` is equal (the
    trainer's own test of a shared vocabulary, opd.inputs.check_vocabulary)."""
    items = sorted(tokenizer.get_vocab().items(), key=lambda item: item[1])
    return hashlib.sha256(json.dumps(items, ensure_ascii=False).encode()).hexdigest()


def _header(kind: str, top_k: int, count: int) -> bytes:
    return _HEADER.pack(MAGIC, VERSION, KINDS.index(kind), top_k, count)


class _Reader:
    def __init__(self, body: bytes, what: str):
        self.body, self.offset, self.what = body, _HEADER.size, what
        if len(body) < _HEADER.size:
            raise WireError(f"{what} of {len(body)} bytes is shorter than its header")
        magic, version, kind, self.top_k, self.count = _HEADER.unpack_from(body)
        if magic != MAGIC or version != VERSION:
            raise WireError(f"{what} is not version {VERSION} of the served teacher's format")
        if kind >= len(KINDS):
            raise WireError(f"{what} names an unknown kind {kind}")
        self.kind = KINDS[kind]

    def array(self, dtype: np.dtype, count: int) -> np.ndarray:
        end = self.offset + count * dtype.itemsize
        if count < 0 or end > len(self.body):
            raise WireError(f"{self.what} ends before its arrays do")
        values = np.frombuffer(self.body, dtype=dtype, count=count, offset=self.offset)
        self.offset = end
        return values

    def hidden_meta(self) -> tuple[int, int]:
        """A distribution answer's hidden size and dtype code."""
        if self.offset + _HIDDEN.size > len(self.body):
            raise WireError(f"{self.what} ends before its hidden size")
        hidden_size, code, _ = _HIDDEN.unpack_from(self.body, self.offset)
        self.offset += _HIDDEN.size
        if code >= len(HIDDEN_DTYPES):
            raise WireError(f"{self.what} names an unknown hidden-state dtype {code}")
        return hidden_size, code

    def done(self) -> None:
        if self.offset != len(self.body):
            raise WireError(f"{self.what} has {len(self.body) - self.offset} bytes past its arrays")


def encode_request(request: ScoreRequest) -> bytes:
    lengths = np.array([len(ids) for ids in request.token_ids], dtype=_INT)
    counts = np.array([len(p) for p in request.positions], dtype=_INT)
    parts = [_header(request.kind, request.top_k, len(lengths)), lengths.tobytes(),
             counts.tobytes()]
    parts += [np.asarray(ids, dtype=_INT).tobytes() for ids in request.token_ids]
    parts += [np.asarray(p, dtype=_INT).tobytes() for p in request.positions]
    return b"".join(parts)


def decode_request(body: bytes) -> ScoreRequest:
    reader = _Reader(body, "the request")
    lengths = reader.array(_INT, reader.count)
    counts = reader.array(_INT, reader.count)
    token_ids = [reader.array(_INT, int(n)) for n in lengths]
    positions = [reader.array(_INT, int(n)) for n in counts]
    reader.done()
    for ids, rows in zip(token_ids, positions):
        if len(rows) and (rows.min() < 0 or rows.max() >= len(ids) - 1):
            raise WireError("the request has a target position outside its conversation")
    return ScoreRequest(reader.kind, reader.top_k, token_ids, positions)


def encode_answer(answer: ScoreAnswer) -> bytes:
    if answer.kind == "distribution":
        assert answer.hidden_TH is not None
        dtype = _FLOAT if answer.hidden_dtype == "float32" else _BFLOAT
        return b"".join([_header(answer.kind, 0, len(answer.hidden_TH)),
                         _HIDDEN.pack(answer.hidden_TH.shape[1],
                                      HIDDEN_DTYPES.index(answer.hidden_dtype), 0),
                         np.asarray(answer.hidden_TH, dtype=dtype).tobytes()])
    parts = [_header(answer.kind, answer.top_k, len(answer.logprobs_T)),
             np.asarray(answer.logprobs_T, dtype=_FLOAT).tobytes()]
    if answer.kind == "topk":
        assert answer.topk_ids_TK is not None and answer.topk_logprobs_TK is not None \
            and answer.topk_rest_T is not None
        parts += [np.asarray(answer.topk_ids_TK, dtype=_INT).tobytes(),
                  np.asarray(answer.topk_logprobs_TK, dtype=_FLOAT).tobytes(),
                  np.asarray(answer.topk_rest_T, dtype=_FLOAT).tobytes()]
    return b"".join(parts)


def decode_answer(body: bytes) -> ScoreAnswer:
    reader = _Reader(body, "the answer")
    targets, k = reader.count, reader.top_k
    if reader.kind == "distribution":
        hidden_size, code = reader.hidden_meta()
        dtype = _FLOAT if HIDDEN_DTYPES[code] == "float32" else _BFLOAT
        hidden_TH = reader.array(dtype, targets * hidden_size).reshape(targets, hidden_size)
        reader.done()
        return ScoreAnswer(reader.kind, 0, np.zeros(0, _FLOAT), hidden_TH=hidden_TH,
                           hidden_dtype=HIDDEN_DTYPES[code])
    answer = ScoreAnswer(reader.kind, k, reader.array(_FLOAT, targets))
    if reader.kind == "topk":
        answer.topk_ids_TK = reader.array(_INT, targets * k).reshape(targets, k)
        answer.topk_logprobs_TK = reader.array(_FLOAT, targets * k).reshape(targets, k)
        answer.topk_rest_T = reader.array(_FLOAT, targets)
    reader.done()
    return answer
