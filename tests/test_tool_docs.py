"""Tool documentation: signatures, summary/full docs and ranked fuzzy search, on tool
definitions copied in spirit from real servers (mcp-server-time,
@modelcontextprotocol/server-filesystem, @modelcontextprotocol/server-everything)."""

from __future__ import annotations

import itertools
import keyword
import time
from collections.abc import Mapping, Sequence
from typing import Any

import pytest

from mcp_server_code_execution_mode import (
    ProxyError,
    parameter_names,
    python_identifier,
    render_signature,
    render_tool_doc,
    schema_arguments,
    search_tools,
)

Tool = dict[str, Any]


def _string(description: str) -> dict[str, str]:
    return {"type": "string", "description": description}


def _object(properties: dict[str, Any], required: Sequence[str] = (), **extra: Any) -> dict[str, Any]:
    return {"type": "object", "properties": properties, "required": list(required), **extra}


TZ_HELP = "IANA timezone name (e.g., 'America/New_York', 'Europe/London'). Use 'UTC' as local timezone"
TIME_TOOLS: list[Tool] = [
    {
        "name": "get_current_time",
        "description": "Get current time in a specific timezone",
        "inputSchema": _object(
            {"timezone": _string(TZ_HELP + " if no timezone provided by the user.")}, ["timezone"]
        ),
    },
    {
        "name": "convert_time",
        "description": "Convert time between timezones",
        "inputSchema": _object(
            {
                "source_timezone": _string(
                    "Source " + TZ_HELP + " if no source timezone provided by the user."
                ),
                "time": _string("Time to convert in 24-hour format (HH:MM)"),
                "target_timezone": _string(
                    "Target " + TZ_HELP + " if no target timezone provided by the user."
                ),
            },
            ["source_timezone", "time", "target_timezone"],
        ),
    },
]
NO_EXTRA: dict[str, Any] = {
    "additionalProperties": False,
    "$schema": "http://json-schema.org/draft-07/schema#",
}
FILESYSTEM_TOOLS: list[Tool] = [
    {
        "name": "read_text_file",
        "description": (
            "Read the complete contents of a file from the file system as text. Handles various text "
            "encodings and provides detailed error messages if the file cannot be read. Use the 'head' "
            "parameter to read only the first N lines of a file, or the 'tail' parameter to read only "
            "the last N lines of a file. Only works within allowed directories."
        ),
        "inputSchema": _object(
            {
                "path": {"type": "string"},
                "tail": {
                    "type": "number",
                    "description": "If provided, returns only the last N lines of the file",
                },
                "head": {
                    "type": "number",
                    "description": "If provided, returns only the first N lines of the file",
                },
            },
            ["path"],
            **NO_EXTRA,
        ),
    },
    {
        "name": "write_file",
        "description": (
            "Create a new file or completely overwrite an existing file with new content. Use with "
            "caution as it will overwrite existing files without warning. Handles text content with "
            "proper encoding. Only works within allowed directories."
        ),
        "inputSchema": _object(
            {"path": {"type": "string"}, "content": {"type": "string"}}, ["path", "content"]
        ),
    },
    {
        "name": "list_directory",
        "description": (
            "Get a detailed listing of all files and directories in a specified path. Results clearly "
            "distinguish between files and directories with [FILE] and [DIR] prefixes. This tool is "
            "essential for understanding directory structure and finding specific files within a "
            "directory. Only works within allowed directories."
        ),
        "inputSchema": _object({"path": {"type": "string"}}, ["path"], **NO_EXTRA),
    },
    {
        "name": "search_files",
        "description": (
            "Recursively search for files and directories matching a pattern. Searches through all "
            "subdirectories from the starting path. The search is case-insensitive and matches partial "
            "names. Returns full paths to all matching items. Great for finding files when you don't "
            "know their exact location. Only searches within allowed directories."
        ),
        "inputSchema": _object(
            {
                "path": {"type": "string"},
                "pattern": {"type": "string"},
                "excludePatterns": {"type": "array", "items": {"type": "string"}, "default": []},
            },
            ["path", "pattern"],
            **NO_EXTRA,
        ),
    },
    {
        "name": "move_file",
        "description": (
            "Move or rename files and directories. Can move files between directories and rename them "
            "in a single operation. If the destination exists, the operation will fail. Both source and"
            " destination must be within allowed directories."
        ),
        "inputSchema": _object(
            {"source": {"type": "string"}, "destination": {"type": "string"}}, ["source", "destination"]
        ),
    },
]
NUMBER_PAIR = _object(
    {
        "a": {"type": "number", "description": "First number"},
        "b": {"type": "number", "description": "Second number"},
    },
    ["a", "b"],
)
EVERYTHING_TOOLS: list[Tool] = [
    {
        "name": "echo",
        "description": "Echoes back the input",
        "inputSchema": _object({"message": _string("Message to echo")}, ["message"]),
    },
    {"name": "add", "description": "Adds two numbers", "inputSchema": NUMBER_PAIR},
    {"name": "get-sum", "description": "Returns the sum of two numbers", "inputSchema": NUMBER_PAIR},
    {
        "name": "longRunningOperation",
        "description": "Demonstrates a long running operation with progress updates",
        "inputSchema": _object(
            {
                "duration": {
                    "type": "number",
                    "default": 10,
                    "description": "Duration of the operation in seconds",
                },
                "steps": {"type": "number", "default": 5, "description": "Number of steps in the operation"},
            }
        ),
    },
    {
        "name": "printEnv",
        "description": "Prints all environment variables, helpful for debugging MCP server configuration",
        "inputSchema": _object({}, **NO_EXTRA),
    },
    {
        "name": "sampleLLM",
        "description": "Samples from an LLM using MCP's sampling feature",
        "inputSchema": _object(
            {
                "prompt": _string("The prompt to send to the LLM"),
                "maxTokens": {
                    "type": "number",
                    "default": 100,
                    "description": "Maximum number of tokens to generate",
                },
            },
            ["prompt"],
        ),
    },
    {
        "name": "getTinyImage",
        "description": "Returns the MCP_TINY_IMAGE",
        "inputSchema": _object({}, **NO_EXTRA),
    },
    {
        "name": "annotatedMessage",
        "description": "Demonstrates how annotations can be used to provide metadata about content",
        "inputSchema": _object(
            {
                "messageType": {
                    "type": "string",
                    "enum": ["error", "success", "debug"],
                    "description": "Type of message to demonstrate different annotation patterns",
                },
                "includeImage": {
                    "type": "boolean",
                    "default": False,
                    "description": "Whether to include an example image",
                },
            },
            ["messageType"],
        ),
    },
    {
        "name": "structuredContent",
        "description": "Returns structured content along with an output schema for client data validation",
        "inputSchema": _object({"location": _string("City name or zip code")}, ["location"]),
        "outputSchema": _object(
            {
                "temperature": {"type": "number"},
                "conditions": {"type": "string"},
                "humidity": {"type": "number"},
            },
            ["temperature", "conditions", "humidity"],
        ),
    },
]
ALL_TOOLS: list[tuple[str, Mapping[str, Any]]] = [
    *(("time", tool) for tool in TIME_TOOLS),
    *(("filesystem", tool) for tool in FILESYSTEM_TOOLS),
    *(("everything", tool) for tool in EVERYTHING_TOOLS),
]


