"""CUDA-graph bucketing and padding (the parts that run on the host), and the CPU staying eager."""
import numpy as np
import pytest
import torch

from engine.cuda_graphs import capture_sizes, graphs_wanted, pad_decode_inputs, padded_size


def test_capture_sizes_follow_vllm():
    sizes = capture_sizes(1024)
    assert sizes[:5] == [1, 2, 4, 8, 16] and sizes[-1] == 512
    assert 248 in sizes and 256 in sizes and 264 not in sizes and 272 in sizes
    assert capture_sizes(2) == [1, 2]
    assert capture_sizes(100)[-2:] == [96, 100]                 # the cap itself is captured
    assert sizes == sorted(set(sizes))


@pytest.mark.parametrize("n,expected", [(1, 1), (3, 4), (5, 8), (9, 16), (250, 256), (257, 272), (512, 512),
                                        (513, None)])
def test_padded_size(n, expected):
    assert padded_size(n, capture_sizes(1024)) == expected


def test_every_batch_up_to_the_cap_has_a_graph_with_little_padding():
    sizes = capture_sizes(512)
    for n in range(1, 513):
        size = padded_size(n, sizes)
        assert n <= size <= max(n + 15, 2 * n - 1 if n < 8 else n + 15)


def test_padding_rows_write_nothing_and_read_one_token():
    padded = pad_decode_inputs(np.array([5, 6]), np.array([40, 9]), np.array([123, 77]),
                               np.array([41, 10], dtype=np.int32), 4)
    assert padded["input_ids"].tolist() == [5, 6, 0, 0]
    assert padded["positions"].tolist() == [40, 9, 0, 0]
    assert padded["slot_mapping"].tolist() == [123, 77, -1, -1]
    assert padded["seq_lens"].tolist() == [41, 10, 1, 1] and padded["seq_lens"].dtype == np.int32
    with pytest.raises(ValueError):
        pad_decode_inputs(np.zeros(5), np.zeros(5), np.zeros(5), np.zeros(5), 4)


def test_cpu_and_sampling_stay_eager(monkeypatch):
    assert not graphs_wanted(torch.device("cpu"), "triton", 0.0)
    assert not graphs_wanted(torch.device("cuda"), "torch", 0.0)
    assert not graphs_wanted(torch.device("cuda"), "triton", 0.7)
    assert graphs_wanted(torch.device("cuda"), "triton", 0.0)
    monkeypatch.setenv("KVTWIN_CUDA_GRAPHS", "0")
    assert not graphs_wanted(torch.device("cuda"), "triton", 0.0)


def test_a_cpu_runner_captures_nothing():
    from engine.runner import ModelRunner
    from engine.weights import build_model
    from sim.core.catalog import get_model

    runner = ModelRunner(build_model(get_model("tiny"), "cpu"), 9, 16, 64)
    assert runner.capture_graphs(8) == 0 and runner.graphs is None


class _ReplayEagerly:
    """Stands in for a captured graph on CPU: replay re-runs the captured forward into the
    same output tensors, so the static buffers, padding and keys are what is tested."""

    def __init__(self, graphs, size, max_seq_len):
        self.graphs, self.size, self.max_seq_len = graphs, size, max_seq_len
        self.logits, self.sampled = graphs._forward(size, max_seq_len)

    def replay(self):
        logits, sampled = self.graphs._forward(self.size, self.max_seq_len)
        self.logits.copy_(logits)
        self.sampled.copy_(sampled)


@pytest.fixture
def triton_runner():
    """The tiny model's runner on CPU with the Triton backend (interpreted): 17 blocks of 16,
    max_model_len 64. Skips where Triton kernels cannot run."""
    from engine.kernels import triton_available
    from engine.runner import ModelRunner
    from engine.weights import build_model
    from sim.core.catalog import get_model

    if not triton_available():
        pytest.skip("Triton kernels cannot run here")
    return ModelRunner(build_model(get_model("tiny"), "cpu", attention_backend="triton"), 17, 16, 64)


@pytest.fixture
def cpu_graphs():
    """Builds DecodeGraphs for a runner whose captures are _ReplayEagerly stand-ins."""
    from engine.cuda_graphs import DecodeGraphs

    class CpuGraphs(DecodeGraphs):
        def _capture(self, size, max_seq_len):
            fake = _ReplayEagerly(self, size, max_seq_len)
            return fake, fake.logits, fake.sampled
    return CpuGraphs


def test_the_graph_path_matches_eager_steps_on_cpu(triton_runner, cpu_graphs):
    """The runner's graph path (inputs into static buffers, padded to 4, rows cut back to 3)
    against its eager path, with the Triton backend interpreted."""
    from sim.core.kv import KVCacheManager
    from validate.calibrate import probe_batch

    runner = triton_runner
    torch.manual_seed(0)
    pool = torch.randn_like(runner.kv_cache)
    graphs = cpu_graphs(runner, 4)
    assert graphs.capture_all() == 3 and graphs.sizes == [1, 2, 4]      # no split below 512 tokens
    logits = {}
    for mode, g in (("eager", None), ("graph", graphs)):
        runner.kv_cache.copy_(pool)
        runner.graphs = g
        kv = KVCacheManager(runner.num_blocks, 16, enable_caching=False)
        batch = probe_batch(kv, [(40, 1, True), (17, 1, True), (5, 1, True)], tag=0)
        assert (runner._graph_for(batch, [0, 1, 2]) is not None) == (g is not None)
        result = runner.execute(batch)
        logits[mode] = result.logits
    assert logits["graph"].shape == (3, 1024)
    torch.testing.assert_close(logits["graph"], logits["eager"], atol=1e-5, rtol=1e-5)


def test_a_static_batch_padding_row_rides_in_the_graph_on_cpu(triton_runner, cpu_graphs):
    """A static batch's decode step with a finished member: the graph runs both rows (live,
    then padding) and hands back the live row's logits, equal to the eager path's."""
    from sim.core.kv import KVCacheManager
    from sim.core.request import make_request
    from sim.core.scheduler import SchedulerConfig
    from sim.core.scheduler_variants import make_scheduler

    runner = triton_runner
    graphs = cpu_graphs(runner, 2)
    graphs.capture_all()
    logits = {}
    for mode, g in (("eager", None), ("graph", graphs)):
        runner.kv_cache.zero_()
        runner.graphs = g
        scheduler = make_scheduler(SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=64, max_model_len=64,
                                              batching="static"),
                              KVCacheManager(runner.num_blocks, 16, enable_caching=False, max_model_len=64))
        for i, (prompt, output) in enumerate([(20, 1), (9, 3)]):
            scheduler.add(make_request(i, 0.0, [(50 + i, prompt)], output))
        scheduler.finish_step(scheduler.schedule())          # the padded prefill; request 0 is done
        batch = scheduler.schedule()
        assert len(batch.decodes) == 1 and batch.pad_rows == 1 and batch.pad_len == 21
        assert (runner._graph_for(batch, [0], 2, 21) is not None) == (g is not None)
        result = runner.execute(batch)
        assert result.rows == 2 and list(result.sampled) == [1]
        logits[mode] = result.logits
    assert logits["graph"].shape == (1, 1024)
    torch.testing.assert_close(logits["graph"], logits["eager"], atol=1e-5, rtol=1e-5)
    assert not runner.kv_cache[:, :, 0].any()
