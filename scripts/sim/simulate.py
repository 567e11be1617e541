"""How routing policies scale: N simulated replicas (each the real Scheduler, scripts/sim/cluster.py) under a Zipf
adapter workload, for 1-64 replicas and 10-10,000 adapters. Prints a markdown table and draws a PNG.

Two sweeps, each at every per-replica offered load in --rates-per-replica (Poisson requests/s; the default is one
load under a replica's capacity and one above it), --requests-per-replica each: replicas 1..64 at --scaling-adapters
adapters, and adapters 10..10,000 at --sweep-replicas replicas. The step
costs are this repository's CPU figures unless --cost-json (scripts/sim/calibrate.py's output) or the --*-ms flags
say otherwise (e.g. GPU figures).

    python -m scripts.sim.simulate --png docs/img/simulator.png
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

from scripts.sim.cluster import ReplicaShape, Result, StepCost, Workload, simulate
from scripts.sim.policies import POLICIES

COST_FLAGS = {f.name: f.name.removesuffix("_s").replace("_", "-") + "-ms" for f in dataclasses.fields(StepCost)}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    parser.add_argument("--adapters", type=int, nargs="+", default=[10, 100, 1000, 10000])
    parser.add_argument("--scaling-adapters", type=int, default=1000, help="adapters in the replica sweep")
    parser.add_argument("--sweep-replicas", type=int, default=16, help="replicas in the adapter sweep")
    parser.add_argument("--policies", nargs="+", default=list(POLICIES), choices=list(POLICIES))
    parser.add_argument(
        "--rates-per-replica",
        type=float,
        nargs="+",
        default=[3.0, 6.0],
        help="requests/s offered per replica (the plot's latency panels use the last)",
    )
    parser.add_argument("--requests-per-replica", type=int, default=100)
    parser.add_argument("--zipf", type=float, default=1.0, help="adapter popularity exponent")
    parser.add_argument("--slots", type=int, default=8, help="device adapter slots per replica")
    parser.add_argument("--max-running", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cost-json", help="a StepCost as JSON (scripts/sim/calibrate.py --json)")
    for name, flag in COST_FLAGS.items():
        parser.add_argument(f"--{flag}", type=float, help=f"StepCost.{name} in ms")
    parser.add_argument("--png", help="draw the plot here")
    parser.add_argument("--json", help="write every result here")
    return parser.parse_args(argv)


def step_cost(args: argparse.Namespace) -> StepCost:
    values = dataclasses.asdict(StepCost())
    if args.cost_json:
        values.update(json.loads(Path(args.cost_json).read_text()))
    for name, flag in COST_FLAGS.items():
        given = getattr(args, flag.replace("-", "_"))
        if given is not None:
            values[name] = given / 1e3
    return StepCost(**values)


def run(args: argparse.Namespace, cost: StepCost) -> list[Result]:
    shape = ReplicaShape(num_slots=args.slots, max_running=args.max_running)
    points = sorted({(n, args.scaling_adapters) for n in args.replicas}
                    | {(args.sweep_replicas, a) for a in args.adapters})  # fmt: skip
    results = []
    for rate in args.rates_per_replica:
        for num_replicas, num_adapters in points:
            workload = Workload(num_requests=args.requests_per_replica * num_replicas,
                                rate_per_s=rate * num_replicas, num_adapters=num_adapters, zipf_s=args.zipf,
                                seed=args.seed)  # fmt: skip
            for policy in args.policies:
                start = time.perf_counter()
                results.append(simulate(num_replicas, workload, policy, shape, cost))
                print(f"  {rate:g} req/s per replica, {num_replicas:>3} replicas, {num_adapters:>5} adapters, "
                      f"{policy}: {time.perf_counter() - start:.1f} s", file=sys.stderr)  # fmt: skip
    return results


def offered_per_replica(r: Result) -> float:
    return r.rate_per_s / r.num_replicas


def table(results: list[Result]) -> str:
    lines = ["| req/s offered per replica | replicas | adapters | policy | throughput, tok/s | per replica | "
             "TTFT p50, s | TTFT p99, s | slot misses / request | disk reads |", "|" + "---|" * 10]  # fmt: skip
    for r in results:
        lines.append(f"| {offered_per_replica(r):g} | {r.num_replicas} | {r.num_adapters} | {r.policy} | "
                     f"{r.throughput_tok_s:.0f} | "
                     f"{r.throughput_tok_s / r.num_replicas:.0f} | {r.ttft_p50_s:.2f} | {r.ttft_p99_s:.2f} | "
                     f"{r.slot_misses_per_request:.2f} | {r.host_loads} |")  # fmt: skip
    return "\n".join(lines)


def plot(results: list[Result], args: argparse.Namespace, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib import ticker

    fig, axes = plt.subplots(2, 3, figsize=(16, 9))
    heavy = max(args.rates_per_replica)
    scaling = [r for r in results if r.num_adapters == args.scaling_adapters]
    sweep = [r for r in results if r.num_replicas == args.sweep_replicas and offered_per_replica(r) == heavy]
    colors = dict(zip(args.policies, plt.rcParams["axes.prop_cycle"].by_key()["color"], strict=False))

    def draw(ax, rows, x_name: str, y_name: str, style: str = "-", label: bool = True) -> None:
        for policy in args.policies:
            points = sorted((getattr(r, x_name), getattr(r, y_name)) for r in rows if r.policy == policy)
            ax.plot(*zip(*points, strict=True), style, marker="o", color=colors[policy],
                    label=policy if label else None)  # fmt: skip

    top, bottom = axes
    for rate in sorted(args.rates_per_replica):
        rows = [r for r in scaling if offered_per_replica(r) == rate]
        draw(top[0], rows, "num_replicas", "throughput_tok_s", "-" if rate == heavy else ":", rate == heavy)
    scaling_heavy = [r for r in scaling if offered_per_replica(r) == heavy]
    draw(top[1], scaling_heavy, "num_replicas", "ttft_p99_s")
    draw(top[2], scaling_heavy, "num_replicas", "slot_misses_per_request")
    draw(bottom[0], sweep, "num_adapters", "throughput_tok_s")
    draw(bottom[1], sweep, "num_adapters", "ttft_p99_s")
    draw(bottom[2], sweep, "num_adapters", "slot_misses_per_request")
    for ax, y_label in zip((*top, *bottom), ["output throughput, tok/s", "TTFT p99, s", "slot misses per request"] * 2,
                           strict=True):  # fmt: skip
        ax.set_ylabel(y_label)
        ax.grid(True, which="both", alpha=0.3)
    for ax in top:
        ax.set_xscale("log", base=2)
        ax.set_xlabel("replicas")
        ax.set_title(f"scaling out: {args.scaling_adapters} adapters, {heavy:g} req/s per replica")
    for ax in bottom:
        ax.set_xscale("log")
        ax.set_xlabel("adapters (Zipf)")
        ax.set_title(f"more adapters: {args.sweep_replicas} replicas, {heavy:g} req/s per replica")
    for ax in (top[0], top[1], bottom[1]):
        ax.set_yscale("log")
        ax.yaxis.set_major_locator(ticker.LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
        ax.yaxis.set_major_formatter(ticker.FormatStrFormatter("%g"))
        ax.yaxis.set_minor_formatter(ticker.NullFormatter())
    light = ", ".join(f"{rate:g}" for rate in sorted(args.rates_per_replica) if rate != heavy)
    if light:
        top[0].set_title(f"scaling out: {args.scaling_adapters} adapters (dotted: {light} req/s per replica)")
    top[0].legend(fontsize=8)
    fig.suptitle(f"Simulated cluster, each replica the real Scheduler: Zipf s={args.zipf:g} adapter popularity, "
                 f"{args.slots} adapter slots and {args.max_running} running requests per replica")  # fmt: skip
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> list[Result]:
    args = parse_args(argv)
    cost = step_cost(args)
    print(f"step cost: {cost}", file=sys.stderr)
    results = run(args, cost)
    print(table(results))
    if args.png:
        plot(results, args, args.png)
    if args.json:
        rows = [{**{k: v for k, v in dataclasses.asdict(r).items() if k != "ttft_s"},
                 "throughput_tok_s": r.throughput_tok_s, "ttft_p50_s": r.ttft_p50_s, "ttft_p99_s": r.ttft_p99_s}
                for r in results]  # fmt: skip
        Path(args.json).write_text(json.dumps({"args": vars(args), "cost": dataclasses.asdict(cost), "results": rows},
                                              indent=1))  # fmt: skip
    return results


if __name__ == "__main__":
    main()
