"""Search by meaning (issue 9, item 6): the query's terms (related words, compounds, phrases,
places) and intent, what servers say about themselves, tool titles and nested parameters
in the index, the ranking, and the one-line hits; the benchmark's query sets over the
catalogue of thirteen servers' tools; then its ten natural-language queries through a
real bridge, a real container and four real servers."""

from __future__ import annotations

import importlib
import json
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from mcp_server_code_execution_mode import (
    _RELATED_WEIGHT,
    MAX_SEARCH_TERMS,
    SearchToolDocsParams,
    query_intent,
    query_terms,
    render_signature,
    render_tool_line,
    search_terms,
    search_tools,
    server_tokens,
)
from tests.conftest import (
    NPM_BIN,
    Engine,
    bridge_client,
    claude_desktop_home,
    proxy_env,
    real_server,
    run_cell,
)

Tool = dict[str, Any]

# The benchmark's queries (benchmarks/bench_search.py), imported by name: benchmarks/ is a
# folder of scripts, not a package mypy checks under this name.
BENCH: Any = importlib.import_module("benchmarks.bench_search")
QUERIES: Sequence[Any] = BENCH.QUERIES


def related(query: str) -> dict[str, Mapping[str, float]]:
    return {term.stem: term.related for term in query_terms(query)}


def names(query: str, tools: Sequence[tuple[str, Mapping[str, Any]]], **kwargs: Any) -> list[str]:
    return [tool["name"] for _, _, tool in search_tools(query, tools, limit=10, **kwargs)]


# ---------------------------------------------------------------- query terms


def test_a_query_word_brings_the_words_of_its_concept() -> None:
    terms = related("remember a folder")
    assert terms["folder"]["directory"] == _RELATED_WEIGHT
    assert terms["remember"]["memory"] == _RELATED_WEIGHT


def test_two_words_also_find_their_compound() -> None:
    timezone, filesystem = search_terms("timezone filesystem")  # as stems: "timezon", ...
    assert related("time zones")["zone"][timezone] == 1.0
    assert related("file system")["system"][filesystem] == 1.0


def test_a_question_phrase_adds_the_concept_it_asks_for() -> None:
    assert search_terms("what time is it") == ["time", "now"]
    assert "current" in related("what time is it")["now"]


def test_a_city_of_the_time_zone_database_finds_time_zones() -> None:
    timezone = search_terms("timezone")[0]
    assert related("the time in Tokyo")["tokyo"][timezone] == _RELATED_WEIGHT
    assert timezone in related("the time in New York")["york"]
    assert timezone not in related("the time in Narnia")["narnia"]


def test_tool_is_a_stop_word() -> None:
    assert search_terms("a tool to add numbers") == search_terms("add numbers")


def test_a_two_word_item_brings_its_concept() -> None:
    assert related("pull request")["request"]["pr"] == _RELATED_WEIGHT
    assert related("open a PR")["pr"]["pull"] == _RELATED_WEIGHT


def test_the_first_verb_or_question_word_tells_the_intent() -> None:
    assert query_intent("comment on an issue") == "create"
    assert query_intent("show the comments on an issue") == "read"
    assert query_intent("what time is it") == "read"
    assert query_intent("please rename a file") == "update"
    assert query_intent("forget everything about a person") == "delete"
    assert query_intent("a file") == ""


def test_query_terms_are_bounded_however_long_the_query() -> None:
    words = " ".join("word%dx" % i for i in range(100_000))
    started = time.perf_counter()
    terms = query_terms(words)
    assert len(terms) == MAX_SEARCH_TERMS
    assert time.perf_counter() - started < 0.5
    assert [term.stem for term in terms] == search_terms(words)


# ---------------------------------------------------------------- what the index holds


NOTES: list[tuple[str, Tool]] = [
    ("kg", {"name": "create_entities", "description": "Create entities in the graph"}),
    ("pages", {"name": "create_page", "description": "Create a page"}),
]


def test_a_server_name_and_instructions_are_searched() -> None:
    servers = {
        "kg": server_tokens(["kg", "memory-server"], "A knowledge graph: what the model should recall"),
        "pages": server_tokens(["pages", "wiki"], ""),
    }
    assert names("remember", NOTES) == []
    assert names("remember", NOTES, servers=servers) == ["create_entities"]
    assert names("wiki", NOTES, servers=servers)[0] == "create_page"


