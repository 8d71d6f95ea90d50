"""The skeleton every section measures with: targets x concurrency x rounds, interleaved."""

from __future__ import annotations

from typing import Callable, Iterable

from pool_bench.children import CpuMeter
from pool_bench.load import Round
from pool_bench.report import say


def metered(fn, meters: dict[str, CpuMeter] | None = None) -> Round:
    """Run `fn()` (a load) and record the CPU seconds each meter's processes spent in it."""
    meters = meters or {}
    before = {k: m.total() for k, m in meters.items()}
    r = fn()
    r.cpu_by = {k: m.total() - before[k] for k, m in meters.items()}
    r.cpu = sum(r.cpu_by.values())
    return r


def interleaved(targets: Iterable[str], concs: list[int], rounds: int, measure: Callable[[str, int], Round],
                meters: dict[str, dict[str, CpuMeter]], label: str, unit: str,
                alternate_per_conc: bool = True) -> dict[tuple[str, int], Round]:
    """`measure(target, concurrency)` (one load) for every target at every concurrency, `rounds`
    times, merged per (target, concurrency). Each round runs all targets at one concurrency
    back to back, so both sides of a ratio see the machine in the same state; their order
    alternates (by round, and by concurrency unless `alternate_per_conc` is off) so that
    neither always goes first. `meters[target]` measures the CPU of that target's processes;
    `unit` ("tok/s" or "req/s") is the rate said on stderr after each load."""
    targets = list(targets)
    results = {(t, c): Round() for t in targets for c in concs}
    for rnd in range(rounds):
        for c in concs:
            flip = (rnd + (c if alternate_per_conc else 0)) % 2
            order = targets[::-1] if flip else targets
            for t in order:
                r = metered(lambda: measure(t, c), meters.get(t))
                results[(t, c)].merge(r)
                count = r.tokens if unit == "tok/s" else r.done
                say(f"  {label + ' ' if label else ''}c={c} {t}: {r.done} req, "
                    f"{count / r.wall if r.wall else 0:.0f} {unit}")
    return results
