"""Tools the server runs (issue 62): what the ``agent`` step adds to an MCP call, and what running a round's calls
at the same time saves, measured in one run.

    .venv/bin/python bench/tools.py [--quick] [--calls N] [--runs R] [--tool-s S]

Both figures run in-process against the MCP example server (examples/mcp_orders/server.py) over stdio; the model
is scripted (it proposes the calls at once and answers from the results), so that only the tool path is timed.

  tool_call_overhead_ms_p50  one ``order_status`` call through the step's call path (stages/agent_calls.py: the
                     pinned-schema check, argument validation, the MCP call through serving/backends/tool_hub.py,
                     the policy's input rails on the result, the call's trace and audit record, the metric) against
                     the same call made directly with the ``mcp`` client on a server process of its own: p50 - p50
                     over N (400; 60 with --quick) calls of each, interleaved (target <= 2 ms).
                     ``tool_call_step_ms_p50`` and ``tool_call_direct_ms_p50`` are the two p50s.
  parallel_calls_speedup  an agent request whose model proposes 4 calls of the ``slow`` tool (S = 0.2 s each) in one
                     reply, against one whose model proposes them one per round: p50 / p50 over R (5; 2 with
                     --quick) requests of each, interleaved (target >= 3).
"""

from __future__ import annotations

import sys
from pathlib import Path

# This folder holds http.py, which would shadow the standard library's http package (imported by httpx, mcp).
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import argparse
import asyncio
import json
import statistics
import time
from typing import Any

from mcp import Client
from mcp.client.stdio import StdioServerParameters

from pipeline.context import RequestContext
from pipeline.events import Done
from pipeline.loader import load_pipeline_text
from pipeline.protocols import Resources
from pipeline.registry import StageRegistry
from pipeline.runner import Pipeline, Runner
from serving.backends.tool_hub import ToolHub
from serving.config.loader import catalog_of
from serving.config.server import ServerSpec
from stages import register_builtins
from stages.agent_calls import ToolCaller
from stages.agent_tools import BoundTool, McpTools
from stages.policy import PolicyConfig, PolicyStage

SERVER_SCRIPT = ROOT / "examples" / "mcp_orders" / "server.py"
PIPELINE = """
name: bench_tools
stages:
  - {id: guard, type: policy, with: {injection: block}}
  - id: answer
    type: agent
    with: {max_rounds: 6, max_tokens: 512, call_timeout_s: 30, tools: [{kind: mcp, server: orders, allow: [slow]}]}
"""


class _Tokenizer:
    def encode_chat(self, messages: Any) -> list[int]:
        return list("".join(m["content"] for m in messages).encode())[:64]

    def decode(self, token_ids: Any) -> str:
        return bytes(token_ids).decode("utf-8", errors="replace")


class _Event:
    __slots__ = ("finish_reason", "num_cached_tokens", "num_output_tokens", "num_prompt_tokens", "text", "token_id")

    def __init__(self, text: str, prompt: int):
        self.token_id, self.text, self.finish_reason = None, text, "stop"
        self.num_prompt_tokens, self.num_cached_tokens, self.num_output_tokens = prompt, 0, 1


class _Stream:
    def __init__(self, text: str, prompt: int):
        self._event = _Event(text, prompt)

    def __aiter__(self) -> Any:
        return self._events()

    async def _events(self) -> Any:
        yield self._event

    async def aclose(self) -> None:
        return None


class ScriptedModel:
    """A model whose n-th reply of a request is the n-th of *replies* (an engine and its provider at once)."""

    default_model = "smol"
    weights_hash = "scripted"

    def __init__(self, replies: list[str]):
        self.tokenizer = _Tokenizer()
        self.replies = replies
        self.submitted = 0

    async def get(self, name: str) -> ScriptedModel:
        return self

    def occupancy(self, name: str) -> Any:
        from pipeline.protocols import ModelOccupancy

        return ModelOccupancy()

    async def submit(self, prompt_ids: Any, sampling: Any, cache_salt: str = "", *, hints: Any = None) -> _Stream:
        reply = self.replies[min(self.submitted, len(self.replies) - 1)]
        self.submitted += 1
        return _Stream(reply, len(prompt_ids))


def server_spec() -> ServerSpec:
    return ServerSpec.model_validate({"models": {"smol": {"source": "models/smollm2-135m-instruct"}},
                                      "mcp_servers": {"orders": {"command": ["python", str(SERVER_SCRIPT)]}}})


def p50(values: list[float]) -> float:
    return statistics.median(values)


