"""vLLM interop: its serve flags, benchmark result files and server logs / metrics read into kvtwin's terms."""
