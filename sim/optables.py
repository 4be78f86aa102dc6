"""Measured operator tables as a step-time source (`step_times: tables` in a scenario).

NVIDIA's AIConfigurator data (`pip install 'kvtwin[tables]'`, package aiconfigurator-core,
Apache-2.0) holds latencies measured with vLLM per GPU: bf16 GEMMs over an (m, n, k) grid,
FlashAttention-3 context attention over (batch, sequence length, heads, KV heads, head dim) and
generation attention over (batch, context length, ...). A step is priced on kvtwin's exact
composition, per layer:

    gemm(tokens, q+2kv, hidden) + gemm(tokens, hidden, q) + gemm(tokens, 2 x intermediate, hidden)
    + gemm(tokens, hidden, intermediate)
    + context attention of each prefill chunk (against its cached context: the table's cost for
      the whole sequence, scaled by the chunk's share of the causal query-key pairs)
    + generation attention of the decodes (batch, mean context)
    + the roofline's per-layer launch, per-block and tp all-reduce terms
plus the LM head gemm(rows, vocab / tp, hidden) and the roofline's per-step device terms. Host
terms and async overlap are the cost model's. Every lookup interpolates log-latency linearly in
log-size on the table's grid (clamped at its edges) and is memoized per distinct size, so a run
costs a few thousand interpolations, not one per step.
"""
from __future__ import annotations

import math
from functools import lru_cache
from pathlib import Path

import numpy as np

# catalog device -> (AIConfigurator system, note when it is a stand-in)
SYSTEMS = {"h100-sxm": ("h100_sxm", None), "h200": ("h200_sxm", None), "a100-80g": ("a100_sxm", None),
           "a100-40g": ("a100_sxm", "A100 SXM 80GB tables stand in for the 40GB part (its HBM is ~25% slower)"),
           "l40s": ("l40s", None)}


class TablesUnavailable(ValueError):
    """The operator tables cannot price this scenario (package missing, device or shape not covered)."""


def data_root() -> Path:
    try:
        import aiconfigurator_core
    except ImportError:
        raise TablesUnavailable("step_times: tables needs the optional package aiconfigurator-core "
                                "(pip install 'kvtwin[tables]'; Linux x86-64, Python 3.11-3.13)") from None
    return Path(aiconfigurator_core.__file__).parent / "systems" / "data"


def table_version(system: str) -> str:
    folder = data_root() / system / "gemm" / "vllm"
    versions = sorted((p.name for p in folder.iterdir() if p.is_dir()),
                      key=lambda v: tuple(int(x) for x in v.split(".") if x.isdigit())) if folder.exists() else []
    if not versions:
        raise TablesUnavailable(f"no vLLM operator tables for {system}")
    return versions[-1]


def _grid(points: np.ndarray, values: np.ndarray, axes: int):
    """A regular log-log grid from scattered (size..., latency) rows (missing cells: nearest in the
    first axis)."""
    from scipy.interpolate import RegularGridInterpolator

    coords = [np.unique(points[:, a]) for a in range(axes)]
    cube = np.full([len(c) for c in coords], np.nan)
    index = tuple(np.searchsorted(coords[a], points[:, a]) for a in range(axes))
    cube[index] = values
    if np.isnan(cube).any():
        filled = np.moveaxis(cube, 0, -1)
        for idx in np.ndindex(filled.shape[:-1]):
            line = filled[idx]
            ok = ~np.isnan(line)
            if ok.any() and not ok.all():
                line[~ok] = np.interp(np.flatnonzero(~ok), np.flatnonzero(ok), line[ok])
        cube = np.moveaxis(filled, -1, 0)
    return RegularGridInterpolator([np.log(c) for c in coords], np.log(cube), bounds_error=False, fill_value=None)


