"""The tag convention of environments.md 1.2 on ``repertory.envs.parsing``.

Rules, in order: (1) thinking is deleted, an unclosed <think> deletes the rest; (2) truncation;
(3) four empty-tag forms; (4) content tags, an unclosed one is malformed; (5) case-insensitive
names, other phases' tags are plain text; (6) the last action tag counts; (7) strict JSON
payloads with key normalisation and integer fields.
"""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from repertory.envs.parsing import (
    DEFAULT_MAX_CHARS,
    PayloadError,
    as_integer,
    clean,
    closest_choice,
    find_tags,
    last_tag,
    normalize_key,
    parse_fields,
    parse_json_object,
)

PROPOSE = frozenset({"propose"})
CHOOSE = frozenset({"choose"})
NEGOTIATION_EMPTY = frozenset({"accept", "reject", "walkaway"})
ITEMS = ("hats", "books", "balls")


# --------------------------------------------------------------------------------------------
# Rule 1: thinking
# --------------------------------------------------------------------------------------------


def test_think_block_is_deleted():
    assert clean("Hello <think>secret plan</think>world") == "Hello world"


def test_several_think_blocks_are_deleted():
    assert clean("a<think>x</think>b<think>y\nz</think>c") == "abc"


def test_think_block_spanning_lines_is_deleted():
    assert clean("start<think>line one\nline two\n</think>end") == "startend"


def test_unclosed_think_deletes_everything_after_it():
    assert clean("keep this <think> secret <choose>A</choose>") == "keep this "


def test_closed_then_unclosed_think():
    assert clean("a<think>x</think>b<think>c <choose>A</choose>") == "ab"


def test_think_is_case_insensitive():
    assert clean("a<THINK>x</Think>b") == "ab"
    assert clean("a<Think>rest") == "a"


def test_tags_inside_thinking_do_not_count():
    text = clean("<think>maybe <choose>B</choose></think> I pick <choose>A</choose>")
    tag = last_tag(text, content_tags=CHOOSE)
    assert tag is not None and tag.payload == "A"
    assert [t.payload for t in find_tags(text, content_tags=CHOOSE)] == ["A"]


def test_tag_only_inside_unclosed_think_is_gone():
    assert last_tag(clean("I pick <think><choose>A</choose>"), content_tags=CHOOSE) is None


# --------------------------------------------------------------------------------------------
# Rule 2: truncation (after thinking is removed)
# --------------------------------------------------------------------------------------------


def test_default_truncation_is_2000_chars():
    assert DEFAULT_MAX_CHARS == 2000
    assert clean("x" * 5000) == "x" * 2000
    assert clean("x" * 2000) == "x" * 2000
    assert clean("short") == "short"


def test_truncation_to_custom_limit():
    assert clean("y" * 800, 500) == "y" * 500


def test_thinking_is_removed_before_truncation():
    long_thought = "<think>" + "z" * 5000 + "</think>"
    assert clean(long_thought + "answer") == "answer"


def test_tag_cut_by_truncation_is_malformed_or_gone():
    tag_text = "<choose>A</choose>"
    text = clean("x" * (2000 - len(tag_text)) + tag_text)
    tag = last_tag(text, content_tags=CHOOSE)
    assert tag is not None and not tag.malformed and tag.payload == "A"
    text = clean("x" * (2000 - len(tag_text) + 3) + tag_text)
    tag = last_tag(text, content_tags=CHOOSE)
    assert tag is not None and tag.malformed


# --------------------------------------------------------------------------------------------
# Rule 3: empty tags
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("form", ["<accept/>", "<accept />", "<accept></accept>", "<accept>"])
def test_four_empty_tag_forms(form):
    tags = find_tags(f"Fine by me. {form} Thanks.", empty_tags=NEGOTIATION_EMPTY)
    assert len(tags) == 1
    assert tags[0].name == "accept"
    assert tags[0].payload is None
    assert not tags[0].malformed


def test_empty_tag_open_close_pair_counts_once():
    tags = find_tags("<accept></accept><reject/>", empty_tags=NEGOTIATION_EMPTY)
    assert [t.name for t in tags] == ["accept", "reject"]


def test_stray_closing_tag_is_plain_text():
    assert find_tags("nothing here </accept> </propose>", PROPOSE, NEGOTIATION_EMPTY) == []


