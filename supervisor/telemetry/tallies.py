"""Counters and histograms of what every request does, kept as plain numbers on the event loop
and turned into Prometheus families when /metrics is scraped (prometheus_client's documented
custom-collector API: CounterMetricFamily, HistogramMetricFamily). prometheus_client's own
Counter and Histogram take a lock, and a Python loop over the buckets, for each observation:
seven of them on every request. Here an observation is a dict lookup and an addition; the
families are built only when scraped, on the loop too (Metrics.render), so nothing races."""

from __future__ import annotations

from bisect import bisect_left

from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily


class CounterTally:
    """One counter family: a value per tuple of label values."""

    __slots__ = ("name", "doc", "labels", "values")

    def __init__(self, name: str, doc: str, labels: list[str]) -> None:
        self.name, self.doc, self.labels = name, doc, labels
        self.values: dict[tuple[str, ...], float] = {}

    def inc(self, key: tuple[str, ...], amount: float = 1) -> None:
        self.values[key] = self.values.get(key, 0) + amount

    def family(self) -> CounterMetricFamily:
        family = CounterMetricFamily(self.name, self.doc, labels=self.labels)
        for key, value in self.values.items():
            family.add_metric(list(key), value)
        return family


class HistogramTally:
    """One histogram family: per tuple of label values, a count per bucket (an observation goes
    in the first bucket whose upper bound it does not pass, as Prometheus's `le`) and the sum."""

    __slots__ = ("name", "doc", "labels", "bounds", "les", "children")

    def __init__(self, name: str, doc: str, labels: list[str], bounds: tuple[float, ...]) -> None:
        self.name, self.doc, self.labels = name, doc, labels
        self.bounds = tuple(float(b) for b in bounds)
        self.les = [repr(b) for b in self.bounds] + ["+Inf"]  # "0.005", "1.0": as prometheus_client writes them
        self.children: dict[tuple[str, ...], list] = {}  # key -> [count per bucket ..., +Inf's, sum]

    def observe(self, key: tuple[str, ...], value: float) -> None:
        child = self.children.get(key)
        if child is None:
            child = self.children[key] = [0] * len(self.les) + [0.0]
        child[bisect_left(self.bounds, value)] += 1
        child[-1] += value

    def family(self) -> HistogramMetricFamily:
        family = HistogramMetricFamily(self.name, self.doc, labels=self.labels)
        for key, child in self.children.items():
            cumulative, buckets = 0, []
            for le, count in zip(self.les, child):
                cumulative += count
                buckets.append((le, cumulative))
            family.add_metric(list(key), buckets, sum_value=child[-1])
        return family


class Tallies:
    """A collector (CollectorRegistry.register) of the tallies given."""

    def __init__(self, *tallies: CounterTally | HistogramTally) -> None:
        self.tallies = tallies

    def describe(self):
        return [t.family() for t in self.tallies]  # names only: the registry checks them for clashes

    def collect(self):
        for tally in self.tallies:
            yield tally.family()
