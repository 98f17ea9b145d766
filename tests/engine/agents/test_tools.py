"""Tool calls read from a model's text, and what comes back when they fail."""

import json
import tempfile
from pathlib import Path

import pytest

from rlflow.engine.agents.tools import CALCULATOR, Tool, calculate, parse_compact, parse_hermes, python_tool, run_call
from rlflow.engine.data.sandbox import SandboxUnavailable, _probe

TOOLS = {CALCULATOR.name: CALCULATOR}


def test_calculator_is_arithmetic_only():
    assert calculate("123*456") == "56088" and calculate("(7 - 2) / 2") == "2.5" and calculate("8/4") == "2"
    assert calculate("-3 ** 2") == "-9" and calculate("17 // 5 % 3") == "0"
    for bad in ("__import__('os')", "open('x')", "a + 1", "9 ** 9 ** 9", "'x' * 3", "True + 1"):
        with pytest.raises((ValueError, SyntaxError)):
            calculate(bad)


def test_hermes_calls_and_their_failures_become_readable_results():
    text = ('Let me compute. <tool_call>{"name": "calc", "arguments": {"expression": "12*12"}}</tool_call>'
            '<tool_call>{"name": "calc", "arguments": "{\\"expression\\": \\"2+2\\"}"}</tool_call>'
            '<tool_call>{"name": "calc", "arguments": {"expression": "1+"</tool_call>'
            '<tool_call>{"name": "search", "arguments": {"q": "x"}}</tool_call>'
            '<tool_call>["calc"]</tool_call>'
            '<tool_call>{"name": "calc", "arguments": {"expression": "1/0"}}</tool_call>')
    results = [run_call(c, TOOLS) for c in parse_hermes(text)]
    assert [(r.content, r.error) for r in results[:2]] == [("144", False), ("4", False)]
    assert results[2].error and "not valid JSON" in results[2].content
    assert results[3].error and "no tool named 'search'" in results[3].content and "calc" in results[3].content
    assert results[4].error and '{"name": str' in results[4].content
    assert results[5].error and "ZeroDivisionError" in results[5].content
    assert parse_hermes("no call here") == []


def test_compact_calls_pass_one_argument_to_the_first_parameter():
    calls = parse_compact("so <<calc:123*456>> then <<calc:2+>> and <<nope:1>>")
    results = [run_call(c, TOOLS) for c in calls]
    assert [r.content for r in results][0] == "56088" and not results[0].error
    assert results[1].error and results[2].error
    echo = Tool("echo", "echo", {"type": "object", "properties": {"text": {"type": "string"}}}, lambda text: text[::-1])
    assert run_call(parse_compact("<<echo:abc>>")[0], {"echo": echo}).content == "cba"


def test_a_tool_is_described_the_way_chat_templates_take_it():
    schema = CALCULATOR.schema()
    assert schema["type"] == "function" and schema["function"]["name"] == "calc"
    assert schema["function"]["parameters"]["required"] == ["expression"]


def test_the_python_tool_runs_isolated_code_and_its_failures_are_readable():
    """Through a parsed Hermes call, as a model would make it: printed output comes back; a crash,
    a timeout, a socket and a read of the user's home come back as readable errors."""
    python = python_tool(timeout_s=2, max_chars=40)
    tools = {python.name: python}

    def call(code: str):
        text = f'<tool_call>{json.dumps({"name": "python", "arguments": {"code": code}})}</tool_call>'
        return run_call(parse_hermes(text)[0], tools)

    assert (call("print(6 * 7)").content, call("print(6 * 7)").error) == ("42\n", False)
    assert call("print('x' * 100)").content == "[61 characters cut]" + "x" * 39 + "\n"
    crash = call("1 / 0")
    assert crash.error and "ZeroDivisionError: division by zero" in crash.content
    assert call("while True: pass").error and "ran past 2s" in call("import time; time.sleep(9)").content
    sock = call("import socket; socket.create_connection(('127.0.0.1', 22))")
    assert sock.error and "Operation not permitted" in sock.content
    with tempfile.NamedTemporaryFile("w", dir=Path.home(), prefix=".rlflow-secret-") as secret:
        secret.write("hunter2")
        secret.flush()
        assert call(f"print(open({secret.name!r}).read())").error
        listing = call(f"import os; print(os.listdir({str(Path.home())!r}))")
        assert listing.error or Path(secret.name).name not in listing.content


def test_the_python_tool_refuses_to_start_without_isolation_unless_told(monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    _probe.cache_clear()
    try:
        with pytest.raises(SandboxUnavailable, match="isolation='none'"):
            python_tool(isolation="namespaces")
        unisolated = python_tool(isolation="none")
        assert run_call(parse_compact("<<python:print(1)>>")[0], {"python": unisolated}).content == "1\n"
    finally:
        _probe.cache_clear()
