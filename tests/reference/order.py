"""Reference model of pageset's sample order, written from formats/order.md and formats/mixture.md alone.

Plain Python ints and lists, standard library only (tests/test_reference_order_independent.py checks the
imports): slow, small and meant to be obviously correct. Section numbers refer to formats/order.md unless a
name says mixture.md. Nothing here is imported from pageset.
"""

from __future__ import annotations

import hashlib
import json
import math
from fractions import Fraction

M64 = 2**64
TAG_PERMUTATION, TAG_PAGES, TAG_WINDOW, TAG_AUG, TAG_MIXTURE_SOURCE = 1, 2, 3, 4, 5


# --- 2. keys -------------------------------------------------------------------------------------------------

def splitmix64(x: int) -> int:
    z = (x + 0x9E3779B97F4A7C15) % M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) % M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) % M64
    return z ^ (z >> 31)


def key(seed: int, epoch: int, tag: int, i: int) -> int:
    h = splitmix64(seed % M64)
    for v in (epoch, tag, i):
        h = splitmix64(h ^ (v % M64))
    return h


def draw(base: int, i: int) -> int:
    """Draw i of the stream ``base`` (section 2.3)."""
    return splitmix64(base ^ (i % M64))


def stream(seed: int, epoch: int, tag: int) -> int:
    """The stream whose draw i is key(seed, epoch, tag, i): key_base of section 2.2."""
    h = splitmix64(seed % M64)
    for v in (epoch, tag):
        h = splitmix64(h ^ (v % M64))
    return h


def randbelow(k: int, n: int) -> int:
    """Section 2.4: the first x of k, splitmix64(k), ... whose low word is >= 2^64 mod n; its high word."""
    assert 1 <= n < M64
    t = M64 % n
    x = k
    while (x * n) % M64 < t:
        x = splitmix64(x)
    return (x * n) // M64


# --- 3. Fisher-Yates, 4. epoch permutations -------------------------------------------------------------------

def shuffle(values: list, base: int) -> list:
    out = list(values)
    for i in range(len(out) - 1, 0, -1):
        j = randbelow(draw(base, i), i + 1)
        out[i], out[j] = out[j], out[i]
    return out


def permutation(page_sizes, seed: int, epoch: int, order: str, window_pages: int = 1) -> list[int]:
    """perm[p] = record id at epoch position p, p in [0, N) (section 4)."""
    sizes = [int(s) for s in page_sizes]
    n = sum(sizes)
    if order == "sequential":
        return list(range(n))
    if order == "random":
        return shuffle(list(range(n)), stream(seed, epoch, TAG_PERMUTATION))
    assert order == "quasi_random", order
    first = [sum(sizes[:k]) for k in range(len(sizes))]
    pages = shuffle(list(range(len(sizes))), stream(seed, epoch, TAG_PAGES))
    out: list[int] = []
    for w in range(math.ceil(len(pages) / window_pages)):
        ids = []
        for k in pages[w * window_pages : (w + 1) * window_pages]:
            ids += range(first[k], first[k] + sizes[k])
        out += shuffle(ids, key(seed, epoch, TAG_WINDOW, w))
    return out


def window_pages_for(page_sizes, window_pages=None, window_records=16384) -> int:
    """Section 4.1: M given, or sized in records (R = window_records) for this layout."""
    if window_pages is not None:
        return window_pages
    k, n = len(page_sizes), sum(int(s) for s in page_sizes)
    if n == 0:
        return 1
    return min(k, max(1, math.ceil(Fraction(window_records * k, n))))


# --- 5. epochs, steps, ranks -------------------------------------------------------------------------------

