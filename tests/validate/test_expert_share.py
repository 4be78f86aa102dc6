"""validate.lodo's pooled expert serial share (V0_EXPERT_POOLED): the fused-MoE kernel's unhidden share
is one value of vLLM 0.7.3's kernel, fitted on the V0 MoE runs of every GPU pooled, and a fold's share
never sees its held-out deployment's runs. Synthetic runs: each one's predicted metrics are its measured
ones times a factor of the share, exp(share - the share its GPU wants) (nothing is simulated)."""
import math
from types import SimpleNamespace

import pytest

from validate import lodo

HOST = {"step_host_s": 2e-3, "seq_host_s": 1e-4, "prefill_seq_host_s": 4e-4, "eager_layer_host_s": 9e-4}
MIXTRAL = "mistralai/Mixtral-8x7B-Instruct-v0.1 / {} / tp 8 / vLLM 0.7.3"
LLAMA = "meta-llama/Meta-Llama-3-70B-Instruct / H200-SXM-141GB / tp 8 / vLLM 0.7.3"
# the share each GPU's Mixtral runs are priced right at
WANTED = {"A100-SXM4-40GB": 0.8, "H200-SXM-141GB": 0.4, "RTX-A6000": 0.6}


def fake_run(deployment: str, i: int, moe: bool) -> lodo.Run:
    scenario = SimpleNamespace(engine_generation="v0", model=SimpleNamespace(is_moe=moe))
    return lodo.Run(id=f"{deployment} #{i}", deployment=deployment, gpu_class=deployment.split(" / ")[1],
                    scenario=scenario, requests=[], measured={"ttft_mean": 1.0, "tpot_mean": 1.0},
                    source="test", api_server=False)


def fake_runs() -> list:
    return ([fake_run(MIXTRAL.format(gpu), i, True) for gpu in WANTED for i in range(2)]
            + [fake_run(LLAMA, i, False) for i in range(2)])


@pytest.fixture
def predicted(monkeypatch):
    """The runs predict() was asked for, each run off by the distance of the share from its GPU's WANTED."""
    asked = []

    def predict(run, coefficients=None, *_, **__):
        asked.append(run.deployment)
        share = coefficients.expert_serial_share
        factor = math.exp(share - WANTED.get(run.gpu_class, share))     # log errors quadratic in the share
        return {k: v * factor for k, v in run.measured.items()}

    monkeypatch.setattr(lodo, "predict", predict)
    monkeypatch.setattr(lodo, "_EXPERT_SHARES", {})
    monkeypatch.setattr(lodo, "_FOLD_STATE", {})
    monkeypatch.setattr(lodo, "pooled_v0_host", lambda runs, without_model=None, progress=None: dict(HOST))
    return asked


def test_a_mixtral_folds_share_is_fitted_on_the_other_gpus_runs_only(predicted):
    runs = fake_runs()
    held = MIXTRAL.format("A100-SXM4-40GB")
    share = lodo.pooled_expert_share(runs, HOST, held, progress=lambda *_: None)
    assert held not in predicted and LLAMA not in predicted, "only the other MoE deployments' runs"
    assert share == pytest.approx((0.4 + 0.6) / 2, abs=1e-6)      # H200's and RTX A6000's wanted, pooled
    predicted.clear()
    assert lodo.pooled_expert_share(runs, HOST, progress=lambda *_: None) == pytest.approx(0.6, abs=1e-6)
    assert set(predicted) == {MIXTRAL.format(gpu) for gpu in WANTED}, "the family's share: every MoE run"


def test_the_switch_puts_the_folds_share_in_what_the_v0_class_fits_hold_fixed(predicted, monkeypatch):
    runs = fake_runs()
    held = MIXTRAL.format("H200-SXM-141GB")
    monkeypatch.setattr(lodo, "V0_EXPERT_POOLED", False)
    assert lodo.v0_fixed(runs, held, progress=lambda *_: None) == HOST, "off: the pooled host profile alone"
    assert not predicted
    assert "pooled expert serial" not in lodo._fit_tag("v0")
    monkeypatch.setattr(lodo, "V0_EXPERT_POOLED", True)
    fixed = lodo.v0_fixed(runs, held, progress=lambda *_: None)
    assert fixed == {**HOST, "expert_serial_share": pytest.approx((0.8 + 0.6) / 2, abs=1e-6)}
    assert held not in predicted
    assert "pooled expert serial" in lodo._fit_tag("v0") and "pooled expert serial" not in lodo._fit_tag("v1")


def test_a_kept_share_is_named_by_its_runs_and_host_profile(predicted, tmp_path, monkeypatch):
    """--resume: a share fitted over another host profile (or other runs) is never handed back."""
    runs = fake_runs()
    monkeypatch.setattr(lodo, "_FOLD_STATE", {"resume": tmp_path})
    first = lodo.pooled_expert_share(runs, HOST, progress=lambda *_: None)
    monkeypatch.setattr(lodo, "_EXPERT_SHARES", {})
    predicted.clear()
    assert lodo.pooled_expert_share(runs, HOST, progress=lambda *_: None) == first and not predicted
    lodo.pooled_expert_share(runs, {**HOST, "step_host_s": 3e-3}, progress=lambda *_: None)
    assert predicted, "another host profile: refitted"
    assert len(list(tmp_path.glob("share-*.json"))) == 2
