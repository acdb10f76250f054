"""Planner estimates against published deployment figures (the planner's "peer").

    .venv/bin/python bench/bench_plan_validate.py

Prints a markdown table (one row per published figure, ratio = estimate / published; goal
0.5x-2x) and writes bench/results/plan_validation.json atomically. Deterministic: no timing.
"""

from __future__ import annotations

from common import markdown_table, write_result

from deltamoe.plan.validate import HIGH, LOW, run_validation


def main() -> None:
    rows = run_validation()
    table = markdown_table(
        ["figure", "setup", "metric", "published", "estimate", "ratio", "note"],
        [[r.system, r.setup, r.metric, f"{r.published:,.2f}", f"{r.estimate:,.2f}",
          f"{r.ratio:.2f}" + ("" if r.within else " (outlier)"), r.note or "-"] for r in rows])
    print(table)
    inside = sum(r.within for r in rows)
    print(f"\n{inside}/{len(rows)} rows within {LOW}x-{HIGH}x")
    path = write_result("plan_validation", {"goal": [LOW, HIGH], "within": inside, "rows": [r.to_json() for r in rows]})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
