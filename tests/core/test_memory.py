"""KV memory arithmetic: every worked number of docs/primer.md, and vLLM's sizing rules."""
import pytest

from sim.core.catalog import MIB, get_model
from sim.core.memory import (InsufficientMemoryError, blocks_for_tokens, kv_bytes_per_block,
                        kv_bytes_per_token, kv_heads_per_rank, plan_memory, slack_tokens,
                        unused_slots)
from sim.scenario import validate_scenario


def test_primer_paging_example_35_17_64():
    lengths = [35, 17, 64]
    assert [blocks_for_tokens(n, 16) for n in lengths] == [3, 2, 4]
    assert [unused_slots(n, 16) for n in lengths] == [13, 15, 0]


def test_primer_paging_example_17_33_64():
    lengths = [17, 33, 64]
    assert [blocks_for_tokens(n, 16) * 16 for n in lengths] == [32, 48, 64]
    assert slack_tokens(lengths, 16) == 30


def test_primer_single_sequences():
    assert (blocks_for_tokens(35, 16), blocks_for_tokens(35, 16) * 16, unused_slots(35, 16)) == (3, 48, 13)
    assert blocks_for_tokens(33, 16) == 3 and 33 - 2 * 16 == 1  # the last block holds 1 token


def test_qwen25_05b_bytes_per_token():
    assert kv_bytes_per_token(get_model("qwen2.5-0.5b")) == 12_288


@pytest.mark.parametrize("name, per_token", [
    ("llama-3.1-8b", 131_072),       # docs/vllm_semantics.md section 1: 128 KiB per token
    ("qwen3-0.6b", 112 * 1024),
    ("llama-2-7b", 512 * 1024),
])
def test_vllm_table_bytes_per_token(name, per_token):
    assert kv_bytes_per_token(get_model(name)) == per_token


def test_block_bytes_llama31_8b():
    assert kv_bytes_per_block(get_model("llama-3.1-8b"), 16) == 2 * MIB


def test_tensor_parallel_splits_then_replicates_kv_heads():
    model = get_model("llama-3.1-70b")  # 8 KV heads
    assert [kv_heads_per_rank(model, tp) for tp in (1, 2, 8, 16)] == [8, 4, 1, 1]
    assert kv_bytes_per_token(model, 16) == kv_bytes_per_token(model, 8)


def scenario(**engine):
    return validate_scenario({"model": "qwen2.5-0.5b", "device": "h200", "engine": engine})


def test_blocks_from_budget_are_whole_blocks_of_what_is_left():
    s = scenario(gpu_memory_utilization=0.9, max_model_len=4096)
    plan = plan_memory(s)
    left = plan.budget_bytes - plan.weight_bytes - plan.activation_bytes - plan.reserved_bytes
    assert plan.num_blocks == left // plan.block_bytes
    assert plan.usable_blocks == plan.num_blocks - 1  # block 0 is vLLM's null block
    # vLLM's "GPU KV cache size" counts the null block (kv_cache_utils.py _report_kv_cache_config)
    assert plan.max_tokens == plan.num_blocks * 16


def test_num_blocks_override_wins():
    assert plan_memory(scenario(num_blocks=100, max_model_len=512)).num_blocks == 100


def test_refuses_to_start_when_one_max_len_request_cannot_fit():
    with pytest.raises(InsufficientMemoryError, match=r"max_model_len 4096 needs 256 blocks.*short by"):
        plan_memory(scenario(num_blocks=100, max_model_len=4096))


def test_tight_budget_reports_the_largest_length_that_fits():
    s = validate_scenario({"model": "llama-3.1-8b", "device": "l4",
                           "engine": {"gpu_memory_utilization": 0.9}})
    with pytest.raises(InsufficientMemoryError) as err:
        plan_memory(s)
    assert "weights" in str(err.value) and "largest max_model_len that fits" in str(err.value)


def test_tp_halves_weights_and_kv_per_gpu():
    base = {"model": "llama-3.1-8b", "device": "l4", "engine": {"max_model_len": 8192}}
    one = plan_memory(validate_scenario({**base, "device": "h100-sxm"}))
    two = plan_memory(validate_scenario({**base, "device": "h100-sxm", "parallelism": {"tp": 2}}))
    assert two.kv_bytes_per_token * 2 == one.kv_bytes_per_token
    assert abs(two.weight_bytes * 2 - one.weight_bytes) <= 1
    assert two.num_blocks > one.num_blocks


def test_weight_count_of_qwen25_05b_matches_the_published_size():
    # Qwen2.5-0.5B: 0.49B parameters (model card), tied embeddings.
    assert 0.48e9 < get_model("qwen2.5-0.5b").num_params() < 0.50e9
    assert 7.9e9 < get_model("llama-3.1-8b").num_params() < 8.1e9
