"""The request metrics' tallies (supervisor/telemetry/tallies.py) scrape as prometheus_client's own
Counter and Histogram do for the same observations (but their `_created` series)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from supervisor.telemetry.metrics import LATENCY_BUCKETS
from supervisor.telemetry.tallies import CounterTally, HistogramTally, Tallies

LABELS = st.sampled_from(["a", "b", 'quote"and\\slash'])
SECONDS = st.one_of(st.floats(0, 1000, allow_nan=False), st.sampled_from(LATENCY_BUCKETS))


def without_created(text: bytes) -> list[str]:
    return [line for line in text.decode().splitlines() if "_created" not in line]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(LABELS, st.integers(0, 10**6)), max_size=20), st.lists(st.tuples(LABELS, SECONDS), max_size=40))
def test_tallies_scrape_as_prometheus_clients_own_metrics(counts, seconds):
    mine, theirs = CollectorRegistry(auto_describe=True), CollectorRegistry(auto_describe=True)
    counter = CounterTally("llm_pool_things", "Things by model", ["model"])
    histogram = HistogramTally("llm_pool_wait_seconds", "Waits by model", ["model"], LATENCY_BUCKETS)
    mine.register(Tallies(counter, histogram))
    their_counter = Counter("llm_pool_things", "Things by model", ["model"], registry=theirs)
    their_histogram = Histogram("llm_pool_wait_seconds", "Waits by model", ["model"], buckets=LATENCY_BUCKETS,
                                registry=theirs)
    for model, n in counts:
        counter.inc((model,), n)
        their_counter.labels(model).inc(n)
    for model, s in seconds:
        histogram.observe((model,), s)
        their_histogram.labels(model).observe(s)
    assert sorted(without_created(generate_latest(mine))) == sorted(without_created(generate_latest(theirs)))