def tool_named(name: str) -> Tool:
    return next(dict(tool) for _, tool in ALL_TOOLS if tool["name"] == name)


def ranked(query: str, limit: int = 5) -> list[tuple[str, str]]:
    return [(alias, tool["name"]) for _, alias, tool in search_tools(query, ALL_TOOLS, limit)]


# ---------------------------------------------------------------- python_identifier


@pytest.mark.parametrize(
    ("tool_name", "identifier"),
    [
        ("get_current_time", "get_current_time"),
        ("get-sum", "get_sum"),
        ("printEnv", "printEnv"),
        ("2fa", "t_2fa"),
        ("class", "class_"),
        ("None", "None_"),
        ("github.create issue", "github_create_issue"),
        ("", "_"),
    ],
)
def test_python_identifier_makes_tool_names_usable_as_attributes(tool_name: str, identifier: str) -> None:
    assert python_identifier(tool_name) == identifier


@pytest.mark.parametrize("tool_name", ["for", "while", "x-y.z", "9lives", "héllo", "a b", "-", "lambda"])
def test_python_identifier_is_always_a_valid_non_keyword_identifier(tool_name: str) -> None:
    identifier = python_identifier(tool_name)
    assert identifier.isidentifier() and identifier.isascii()
    assert not keyword.iskeyword(identifier)


# ---------------------------------------------------------------- render_signature


