"""The echo engine (worker/echo_engine.py): the real continuous engine over a runner that
echoes each prompt, one token per sequence per period, its steps on a fixed grid, a period's
tokens handed out in slices. Its outputs go through the same `Sequence` bookkeeping as a
model's, so max_tokens, stops, cancels and the usage counts hold as they do with a model."""

from __future__ import annotations

import subprocess
import sys
import time
from dataclasses import dataclass, field
from itertools import pairwise

import pytest

from shared.protocol import FinishReason
from tests.factories import CharDecoder, make_request
from worker.config import EngineConfig
from worker.echo_engine import EchoEngine, build_echo_engine, eos_token_ids
from worker.sequence import Sequence, SequenceOutput

PROMPT = [ord(c) for c in "ABCD"]  # CharDecoder: token n is chr(n)


@dataclass
class FakeClock:
    """Time moves only when the runner sleeps, or when a test says so."""

    now_s: float = 100.0
    sleeps_s: list[float] = field(default_factory=list)

    def now(self) -> float:
        return self.now_s

    def sleep(self, seconds: float) -> None:
        self.sleeps_s.append(seconds)
        self.now_s += seconds


def _engine(clock: FakeClock, tokens_per_s: float = 10.0, **config) -> EchoEngine:
    engine = build_echo_engine(EngineConfig(echo_tokens_per_s=tokens_per_s, **config), 1000)
    engine.grid.clock, engine.grid.sleep = clock.now, clock.sleep
    return engine


def _add(engine: EchoEngine, i: int, max_tokens: int, *, prompt=PROMPT, eos=(), **sampling):
    request = make_request(i, prompt, max_tokens, **sampling)
    seq = Sequence.from_request(request, CharDecoder(), frozenset(eos))
    assert engine.add(seq) is None
    return seq


def _run(engine: EchoEngine) -> dict[str, list[SequenceOutput]]:
    outputs: dict[str, list[SequenceOutput]] = {}
    while engine.has_work():
        for output in engine.step():
            outputs.setdefault(output.request_id, []).append(output)
    return outputs


def _text(outputs: list[SequenceOutput]) -> str:
    return "".join(o.text for o in outputs)


def test_echoes_the_prompt_cyclically_up_to_max_tokens_with_the_usage_of_a_model():
    engine = _engine(FakeClock())
    seq = _add(engine, 0, max_tokens=10)
    outputs = _run(engine)["r0"]
    assert seq.output_token_ids == PROMPT * 2 + PROMPT[:2]
    assert _text(outputs) == "ABCDABCDAB"
    assert [o.num_new_tokens for o in outputs] == [1] * 10  # one token a step
    last = outputs[-1]
    assert last.finish_reason is FinishReason.LENGTH
    assert (last.num_prompt_tokens, last.num_output_tokens) == (4, 10)
    # The prompt, then every output token but the last one fed back: as with a model.
    assert last.num_computed_tokens == 4 + 10 - 1


def test_a_stop_string_ends_the_echo_and_is_not_sent():
    engine = _engine(FakeClock())
    _add(engine, 0, max_tokens=20, stop=["DA"])
    outputs = _run(engine)["r0"]
    assert _text(outputs) == "ABC"
    assert outputs[-1].finish_reason is FinishReason.STOP
    assert outputs[-1].num_output_tokens == 5  # A B C D A: the stop string's last token


def test_a_stop_token_id_and_eos_end_the_echo():
    engine = _engine(FakeClock())
    _add(engine, 0, max_tokens=20, stop_token_ids=[ord("C")])
    _add(engine, 1, max_tokens=20, eos=[ord("D")])
    _add(engine, 2, max_tokens=6, eos=[ord("D")], ignore_eos=True)
    outputs = _run(engine)
    assert (_text(outputs["r0"]), outputs["r0"][-1].num_output_tokens) == ("AB", 3)
    assert (_text(outputs["r1"]), outputs["r1"][-1].num_output_tokens) == ("ABC", 4)
    assert outputs["r0"][-1].finish_reason is outputs["r1"][-1].finish_reason is FinishReason.STOP
    assert _text(outputs["r2"]) == "ABCDAB"
    assert outputs["r2"][-1].finish_reason is FinishReason.LENGTH


def test_a_cancel_ends_the_sequence_with_what_it_was_given():
    engine = _engine(FakeClock())
    _add(engine, 0, max_tokens=100)
    _add(engine, 1, max_tokens=5)
    for _ in range(3):
        engine.step()
    [cancelled] = engine.abort({"r0"})
    assert cancelled.finish_reason is FinishReason.CANCELLED
    assert cancelled.num_output_tokens == 3
    rest = _run(engine)
    assert set(rest) == {"r1"}  # r0 gets nothing after its cancel
    assert rest["r1"][-1].num_output_tokens == 5


