"""Python's garbage collector in the long-running processes: what a process keeps for life is
frozen out of its collections.

A full collection (the oldest generation) walks every object the collector tracks, and runs
on the thread that allocates: in the API that is the event loop every stream is on, in a
worker the loop that steps the batch. The modules, tokenizers and model a process loads at
startup are hundreds of thousands of objects (the API with transformers' tokenizers: about
280,000), and one full walk of them took 0.16-0.32 s here, a stall of every stream at once
(TTFT and ITL tails), each time the objects that requests leave behind add up to a quarter
of that count. `gc.freeze()` moves every object that exists now into a permanent
generation that collections skip; what requests allocate afterwards is still collected.
vLLM and SGLang do the same after their startup.

What requests allocate is the rest of the walk. An API process holding 5,000 streams ran a
full collection every 5 s or so while they opened (each time the objects that survived
since the last one were a quarter of the rest: the streams themselves), 0.1 s at first and
1.3 s at 5,000 streams, and a middle-generation one every 0.5 s, 10-70 ms each; every stream
of the process stalls for each (a run with a `gc.callbacks` timer on this 2-core machine:
bench/results/api-gc-pauses-5000-streams-session17.txt). So a server process also collects
its young generation every `SERVER_THRESHOLDS[0]` net allocations instead of 700, and
considers a full collection after 100 of the middle one's instead of 10: the same work in
far fewer, larger young collections (a few ms each), and full walks a hundred times rarer.
Garbage is still collected: cycles die young (in the young collections), and the few that
reach the oldest generation wait for the next full walk.
"""

from __future__ import annotations

import gc

SERVER_THRESHOLDS = (10_000, 10, 100)  # Python's defaults: (700, 10, 10)


def freeze_long_lived() -> None:
    """Once the process holds what it keeps for life (or after loading more of it, such as
    another model's tokenizer, or another model in a shared worker): collect the garbage so
    far, what an earlier freeze held included (a model dropped since), then freeze what
    remains."""
    gc.unfreeze()
    gc.collect()
    gc.freeze()
    gc.set_threshold(*SERVER_THRESHOLDS)
