"""Rendering section (ExecutionOutcome -> text / TOON + structuredContent) and the
run_python tool definition of the MCP server section."""

from __future__ import annotations

from typing import Any

import mcp_types as types
import pytest
import toon_format
from pydantic import ValidationError

import mcp_sandbox_kernel
import mcp_server_code_execution_mode as bridge
from mcp_server_code_execution_mode import (
    BridgeConfig,
    ExecutionOutcome,
    OutputCut,
    render_compact,
    render_outcome,
    render_toon,
    structured_result,
)

CONFIG = BridgeConfig(max_output_chars=1000)
TRACEBACK = (
    "Traceback (most recent call last):\n"
    '  File "<cell-3>", line 1, in <module>\n'
    "    1 / 0\n"
    "ZeroDivisionError: division by zero\n"
)


def text_of(result: types.CallToolResult) -> str:
    assert len(result.content) == 1
    content = result.content[0]
    assert isinstance(content, types.TextContent)
    return content.text


# --- render_compact ---------------------------------------------------------------------


def test_stdout_only_is_shown_as_is_without_trailing_newline() -> None:
    outcome = ExecutionOutcome(status="ok", stdout="hello\nworld\n")

    assert render_compact(outcome, CONFIG) == "hello\nworld"


def test_stderr_gets_its_own_labelled_section_after_stdout() -> None:
    outcome = ExecutionOutcome(status="ok", stdout="out\n", stderr="warning: careful\n")

    assert render_compact(outcome, CONFIG) == "out\n[stderr]\nwarning: careful"


def test_stderr_only_is_labelled() -> None:
    outcome = ExecutionOutcome(status="ok", stderr="oops\n")

    assert render_compact(outcome, CONFIG) == "[stderr]\noops"


def test_value_is_shown_after_the_output() -> None:
    outcome = ExecutionOutcome(status="ok", stdout="printed\n", value="[1, 2, 3]")

    assert render_compact(outcome, CONFIG) == "printed\n[1, 2, 3]"


def test_value_alone_is_the_whole_text() -> None:
    assert render_compact(ExecutionOutcome(status="ok", value="42"), CONFIG) == "42"


def test_empty_string_value_is_still_shown() -> None:
    assert render_compact(ExecutionOutcome(status="ok", value="''"), CONFIG) == "''"


def test_error_shows_the_traceback_after_the_output() -> None:
    outcome = ExecutionOutcome(
        status="error",
        stdout="before the error\n",
        error={"type": "ZeroDivisionError", "message": "division by zero", "traceback": TRACEBACK},
    )

    text = render_compact(outcome, CONFIG)

    assert text.startswith("before the error\n")
    assert text.endswith(TRACEBACK)
    assert '"<cell-3>"' in text


def test_error_without_traceback_shows_type_and_message() -> None:
    outcome = ExecutionOutcome(
        status="error", error={"type": "SandboxError", "message": "frame too big", "traceback": ""}
    )

    assert render_compact(outcome, CONFIG) == "SandboxError: frame too big"


def test_a_cut_stream_keeps_head_and_tail_and_the_marker_names_the_saved_file() -> None:
    outcome = ExecutionOutcome(
        status="ok",
        stdout="h" * 500,
        cuts={"stdout": OutputCut(count=4001, tail="t" * 500, file="/tmp/outputs/3.stdout")},
    )

    text = render_compact(outcome, CONFIG)

    head, marker, tail = text.split("\n")
    assert head == "h" * 500 and tail == "t" * 500
    assert marker == (
        "[... 4,001 characters of stdout cut (a result shows 1,000 characters, MCP_BRIDGE_MAX_OUTPUT); "
        "all of it is in /tmp/outputs/3.stdout ...]"
    )


def test_one_budget_is_shared_and_what_a_small_part_leaves_goes_to_the_others() -> None:
    outcome = ExecutionOutcome(status="ok", stdout="o" * 3000, stderr="e" * 100, value="v" * 3000)

    fitted = bridge.fit_output(outcome, 1000)

    assert fitted.text["stderr"] == "e" * 100  # within its share: whole
    for name, letter in (("stdout", "o"), ("value", "v")):  # 450 each, head and tail
        head, marker, tail = fitted.text[name].split("\n")
        assert (head, tail) == (letter * 225, letter * 225)
        assert "2,550 characters of %s cut" % bridge.PART_LABELS[name] in marker
        assert fitted.cut[name] == {"characters": 2550}
    assert "stderr" not in fitted.cut


