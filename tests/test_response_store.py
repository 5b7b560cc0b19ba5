"""The Responses API's store on its own: per tenant, bounded in count, bytes and time, oldest first."""

from __future__ import annotations

from array import array

from radixcache.worker.http.openai.response_store import ResponseStore, StoredResponse


def stored(response_id: str, tokens: int = 10) -> StoredResponse:
    return StoredResponse(
        id=response_id, body={"id": response_id}, token_ids=array("i", range(tokens)), text="x" * tokens,
        generated_text_without_last="x" * (tokens - 1), conversation=[], instructions=None,
    )  # fmt: skip


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_tenants_are_apart():
    store = ResponseStore()
    store.put("alice", stored("r1"))
    assert store.get("alice", "r1").id == "r1"
    assert store.get("bob", "r1") is None and not store.delete("bob", "r1")
    assert store.delete("alice", "r1") and store.get("alice", "r1") is None and len(store) == 0


def test_bounded_by_count_bytes_and_time():
    clock = Clock()
    store = ResponseStore(max_responses=3, max_bytes=stored("x", 1000).size * 2 + 10, ttl_s=60, clock=clock)
    for i in range(5):
        store.put("a", stored(f"r{i}"))
    assert [store.get("a", f"r{i}") is not None for i in range(5)] == [False, False, True, True, True]
    store.put("a", stored("big1", 1000))
    store.put("a", stored("big2", 1000))
    assert store.bytes("a") <= store.max_bytes and store.get("a", "big2") is not None
    assert store.get("a", "r4") is None  # the oldest went first
    assert not store.put("a", stored("huge", 10_000))  # larger than the whole budget: not kept
    store.put("b", stored("b1"))
    clock.now = 59.0
    assert store.get("b", "b1") is not None
    clock.now = 60.0
    assert store.get("b", "b1") is None and store.bytes("b") == 0  # expired
    off = ResponseStore(max_responses=0)
    assert not off.put("a", stored("r"))


def test_a_follow_up_may_continue_with_or_without_the_final_stop_token():
    r = stored("r", 4)
    assert r.prefixes() == [([0, 1, 2, 3], "xxxx"), ([0, 1, 2], "xxx")]
