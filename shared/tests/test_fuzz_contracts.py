"""Fuzzing the bus contract decoders: random bytes and mutated valid messages raise only ContractError.

Every bus message type in `harnessrl.shared.contracts` (each `Message` subclass, and the episode
event union through `decode_event`) is fed 1,500 random byte strings and 2,500 mutations of a
valid encoded message (a field replaced, dropped or added, the schema changed, bytes flipped, cut
or inserted, nesting far deeper than any message has). A decoder may return a message of its type
or raise `ContractError`, the documented decode error; any other exception is a crash.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

import msgspec
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from harnessrl.shared import contracts as c

RANDOM_BYTES_CASES = 1500
MUTATION_CASES = 2500
FUZZ = settings(deadline=None, database=None, derandomize=True, suppress_health_check=list(HealthCheck))

MESSAGE_TYPES: list[type[msgspec.Struct]] = sorted(
    (
        kind
        for kind in vars(c).values()
        if isinstance(kind, type)
        and issubclass(kind, c.Message)
        and kind not in (c.Message, c.EpisodeEventBase)
    ),
    key=lambda kind: kind.__name__,
)
EVENT_TYPES = [kind for kind in MESSAGE_TYPES if issubclass(kind, c.EpisodeEventBase)]
Decoder = Callable[[bytes], object]
DECODERS: dict[str, tuple[Decoder, tuple[type, ...]]] = {
    **{kind.__name__: (lambda data, kind=kind: c.decode(data, kind), (kind,)) for kind in MESSAGE_TYPES},
    "decode_event": (c.decode_event, tuple(EVENT_TYPES)),
}


def sample(info: msgspec.inspect.Type) -> Any:
    """A smallest valid value of a type (required fields only)."""
    simple = {
        msgspec.inspect.StrType: "x",
        msgspec.inspect.IntType: 1,
        msgspec.inspect.FloatType: 0.5,
        msgspec.inspect.BoolType: True,
        msgspec.inspect.BytesType: b"x",
    }
    for kind, value in simple.items():
        if isinstance(info, kind):
            return value
    if isinstance(info, msgspec.inspect.LiteralType):
        return info.values[0]
    if isinstance(info, msgspec.inspect.ListType):
        return []
    if isinstance(info, msgspec.inspect.DictType):
        return {}
    if isinstance(info, msgspec.inspect.UnionType):
        return sample(info.types[0])
    if isinstance(info, msgspec.inspect.StructType):
        fields = {f.encode_name: sample(f.type) for f in info.fields if f.required}
        return {info.tag_field: info.tag, **fields} if info.tag_field else fields
    return None


VALID: dict[str, dict[str, Any]] = {
    kind.__name__: sample(msgspec.inspect.type_info(kind)) for kind in MESSAGE_TYPES
}
msgpack_value = st.recursive(
    st.one_of(
        st.none(),
        st.booleans(),
        st.integers(-(2**63), 2**64 - 1),
        st.floats(),
        st.text(max_size=16),
        st.binary(max_size=16),
    ),
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=10,
)


_DEEP = "<deep>"


def nested(depth: int) -> bytes:
    """msgpack of an array `depth` arrays deep (the encoder itself would refuse to build it)."""
    return b"\x91" * depth + b"\x90"


@st.composite
def mutated(draw: st.DrawFn) -> tuple[str, bytes]:
    """A decoder's name and a mutation of a valid message of its type."""
    name = draw(st.sampled_from([*VALID, "decode_event"]))
    kind_name = draw(st.sampled_from([k.__name__ for k in EVENT_TYPES])) if name == "decode_event" else name
    fields = dict(VALID[kind_name])
    known = [f.encode_name for f in msgspec.structs.fields(getattr(c, kind_name))]
    for _ in range(draw(st.integers(1, 3))):
        operation = draw(st.sampled_from(["replace", "replace", "drop", "add", "schema", "deep"]))
        field = draw(st.sampled_from(known))
        if operation == "replace":
            fields[field] = draw(msgpack_value)
        elif operation == "drop":
            fields.pop(field, None)
        elif operation == "add":
            fields[draw(st.text(max_size=8))] = draw(msgpack_value)
        elif operation == "schema":
            fields["schema"] = draw(st.one_of(st.integers(-(2**63), 2**63 - 1), msgpack_value))
        else:
            fields[field] = _DEEP
    data = msgspec.msgpack.encode(fields)
    data = data.replace(msgspec.msgpack.encode(_DEEP), nested(draw(st.integers(100, 20_000))))
    for _ in range(draw(st.integers(0, 3))):
        if not data:
            break
        position = draw(st.integers(0, len(data) - 1))
        edit = draw(st.sampled_from(["flip", "cut", "insert"]))
        if edit == "flip":
            data = (
                data[:position] + bytes([data[position] ^ draw(st.integers(1, 255))]) + data[position + 1 :]
            )
        elif edit == "cut":
            data = data[:position]
        else:
            data = data[:position] + draw(st.binary(min_size=1, max_size=8)) + data[position:]
    return name, data


def decode_or_refuse(name: str, data: bytes, outcomes: Counter[str]) -> None:
    """The decoder returns a message of its type or raises ContractError, nothing else."""
    decoder, types = DECODERS[name]
    try:
        message = decoder(data)
    except c.ContractError:
        outcomes["refused"] += 1
        return
    assert isinstance(message, types), (name, message)
    outcomes["decoded"] += 1


def test_every_message_type_is_covered_and_its_sample_is_valid() -> None:
    assert len(MESSAGE_TYPES) >= 15
    for kind in MESSAGE_TYPES:
        assert isinstance(c.decode(msgspec.msgpack.encode(VALID[kind.__name__]), kind), kind)


def test_random_bytes_raise_only_contract_error(say: Callable[[str], None]) -> None:
    outcomes: Counter[str] = Counter()

    @settings(FUZZ, max_examples=RANDOM_BYTES_CASES)
    @given(
        data=st.one_of(st.binary(max_size=512), st.binary(max_size=8).map(lambda b: b"\x81\xa6schema" + b))
    )
    def one_case(data: bytes) -> None:
        for name in DECODERS:
            decode_or_refuse(name, data, outcomes)

    one_case()
    inputs = f"{RANDOM_BYTES_CASES} inputs x {len(DECODERS)} decoders"
    say(f"fuzz contracts random bytes: {inputs}, {dict(outcomes)}")
    assert sum(outcomes.values()) >= RANDOM_BYTES_CASES * len(DECODERS)


def test_mutated_valid_messages_raise_only_contract_error(say: Callable[[str], None]) -> None:
    outcomes: Counter[str] = Counter()

    @settings(FUZZ, max_examples=MUTATION_CASES)
    @given(case=mutated())
    def one_case(case: tuple[str, bytes]) -> None:
        decode_or_refuse(*case, outcomes)

    one_case()
    say(f"fuzz contracts mutations: {dict(outcomes)}")
    assert sum(outcomes.values()) >= MUTATION_CASES
    assert outcomes["decoded"] > 0 and outcomes["refused"] > 0