class OperatorTables:
    """Latency lookups for one GPU and one model shape (per tp rank), in seconds."""

    def __init__(self, device_name: str, model, tp: int = 1, max_tokens: int = 8192, max_seqs: int = 1024,
                 max_len: int = 131072):
        if device_name not in SYSTEMS:
            raise TablesUnavailable(f"no operator tables for device '{device_name}' "
                                    f"(covered: {', '.join(sorted(SYSTEMS))})")
        if model.dtype != "bfloat16":
            raise TablesUnavailable(f"operator tables are loaded for bfloat16 only, not {model.dtype}")
        unsupported = [what for what, present in (
            ("quantized weights", getattr(model, "quantization", None) is not None),
            ("MoE layers", getattr(model, "num_experts", 0) > 0),
            ("sliding-window attention", getattr(model, "sliding_window", None) is not None)) if present]
        if unsupported:
            raise TablesUnavailable(f"operator tables price dense bf16 full-attention models only; this one has "
                                    f"{', '.join(unsupported)} (use step_times: datasheet)")
        self.system, self.note = SYSTEMS[device_name]
        self.version = table_version(self.system)
        self.model, self.tp = model, tp
        import pandas as pd

        base = data_root() / self.system
        gemm = pd.read_parquet(base / "gemm" / "vllm" / self.version / "gemm_perf.parquet")
        gemm = gemm[gemm["gemm_dtype"] == "bfloat16"]
        self._gemm = _grid(gemm[["m", "n", "k"]].to_numpy(float), gemm["latency"].to_numpy(float), 3)
        heads, kv = model.num_heads // tp, max(1, model.num_kv_heads // tp)
        self._context = self._attention(base / "attention" / "vllm" / self.version / "context_attention_perf.parquet",
                                        heads, kv, "isl")
        self._generation = self._attention(base / "attention" / "vllm" / self.version /
                                           "generation_attention_perf.parquet", heads, kv, "step")
        h, d = model.hidden_size, model.head_dim
        q, kvd, inter = heads * d, kv * d, model.intermediate_size // tp
        self._layer_gemms = ((q + 2 * kvd, h), (h, q), (2 * inter, h), (h, inter))
        self._head = (model.vocab_size // tp, h)
        self.context_s = lru_cache(maxsize=None)(self._context_s)
        # every size a step can have, priced once with vectorized lookups: a step is then a few
        # array reads (the simulator must stay within 1.5x of its roofline speed)
        tokens = np.arange(1, max_tokens + max_seqs + 1, dtype=float)
        self._linear = np.concatenate([[0.0], sum(self._lookups(self._gemm, tokens, n, k)
                                                   for n, k in self._layer_gemms)])
        rows = np.arange(1, max_seqs + 1, dtype=float)
        self._heads = np.concatenate([[0.0], self._lookups(self._gemm, rows, *self._head)])
        self._buckets = np.array(sorted({bucket(x) for x in np.geomspace(1, max(max_len, 2), 4000)}))
        batch, ctx = np.meshgrid(rows, self._buckets, indexing="ij")
        self._decode = self._lookups(self._generation, batch.ravel(), ctx.ravel()).reshape(batch.shape)

    def _attention(self, path: Path, heads: int, kv: int, length: str):
        import pandas as pd

        table = pd.read_parquet(path)
        for column, value in (("attn_dtype", "bfloat16"), ("kv_cache_dtype", "bfloat16"), ("window_size", 0)):
            if column in table:          # older collections (A100, vLLM 0.14) lack some columns
                table = table[table[column] == value]
        if "kernel_source" in table:     # one kernel family (the most measured) for the whole grid
            table = table[table["kernel_source"] == table["kernel_source"].mode()[0]]
        table = table[table["head_dim"] == self._nearest(table["head_dim"], self.model.head_dim, "head_dim")]
        table = table[table["num_heads"] == self._nearest(table["num_heads"], heads, "heads")]
        table = table[table["num_key_value_heads"] == self._nearest(table["num_key_value_heads"], kv, "KV heads")]
        if table.empty:
            raise TablesUnavailable(f"{path.name}: no rows for this model's attention shape")
        return _grid(table[["batch_size", length]].to_numpy(float), table["latency"].to_numpy(float), 2)

    @staticmethod
    def _nearest(column, value: int, what: str) -> int:
        options = np.unique(column.to_numpy())
        best = options[np.argmin(np.abs(np.log(options / value)))]
        if best != value and what == "head_dim":
            raise TablesUnavailable(f"no attention rows for head_dim {value} (tables have {list(options)})")
        return int(best)

    def _lookup(self, grid, *sizes: float) -> float:
        return float(np.exp(grid([np.log(np.maximum(sizes, 1.0))])[0])) * 1e-3      # tables hold ms

    @staticmethod
    def _lookups(grid, *columns) -> np.ndarray:
        """Vectorized: one latency (s) per row of the size columns (scalars broadcast)."""
        cols = np.broadcast_arrays(*[np.asarray(c, dtype=float) for c in columns])
        points = np.log(np.maximum(np.column_stack([c.ravel() for c in cols]), 1.0))
        return np.exp(grid(points)) * 1e-3

    def linear_s(self, tokens: int) -> float:
        """One layer's four GEMMs over `tokens` rows."""
        if tokens >= len(self._linear):
            return self._lookups(self._gemm, [tokens] * 4, *zip(*self._layer_gemms)).sum()
        return self._linear[tokens]

    def head_s(self, rows: int) -> float:
        return self._heads[rows] if rows < len(self._heads) else self._lookup(self._gemm, rows, *self._head)

    def generation_s(self, decodes: int, context: int) -> float:
        """The decode batch's attention at its (bucketed) mean context, one layer."""
        j = np.searchsorted(self._buckets, context)
        if decodes < len(self._decode) + 1 and j < len(self._buckets) and self._buckets[j] == context:
            return self._decode[decodes - 1, j]
        return self._lookup(self._generation, decodes, context)

    def _context_s(self, chunk: int, cached: int) -> float:
        """One prefill chunk's attention against `cached` earlier tokens (one layer)."""
        total = chunk + cached
        whole = self._lookup(self._context, 1, total)
        pairs = chunk * cached + chunk * (chunk + 1) / 2
        return whole * pairs / (total * (total + 1) / 2)

    def describe(self) -> str:
        note = f"; {self.note}" if self.note else ""
        return f"operator tables (aiconfigurator-core, vLLM {self.version} on {self.system}{note})"


def bucket(context: float) -> int:
    """Mean decode context, rounded to 1/16 of its power of two: memoization keys stay few."""
    if context <= 16:
        return max(1, int(round(context)))
    step = 2 ** (int(math.log2(context)) - 4)
    return int(round(context / step) * step)




_PRICED: dict[tuple, OperatorTables] = {}


def tables_for(device_name: str, model, tp: int, max_tokens: int, max_seqs: int, max_len: int) -> OperatorTables:
    """One priced table set per deployment shape (a sweep's points share it)."""
    key = (device_name, model.model_dump_json(exclude={"name", "weights"}), tp, max_tokens, max_seqs, max_len)
    if key not in _PRICED:
        if len(_PRICED) >= 16:
            _PRICED.pop(next(iter(_PRICED)))
        _PRICED[key] = OperatorTables(device_name, model, tp, max_tokens, max_seqs, max_len)
    return _PRICED[key]

__all__ = ["OperatorTables", "TablesUnavailable", "bucket", "tables_for", "SYSTEMS"]
