"""The remote page source alone (``load/remote_pages.py``): a record file with records that cross two and three
pages, empty records and a short last page, served by aiohttp's static file server behind the fault proxy
(tests/remote_servers.py), read through :class:`RemotePages` directly.

Expectations are independent of the product: record bytes from the reference reader (tests/reference/format.py),
page sets and range requests counted by hand from the spec's page layout (``data_offset + k * page_size``), and
the proxy's own log of the range GETs it saw.
"""

from __future__ import annotations

import concurrent.futures
import re
import time

import numpy as np
import pytest
from reference.format import read_file
from remote_servers import FaultProxy, StaticHTTP

from pageset import Bytes, Int, RemoteReadError, open_dataset, write_dataset
from pageset.load.remote_pages import MAX_LOOKAHEAD_STEPS, RemotePages, span_pages

PS = 4096


def _sizes() -> list[int]:
    rng = np.random.default_rng(18)
    sizes = [int(s) for s in rng.integers(0, 1500, size=40)]
    sizes[3] = sizes[17] = 0  # empty records
    sizes[5] = 2 * PS + 100  # crosses three pages
    sizes[11] = PS + 7  # crosses two pages
    sizes[25] = 3 * PS  # at least three pages, four when it does not start on a boundary
    return sizes


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("remote_pages")
    rng = np.random.default_rng(7)
    rows = [{"blob": rng.integers(0, 256, size=n, dtype=np.uint8).tobytes(), "id": i}
            for i, n in enumerate(_sizes())]
    write_dataset(root / "r.pageset", rows, {"blob": Bytes(), "id": Int()}, num_workers=0, page_size=PS,
                  progress=False)
    ref = read_file(root / "r.pageset")
    http = StaticHTTP(root)
    proxy = FaultProxy(http.url)
    try:
        yield {"ref": ref, "proxy": proxy, "url": f"{proxy.url}/r.pageset", "rows": rows}
    finally:
        proxy.stop()
        http.stop()


@pytest.fixture
def env(served):
    served["proxy"].reset()
    ds = open_dataset(served["url"], request_timeout=5, request_attempts=2)
    served["proxy"].reset()  # the open's own requests are not the page source's
    opened = []

    def make(**kw):
        rp = RemotePages(ds, **kw)
        opened.append(rp)
        return rp

    yield {**served, "ds": ds, "make": make}
    served["proxy"].hang = False  # hung requests end unanswered: their fetches retry and finish
    for rp in opened:
        rp.close()
        rp._pool.shutdown(wait=True)  # no fetch thread outlives the test (bounded by the request timeouts)
    ds.close()
    served["proxy"].reset()


def _layout(ref):
    h = ref.header
    data_offset, page_size = h["data_offset"], h["page_size"]
    data_length = sum(len(p) for p in ref.pages)
    return data_offset, page_size, len(ref.pages), data_length


def _page_range(ref, k0: int, k1: int) -> str:
    """The Range header of a request for pages [k0, k1), as the spec's page layout gives it."""
    data_offset, ps, count, length = _layout(ref)
    end = data_offset + min(k1 * ps, length) - 1
    return f"bytes={data_offset + k0 * ps}-{end}"


def _spans(ref, ids):
    offs = np.array([ref.records[i]["_offset"] for i in ids], dtype=np.int64)
    lens = np.array([ref.records[i]["_length"] for i in ids], dtype=np.int64)
    return offs, lens


def _record_bytes(ref, i: int) -> bytes:
    r = ref.records[i]
    return ref.data[r["_offset"]: r["_offset"] + r["_length"]]


# ---- span_pages --------------------------------------------------------------------------------------------

def test_span_pages_by_hand():
    # data at byte 100, pages of 10 bytes, 5 pages (the last one may be short)
    got = span_pages(np.array([100, 105, 119, 130, 100]), np.array([3, 0, 2, 25, 10]), 100, 10, 5)
    assert got.tolist() == [0, 1, 2, 3, 4]  # 100-102 -> 0; empty; 119-120 -> 1, 2; 130-154 -> 3, 4 (clamped)
    assert got.dtype == np.int64
    assert span_pages(np.array([110]), np.array([10]), 100, 10, 5).tolist() == [1]  # ends on a boundary
    assert span_pages(np.array([120, 100]), np.array([1, 1]), 100, 10, 5).tolist() == [0, 2]  # sorted
    assert span_pages(np.array([120]), np.array([0]), 100, 10, 5).tolist() == []
    assert span_pages(np.array([100]), np.array([5]), 100, 10, 0).tolist() == []


