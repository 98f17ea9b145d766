"""Tools a policy can call inside an episode: their descriptions, how calls are read from the
model's text, and how they run.

A tool is a plain function with a JSON-schema description (`Tool`); the descriptions go to the
tokenizer's chat template (`tools=`), so the model sees them the way it was trained to. A parser
turns a model turn's text into calls:
- `hermes`: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, the form of Hermes and
  Qwen2.5/Qwen3 chat templates (several calls a turn allowed);
- `compact`: `<<name:argument>>`, one string argument, for small models whose every character
  is a token (the embedded agent task); a tool's first parameter gets the argument.

Invariants:
- a call the parser cannot read (broken JSON, no name, arguments that are not an object) or that
  names no offered tool is not dropped: it becomes an error result the model reads back as its
  observation, and it is counted (`ToolResult.error`);
- a tool that raises returns the exception's text as its result, counted the same way; tools run
  in the driver, never in the environment;
- the Python executor (`python_tool`) runs model-written code isolated from the network and the
  user's files (engine/data/sandbox.py), and refuses to be built where no isolation works unless
  it is told `isolation="none"`.

Run its tests with ``python -m pytest tests/engine/agents -q``.
"""

from __future__ import annotations

import ast
import json
import operator
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from rlflow.engine.data.sandbox import resolve_isolation, run_python


@dataclass
class Tool:
    name: str
    description: str
    parameters: dict  # JSON schema of the arguments object
    fn: Callable[..., Any]

    def schema(self) -> dict:
        """The OpenAI-style function description chat templates take in `tools=`."""
        return {"type": "function",
                "function": {"name": self.name, "description": self.description, "parameters": self.parameters}}


@dataclass
class ToolCall:
    name: str
    arguments: dict = field(default_factory=dict)
    error: str = ""  # set when the call could not be read: it is not run, the error is its result


@dataclass
class ToolResult:
    name: str
    content: str
    error: bool  # the call was unreadable, named no tool, or its tool raised


_HERMES = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_COMPACT = re.compile(r"<<(\w+):(.*?)>>", re.DOTALL)


def parse_hermes(text: str) -> list[ToolCall]:
    calls = []
    for body in _HERMES.findall(text):
        try:
            call = json.loads(body)
        except json.JSONDecodeError as e:
            calls.append(ToolCall("", error=f"tool call is not valid JSON: {e.msg} at {e.pos}"))
            continue
        name, args = (call.get("name"), call.get("arguments", {})) if isinstance(call, dict) else (None, None)
        if isinstance(args, str):  # some models write the arguments object as a JSON string
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                args = None
        if not isinstance(name, str) or not isinstance(args, dict):
            calls.append(ToolCall(str(name or ""), error='a tool call needs {"name": str, "arguments": object}'))
        else:
            calls.append(ToolCall(name, args))
    return calls


def parse_compact(text: str) -> list[ToolCall]:
    return [ToolCall(name, {"": arg}) for name, arg in _COMPACT.findall(text)]


PARSERS: dict[str, Callable[[str], list[ToolCall]]] = {"hermes": parse_hermes, "compact": parse_compact}


def run_call(call: ToolCall, tools: dict[str, Tool]) -> ToolResult:
    """One call's result; every failure is a result the model can read, marked as an error."""
    if call.error:
        return ToolResult(call.name, f"error: {call.error}", True)
    tool = tools.get(call.name)
    if tool is None:
        return ToolResult(call.name, f"error: no tool named {call.name!r} (tools: {', '.join(sorted(tools))})", True)
    args = call.arguments
    if set(args) == {""}:  # compact form: the one argument is the tool's first parameter
        first = next(iter(tool.parameters.get("properties", {})), None)
        args = {first: args[""]} if first else {}
    try:
        return ToolResult(call.name, str(tool.fn(**args)), False)
    except Exception as e:  # the model's call failed: it reads why
        return ToolResult(call.name, f"error: {type(e).__name__}: {e}", True)


# ------------------------------------------------------------------ built-in tools

_OPS: dict[type, Callable] = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
                              ast.Div: operator.truediv, ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod,
                              ast.Pow: operator.pow, ast.USub: operator.neg, ast.UAdd: operator.pos}
MAX_POWER = 64  # exponents above this are refused: 9**9**9 would hold the driver for minutes


def calculate(expression: str) -> str:
    """The value of an arithmetic expression of numbers, + - * / // % ** and parentheses; an
    integer result is written without a decimal point."""
    def value(node: ast.AST) -> int | float:
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
            return node.value
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](value(node.operand))
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            left, right = value(node.left), value(node.right)
            if isinstance(node.op, ast.Pow) and abs(right) > MAX_POWER:
                raise ValueError(f"exponent over {MAX_POWER}")
            return _OPS[type(node.op)](left, right)
        raise ValueError(f"not arithmetic: {ast.unparse(node)!r}")

    result = value(ast.parse(expression.strip(), mode="eval").body)
    return str(int(result)) if isinstance(result, float) and result.is_integer() else str(result)


def python_tool(timeout_s: float = 5.0, memory_bytes: int = 512 * 1024**2, isolation: str = "auto",
                max_chars: int = 2000) -> Tool:
    """A tool that runs the model's Python and returns what it printed, isolated as `isolation`
    says (engine/data/sandbox.py); built where an environment class lists its tools, so a machine
    that cannot isolate it fails at start-up. A crash, a timeout or a non-zero exit is an error
    result holding the end of stderr; output past `max_chars` is cut at the front, and says so."""
    mode = resolve_isolation(isolation)

    def run(code: str) -> str:
        result = run_python(code, timeout_s, memory_bytes, isolation=mode)
        if result.timed_out:
            raise TimeoutError(f"the code ran past {timeout_s:g}s")
        if result.returncode != 0:
            raise RuntimeError(_tail(result.stderr.strip() or f"exit status {result.returncode}", max_chars))
        return _tail(result.stdout, max_chars)

    return Tool("python", "Run Python code in a fresh interpreter; returns what it prints.",
                {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]}, run)


def _tail(text: str, max_chars: int) -> str:
    return text if len(text) <= max_chars else f"[{len(text) - max_chars} characters cut]" + text[-max_chars:]


CALCULATOR = Tool("calc", "Evaluate an arithmetic expression (+ - * / // % ** and parentheses).",
                  {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]},
                  calculate)
BUILTIN_TOOLS = {CALCULATOR.name: CALCULATOR}
