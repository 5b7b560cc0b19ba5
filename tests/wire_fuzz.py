"""Wire fuzzing of a running worker: hypothesis-built requests with extreme values, plus raw corrupt payloads.

`run_wire_fuzz(target, count=..., seconds=...)` sends up to `count` calls (stopping after `seconds`) and returns a
FuzzReport; tests/test_wire_fuzz.py runs a short one, `make soak` a long one. Every call must end OK or with a status
the proto documents for bad input or load; UNKNOWN and INTERNAL are what the fuzzing looks for.

Calls go through generic channel methods with pre-serialized bytes, so the same path carries valid messages,
messages no honest client would build (huge repeated fields, NaN, int32/int64 extremes, any Unicode) and bytes that
are not a message at all (flipped bytes, truncation, invalid UTF-8 and lone surrogates in string fields).
"""

from __future__ import annotations

import collections
import math
import time
from dataclasses import dataclass, field

import grpc
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import seed as hypothesis_seed
from hypothesis import strategies as st

from radixcache.v1 import radixcache_pb2 as pb

SERVICE = "/radixcache.v1.RadixCache/"
# Statuses the proto documents for bad input, load and deadlines. INTERNAL is documented for a failure inside a
# request, which no input may cause; UNKNOWN is never documented.
EXPECTED = {
    grpc.StatusCode.OK,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.ALREADY_EXISTS,
    grpc.StatusCode.DEADLINE_EXCEEDED,
}
INT32 = (-(2**31), 2**31 - 1)
INT64 = (-(2**63), 2**63 - 1)


@dataclass(frozen=True)
class FuzzCall:
    method: str  # e.g. "Generate"
    payload: bytes
    note: str  # what was sent, for the report

    @property
    def streaming(self) -> bool:
        return self.method == "Generate"


@dataclass
class FuzzReport:
    calls: int = 0
    statuses: collections.Counter[str] = field(default_factory=collections.Counter)
    unexpected: list[tuple[str, str, str, str]] = field(default_factory=list)  # (method, status, details, note)

    @property
    def unknown_or_internal(self) -> int:
        return self.statuses["UNKNOWN"] + self.statuses["INTERNAL"]


# -- strategies ------------------------------------------------------------------------------------------------
def _extreme_ints(lo: int, hi: int, small: tuple[int, int] = (-2, 8)) -> st.SearchStrategy[int]:
    return st.one_of(st.sampled_from([lo, hi, 0, -1, 1, lo + 1, hi - 1]), st.integers(*small), st.integers(lo, hi))


_wild_floats = st.one_of(
    st.sampled_from([math.nan, math.inf, -math.inf, -0.0, 1e-45, 5e-324, 1e-300, 1e300, -1.0]),
    st.floats(allow_nan=True, allow_infinity=True),
)
# In range, including the extremes that used to crash sampling (temperature 1e-38, top_p 1e-46).
_tame_unit = st.sampled_from([1e-46, 1e-38, 1e-12, 1.0]) | st.floats(0.0, 1.0, exclude_min=True)
_tame_temperature = st.sampled_from([0.0, 1e-38, 1e-30, 1e-6, 5.0, 1e6]) | st.floats(0.0, 2.0)
# Any Unicode protobuf accepts (no lone surrogates: those only travel as invalid bytes, see _corrupt).
_text = st.text(st.characters(exclude_categories=["Cs"]), max_size=200)
_short_text = st.text(st.characters(exclude_categories=["Cs"]), min_size=1, max_size=40)
_ids = st.lists(st.integers(0, 193), min_size=1, max_size=200)
_wild_ids = st.lists(_extreme_ints(*INT32, small=(0, 300)), max_size=300) | st.builds(
    lambda n, v: [v] * n, st.sampled_from([5_000, 100_000]), _extreme_ints(*INT32, small=(0, 300))
)
_roles = st.sampled_from(["system", "user", "assistant", "tool"])
_messages = st.lists(st.tuples(_roles, _text), min_size=1, max_size=6)
_wild_messages = st.lists(st.tuples(_roles | _text, _text), max_size=12) | st.builds(
    lambda n: [("user", "x")] * n, st.sampled_from([2_000, 50_000])
)