@pytest.mark.parametrize(
    ("name", "signature"),
    [
        (
            "get_current_time",
            "get_current_time(timezone: str) -> Any  # Get current time in a specific timezone",
        ),
        (
            "convert_time",
            "convert_time(source_timezone: str, time: str, target_timezone: str) -> Any"
            "  # Convert time between timezones",
        ),
        (
            "read_text_file",
            "read_text_file(path: str, tail: float | None = None, head: float | None = None) -> Any"
            "  # Read the complete contents of a file from the file system as text",
        ),
        (
            "search_files",
            "search_files(path: str, pattern: str, excludePatterns: list[str] = []) -> Any"
            "  # Recursively search for files and directories matching a pattern",
        ),
        ("get-sum", "get_sum(a: float, b: float) -> Any  # Returns the sum of two numbers"),
        (
            "longRunningOperation",
            "longRunningOperation(duration: float = 10, steps: float = 5) -> Any"
            "  # Demonstrates a long running operation with progress updates",
        ),
        (
            "printEnv",
            "printEnv() -> Any"
            "  # Prints all environment variables, helpful for debugging MCP server configuration",
        ),
        (
            "sampleLLM",
            "sampleLLM(prompt: str, maxTokens: float = 100) -> Any"
            "  # Samples from an LLM using MCP's sampling feature",
        ),
        (
            "annotatedMessage",
            "annotatedMessage(messageType: Literal['error', 'success', 'debug'], "
            "includeImage: bool = False) -> Any"
            "  # Demonstrates how annotations can be used to provide metadata about content",
        ),
        (
            "structuredContent",
            "structuredContent(location: str) -> dict"
            "  # Returns structured content along with an output schema for client data validation",
        ),
    ],
)
def test_signature_of_real_server_tools(name: str, signature: str) -> None:
    assert render_signature(tool_named(name)) == signature


def test_signature_puts_required_parameters_first_and_marks_missing_defaults_none() -> None:
    tool = {
        "name": "create_issue",
        "description": "Create a new issue in a GitHub repository.\nMore details on a second line.",
        "inputSchema": _object(
            {
                "body": _string("Issue body"),
                "owner": {"type": "string"},
                "labels": {"type": "array", "items": {"type": "string"}},
                "repo": {"type": "string"},
                "title": {"type": "string"},
                "mode": {"type": "string", "default": "fast"},
                "milestone": {"type": "integer", "default": None},
            },
            ["owner", "repo", "title"],
        ),
        "outputSchema": {"type": "object"},
    }
    assert render_signature(tool) == (
        "create_issue(owner: str, repo: str, title: str, body: str | None = None, "
        "labels: list[str] | None = None, mode: str = 'fast', milestone: int | None = None) -> dict"
        "  # Create a new issue in a GitHub repository"
    )


@pytest.mark.parametrize(
    ("schema", "rendered"),
    [
        ({"type": "integer"}, "int"),
        ({"type": "null"}, "None"),
        ({"type": ["string", "null"]}, "str | None"),
        (
            {"anyOf": [{"type": "integer"}, {"type": ["integer", "string"]}, {"type": "null"}]},
            "int | str | None",
        ),
        ({"oneOf": [{"type": "boolean"}, {"type": "mystery"}]}, "Any"),
        ({"const": 3}, "Literal[3]"),
        ({"enum": [1, "a", None]}, "Literal[1, 'a', None]"),
        ({"type": "array"}, "list"),
        ({"type": "array", "items": {"type": "array", "items": {"type": "integer"}}}, "list[list[int]]"),
        ({"type": "array", "items": {"anyOf": [{"type": "string"}, {"type": "integer"}]}}, "list[str | int]"),
        ({"type": "object"}, "dict"),
        ({"type": "object", "additionalProperties": {"type": "integer"}}, "dict[str, int]"),
        ({"type": "object", "properties": {"x": {}}, "additionalProperties": {"type": "integer"}}, "dict"),
        ({"$ref": "#/$defs/Issue"}, "Issue"),
        ({"$ref": "#/definitions/Label"}, "Label"),
        ({"$ref": "#/$defs/Missing"}, "Any"),
        ({"$ref": "https://example.com/schema.json"}, "Any"),
        ({}, "Any"),
        ({"type": "tuple"}, "Any"),
    ],
)
def test_json_schema_types_render_as_python_types(schema: dict[str, Any], rendered: str) -> None:
    tool = {
        "name": "f",
        "inputSchema": {
            "type": "object",
            "properties": {"x": schema},
            "required": ["x"],
            "$defs": {"Issue": {"type": "object"}},
            "definitions": {"Label": {"type": "string"}},
        },
    }
    assert render_signature(tool) == "f(x: %s) -> Any" % rendered


