"""Read budgets for the dashboard from Redis: the utilization index first, windows per page."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import redis.asyncio as aioredis
from pydantic import ValidationError

from spendgate.dashboard.views import KeyRow, key_row, window_series
from spendgate.schemas import window_codec
from spendgate.schemas.layout import Layout
from spendgate.schemas.matching import parse_key
from spendgate.schemas.policies import Policy
from spendgate.schemas.redis_keys import (
    pending_total_key,
    pending_window_key,
    policies_key,
    policies_version_key,
    utilization_key,
    window_key,
)
from spendgate.schemas.shards import tenant_of

Sort = Literal["share", "key", "policy", "tenant"]
#: Index members fetched per call while filtering (names and scores only, no windows).
SCAN_CHUNK = 5_000
#: Rows decoded per page at most.
MAX_PAGE = 200


@dataclass(frozen=True, slots=True)
class Page:
    """One page of budget rows and how many keys match the filter."""

    rows: list[KeyRow]
    matched: int
    offset: int


class BudgetReader:
    """The dashboard's reads of what the worker and admission keep in Redis."""

    def __init__(self, client: aioredis.Redis, prefix: str, layout: Layout | None = None) -> None:
        self.client = client
        self.prefix = prefix
        #: One Redis, or a cluster: then each virtual shard has its own utilization index
        #: and the pages merge them by score.
        self.layout = layout or Layout(prefix)
        self._indexes = tuple(utilization_key(shard) for shard in self.layout.shards())
        self._member = re.compile(
            re.escape(prefix) + (r"\{s\d+\}" if self.layout.cluster else "") + re.escape("w:")
        )
        self._policies: tuple[object, dict[str, Policy]] = (b"-", {})

    async def now_ms(self) -> int:
        """The Redis clock (what admission decides on), in ms."""
        seconds, micros = await self.client.time()
        return int(seconds) * 1000 + int(micros) // 1000

    async def policies(self) -> dict[str, Policy]:
        """The policies in force, re-read only when their version moved."""
        control = self.layout.control
        version = await self.client.get(policies_version_key(control))
        if version != self._policies[0]:
            raw = await self.client.hgetall(policies_key(control))
            found: dict[str, Policy] = {}
            for pid, value in raw.items():
                try:
                    found[_text(pid)] = Policy.model_validate_json(value)
                except ValidationError:
                    continue
            self._policies = (version, found)
        return self._policies[1]

    async def page(
        self,
        may_read: Callable[[str | None], bool],
        *,
        tenant: str | None = None,
        policy: str | None = None,
        sort: Sort = "share",
        descending: bool = True,
        offset: int = 0,
        limit: int = 50,
    ) -> Page:
        """The budgets a reader may see, filtered, sorted and paged.

        Sorted by share (used + reserved over limit), candidates come from the
        utilization index in its order and only the page's windows are decoded; the
        page itself is ordered by the exact share (the index holds each window's share
        when it was last written). Filters read only the index's member names.
        """
        limit = max(1, min(limit, MAX_PAGE))
        policies = await self.policies()
        unfiltered = tenant is None and policy is None and may_read(None)
        if sort == "share" and unfiltered:
            matched = 0
            for index in self._indexes:
                matched += int(await self.client.zcard(index))
            ranked = await self._ranked(offset, limit, descending)
            keys = [self._key(m) for m in ranked]
        else:
            names = await self._matching(policies, may_read, tenant, policy, descending)
            if sort != "share":
                names.sort(key=lambda k: _sort_key(k, sort, policies), reverse=descending)
            matched = len(names)
            keys = names[offset : offset + limit]
        rows = await self._rows(keys, policies)
        if sort == "share":
            rows.sort(key=lambda r: r.share, reverse=descending)
        return Page(rows, matched, offset)

    async def _matching(
        self,
        policies: dict[str, Policy],
        may_read: Callable[[str | None], bool],
        tenant: str | None,
        policy: str | None,
        descending: bool,
    ) -> list[str]:
        """Every indexed key passing the filters, in index order (names and scores only;
        on a cluster the shards' indexes are read in turn and ordered by score)."""
        rng = self.client.zrevrange if descending else self.client.zrange
        out: list[tuple[float, str]] = []
        for index in self._indexes:
            start = 0
            while True:
                chunk: list[Any] = await rng(index, start, start + SCAN_CHUNK - 1, withscores=True)
                for member, score in chunk:
                    key = self._key(member)
                    pid, fields = parse_key(key)
                    p = policies.get(pid)
                    if p is None or (policy is not None and pid != policy):
                        continue
                    owner = tenant_of(p, fields)
                    if not may_read(owner) or (tenant is not None and owner != tenant):
                        continue
                    out.append((float(score), key))
                if len(chunk) < SCAN_CHUNK:
                    break
                start += SCAN_CHUNK
        if len(self._indexes) > 1:
            out.sort(key=lambda item: item[0], reverse=descending)
        return [key for _, key in out]

    async def _ranked(self, start: int, count: int, descending: bool) -> list[object]:
        """Index members by score, ranks ``start`` .. ``start + count - 1`` (on a cluster,
        of every shard's index merged by score)."""
        rng = self.client.zrevrange if descending else self.client.zrange
        if len(self._indexes) == 1:
            return list(await rng(self._indexes[0], start, start + count - 1))
        scored: list[tuple[float, object]] = []
        for index in self._indexes:
            top: list[Any] = await rng(index, 0, start + count - 1, withscores=True)
            scored += ((float(score), member) for member, score in top)
        scored.sort(key=lambda item: item[0], reverse=descending)
        return [member for _, member in scored[start : start + count]]

    def _prefix_of(self, key: str, policies: dict[str, Policy]) -> str:
        """The shard prefix of a budget key's window (the prefix without a cluster)."""
        p = policies.get(parse_key(key)[0])
        if p is None or not self.layout.cluster:
            return self.prefix
        return self.layout.of_key(p, key)

    async def _rows(self, keys: list[str], policies: dict[str, Policy]) -> list[KeyRow]:
        """Decode the windows of ``keys``; a key whose window expired, or whose policy was
        deleted, leaves the index."""
        if not keys:
            return []
        now_ms, held = await self._windows(keys, policies)
        rows: list[KeyRow] = []
        gone: dict[str, list[str]] = {}
        for key, (window, pending) in zip(keys, held, strict=True):
            p = policies.get(parse_key(key)[0])
            if p is None or (window is None and not pending):
                # Its policy was deleted, or its window expired: it leaves the index (a
                # deleted policy's key, of a shard no longer known: every shard's index).
                shards = self.layout.shards() if p is None else (self._prefix_of(key, policies),)
                for shard in shards:
                    gone.setdefault(shard, []).append(window_key(shard, key))
                continue
            rows.append(key_row(key, p, window, pending, now_ms))
        for shard, members in gone.items():
            await self.client.zrem(utilization_key(shard), *members)
        return rows

    async def detail(self, key: str) -> tuple[KeyRow, dict[str, Any]] | None:
        """One key's row and its window over time (``None``: no such key or policy)."""
        policies = await self.policies()
        p = policies.get(parse_key(key)[0])
        if p is None:
            return None
        now_ms, [(window, pending)] = await self._windows([key], policies)
        if window is None and not pending:
            return None
        return key_row(key, p, window, pending, now_ms), window_series(p, window, pending, now_ms)

    async def _windows(
        self, keys: list[str], policies: dict[str, Policy]
    ) -> tuple[int, list[tuple[Any, Any]]]:
        """The Redis clock (ms) and each key's window and pending window, read together
        (on a cluster, one node's clock)."""
        pipe = self.client.pipeline(transaction=False)
        cluster = self.layout.cluster
        if not cluster:
            pipe.time()
        for key in keys:
            shard = self._prefix_of(key, policies)
            pipe.get(window_key(shard, key))
            pipe.hgetall(pending_window_key(shard, key))
            pipe.hgetall(pending_total_key(shard, key))
        replies = list(await pipe.execute())
        clock = await self.client.time() if cluster else replies.pop(0)
        seconds, micros = clock
        now_ms = int(seconds) * 1000 + int(micros) // 1000
        return now_ms, [
            (window, window_codec.pending_fields(v1, v2))
            for window, v1, v2 in zip(replies[::3], replies[1::3], replies[2::3], strict=True)
        ]

    def owner(self, key: str, policies: dict[str, Policy]) -> tuple[bool, str | None]:
        """Whether ``key``'s policy is in force, and the tenant the key belongs to."""
        pid, fields = parse_key(key)
        p = policies.get(pid)
        return (p is not None, tenant_of(p, fields) if p is not None else None)

    def _key(self, member: object) -> str:
        text = _text(member)
        found = self._member.match(text)
        return text[found.end() :] if found else text


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _sort_key(key: str, sort: Sort, policies: dict[str, Policy]) -> tuple[str, str]:
    pid, fields = parse_key(key)
    if sort == "policy":
        return (pid, key)
    if sort == "tenant":
        p = policies.get(pid)
        return ((tenant_of(p, fields) if p else None) or "", key)
    return (key, "")