@st.composite
def _input(draw: st.DrawFn, message: object, kinds: tuple[str, ...], wild: bool) -> None:
    """Sets one of the request's `input` oneof fields (a wild request: maybe none, maybe huge or out of range)."""
    kind = draw(st.sampled_from((*kinds, "none") if wild else kinds))
    if kind == "text":
        text = draw(_text | st.sampled_from(["x" * 5_000, "y" * 300_000])) if wild else draw(_short_text)
        message.text = text  # type: ignore[attr-defined]
    elif kind == "token_ids":
        message.token_ids.ids.extend(draw(_wild_ids if wild else _ids))  # type: ignore[attr-defined]
    elif kind == "messages":
        message.messages.SetInParent()  # type: ignore[attr-defined]
        for role, content in draw(_wild_messages if wild else _messages):
            message.messages.messages.add(role=role, content=content)  # type: ignore[attr-defined]


@st.composite
def generate_requests(draw: st.DrawFn, wild: bool | None = None) -> pb.GenerateRequest:
    """About 1 in 3 wild (extreme ints, NaN/inf, huge repeated fields); the rest in range, so they reach the engine."""
    wild = draw(st.integers(0, 2)) == 0 if wild is None else wild
    r = pb.GenerateRequest(request_id=draw(_text) if wild else "")
    draw(_input(r, ("text", "token_ids", "messages"), wild))
    optional = {
        "max_tokens": _extreme_ints(*INT32) if wild else st.integers(1, 6),
        "temperature": _wild_floats if wild else _tame_temperature,
        "top_k": _extreme_ints(*INT32) if wild else st.sampled_from([-1, 1, 2, 50, 2**31 - 1]),
        "top_p": _wild_floats if wild else _tame_unit,
        "min_p": _wild_floats if wild else st.sampled_from([0.0, 1.0]) | _tame_unit,
        "seed": _extreme_ints(*INT64),
        "ignore_eos": st.booleans(),
        "logprobs": st.booleans(),
        "top_logprobs": _extreme_ints(*INT32, small=(0, 21)) if wild else st.integers(0, 20),
    }
    for name, values in optional.items():
        if draw(st.booleans()):
            setattr(r, name, draw(values))
    if not r.HasField("max_tokens"):
        r.max_tokens = 4  # short generations, so a run makes many calls
    if wild:
        r.stop.extend(draw(st.lists(_text, max_size=3) | st.builds(lambda n: ["s"] * n, st.sampled_from([17, 10_000]))))
        r.stop_token_ids.extend(draw(_wild_ids))
    else:
        r.stop.extend(draw(st.lists(_short_text, max_size=3)))
        r.stop_token_ids.extend(draw(st.lists(st.integers(0, 193), max_size=3)))
    return r


@st.composite
def pin_requests(draw: st.DrawFn) -> pb.PinPrefixRequest:
    wild = draw(st.booleans())
    r = pb.PinPrefixRequest()
    draw(_input(r, ("text", "token_ids", "messages"), wild))
    if draw(st.booleans()):
        r.ttl_seconds = draw(_wild_floats if wild else st.floats(0.01, 60.0))
    return r


@st.composite
def unpin_requests(draw: st.DrawFn) -> pb.UnpinPrefixRequest:
    r = pb.UnpinPrefixRequest()
    draw(_input(r, ("text", "token_ids", "messages"), draw(st.booleans())))
    return r


@st.composite
def tokenize_requests(draw: st.DrawFn) -> pb.TokenizeRequest:
    r = pb.TokenizeRequest()
    draw(_input(r, ("text", "messages"), draw(st.booleans())))
    return r


_REQUESTS = {
    "Generate": generate_requests(),
    "PinPrefix": pin_requests(),
    "UnpinPrefix": unpin_requests(),
    "Tokenize": tokenize_requests(),
}


