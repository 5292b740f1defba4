"""Read alerts back from the alerts topic (``spendgate alerts tail``)."""

from __future__ import annotations

from collections.abc import AsyncIterator

from pydantic import ValidationError

from spendgate.schemas import kafka_connect
from spendgate.schemas.alerts import Alert
from spendgate.schemas.kafka_connect import KafkaConnection
from spendgate.streams.kafka_util import assign, partitions, stop


async def read_alerts(
    kafka: KafkaConnection, topic: str, *, from_beginning: bool, follow: bool
) -> AsyncIterator[Alert]:
    """Yield alerts in topic order; stop at the current end unless ``follow``."""
    consumer = kafka_connect.consumer(kafka, enable_auto_commit=False)
    await consumer.start()
    try:
        tps = await partitions(consumer, topic)
        if not tps:
            return
        await assign(consumer, tps)
        end = await consumer.end_offsets(tps)
        if from_beginning:
            await consumer.seek_to_beginning(*tps)
        else:
            await consumer.seek_to_end(*tps)
        while True:
            positions = {tp: await consumer.position(tp) for tp in tps}
            if not follow and all(positions[tp] >= end[tp] for tp in tps):
                return
            batch = await consumer.getmany(*tps, timeout_ms=500)
            for messages in batch.values():
                for msg in messages:
                    try:
                        yield Alert.model_validate_json(msg.value or b"")
                    except ValidationError:
                        continue  # not ours; the topic may be shared
    finally:
        await stop(consumer)


def describe(alert: Alert) -> str:
    """One readable line for a terminal."""
    soon = alert.exhausts_in_seconds
    what = {
        "threshold": f"crossed {alert.threshold:.0%}" if alert.threshold is not None else "",
        "exhausted": "exhausted",
        "reservation_expired": f"reservation {alert.reservation_id} expired, charged in full",
        "store_failure": "store unreachable",
        "overage": f"committed {alert.actual} over an estimate of {alert.estimate}",
        "forecast": "heading for the limit" if soon is None else f"exhausts in {soon}s",
    }[alert.kind]
    share = alert.used / alert.limit
    return (
        f"{alert.at:%Y-%m-%d %H:%M:%S}Z  {alert.kind:<19} {alert.key}  {what}  "
        f"used {alert.used}/{alert.limit} ({share:.0%})  id {alert.alert_id}"
    )
