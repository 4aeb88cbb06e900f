"""The roofline bench (bench/roofline.py): where the bandwidth is read against the steps."""

from __future__ import annotations

from bench import roofline
from shared import model_source


def _fake_probe(reads: list[int]):
    def probe(device=None, num_repeats: int = 8) -> float:
        reads.append(num_repeats)
        return 1e9 * (2, 5, 3)[len(reads) - 1]  # the host's bandwidth moves between reads

    return probe


def test_on_the_cpu_the_bandwidth_is_probed_between_the_steps(
    tiny_loaded, tiny_model_dir, monkeypatch
):
    decoder = model_source.load_tokenizer(model_source.resolve(str(tiny_model_dir)))
    reads: list[int] = []
    monkeypatch.setattr(roofline, "measure_bandwidth", _fake_probe(reads))
    point = roofline.measure_decode(tiny_loaded, decoder, 2, 16, None, num_steps=6)
    assert reads == [2, 2, 2]  # a round of two passes before each third of the steps
    assert point.bandwidth_bytes_per_s == 5e9  # the best pass: the harder roofline
    assert point.step_s > 0 and point.batch_size == 2


def test_a_bandwidth_given_is_the_one_the_steps_are_set_against(
    tiny_loaded, tiny_model_dir, monkeypatch
):
    decoder = model_source.load_tokenizer(model_source.resolve(str(tiny_model_dir)))
    reads: list[int] = []
    monkeypatch.setattr(roofline, "measure_bandwidth", _fake_probe(reads))
    point = roofline.measure_decode(tiny_loaded, decoder, 2, 16, 7e9, num_steps=6)
    assert reads == []  # a GPU's device copy, read once before
    assert point.bandwidth_bytes_per_s == 7e9
    # the roofline is the bytes a step must read at that bandwidth
    assert point.roofline_s == (point.weight_bytes + point.kv_bytes) / 7e9
    assert point.weight_bytes == sum(
        p.numel() * p.element_size() for p in tiny_loaded.model.parameters()
    )


def test_the_steps_timed_are_decodes_where_a_prompt_takes_many_steps(
    tiny_loaded, tiny_model_dir, monkeypatch
):
    """A long prompt is chunked over several steps (`Scheduler._chunk_size`): the warm-up and
    the timed steps start once it is in, so every one of them decodes a token."""
    decoder = model_source.load_tokenizer(model_source.resolve(str(tiny_model_dir)))
    engines = []
    build = roofline.build_engine
    monkeypatch.setattr(
        roofline, "build_engine", lambda *a: engines.append(build(*a)) or engines[-1]
    )
    monkeypatch.setattr(roofline, "measure_bandwidth", lambda *a, **k: 1e9)
    roofline.measure_decode(tiny_loaded, decoder, 1, 1024, None, num_steps=6)
    (seq,) = engines[0].scheduler.running
    assert seq.num_output_tokens == 1 + 5 + 6  # the prompt's token, 5 warm-up, 6 timed
