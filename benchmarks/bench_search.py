"""Search benchmark: does ``runtime.search_tool_docs`` find the right tool for plain words?

Starts four real MCP servers through the bridge's own client pool (ClientPool + SandboxAPI,
in this process; no container: the ranking runs on the host): server-everything,
server-filesystem and server-memory (npm, installed by scripts/setup.sh under
.cache/mcp-servers) and mcp-server-time (PyPI, in .venv). Their aliases are the names a
user's config gives them: everything, filesystem, memory, time. Then, for each of the
QUERIES below (written the way a model writes them), it asks SandboxAPI.search_tool_docs for
every hit (limit 50) and prints the rank of the expected tool, the top hit and its score,
and how many queries ranked their tool first and in the top 3. tests/test_search.py runs
the same queries through a real bridge and container.

With --catalogue it starts nothing: it ranks, in this process (index_tools, rank_tools, as
SandboxAPI does), the tool lists of benchmarks/search_catalogs.json, thirteen servers in one
catalogue (GitHub, Slack, fetch, Puppeteer, Playwright, Postgres, SQLite, git, Brave
Search and the four above), for its query sets: "dev" (the search may be tuned on it),
"held_out" (measured, never tuned on) and "ten" (the QUERIES below, among all thirteen).
Per set: each query's rank of its expected tool, the top hit, and the counts ranked first
and in the top 3. tests/test_search.py asserts floors on the same counts.

With --eval it ranks the fair evaluation set of benchmarks/search_eval/ (38 real servers'
tool lists as they serve them, 544 queries written blind from the catalogs alone, split
into dev and held-out before any tuning): top-1, top-3 and MRR on each split, for the
bridge's ranking and, side by side, for a baseline from the standard library (SQLite FTS5,
porter tokenizer, bm25 over the tool's name, description and parameter names), and the
time per search. Tune on dev only; held-out is for reporting.

It is a measurement, not a test: it always exits 0 (problems are listed under the table).
Usage:

    .venv/bin/python benchmarks/bench_search.py [--verbose]
    .venv/bin/python benchmarks/bench_search.py --catalogue [--set dev] [--counts-only]
    .venv/bin/python benchmarks/bench_search.py --eval
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio

from mcp_server_code_execution_mode import (
    MAX_SEARCH_LIMIT,
    BridgeConfig,
    ClientPool,
    DiscoveryResult,
    IndexedTool,
    SandboxAPI,
    ServerSpec,
    ToolIndex,
    index_tools,
    rank_tools,
    server_tokens,
)

REPO = Path(__file__).resolve().parent.parent
NPM_BIN = REPO / ".cache" / "mcp-servers" / "node_modules" / ".bin"
START_DEADLINE_S = 120.0
CATALOGUE = REPO / "benchmarks" / "search_catalogs.json"
CATALOGUE_SETS = ("dev", "held_out", "ten")


@dataclass(frozen=True)
class Query:
    text: str
    server: str  # the alias
    tools: tuple[str, ...]  # the right tool; two where either is the right call


# Ten requests as a model phrases them, two or three per server; the right tool is the
# one a person who knows the servers would call.
QUERIES = (
    # a person not in the graph yet: create_entities (with observations); one already
    # there: add_observations
    Query("remember a fact about a person", "memory", ("create_entities", "add_observations")),
    Query("what time is it in Tokyo", "time", ("get_current_time",)),
    Query("convert time between time zones", "time", ("convert_time",)),
    Query("list files in a folder", "filesystem", ("list_directory",)),
    Query("read a text file", "filesystem", ("read_text_file",)),
    Query("save text to a file", "filesystem", ("write_file",)),
    Query("add two numbers", "everything", ("get-sum",)),
    Query("show the environment variables", "everything", ("get-env",)),
    Query("search my memory for a person", "memory", ("search_nodes",)),
    Query("forget everything about a person", "memory", ("delete_entities",)),
)


def server_specs(workdir: Path) -> list[ServerSpec]:
    """The four servers, as discovery would configure them; files and memory in `workdir`."""
    files = workdir / "files"
    files.mkdir(exist_ok=True)
    commands = {
        "everything": [str(NPM_BIN / "mcp-server-everything")],
        "filesystem": [str(NPM_BIN / "mcp-server-filesystem"), str(files)],
        "memory": [str(NPM_BIN / "mcp-server-memory")],
        "time": [str(Path(sys.executable).parent / "mcp-server-time")],
    }
    missing = [argv[0] for argv in commands.values() if not Path(argv[0]).exists()]
    if missing:
        raise FileNotFoundError("not installed (run scripts/setup.sh): %s" % ", ".join(missing))
    env = {"MEMORY_FILE_PATH": str(workdir / "memory.jsonl")}
    return [
        ServerSpec(name, name, "stdio", argv[0], tuple(argv[1:]), env=env if name == "memory" else {})
        for name, argv in sorted(commands.items())
    ]


@dataclass(frozen=True)
class Outcome:
    text: str  # the query
    expected: str  # "server.tool", or "server.a / b" for either of two
    rank: int | None  # 1-based; None: not among the hits
    top: str  # "server.tool"
    score: float
    lines: tuple[str, ...] = ()  # the first hits as runtime.search_tool_docs(query) shows them


def rank_of(query: Query, hits: Sequence[dict[str, Any]]) -> int | None:
    for rank, hit in enumerate(hits, 1):
        if hit["server"] == query.server and hit["tool"] in query.tools:
            return rank
    return None


def counts(outcomes: Sequence[Outcome]) -> tuple[int, int]:
    """How many queries ranked their tool first, and in the top 3."""
    first = sum(1 for o in outcomes if o.rank == 1)
    return first, sum(1 for o in outcomes if o.rank is not None and o.rank <= 3)


async def measure(workdir: Path) -> tuple[list[Outcome], list[str]]:
    config = BridgeConfig(state_dir=workdir / "state")
    discovery = DiscoveryResult(tuple(server_specs(workdir)), (), ())
    outcomes: list[Outcome] = []
    async with anyio.create_task_group() as group:
        pool = ClientPool(discovery, config, group)
        try:
            api = SandboxAPI(pool, config)
            with anyio.fail_after(START_DEADLINE_S):  # the first search starts every server
                await api.search_tool_docs("start", 1)
            failures = [
                "%s: %s" % (alias, client.failure)
                for alias, client in pool.clients.items()
                if not client.running
            ]
            for query in QUERIES:
                hits: Any = (await api.search_tool_docs(query.text, MAX_SEARCH_LIMIT, "summary"))["hits"]
                lines: Any = (await api.search_tool_docs(query.text, 3, "line"))["hits"]
                top = "%s.%s" % (hits[0]["server"], hits[0]["tool"]) if hits else "(none)"
                score = hits[0]["score"] if hits else 0.0
                expected = "%s.%s" % (query.server, " / ".join(query.tools))
                outcomes.append(Outcome(query.text, expected, rank_of(query, hits), top, score, tuple(lines)))
        finally:
            await pool.aclose()
    return outcomes, failures


# --- the catalogue: many servers' tool lists, ranked in this process ------------------


@dataclass(frozen=True)
class CatalogueQuery:
    text: str
    expected: tuple[str, ...]  # "alias.tool"; any of them is the right call


def load_catalogue(path: Path = CATALOGUE) -> tuple[ToolIndex, dict[str, list[CatalogueQuery]]]:
    """The catalogue's tools indexed as SandboxAPI indexes a server's (its alias, name and
    title, and its instructions, as server_tokens), and its query sets by name, "ten"
    being QUERIES."""
    data = json.loads(path.read_text(encoding="utf-8"))
    indexed: list[IndexedTool] = []
    for server in data["servers"]:
        alias = server["alias"]
        names = [alias, server.get("name"), server.get("title")]
        about = server_tokens(names, server.get("instructions", ""))
        indexed += index_tools(((alias, tool) for tool in server["tools"]), {alias: about})
    sets = {
        name: [CatalogueQuery(q["query"], tuple(q["expected"])) for q in data[name]]
        for name in ("dev", "held_out")
    }
    sets["ten"] = [
        CatalogueQuery(q.text, tuple("%s.%s" % (q.server, tool) for tool in q.tools)) for q in QUERIES
    ]
    return ToolIndex(indexed), sets


def rank_catalogue(indexed: ToolIndex, queries: Sequence[CatalogueQuery]) -> list[Outcome]:
    """Each query's outcome over the whole catalogue (every hit, up to MAX_SEARCH_LIMIT)."""
    outcomes: list[Outcome] = []
    for query in queries:
        hits = rank_tools(query.text, indexed, MAX_SEARCH_LIMIT)
        names = ["%s.%s" % (alias, tool.get("name")) for _, alias, tool in hits]
        rank = next((i for i, name in enumerate(names, 1) if name in query.expected), None)
        top, score = (names[0], hits[0][0]) if hits else ("(none)", 0.0)
        outcomes.append(Outcome(query.text, " / ".join(query.expected), rank, top, score))
    return outcomes