def test_a_cut_in_the_middle_is_counted_with_what_the_budget_cuts_from_head_and_tail() -> None:
    outcome = ExecutionOutcome(
        status="ok", stderr="a" * 500, cuts={"stderr": OutputCut(count=7, tail="z" * 500)}
    )

    text = render_compact(outcome, bridge.BridgeConfig(max_output_chars=600))

    assert text.startswith("[stderr]\n" + "a" * 300 + "\n[... 407 characters of stderr cut")
    assert text.endswith("...]\n" + "z" * 300)


def test_a_short_head_leaves_its_room_to_the_tail() -> None:
    assert bridge.keep_ends("ab", 10, "x" * 100, 50) == ("ab", 10 + 52, "x" * 48)
    assert bridge.keep_ends("abcdef", 0, "", 4) == ("ab", 2, "ef")
    assert bridge.keep_ends("abc", 0, "def", 6) == ("abcdef", 0, "")


def test_the_traceback_shares_the_budget_and_keeps_its_end() -> None:
    traceback = "Traceback (most recent call last):\n" + "  frame\n" * 500 + "ValueError: the cause"
    outcome = ExecutionOutcome(
        status="error", stdout="x" * 5000, error={"type": "ValueError", "message": "", "traceback": traceback}
    )

    text = render_compact(outcome, CONFIG)

    assert text.endswith("ValueError: the cause")
    assert "characters of the traceback cut" in text and "characters of stdout cut" in text
    assert len(text) < 1000 + 2 * 200  # the budget plus two markers


def test_cut_marker_appears_even_when_all_kept_output_is_empty() -> None:
    outcome = ExecutionOutcome(status="ok", cuts={"stdout": OutputCut(count=12)})

    assert "12 characters of stdout cut" in render_compact(outcome, CONFIG)


def test_no_marker_without_truncation() -> None:
    assert "cut" not in render_compact(ExecutionOutcome(status="ok", stdout="short\n"), CONFIG)


def test_notices_come_first_prefixed_with_session() -> None:
    outcome = ExecutionOutcome(
        status="ok",
        stdout="hi\n",
        notices=["Reset: started a fresh session with an empty namespace.", "second notice"],
    )

    lines = render_compact(outcome, CONFIG).splitlines()

    assert lines == [
        "[session] Reset: started a fresh session with an empty namespace.",
        "[session] second notice",
        "hi",
    ]


def test_timeout_has_a_status_line_after_the_traceback() -> None:
    outcome = ExecutionOutcome(
        status="timeout",
        stdout="working...\n",
        error={"type": "KeyboardInterrupt", "message": "", "traceback": "KeyboardInterrupt\n"},
        detail="Timed out after 5s: the code was interrupted (KeyboardInterrupt). The session and "
        "its state were kept.",
    )

    text = render_compact(outcome, CONFIG)

    assert text.splitlines()[-1] == (
        "[timeout] Timed out after 5s: the code was interrupted (KeyboardInterrupt). "
        "The session and its state were kept."
    )
    assert text.index("KeyboardInterrupt\n") < text.index("[timeout]")


def test_crash_has_a_status_line_and_no_traceback() -> None:
    outcome = ExecutionOutcome(
        status="crashed",
        state_kept=False,
        detail="The sandbox was killed (SIGKILL). All state was lost.",
    )

    assert (
        render_compact(outcome, CONFIG) == "[crashed] The sandbox was killed (SIGKILL). All state was lost."
    )


def test_empty_outcome_says_no_output() -> None:
    assert render_compact(ExecutionOutcome(status="ok"), CONFIG) == "(no output)"


# --- structured_result and render_toon -----------------------------------------------------