def test_schema_open_to_any_property_shows_kwargs() -> None:
    assert render_signature({"name": "f", "inputSchema": {"type": "object"}}) == "f(**kwargs: Any) -> Any"
    open_empty = {"type": "object", "properties": {}, "additionalProperties": True}
    assert render_signature({"name": "f", "inputSchema": open_empty}) == "f(**kwargs: Any) -> Any"
    typed = {"type": "object", "additionalProperties": {"type": "string"}}
    assert render_signature({"name": "f", "inputSchema": typed}) == "f(**kwargs: str) -> Any"
    closed = {"type": "object", "additionalProperties": False}
    assert render_signature({"name": "f", "inputSchema": closed}) == "f() -> Any"


def test_schema_declaring_empty_properties_takes_no_arguments() -> None:
    # What pydantic / FastMCP servers emit for a tool without parameters.
    no_params = {"type": "object", "properties": {}, "title": "printEnvArguments"}
    assert render_signature({"name": "f", "inputSchema": no_params}) == "f() -> Any"


def test_parameter_names_are_sanitized_without_collisions() -> None:
    # A name that is already a Python name keeps it: a_b= means "a_b" when called too.
    schema = _object(
        {"from": {"type": "string"}, "a-b": {"type": "integer"}, "a_b": {"type": "integer"}}, ["from"]
    )
    assert render_signature({"name": "f", "inputSchema": schema}) == (
        "f(from_: str, a_b_: int | None = None, a_b: int | None = None) -> Any"
    )


@pytest.mark.parametrize(
    ("properties", "python_names"),
    [
        ({"user-id": {}, "limit": {}}, {"user-id": "user_id", "limit": "limit"}),
        ({"a-b": {}, "a_b": {}}, {"a-b": "a_b_", "a_b": "a_b"}),
        ({"a_b": {}, "a-b": {}}, {"a_b": "a_b", "a-b": "a_b_"}),
        ({"a-b": {}, "a.b": {}, "a_b_": {}}, {"a-b": "a_b", "a.b": "a_b__", "a_b_": "a_b_"}),
        ({"class": {}, "class_": {}}, {"class": "class__", "class_": "class_"}),
        ({"2fa": {}}, {"2fa": "t_2fa"}),
    ],
)
def test_each_python_parameter_name_maps_back_to_one_schema_name(
    properties: dict[str, Any], python_names: dict[str, str]
) -> None:
    schema = _object(properties)
    assert parameter_names(schema) == python_names
    # The names the signature shows are these, and a call with them reaches the same schema names.
    shown = render_signature({"name": "f", "inputSchema": schema})
    assert shown == "f(%s) -> Any" % ", ".join("%s: Any = None" % name for name in python_names.values())
    called = {python: index for index, python in enumerate(python_names.values())}
    assert schema_arguments(schema, called) == {name: index for index, name in enumerate(python_names)}


def test_schema_names_and_unknown_keys_are_sent_as_they_are() -> None:
    schema = _object({"user-id": {"type": "string"}, "a_b": {"type": "integer"}})
    assert schema_arguments(schema, {"user-id": "u", "a_b": 1, "extra-key": 2, "other": 3}) == {
        "user-id": "u",
        "a_b": 1,
        "extra-key": 2,
        "other": 3,
    }
    assert schema_arguments({}, {"x-y": 1}) == {"x-y": 1}


def test_a_parameter_given_under_both_names_is_refused() -> None:
    schema = _object({"user-id": {"type": "string"}})
    with pytest.raises(ProxyError, match="'user-id' is given twice, as 'user_id' and as 'user-id'"):
        schema_arguments(schema, {"user_id": "a", "user-id": "b"})


def test_return_is_dict_only_for_object_output_schemas() -> None:
    base: Tool = {"name": "f", "inputSchema": _object({})}
    assert render_signature(base).endswith("-> Any")
    assert render_signature({**base, "outputSchema": {"type": "object"}}).endswith("-> dict")
    assert render_signature({**base, "outputSchema": {"type": "array"}}).endswith("-> Any")
    assert render_signature({**base, "outputSchema": "object"}).endswith("-> Any")