def search_times(indexed: ToolIndex, queries: Sequence[CatalogueQuery]) -> list[float]:
    """Seconds each query's search takes over the whole catalogue (tests only guard
    against a blow-up; the time per search is measured here)."""
    times = []
    for query in queries:
        started = time.perf_counter()
        rank_tools(query.text, indexed, MAX_SEARCH_LIMIT)
        times.append(time.perf_counter() - started)
    return times


def print_catalogue(sets: Sequence[str], counts_only: bool) -> None:
    indexed, queries = load_catalogue()
    servers = len({entry.alias for entry in indexed.tools})
    print("catalogue: %d tools of %d servers (%s)\n" % (len(indexed.tools), servers, CATALOGUE.name))
    for name in sets:
        outcomes = rank_catalogue(indexed, queries[name])
        first, top3 = counts(outcomes)
        if not counts_only:
            print("%s:\n%s\n" % (name, render_table(outcomes)))
        total = len(outcomes)
        print("%s: ranked first %d/%d, in the top 3 %d/%d\n" % (name, first, total, top3, total))
    times = sorted(search_times(indexed, [query for name in sets for query in queries[name]]))
    if times:
        p95 = times[int(0.95 * (len(times) - 1))]
        print(
            "time per search over %d tools: median %.1f ms, p95 %.1f ms (%d searches)"
            % (len(indexed.tools), 1000 * statistics.median(times), 1000 * p95, len(times))
        )


