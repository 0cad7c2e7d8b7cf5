"""Writes ``reliable-sub.json``, the Grafana dashboard, from code (grafana-foundation-sdk).

    python examples/dashboard/generate.py          # rewrite reliable-sub.json
    python examples/dashboard/generate.py --check  # exit 1 if the file differs from the code

Metric names come from :mod:`reliable_sub.telemetry.semconv` as Prometheus stores them
(OpenTelemetry's Prometheus exporter: dots become underscores, seconds gain ``_seconds``,
counters ``_total``), and every query is filtered by the dashboard's variables, so panels,
queries and names stay in one place. ``tests/test_prometheus.py`` runs each query against a
real Prometheus, with the variables substituted.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

from grafana_foundation_sdk.builders import common, prometheus, timeseries
from grafana_foundation_sdk.builders import dashboard as grafana
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models.common import LegendDisplayMode, LegendPlacement
from grafana_foundation_sdk.models.dashboard import (
    DataSourceRef,
    GridPos,
    VariableOption,
    VariableRefresh,
    VariableSort,
)

from reliable_sub.telemetry import semconv as sc

OUTPUT = Path(__file__).resolve().parent / "reliable-sub.json"
DATASOURCE = DataSourceRef(type_val="prometheus", uid="${datasource}")


def series(metric: str, suffix: str = "") -> str:
    """``metric``'s name in Prometheus (``suffix``: ``_total``, ``_seconds``, ...)."""
    return metric.replace(".", "_") + suffix


def label(attribute: str) -> str:
    return attribute.replace(".", "_")


GROUP = label(sc.CONSUMER_GROUP_NAME)
SYSTEM = label(sc.MESSAGING_SYSTEM)
# The filters: consumer metrics by service, system and subscription; the health gauge and the
# publish side by service and system; the outbox by service.
CONSUMER = f'job=~"$job", {SYSTEM}=~"$system", {GROUP}=~"$subscription"'
SERVICE_SYSTEM = f'job=~"$job", {SYSTEM}=~"$system"'
SERVICE = 'job=~"$job"'
RATE = "[$__rate_interval]"

CONSUMED = series(sc.CONSUMED_MESSAGES, "_total")
BUCKETS = series(sc.PROCESS_DURATION, "_seconds_bucket")
SENT = series(sc.SENT_MESSAGES, "_total")
# the variables' choices: what has reported under each filter
SERVICES = (f'{{__name__=~"{CONSUMED}|{SENT}|{series(sc.OUTBOX_BACKLOG)}"}}')


@dataclass(frozen=True)
class Query:
    expr: str
    legend: str


@dataclass(frozen=True)
class Panel:
    title: str
    description: str
    unit: str
    queries: tuple[Query, ...]
    per_subscription: bool = True  # filtered by $subscription (the test checks it holds)


def _rate_by(metric: str, by: str, extra: str = "") -> str:
    return f"sum by ({by}) (rate({metric}{{{CONSUMER}{extra}}}{RATE}))"


def _processing_time(quantile: float) -> Query:
    return Query(f"histogram_quantile({quantile}, sum by (le, {GROUP}) "
                 f"(rate({BUCKETS}{{{CONSUMER}}}{RATE})))",
                 f"p{round(quantile * 100)} {{{{{GROUP}}}}}")