def epoch_length(n: int, global_batch: int, drop_last: bool) -> int:
    if n <= 0 or (drop_last and n < global_batch):
        raise ValueError("no full step")
    return (n // global_batch) * global_batch if drop_last else -(-n // global_batch) * global_batch


def epoch_end(n: int, global_batch: int, drop_last: bool, cursor: int) -> int:
    """Section 5.1: where an epoch ends whose steps of ``global_batch`` start at ``cursor``."""
    left = n - cursor
    steps = left // global_batch if drop_last else -(-left // global_batch)
    return cursor + max(steps, 0) * global_batch


def rank_positions(step: int, rank: int, world_size: int, global_batch: int) -> list[int]:
    assert global_batch % world_size == 0 and 0 <= rank < world_size
    b = global_batch // world_size
    return [step * global_batch + rank * b + j for j in range(b)]


def aug_key(seed: int, epoch: int, position: int) -> int:
    return key(seed, epoch, TAG_AUG, position)


class FileOrder:
    """Order v1 of one record layout (a whole file, or a subset of it: mixture.md section 1).

    ``FileOrder(page_sizes, seed, order, window_pages, drop_last, global_batch, subset=None,
    window_records=16384)``: page_sizes, the file's records (or token windows) per page (sections 6, 7); subset,
    the ``indices`` list (any order, repeats allowed), None for the whole file; window_pages None: M sized in
    records on the layout the order runs on (section 4.1; a subset's virtual layout).
    """

    def __init__(self, page_sizes, seed, order, window_pages, drop_last, global_batch, subset=None,
                 window_records=16384):
        self.seed, self.order = seed, order
        self.window_pages, self.window_records = window_pages, window_records
        self.drop_last, self.g = drop_last, global_batch
        sizes = [int(s) for s in page_sizes]
        if subset is None:
            self.members, self.vsizes = None, sizes
        else:
            subset = [int(x) for x in subset]
            if order == "quasi_random":
                page_of = [k for k, s in enumerate(sizes) for _ in range(s)]
                self.members = sorted(subset, key=lambda x: page_of[x])  # sorted() is stable
                self.vsizes = [c for c in (sum(1 for x in subset if page_of[x] == k) for k in range(len(sizes)))
                               if c > 0]
            else:
                self.members, self.vsizes = list(subset), [len(subset)]
        self.n = sum(self.vsizes)
        self.m = window_pages_for(self.vsizes, window_pages, window_records)
        self.length = epoch_length(self.n, global_batch, drop_last)
        self.steps = self.length // global_batch
        self._perms: dict[int, list[int]] = {}

    def perm(self, epoch: int) -> list[int]:
        if epoch not in self._perms:
            p = permutation(self.vsizes, self.seed, epoch, self.order, self.m)
            self._perms[epoch] = p if self.members is None else [self.members[v] for v in p]
        return self._perms[epoch]

    def record(self, epoch: int, position: int) -> tuple[int, bool]:
        """(record id, is padding) at an epoch position in [0, L)."""
        return self.perm(epoch)[position % self.n], position >= self.n

    def batch(self, epoch: int, step: int, rank: int, world_size: int) -> tuple[list[int], list[bool]]:
        """(_index, _is_padding) of one rank's batch."""
        assert 0 <= step < self.steps
        out = [self.record(epoch, p) for p in rank_positions(step, rank, world_size, self.g)]
        return [i for i, _ in out], [pad for _, pad in out]

    def global_stream(self, epoch: int, step: int, steps: int) -> list[tuple[int, bool]]:
        """(id, padding) of ``steps`` global steps from (epoch, step), crossing epoch ends (epoch after epoch)."""
        out = []
        for _ in range(steps):
            if step == self.steps:
                epoch, step = epoch + 1, 0
            out += [self.record(epoch, p) for p in range(step * self.g, (step + 1) * self.g)]
            step += 1
        return out


# --- 6, 7. page layouts ---------------------------------------------------------------------------------------

def record_page_sizes(offsets, data_offset: int, page_size: int, page_count: int) -> list[int]:
    """Records per page from the index's ``_offset`` column (section 6)."""
    sizes = [0] * max(page_count, 1)
    for off in offsets:
        sizes[0 if page_count == 0 else min((int(off) - data_offset) // page_size, page_count - 1)] += 1
    return sizes


def token_windows(count: int, seq_len: int) -> int:
    return (count - 1) // seq_len


def window_page_sizes(count: int, seq_len: int, itemsize: int, page_size: int, page_count: int) -> list[int]:
    """Windows per page of a token stream (section 7)."""
    sizes = [0] * max(page_count, 1)
    for w in range(token_windows(count, seq_len)):
        sizes[(w * seq_len * itemsize) // page_size] += 1
    return sizes


# --- 8. state -------------------------------------------------------------------------------------------------

def state_dict(dataset_id, seed, epoch, cursor, global_batch, order, window_pages, drop_last, subset=None,
               seq_len=0, packing="", window_records=16384) -> dict:
    """window_pages None: the window sized in records (saved as 0, with window_records)."""
    d = {"version": 1, "order_algo": 1, "dataset_id": dataset_id, "seed": seed, "epoch": epoch, "cursor": cursor,
         "global_batch_size": global_batch, "order": order,
         "window_pages": 0 if window_pages is None else window_pages, "drop_last": drop_last}
    if window_pages is None:
        d["window_records"] = window_records
    if subset is not None:
        d["subset"] = subset_digest(subset)
    if seq_len:
        d["seq_len"] = seq_len
    if packing:  # formats/packing.md section 7
        d["packing"] = packing
    if cursor % global_batch:  # inside an epoch in which the global batch changed (section 5.1)
        d["batch_offset"] = cursor % global_batch
    return d


def resume_position(state: dict, length: int) -> tuple[int, int]:
    """(epoch, step) of the next batch after loading ``state`` (an epoch of ``length`` positions), same G."""
    assert 0 <= state["cursor"] <= length and state["cursor"] % state["global_batch_size"] == 0
    if state["cursor"] == length:
        return state["epoch"] + 1, 0
    return state["epoch"], state["cursor"] // state["global_batch_size"]


def resume_cursor(state: dict, n: int, global_batch: int) -> tuple[int, int]:
    """(epoch, cursor) at which a loader of global batch ``global_batch`` (the saved one or another) continues
    from ``state`` (section 8 with section 5.1; n records, or samples_per_epoch of a mixture)."""
    g_s, cursor, offset = state["global_batch_size"], state["cursor"], state.get("batch_offset", 0)
    assert cursor % g_s == offset and 0 <= offset < g_s
    end = epoch_end(n, g_s, state["drop_last"], offset) if offset else epoch_length(n, g_s, state["drop_last"])
    assert cursor <= end
    if cursor == end or epoch_end(n, global_batch, state["drop_last"], cursor) == cursor:
        return state["epoch"] + 1, 0
    return state["epoch"], cursor


def cut_epoch(n: int, global_batch: int, drop_last: bool, cursor: int) -> list[list[int]]:
    """Section 5.1: the positions of each remaining global step of an epoch cut at ``cursor``."""
    end = epoch_end(n, global_batch, drop_last, cursor) if cursor else epoch_length(n, global_batch, drop_last)
    return [list(range(p, p + global_batch)) for p in range(cursor, end, global_batch)]


def refused_field(saved: dict, current: dict, world_size: int) -> str | None:
    """The field load_state_dict names when ``current``'s loader refuses ``saved`` (None: accepted)."""
    for name in ("version", "order_algo"):
        if saved.get(name) != 1:
            return name
    checks = ["dataset_id", "subset", "seq_len", "packing", "order_algo", "seed", "order", "drop_last"]
    if saved["order"] == "quasi_random":
        checks[checks.index("drop_last"):checks.index("drop_last")] = ["window_pages", "window_records"]
    absent = {"subset": "", "seq_len": 0, "packing": "", "window_records": 0}  # optional keys: value when missing
    for name in checks:
        a, b = saved.get(name, absent.get(name)), current.get(name, absent.get(name))
        if name == "seq_len" and not a:
            continue
        if a != b:
            return name
    if current["global_batch_size"] % world_size:  # the loader's G; the saved one may differ (section 5.1)
        return "global_batch_size"
    return None


def subset_digest(indices) -> str:
    data = b"".join(int(x).to_bytes(8, "little", signed=True) for x in indices)
    return f"{len(indices)}:{hashlib.sha256(data).hexdigest()[:32]}"


# --- mixture.md 2.1 quotas ----------------------------------------------------------------------------------

def quotas(weights) -> list[int]:
    exact = [Fraction(w) for w in weights]
    total = sum(exact)
    assert total > 0 and all(w >= 0 for w in exact)
    q = None
    if all(w.denominator == 1 for w in exact) and total <= 10**6:
        q = [int(w) for w in exact]
    if q is None:
        shares = [w / total for w in exact]
        simple = [s.limit_denominator(1000) for s in shares]
        lcd = math.lcm(*(f.denominator for f in simple))
        if sum(simple) == 1 and all(abs(a - b) <= Fraction(1, 10**9) for a, b in zip(simple, shares)) \
                and lcd <= 10**6:
            q = [int(f * lcd) for f in simple]
    if q is None:
        scaled = [w * 10**6 / total for w in exact]
        q = [math.floor(s) for s in scaled]
        by_remainder = sorted(range(len(q)), key=lambda i: (-(scaled[i] - q[i]), i))
        for i in by_remainder[: 10**6 - sum(q)]:
            q[i] += 1
    assert all(qi > 0 for w, qi in zip(exact, q) if w > 0)
    g = math.gcd(*q)
    return [x // g for x in q]


# --- mixture.md 2.2 the schedule ------------------------------------------------------------------------------

def schedule(q) -> list[int]:
    """slot[0..D-1]: the source of each slot of one period (EDF on Tijdeman's windows)."""
    d_total = sum(q)
    live = [i for i, x in enumerate(q) if x > 0]
    a, b = 2 * len(live) - 2, 2 * len(live) - 3
    taken = [0] * len(q)
    slots = []
    for t in range(1, d_total + 1):
        best = None
        for i in live:
            k = taken[i] + 1
            if len(live) > 1 and not k * d_total * a <= t * q[i] * a + b * d_total:
                continue  # not released
            if best is None or ((k - 1) * a + b) * q[best] < ((taken[best]) * a + b) * q[i]:
                best = i
        assert best is not None, "EDF left a slot empty"
        slots.append(best)
        taken[best] += 1
    assert taken == list(q)
    return slots


class MixtureModel:
    """mixture.md 2.3-2.5: global mixture positions -> (source, record id), per-source epochs, the state."""

    def __init__(self, weights, source_page_sizes, seed, order, window_pages, drop_last, global_batch,
                 samples_per_epoch=None, window_records=16384):
        self.q = quotas(weights)
        self.slots = schedule(self.q)
        self.period = len(self.slots)
        self.seed, self.order, self.drop_last, self.g = seed, order, drop_last, global_batch
        self.window_pages, self.window_records = window_pages, window_records
        self.sizes = [[int(s) for s in p] for p in source_page_sizes]
        # section 4.1 of order.md per source: each its own M when the window is sized in records
        self.m = [window_pages_for(p, window_pages, window_records) for p in self.sizes]
        self.n = [sum(p) for p in self.sizes]
        self.spe = samples_per_epoch if samples_per_epoch is not None else sum(self.n)
        self.length = epoch_length(self.spe, global_batch, drop_last)
        self.steps = self.length // global_batch
        self.source_seeds = [key(seed, 0, TAG_MIXTURE_SOURCE, i) for i in range(len(self.q))]
        self._perms: dict[tuple[int, int], list[int]] = {}
        # prefix[r][i]: samples of source i in slots [0, r) of a period
        self._prefix = [[0] * len(self.q)]
        for s in self.slots:
            row = list(self._prefix[-1])
            row[s] += 1
            self._prefix.append(row)

    def count(self, g: int, i: int) -> int:
        """c_i(g): samples of source i among global positions [0, g)."""
        return (g // self.period) * self.q[i] + self._prefix[g % self.period][i]

    def sample(self, g: int) -> tuple[int, int]:
        """(source, record id) at global position g."""
        i = self.slots[g % self.period]
        k = self.count(g, i)
        e, pos = divmod(k, self.n[i])
        if (i, e) not in self._perms:
            self._perms[(i, e)] = permutation(self.sizes[i], self.source_seeds[i], e, self.order, self.m[i])
        return i, self._perms[(i, e)][pos]

    def batch(self, epoch: int, step: int, rank: int, world_size: int) -> tuple[list[int], list[int]]:
        """(_source, _index) of one rank's batch (no padding in a mixture)."""
        out = [self.sample(epoch * self.length + p) for p in rank_positions(step, rank, world_size, self.g)]
        return [s for s, _ in out], [i for _, i in out]

    def cursors(self, g: int) -> list[tuple[int, int]]:
        return [divmod(self.count(g, i), n) if n else (0, 0) for i, n in enumerate(self.n)]

    def dataset_id(self, source_ids) -> str:
        text = json.dumps({"mixture_algo": 1, "quotas": list(self.q), "samples_per_epoch": self.spe,
                           "sources": list(source_ids)}, sort_keys=True)
        return "mixture:" + hashlib.sha256(text.encode()).hexdigest()[:32]

    def state_dict(self, source_ids, epoch, cursor, seq_len=0, origin=None) -> dict:
        """origin: the global position of the epoch's first sample (default epoch * L; mixture.md 2.4, 2.5)."""
        first = epoch * self.length if origin is None else origin
        d = state_dict(self.dataset_id(source_ids), self.seed, epoch, cursor, self.g, self.order, self.window_pages,
                       self.drop_last, seq_len=seq_len, window_records=self.window_records)
        d["mixture"] = {"mixture_algo": 1, "quotas": list(self.q), "samples_per_epoch": self.spe,
                        "sources": [{"dataset_id": sid, "epoch": e, "cursor": c}
                                    for sid, (e, c) in zip(source_ids, self.cursors(first + cursor))]}
        if first != epoch * self.length:
            d["mixture"]["origin"] = first
        return d


# --- mixture.md 3 schedules ---------------------------------------------------------------------------------

def apportion(n: int, weights) -> list[int]:
    """mixture.md 3.2: n shared in proportion to the integer weights by largest remainder, ties to the lower index."""
    total = sum(weights)
    exact = [Fraction(n * w, total) for w in weights]
    out = [math.floor(x) for x in exact]
    order = sorted(range(len(out)), key=lambda i: (-(exact[i] - out[i]), i))
    for i in order[: n - sum(out)]:
        out[i] += 1
    return out


def _lowest(q) -> list[int]:
    g = math.gcd(*q)
    return [x // g for x in q]


def schedule_pieces(starts, stage_quotas, interpolate, block, until: int) -> list[tuple]:
    """mixture.md 3.2: the pieces (start, stop or None, quotas, stage) of a schedule, as far as position until."""
    pieces = []
    for j, s in enumerate(starts):
        if s > until:
            break
        if j == len(starts) - 1:
            pieces.append((s, None, _lowest(stage_quotas[j]), j))
            break
        length = starts[j + 1] - s
        if interpolate[j] == "step":
            q = _lowest(stage_quotas[j])
            periods, rest = divmod(length, sum(q))
            if periods:
                pieces.append((s, s + periods * sum(q), q, j))
            if rest:
                pieces.append((s + periods * sum(q), starts[j + 1], _lowest(apportion(rest, q)), j))
            continue
        # a ramp: source i is owed T_i(y) = integral over [0, y) of p_i + (p'_i - p_i) t / length
        p = [Fraction(x, sum(stage_quotas[j])) for x in stage_quotas[j]]
        p2 = [Fraction(x, sum(stage_quotas[j + 1])) for x in stage_quotas[j + 1]]
        b = min(block if block is not None else max(-(-length // 100), 4096), 10**6)
        got = [0] * len(p)
        x = 0
        while x < length:
            y = min(x + b, length)
            owed = [max(a * y + (a2 - a) * Fraction(y * y, 2 * length) - c, Fraction(0))
                    for a, a2, c in zip(p, p2, got)]
            den = math.lcm(*(o.denominator for o in owed))
            n = apportion(y - x, [int(o * den) for o in owed])
            pieces.append((s + x, s + y, _lowest(n), j))
            got = [c + v for c, v in zip(got, n)]
            x = y
    return pieces


class ScheduleModel:
    """mixture.md 3: the source of every position and every source's counts under a schedule (and edits)."""

    def __init__(self, starts, stage_quotas, interpolate=(), block=None, until=10**5):
        self.starts, self.stage_quotas = list(starts), [list(q) for q in stage_quotas]
        self.interpolate, self.block = list(interpolate), block
        self.pieces = schedule_pieces(self.starts, self.stage_quotas, self.interpolate, block, until)
        self._slots = {}
        # counts at each piece's start, by summing the pieces' slots one position at a time
        self.bases = []
        counts = [0] * len(self.stage_quotas[0])
        for a, b, q, _ in self.pieces:
            self.bases.append(list(counts))
            if b is not None:
                slots = self.slots(q)
                for g in range(a, b):
                    counts[slots[(g - a) % len(slots)]] += 1
        self.edit_at, self.offset = 0, [0] * len(counts)

    def slots(self, q) -> list[int]:
        key_ = tuple(q)
        if key_ not in self._slots:
            self._slots[key_] = schedule(list(q))
        return self._slots[key_]

    def _piece(self, g: int) -> int:
        k = max(i for i, p in enumerate(self.pieces) if p[0] <= g)
        assert self.pieces[k][1] is None or g < self.pieces[k][1], "position past the modelled pieces"
        return k

    def natural(self, g: int) -> list[int]:
        k = self._piece(g)
        a, _, q, _ = self.pieces[k]
        out = list(self.bases[k])
        slots = self.slots(q)
        for t in range(a, g):
            out[slots[(t - a) % len(slots)]] += 1
        return out

    def edit(self, g0: int, counts) -> None:
        """mixture.md 3.3: from g0 on, each source continues from counts[i] samples."""
        self.edit_at = g0
        self.offset = [c - n for c, n in zip(counts, self.natural(g0))]

    def counts(self, g: int) -> list[int]:
        assert g >= self.edit_at
        return [n + o for n, o in zip(self.natural(g), self.offset)]

    def source(self, g: int) -> tuple[int, int]:
        """(source, its sample number k) at position g."""
        k = self._piece(g)
        a, _, q, _ = self.pieces[k]
        slots = self.slots(q)
        i = slots[(g - a) % len(slots)]
        return i, self.counts(g)[i]

    def schedule_id(self) -> str:
        text = json.dumps({"block": self.block, "interpolate": self.interpolate,
                           "stages": [[s, q] for s, q in zip(self.starts, self.stage_quotas)]}, sort_keys=True)
        return "schedule:" + hashlib.sha256(text.encode()).hexdigest()[:32]


class ScheduledMixtureModel(MixtureModel):
    """mixture.md 2.3-2.5 over a schedule (section 3): MixtureModel with the schedule's sources and counts."""

    def __init__(self, sched: ScheduleModel, source_page_sizes, seed, order, window_pages, drop_last, global_batch,
                 samples_per_epoch=None, window_records=16384):
        super().__init__(sched.stage_quotas[0], source_page_sizes, seed, order, window_pages, drop_last,
                         global_batch, samples_per_epoch, window_records)
        self.sched = sched
        self.edits = []

    def count(self, g: int, i: int) -> int:
        return self.sched.counts(g)[i]

    def sample(self, g: int) -> tuple[int, int]:
        i, k = self.sched.source(g)
        e, pos = divmod(k, self.n[i])
        if (i, e) not in self._perms:
            self._perms[(i, e)] = permutation(self.sizes[i], self.source_seeds[i], e, self.order, self.m[i])
        return i, self._perms[(i, e)][pos]

    def dataset_id(self, source_ids) -> str:
        if len(self.sched.starts) == 1:
            return super().dataset_id(source_ids)
        text = json.dumps({"mixture_algo": 1, "schedule": self.sched.schedule_id(), "samples_per_epoch": self.spe,
                           "sources": list(source_ids)}, sort_keys=True)
        return "mixture:" + hashlib.sha256(text.encode()).hexdigest()[:32]

    def state_dict(self, source_ids, epoch, cursor, seq_len=0, origin=None) -> dict:
        first = epoch * self.length if origin is None else origin
        g = first + cursor
        d = state_dict(self.dataset_id(source_ids), self.seed, epoch, cursor, self.g, self.order, self.window_pages,
                       self.drop_last, seq_len=seq_len, window_records=self.window_records)
        stage = max(j for j, s in enumerate(self.sched.starts) if s <= g)
        d["mixture"] = {"mixture_algo": 1, "quotas": list(self.sched.stage_quotas[stage]),
                        "samples_per_epoch": self.spe,
                        "sources": [{"dataset_id": sid, "epoch": e, "cursor": c}
                                    for sid, (e, c) in zip(source_ids, self.cursors(g))]}
        if len(self.sched.starts) > 1:
            d["mixture"]["schedule"] = {"id": self.sched.schedule_id(), "stage": stage}
        if self.edits:
            d["mixture"]["base"] = {"position": self.sched.edit_at, "counts": self.sched.counts(self.sched.edit_at)}
            d["mixture"]["edits"] = list(self.edits)
        if first != epoch * self.length:
            d["mixture"]["origin"] = first
        return d