def test_structured_result_carries_every_field_a_call_has() -> None:
    outcome = ExecutionOutcome(
        status="error",
        stdout="o",
        stderr="e",
        value=None,
        error={"type": "E", "message": "m", "traceback": "t"},
        cuts={"stdout": OutputCut(count=1), "stderr": OutputCut(count=2)},
        state_kept=False,
        detail="d",
        notices=["n"],
        duration=1.23456,
    )

    assert structured_result(outcome, bridge.fit_output(outcome, 1000)) == {
        "status": "error",
        "stdout": "o\n" + mcp_sandbox_kernel.cut_marker(1, "stdout", 1000) + "\n",
        "stderr": "e\n" + mcp_sandbox_kernel.cut_marker(2, "stderr", 1000) + "\n",
        "error": {"type": "E", "message": "m", "traceback": "t"},
        "truncated": {"stdout": {"characters": 1}, "stderr": {"characters": 2}},
        "state_kept": False,
        "detail": "d",
        "notices": ["n"],
        "duration_seconds": 1.235,
    }


def test_a_trivial_call_is_three_fields_and_its_value_is_json() -> None:
    outcome = ExecutionOutcome(status="ok", value="2", value_json=2, duration=0.0042)

    assert structured_result(outcome, bridge.fit_output(outcome, 1000)) == {
        "status": "ok",
        "value": 2,
        "duration_seconds": 0.004,
    }


def test_a_value_that_is_not_json_comes_as_its_repr() -> None:
    outcome = ExecutionOutcome(status="ok", value="{1, 2}")

    structured = structured_result(outcome, bridge.fit_output(outcome, 1000))

    assert structured["value_repr"] == "{1, 2}" and "value" not in structured


def test_a_json_value_the_budget_cuts_comes_as_its_cut_repr() -> None:
    rows = list(range(400))
    outcome = ExecutionOutcome(status="ok", stdout="x" * 900, value=repr(rows), value_json=rows)

    structured = structured_result(outcome, bridge.fit_output(outcome, 1000))

    assert "value" not in structured
    assert "characters of the value cut" in structured["value_repr"]


def test_toon_round_trips_to_the_structured_fields() -> None:
    outcome = ExecutionOutcome(
        status="timeout",
        stdout="a: b\nline two\n",
        value="{'k': 1}",
        value_json={"k": 1},
        state_kept=False,
        detail="Timed out after 3s.",
        notices=["Reset: fresh"],
        duration=2.5,
    )

    decoded: dict[str, Any] = toon_format.decode(render_toon(outcome, bridge.fit_output(outcome, 1000)))

    assert decoded == {
        "status": "timeout",
        "stdout": "a: b\nline two\n",
        "value": {"k": 1},
        "state_kept": False,
        "detail": "Timed out after 3s.",
        "notices": ["Reset: fresh"],
        "duration_seconds": 2.5,
    }


def test_toon_omits_empty_fields() -> None:
    outcome = ExecutionOutcome(status="ok", stdout="hi")
    text = render_toon(outcome, bridge.fit_output(outcome, 1000))

    decoded: dict[str, Any] = toon_format.decode(text)
    assert set(decoded) == {"status", "stdout", "duration_seconds"}
    assert text.startswith("status: ok")


TABLE = [
    {
        "id": i,
        "name": "user%02d" % i,
        "email": "user%02d@example.com" % i,
        "active": i % 3 != 0,
        "score": i * 7,
    }
    for i in range(20)
]


def test_a_table_costs_fewer_tokens_in_toon_than_in_compact() -> None:
    from anthropic_tokenizer import count_tokens

    outcome = ExecutionOutcome(status="ok", value=repr(TABLE), value_json=TABLE, duration=0.01)
    fitted = bridge.fit_output(outcome, bridge.BridgeConfig().max_output_chars)

    toon, compact = render_toon(outcome, fitted), render_compact(outcome, bridge.BridgeConfig())

    assert "value[20]{id,name,email,active,score}:" in toon  # a table: the keys once
    assert count_tokens(toon) < 0.8 * count_tokens(compact), (count_tokens(toon), count_tokens(compact))


# --- render_outcome ----------------------------------------------------------------------------


def test_render_outcome_in_compact_mode_uses_compact_text_and_structured_content() -> None:
    outcome = ExecutionOutcome(status="ok", stdout="hi\n", value="1")

    result = render_outcome(outcome, CONFIG)

    assert text_of(result) == "hi\n1"
    assert result.structured_content == structured_result(outcome, bridge.fit_output(outcome, 1000))
    assert result.is_error is False


