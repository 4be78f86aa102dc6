"""vLLM interop: its serve flags, result files and server logs / metrics read into kvtwin's terms."""