def test_summary_comment_is_first_sentence_trimmed_or_omitted() -> None:
    long = {"name": "f", "inputSchema": _object({}), "description": "\n\n  " + "word " * 40}
    comment = render_signature(long).split("  # ", 1)[1]
    assert len(comment) <= 100 and comment.endswith("...")
    assert render_signature({"name": "f", "inputSchema": _object({})}) == "f() -> Any"
    assert render_signature({"name": "f", "inputSchema": _object({}), "description": "  \n "}) == "f() -> Any"
    abbrev = {"name": "f", "inputSchema": _object({}), "description": "Use e.g. this. Then that."}
    assert render_signature(abbrev) == "f() -> Any  # Use e.g. this"


GARBAGE_SCHEMAS: list[object] = [
    None,
    "not a schema",
    42,
    [],
    {"properties": ["path"], "required": "path"},
    {"properties": {"x": "string", "y": None, 3: {"type": "string"}}, "required": ["x", 7, None, "ghost"]},
    {"properties": {"x": {"type": 42, "items": "nope", "enum": "abc", "anyOf": {}}}, "required": {"x": 1}},
    {"properties": {"x": {"type": "array", "items": [1, 2]}, "y": {"$ref": 5, "oneOf": []}}},
    {"properties": {"x": {"type": ["string", 3, None]}, "z": {"enum": []}}, "additionalProperties": "yes"},
    {"properties": {"x": {"$ref": "#/$defs"}, "y": {"$ref": "#/$defs/a/b"}}, "$defs": ["a"]},
    {"properties": {}, "additionalProperties": {"type": "object", "additionalProperties": "x"}},
]


def _deep_schema(levels: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "array", "items": schema}
    return schema


@pytest.mark.parametrize("schema", [*GARBAGE_SCHEMAS, _object({"x": _deep_schema(5000)})])
def test_garbage_schemas_never_raise(schema: object) -> None:
    tool = {"name": "weird", "description": 17, "inputSchema": schema, "outputSchema": ["object"]}
    assert render_signature(tool).startswith("weird(")
    assert render_tool_doc("srv", tool, "full")["input_schema"] is schema
    search_tools("weird string path", [("srv", tool)])


def test_garbage_schema_renders_unknown_parts_as_any() -> None:
    tool = {"name": "weird", "inputSchema": GARBAGE_SCHEMAS[5]}
    assert render_signature(tool) == "weird(x: Any, ghost: Any, y: Any = None) -> Any"
    duplicated = _object({"x": {"type": "string"}}, ["x", "x", "ghost", "ghost"])
    assert render_signature({"name": "f", "inputSchema": duplicated}) == "f(x: str, ghost: Any) -> Any"


def test_tool_without_name_or_schema_still_renders() -> None:
    assert render_signature({}) == "_(**kwargs: Any) -> Any"
    assert render_tool_doc("srv", {}, "summary") == {
        "server": "srv",
        "tool": "",
        "name": "_",
        "signature": "_(**kwargs: Any) -> Any",
    }


# ---------------------------------------------------------------- render_tool_doc


def test_summary_doc_has_server_names_and_signature_only() -> None:
    tool = tool_named("get-sum")
    assert render_tool_doc("everything", tool, "summary") == {
        "server": "everything",
        "tool": "get-sum",
        "name": "get_sum",
        "signature": render_signature(tool),
    }


def test_full_doc_adds_whole_description_and_schemas() -> None:
    tool = tool_named("read_text_file")
    doc = render_tool_doc("filesystem", tool, "full")
    assert doc["description"] == tool["description"]
    assert doc["input_schema"] == tool["inputSchema"]
    assert "output_schema" not in doc
    structured = tool_named("structuredContent")
    assert render_tool_doc("everything", structured, "full")["output_schema"] == structured["outputSchema"]


def test_unknown_detail_is_rejected_with_the_accepted_values() -> None:
    with pytest.raises(ValueError, match="'summary' or 'full'"):
        render_tool_doc("time", tool_named("convert_time"), "everything")  # type: ignore[arg-type]


# ---------------------------------------------------------------- search_tools


def test_search_current_time_in_timezone_ranks_get_current_time_first() -> None:
    assert ranked("current time in a timezone")[0] == ("time", "get_current_time")