@st.composite
def _corrupt(draw: st.DrawFn, payload: bytes) -> tuple[bytes, str]:
    """A valid payload made invalid: flipped bytes, a truncation, or a string field with bytes that are not UTF-8."""
    how = draw(st.sampled_from(["flip", "truncate", "bad-utf8", "random"]))
    if how == "flip" and payload:
        data = bytearray(payload)
        for _ in range(draw(st.integers(1, 4))):
            data[draw(st.integers(0, len(data) - 1))] = draw(st.integers(0, 255))
        return bytes(data), how
    if how == "truncate" and len(payload) > 1:
        return payload[: draw(st.integers(1, len(payload) - 1))], how
    if how == "bad-utf8":
        # Field 1 or 2 (a string in every request here) as length-delimited bytes: invalid UTF-8, a lone surrogate
        # (U+D800 as CESU bytes) or an overlong encoding.
        bad = draw(st.sampled_from([b"\xff\xfe", b"\xed\xa0\x80", b"\xc0\xaf", b"ok\xe2\x82", b"\x80"]))
        tag = draw(st.sampled_from([0x0A, 0x12]))
        return payload + bytes([tag, len(bad)]) + bad, how
    return draw(st.binary(max_size=64)), "random"


@st.composite
def fuzz_calls(draw: st.DrawFn) -> FuzzCall:
    """One call: a hypothesis-built request (serialized), or a corrupt version of one (about 1 in 4)."""
    method = draw(st.sampled_from(["Generate", "Generate", "Generate", "PinPrefix", "UnpinPrefix", "Tokenize"]))
    request = draw(_REQUESTS[method])
    payload = request.SerializeToString()
    if draw(st.integers(0, 3)) == 0:
        payload, how = draw(_corrupt(payload))
        return FuzzCall(method, payload, f"corrupt ({how}): {payload[:80]!r}")
    return FuzzCall(method, payload, f"{type(request).__name__}: {str(request)[:300]!r}")


# -- driver ----------------------------------------------------------------------------------------------------
def send(channel: grpc.Channel, call: FuzzCall, *, timeout: float, metadata: tuple = ()) -> tuple[str, str]:
    """Sends one call; returns (status name, details). Streams are read to the end."""
    path = SERVICE + call.method
    try:
        if call.streaming:
            for _ in channel.unary_stream(path)(call.payload, timeout=timeout, metadata=metadata):
                pass
        else:
            channel.unary_unary(path)(call.payload, timeout=timeout, metadata=metadata)
    except grpc.RpcError as e:
        return e.code().name, e.details() or ""
    return "OK", ""


def run_wire_fuzz(
    target: str,
    *,
    count: int,
    seconds: float,
    seed: int = 0,
    timeout: float = 10.0,
    metadata: tuple = (),
) -> FuzzReport:
    """Sends up to `count` fuzzed calls to the worker at `target` (stopping after `seconds`), one at a time.

    Deterministic for a given seed. Returns the statuses seen and every call whose status is not in EXPECTED.
    """
    report = FuzzReport()
    deadline = time.monotonic() + seconds
    expected = {code.name for code in EXPECTED}
    with grpc.insecure_channel(target, options=[("grpc.max_send_message_length", 64 << 20)]) as channel:

        @hypothesis_seed(seed)
        @settings(
            max_examples=count,
            database=None,
            deadline=None,
            phases=[Phase.generate],  # collect, never shrink: a run reports, the caller asserts
            suppress_health_check=list(HealthCheck),
        )
        @given(call=fuzz_calls())
        def one(call: FuzzCall) -> None:
            if time.monotonic() > deadline:
                return
            status, details = send(channel, call, timeout=timeout, metadata=metadata)
            report.calls += 1
            report.statuses[status] += 1
            if status not in expected:
                report.unexpected.append((call.method, status, details[:300], call.note))

        one()
    return report