def test_span_pages_of_every_record_are_the_references(served):
    ref = served["ref"]
    data_offset, ps, count, _ = _layout(ref)
    for i in range(len(ref.records)):
        offs, lens = _spans(ref, [i])
        want = ref.record_pages(i) if lens[0] else []
        assert span_pages(offs, lens, data_offset, ps, count).tolist() == want, i
    ids = list(range(len(ref.records)))
    offs, lens = _spans(ref, ids)
    want = sorted({k for i in ids if ref.records[i]["_length"] for k in ref.record_pages(i)})
    assert span_pages(offs, lens, data_offset, ps, count).tolist() == want
    assert any(len(ref.record_pages(i)) >= 3 for i in ids)  # the fixture has records over three pages


# ---- gather ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("ordered", [True, False])
def test_gather_returns_the_reference_bytes_and_reuses_the_staging_buffer(env, ordered):
    ref = env["ref"]
    rp = env["make"](prefetch_bytes=PS, max_requests=2)
    rng = np.random.default_rng(3)
    staging: dict = {}
    batches = [[5, 3, 11, 0, 25, 39], [17], list(range(len(ref.records)))]
    batches += [rng.choice(len(ref.records), size=7, replace=True).tolist() for _ in range(4)]
    for ids in batches:
        offs, lens = _spans(ref, ids)
        buf, out = rp.gather(offs, lens, staging, ordered=ordered)
        assert out.shape == offs.shape
        for j, i in enumerate(ids):
            assert bytes(buf[out[j]: out[j] + lens[j]]) == _record_bytes(ref, i), (ids, j)
    total = sum(len(_record_bytes(ref, i)) for i in range(len(ref.records)))
    assert staging["bytes"].shape[0] == max(total, 1 << 16)
    small = staging["bytes"]
    rp.gather(*_spans(ref, [1]), staging)
    assert staging["bytes"] is small  # a smaller batch reuses the buffer


def test_gather_grows_a_small_staging_buffer(env):
    ref = env["ref"]
    rp = env["make"]()
    staging = {"bytes": np.zeros(10, dtype=np.uint8)}
    ids = [5, 25, 11]
    offs, lens = _spans(ref, ids)
    buf, out = rp.gather(offs, lens, staging)
    assert staging["bytes"] is buf and buf.shape[0] == max(int(lens.sum()), 1 << 16)
    assert out.tolist() == [0, int(lens[0]), int(lens[0] + lens[1])]  # batch order, back to back
    assert b"".join(bytes(buf[o: o + n]) for o, n in zip(out, lens)) == b"".join(_record_bytes(ref, i) for i in ids)


# ---- requests and counters ---------------------------------------------------------------------------------

def test_missing_pages_are_fetched_as_runs_capped_at_max_run_bytes(env):
    ref, proxy = env["ref"], env["proxy"]
    rp = env["make"](max_requests=1, max_run_bytes=2 * PS + 5)  # runs of at most 2 pages
    _, _, count, length = _layout(ref)
    got = rp.pages(np.array([0, 1, 2, 3, 5, 7, 8]))
    assert sorted(got) == [0, 1, 2, 3, 5, 7, 8]
    for k, page in got.items():
        assert bytes(page) == ref.pages[k], k
    assert proxy.range_gets() == [_page_range(ref, a, b) for a, b in [(0, 2), (2, 4), (5, 6), (7, 9)]]
    st = rp.stats()
    assert {k: st[k] for k in ("requests", "pages_fetched", "pages_used", "memory_hits", "waits")} == {
        "requests": 4, "pages_fetched": 7, "pages_used": 7, "memory_hits": 0, "waits": 1}
    assert st["bytes_fetched"] == 7 * PS
    assert st["all_requests"] >= 4
    # pages 1 and 2 are in memory, 4 is not: one request for one page, one more wait
    last = count - 1
    got = rp.pages(np.array([1, 2, 4, last]))
    assert bytes(got[last]) == ref.pages[last] and len(ref.pages[last]) < PS  # the short last page
    assert proxy.range_gets()[4:] == [_page_range(ref, 4, 5), _page_range(ref, last, last + 1)]
    st = rp.stats()
    assert (st["requests"], st["pages_fetched"], st["pages_used"], st["memory_hits"], st["waits"]) == (6, 9, 11, 2, 2)
    assert st["bytes_fetched"] == 8 * PS + len(ref.pages[last])
    assert length == (count - 1) * PS + len(ref.pages[last])
    rp.pages(np.array([1, 2]))  # all in memory: no wait counted
    st = rp.stats()
    assert (st["requests"], st["memory_hits"], st["waits"]) == (6, 4, 2)


