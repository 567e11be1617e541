"""Request bodies: the native API's strict schemas, the field types and Strict base the OpenAI-side bodies
(openai/schemas.py) share, and both turned into protocol SamplingParams."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Annotated, Any, TypeVar

import msgspec
from loraplex.frontend.errors import InputError
from loraplex.protocol.structs import SamplingParams

T = TypeVar("T")
MAX_INT64 = 2**63 - 1
MAX_SEED = MAX_INT64
MAX_MESSAGE_LEN = 400  # error messages quote the input, cut to this

# Field types with their ranges, so the schemas (and /openapi.json) state them. Every int is bounded: the processes
# carry ints as int64, and one past that must be refused here, not found overflowing the wire encoder.
Int64 = Annotated[int, msgspec.Meta(ge=-(2**63), le=MAX_INT64)]
TokenCount = Annotated[int, msgspec.Meta(ge=0, le=MAX_INT64)]
TokenId = Annotated[int, msgspec.Meta(ge=0, le=MAX_INT64)]  # the vocabulary bound is checked where it is known
Temperature = Annotated[float, msgspec.Meta(ge=0.0, le=100.0)]
TopP = Annotated[float, msgspec.Meta(gt=0.0, le=1.0)]
TopK = Annotated[int, msgspec.Meta(ge=-1, le=MAX_INT64, description="-1 or 0 = the whole vocabulary")]
Seed = Annotated[int, msgspec.Meta(ge=0, le=MAX_SEED)]
MAX_TOP_LOGPROBS = 20
TopLogprobs = Annotated[int, msgspec.Meta(ge=0, le=MAX_TOP_LOGPROBS)]
MAX_N = 16
NumResults = Annotated[int, msgspec.Meta(ge=1, le=MAX_N)]
Penalty = Annotated[float, msgspec.Meta(ge=-2.0, le=2.0, description="presence / frequency penalty (OpenAI's range)")]
RepetitionPenalty = Annotated[float, msgspec.Meta(gt=0.0, le=100.0, description="1 = off")]
MinP = Annotated[float, msgspec.Meta(ge=0.0, le=1.0)]
LogitBiasValue = Annotated[float, msgspec.Meta(ge=-100.0, le=100.0, description="added to the token's logit")]
# token id (a string: JSON's object keys) -> bias, as OpenAI, vLLM and SGLang take it
LogitBias = dict[str, LogitBiasValue]
LogprobStart = Annotated[int, msgspec.Meta(ge=-1, le=MAX_INT64, description="-1 = output logprobs only")]
# The OS cannot take a NUL byte in a path: refused here, before any file call raises on it.
LoRAScale = Annotated[float, msgspec.Meta(description="the adapter's strength: its term times this, in [0, 4]")]
AdapterPath = Annotated[str, msgspec.Meta(pattern=r"^[^\x00]*$", description="a directory holding a PEFT adapter")]


class Strict(msgspec.Struct, forbid_unknown_fields=True):
    """The base of every object of a request body, nested ones included: a field it does not name is refused (400
    naming the field's JSON path, see `convert`), never dropped. Free-form objects (JSON schemas, template kwargs) are
    typed `dict` on purpose; any other object of known shape is a Strict subclass (tests/unit/test_strict_bodies.py
    walks every request schema to hold this)."""


class NativeSamplingParams(Strict, kw_only=True):
    max_new_tokens: TokenCount = 128
    temperature: Temperature = 1.0
    top_p: TopP = 1.0
    top_k: TopK = -1
    stop: str | list[str] | None = None
    stop_token_ids: list[TokenId] | None = None
    ignore_eos: bool = False
    seed: Seed | None = None
    n: NumResults = 1
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    repetition_penalty: RepetitionPenalty = 1.0
    min_p: MinP = 0.0
    min_new_tokens: TokenCount = 0
    no_stop_trim: bool = False
    skip_special_tokens: bool = True
    json_schema: str | None = None  # structured output (frontend/constraints.py): at most one of the three
    regex: str | None = None
    ebnf: str | None = None
    structural_tag: str | None = None  # SGLang's: xgrammar's structural tag, as JSON text
    logit_bias: LogitBias | None = None


class LoRAMixBody(Strict, kw_only=True):
    """A weighted mix of loaded adapters (frontend/adapters/mixes.py checks the values)."""

    adapters: dict[str, float]  # adapter name -> weight
    merge: str = "linear"  # linear | ties | dare_linear
    density: float | None = None  # ties, dare_linear: the share of each tensor kept, in (0, 1]
    seed: int = 0  # dare_linear: the seed of its random masks


class NativeGenerateRequest(Strict, kw_only=True):
    text: str | list[str] | None = None
    input_ids: list[TokenId | list[TokenId]] | None = None  # one prompt, or a batch of prompts
    sampling_params: NativeSamplingParams | None = None
    lora_path: str | LoRAMixBody | list[str | LoRAMixBody | None] | None = None  # an adapter's name, or a mix
    lora_scale: LoRAScale | list[LoRAScale | None] | None = None  # the adapter's strength, per item for a batch
    stream: bool = False
    rid: str | list[str] | None = None
    return_logprob: bool = False
    top_logprobs_num: TopLogprobs = 0
    return_text_in_logprobs: bool = False
    logprob_start_len: LogprobStart = -1
    priority: int = 0  # --scheduling-policy priority: lower runs first (vLLM's order); fcfs ignores it
    # SGLang's images (a vision model's): one image (a data: or http(s):// URL, a file:// URL or path under
    # --allowed-local-media-path, or raw base64), a prompt's list, or for a batch one item (image or list) per prompt
    image_data: str | list[str | list[str] | None] | None = None


# SGLang /generate fields we do not implement, with the values that mean "off" (accepted and dropped).
NATIVE_NEUTRAL = {
    "audio_data": (None,),
    "modalities": (None, []),
    "custom_logit_processor": (None,),
    "return_hidden_states": (None, False),
    "log_metrics": (None, True, False),
}
NATIVE_SAMPLING_NEUTRAL = {
    "spaces_between_special_tokens": (None, True),
    "custom_params": (None,),
}


# ---- the native API's other bodies -----------------------------------------------------------------------


class AbortBody(Strict):
    rid: str


class AdapterSpecBody(Strict):
    lora_name: str
    lora_path: AdapterPath
    pinned: bool = False
    draft_lora_path: AdapterPath | None = None  # its draft model's adapter (speculative decoding, SGLang's name)


class LoadBody(Strict):
    lora_name: str | None = None
    lora_path: AdapterPath | None = None
    pinned: bool = False
    draft_lora_path: AdapterPath | None = None
    adapters: list[AdapterSpecBody] | None = None


class UnloadBody(Strict):
    lora_name: str | None = None
    lora_names: list[str] | None = None


def _is_neutral(value: object, neutral: tuple) -> bool:
    # Types must match too: `logprobs: 0` is neutral, `logprobs: true` is not, though True == 1 in Python.
    return any(value == v and type(value) is type(v) for v in neutral) or (
        isinstance(value, float) and value == 0.0 and 0 in neutral
    )


def strip_neutral(raw: dict, known: set[str], neutral: dict[str, tuple], what: str) -> dict:
    """Drop unimplemented fields set to their neutral value; refuse them set to anything else, and unknown ones."""
    for key in list(raw):
        if key in known:
            continue
        if key not in neutral:
            raise InputError(f"unknown {what} {brief(key)}")
        if not _is_neutral(raw[key], neutral[key]):
            raise InputError(f"{what} {brief(key)} is not supported (got {brief(raw[key])})")
        del raw[key]
    return raw


def cut(text: str, max_len: int) -> str:
    return text if len(text) <= max_len else text[: max_len - 3] + "..."


def brief(value: object, max_len: int = 80) -> str:
    """A value for an error message: short, and safe for any decoded body (however long or deeply nested)."""
    try:
        return cut(repr(value), max_len)
    except RecursionError:
        return "a deeply nested value"


def decode_body(body: bytes, schema: type[T], strip: Callable[[dict], object] | None = None) -> T:
    """The one way a JSON request body becomes a typed request (native, OpenAI, adapters alike).

    Anything the parser cannot take (malformed JSON, invalid UTF-8, numbers out of range, nesting deeper than the
    decoder recurses) and anything the schema refuses (strict types: "1" is no number, 1 is no bool) is an InputError.
    strip, if given, drops the unimplemented fields that are set to their neutral values (and refuses the others).
    """
    try:
        raw = msgspec.json.decode(body)
    except msgspec.DecodeError as e:
        raise InputError(f"malformed JSON: {e}") from e
    except RecursionError as e:
        raise InputError("malformed JSON: nested too deeply") from e
    if not isinstance(raw, dict):
        raise InputError("the request body must be a JSON object")
    if strip is not None:
        strip(raw)
    return convert(raw, schema, "request")


def strip_native(raw: dict) -> None:
    strip_neutral(raw, set(NativeGenerateRequest.__struct_fields__), NATIVE_NEUTRAL, "field")
    params = raw.get("sampling_params")
    if isinstance(params, dict):
        strip_neutral(
            params, set(NativeSamplingParams.__struct_fields__), NATIVE_SAMPLING_NEUTRAL, "sampling parameter"
        )


# msgspec's words for a field a Strict object does not name, with the path of that object ("$" alone at the top)
_UNKNOWN_FIELD = re.compile(r"Object contains unknown field `(?P<field>.*?)`(?: - at `\$(?P<at>.*)`)?", re.DOTALL)


def convert(value: Any, schema: type[T], what: str, path: str = "") -> T:
    """value (decoded JSON) as schema, or an InputError. path: where value sits in the body, for the messages."""
    try:
        return msgspec.convert(value, schema)
    except msgspec.ValidationError as e:  # its message may quote a field name of any length
        unknown = _UNKNOWN_FIELD.fullmatch(str(e))
        if unknown is not None:
            field_path = f"{path}{unknown['at'] or ''}.{unknown['field']}".lstrip(".")
            raise InputError(f"unknown field {cut(repr(field_path), MAX_MESSAGE_LEN)}") from e
        raise InputError(f"invalid {what}: {cut(str(e), MAX_MESSAGE_LEN)}") from e
    except RecursionError as e:
        raise InputError(f"invalid {what}: nested too deeply") from e


def make_sampling(
    *,
    max_new_tokens: int,
    temperature: float,
    top_p: float,
    top_k: int,
    ignore_eos: bool,
    seed: int | None,
    stop_token_ids: list[int] | None,
    eos_token_ids: list[int],
    logprobs: int = -1,
    presence_penalty: float = 0.0,
    frequency_penalty: float = 0.0,
    repetition_penalty: float = 1.0,
    min_p: float = 0.0,
    min_new_tokens: int = 0,
    logprob_start_len: int = -1,
    prompt_top_logprobs: int = 0,
    controls: LogitControls | None = None,
) -> SamplingParams:
    if max_new_tokens < 0:
        raise InputError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    if not 0.0 <= temperature <= 100.0:
        raise InputError(f"temperature must be in [0, 100], got {temperature}")
    if not 0.0 < top_p <= 1.0:
        raise InputError(f"top_p must be in (0, 1], got {top_p}")
    if top_k < -1:
        raise InputError(f"top_k must be -1 (off) or >= 1, got {top_k}")
    if seed is not None and not 0 <= seed <= MAX_SEED:
        raise InputError(f"seed must be in [0, 2**63 - 1], got {seed}")
    if not (-2.0 <= presence_penalty <= 2.0 and -2.0 <= frequency_penalty <= 2.0):
        raise InputError("presence_penalty and frequency_penalty must be in [-2, 2]")
    if not 0.0 < repetition_penalty <= 100.0:
        raise InputError(f"repetition_penalty must be in (0, 100], got {repetition_penalty}")
    if not 0.0 <= min_p <= 1.0:
        raise InputError(f"min_p must be in [0, 1], got {min_p}")
    if not 0 <= min_new_tokens <= max_new_tokens:
        raise InputError(f"the minimum of new tokens ({min_new_tokens}) must be in [0, max tokens ({max_new_tokens})]")
    stops = list(stop_token_ids or [])
    if any(t < 0 for t in stops):
        raise InputError("stop_token_ids must be non-negative")
    if not ignore_eos:
        stops += [t for t in eos_token_ids if t not in stops]
    return SamplingParams(
        max_new_tokens=max_new_tokens,
        temperature=float(temperature),
        top_p=float(top_p),
        top_k=-1 if top_k == 0 else top_k,
        ignore_eos=ignore_eos,
        seed=seed,
        stop_token_ids=stops,
        logprobs=logprobs,
        presence_penalty=float(presence_penalty),
        frequency_penalty=float(frequency_penalty),
        repetition_penalty=float(repetition_penalty),
        min_p=float(min_p),
        min_new_tokens=min_new_tokens,
        logprob_start_len=logprob_start_len,
        prompt_top_logprobs=prompt_top_logprobs,
        **(msgspec.structs.asdict(controls) if controls is not None else {}),
    )


def stop_list(stop: str | list[str] | None) -> list[str]:
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else list(stop)
    if len(stops) > 16:
        raise InputError("at most 16 stop strings")
    return [s for s in stops if s]


def native_sampling(
    params: NativeSamplingParams | None, eos_token_ids: list[int], logprobs: int = -1, logprob_start_len: int = -1,
    vocab_size: int | None = None,
) -> tuple[SamplingParams, list[str]]:
    p = params or NativeSamplingParams()
    sampling = make_sampling(
        max_new_tokens=p.max_new_tokens,
        temperature=p.temperature,
        top_p=p.top_p,
        top_k=p.top_k,
        ignore_eos=p.ignore_eos,
        seed=p.seed,
        stop_token_ids=p.stop_token_ids,
        eos_token_ids=eos_token_ids,
        logprobs=logprobs,
        presence_penalty=p.presence_penalty,
        frequency_penalty=p.frequency_penalty,
        repetition_penalty=p.repetition_penalty,
        min_p=p.min_p,
        min_new_tokens=p.min_new_tokens,
        logprob_start_len=logprob_start_len,
        prompt_top_logprobs=max(logprobs, 0),  # SGLang: top_logprobs_num alternatives for prompt and output alike
        controls=logit_controls(p.logit_bias, None, None, None, vocab_size),
    )
    return sampling, stop_list(p.stop)


class LogitControls(msgspec.Struct, frozen=True, kw_only=True):
    """vLLM's logit controls as SamplingParams takes them (its fields of the same names)."""

    logit_bias: dict[int, float] = {}
    allowed_token_ids: list[int] | None = None
    bad_words_ids: list[list[int]] = []


def logit_controls(
    logit_bias: dict[str, float] | None, allowed_token_ids: list[int] | None, bad_words: list[str] | None,
    tokenizer: Any, vocab_size: int | None,
) -> LogitControls:  # fmt: skip
    """The request's logit_bias, allowed_token_ids and bad_words checked (ids inside the vocabulary, as vLLM checks
    them; vocab_size None: not known yet, the runtime refuses the request anyway) and bad words tokenized."""
    bias = {}
    for key, value in (logit_bias or {}).items():
        try:
            bias[int(key)] = float(value)
        except ValueError:
            raise InputError(f"logit_bias keys must be token ids, got {brief(key)}") from None
    if allowed_token_ids is not None and not allowed_token_ids:
        raise InputError("allowed_token_ids is an empty list: nothing could be sampled")
    words = bad_words_ids(bad_words or [], tokenizer)
    if vocab_size is not None:
        for field, ids in (("logit_bias", list(bias)), ("allowed_token_ids", allowed_token_ids or []),
                           ("bad_words", [t for w in words for t in w])):  # fmt: skip
            outside = sorted({t for t in ids if not 0 <= t < vocab_size})
            if outside:
                raise InputError(f"{field} has token ids outside the vocabulary [0, {vocab_size}): {brief(outside)}")
    allowed = None if allowed_token_ids is None else sorted(set(allowed_token_ids))
    return LogitControls(logit_bias=bias, allowed_token_ids=allowed, bad_words_ids=words)


def bad_words_ids(bad_words: list[str], tokenizer: Any) -> list[list[int]]:
    """Each word's token sequences, as vLLM makes them: the word (leading blanks stripped) tokenized alone, and again
    after a space where that gives a different first token and as many tokens (a word at the start of the text and
    one in the middle of it)."""
    sequences: list[list[int]] = []
    for word in bad_words:
        if not word.strip():
            raise InputError(f"bad_words holds a blank word: {brief(word)}")
        alone = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        sequences.append(alone)
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        if spaced[0] != alone[0] and len(spaced) == len(alone):
            sequences.append(spaced)
    return sequences