PANELS: tuple[Panel, ...] = (
    Panel("Throughput by outcome",
          "Deliveries per second, by how they ended (reliable_sub.outcome): acked, duplicate, "
          "retried, deferred, dead_lettered, stopped, requeued, ack_refused.",
          "reqps", (Query(_rate_by(CONSUMED, f"{GROUP}, {label(sc.OUTCOME)}"),
                          f"{{{{{GROUP}}}}} {{{{{label(sc.OUTCOME)}}}}}"),)),
    Panel("Backlog at the broker",
          "Messages of the subscription not yet acked (delivered or not), and those delivered "
          "and not yet acked: sampled every TelemetryPolicy.backlog_interval.",
          "short", (
              Query(f"max by ({GROUP}) ({series(sc.SUBSCRIPTION_BACKLOG)}{{{CONSUMER}}})",
                    f"backlog {{{{{GROUP}}}}}"),
              Query(f"max by ({GROUP}) ({series(sc.SUBSCRIPTION_UNACKED)}{{{CONSUMER}}})",
                    f"unacked {{{{{GROUP}}}}}"))),
    Panel("Oldest unacked message",
          "Seconds since the oldest unacked message of the subscription was published (no "
          "point where the broker does not tell, e.g. the Pub/Sub emulator).",
          "s", (Query(f"max by ({GROUP}) "
                      f"({series(sc.SUBSCRIPTION_OLDEST_AGE, '_seconds')}{{{CONSUMER}}})",
                      f"{{{{{GROUP}}}}}"),)),
    Panel("Processing time p50 / p99 vs lease deadline",
          "Handler time per delivery; the lease deadline is the current extension (the p99, "
          "within LeasePolicy's bounds). A p99 near the deadline means redeliveries of "
          "deliveries still running.",
          "s", (_processing_time(0.5), _processing_time(0.99),
                Query(f"max by ({GROUP}) "
                      f"({series(sc.LEASE_DEADLINE_METRIC, '_seconds')}{{{CONSUMER}}})",
                      f"lease deadline {{{{{GROUP}}}}}"))),
    Panel("Attempt on which messages succeeded",
          "Acked messages by their delivery attempt (1 to 10, then >10), over the time range.",
          "short", (Query(f"sum by ({label(sc.ATTEMPT)}) (increase("
                          f"{series(sc.ATTEMPTS, '_total')}{{{CONSUMER}}}[$__range]))",
                          f"attempt {{{{{label(sc.ATTEMPT)}}}}}"),)),
    Panel("Failures by error type",
          "Failed deliveries per second (retried or dead-lettered) by the exception's "
          "qualified class name (error.type; the first 20 per subscription, then _OTHER).",
          "reqps", (Query(_rate_by(CONSUMED, f"{GROUP}, {label(sc.ERROR_TYPE)}",
                                   f', {label(sc.ERROR_TYPE)}!=""'),
                          f"{{{{{GROUP}}}}} {{{{{label(sc.ERROR_TYPE)}}}}}"),)),
    Panel("Dead letters: rejected vs attempts used up",
          "Messages published to the dead-letter topic per second, by why "
          "(reliable_sub.dead_letter.reason): rejected (Reject, a non-retryable error, a body "
          "that does not validate), max-delivery-attempts, unreadable, running-too-long.",
          "reqps", (Query(_rate_by(series(sc.DEAD_LETTERED, "_total"),
                                   f"{GROUP}, {label(sc.DEAD_LETTER_REASON)}"),
                          f"{{{{{GROUP}}}}} {{{{{label(sc.DEAD_LETTER_REASON)}}}}}"),)),
    Panel("Duplicates skipped",
          "Deliveries the dedup store had as completed, acked without running the handler.",
          "reqps", (Query(_rate_by(series(sc.DUPLICATES, "_total"), GROUP),
                          f"{{{{{GROUP}}}}}"),)),
    Panel("Lease extensions",
          "Ack-deadline extensions per second of deliveries whose handlers still run.",
          "reqps", (Query(_rate_by(series(sc.LEASE_EXTENSIONS, "_total"), GROUP),
                          f"{{{{{GROUP}}}}}"),)),
    Panel("In flight",
          "Deliveries received and not yet settled at the broker.",
          "short", (Query(f"sum by ({GROUP}) ({series(sc.INFLIGHT)}{{{CONSUMER}}})",
                          f"{{{{{GROUP}}}}}"),)),
    Panel("Consumers healthy",
          "1 while a Subscriber is running and handling (healthy()), 0 while not.",
          "short", (Query(f"min by (job, instance, {SYSTEM}) "
                          f"({series(sc.CONSUMER_HEALTHY)}{{{SERVICE_SYSTEM}}})",
                          "{{job}} {{instance}}"),), per_subscription=False),
    Panel("Publishes and publish errors",
          "Messages published per second by destination (the adapter's publishes: your own, "
          "dead letters, the outbox relay's), and those that failed, by error.type.",
          "reqps", (
              Query(f"sum by ({label(sc.DESTINATION_NAME)}) "
                    f"(rate({SENT}{{{SERVICE_SYSTEM}}}{RATE}))",
                    f"{{{{{label(sc.DESTINATION_NAME)}}}}}"),
              Query(f"sum by ({label(sc.DESTINATION_NAME)}, {label(sc.ERROR_TYPE)}) "
                    f'(rate({SENT}{{{SERVICE_SYSTEM}, {label(sc.ERROR_TYPE)}!=""}}{RATE}))',
                    f"failed {{{{{label(sc.DESTINATION_NAME)}}}}} "
                    f"{{{{{label(sc.ERROR_TYPE)}}}}}")),
          per_subscription=False),
    Panel("Publish time p99",
          "Seconds per publish operation (one message, or one publish_many batch), p99.",
          "s", (Query(f"histogram_quantile(0.99, sum by (le, {label(sc.DESTINATION_NAME)}) (rate("
                      f"{series(sc.OPERATION_DURATION, '_seconds_bucket')}"
                      f"{{{SERVICE_SYSTEM}}}{RATE})))",
                      f"{{{{{label(sc.DESTINATION_NAME)}}}}}"),), per_subscription=False),
    Panel("Outbox backlog",
          "Committed outbox rows not yet published, and rows parked after max_attempts.",
          "short", (
              Query(f"max by ({label('reliable_sub.outbox.table')}) "
                    f"({series(sc.OUTBOX_BACKLOG)}{{{SERVICE}}})",
                    "pending {{reliable_sub_outbox_table}}"),
              Query(f"max by ({label('reliable_sub.outbox.table')}) "
                    f"({series(sc.OUTBOX_PARKED)}{{{SERVICE}}})",
                    "parked {{reliable_sub_outbox_table}}")), per_subscription=False),
    Panel("Oldest unpublished outbox row",
          "Age of the oldest committed row not yet published (0 when there is none).",
          "s", (Query(f"max by ({label('reliable_sub.outbox.table')}) "
                      f"({series(sc.OUTBOX_OLDEST_AGE, '_seconds')}{{{SERVICE}}})",
                      "{{reliable_sub_outbox_table}}"),), per_subscription=False),
)