def test_memory_is_an_lru_of_memory_bytes(env):
    ref, proxy = env["ref"], env["proxy"]
    rp = env["make"](max_requests=1, memory_bytes=3 * PS)
    for k in (0, 1, 2):
        rp.pages(np.array([k]))
    rp.pages(np.array([0]))  # a hit: page 0 is now the most recently used
    rp.pages(np.array([3]))  # over the bound: page 1 (least recently used) goes, 0 stays
    assert rp.stats()["requests"] == 4
    rp.pages(np.array([0]))
    rp.pages(np.array([2]))
    assert rp.stats()["requests"] == 4 and rp.stats()["memory_hits"] == 3
    rp.pages(np.array([1]))  # fetched again
    assert rp.stats()["requests"] == 5
    assert proxy.range_gets()[-1] == _page_range(ref, 1, 2)


def test_a_run_is_fetched_once_while_threads_wait_on_it(env):
    ref, proxy = env["ref"], env["proxy"]
    proxy.latency = 0.3
    rp = env["make"](max_requests=4)
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        outs = list(pool.map(lambda _: rp.pages(np.array([2, 3, 4])), range(4)))
    for got in outs:
        assert {k: bytes(v) for k, v in got.items()} == {k: ref.pages[k] for k in (2, 3, 4)}
    assert proxy.range_gets() == [_page_range(ref, 2, 5)]
    assert rp.stats()["requests"] == 1


# ---- the plan: prefetch in step order, pins ----------------------------------------------------------------

def _one_page_steps(pages, calls=None):
    """``pages_of_step`` for steps of one page each; ``calls`` records the steps the source planned, in order."""
    def pages_of_step(s):
        if calls is not None:
            calls.append(s)
        return np.array([pages[s]], dtype=np.int64)

    return pages_of_step


def _settled(rp, pages) -> None:
    """Wait (bounded by the fetches' own timeouts) for the requests already issued for ``pages``."""
    rp.pages(np.asarray(pages, dtype=np.int64))


def test_plan_requests_the_next_steps_up_to_prefetch_bytes_in_step_order(env):
    ref, proxy = env["ref"], env["proxy"]
    rp = env["make"](max_requests=1, prefetch_bytes=3 * PS)
    order, calls = [6, 2, 9, 4, 0, 8], []
    rp.plan(_one_page_steps(order, calls), 0, len(order))
    assert calls == [0, 1, 2]  # planned (and requested) before any thread asks
    _settled(rp, order[:3])
    assert proxy.range_gets() == [_page_range(ref, k, k + 1) for k in order[:3]]  # step order, 3 pages
    st = rp.stats()
    assert st["requests"] == 3 and st["memory_hits"] + st["waits"] >= 1
    rp.advance(1)  # step 0's page is released: one more step fits
    assert calls == [0, 1, 2, 3]
    _settled(rp, order[1:4])
    assert proxy.range_gets() == [_page_range(ref, k, k + 1) for k in order[:4]]
    rp.advance(3)  # steps 1 and 2 released: two more steps fit
    assert calls == [0, 1, 2, 3, 4, 5]
    rp.advance(6)  # past the end: nothing more to plan
    assert calls == [0, 1, 2, 3, 4, 5]
    _settled(rp, order[3:])
    assert rp.stats()["requests"] == 6


def test_the_steps_threads_work_on_are_planned_whatever_the_budget(env):
    ref, proxy = env["ref"], env["proxy"]
    rp = env["make"](max_requests=1, prefetch_bytes=0)  # the budget is one page
    order, calls = [6, 2, 9, 4, 0, 8], []
    rp.plan(_one_page_steps(order, calls), 1, len(order), min_ahead=3)  # resumed at step 1, 3 steps in flight
    assert calls == [1, 2, 3]
    _settled(rp, order[1:4])
    assert proxy.range_gets() == [_page_range(ref, k, k + 1) for k in order[1:4]]
    rp.advance(2)
    assert calls == [1, 2, 3, 4]
    _settled(rp, order[2:5])
    assert proxy.range_gets() == [_page_range(ref, k, k + 1) for k in order[1:5]]