def test_render_outcome_in_toon_mode_uses_toon_text() -> None:
    outcome = ExecutionOutcome(status="ok", stdout="hi\n", value="1")

    result = render_outcome(outcome, BridgeConfig(output_mode="toon"))

    assert text_of(result) == render_toon(outcome, bridge.fit_output(outcome, 1000))
    assert result.structured_content == structured_result(outcome, bridge.fit_output(outcome, 1000))


@pytest.mark.parametrize(
    ("status", "is_error"), [("ok", False), ("error", True), ("timeout", True), ("crashed", True)]
)
def test_is_error_is_true_for_every_non_ok_status(status: Any, is_error: bool) -> None:
    assert render_outcome(ExecutionOutcome(status=status), CONFIG).is_error is is_error


def test_render_error_is_an_error_result_with_the_message() -> None:
    result = bridge.render_error(bridge.EngineUnavailableError("No runtime. Install Podman."))

    assert result.is_error is True
    assert text_of(result) == "No runtime. Install Podman."


# --- the run_python tool -------------------------------------------------------------------------


def test_tool_is_named_run_python_and_points_to_the_manual() -> None:
    tool = bridge.run_python_tool(CONFIG)

    assert tool.name == "run_python"
    assert tool.description is not None
    assert bridge.CAPABILITIES_URI in tool.description
    assert "search_tool_docs" in tool.description and "mcp_<server>" in tool.description
    # Proxied tools can write and reach the network: no annotation may claim otherwise.
    assert tool.annotations is None


def test_tool_input_schema_has_code_timeout_reset_and_session() -> None:
    schema = bridge.run_python_tool(CONFIG).input_schema

    assert schema["type"] == "object"
    assert set(schema["properties"]) == {"code", "timeout", "reset", "session"}
    assert schema["required"] == ["code"]
    assert schema["additionalProperties"] is False
    assert schema["properties"]["code"]["type"] == "string"
    assert schema["properties"]["reset"]["type"] == "boolean"
    assert schema["properties"]["reset"]["default"] is False
    assert schema["properties"]["session"] == {
        "default": "default",
        "description": "Sandbox name; each has its own state",
        "type": "string",
    }


def test_tool_timeout_default_and_maximum_come_from_the_config() -> None:
    schema = bridge.run_python_tool(BridgeConfig(timeout=12.5, max_timeout=90.0)).input_schema
    timeout = schema["properties"]["timeout"]

    assert timeout["default"] == 12.5
    assert timeout["maximum"] == 90.0
    assert timeout["exclusiveMinimum"] == 0


def test_tool_schema_has_no_auto_generated_titles() -> None:
    schema = bridge.run_python_tool(CONFIG).input_schema

    assert "title" not in schema
    assert all("title" not in prop for prop in schema["properties"].values())


def test_input_model_applies_defaults_from_the_config() -> None:
    model = bridge.run_python_input_model(BridgeConfig(timeout=7.0))

    request = model.model_validate({"code": "print(1)"})

    assert request.model_dump() == {
        "code": "print(1)",
        "timeout": 7.0,
        "reset": False,
        "saved_tools": True,
        "session": "default",
    }


def test_input_model_rejects_timeout_over_the_configured_maximum() -> None:
    model = bridge.run_python_input_model(BridgeConfig(max_timeout=60.0))

    assert model.model_validate({"code": "", "timeout": 60}).model_dump()["timeout"] == 60
    with pytest.raises(ValidationError):
        model.model_validate({"code": "", "timeout": 61})


def validation_message(arguments: dict[str, Any]) -> str:
    model = bridge.run_python_input_model(BridgeConfig(max_timeout=120.0))
    with pytest.raises(ValidationError) as caught:
        model.model_validate(arguments)
    return bridge.describe_validation_error(caught.value)


def test_validation_message_for_missing_code_names_the_field_and_how_to_call() -> None:
    message = validation_message({})

    assert message.startswith("Invalid run_python arguments (code: Field required).")
    assert 'Call run_python with {"code": "..."}' in message
    assert '"timeout"' in message
    assert '"reset"' in message


def test_validation_message_for_too_large_timeout_states_the_limit() -> None:
    message = validation_message({"code": "1", "timeout": 500})

    assert "timeout:" in message
    assert "less than or equal to 120" in message


