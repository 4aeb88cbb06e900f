"""Decode steps of a few sequences on the CPU: the few-row matmul kernel against torch's
matmul, and every layer in one C call (worker/runner/cpu_decode.py) against the fused forward
it stands in for."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from bench import kernel_run
from tests import tiny_model
from tests.factories import serve_together
from tests.reference import assert_within_rounding_of_torch, bf16_matmul_case
from worker.runner import cpu_decode, cpu_kernels, llama
from worker.runner.cpu_decode import DecodeLayers
from worker.runner.model_runner import ModelRunner
from worker.runner.paged_attention import decode_group

_library = cpu_kernels.load()
pytestmark = pytest.mark.skipif(
    _library is None or not _library.few_rows_available(),
    reason="the few-row kernels need a C compiler and a CPU with AVX512-BF16",
)


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 8])
@pytest.mark.parametrize(("n", "k"), [(96, 64), (37, 96), (1000, 576)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_few_row_matmuls_are_torchs(rows, n, k, with_bias):
    x, weight, bias = bf16_matmul_case(rows, n, k, with_bias)
    linear = llama._Linear(weight, bias)
    assert linear.max_few_rows == 8
    # the kernel itself: on a CPU with AMX the linear would take AMX's (test_amx_matmul.py)
    assert_within_rounding_of_torch(linear._matmul_few_rows(x), x, weight, bias)


@pytest.mark.parametrize(
    ("vendor", "family", "defines"),
    [
        ("AuthenticAMD", "26", ("-DFEW_ROWS_ONE_STREAM",)),  # Zen 5: full-width AVX-512
        ("AuthenticAMD", "25", ("-DSTREAMS=2",)),  # Zen 3-4: two places a thread (Zen 4)
        ("AuthenticAMD", "23", ()),  # Zen 1-2: AVX2 only
        ("GenuineIntel", "6", ()),  # not measured there: the grouped kernel
        (None, None, ()),  # /proc/cpuinfo unread
    ],
)
def test_the_kernels_are_built_for_the_cpus_kind(monkeypatch, vendor, family, defines):
    info = {} if vendor is None else {"vendor_id": vendor, "cpu family": family}
    monkeypatch.setattr(cpu_kernels, "_cpuinfo", lambda: info)
    assert cpu_kernels.cpu_defines() == defines


@pytest.fixture(scope="module")
def kernel_cache(tmp_path_factory):
    """One cache for the builds below: a build of the same defines is made once."""
    return tmp_path_factory.mktemp("kernels")


def _build_with(monkeypatch, cache, defines: tuple[str, ...]):
    monkeypatch.setattr(cpu_kernels, "cpu_defines", lambda: defines)
    monkeypatch.setenv("LLMFLEET_KERNEL_CACHE", str(cache))
    return kernel_run.with_signatures(str(cpu_kernels._build(cpu_kernels._compiler())))


def _few_rows(library, x, weight, bias) -> torch.Tensor:
    y = torch.empty(x.shape[0], weight.shape[0], dtype=torch.bfloat16)
    rows, k = x.shape
    assert library.matmul_few_rows(
        x.data_ptr(), weight.data_ptr(), bias.data_ptr(), y.data_ptr(), rows, weight.shape[0], k
    ) == 0  # fmt: skip
    return y


@pytest.fixture
def streams():
    """Sets a build of the few-row kernel to read one place a thread or two at 1, 2 and 8 rows
    of x (`few_rows_streams`), and puts back the process's own build's places."""
    chosen = {rows: _library.few_rows_streams(rows, 0) for rows in cpu_kernels.STREAM_ROWS}

    def use(library, places: int) -> None:
        for rows in cpu_kernels.STREAM_ROWS:
            library.few_rows_streams(rows, places)

    yield use
    for rows, places in chosen.items():
        _library.few_rows_streams(rows, places)


_INTEL, _ZEN4, _ZEN5 = (), ("-DSTREAMS=2",), ("-DFEW_ROWS_ONE_STREAM",)
# Two places a thread is the AVX512-BF16 kernel's; the AVX2 one reads one (and says so).
_two_places = pytest.mark.skipif(
    "avx512_bf16" not in cpu_kernels.cpu_flags(), reason="the AVX2 kernel reads one place"
)


@_two_places
@pytest.mark.parametrize(("defines", "places"), [(_INTEL, 1), (_ZEN4, 2), (_ZEN5, 1)])
def test_each_build_reads_its_places_until_told_otherwise(
    monkeypatch, kernel_cache, defines, places
):
    library = _build_with(monkeypatch, kernel_cache, defines)
    assert [library.few_rows_streams(rows, 0) for rows in range(1, 9)] == [
        places if rows in cpu_kernels.STREAM_ROWS else 1 for rows in range(1, 9)
    ]


@pytest.mark.parametrize(
    "defines",
    [
        _INTEL,  # 2-7 rows of x in groups of rows of w
        _ZEN4,  # the same, two places a thread at 1, 2 and 8 rows until set otherwise
        _ZEN5,  # 2-7 rows of x one row of w at a time
    ],
)
@pytest.mark.parametrize("places", [1, 2])
def test_every_build_of_the_few_row_kernel_is_torchs(
    monkeypatch, kernel_cache, streams, defines, places
):
    """This CPU's build is tested above; each CPU kind's is built here, so that every one is
    checked on any AVX512-BF16 host, in one place a thread and in two. Weights of 1 and 3 rows
    leave a thread's run an odd row or none for its second place."""
    library = _build_with(monkeypatch, kernel_cache, defines)
    streams(library, places)
    if "avx512_bf16" in cpu_kernels.cpu_flags():
        assert library.few_rows_streams(1, 0) == library.few_rows_streams(8, 0) == places
    for rows in range(1, 9):
        for n, k in [(1, 64), (3, 96), (37, 96), (1000, 576)]:
            x, weight, bias = bf16_matmul_case(rows, n, k, with_bias=True)
            assert_within_rounding_of_torch(_few_rows(library, x, weight, bias), x, weight, bias)


