"""The one member cache of many-file sets (read/member_cache.py): bounded, least recently used closed first, a
held member never closed, errors of opening reach the caller with nothing held. Checked against hand-worked
sequences of opens and closes."""

import threading

import numpy as np
import pytest

from pageset.read.member_cache import MemberCache, max_open_files


class Log:
    def __init__(self, fail=()):
        self.events, self.fail = [], set(fail)

    def open(self, k):
        if k in self.fail:
            raise FileNotFoundError(f"member {k}")
        self.events.append(("open", k))
        return f"item{k}"

    def close(self, k, item):
        assert item == f"item{k}"
        self.events.append(("close", k))


def test_least_recently_used_idle_member_is_closed_first():
    log = Log()
    c = MemberCache(5, log.open, log.close, 2)
    assert c.acquire([3, 1]) == ["item3", "item1"]  # opened in order of first appearance
    c.release([3, 1])
    assert c.open_members() == [1, 3]  # one tick per call: ties by the lower index
    c.get(4)  # 1 and 3 share the oldest tick: 1 goes first
    assert log.events == [("open", 3), ("open", 1), ("open", 4), ("close", 1)]
    assert c.open_members() == [3, 4]
    c.get(3)
    c.get(0)  # 4 is now the least recently used
    assert log.events[-2:] == [("open", 0), ("close", 4)]
    assert c.open_members() == [3, 0] and c.opens == 4


def test_a_held_member_is_never_closed_and_the_bound_returns_on_release():
    log = Log()
    c = MemberCache(6, log.open, log.close, 2)
    c.hold([0, 0, 1, 2])  # repeats hold once
    assert c.open_members() == [0, 1, 2] and ("close", 0) not in log.events  # 3 held > max_open: none closed
    c.hold([3])
    assert len(c.open_members()) == 4
    c.release([3])  # 3 is idle and the only member nobody holds: it closes, the held ones stay
    assert c.open_members() == [0, 1, 2] and log.events[-1] == ("close", 3)
    c.release([0, 0, 1, 2])  # one release per call, as one hold per call
    # 0, 1, 2 share the tick of their call: the lowest index closes first, down to max_open
    assert log.events[-1] == ("close", 0) and c.open_members() == [1, 2] and not c._users.any()


def test_acquire_within_refuses_a_read_past_the_bound_and_holds_nothing():
    log = Log()
    c = MemberCache(8, log.open, log.close, 3)
    c.hold([0, 1])
    assert c.acquire_within([2, 3]) is None  # 2 held + 2 new > 3
    assert c.open_members() == [0, 1] and log.events == [("open", 0), ("open", 1)]
    assert c.acquire_within([1, 2]) == ["item1", "item2"]  # 2 held + 1 new = 3
    assert c.acquire_within([5]) == ["item5"]  # one member is always allowed (the caller reads one at a time)
    c.release([1, 2])
    c.release([5])
    c.release([0, 1])
    assert len(c.open_members()) == 3


def test_an_open_error_reaches_the_caller_with_nothing_held():
    log = Log(fail={2})
    c = MemberCache(4, log.open, log.close, 1)
    with pytest.raises(FileNotFoundError, match="member 2"):
        c.acquire([1, 2])
    assert not c._users.any()  # nothing of the call is held
    assert c.open_members() == [1]  # what it opened stays within the bound
    assert c.acquire([0]) == ["item0"]
    c.release([0])
    assert c.open_members() == [0]


def test_put_enters_an_item_opened_elsewhere_and_close_closes_all():
    log = Log()
    c = MemberCache(3, log.open, log.close, 3, closed_message="set/: the loader was closed")
    assert c.fit
    c.put(2, "item2")
    assert c.peek(2) == "item2" and c.opens == 0 and c.items() == {2: "item2"}
    c.get(0)
    c.close()
    assert sorted(log.events) == [("close", 0), ("close", 2), ("open", 0)]
    with pytest.raises(RuntimeError, match="set/: the loader was closed"):
        c.acquire([1])
    d = MemberCache(2, log.open, log.close, 1, closed_message=None)  # a record reader: usable after close()
    d.get(1)
    d.close()
    assert d.get(1) == "item1"


def test_bad_bounds_and_the_open_file_limit():
    with pytest.raises(ValueError, match="max_open"):
        MemberCache(2, str, print, 0)
    assert 16 <= max_open_files(10_000) <= 10_000
    assert max_open_files(5) == 5


def test_threads_holding_members_never_see_one_closed():
    """4 threads hold random members of 40 (max_open 4) and check each held item is still open."""
    lock = threading.Lock()
    state = {"open": set(), "bad": 0}

    def opener(k):
        with lock:
            state["open"].add(k)
        return k

    def closer(k, item):
        with lock:
            state["open"].discard(k)

    c = MemberCache(40, opener, closer, 4)

    def work(seed):
        rng = np.random.default_rng(seed)
        for _ in range(300):
            ks = rng.integers(0, 40, 3)
            c.hold(ks)
            with lock:
                state["bad"] += sum(1 for k in ks.tolist() if k not in state["open"])
            c.release(ks)

    threads = [threading.Thread(target=work, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert state["bad"] == 0 and len(c.open_members()) <= 4 and not c._users.any()