def test_planned_pages_are_pinned_and_released_when_their_step_has_passed(env):
    ref, proxy = env["ref"], env["proxy"]
    # memory holds one page; the plan pins 3 pages of the next steps, so none of them is evicted
    rp = env["make"](max_requests=1, prefetch_bytes=3 * PS, memory_bytes=PS)
    order = [1, 3, 5, 7, 9]
    rp.plan(_one_page_steps(order), 0, len(order))
    _settled(rp, order[:3])
    _settled(rp, order[:3])
    assert rp.stats()["requests"] == 3 and rp.stats()["memory_hits"] >= 3  # pinned: still in memory
    rp.advance(2)  # steps 0 and 1 pass: pages 1 and 3 may go; 5 (step 2), 7 and 9 are planned
    _settled(rp, [5, 7, 9])
    requests = rp.stats()["requests"]
    assert requests == 5
    rp.pages(np.array([1]))  # evicted once unpinned (memory holds one page)
    assert rp.stats()["requests"] == requests + 1
    assert proxy.range_gets()[-1] == _page_range(ref, 1, 2)


def test_a_new_plan_releases_the_old_plans_pins(env):
    rp = env["make"](max_requests=1, prefetch_bytes=2 * PS, memory_bytes=PS)
    rp.plan(_one_page_steps([1, 3]), 0, 2)
    _settled(rp, [1, 3])
    rp.plan(_one_page_steps([5]), 0, 1)  # pages 1 and 3 are no longer pinned
    _settled(rp, [5])
    n = rp.stats()["requests"]
    rp.pages(np.array([1]))
    rp.pages(np.array([3]))
    assert rp.stats()["requests"] == n + 2


def test_lookahead_is_bounded_in_steps(env):
    proxy = env["proxy"]
    rp = env["make"](max_requests=1, prefetch_bytes=1 << 30)
    # every step needs page 0 (in flight or in memory after the first): the byte budget never fills
    calls = []

    def pages_of_step(s):
        calls.append(s)
        return np.array([0], dtype=np.int64)

    rp.plan(pages_of_step, 0, 10 * MAX_LOOKAHEAD_STEPS)
    assert calls == list(range(MAX_LOOKAHEAD_STEPS))
    rp.advance(5)
    assert calls == list(range(MAX_LOOKAHEAD_STEPS + 5))
    _settled(rp, [0])
    assert len(proxy.range_gets()) == 1


# ---- failures ----------------------------------------------------------------------------------------------

def test_the_first_failure_fails_the_pending_fetches_at_once_and_later_waits_until_a_new_plan(env):
    ref, proxy = env["ref"], env["proxy"]
    rp = env["make"](max_requests=1, max_run_bytes=PS)
    proxy.error = (403, "AccessDenied", "Access Denied")  # not retried
    with pytest.raises(PermissionError) as first:
        rp.pages(np.array([0, 1, 2]))  # three runs of one page: the first refusal fails the other two
    assert len(proxy.range_gets()) == 1
    with pytest.raises(PermissionError) as again:
        rp.pages(np.array([4]))  # asking again would only repeat it: no request
    assert again.value is first.value
    with pytest.raises(PermissionError) as gather:
        rp.gather(*_spans(ref, [1]), {})
    assert gather.value is first.value
    assert len(proxy.range_gets()) == 1
    proxy.error = None
    rp.plan(_one_page_steps([0, 1]), 0, 2)  # a new iteration tries the store again
    got = rp.pages(np.array([0, 1, 2]))
    assert {k: bytes(v) for k, v in got.items()} == {k: ref.pages[k] for k in (0, 1, 2)}


def test_a_refused_fetch_reaches_the_waiting_thread_as_the_stores_error(env):
    proxy = env["proxy"]
    rp = env["make"](max_requests=1)
    proxy.error = (403, "AccessDenied", "Access Denied")
    with pytest.raises(PermissionError, match=re.escape(env["url"])):
        rp.pages(np.array([3]))
    with pytest.raises(PermissionError, match=re.escape(env["url"])):
        rp.gather(*_spans(env["ref"], [5]), {})  # until the next plan
    assert len(proxy.range_gets()) == 1


