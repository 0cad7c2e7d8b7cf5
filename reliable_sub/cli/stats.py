"""``reliable-sub stats SUBSCRIPTION``: what a subscription holds now."""

from __future__ import annotations

import click

from ..ports import Adapter, Inspectable, SubscriptionStats
from .app import USAGE, fail, json_option, print_json, print_table, with_adapter

UNKNOWN = "unknown"


@click.command()
@click.argument("subscription")
@click.option("--dead-letter-subscription", metavar="SUBSCRIPTION",
              help="Also count what waits in this dead-letter queue.")
@json_option
@with_adapter
async def stats(adapter: Adapter, subscription: str, dead_letter_subscription: str | None,
                as_json: bool) -> None:
    """Backlog, in flight, oldest unacked age, ack deadline (and dead letters waiting).

    The lease deadline the consumers use now is theirs: see the reliable_sub.lease.deadline
    metric. Pub/Sub reports backlogs through Cloud Monitoring only: they show as unknown.
    """
    if not isinstance(adapter, Inspectable):
        fail(USAGE, f"{type(adapter).__name__} reports no figures")
    figures = await adapter.subscription_stats(subscription)
    dead: SubscriptionStats | None = None
    if dead_letter_subscription is not None:
        dead = await adapter.subscription_stats(dead_letter_subscription)
    values = {
        "backlog": figures.backlog, "in_flight": figures.in_flight,
        "oldest_unacked_age_seconds": figures.oldest_unacked_age,
        "ack_deadline_seconds": figures.ack_deadline,
        "dead_lettered_waiting": None if dead is None else dead.backlog,
    }
    if as_json:
        print_json({"subscription": subscription, **values})
        return
    shown = {name: UNKNOWN if value is None else value for name, value in values.items()
             if name != "dead_lettered_waiting" or dead is not None}
    print_table(subscription, list(shown), [list(shown.values())])


COMMANDS = [stats]
