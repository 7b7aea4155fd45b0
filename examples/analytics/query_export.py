"""SQL over a `harnessrl export` folder with DuckDB: a report per run, or any query of your own.

Each table of the export (`spans`, `episodes`, `rollouts`, `weights`, `metrics`) is a view over its
Parquet parts, with `run` and `day` read from the partition folders. Every result row is printed as
one JSON line, `{"query": <name>, <column>: <value>, ...}`.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import duckdb

TABLES = ("spans", "episodes", "rollouts", "weights", "metrics")

# name -> (tables it reads, SQL)
REPORT = {
    "calls": (
        ("spans",),
        """
        SELECT run, count(*) AS calls, count(DISTINCT episode) AS episodes,
               round(avg(prompt_len), 1) AS prompt_tokens_per_call,
               round(avg(len(completions[1].token_ids)), 1) AS completion_tokens_per_call,
               round(avg(latency_s), 3) AS latency_s, min(day) AS first_day, max(day) AS last_day
        FROM spans GROUP BY run ORDER BY run
        """,
    ),
    "outcomes": (
        ("episodes",),
        """
        SELECT run, kind, count(*) AS episodes FROM episodes
        WHERE kind IN ('completed', 'failed') GROUP BY ALL ORDER BY ALL
        """,
    ),
    "tokens_by_reward": (
        ("rollouts", "spans"),
        """
        SELECT run, reward, count(DISTINCT episode) AS episodes,
               round(sum(len(completions[1].token_ids)) / count(DISTINCT episode), 1)
                   AS completion_tokens_per_episode
        FROM rollouts JOIN spans USING (run, episode) GROUP BY ALL ORDER BY ALL
        """,
    ),
    "steps": (
        ("metrics",),
        """
        SELECT run, step, version, round("values"['reward/mean'], 3) AS reward_mean, trained
        FROM metrics ORDER BY run, step
        """,
    ),
    "weights": (
        ("weights",),
        """
        SELECT run, max(version) AS latest_version, count(*) AS published FROM weights
        GROUP BY run ORDER BY run
        """,
    ),
}


def connect(out: Path) -> tuple[duckdb.DuckDBPyConnection, set[str]]:
    """A DuckDB connection with a view per exported table that has parts; the tables it has."""
    con = duckdb.connect()
    present = set()
    for table in TABLES:
        if not any((out / table).glob("*/*/*.parquet")):
            continue
        parts = str(out / table / "*" / "*" / "*.parquet").replace("'", "''")
        # Only our own table names and a quoted path go into the statement (a view takes no parameters).
        con.execute(
            f"CREATE VIEW {table} AS SELECT * FROM read_parquet('{parts}', hive_partitioning = true, "  # noqa: S608
            "hive_types = {'run': VARCHAR, 'day': DATE})"
        )
        present.add(table)
    return con, present


def show(con: duckdb.DuckDBPyConnection, name: str, sql: str) -> None:
    """Print each row of a query as one JSON line."""
    result = con.execute(sql)
    columns = [column[0] for column in result.description]
    for row in result.fetchall():
        print(json.dumps({"query": name, **dict(zip(columns, row, strict=True))}, default=str))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("out", type=Path, help="the folder `harnessrl export --out` wrote")
    parser.add_argument("--sql", default=None, help="run this query instead of the report")
    args = parser.parse_args()
    con, present = connect(args.out)
    if args.sql is not None:
        show(con, "sql", args.sql)
        return
    for name, (tables, sql) in REPORT.items():
        if present.issuperset(tables):
            show(con, name, sql)


if __name__ == "__main__":
    main()