@_two_places
@pytest.mark.parametrize("rows", [1, 8])
def test_two_places_a_thread_sum_as_one(streams, rows):
    """At 1 and 8 rows of x, reading a thread's rows of w in two places changes only the order
    of the reads: each output's sums are those of the one-place kernel, bit for bit, the odd
    row read alone included. Each row of w is a half of terms of 2^-12 to 2^12 and its
    negation against the same half of x: the exact sum is the bias, and what fp32 leaves of
    the cancelled terms depends on the order they were added in."""
    generator = torch.Generator().manual_seed(rows)
    for n, k in [(3, 96), (1001, 576), (577, 1536)]:
        x, weight, bias = bf16_matmul_case(rows, n, k, with_bias=True)
        scale = torch.pow(2.0, torch.randint(-12, 13, (n, k // 2), generator=generator).float())
        half = (weight[:, : k // 2].float() * scale).to(torch.bfloat16)
        weight = torch.cat([half, -half], dim=1)
        x = torch.cat([x[:, : k // 2], x[:, : k // 2]], dim=1)
        outputs = []
        for places in (1, 2):
            streams(_library, places)
            outputs.append(_few_rows(_library, x, weight, bias))
        assert torch.equal(*outputs)


@_two_places
@pytest.mark.parametrize(("setting", "places"), [("1", 1), ("2", 2), ("3", None), ("", None)])
def test_an_operator_sets_the_places_a_thread(monkeypatch, streams, setting, places):
    built = cpu_kernels.set_streams(_library)  # this build's own, as no setting leaves it
    monkeypatch.setenv("LLMFLEET_CPU_STREAMS", setting)
    expected = built if places is None else dict.fromkeys(cpu_kernels.STREAM_ROWS, places)
    assert cpu_kernels.set_streams(_library) == expected
    assert {rows: _library.few_rows_streams(rows, 0) for rows in (1, 2, 8)} == expected
    assert _library.few_rows_streams(3, 2) == 1 and _library.few_rows_streams(3, 0) == 1


def test_more_rows_and_other_weights_take_torchs_matmul():
    weight = torch.randn(64, 64).to(torch.bfloat16)
    assert llama._Linear(weight).max_few_rows == 8
    assert llama._Linear(weight.float()).max_few_rows == 0  # bf16 only
    assert llama._Linear(torch.randn(64, 48).to(torch.bfloat16)).max_few_rows == 0  # k % 32
    # nine rows: torch's matmul, or a tiled kernel (test_amx_matmul.py, test_pair_matmul.py),
    # bit for bit
    x = torch.randn(9, 64).to(torch.bfloat16)
    assert torch.equal(llama._Linear(weight)(x), F.linear(x, weight))


class _Recording:
    """A runner's forward that keeps each decode step's logits and counts the steps each
    path took: `decode_at` (the host's lists into one C call), the decode layers' `step`
    (tensors into one C call) or neither (the fused forward from Python)."""

    def __init__(self, forward, path: str) -> None:
        self._forward = forward = copy.copy(forward)  # the model's one forward is shared
        self.decode_logits: list[torch.Tensor] = []
        self.calls = {"decode_at": 0, "step": 0}
        if path == "python":
            forward.decode_layers = None
        else:
            forward.decode_layers = copy.copy(forward.decode_layers)
            c_step = forward.decode_layers.step
            forward.decode_layers.step = lambda *args: self._count("step") or c_step(*args)
        self._use_decode_at = path == "decode_at"

    def _count(self, path: str) -> None:
        self.calls[path] += 1

    def decode_at(self, *args):
        stepped = self._forward.decode_at(*args) if self._use_decode_at else None
        if stepped is not None:
            self._count("decode_at")
            self.decode_logits.append(stepped[0].clone())
        return stepped

    def __call__(self, input_ids, positions, k_pool, v_pool, step, keep):
        logits = self._forward(input_ids, positions, k_pool, v_pool, step, keep)
        if not step.prefills:
            self.decode_logits.append(logits.clone())
        return logits


def _serve(
    loaded, prompts: list[list[int]], path: str, num_blocks: int, max_num_seqs: int = 8, **sampling
):
    """Each decode step's logits, every request's tokens and the preemptions, served
    together through `path` ("decode_at", "step" or "python"); each decode step is checked to
    have taken it."""
    runner = ModelRunner(loaded, num_blocks, 4, "own")
    assert runner._forward is not None and runner._forward.decode_layers is not None
    recording = _Recording(runner._forward, path)
    runner._forward = recording  # the runner calls it as a function
    tokens, num_preemptions = serve_together(
        runner, prompts, num_blocks, max_num_seqs=max_num_seqs, **sampling
    )
    num_decode_steps = len(recording.decode_logits)
    expected = {"decode_at": 0, "step": 0} | ({path: num_decode_steps} if path != "python" else {})
    assert recording.calls == expected
    return recording.decode_logits, tokens, num_preemptions


_PROMPTS = [list(range(1000, 1030)), [7, 7, 7, 7, 7, 7], list(range(2000, 2045, 3)), [42],
            list(range(3000, 3020)), [5, 6]]  # fmt: skip


@pytest.mark.parametrize("path", ["decode_at", "step"])
def test_the_decode_layers_are_the_fused_forward_bit_for_bit(path):
    """Decodes of 1-6 sequences (prompts of different lengths, so several attention groups,
    and preemption) give the same logits and tokens, to the bit, through one C call (from
    the host's lists, or from tensors) as through the fused forward's kernels called from
    Python."""
    loaded = tiny_model.attentive("llama", num_heads=2, num_kv_heads=1)
    loaded.model.to(torch.bfloat16)
    rows_seen = set()
    for num_blocks in (14, 60):  # with preemptions, then all six decoding together
        logits_in_c, tokens_in_c, preempted = _serve(loaded, _PROMPTS, path, num_blocks)
        logits, tokens, _ = _serve(loaded, _PROMPTS, "python", num_blocks)
        assert tokens_in_c == tokens
        assert len(logits_in_c) == len(logits) > 5
        for got, expected in zip(logits_in_c, logits, strict=True):
            assert torch.equal(got, expected)
        rows_seen |= {step.shape[0] for step in logits}
        assert (preempted > 0) == (num_blocks == 14)
    assert rows_seen >= {1, 3, 4, 6}


def test_seeded_sampling_from_the_host_path_draws_the_tensor_paths_tokens():
    """Rows that are not greedy get the logits from `decode_at` and sample them in Python:
    the same draws as from the tensors' path."""
    loaded = tiny_model.attentive("llama", num_heads=2, num_kv_heads=1)
    loaded.model.to(torch.bfloat16)
    sampled = {
        path: _serve(loaded, _PROMPTS, path, 60, temperature=0.9, seed=7)[1]
        for path in ("decode_at", "step")
    }
    assert sampled["decode_at"] == sampled["step"]
    greedy = _serve(loaded, _PROMPTS, "step", 60)[1]
    assert sampled["step"] != greedy  # sampled, not argmax


def test_a_position_past_the_rope_table_takes_the_tensor_path():
    """`decode_at` reads cos and sin from the RoPE table: a step with a position past it
    is left to `__call__`, which asks the rotary module (the C call refuses such a position
    too)."""
    loaded = tiny_model.attentive("llama", num_heads=2, num_kv_heads=1)
    loaded.model.to(torch.bfloat16)
    runner = ModelRunner(loaded, 60, 4, "own")
    forward = runner._forward
    assert forward is not None and forward._rope_table is not None
    cos, sin = forward._rope_table
    forward = copy.copy(forward)
    forward._rope_table = (cos[:12], sin[:12])
    args = ([5], [12], [12], [[0, 1, 2, 3]], [13], [(0, 1)], runner._k_pool, runner._v_pool, True)
    assert forward.decode_at(*args) is None
    with pytest.raises(IndexError, match="RoPE table"):
        forward.decode_layers.step_at(*args[:6], forward._rope_table, *args[6:])
    assert forward.decode_at([5], [11], *args[2:]) is not None


def test_a_token_outside_the_embedding_fails_the_step_and_writes_nothing():
    """The C step reads the embedding at each token id: one past its rows is refused before
    anything is read or written (as `F.embedding` raises for it)."""
    loaded = tiny_model.attentive("llama", num_heads=2, num_kv_heads=1, vocab_size=512)
    loaded.model.to(torch.bfloat16)
    runner = ModelRunner(loaded, 8, 4, "own")
    forward = runner._forward
    assert forward is not None and forward.decode_layers is not None
    k_pool, v_pool = runner._k_pool.clone(), runner._v_pool.clone()
    cos, sin = forward._rope(torch.tensor([3]))
    group = decode_group(0, torch.tensor([[0]]), torch.tensor([4]))
    with pytest.raises(IndexError):
        forward.decode_layers.step(
            torch.tensor([512]), cos, sin, torch.tensor([3]), k_pool, v_pool, [group]
        )
    assert torch.equal(k_pool, runner._k_pool) and torch.equal(v_pool, runner._v_pool)
    logits = forward.decode_layers.step(
        torch.tensor([511]), cos, sin, torch.tensor([3]), k_pool, v_pool, [group]
    )
    assert logits.shape == (1, 512) and not torch.equal(k_pool, runner._k_pool)


@pytest.mark.skipif(
    not llama.amx_matmuls_available() and not llama.pair_matmuls_available(),
    reason="the tiled matmuls need a CPU with AMX or AVX512-BF16",
)
def test_with_tiled_matmuls_the_decode_layers_take_any_number_of_rows_bit_for_bit(monkeypatch):
    loaded = tiny_model.attentive("llama", num_heads=2, num_kv_heads=1)
    loaded.model.to(torch.bfloat16)
    if not llama.amx_matmuls_available():  # past 8 rows the decode layers take the pair kernel
        call = llama._Linear.__call__
        monkeypatch.setattr(
            llama._Linear,
            "__call__",
            lambda linear, x: linear.matmul_pairs(x) if len(x) > 8 else call(linear, x),
        )
    prompts = [[1000 + i, 2000 + 3 * i] for i in range(20)]  # short: all twenty decode at once
    logits_in_c, tokens_in_c, _ = _serve(loaded, prompts, "decode_at", 400, max_num_seqs=20)
    logits, tokens, _ = _serve(loaded, prompts, "python", 400, max_num_seqs=20)
    assert tokens_in_c == tokens
    for got, expected in zip(logits_in_c, logits, strict=True):
        assert torch.equal(got, expected)
    assert max(step.shape[0] for step in logits_in_c) == 16  # the test engine's 16-token budget


def test_decode_layers_are_built_only_where_they_can_run(monkeypatch):
    loaded = tiny_model.attentive("llama", num_heads=2, num_kv_heads=1)
    loaded.model.to(torch.bfloat16)
    decode_layers = llama.LlamaForward(loaded.model).decode_layers
    # any number of rows with the tiled matmuls, else the few-row kernel's 8
    tiled = llama.amx_matmuls_available() or llama.pair_matmuls_available()
    expected_rows = cpu_decode.MAX_ROWS_TILED if tiled else 8
    assert decode_layers is not None and decode_layers.max_rows == expected_rows
    monkeypatch.setenv("LLMFLEET_CPU_DECODE_LAYERS", "0")
    assert llama.LlamaForward(loaded.model).decode_layers is None
    monkeypatch.delenv("LLMFLEET_CPU_DECODE_LAYERS")
    loaded.model.to(torch.float32)
    assert DecodeLayers.for_forward(llama.LlamaForward(loaded.model)) is None