def test_server_instructions_are_indexed_only_up_to_their_cap() -> None:
    tokens = server_tokens([], "x " * 10_000 + "needle")
    assert "needle" not in tokens.about


def test_tool_titles_weigh_like_names() -> None:
    tools: list[tuple[str, Tool]] = [
        ("mail", {"name": "t1", "description": "Mentions an email address once"}),
        ("mail", {"name": "t2", "title": "Send Email"}),
        ("mail", {"name": "t3", "annotations": {"title": "Send Email"}}),
    ]
    assert names("send email", tools)[:2] == ["t2", "t3"]


def test_nested_parameter_names_and_descriptions_are_searched() -> None:
    item = {"type": "object", "properties": {"observations": {"type": "array", "description": "Facts"}}}
    schema = {"type": "object", "properties": {"entities": {"type": "array", "items": item}}}
    tools: list[tuple[str, Tool]] = [("kg", {"name": "create_entities", "inputSchema": schema})]
    assert names("observations", tools) == ["create_entities"]
    assert names("facts", tools) == ["create_entities"]


def test_a_destructive_tool_ranks_lower_unless_the_query_asks_for_a_change() -> None:
    same = {"description": "A note in the notebook"}
    tools: list[tuple[str, Tool]] = [
        ("n", {"name": "a_note", **same, "annotations": {"destructiveHint": True}}),
        ("n", {"name": "b_note", **same}),
    ]
    assert names("note", tools) == ["b_note", "a_note"]
    assert names("change a note", tools) == ["a_note", "b_note"]  # equal scores: alphabetical


def test_a_tool_that_reads_ranks_lower_when_the_query_acts_and_the_other_way_round() -> None:
    tools: list[tuple[str, Tool]] = [
        ("gh", {"name": "get_issue_comments", "annotations": {"readOnlyHint": True}}),
        ("gh", {"name": "add_issue_comment"}),  # no hint: "add" in its name
    ]
    assert names("comment on an issue", tools)[0] == "add_issue_comment"
    assert names("show the comments on an issue", tools)[0] == "get_issue_comments"


def test_a_tool_that_creates_ranks_lower_when_the_query_updates() -> None:
    same = {"description": "A pull request"}
    tools: list[tuple[str, Tool]] = [
        ("gh", {"name": "create_pull_request", **same}),
        ("gh", {"name": "update_pull_request", **same}),
    ]
    assert names("change a pull request", tools)[0] == "update_pull_request"
    assert names("propose a pull request", tools)[0] == "create_pull_request"


def test_show_asks_for_a_list_and_parameter_choices_are_searched() -> None:
    state = {"type": "object", "properties": {"state": {"type": "string", "enum": ["open", "closed"]}}}
    tools: list[tuple[str, Tool]] = [
        ("gh", {"name": "get_issue", "annotations": {"readOnlyHint": True}}),
        ("gh", {"name": "list_issues", "inputSchema": state, "annotations": {"readOnlyHint": True}}),
    ]
    assert names("show the issues", tools)[0] == "list_issues"
    assert names("closed", tools) == ["list_issues"]


def test_a_prefix_every_tool_of_a_server_has_is_not_what_its_tools_do() -> None:
    tools: list[tuple[str, Tool]] = [
        ("chat", {"name": "chat_send"}),
        ("chat", {"name": "chat_read"}),
        ("chat", {"name": "chat_list"}),
        ("fax", {"name": "send_fax"}),  # shorter: first if "chat" counted as half of chat_send
    ]
    assert names("send", tools)[0] == "chat_send"


def test_related_words_find_a_tool_that_never_says_the_query_words() -> None:
    tools: list[tuple[str, Tool]] = [
        ("fs", {"name": "list_directory", "description": "Entries of a directory"}),
        ("fs", {"name": "read_file", "description": "Contents of a file"}),
    ]
    assert names("show what is in a folder", tools) == ["list_directory"]


def test_a_city_ranks_time_zone_tools_first() -> None:
    zone = {"type": "object", "properties": {"timezone": {"type": "string"}}}
    tools: list[tuple[str, Tool]] = [
        ("clock", {"name": "get_current_time", "description": "Current time", "inputSchema": zone}),
        ("files", {"name": "get_file_info", "description": "Creation time of a file"}),
    ]
    assert names("what time is it in Paris", tools)[0] == "get_current_time"


