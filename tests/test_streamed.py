

def test_more_requests_than_memory_holds_need_spilling():
    path, overrides = CASES["fleet"]
    scenario = load_scenario(ROOT / "scenarios" / path, [*overrides, "workload.num_requests=1000001"])
    with pytest.raises(ValueError, match=r"workload.num_requests: 1,000,001 .*--spill-records"):
        predict(scenario)