# --------------------------------------------------------------------------------------------
# Rule 4: content tags
# --------------------------------------------------------------------------------------------


def test_content_tag_payload():
    tags = find_tags('Here: <propose>{"hats": 3}</propose> ok', content_tags=PROPOSE)
    assert len(tags) == 1
    assert tags[0].name == "propose" and tags[0].payload == '{"hats": 3}' and not tags[0].malformed


def test_content_tag_span():
    text = 'ab <propose>{"hats": 3}</propose> cd'
    (tag,) = find_tags(text, content_tags=PROPOSE)
    assert text[tag.start : tag.end] == '<propose>{"hats": 3}</propose>'


@pytest.mark.parametrize(
    "text",
    [
        '<propose>{"hats": 3}',
        '<propose>{"hats": 3}</propose',
        '<propose>{"hats": 3}</propos>',
        "I choose <propose>",
    ],
)
def test_unclosed_content_tag_is_malformed(text):
    tag = last_tag(text, content_tags=PROPOSE)
    assert tag is not None
    assert tag.malformed
    assert tag.payload is None


def test_content_tag_reopened_before_closing():
    tags = find_tags("<choose>A <choose>B</choose>", content_tags=CHOOSE)
    assert [(t.malformed, t.payload) for t in tags] == [(True, None), (False, "B")]
    tag = last_tag("<choose>A <choose>B</choose>", content_tags=CHOOSE)
    assert tag is not None and tag.payload == "B"


def test_empty_content_payload():
    (tag,) = find_tags("<choose></choose>", content_tags=CHOOSE)
    assert tag.payload == "" and not tag.malformed


# --------------------------------------------------------------------------------------------
# Rule 5: names are case-insensitive; other phases' tags are plain text
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("text", ["<CHOOSE>A</CHOOSE>", "<Choose>A</choose>", "<choose>A</ChOoSe>"])
def test_tag_names_case_insensitive(text):
    tag = last_tag(text, content_tags=CHOOSE)
    assert tag is not None and tag.name == "choose" and tag.payload == "A" and not tag.malformed


def test_empty_tag_case_insensitive():
    tag = last_tag("<ACCEPT/>", empty_tags=NEGOTIATION_EMPTY)
    assert tag is not None and tag.name == "accept"


def test_tags_of_other_phases_are_plain_text():
    text = 'I <accept/> and <propose>{"hats": 1}</propose> and <vote>Bob</vote>'
    assert find_tags(text, content_tags=CHOOSE) == []
    assert last_tag(text, content_tags=CHOOSE) is None


def test_other_phase_tag_after_action_does_not_replace_it():
    text = "<choose>A</choose> <propose>{}</propose> <accept/>"
    tag = last_tag(text, content_tags=CHOOSE)
    assert tag is not None and tag.payload == "A"


def test_unclosed_tag_of_other_phase_is_plain_text():
    tag = last_tag("<propose>{ <choose>B</choose>", content_tags=CHOOSE)
    assert tag is not None and tag.payload == "B" and not tag.malformed


# --------------------------------------------------------------------------------------------
# Rule 6: the last action tag counts, valid or not
# --------------------------------------------------------------------------------------------


def test_last_of_several_tags_counts():
    tag = last_tag("<choose>A</choose> no wait <choose>B</choose>", content_tags=CHOOSE)
    assert tag is not None and tag.payload == "B"


def test_last_tag_counts_even_if_malformed():
    tag = last_tag("<choose>A</choose> and then <choose>B", content_tags=CHOOSE)
    assert tag is not None and tag.malformed


def test_last_tag_counts_across_kinds():
    text = '<propose>{"hats": 1}</propose> actually <accept/>'
    tag = last_tag(text, content_tags=PROPOSE, empty_tags=NEGOTIATION_EMPTY)
    assert tag is not None and tag.name == "accept"
    text = '<accept/> actually <propose>{"hats": 1}</propose>'
    tag = last_tag(text, content_tags=PROPOSE, empty_tags=NEGOTIATION_EMPTY)
    assert tag is not None and tag.name == "propose" and tag.payload == '{"hats": 1}'


def test_last_tag_none_without_tags():
    assert last_tag("I choose A", content_tags=CHOOSE) is None
    assert last_tag("", content_tags=CHOOSE, empty_tags=NEGOTIATION_EMPTY) is None


