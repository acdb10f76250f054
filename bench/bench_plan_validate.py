"""Planner estimates against published deployment figures (the planner's "peer").

    .venv/bin/python bench/bench_plan_validate.py [--quick]

Prints a markdown table (one row per published figure, ratio = estimate / published; goal
0.5x-2x) and writes bench/results/plan_validation.json atomically. Deterministic: no timing.
"""

from __future__ import annotations

import argparse

from common import markdown_table, result_name, write_result

from deltamoe.plan.validate import HIGH, LOW, run_validation


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the same (it is cheap), written to plan_validation_quick.json")
    args = parser.parse_args()
    rows = run_validation()
    table = markdown_table(
        ["figure", "setup", "metric", "published", "estimate", "ratio", "note"],
        [[r.system, r.setup, r.metric, f"{r.published:,.2f}", f"{r.estimate:,.2f}",
          f"{r.ratio:.2f}" + ("" if r.within else " (outlier)"), r.note or "-"] for r in rows])
    print(table)
    inside = sum(r.within for r in rows)
    print(f"\n{inside}/{len(rows)} rows within {LOW}x-{HIGH}x")
    path = write_result(result_name("plan_validation", args.quick), {"goal": [LOW, HIGH], "within": inside, "rows": [r.to_json() for r in rows]})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