def test_validation_message_for_unknown_argument_names_it() -> None:
    message = validation_message({"code": "1", "cmd": "ls"})

    assert "cmd: Extra inputs are not permitted" in message


def test_validation_message_lists_every_problem() -> None:
    message = validation_message({"code": 5, "reset": "perhaps"})

    assert "code:" in message
    assert "reset:" in message
    assert message.count(";") >= 1


def test_tools_list_answer_stays_under_200_tokens() -> None:
    # The whole point: the context cost of this server is small and constant.
    import json

    from anthropic_tokenizer import count_tokens

    listing = types.ListToolsResult(
        tools=[bridge.run_python_tool(bridge.BridgeConfig())],
        ttl_ms=bridge.TOOL_LIST_TTL_MS,
        cache_scope="public",
    )
    text = json.dumps(
        listing.model_dump(by_alias=True, exclude_none=True, mode="json"), separators=(",", ":")
    )
    assert count_tokens(text) < 200


# --- what leaves the bridge: clean text, the bridge's words apart -------------------------


def test_terminal_escapes_and_control_characters_are_removed_from_what_the_model_sees() -> None:
    noisy = "a\x1b[31mred\x1b[0m \x1b]0;title\x07|\x1b]8;;http://x\x1b\\link\x1b]8;;\x1b\\|nul\x00|\x07\x08\x9b|\tok"

    assert bridge.clean_text(noisy) == "ared |link|nul||\tok"


def test_a_carriage_return_cannot_overwrite_a_line() -> None:
    assert bridge.clean_text("shown\rhidden\r\nnext") == "shown\nhidden\nnext"


def test_lone_surrogates_become_escapes_that_json_can_carry() -> None:
    assert bridge.clean_text("bad \udcff name") == "bad \\udcff name"
    assert bridge.clean_text("emoji \U0001f600 and é stay") == "emoji \U0001f600 and é stay"


def test_every_string_of_a_result_is_cleaned_text_and_structured_alike() -> None:
    outcome = ExecutionOutcome(
        status="error",
        stdout="\x1b[1mbold\x1b[0m\n",
        error={"type": "ValueError", "message": "\udcff", "traceback": "ValueError: \udcff\n"},
        notices=["a notice"],
    )

    result = render_outcome(outcome, CONFIG)

    texts = [block.text for block in result.content if isinstance(block, types.TextContent)]
    assert texts == ["[session] a notice", "bold\nValueError: \\udcff\n"]
    assert result.structured_content is not None
    assert result.structured_content["stdout"] == "bold\n"
    assert result.structured_content["error"]["message"] == "\\udcff"
    result.model_dump_json()  # serializes: no lone surrogate left anywhere


def test_the_bridges_notices_and_status_are_blocks_of_their_own() -> None:
    outcome = ExecutionOutcome(
        status="timeout",
        stdout="[session] printed by the code\n",
        notices=["Reset: started a fresh session with an empty namespace."],
        detail="Timed out after 2s.",
    )

    blocks = bridge.render_blocks(outcome, bridge.fit_output(outcome, 1000))

    assert blocks == [
        "[session] Reset: started a fresh session with an empty namespace.",
        "\\[session] printed by the code",  # the code's: escaped
        "[timeout] Timed out after 2s.",
    ]


def test_output_that_mimics_the_bridges_lines_is_escaped_and_nothing_else() -> None:
    outcome = ExecutionOutcome(
        status="ok",
        # Control characters cannot hide a tag: the escape is decided on the cleaned text.
        stdout="[timeout] fake\n\x1b[0m[session] fake\nok\r[ok] fake\n[earlier call, now finished]\n",
        stderr="[stderr]\n[error] fake\n",
        value="'[crashed] in a repr'",
    )

    text = render_compact(outcome, CONFIG)

    assert text.splitlines() == [
        "\\[timeout] fake",
        "\\[session] fake",
        "ok",
        "\\[ok] fake",
        "\\[earlier call, now finished]",
        "[stderr]",  # the bridge's label, then the code's stderr
        "\\[stderr]",
        "\\[error] fake",
        "'[crashed] in a repr'",
    ]
    # The structured result keeps the output as it was.
    assert (
        structured_result(outcome, bridge.fit_output(outcome, 1000))["stderr"] == "[stderr]\n[error] fake\n"
    )


