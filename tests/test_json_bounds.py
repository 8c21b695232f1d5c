"""A client's JSON is parsed with bounded cost (realtime/ws/protocol.py `load_json`): the checks that walk a parsed
value in Python run only where the text shows they can find something. Against a reference that always walks, on
generated messages: the same values accepted, the same refused, for the same reasons."""
from __future__ import annotations

import json
import re
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from realtime.ws.protocol import (MAX_INTEGER_DIGITS, MAX_JSON_CONTAINERS, MAX_JSON_DEPTH, ProtocolError,
                                 SessionConfig, configure, load_json, parse_message)

PIECES = ["a", "é", "\ud800", "\udbff", "\udc00", "\\", "\\u", "ud800", "1" * 25, " ", "\"", "\u2028", "[" * 40,
          "\ud83d\ude00"]


def reference(text: str) -> set[str]:
    """Why the reference refuses the text (short reasons; none: accepted): every string walked, every integer and
    the nesting measured on the parsed value."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return {"invalid_json"}
    reasons: set[str] = set()
    containers = 0

    def walk(item, depth: int) -> None:
        if isinstance(item, bool) or item is None or isinstance(item, float):
            return
        if isinstance(item, int):
            if len(str(abs(item))) > MAX_INTEGER_DIGITS:
                reasons.add("digits")
        elif isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                reasons.add("surrogate")
        else:
            nonlocal containers
            containers += 1
            if containers > MAX_JSON_CONTAINERS:
                reasons.add("containers")
            if depth + 1 > MAX_JSON_DEPTH:
                reasons.add("depth")
            for key, child in (item.items() if isinstance(item, dict) else ((None, child) for child in item)):
                if key is not None:
                    walk(key, depth + 1)
                walk(child, depth + 1)

    walk(json.loads(text), 0)
    return reasons


def reason_of(failure: ProtocolError) -> str:
    for words, reason in (("nested", "depth"), ("digits", "digits"), ("surrogate", "surrogate"),
                          ("arrays and objects", "containers")):
        if words in failure.message:
            return reason
    return failure.code


strings = st.lists(st.sampled_from(PIECES), max_size=4).map("".join)
scalars = st.one_of(st.none(), st.booleans(), st.integers(-10 ** 30, 10 ** 30), st.floats(allow_nan=False,
                    allow_infinity=False), strings)
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(strings, inner, max_size=3),
                      max_leaves=20)


@settings(max_examples=400, deadline=None)
@given(value=values, wrap=st.integers(0, MAX_JSON_DEPTH + 4), ascii_only=st.booleans())
def test_the_fast_checks_accept_and_refuse_what_the_full_walk_does(value, wrap, ascii_only):
    for _ in range(wrap):
        value = [value]
    text = json.dumps(value, ensure_ascii=ascii_only)
    expected = reference(text)
    try:
        parsed = load_json(text)
    except ProtocolError as failure:  # a text with more than one fault is refused for one of them
        assert reason_of(failure) in expected, (expected, failure.message)
        return
    assert not expected and parsed == json.loads(text)


def test_many_small_values_cost_little_and_many_containers_are_refused():
    """A hostile try: 256 KB of small values cost 0.2-0.4 s of the event loop each (the checks walked every one)."""
    flat = json.dumps({"type": "keepalive", "x": [0] * 60000})
    started = time.thread_time()
    load_json(flat)
    assert time.thread_time() - started < 0.1  # ~12 ms on the development machine; 0.2 s before
    nested = json.dumps({"type": "keepalive", "x": [[[0]]] * (MAX_JSON_CONTAINERS // 2 + 1)})  # "[[0]]" each
    with pytest.raises(ProtocolError, match="arrays and objects"):
        load_json(nested)
    brackets = {"type": "text.append", "context_id": "c", "text": "[" * (MAX_JSON_CONTAINERS + 1)}
    assert load_json(json.dumps(brackets)) == brackets  # brackets in a string are text, however many


@pytest.mark.parametrize("text, field", [
    ('{"type": "ping", "id": 1e309}', "id"),
    ('{"type": "context.cancel", "context_id": "a", "played_ms": -1e400}', "played_ms"),
    ('{"type": "text.append", "context_id": "a", "text": "hi", "flush": 1e999}', "flush")])
def test_a_number_too_large_for_a_double_is_named_out_of_range(text, field):
    """JSON's 1e309 is a number Python reads as infinity: refused as out of range, naming the field, not as a value
    of the wrong kind (a hostile try's finding: "must be a string or a number" for a number)."""
    with pytest.raises(ProtocolError, match=f"field '{field}' is a number out of range") as refused:
        parse_message(text)
    assert refused.value.code == "invalid_message"


@settings(max_examples=200, deadline=None)
@given(event_id=st.integers(-2**70, 2**70) | st.floats(allow_nan=False, allow_infinity=False))
def test_an_event_id_is_echoed_only_under_2_63_whether_integer_or_float(event_id):
    """The bound its error states holds for both kinds of number (a hostile try: 1e308 was echoed)."""
    text = json.dumps({"type": "ping", "event_id": event_id})
    if abs(event_id) < 2**63:
        assert parse_message(text)["event_id"] == event_id
    else:
        with pytest.raises(ProtocolError, match="under 2\\*\\*63|digits is out of range") as refused:
            parse_message(text)
        assert refused.value.code == "invalid_message"


@pytest.mark.parametrize("text, field", [
    ('{"speed": 1111111111111111111111.5, "seed": [22222222222222222222222]}', None),  # a float's digits; an item
    ('{"seed": 22222222222222222222222, "speed": 1111111111111111111111.5}', "seed"),
    ('{"a": [22222222222222222222222], "b": 222222222222222222222222}', None),  # not a longer one's key
])
def test_an_integer_too_long_is_attributed_to_its_own_key_only(text, field):
    with pytest.raises(ProtocolError, match="digits is out of range") as refused:
        load_json(text)
    assert refused.value.field == field


@pytest.mark.parametrize("text", ['{"x": {"seed": 2222222222222222222222}}', '[{"seed": 2222222222222222222222}]',
                                  '{"x": {"seed": 2222222222222222222222}, "seed": 1}'])
def test_an_integer_too_long_in_a_nested_object_names_no_field(text):
    """`param` names a field of the message (a hostile try: a nested key of the same name was named)."""
    with pytest.raises(ProtocolError, match="22 digits") as refused:
        load_json(text)
    assert refused.value.field is None


keys = st.text(st.characters(exclude_categories=["Cs"]), max_size=8)
short_scalars = st.one_of(st.none(), st.booleans(), st.integers(-10 ** 6, 10 ** 6), keys)


@settings(max_examples=200, deadline=None)
@given(fields=st.dictionaries(keys, short_scalars, max_size=4), key=keys, first=short_scalars, second=short_scalars,
       depth=st.integers(0, 3), position=st.integers(0, 4))
def test_a_key_given_twice_in_any_object_is_refused_naming_it(fields, key, first, second, depth, position):
    """JSON leaves the meaning of an object with a repeated key to its reader (Python keeps the last value, others the
    first): such a message is refused, naming the key, and as the field at fault (`param`) only at the top level."""
    pairs = [json.dumps(name) + ": " + json.dumps(value) for name, value in fields.items() if name != key]
    pairs.insert(min(position, len(pairs)), json.dumps(key) + ": " + json.dumps(first))
    pairs.append(json.dumps(key) + ": " + json.dumps(second))
    text = "{" + ", ".join(pairs) + "}"
    for _ in range(depth):
        text = '{"outer": [' + text + "]}"
    with pytest.raises(ProtocolError, match="given twice in one object") as refused:
        load_json(text)
    assert refused.value.code == "invalid_message" and repr(key[:128]) in refused.value.message
    assert refused.value.field == (key if depth == 0 else None)


def test_a_message_with_a_repeated_id_echoes_no_id_it_repeats():
    """An error echoes the message's event_id and context_id; one given twice names neither value."""
    with pytest.raises(ProtocolError, match="'text' is given twice") as refused:
        parse_message('{"type": "text.append", "event_id": "e", "context_id": "c", "text": "a", "text": "b"}')
    assert (refused.value.event_id, refused.value.context_id, refused.value.field) == ("e", "c", "text")
    with pytest.raises(ProtocolError, match="'event_id' is given twice") as refused:
        parse_message('{"type": "ping", "event_id": "e", "event_id": "f"}')
    assert refused.value.event_id is None


@pytest.mark.parametrize("text, words", [
    ('{"type": "text.append", "context_id": "c", "text": null}', "field 'text' is null; it must be a string"),
    ('{"type": "text.append", "context_id": "c"}', "field 'text' is missing; it must be a string"),
    ('{"type": "context.end", "context_id": null}', "field 'context_id' is null"),
])
def test_a_required_field_that_is_null_is_not_called_missing(text, words):
    """A hostile try: `"text": null` was answered "missing field 'text'", though the field was there."""
    with pytest.raises(ProtocolError, match=re.escape(words)) as refused:
        parse_message(text)
    assert refused.value.code == "invalid_message"


@pytest.mark.parametrize("encoding, code, words", [
    ("x" * 200, "unsupported_format", "audio.encoding takes at most 128 characters"),
    (7, "invalid_config", "audio.encoding must be a string"),
    ("aac", "unsupported_format", "aac"),
])
def test_a_bad_encoding_is_named_for_what_is_wrong_with_it(encoding, code, words):
    """A hostile try: a 200-character encoding was told it "must be a string", which it was."""
    _, errors = configure(SessionConfig(), {"audio": {"encoding": encoding}})
    assert [error.code for error in errors] == [code] and words in errors[0].message, errors[0].message


@pytest.mark.parametrize("depth", [10, 900])
def test_a_repeated_key_deep_down_is_refused_without_walking_the_value(depth):
    """A review's finding: with a lone surrogate escape in the text the whole value was walked before its depth was
    bounded (the error named a path of 900 levels, 2,047 characters; deeper, RecursionError could escape)."""
    text = "[" * depth + '{"\\ud800": 1, "\\ud800": 2}' + "]" * depth
    with pytest.raises(ProtocolError) as refused:
        parse_message(text)
    assert refused.value.code == "invalid_message" and len(refused.value.message) < 200, refused.value.message