async def overhead(calls: int) -> dict[str, float]:
    """The step's call path against the mcp client's own call, interleaved (see the module docstring)."""
    spec = server_spec()
    hub = ToolHub(spec, ROOT)
    listed = await hub.list_mcp("orders")
    schema = listed["order_status"]
    tool = BoundTool("order_status", "mcp", schema.description, dict(schema.parameters), schema.sha256,
                     McpTools(kind="mcp", server="orders", allow=["order_status"]), "orders")
    policy = PolicyStage("guard", PolicyConfig.model_validate({"injection": "block", "deny": ["credentials"]}),
                         Resources())
    direct_s, step_s = [], []
    params = StdioServerParameters(command=sys.executable, args=[str(SERVER_SCRIPT)])
    try:
        async with Client(params) as client:
            for i in range(calls + 10):
                ctx = RequestContext.from_text("bench_tools", "x")
                ctx.facts["input_rails"] = lambda text, source, ctx=ctx: policy.scan_untrusted(ctx, text, source)
                caller = ToolCaller("answer", Resources(tools=hub), ctx, 30.0, 16000)
                started = time.perf_counter()
                await client.call_tool("order_status", {"order_id": "A-1001"})
                middle = time.perf_counter()
                told = await caller.call(tool, "order_status", {"order_id": "A-1001"}, 1)
                ended = time.perf_counter()
                if '"outcome": "ok"' not in told:
                    raise RuntimeError(f"the call through the step did not succeed: {told}")
                if i >= 10:  # warm-up: connections, imports, first listing
                    direct_s.append(middle - started)
                    step_s.append(ended - middle)
    finally:
        await hub.aclose()
    return {"tool_call_overhead_ms_p50": round((p50(step_s) - p50(direct_s)) * 1e3, 3),
            "tool_call_step_ms_p50": round(p50(step_s) * 1e3, 3),
            "tool_call_direct_ms_p50": round(p50(direct_s) * 1e3, 3)}


async def parallel(runs: int, tool_s: float) -> dict[str, float]:
    """4 calls proposed at once against 4 proposed one per round (see the module docstring)."""
    spec = server_spec()
    hub = ToolHub(spec, ROOT)
    registry = register_builtins(StageRegistry())
    loaded = load_pipeline_text(PIPELINE, "bench_tools.yaml", registry, catalog_of(spec))
    one = {"name": "slow", "arguments": {"seconds": tool_s}}
    scripts = {"parallel": [json.dumps([one] * 4), "All four done."],
               "sequential": [json.dumps(one)] * 4 + ["All four done."]}
    times: dict[str, list[float]] = {name: [] for name in scripts}
    try:
        for _ in range(runs + 1):
            for name, replies in scripts.items():
                model = ScriptedModel(replies)
                pipeline = Pipeline(loaded, Resources(catalog_of(spec), engines=model, tools=hub))
                ctx = RequestContext.from_text("bench_tools", "Run the slow tool four times.")
                started = time.perf_counter()
                final = await Runner().run(pipeline, ctx)
                times[name].append(time.perf_counter() - started)
                calls = [r for r in ctx.stages if r.type == "tool" and r.status == "ok"]
                if not isinstance(final, Done) or len(calls) != 4:
                    raise RuntimeError(f"{name}: the request did not make its 4 calls: {final}")
                await pipeline.aclose()
        seq, par = p50(times["sequential"][1:]), p50(times["parallel"][1:])  # the first pins and warms up
    finally:
        await hub.aclose()
    return {"parallel_calls_speedup": round(seq / par, 3), "parallel_calls_ms_p50": round(par * 1e3, 1),
            "sequential_calls_ms_p50": round(seq * 1e3, 1), "tool_s": tool_s}


async def main(args: argparse.Namespace) -> dict[str, Any]:
    calls = args.calls or (60 if args.quick else 400)
    runs = args.runs or (2 if args.quick else 5)
    result: dict[str, Any] = {"bench": "tools", "quick": args.quick, "calls": calls, "runs": runs}
    result |= await overhead(calls)
    print(f"overhead: step p50 {result['tool_call_step_ms_p50']} ms, direct p50 {result['tool_call_direct_ms_p50']} "
          f"ms -> {result['tool_call_overhead_ms_p50']} ms added (target <= 2)", flush=True)
    result |= await parallel(runs, args.tool_s)
    print(f"parallel: 4 x {args.tool_s} s at once p50 {result['parallel_calls_ms_p50']} ms, one per round p50 "
          f"{result['sequential_calls_ms_p50']} ms -> {result['parallel_calls_speedup']}x (target >= 3)", flush=True)
    return result


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a short run (make bench, CI)")
    parser.add_argument("--calls", type=int, help="calls of each side for the overhead (default 400; 60 with --quick)")
    parser.add_argument("--runs", type=int, help="requests of each side for the speedup (default 5; 2 with --quick)")
    parser.add_argument("--tool-s", type=float, default=0.2, help="how long the slow tool takes (default 0.2 s)")
    print(json.dumps(asyncio.run(main(parser.parse_args()))))