def test_max_num_seqs_bounds_the_sequences_given_tokens_in_a_step():
    engine = _engine(FakeClock(), max_num_seqs=2)
    for i in range(3):
        _add(engine, i, max_tokens=3)
    first = {o.request_id for o in engine.step()}
    assert first == {"r0", "r1"} and engine.stats().num_waiting == 1
    engine.step()
    assert {o.request_id for o in engine.step()} == {"r0", "r1"}  # their last tokens
    assert {o.request_id for o in engine.step()} == {"r2"}  # a place freed


def test_steps_keep_a_fixed_grid_of_one_period():
    clock = FakeClock()
    engine = _engine(clock, tokens_per_s=20.0)  # 50 ms a step: the period
    _add(engine, 0, max_tokens=50)
    started_s = []
    for _ in range(5):
        engine.step()
        started_s.append(clock.now_s)
    assert [round(s - started_s[0], 9) for s in started_s] == [0.0, 0.05, 0.1, 0.15, 0.2]
    # Work between steps (publishing, intake) is hidden in the wait for the next slot...
    clock.now_s += 0.03
    engine.step()
    assert round(clock.now_s - started_s[0], 9) == 0.25
    # ...a step late by less than a period runs at once and keeps the grid...
    clock.now_s += 0.07
    engine.step()
    assert round(clock.now_s - started_s[0], 9) == 0.32
    engine.step()
    assert round(clock.now_s - started_s[0], 9) == 0.35
    # ...and after more than a period (idle, or far behind) a new grid starts at once.
    clock.now_s += 1.0
    num_sleeps = len(clock.sleeps_s)
    engine.step()
    assert len(clock.sleeps_s) == num_sleeps


def test_slices_hand_out_a_period_in_steps_each_sequence_once_a_period():
    clock = FakeClock()
    # 1 token a second per sequence, a step every 250 ms: four slices of the sequences.
    engine = _engine(clock, tokens_per_s=1.0, echo_step_ms=250.0)
    assert engine.num_slices == 4
    for i in range(8):
        _add(engine, i, max_tokens=3)
    times_s: dict[str, list[float]] = {}
    steps = []
    while engine.has_work():
        outputs = engine.step()
        steps.append(sorted(o.request_id for o in outputs))
        for output in outputs:
            times_s.setdefault(output.request_id, []).append(clock.now_s)
    # Round robin as added: r0 and r4 in the first slice, r1 and r5 in the second...
    assert steps[:4] == [["r0", "r4"], ["r1", "r5"], ["r2", "r6"], ["r3", "r7"]]
    assert steps[4:8] == steps[:4] and len(steps) == 12
    assert len(times_s) == 8
    for request_times_s in times_s.values():  # each a period apart, whatever its slice
        assert [round(b - a, 9) for a, b in pairwise(request_times_s)] == [1, 1]


def test_a_step_that_does_not_fit_the_period_is_rounded_to_whole_slices():
    engine = build_echo_engine(EngineConfig(echo_tokens_per_s=3.0, echo_step_ms=100.0), 10)
    assert engine.num_slices == 3
    assert engine.grid.step_s * engine.num_slices == pytest.approx(1 / 3)
    assert build_echo_engine(EngineConfig(echo_tokens_per_s=3.0), 10).num_slices == 1


def test_the_rate_is_tokens_per_s_on_the_real_clock():
    engine = build_echo_engine(EngineConfig(echo_tokens_per_s=100.0), 1000)
    _add(engine, 0, max_tokens=11)
    started_s = time.monotonic()
    outputs = _run(engine)["r0"]
    # 11 tokens are 11 steps, 10 periods of 10 ms apart: never faster than the rate.
    assert len(outputs) == 11
    assert time.monotonic() - started_s >= 0.1


def test_eos_ids_are_the_tokenizers():
    class Tokenizer:
        eos_token_id = 2

        def __len__(self) -> int:
            return 10

    assert eos_token_ids(Tokenizer()) == frozenset({2})


def test_the_echo_worker_imports_no_torch():
    code = "import sys, worker.echo_engine, worker.service; print('torch' in sys.modules)"
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == "False"


def test_the_emission_log_has_a_line_per_token_handed_out(tmp_path):
    path = tmp_path / "emissions.txt"
    engine = _engine(FakeClock(), echo_emissions_path=str(path))
    _add(engine, 0, max_tokens=3)
    _add(engine, 1, max_tokens=2)
    outputs = _run(engine)
    lines = path.read_text().splitlines()
    by_request: dict[str, list[float]] = {}
    for line in lines:
        request_id, at_s = line.split(" ")
        by_request.setdefault(request_id, []).append(float(at_s))
    assert (
        {rid: len(times) for rid, times in by_request.items()}
        == {rid: sum(o.num_new_tokens for o in outs) for rid, outs in outputs.items()}
        == {"r0": 3, "r1": 2}
    )
    assert all(times == sorted(times) for times in by_request.values())