# --- the fair evaluation: search_eval's catalogs and blind queries, against FTS5 -------------

EVAL_DIR = REPO / "benchmarks" / "search_eval"


def eval_tools() -> tuple[ToolIndex, list[tuple[str, dict[str, Any]]]]:
    """search_eval's tools, indexed as the bridge indexes them, and as (alias, tool) pairs."""
    data = json.loads((EVAL_DIR / "catalogs.json").read_text(encoding="utf-8"))
    indexed: list[IndexedTool] = []
    pairs: list[tuple[str, dict[str, Any]]] = []
    for server in data["servers"]:
        alias = server["alias"]
        about = server_tokens(
            [alias, server.get("name"), server.get("title")], server.get("instructions", "")
        )
        indexed += index_tools(((alias, tool) for tool in server["tools"]), {alias: about})
        pairs += [(alias, tool) for tool in server["tools"]]
    return ToolIndex(indexed), pairs


class Fts5Baseline:
    """The standard library's own full-text search over the same tools: SQLite FTS5 with
    the porter tokenizer, bm25 over the name (split on _ - and case), the description and
    the parameter names; the query's words OR-ed."""

    def __init__(self, pairs: Sequence[tuple[str, dict[str, Any]]]) -> None:
        import re
        import sqlite3

        self.db = sqlite3.connect(":memory:")
        self.db.execute(
            "CREATE VIRTUAL TABLE tools USING "
            "fts5(key UNINDEXED, name, description, params, tokenize='porter')"
        )
        for alias, tool in pairs:
            name = str(tool.get("name", ""))
            words = re.sub(r"([a-z])([A-Z])", r"\1 \2", name).replace("_", " ").replace("-", " ")
            schema = tool.get("inputSchema") or {}
            params = " ".join(str(key).replace("_", " ") for key in (schema.get("properties") or {}))
            self.db.execute(
                "INSERT INTO tools VALUES (?, ?, ?, ?)",
                (
                    "%s.%s" % (alias, name),
                    "%s %s" % (alias, words),
                    str(tool.get("description") or ""),
                    params,
                ),
            )

    def rank(self, query: str, limit: int = MAX_SEARCH_LIMIT) -> list[str]:
        import re

        words = [word for word in re.findall(r"[A-Za-z0-9]+", query.lower()) if len(word) > 1]
        if not words:
            return []
        match = " OR ".join('"%s"' % word for word in words)
        rows = self.db.execute(
            "SELECT key FROM tools WHERE tools MATCH ? ORDER BY bm25(tools, 0, 2.0, 1.0, 0.5) LIMIT ?",
            (match, limit),
        )
        return [row[0] for row in rows]


def rank_names(index: ToolIndex, query: str) -> list[str]:
    """The bridge's hits for a query over the index, as "alias.tool", best first."""
    hits = rank_tools(query, index, MAX_SEARCH_LIMIT)
    return ["%s.%s" % (alias, tool.get("name")) for _, alias, tool in hits]


def eval_figures(
    ranked: Sequence[Sequence[str]], queries: Sequence[dict[str, Any]]
) -> tuple[float, float, float]:
    """top-1, top-3 (fractions) and MRR of ``ranked`` (each query's hits, best first)."""
    ranks = []
    for hits, query in zip(ranked, queries, strict=True):
        expected = set(query["expected"])
        ranks.append(next((i for i, name in enumerate(hits, 1) if name in expected), None))
    n = len(ranks) or 1
    top1 = sum(1 for r in ranks if r == 1) / n
    top3 = sum(1 for r in ranks if r is not None and r <= 3) / n
    mrr = sum(1 / r for r in ranks if r is not None) / n
    return top1, top3, mrr