def test_when_several_fetches_fail_later_waits_raise_one_kept_error_without_asking_again(env):
    proxy = env["proxy"]
    rp = env["make"](max_requests=2, max_run_bytes=PS)
    proxy.error = (403, "AccessDenied", "Access Denied")
    proxy.latency = 0.2  # both requests are out before either answers
    with pytest.raises(PermissionError):
        rp.pages(np.array([0, 2]))
    kept = []
    for _ in range(3):
        with pytest.raises(PermissionError) as later:
            rp.pages(np.array([6]))
        kept.append(later.value)
    assert kept[0] is kept[1] is kept[2]
    assert len(proxy.range_gets()) == 2


def test_a_wait_with_no_sign_of_life_gives_up_after_stall_after(env):
    proxy = env["proxy"]
    rp = env["make"](max_requests=1)
    rp.stall_after = 0.5  # the fetch's own timeout (5 s x 2 attempts) is far longer
    proxy.hang = True
    t0 = time.monotonic()
    with pytest.raises(RemoteReadError, match=re.escape(env["url"]) + r": page 3 not fetched: no answer from the "
                       r"store for 0\.\d s with 1 request\(s\) awaited \(request_attempts 2 x request_timeout 5 s"):
        rp.pages(np.array([3]))
    assert time.monotonic() - t0 < 4.0  # well before the fetch's own 10 s
    with pytest.raises(RemoteReadError, match="page 3 not fetched"):
        rp.pages(np.array([5]))  # the failure holds until the next plan
    proxy.hang = False


def test_wait_timeout_caps_a_wait_even_while_answers_arrive(env):
    proxy = env["proxy"]
    rp = env["make"](max_requests=1)
    rp.wait_timeout = 0.3
    proxy.hang = True
    t0 = time.monotonic()
    with pytest.raises(RemoteReadError, match="page 7 not fetched"):
        rp.pages(np.array([7]))
    assert time.monotonic() - t0 < 4.0
    proxy.hang = False


def test_closed_source_refuses_and_fails_pending_waits(env):
    proxy = env["proxy"]
    rp = env["make"](max_requests=1)
    rp.close()
    with pytest.raises(RuntimeError, match=re.escape(env["url"]) + ": the page source is closed"):
        rp.pages(np.array([0]))
    rp.advance(0)  # a no-op once closed
    rp.close()
    assert proxy.range_gets() == []


def test_arguments_are_checked(env):
    with pytest.raises(ValueError, match="max_requests must be >= 1, got 0"):
        env["make"](max_requests=0)
    with pytest.raises(ValueError, match="prefetch_bytes must be >= 0, got -1"):
        env["make"](prefetch_bytes=-1)
    rp = env["make"](prefetch_bytes=10)
    assert rp.prefetch_bytes == PS and rp.memory_bytes == 2 * PS  # at least one page; memory twice that
    assert env["make"](memory_bytes=5 * PS + 1).memory_bytes == 5 * PS + 1
    assert env["make"](max_run_bytes=3 * PS + 1).max_run_pages == 3
    assert env["make"](max_run_bytes=10).max_run_pages == 1
    assert env["make"]().prefetch_bytes == 64 << 20


def test_cache_dir_waits_for_another_processs_fetch_twice_its_retry_budget(env, tmp_path):
    rp = env["make"](cache_dir=tmp_path / "c")
    # request_attempts 2 x (request_timeout 5 s + backoff_max 5 s), twice, + 30 s
    assert rp.disk.lock_timeout == 70.0
    assert rp.disk.limit_bytes == 10 << 30
    ref = env["ref"]
    buf, out = rp.gather(*_spans(ref, [5]), {})
    assert bytes(buf[out[0]: out[0] + ref.records[5]["_length"]]) == _record_bytes(ref, 5)
    assert rp.stats()["disk_misses"] >= 1 and rp.stats()["disk_hits"] == 0
    with pytest.raises(ValueError, match="^" + re.escape(env["url"]) + ": "):
        env["make"](cache_dir=tmp_path / "d", cache_limit_bytes=100)  # smaller than one page