# ---------------------------------------------------------------- one-line hits


def test_a_line_is_the_call_with_its_summary() -> None:
    tool = {"name": "get-sum", "description": "Returns the sum.\nMore.", "inputSchema": {"type": "object"}}
    assert render_tool_line("everything", tool) == "mcp_everything.%s" % render_signature(tool)
    assert render_tool_line("everything", tool).startswith("mcp_everything.get_sum(")


def test_a_line_stays_one_line_whatever_the_schema_holds() -> None:
    schema = {
        "type": "object",
        "properties": {"x": {"$ref": "#/$defs/a\nb"}, "y": {"enum": ["p\u2028q"]}},
        "$defs": {"a\nb": {}},
    }
    tool = {"name": "t\r\n", "description": "first\u2029second\x85third", "inputSchema": schema}
    line = render_tool_line("srv", tool)
    assert len(line.splitlines()) == 1 and line.startswith("mcp_srv.t__(")


def test_search_params_default_to_lines_and_accept_only_the_three_details() -> None:
    assert SearchToolDocsParams.model_validate({"query": "x"}).detail == "line"
    for detail in ("line", "summary", "full"):
        assert SearchToolDocsParams.model_validate({"query": "x", "detail": detail}).detail == detail
    with pytest.raises(ValidationError):
        SearchToolDocsParams.model_validate({"query": "x", "detail": "lines"})


# ---------------------------------------------------------------- many servers: the catalogue

# benchmarks/search_catalogs.json: thirteen servers' tools in one catalogue and two query
# sets (dev: tuned on; held_out: never). The floors are the measured counts (dev 12/16
# first and 16/16 in the top 3, held_out 13/18 and 16/18, ten 10/10 and 10/10) less one
# query each, so a change that loses a query passes and one that loses two fails.
CATALOGUE_FLOORS = {"dev": (11, 15), "held_out": (12, 15), "ten": (9, 9)}


def test_query_sets_find_the_right_tool_among_many_servers() -> None:
    indexed, sets = BENCH.load_catalogue()
    assert len({entry.alias for entry in indexed.tools}) == 13 and len(indexed.tools) >= 100
    assert len(sets["dev"]) >= 15 and len(sets["held_out"]) >= 15
    for name, (first, top3) in CATALOGUE_FLOORS.items():
        outcomes = BENCH.rank_catalogue(indexed, sets[name])
        table = "\n".join("%s: %s (top %s)" % (o.text, o.rank, o.top) for o in outcomes)
        ranked_first, in_top3 = BENCH.counts(outcomes)
        assert ranked_first >= first and in_top3 >= top3, (name, table)


# benchmarks/search_eval: 38 real servers' tool lists (699 tools) and 544 queries written
# blind from them, split into dev (tuned on) and held-out (never tuned on, never looked at
# query by query) before any tuning. The floors are the counts measured when the ranking
# was last changed (held-out: 199/272 first, 234/272 in the top 3; dev 206/272 and
# 247/272) less one query each.
EVAL_FLOORS = {"held_out": (198, 233), "dev": (205, 246)}


def test_the_fair_evaluation_sets_keep_their_measured_figures() -> None:
    index, _ = BENCH.eval_tools()
    queries = json.loads((BENCH.EVAL_DIR / "queries.json").read_text(encoding="utf-8"))
    assert len(index.tools) == 699
    for name, (first, top3) in EVAL_FLOORS.items():
        ranked = [BENCH.rank_names(index, query["query"]) for query in queries[name]]
        top1_share, top3_share, _ = BENCH.eval_figures(ranked, queries[name])
        count = len(queries[name])
        assert round(top1_share * count) >= first and round(top3_share * count) >= top3, name


# ---------------------------------------------------------------- real servers, real bridge


def four_servers(tmp_path: Path) -> dict[str, Any]:
    memory = NPM_BIN / "mcp-server-memory"
    if not memory.exists():
        pytest.fail("server-memory is not installed at %s; run scripts/setup.sh" % memory)
    files = tmp_path / "files"
    files.mkdir()
    return {
        "everything": {"command": real_server("everything")},
        "filesystem": {"command": real_server("filesystem"), "args": [str(files)]},
        "memory": {"command": str(memory), "env": {"MEMORY_FILE_PATH": str(tmp_path / "memory.jsonl")}},
        "time": {"command": real_server("time")},
    }


