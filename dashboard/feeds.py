"""Live inputs of the dashboard: the latest alerts and refusals from Kafka, scraped metrics."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable
from typing import Any, Generic, TypeVar

import httpx
from aiokafka.errors import KafkaError
from pydantic import BaseModel, ValidationError

from spendgate.dashboard.views import Scrape, parse_scrape, rates
from spendgate.schemas import kafka_connect
from spendgate.schemas.kafka_connect import KafkaConnection
from spendgate.streams.kafka_util import assign, partitions, stop

logger = logging.getLogger(__name__)

M = TypeVar("M", bound=BaseModel)


class TopicFeed(Generic[M]):
    """Keeps the latest ``size`` records of a topic (each parsed as ``model``), following
    it; starts ``size`` records back from the end of each partition. A topic that does
    not exist yet is looked for again every few seconds. With ``identity``, a record
    whose identity is already kept is skipped (a refusal retried by its client)."""

    def __init__(
        self,
        kafka: KafkaConnection,
        topic: str,
        model: type[M],
        size: int,
        identity: Callable[[M], str] | None = None,
    ) -> None:
        self.kafka = kafka
        self.topic = topic
        self.model = model
        self.identity = identity
        self.items: deque[M] = deque(maxlen=size)
        self._kept: set[str] = set()

    async def run(self) -> None:
        """Follow the topic until cancelled, reconnecting after broker errors."""
        while True:
            try:
                await self._follow()
            except (KafkaError, OSError) as exc:
                logger.warning("dashboard: reading %s failed (%s); retrying", self.topic, exc)
            await asyncio.sleep(2.0)

    async def _follow(self) -> None:
        consumer = kafka_connect.consumer(self.kafka, enable_auto_commit=False)
        await consumer.start()
        try:
            tps = await partitions(consumer, self.topic)
            if not tps:
                return  # not created yet
            await assign(consumer, tps)
            # Read again from ``size`` back: what was kept before a reconnect comes again.
            self.items.clear()
            self._kept.clear()
            ends = await consumer.end_offsets(tps)
            for tp in tps:
                consumer.seek(tp, max(0, ends[tp] - (self.items.maxlen or 0)))
            while True:
                batch = await consumer.getmany(*tps, timeout_ms=500)
                for messages in batch.values():
                    for msg in messages:
                        self.keep(msg.value or b"")
        finally:
            await stop(consumer)

    def keep(self, raw: bytes) -> None:
        """Parse and keep one record (one not of this model is skipped)."""
        try:
            item = self.model.model_validate_json(raw)
        except ValidationError:
            return
        if self.identity is not None:
            ident = self.identity(item)
            if ident in self._kept:
                return
            if len(self.items) == self.items.maxlen:
                self._kept.discard(self.identity(self.items[0]))  # about to leave
            self._kept.add(ident)
        self.items.append(item)


class Scraper:
    """Scrapes the admission's and the worker's ``/metrics`` every ``interval_s``."""

    def __init__(
        self,
        admission_url: str,
        worker_url: str,
        interval_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.urls = (admission_url, worker_url)
        self.interval_s = interval_s
        self.clock = clock
        self.previous: Scrape | None = None
        self.latest: Scrape | None = None
        self.up = {"admission": False, "worker": False}
        self.last_lag: float | None = None

    async def run(self) -> None:
        """Scrape until cancelled."""
        async with httpx.AsyncClient(timeout=max(0.5, self.interval_s)) as http:
            while True:
                await self.scrape(http)
                await asyncio.sleep(self.interval_s)

    async def scrape(self, http: httpx.AsyncClient) -> None:
        """One scrape of both endpoints (one that does not answer reads as ``None``)."""
        texts: list[str | None] = []
        for name, url in zip(self.up, self.urls, strict=True):
            text = None
            with contextlib.suppress(httpx.HTTPError):
                answer = await http.get(url)
                if answer.status_code == 200:
                    text = answer.text
            self.up[name] = text is not None
            texts.append(text)
        self.previous, self.latest = self.latest, parse_scrape(self.clock(), *texts)

    def panel(self) -> dict[str, Any]:
        """The metrics panel's figures (``views.rates``) and which endpoints answered."""
        if self.latest is None:
            return {"up": dict(self.up)}
        panel = rates(self.previous, self.latest)
        # An interval with no record applied has no lag of its own: keep the last one.
        if panel["worker_lag_s"] is None:
            panel["worker_lag_s"] = self.last_lag
        self.last_lag = panel["worker_lag_s"]
        return {**panel, "up": dict(self.up)}
