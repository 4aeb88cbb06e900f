"""Benchmark load generator for any OpenAI-compatible server (llmfleet or vLLM).

The modules form a chain, read top to bottom: `workload` (what to send and when) ->
`client` (send it open loop over HTTP/SSE, time every chunk) -> `metrics` (turn timings
into a JSON-able summary) -> `report` (a text table, a JSON file, a PNG).

Nothing is imported here, so `import bench.workload` does not pull in httpx or matplotlib.
"""
