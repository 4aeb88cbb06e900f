"""When a sequence ends, and why."""

from __future__ import annotations

from shared.protocol import SamplingParams
from worker.detokenizer import IncrementalDetokenizer
from worker.sequence import Sequence

EOS = 2


class CharDecoder:
    """Token id n decodes to chr(n): enough to test the bookkeeping without a tokenizer."""

    def decode(self, token_ids, skip_special_tokens=True):
        return "".join("" if t == EOS else chr(t) for t in token_ids)


def _seq(**sampling) -> Sequence:
    params = SamplingParams(**sampling)
    return Sequence(
        request_id="r",
        prompt_token_ids=[65, 66],
        sampling=params,
        eos_token_ids=frozenset({EOS}),
        detokenizer=IncrementalDetokenizer(CharDecoder(), params.stop),
    )


def test_eos_stops_without_text():
    seq = _seq(max_tokens=10)
    assert seq.append_token(ord("h")).text == "h"
    final = seq.append_token(EOS)
    assert (final.finish_reason, final.text, final.num_output_tokens) == ("stop", "", 2)
    assert seq.is_finished


def test_ignore_eos_runs_to_max_tokens():
    seq = _seq(max_tokens=3, ignore_eos=True)
    outputs = [seq.append_token(t) for t in (EOS, EOS, ord("x"))]
    assert [o.finish_reason for o in outputs] == [None, None, "length"]


def test_stop_token_ids():
    seq = _seq(max_tokens=10, stop_token_ids=(ord("z"),))
    assert seq.append_token(ord("z")).finish_reason == "stop"


def test_stop_string_across_tokens():
    seq = _seq(max_tokens=10, stop=("cd",))
    texts = [seq.append_token(ord(c)) for c in "abcd"]
    assert "".join(o.text for o in texts) == "ab"
    assert texts[-1].finish_reason == "stop"


def test_stop_string_found_on_the_last_allowed_token_is_a_stop():
    seq = _seq(max_tokens=2, stop=("bc",))
    seq.append_token(ord("b"))
    final = seq.append_token(ord("c"))
    assert final.finish_reason == "stop" and final.text == ""


def test_cancel_reports_tokens_so_far():
    seq = _seq(max_tokens=10)
    seq.append_token(ord("a"))
    final = seq.cancel()
    assert (final.finish_reason, final.num_output_tokens) == ("cancelled", 1)
