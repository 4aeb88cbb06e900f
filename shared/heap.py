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
"""

from __future__ import annotations

import gc


def freeze_long_lived() -> None:
    """Once the process holds what it keeps for life (or after loading more of it, such as
    another model's tokenizer, or another model in a shared worker): collect the garbage so
    far, what an earlier freeze held included (a model dropped since), then freeze what
    remains."""
    gc.unfreeze()
    gc.collect()
    gc.freeze()