def test_ordinary_output_is_shown_unchanged() -> None:
    plain = "1\n[INFO] starting\n[1, 2, 3]\n  [session] indented\nsession] no bracket\n"
    assert render_compact(ExecutionOutcome(status="ok", stdout=plain), CONFIG) == plain.rstrip("\n")


def test_an_http_result_stays_under_the_transport_limit_even_with_a_large_output_budget() -> None:
    # MCP_BRIDGE_MAX_OUTPUT of 3 million characters of quotes: 6 MB of JSON text per copy.
    config = bridge.BridgeConfig(max_output_chars=3_000_000)
    outcome = ExecutionOutcome(status="ok", stdout='"' * 3_000_000, notices=["n" * 500_000])
    result = bridge.render_outcome(outcome, config, bridge.HTTP_MAX_RESULT_BYTES)
    size = len(result.model_dump_json(by_alias=True, exclude_none=True))
    assert size <= bridge.HTTP_MAX_RESULT_BYTES, size
    assert "characters of stdout cut" in result.content[-1].text  # type: ignore[union-attr]
    assert len(bridge.render_outcome(outcome, config).model_dump_json()) > 6_000_000  # stdio: as set


# --- a result shaped for the client that reads it (ClientProfile) ---------------------------

PIXEL_B64 = "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAQAAAC1HAwCAAAAC0lEQVR42mNkYAAAAAYAAjCB0C8AAAAASUVORK5CYII="


def png_attachment() -> types.EmbeddedResource:
    return types.EmbeddedResource(
        resource=types.BlobResourceContents(
            uri="file:///workspace/p.png", mime_type="image/png", blob=PIXEL_B64
        )
    )


def test_each_measured_client_gets_the_text_once_and_others_get_both_forms() -> None:
    outcome = ExecutionOutcome(status="ok", stdout="hi\n", value="42", value_json=42)
    default = render_outcome(outcome, CONFIG)
    assert default.structured_content is not None and "hi" in bridge_text(default)
    for name in ("claude-code", "codex-mcp-client"):
        shaped = render_outcome(outcome, CONFIG, client=bridge.client_profile(name))
        # These clients would show the model only the JSON (escaped, the text dropped): text alone.
        assert shaped.structured_content is None and bridge_text(shaped) == bridge_text(default), name
    assert bridge.client_profile("somebody-else") is bridge.DEFAULT_CLIENT is bridge.client_profile(None)


def test_a_failed_run_keeps_its_plot_where_the_client_drops_the_images_of_errors() -> None:
    error: mcp_sandbox_kernel.ErrorInfo = {
        "type": "ZeroDivisionError",
        "message": "division by zero",
        "traceback": "Traceback (most recent call last):\nZeroDivisionError: division by zero\n",
    }
    outcome = ExecutionOutcome(status="error", error=error, images=[("image/png", PIXEL_B64)])
    claude_code = bridge.client_profile("claude-code")
    claude = render_outcome(outcome, CONFIG, client=claude_code)
    assert not claude.is_error and "ZeroDivisionError: division by zero" in bridge_text(claude)
    assert [block.type for block in claude.content][-1] == "image"
    assert render_outcome(outcome, CONFIG).is_error  # a client that keeps them keeps the flag too
    assert render_outcome(ExecutionOutcome(status="error", error=error), CONFIG, client=claude_code).is_error


def test_codex_gets_output_under_its_own_cut_and_attached_images_as_images() -> None:
    codex = bridge.client_profile("codex-mcp-client")
    long = ExecutionOutcome(status="ok", stdout="y" * 50_000)
    text = bridge_text(render_outcome(long, BridgeConfig(), client=codex))
    assert len(text) < 11_000 and "characters of stdout cut" in text  # the marker stays visible
    assert "(a result shows 10,000 characters, the most this client shows whole)" in text
    attached = ExecutionOutcome(
        status="ok", value="'file:///workspace/p.png'", attachments=[png_attachment()]
    )
    shaped = render_outcome(attached, CONFIG, client=codex)
    assert [block.type for block in shaped.content] == ["text", "image"]
    assert [block.type for block in render_outcome(attached, CONFIG).content] == ["text", "resource"]


def bridge_text(result: types.CallToolResult) -> str:
    return "\n".join(block.text for block in result.content if isinstance(block, types.TextContent))
