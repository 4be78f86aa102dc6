"""The routers people deploy in front of vLLM, each as its source scores replicas: llm-d's endpoint
picker (llm_d.py), NVIDIA Dynamo's KV router (dynamo.py), SGLang's cache-aware router (sglang.py);
their settings (config.py), the state they share (state.py) and prefix-aware routing regret
(regret.py). `sim.routers.factory.make_router` picks one from `cluster.router`; docs/whatif/routers.md."""