# --------------------------------------------------------------------------------------------
# Rule 7: JSON payloads
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("key", ["Books", "book", "books", " BOOKS ", "Book"])
def test_key_normalisation(key):
    assert normalize_key(key) == normalize_key("books") == "book"
    assert parse_fields(json.dumps({key: 4}), ITEMS, required=False) == {"books": 4}


def test_key_normalisation_drops_only_one_s():
    assert normalize_key("hatss") == "hats"
    with pytest.raises(PayloadError):
        parse_fields('{"hatss": 1}', ITEMS, required=False)


def test_parse_fields_all_keys():
    out = parse_fields('{"Hats": 1, "book": 2, "BALLS": 3}', ITEMS, required=False)
    assert out == {"hats": 1, "books": 2, "balls": 3}


def test_unknown_key_is_invalid():
    with pytest.raises(PayloadError):
        parse_fields('{"hats": 1, "shoes": 2}', ITEMS, required=False)
    with pytest.raises(PayloadError):
        parse_fields('{"keep": 5, "give": 5}', ("keep",), required=True)


def test_missing_key_optional_vs_required():
    assert parse_fields('{"hats": 2}', ITEMS, required=False) == {"hats": 2}
    assert parse_fields("{}", ITEMS, required=False) == {}
    with pytest.raises(PayloadError):
        parse_fields("{}", ("keep",), required=True)
    assert parse_fields('{"Keep": 5}', ("keep",), required=True) == {"keep": 5}
    assert parse_fields('{"keeps": 5}', ("keep",), required=True) == {"keep": 5}


@pytest.mark.parametrize(
    "payload",
    [
        "",
        "not json",
        "[1, 2]",
        "3",
        '"hats"',
        "null",
        "{'hats': 1}",
        '{"hats": 1,}',
        '{"hats": NaN}',
        '{"hats": Infinity}',
        '{"hats": -Infinity}',
        "[" * 100_000,
        '{"hats": ' + "1" * 5000 + "}",
    ],
)
def test_non_object_or_non_strict_json_is_invalid(payload):
    with pytest.raises(PayloadError):
        parse_fields(payload, ITEMS, required=False)


def test_parse_json_object_strict():
    assert parse_json_object('{"a": 1}') == {"a": 1}
    with pytest.raises(PayloadError):
        parse_json_object('{"a": NaN}')
    with pytest.raises(PayloadError):
        parse_json_object("[]")


@pytest.mark.parametrize("value,expected", [(3, 3), (3.0, 3), (0, 0), (0.0, 0), (-0.0, 0), (10, 10), (1e1, 10)])
def test_integer_fields_accept_integers_and_integral_floats(value, expected):
    got = as_integer(value, "hats")
    assert got == expected and type(got) is int


@pytest.mark.parametrize("value", [3.5, 0.1, True, False, "3", None, [3], {"x": 3}, math.nan, math.inf, -math.inf])
def test_integer_fields_reject_non_integers(value):
    with pytest.raises(PayloadError):
        as_integer(value, "hats")


@pytest.mark.parametrize(
    "payload,ok",
    [
        ('{"keep": 3.0}', True),
        ('{"keep": 3.5}', False),
        ('{"keep": true}', False),
        ('{"keep": "3"}', False),
        ('{"keep": NaN}', False),
    ],
)
def test_integer_field_via_json(payload, ok):
    def read() -> int:
        return as_integer(parse_fields(payload, ("keep",), required=True)["keep"], "keep")

    if ok:
        assert read() == 3
    else:
        with pytest.raises(PayloadError):
            read()


# --------------------------------------------------------------------------------------------
# Property tests: never raise
# --------------------------------------------------------------------------------------------

FRAGMENTS = [
    "<propose>",
    "</propose>",
    "<PROPOSE>",
    "</Propose",
    "<propose/>",
    "<accept/>",
    "<accept />",
    "<accept>",
    "</accept>",
    "<choose>",
    "</choose>",
    "<think>",
    "</think>",
    "<",
    ">",
    "/",
    "{",
    "}",
    "[",
    "]",
    '"hats":',
    '"Books":',
    '"keep":',
    '"ball"',
    ":",
    ",",
    " ",
    "\n",
    "1",
    "10",
    "3.0",
    "3.5",
    "-1",
    "1e400",
    "NaN",
    "true",
    '"3"',
    "null",
    "A",
    "b",
]