def print_eval() -> None:
    indexed, pairs = eval_tools()
    queries = json.loads((EVAL_DIR / "queries.json").read_text(encoding="utf-8"))
    baseline = Fts5Baseline(pairs)
    servers = len({entry.alias for entry in indexed.tools})
    print(
        "search_eval: %d tools of %d servers; dev %d, held-out %d queries (written blind)\n"
        % (len(indexed.tools), servers, len(queries["dev"]), len(queries["held_out"]))
    )
    print("%-10s %-16s %7s %7s %7s" % ("set", "ranking", "top-1", "top-3", "MRR"))
    times: list[float] = []
    for name in ("dev", "held_out"):
        texts = [query["query"] for query in queries[name]]
        ours = []
        for text in texts:
            started = time.perf_counter()
            ours.append(rank_names(indexed, text))
            times.append(time.perf_counter() - started)
        for label, ranked in (("bridge", ours), ("FTS5 baseline", [baseline.rank(text) for text in texts])):
            top1, top3, mrr = eval_figures(ranked, queries[name])
            print("%-10s %-16s %6.1f%% %6.1f%% %7.3f" % (name, label, 100 * top1, 100 * top3, mrr))
    # The bound is per search over 300 tools: the first 300 of the catalogue.
    smaller = ToolIndex(indexed.tools[:300])
    times_300 = []
    for query in queries["dev"] + queries["held_out"]:
        started = time.perf_counter()
        rank_names(smaller, query["query"])
        times_300.append(time.perf_counter() - started)
    print()
    for tools, measured in ((len(indexed.tools), times), (300, times_300)):
        measured.sort()
        print(
            "time per search over %d tools (the bridge's ranking): median %.1f ms, p95 %.1f ms"
            % (tools, 1000 * statistics.median(measured), 1000 * measured[int(0.95 * (len(measured) - 1))])
        )


def render_table(outcomes: Sequence[Outcome]) -> str:
    header = ["#", "query", "expected", "rank", "top hit (score)"]
    rows = [
        [
            str(i),
            o.text,
            o.expected,
            str(o.rank) if o.rank else "-",
            "%s (%.2f)" % (o.top, o.score),
        ]
        for i, o in enumerate(outcomes, 1)
    ]
    widths = [max(len(line[i]) for line in [header, *rows]) for i in range(len(header))]

    def fmt(line: list[str]) -> str:
        return "  ".join(
            cell.rjust(w) if i in (0, 3) else cell.ljust(w)
            for i, (cell, w) in enumerate(zip(line, widths, strict=True))
        ).rstrip()

    return "\n".join([fmt(header), "  ".join("-" * w for w in widths), *(fmt(row) for row in rows)])


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--verbose", action="store_true", help="also print each query's first three lines")
    parser.add_argument(
        "--catalogue",
        action="store_true",
        help="rank the query sets of %s instead (no server started)" % CATALOGUE.name,
    )
    parser.add_argument(
        "--set", action="append", choices=CATALOGUE_SETS, help="with --catalogue: only this set (repeatable)"
    )
    parser.add_argument(
        "--counts-only", action="store_true", help="with --catalogue: only the counts (no per-query table)"
    )
    parser.add_argument(
        "--eval",
        action="store_true",
        help="the fair evaluation set (benchmarks/search_eval): dev and held-out, against an FTS5 baseline",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.eval:
        print_eval()
        return 0
    if args.catalogue:
        print_catalogue(args.set or CATALOGUE_SETS, args.counts_only)
        return 0
    with tempfile.TemporaryDirectory(prefix="bench-search-") as tmp:
        try:
            outcomes, problems = anyio.run(measure, Path(tmp))
        except Exception as exc:  # a measurement: report and exit 0
            print("search benchmark failed: %s: %s" % (type(exc).__name__, exc))
            return 0
    print(render_table(outcomes))
    first, top3 = counts(outcomes)
    print(
        "\nranked first: %d/%d (target >= 8)   in the top 3: %d/%d"
        % (first, len(outcomes), top3, len(outcomes))
    )
    if args.verbose:
        for o in outcomes:
            print("\n>>> runtime.search_tool_docs(%r, limit=3)" % o.text)
            print("\n".join(o.lines))
    if problems:
        print("\nproblems:")
        for problem in problems:
            print("- %s" % problem)
    return 0


if __name__ == "__main__":
    sys.exit(main())
