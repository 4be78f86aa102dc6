"""Reading what a real vLLM deployment leaves behind: benchmark result files, logs, flags."""