SEARCH_CELL = """
import json
from mcp import runtime
queries = json.loads(%r)
ranks = []
for text, server, tools in queries:
    hits = runtime.search_tool_docs(text, limit=50, detail="summary")
    ranks.append(next(
        (i for i, hit in enumerate(hits, 1) if hit["server"] == server and hit["tool"] in tools), None
    ))
lines = [runtime.search_tool_docs(text, detail="line") for text, _, _ in queries]
shown = [repr(runtime.search_tool_docs(text)) for text, _, _ in queries]  # hits print as their lines
full = runtime.search_tool_docs("read a text file", 1, "full")[0]
json.dumps({"ranks": ranks, "lines": lines, "shown": shown, "full": sorted(full)})
"""


@pytest.mark.anyio
async def test_natural_language_queries_find_the_right_tool_on_real_servers(
    proxy_engine: Engine, state_dir: Path, tmp_path: Path
) -> None:
    home = claude_desktop_home(tmp_path, four_servers(tmp_path))
    queries = json.dumps([[q.text, q.server, list(q.tools)] for q in QUERIES])
    async with bridge_client(proxy_env(proxy_engine, state_dir, home)) as client:
        answer = await run_cell(client, SEARCH_CELL % queries, timeout=120)
    assert not answer["is_error"], answer["text"]
    found = json.loads(eval(answer["value"]))
    table = "\n".join("%s: %s" % (q.text, rank) for q, rank in zip(QUERIES, found["ranks"], strict=True))
    assert len(QUERIES) == 10
    assert sum(rank == 1 for rank in found["ranks"]) >= 8, table
    assert all(rank is not None and rank <= 3 for rank in found["ranks"]), table
    keys = "server tool name signature description input_schema output_schema score line"
    assert found["full"] == sorted(keys.split())
    assert found["shown"] == ["[%s]" % ", ".join(lines) for lines in found["lines"]]
    for query, lines in zip(QUERIES, found["lines"], strict=True):
        assert 1 <= len(lines) <= 5, lines
        for line in lines:
            assert isinstance(line, str) and len(line.splitlines()) == 1, line
            assert line.startswith("mcp_") and "(" in line and "  # " in line, line
        assert lines[0].startswith("mcp_%s." % query.server), (query.text, lines)


WEAK_AND_WRONG_CELL = """
from mcp import runtime
weak = runtime.search_tool_docs("bake a chocolate cake with sprinkles")
good = runtime.search_tool_docs("current time in a timezone")
try:
    mcp_time.get_time(timezone="Europe/Paris")
except AttributeError as exc:
    wrong = str(exc)
[len(weak), good[0]["tool"], wrong]
"""


@pytest.mark.anyio
async def test_a_weak_search_says_so_and_a_wrong_tool_name_gets_the_nearest_signatures(
    proxy_engine: Engine, state_dir: Path, tmp_path: Path
) -> None:
    """Issue 21, items 3 and 4: a query no tool matches well says so in the code's output,
    naming the likeliest servers and query_tool_docs; a good one says nothing; a call to a tool the
    server does not have names the nearest tools (by name and by meaning) with their
    signatures, so the model can fix the call in the same run."""
    home = claude_desktop_home(tmp_path, four_servers(tmp_path))
    async with bridge_client(proxy_env(proxy_engine, state_dir, home)) as client:
        answer = await run_cell(client, WEAK_AND_WRONG_CELL, timeout=120)
    assert not answer["is_error"], answer["text"]
    weak_count, good_tool, wrong = eval(answer["value"])
    assert good_tool == "get_current_time"
    # Said where the code searched, in its output (stderr), once: the good search says nothing.
    said = [line for line in answer["stderr"].splitlines() if line.startswith("runtime.search_tool_docs(")]
    assert len(said) == 1, answer["stderr"]
    assert "bake a chocolate cake" in said[0] and "no tool matches" in said[0], said
    assert "runtime.query_tool_docs(" in said[0], said
    assert weak_count <= 5
    assert "has no tool 'get_time'" in wrong, wrong
    assert "The nearest: mcp_time.get_current_time(timezone: str)" in wrong, wrong