def test_search_write_a_file_ranks_write_file_first() -> None:
    assert ranked("write a file")[0] == ("filesystem", "write_file")


def test_search_tolerates_typos_tmezone_convrsion() -> None:
    assert ranked("tmezone convrsion")[0] == ("time", "convert_time")


def test_search_tolerates_swapped_letters_fiel() -> None:
    top = ranked("fiel", limit=4)
    assert len(top) == 4 and all(name.endswith("_file") or name.endswith("_files") for _, name in top)


def test_search_list_files_in_directory_ranks_list_directory_first() -> None:
    assert ranked("list files in directory")[0] == ("filesystem", "list_directory")


def test_search_add_two_numbers_ranks_add_and_get_sum_first() -> None:
    assert set(ranked("add two numbers")[:2]) == {("everything", "add"), ("everything", "get-sum")}


@pytest.mark.parametrize(
    ("query", "expected"),
    [
        ("reading text", "read_text_file"),
        ("files fiel reading", "read_text_file"),
        ("renaming", "move_file"),
        ("tiny images", "getTinyImage"),
        ("environment variables", "printEnv"),
    ],
)
def test_search_matches_word_forms_and_typos(query: str, expected: str) -> None:
    assert ranked(query)[0][1] == expected


def test_search_timezones_finds_both_time_tools_first() -> None:
    assert {name for _, name in ranked("timezones")[:2]} == {"get_current_time", "convert_time"}


def test_search_respects_limit_and_reports_only_positive_scores() -> None:
    hits = search_tools("file", ALL_TOOLS, limit=3)
    assert len(hits) == 3
    assert all(score > 0 for score, _, _ in search_tools("file", ALL_TOOLS, limit=100))
    assert [score for score, _, _ in hits] == sorted((score for score, _, _ in hits), reverse=True)
    assert search_tools("file", ALL_TOOLS, limit=0) == []


@pytest.mark.parametrize("query", ["", "   ", "the a of in", "?!"])
def test_search_with_empty_query_returns_nothing(query: str) -> None:
    assert search_tools(query, ALL_TOOLS) == []


def test_search_with_unrelated_query_returns_nothing() -> None:
    assert search_tools("kubernetes", ALL_TOOLS) == []


def test_search_ordering_is_deterministic_with_ties_broken_by_shorter_then_alphabetical_name() -> None:
    same = {"description": "Make a report", "inputSchema": _object({})}
    tools: list[tuple[str, Mapping[str, Any]]] = [
        ("s", {"name": name, **same}) for name in ("report-b", "report-long", "report-a")
    ]
    orders = {
        tuple(tool["name"] for _, _, tool in search_tools("report", list(perm)))
        for perm in itertools.permutations(tools)
    }
    assert orders == {("report-a", "report-b", "report-long")}
    assert ranked("file", limit=10) == ranked("file", limit=10)


def _synthetic_tools(count: int) -> list[tuple[str, Mapping[str, Any]]]:
    syllables = ["ka", "lo", "mi", "ne", "ru", "sa", "ti", "vo", "ze", "pa", "do", "fu"]
    words = ["".join(parts) for parts in itertools.product(syllables, repeat=3)]
    tools: list[tuple[str, Mapping[str, Any]]] = []
    for i in range(count):
        picked = [words[(i * 7 + j * 131) % len(words)] for j in range(30)]
        tool = {
            "name": "%s_%s" % (picked[0], picked[1]),
            "description": " ".join(picked[2:20]),
            "inputSchema": _object({w: _string("the %s value" % w) for w in picked[20:]}, picked[20:22]),
        }
        tools.append(("server%d" % (i % 20), tool))
    return tools


def test_search_over_500_tools_finds_a_misspelled_tool_without_blowing_up() -> None:
    tools = [*_synthetic_tools(500), *ALL_TOOLS]
    started = time.perf_counter()
    hits = search_tools("tmezone convrsion kalomi", tools)
    elapsed = time.perf_counter() - started
    assert hits[0][2]["name"] == "convert_time" or "kalomi" in hits[0][2]["name"]
    # A hang guard (a ranking quadratic in the tools would take minutes), not a speed figure:
    # benchmarks/bench_search.py measures the time per search; coverage's tracing and a loaded
    # machine make one search here take seconds.
    assert elapsed < 15.0, "search over 500 tools took %.2fs" % elapsed
