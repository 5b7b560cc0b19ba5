"""Small pieces of the worker: token files, the authenticator, size parsing, the random model's tokenizer."""

from __future__ import annotations

import argparse
import random

import pytest

from radixcache.memory import parse_size
from radixcache.worker.cli import char_tokenizer
from radixcache.worker.front.auth import Authenticator, load_token_file, load_tokens


def test_load_tokens_json_and_lines(tmp_path):
    j = tmp_path / "t.json"
    j.write_text('{"s3cret": "alice", "other": "bob"}')
    assert load_tokens(j) == {"s3cret": "alice", "other": "bob"}
    t = tmp_path / "t.txt"
    t.write_text("# comment\n\ns3cret alice\nother  bob\n")
    assert load_tokens(t) == {"s3cret": "alice", "other": "bob"}
    t.write_text("s3cret alice extra\n")
    with pytest.raises(ValueError, match="t.txt:1: expected '<token> <tenant>'"):
        load_tokens(t)
    t.write_text("s3cret ali/ce\n")
    with pytest.raises(ValueError, match="tenant 'ali/ce' must be"):
        load_tokens(t)
    t.write_text("# nothing\n")
    with pytest.raises(ValueError, match="no tokens"):
        load_tokens(t)


def test_tokens_file_lines_with_trailing_blanks_load_as_the_bare_tenant(tmp_path):
    # Files written by hand or on Windows end lines with spaces, tabs or "\r": the tenant is still the bare name,
    # and the token still authenticates (as that tenant, in that tenant's namespace).
    t = tmp_path / "t.txt"
    t.write_bytes(b"s3cret alice   \nother\tbob\t\r\nroot ops admin  \r\n")
    tokens, admins = load_token_file(t)
    assert tokens == {"s3cret": "alice", "other": "bob", "root": "ops"} and admins == {"root"}
    auth = Authenticator(tokens, admins)
    assert auth.tenant([("authorization", "Bearer s3cret")]) == "alice"
    assert auth.is_admin([("authorization", "Bearer root")]) and not auth.is_admin([("authorization", "Bearer other")])


def test_authenticator():
    off = Authenticator(None)
    assert not off.enabled and off.tenant([]) == ""
    auth = Authenticator({"s3cret": "alice"})
    assert auth.tenant([("authorization", "Bearer s3cret")]) == "alice"
    assert auth.tenant([("Authorization", b"bearer s3cret")]) == "alice"
    assert auth.tenant([("authorization", "Bearer wrong")]) is None
    assert auth.tenant([("authorization", "Basic s3cret")]) is None
    assert auth.tenant([("x-other", "s3cret")]) is None
    assert auth.tenant(None) is None


def test_kv_memory_sizes_parse_like_the_memory_calculator():
    assert parse_size("512MiB") == 512 * 2**20
    assert parse_size("2GB") == 2 * 10**9
    assert parse_size("1.5GiB") == int(1.5 * 2**30)
    assert parse_size("4096") == 4096
    for bad in ("lots", "0"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_size(bad)


def test_char_tokenizer_round_trips_any_ids():
    tok = char_tokenizer()
    assert tok.encode("hi") == [0, tok.encode("h", add_special_tokens=False)[0], tok.encode("i", False)[0]]
    ids = [random.Random(0).randrange(3, tok.vocab_size) for _ in range(500)]
    assert tok.encode(tok.decode(ids), add_special_tokens=False) == ids
    one = tok.apply_chat_template([{"role": "user", "content": "a"}])
    two = tok.apply_chat_template(
        [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}]
    )
    assert two.startswith(one + "b")  # turn N+1's prompt extends turn N's prompt + reply


def test_rate_limited_warning_says_how_many_it_held_back(caplog):
    import logging

    from radixcache.worker.front.refusal_log import RateLimitedWarning

    now = [100.0]
    warning = RateLimitedWarning(logging.getLogger("test.rate"), interval=10.0, clock=lambda: now[0])
    assert [warning.warn(f"bad {i}") for i in range(5)] == [True, False, False, False, False]
    now[0] += 10.0
    assert warning.warn("bad again")
    assert [r.getMessage() for r in caplog.records] == ["bad 0", "bad again (and 4 more in the last 10 s)"]


@pytest.mark.parametrize(
    ("config", "kinds", "window"), [({}, ["global", "global"], 0), ("sliding", ["sliding", "global"], 8)]
)
def test_model_info_names_each_layers_attention_and_the_window(config, kinds, window):
    from engine_fixtures import SLIDING, tiny_model

    from radixcache.worker.engine.api import ModelFacts
    from radixcache.worker.engine.engine import Engine, EngineConfig
    from radixcache.worker.server import describe

    engine = Engine(tiny_model(**(SLIDING if config == "sliding" else {})), EngineConfig(page_size=4, kv_pages=16))
    info = describe(engine, model_name="tiny")
    assert (list(info.layer_kinds), info.sliding_window) == (kinds, window)
    facts = ModelFacts.from_message(info)  # the front-side mirror keeps them, as plain values
    assert (facts.layer_kinds, facts.sliding_window) == (tuple(kinds), window)