tag_text = st.lists(st.one_of(st.sampled_from(FRAGMENTS), st.text(max_size=5)), max_size=40).map("".join)
any_text = st.one_of(st.text(), tag_text)
tag_sets = st.sampled_from([frozenset(), PROPOSE, CHOOSE, PROPOSE | CHOOSE])
empty_sets = st.sampled_from([frozenset(), NEGOTIATION_EMPTY, frozenset({"pass"})])


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(text=any_text, content=tag_sets, empty=empty_sets)
def test_find_tags_never_raises_and_is_consistent(text, content, empty):
    tags = find_tags(text, content, empty)
    last = last_tag(text, content, empty)
    assert last == (tags[-1] if tags else None)
    previous_end = 0
    for tag in tags:
        assert tag.name in content | empty
        assert previous_end <= tag.start < tag.end <= len(text)
        previous_end = tag.end
        assert text[tag.start] == "<" and text[tag.end - 1] == ">"
        if tag.name in empty and tag.name not in content:
            assert tag.payload is None and not tag.malformed
        if tag.malformed:
            assert tag.payload is None
        elif tag.name in content:
            assert tag.payload is not None and tag.payload in text[tag.start : tag.end]


@settings(max_examples=300, deadline=None)
@given(text=any_text, limit=st.integers(min_value=0, max_value=3000))
def test_clean_never_raises(text, limit):
    out = clean(text, limit)
    assert len(out) <= limit
    assert "<think>" not in out.lower()
    if "<think" not in text.lower():
        assert out == text[:limit]


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-20, 20) | st.floats(allow_nan=False) | st.text(max_size=5),
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=6), children, max_size=3),
    max_leaves=8,
)
json_objects = st.dictionaries(
    st.one_of(st.sampled_from(["hats", "Books", "ball", "keep", "KEEPS", " hat ", "shoes", ""]), st.text(max_size=6)),
    json_values,
    max_size=4,
).map(json.dumps)
payloads = st.one_of(st.text(), tag_text, json_objects)


@settings(max_examples=300, deadline=None)
@given(
    payload=payloads,
    fields=st.sampled_from([ITEMS, ("keep",), ("price",)]),
    required=st.booleans(),
)
def test_parse_fields_raises_only_payload_error(payload, fields, required):
    try:
        out = parse_fields(payload, fields, required)
    except PayloadError:
        return
    assert set(out) <= set(fields)
    if required:
        assert set(out) == set(fields)
    for value in out.values():
        try:
            as_integer(value, "x")
        except PayloadError:
            pass


GRID = ['<propose>{"price": 400}</propose>', '<propose>{"price": 450}</propose>', "<accept/>", "<reject/>"]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ('How about 437? <propose>{"price": 437}</propose>', GRID[1]),  # 13 from 450, 37 from 400
        ('<propose>{"price": 425}</propose>', GRID[0]),  # a tie goes to the first choice
        ('<propose>{"price": 9}</propose> then <accept />', GRID[2]),  # the last tag counts
        ("That works. <ACCEPT></accept>", GRID[2]),
        ("Deal?", None),  # no tag
        ("<propose>{price: 400}</propose>", None),  # a payload that is no JSON object matches nothing
        ('<propose>{"price": 400}', None),  # malformed
        ('<propose>{"price": "400"}</propose>', None),  # not a number
    ],
)
def test_closest_choice_projects_free_text_onto_the_constrained_answers(text, expected):
    assert closest_choice(text, GRID) == expected


def test_closest_choice_over_several_fields_and_plain_payloads():
    split = ['<propose>{"book": 1, "hat": 0}</propose>', '<propose>{"book": 2, "hat": 2}</propose>']
    assert closest_choice('<propose>{"book": 2, "hat": 1, "ball": 0}</propose>', split) == split[1]  # 1 vs 2
    assert closest_choice('<propose>{"book": 1}</propose>', split) == split[0]  # missing hat counts 0
    moves = ["<choose>A</choose>", "<choose>B</choose>"]
    assert closest_choice("I pick <choose> B </choose>", moves) == moves[1]
    assert closest_choice("<choose>C</choose>", moves) is None