def _variable(name: str, text: str, query: str) -> grafana.QueryVariable:
    return (grafana.QueryVariable(name).label(text).datasource(DATASOURCE).query(query)
            .refresh(VariableRefresh.ON_TIME_RANGE_CHANGED).sort(VariableSort.ALPHABETICAL_ASC)
            .multi(True).include_all(True).all_value(".*")
            .current(VariableOption(selected=True, text="All", value="$__all")))


VARIABLES = (
    ("job", "Service", f"label_values({SERVICES}, job)"),
    ("system", "messaging.system", f'label_values({CONSUMED}{{job=~"$job"}}, {SYSTEM})'),
    ("subscription", "Subscription",
     f'label_values({CONSUMED}{{job=~"$job", {SYSTEM}=~"$system"}}, {GROUP})'),
)


def build() -> dict[str, object]:
    """The dashboard, as Grafana's JSON model."""
    board = (grafana.Dashboard("reliable-sub").uid("reliable-sub").tags(["reliable-sub",
                                                                          "messaging"])
             .editable().time("now-1h", "now").refresh("30s")
             .with_variable(grafana.DatasourceVariable("datasource").label("Prometheus")
                            .type("prometheus")))
    for name, text, query in VARIABLES:
        board = board.with_variable(_variable(name, text, query))
    for number, panel in enumerate(PANELS):
        chart = (timeseries.Panel().id(number + 1).title(panel.title)
                 .description(panel.description).unit(panel.unit).datasource(DATASOURCE)
                 .grid_pos(GridPos(h=8, w=12, x=12 * (number % 2), y=8 * (number // 2)))
                 .legend(common.VizLegendOptions().show_legend(True)
                         .display_mode(LegendDisplayMode.LIST)
                         .placement(LegendPlacement.BOTTOM)))
        for ref, query in zip("ABCDEFGH", panel.queries, strict=False):
            chart = chart.with_target(prometheus.Dataquery().expr(query.expr)
                                      .legend_format(query.legend).ref_id(ref)
                                      .datasource(DATASOURCE))
        board = board.with_panel(chart)
    encoded = json.dumps(board.build(), cls=JSONEncoder, sort_keys=True)
    result: dict[str, object] = json.loads(encoded)
    return result


def render() -> str:
    return json.dumps(build(), indent=2, sort_keys=True) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true",
                        help="exit 1 if reliable-sub.json is not what the code generates")
    arguments = parser.parse_args()
    text = render()
    if arguments.check:
        if OUTPUT.read_text() != text:
            print(f"{OUTPUT.name} is stale: run python examples/dashboard/generate.py",
                  file=sys.stderr)
            return 1
        return 0
    OUTPUT.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
