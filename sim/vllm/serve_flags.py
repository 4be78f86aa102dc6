"""`vllm serve MODEL --flag ...` -> a kvtwin scenario, every flag accounted for.

Each flag of the command lands in exactly one of three lists:
  mapped    a flag kvtwin models: its value is written to a scenario field (MODELLED below)
  ignored   a flag vLLM has that does not change what kvtwin predicts, or that kvtwin does
            not model yet; the reason is given (IGNORED below)
  unknown   a flag this table does not know (a newer vLLM, a plugin, a typo); a name close
            to a modelled flag is an error instead ("did you mean"), since a misspelt
            --max-num-seq would otherwise silently fall back to the default
vLLM spellings accepted: `--flag value`, `--flag=value`, underscores for dashes
(`--max_model_len`), `--no-flag` for booleans, `--config FILE.yaml` (its keys are flag names;
the command line wins), and the prefixes `vllm serve` or `python -m vllm.entrypoints.openai.api_server`.
The flag names and defaults follow vLLM's engine arguments (docs.vllm.ai, "Engine Arguments",
v0.8-v0.21); docs/vllm_semantics.md lists the flags and the release each behaviour follows.
"""
from __future__ import annotations

import argparse
import difflib
import json
import math
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import yaml

from sim.core.files import FileFormatError, excerpt, printable, read_yaml
from sim.errors import UserError
from sim.output.run_dir import check_out_file, out_file_arg
from sim.vllm import kv_offload_flags, lora_flags
from sim.vllm.kv_offload_flags import offloading_size


# ----------------------------------------------------------------------------- value parsers

def _number(text: str, expected: str) -> float:
    """float(text), with an error saying what the flag expects instead of Python's own message."""
    try:
        return float(text)
    except ValueError:
        raise ValueError(f"{excerpt(text)}: {expected}") from None


def _human_int(text: str) -> int:
    """vLLM's human_readable_int: 1k = 1000, 1K = 1024 (and m/M, g/G, t/T); 25.6k = 25600; plain integers."""
    units = {"k": 10 ** 3, "m": 10 ** 6, "g": 10 ** 9, "t": 10 ** 12,
             "K": 2 ** 10, "M": 2 ** 20, "G": 2 ** 30, "T": 2 ** 40}
    text = text.strip()
    scale = units.get(text[-1:], 1)
    number = text[:-1] if scale != 1 else text
    if "." in number and text[-1:] in "KMGT":
        raise ValueError(f"{excerpt(text)}: decimals only go with the decimal suffixes k, m, g, t (as vLLM reads it)")
    if not _is_number(number):
        raise ValueError(f"{excerpt(text)}: expected a whole number, e.g. 4096, 32k (32,000) or 32K (32,768)")
    value = float(number) * scale
    if not math.isfinite(value):         # 1e400 reads as inf: no int holds it
        raise ValueError(f"{excerpt(text)} is not a finite number")
    if value != int(value):
        raise ValueError(f"{excerpt(text)} is not a whole number")
    return int(value)


def _int(text: str) -> int:
    """A plain integer flag; a 5,000-digit one is refused by its length, not by Python's digit limit."""
    if len(text.strip()) > 30:
        raise ValueError(f"{excerpt(text)} is not an integer of a sensible size")
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"{excerpt(text)}: expected an integer") from None


def _fraction(text: str) -> float:
    value = _number(text, "expected a number, e.g. 0.9")
    if not math.isfinite(value):
        raise ValueError(f"{excerpt(text)} is not a finite number")
    return value


def _bool(text: str) -> bool:
    low = text.strip().lower()
    if low in ("true", "1", "yes", "on"):
        return True
    if low in ("false", "0", "no", "off"):
        return False
    raise ValueError(f"{excerpt(text)} is not true or false")


def _choice(*allowed: str) -> Callable[[str], str]:
    def parse(text: str) -> str:
        if text not in allowed:
            raise ValueError(f"{excerpt(text)} is not one of {', '.join(allowed)}")
        return text
    return parse


_DTYPES = {"half": "float16", "float16": "float16", "bfloat16": "bfloat16", "float": "float32",
           "float32": "float32"}


def _dtype(text: str) -> Optional[str]:
    """--dtype auto keeps the checkpoint's dtype (the catalog's): None = leave the field alone."""
    if text == "auto":
        return None
    if text not in _DTYPES:
        raise ValueError(f"{excerpt(text)} is not one of auto, {', '.join(_DTYPES)}")
    return _DTYPES[text]


_QUANT = {"fp8": {"method": "fp8", "scales": "tensor"},      # vLLM quantizes a 16-bit checkpoint per tensor
          "awq": {"method": "awq"}, "awq_marlin": {"method": "awq"}, "gptq": {"method": "gptq"},
          "gptq_marlin": {"method": "gptq"}, "mxfp4": {"method": "mxfp4", "experts_only": True}}


def _speculative_config(text: str) -> dict:
    """--speculative-config JSON -> engine.speculative's fields: the method (`_speculative_method`),
    num_speculative_tokens and the draft model (sim/speculative.py; `_speculative_section` settles
    what the scenario can take)."""
    config = _json_object(text)
    out: dict[str, Any] = {"method": _speculative_method(config)}
    k = config.get("num_speculative_tokens")
    if k is not None:
        try:
            out["num_speculative_tokens"] = int(k)
        except (TypeError, ValueError):
            raise ValueError(f"num_speculative_tokens {excerpt(str(k), 40)} is not an integer") from None
    if config.get("model"):
        out["model"] = str(config["model"])[:200]
    other = sorted(str(key)[:40] for key in config if key not in ("method", "num_speculative_tokens", "model"))
    if other:               # (reported by _speculative_section, then dropped)
        out[_OTHER_KEYS] = other[:20]
    return out


_OTHER_KEYS = "(other keys)"


def _json_object(text: str) -> dict:
    import json

    try:
        config = json.loads(text) if len(text) <= 10_000 else None
    except ValueError:
        config = _unquoted_object(text)
    if not isinstance(config, dict):
        raise ValueError("expected a JSON object such as '{\"method\": \"eagle\", \"model\": ...}'")
    return config


def _speculative_method(config: dict) -> str:
    """A --speculative-config object's method, as vLLM 0.19 config/speculative.py infers it when
    unset: "ngram" for model ngram, eagle / eagle3 from the draft's name, else draft_model; the
    MTP family is renamed mtp."""
    method, model = config.get("method"), str(config.get("model") or "").lower()
    if method is None:
        if model in ("ngram", "[ngram]"):
            method = "ngram"
        elif "eagle-" in model:
            method = "eagle"
        elif "eagle3" in model:
            method = "eagle3"
        else:
            method = "draft_model"
    method = str(method)
    if method.endswith("_mtp"):
        method = "mtp"
    if not method.replace("_", "").isalnum() or len(method) > 40:
        raise ValueError(f"method {method[:40]!r} is not a method name")
    return method


def _unquoted_object(text: str) -> Optional[dict]:
    """{method:mtp,num_speculative_tokens:1}: what a shell leaves of an unquoted JSON object."""
    body = text.strip()
    if len(body) > 10_000 or not (body.startswith("{") and body.endswith("}")):
        return None
    pairs = [p.partition(":") for p in body[1:-1].split(",") if p.strip()]
    if any(not sep or not key.strip() for key, sep, _ in pairs):
        return None
    return {key.strip(): value.strip() for key, _, value in pairs}


def _partial_prefills(text: str) -> int:
    """vLLM's engine arguments refuse any value but 1 (engine/arg_utils.py _check_feature_supported,
    0.12-0.21: NotImplementedError "Concurrent Partial Prefill is not supported")."""
    value = _int(text)
    if value != 1:
        raise ValueError("vLLM (0.12-0.21, engine/arg_utils.py) refuses it: \"Concurrent Partial Prefill is "
                         "not supported\"; only 1 starts")
    return value


def _quantization(text: str) -> dict:
    if text not in _QUANT:
        raise ValueError(f"{excerpt(text)} is not a method kvtwin models ({', '.join(_QUANT)}); a pre-quantized "
                         f"checkpoint's config.json (model: {{hf_config: ...}}) carries its own")
    return dict(_QUANT[text])


@dataclass(frozen=True)
class Modelled:
    """A vLLM flag kvtwin models: where its value goes and vLLM's default (for docs/live_endpoints.md)."""

    flag: str                    # canonical long name
    field: str                   # scenario path, dotted
    parse: Callable[[str], Any]
    vllm_default: str
    aliases: tuple[str, ...] = ()
    boolean: bool = False        # BooleanOptionalAction: --flag / --no-flag (an explicit value also works)


MODELLED = (
    Modelled("--max-model-len", "engine.max_model_len", _human_int, "the model's context length"),
    Modelled("--gpu-memory-utilization", "engine.gpu_memory_utilization", _fraction, "0.9 (0.92 from vLLM 0.20)"),
    Modelled("--max-num-seqs", "engine.max_num_seqs", _int,
             "API server (0.9+): 1024 on >= 70 GiB GPUs (not A100), else 256; at most max_num_batched_tokens"),
    Modelled("--max-num-batched-tokens", "engine.max_num_batched_tokens", _human_int,
             "API server (0.9+): 8192 on >= 70 GiB GPUs (not A100), else 2048"),
    Modelled("--block-size", "engine.block_size", _int, "16 (CUDA)"),
    Modelled("--num-gpu-blocks-override", "engine.num_blocks", _int, "none: sized from memory"),
    Modelled("--enable-prefix-caching", "engine.prefix_caching", _bool, "on (V1)", boolean=True),
    Modelled("--enable-chunked-prefill", "engine.chunked_prefill", _bool, "on (V1)", boolean=True),
    Modelled("--tensor-parallel-size", "parallelism.tp", _int, "1", ("-tp",)),
    Modelled("--scheduling-policy", "engine.scheduling_policy", _choice("fcfs", "priority"), "fcfs"),
    Modelled("--dtype", "model.dtype", _dtype, "auto (the checkpoint's dtype)"),
    Modelled("--kv-cache-dtype", "engine.kv_cache_dtype", _choice("auto", "fp8", "fp8_e4m3", "fp8_e5m2"),
             "auto (the model dtype)"),
    Modelled("--quantization", "model.quantization", _quantization,
             "none (the checkpoint's quantization_config)", ("-q",)),
    Modelled("--data-parallel-size", "parallelism.dp", _int, "1", ("-dp",)),
    Modelled("--enable-expert-parallel", "parallelism.ep", _bool, "off (ep = tp x dp when on)", ("-ep",),
             boolean=True),
    Modelled("--data-parallel-size-local", "parallelism.dp_local", _int, "all dp ranks on this node", ("-dpl",)),
    Modelled("--data-parallel-hybrid-lb", "parallelism.dp_load_balancing", _bool,
             "off: internal (the API servers balance every rank)", ("-dph",), boolean=True),
    Modelled("--data-parallel-external-lb", "parallelism.dp_load_balancing", _bool,
             "off: internal (the API servers balance every rank)", ("-dpe",), boolean=True),
    # one rank's or one secondary node's command: vLLM infers external / hybrid balancing from them
    Modelled("--data-parallel-rank", "parallelism.dp_load_balancing", _int, "unset: internal", ("-dpn",)),
    Modelled("--data-parallel-start-rank", "parallelism.dp_load_balancing", _int, "unset: internal", ("-dpr",)),
    Modelled("--data-parallel-backend", "parallelism.dp_backend", _choice("mp", "ray"), "mp", ("-dpb",)),
    Modelled("--api-server-count", "parallelism.api_servers", _int,
             "the ranks its API servers balance (dp; dp_local for hybrid, 1 external) from vLLM 0.15, else 1; "
             "also the servers of the API-server front end (engine.front_end_s)",
             ("-asc",)),
    Modelled("--all2all-backend", "parallelism.all2all_backend",
             _choice("allgather_reducescatter", "naive", "pplx", "deepep_high_throughput", "deepep_low_latency",
                     "flashinfer_all2allv", "mori", "nixl_ep", "flashinfer_nvlink_two_sided",
                     "flashinfer_nvlink_one_sided"), "allgather_reducescatter"),
    Modelled("--async-scheduling", "engine.async_scheduling", _bool,
             "auto: on from vLLM 0.14 unless an executor, speculative method or platform turns it off",
             boolean=True),
    Modelled("--enforce-eager", "engine.enforce_eager", _bool, "off (CUDA graphs)", boolean=True),
    Modelled("--kv-cache-memory-bytes", "engine.kv_cache_memory_bytes", _human_int,
             "none: sized from gpu_memory_utilization", ("--kv-cache-memory",)),
    Modelled("--distributed-executor-backend", "engine.distributed_executor_backend",
             _choice("mp", "uni", "ray", "external_launcher"), "uni on one GPU, mp on several"),
    Modelled("--kv-offloading-size", "engine.kv_offload.size_gib", offloading_size,
             "none (off); GiB over all ranks (docs/kv_offload.md)"),
    Modelled("--kv-offloading-backend", "engine.kv_offload.backend", _choice("native", "lmcache"),
             "native (only with --kv-offloading-size)"),
    Modelled("--speculative-config", "engine.speculative", _speculative_config,
             "none (method, num_speculative_tokens, model; acceptance from engine.speculative's defaults)",
             ("-sc",)),
    Modelled("--long-prefill-token-threshold", "engine.long_prefill_token_threshold", _human_int, "0 (off)"),
    Modelled("--max-num-partial-prefills", "engine.max_num_partial_prefills", _partial_prefills,
             "1 (the only value vLLM V1 accepts)"),
    Modelled("--scheduler-reserve-full-isl", "engine.reserve_full_prompt", _bool,
             "on (from vLLM 0.19; earlier releases check the first chunk only)", boolean=True),
    Modelled("--performance-mode", "engine.performance_mode", _choice("balanced", "interactivity", "throughput"),
             "balanced (from vLLM 0.17; throughput doubles the max_num_seqs and max_num_batched_tokens defaults)"),
    Modelled("--pipeline-parallel-size", "engine.pipeline_parallel_size", _int,
             "1 (stages not modelled: only its effect on auto async scheduling, off with pp > 1 in vLLM 0.14)",
             ("-pp",)),
)

# Environment variables a command may set before `vllm serve` (NAME=value words), the scenario field
# each maps to and its parser; others are reported as ignored (ENV_IGNORED) or unknown.
def _use_v1(text: str) -> str:
    """VLLM_USE_V1 as vllm/envs.py reads it, bool(int(value)): 0 -> v0, any other integer -> v1."""
    try:
        return "v1" if int(text) else "v0"
    except ValueError:
        raise ValueError(f"{excerpt(text)} is not an integer (vLLM reads bool(int(VLLM_USE_V1)))") from None


ENV_MODELLED: dict[str, tuple[str, Callable[[str], Any]]] = {
    # envs.py: "0" up to 0.19, "1" from 0.20; read by v1/worker/gpu_worker.py determine_available_memory
    "VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS": ("engine.estimate_cudagraph_memory", _bool),
    # envs.py 0.6.4 - 0.11.0 (the engine generation: sim/core/vllm_versions.py); other releases do not
    # read it, which use_v1_by_release settles once the release is known
    "VLLM_USE_V1": ("engine.vllm_engine", _use_v1),
}

# Flags vLLM has that kvtwin leaves out, with why. True/False: whether the flag is a bare switch
# (takes no value), so the parser knows whether the next word is its value.
_SERVER = "HTTP server setting: no effect on the engine's timing or memory"
_LOADING = "how the weights or tokenizer are found and loaded: no effect on serving performance"
_OUTPUT = "what a response carries: no effect on the engine's timing or memory"
_NOT_MODELLED = "not modelled by kvtwin: the prediction assumes vLLM's default"
IGNORED: dict[str, tuple[bool, str]] = {
    **{f: (False, _SERVER) for f in (
        "--host", "--port", "--uds", "--api-key", "--served-model-name", "--root-path", "--allowed-origins",
        "--allowed-methods", "--allowed-headers", "--ssl-keyfile", "--ssl-certfile", "--ssl-ca-certs",
        "--ssl-cert-reqs", "--middleware", "--uvicorn-log-level", "--max-log-len", "--response-role",
        "--chat-template", "--chat-template-content-format", "--tool-call-parser", "--tool-parser-plugin",
        "--reasoning-parser", "--prompt-adapters",
        "--log-config-file", "--h11-max-incomplete-event-size", "--h11-max-header-count")},
    **{f: (True, _SERVER) for f in (
        "--disable-log-requests", "--enable-log-requests", "--disable-log-stats", "--disable-fastapi-docs",
        "--enable-request-id-headers", "--disable-uvicorn-access-log", "--enable-server-load-tracking",
        "--disable-frontend-multiprocessing", "--enable-auto-tool-choice", "--headless",
        "--enable-ssl-refresh", "--enable-log-outputs")},
    **{f: (False, _LOADING) for f in (
        "--tokenizer", "--tokenizer-mode", "--revision", "--code-revision", "--tokenizer-revision",
        "--download-dir", "--load-format", "--config-format", "--hf-config-path", "--model-loader-extra-config",
        "--hf-token", "--model-impl", "--generation-config", "--override-generation-config",
        "--task", "--runner", "--convert", "--max-parallel-loading-workers")},
    **{f: (True, _LOADING) for f in ("--trust-remote-code", "--skip-tokenizer-init")},
    **{f: (False, _OUTPUT) for f in ("--max-logprobs", "--logprobs-mode", "--guided-decoding-backend",
                                     "--structured-outputs-config")},
    **{f: (True, _OUTPUT) for f in ("--return-tokens-as-token-ids", "--enable-prompt-tokens-details",
                                    "--enable-force-include-usage")},
    "--seed": (False, "vLLM's sampling seed; kvtwin's `seed` draws the workload instead"),
    "--compilation-config": (False, "compilation changes step times: calibrate the cost model on the "
                                    "same setting"),
    "-O": (False, "compilation level changes step times: calibrate the cost model on the same setting"),
    "--calculate-kv-scales": (True, _NOT_MODELLED),
    "--swap-space": (False, "CPU swap space: V1 preempts by recompute only, as kvtwin does"),
    "--preemption-mode": (False, "kvtwin (and vLLM V1) preempt by recompute only"),
    "--cpu-offload-gb": (False, _NOT_MODELLED + " (no weight offload)"),
    "--max-seq-len-to-capture": (False, "CUDA-graph capture size: calibrate the cost model on the same setting"),
    "--cuda-graph-sizes": (False, "CUDA-graph capture sizes: calibrate the cost model on the same setting"),
    "--disable-custom-all-reduce": (True, "all-reduce kernel choice: calibrate the link terms on the same setting"),
    "--max-long-partial-prefills": (False, "vLLM V1 only checks it against --max-num-partial-prefills "
                                           "(which must be 1); its scheduler never reads it"),
    "--num-scheduler-steps": (False, "V0's multi-step scheduling: not modelled (V1 ignores it)"),
    "--num-lookahead-slots": (False, "V0 only (speculative decoding); not modelled"),
    "--prefix-caching-hash-algo": (False, "which hash keys the blocks: no effect on hits or timing"),
    "--disable-sliding-window": (True, _NOT_MODELLED + " (full attention in every layer)"),
    "--rope-scaling": (False, "set it in the model's config (model.rope_scaling); not read from the flag"),
    "--rope-theta": (False, "set it in the model's config (model.rope_theta); not read from the flag"),
    "--hf-overrides": (False, "set the model's fields in the scenario's model section instead"),
    # --enable-lora, --max-loras, --max-lora-rank, --max-cpu-loras, --lora-modules are mapped
    # (sim/vllm/lora_flags.py)
    "--limit-mm-per-prompt": (False, _NOT_MODELLED + " (text only)"),
    "--mm-processor-kwargs": (False, _NOT_MODELLED + " (text only)"),
    # OffloadingConnector / LMCacheConnectorV1 configs are mapped (sim/vllm/kv_offload_flags.py)
    "--kv-transfer-config": (False, _NOT_MODELLED + " (no disaggregated prefill)"),
    "--kv-events-config": (False, "event publishing: no effect on the prediction"),
    "--enable-sleep-mode": (True, "no effect on serving performance"),
    "--stream-interval": (False, "tokens per streamed chunk: a client-side ITL effect kvtwin does not model"),
}

ENV_IGNORED = {
    "CUDA_VISIBLE_DEVICES": "which GPUs: the scenario's device and parallelism say how many",
    "HF_TOKEN": _LOADING, "HF_HOME": _LOADING, "HF_HUB_OFFLINE": _LOADING,
    "VLLM_LOGGING_LEVEL": "logging: no effect on the engine's timing or memory",
}

# The vLLM command's own words before its arguments.
_PREFIXES = (("vllm", "serve"), ("python", "-m", "vllm.entrypoints.openai.api_server"),
             ("python3", "-m", "vllm.entrypoints.openai.api_server"))


@dataclass
class Translation:
    """What a `vllm serve` command means for kvtwin; `raw` is the scenario mapping to write."""

    model: str
    raw: dict[str, Any]
    mapped: list[tuple[str, str, Any]] = field(default_factory=list)     # flag, field, value
    ignored: list[tuple[str, Optional[str], str]] = field(default_factory=list)  # flag, value, why
    unknown: list[tuple[str, Optional[str]]] = field(default_factory=list)       # flag, value
    lora_adapters: int = 0          # adapters --lora-modules names (sim/vllm/lora_flags.py)
    remarks: list[str] = field(default_factory=list)     # further lines for the scenario's notes

    def notes(self) -> list[str]:
        """One line per ignored or unknown flag, escaped (the command is untrusted text: a newline
        in a value must not end a comment line), at most MAX_LISTED of each, then a count."""
        out = capped([_shown(flag, value) + f": ignored ({why})" for flag, value, why in self.ignored], "ignored flags")
        out += capped([_shown(flag, None) + ": unknown to kvtwin's flag table, ignored (a newer vLLM flag?)"
                       for flag, _ in self.unknown], "unknown flags")
        return out


MAX_LISTED = 50            # flags listed one per line; a 5,000-flag command gets a count for the rest
MAX_COMMAND_CHARS = 2000   # of the command echoed into the written file's first line


def _shown(flag: str, value: Optional[str]) -> str:
    """`--flag value` as one printable line of bounded length."""
    return printable(flag, 100) + (f" {printable(value, 200)}" if value is not None else "")


def capped(lines: list[str], what: str, limit: int = MAX_LISTED) -> list[str]:
    return lines if len(lines) <= limit else [*lines[:limit], f"... and {len(lines) - limit:,} more {what}"]


# ----------------------------------------------------------------------------- splitting the command

def command_words(command: str | list[str]) -> list[str]:
    """The argument words after `vllm serve` (or the api_server module); a string is split as a shell would."""
    return _vllm_arguments(command)[0]


def _vllm_arguments(command: str | list[str]) -> tuple[list[str], bool]:
    """(the words after `vllm serve`, whether the command named vLLM): `/path/to/vllm serve` and
    `python3.12 -m vllm.entrypoints.openai.api_server` count too; without such a prefix the words
    are taken as vLLM's arguments themselves (MODEL --flags, or only --flags). Leading environment
    assignments (NAME=value, after an optional `env`) are skipped: `environment` reads them."""
    words = _leading_environment(_shell_words(command))[1]
    program = [Path(words[0]).name if words else "", *words[1:3]]
    if program[0].startswith("python"):
        program[0] = "python"
    for prefix in _PREFIXES:
        if tuple(program[: len(prefix)]) == prefix:
            return words[len(prefix):], True
    if words and words[0] == "serve":
        return words[1:], True
    return words, False


def _shell_words(command: str | list[str]) -> list[str]:
    try:
        return shlex.split(command.replace("\\\n", " ")) if isinstance(command, str) else list(command)
    except ValueError as e:             # an unbalanced quote
        raise UserError(f"the vLLM command cannot be split into words as a shell would ({e})") from None


def _leading_environment(words: list[str]) -> tuple[list[tuple[str, str]], list[str]]:
    """`VLLM_X=1 env Y=2 vllm serve ...` -> ([(VLLM_X, 1), (Y, 2)], [vllm, serve, ...])."""
    import re

    env, i = [], 0
    while i < len(words):
        name, eq, value = words[i].partition("=")
        if words[i] == "env":
            i += 1
        elif eq and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]{0,99}", name):
            env.append((name, value))
            i += 1
        else:
            break
    return env, words[i:]


SECRET_FLAGS = ("--api-key", "--hf-token")
SECRET_NAME = ("TOKEN", "KEY", "SECRET", "PASSWORD")     # in an environment variable's name: HF_TOKEN, ...
REDACTED = "REDACTED"           # no character a shell would quote


def without_secrets(command: str | list[str]) -> str | list[str]:
    """The command with the values of --api-key, --hf-token and of environment variables named like
    secrets (HF_TOKEN=..., VLLM_API_KEY=...) replaced by REDACTED: the command is echoed on screen
    and into the scenario file, which is meant to be shared. Unchanged when it holds none."""
    env, words = _leading_environment(_shell_words(command))
    out = [f"{name}={REDACTED if value and any(s in name.upper() for s in SECRET_NAME) else value}"
           for name, value in env]
    for word in words:
        flag, eq, _ = word.partition("=")
        if flag in SECRET_FLAGS and eq:
            word = f"{flag}={REDACTED}"
        elif out and out[-1] in SECRET_FLAGS and not word.startswith("-"):
            word = REDACTED
        out.append(word)
    if out == [f"{name}={value}" for name, value in env] + words:
        return command                   # as given (`env`, quoting), when there is nothing to hide
    return out if isinstance(command, list) else shlex.join(out)


def environment(command: str | list[str]) -> list[tuple[str, str]]:
    """The NAME=value assignments before the vLLM command."""
    return _leading_environment(_shell_words(command))[0]


def _canonical(name: str) -> str:
    """--max_model_len -> --max-model-len (vLLM accepts both spellings)."""
    return name if not name.startswith("--") else "--" + name[2:].replace("_", "-")


_BY_NAME = {name: m for m in MODELLED for name in (m.flag, *m.aliases)}


def _takes_value(name: str, explicit: Optional[str], following: Optional[str]) -> bool:
    """Whether the next word is this flag's value (an `=value` was already split off)."""
    if explicit is not None or following is None or name.startswith("--no-"):
        return False
    if name == "--enable-lora":           # a switch (lora_flags)
        return following.lower() in ("true", "false")
    if name in _BY_NAME:
        m = _BY_NAME[name]
        return not m.boolean or following.lower() in ("true", "false")
    if name in IGNORED:
        return not IGNORED[name][0]
    return not following.startswith("-") or _is_number(following)


def _is_number(text: str) -> bool:
    try:
        float(text)
        return True
    except ValueError:
        return False


def split_flags(words: list[str]) -> tuple[list[str], list[tuple[str, Optional[str]]]]:
    """Positional words and (flag, value or None) pairs, in command-line order."""
    positional, flags = [], []
    i = 0
    while i < len(words):
        word = words[i]
        if not word.startswith("-") or _is_number(word):
            positional.append(word)
            i += 1
            continue
        name, eq, value = word.partition("=")
        name = _canonical(name)
        explicit = value if eq else None
        if name.startswith("-O") and len(name) > 2:      # -O3: the level glued to the flag
            name, explicit = "-O", name[2:]
        following = words[i + 1] if i + 1 < len(words) else None
        if name == "--lora-modules" and explicit is None:     # nargs '+': every word up to the next flag
            while i + 1 < len(words) and not words[i + 1].startswith("-"):
                flags.append((name, words[i + 1]))
                i += 1
            if flags and flags[-1][0] == name:
                i += 1
                continue
        if _takes_value(name, explicit, following):
            explicit, i = following, i + 1
        flags.append((name, explicit))
        i += 1
    return positional, flags


def config_file_flags(path: Path) -> list[tuple[str, Optional[str]]]:
    """vLLM's --config YAML: {flag-name: value}; true = a bare switch, false = its --no- form."""
    try:       # strict YAML (duplicate keys, alias bombs refused), bounded, UTF-8
        data = read_yaml(path, "vLLM --config YAML file")
    except FileFormatError as e:
        raise UserError(f"--config {e}") from None
    if not isinstance(data, dict):
        raise UserError(f"--config {path}: expected a mapping of flag names to values")
    return mapping_flags(data)


def mapping_flags(data: dict[str, Any]) -> list[tuple[str, Optional[str]]]:
    """{flag_name: value} (a --config file, the `non-default args:` vLLM logs) as (flag, value) pairs."""
    out = []
    for key, value in data.items():
        name = _canonical(f"--{key}")
        if value is True:
            out.append((name, None))
        elif value is False:
            out.append((name, "false") if name in _BY_NAME else ("--no-" + name[2:], None))
        elif isinstance(value, (dict, list)):      # a JSON flag (--kv-transfer-config) logged as a mapping
            out.append((name, json.dumps(value)))
        else:
            out.append((name, str(value)))
    return out


# ----------------------------------------------------------------------------- translating

def translate(command: str | list[str], device: str, base_dir: Optional[Path] = None,
              model_name: Optional[str] = None, spec_metrics: Optional[Path] = None) -> Translation:
    """The scenario mapping for `command` on catalog `device`. UserError on a value vLLM would
    also refuse, a missing model, or a flag that looks like a misspelt modelled one. `spec_metrics`:
    a /metrics scrape whose spec-decode counters give the speculative section's acceptance."""
    words, named_vllm = _vllm_arguments(command)
    positional, flags = split_flags(words)
    configs = [v for f, v in flags if f == "--config"]
    flags = [p for path in configs if path for p in config_file_flags(Path(path))] + \
            [(f, v) for f, v in flags if f != "--config"]
    model_arg = next((v for f, v in flags if f == "--model"), None) or (positional[0] if positional else None)
    extra = positional[1:] if positional and model_arg == positional[0] else positional
    if extra:
        if not named_vllm:
            raise _not_vllm_serve(words)
        raise UserError(f"unexpected word(s) {excerpt(' '.join(extra))} in the vLLM command: after the model, "
                        f"vLLM takes only --flags")
    if model_arg is None and model_name is None:
        took = [f"{f} {v}" for f, v in flags if v is not None and f not in _BY_NAME and f not in IGNORED]
        hint = f" (did an unknown flag take it as its value? {excerpt(', '.join(took), 200)})" if took else ""
        raise UserError(f"the vLLM command names no model (vllm serve MODEL ...){hint}")
    try:
        model = model_name or catalog_model(model_arg, base_dir)
    except UserError:
        if not named_vllm:           # `rm -rf /x`: not a model that is missing but another program
            raise _not_vllm_serve(words) from None
        raise
    from sim.scenario import set_path

    raw: dict[str, Any] = {"name": _scenario_name(model_arg or model), "model": model, "device": device}
    if isinstance(model, str) and model_arg and model_arg != model:
        raw["description"] = f"from `vllm serve {model_arg}` (catalog model {model})"
    result = Translation(model=model_arg or str(model), raw=raw)
    for name, value in flags:
        if name == "--model":
            continue
        outcome = _one_flag(name, value)
        if outcome is None:
            continue
        if isinstance(outcome, Modelled):
            parsed = _parse(outcome, name, value)
            result.mapped.append((name if value is None else f"{name} {value}", outcome.field, parsed))
            if parsed is not None:
                result.raw = set_path(result.raw, outcome.field.split("."), parsed)
    _environment(result, environment(command))
    _expert_parallel(result)
    _dp_load_balancing(result)
    _pipeline_parallel_remark(result)
    _speculative_section(result, spec_metrics, base_dir)
    result = _sorted_out(result, flags)
    kv_offload_flags.apply(result, flags, result.raw.get("parallelism", {}).get("tp", 1))
    lora_flags.apply(result, flags)
    return result


def _speculative_section(result: Translation, spec_metrics: Optional[Path], base_dir: Optional[Path]) -> None:
    """engine.speculative as the scenario can take it: the acceptance a /metrics scrape measured
    (`spec_metrics`), else the method's default. A method kvtwin does not draft for, or one with no
    default and no scrape (ngram, draft_model: it depends on the workload), or a draft model not in
    the catalog, keeps only its effect on async scheduling (engine.speculative_method) and says so
    among the ignored flags, naming the field that would model it."""
    from sim.speculative import DEFAULT_ACCEPTANCE, DEFAULT_NUM_SPEC_TOKENS, SpeculativeConfig

    engine = result.raw.get("engine", {})
    section = engine.get("speculative")
    if section is None:
        if spec_metrics is not None:
            raise UserError("--spec-metrics: the command sets no --speculative-config")
        return
    other = section.pop(_OTHER_KEYS, None) or []
    if "draft_tensor_parallel_size" in other:      # the one key that moves the memory plan
        other.remove("draft_tensor_parallel_size")
        result.ignored.append(("--speculative-config draft_tensor_parallel_size", None,
                               "not modelled: kvtwin loads and prices the draft model at the target's tp "
                               "(vLLM's default), so with 1 its weights per GPU and the KV pool differ"))
    if other:
        result.ignored.append(("--speculative-config " + ", ".join(other), None,
                               "their effect on timing goes through the acceptance (engine.speculative."
                               "acceptance_rates) and the draft cost, which kvtwin models directly"))
    method = section["method"]
    modelled = SpeculativeConfig.model_fields["method"].annotation.__args__
    k = section.get("num_speculative_tokens") or DEFAULT_NUM_SPEC_TOKENS.get(method)
    if spec_metrics is not None and k is not None:
        from sim.vllm.spec_metrics import acceptance_from_scrape

        section["acceptance_rates"] = acceptance_from_scrape(spec_metrics, k)
    why = None
    if method == "draft_model" and section.get("model"):
        try:
            section["model"] = catalog_model(section["model"], base_dir)
        except UserError:
            why = f"draft model {printable(section['model'], 80)} is not in the catalog"
        if not isinstance(section.get("model"), str):
            why = "a draft model given as a folder is not modelled (a catalog name is)"
    if method not in modelled:
        why = f"method {method}: its draft tokens are not modelled (only {', '.join(modelled)})"
    elif why is not None or "acceptance_rates" in section:
        pass
    elif method not in DEFAULT_ACCEPTANCE:
        why = (f"method {method}: no published default acceptance; set engine.speculative.acceptance_rate "
               f"(and its fields) to model its draft tokens")
    elif "num_speculative_tokens" not in section and method not in DEFAULT_NUM_SPEC_TOKENS:
        why = f"method {method} without num_speculative_tokens (vLLM takes it from the draft's config)"
    if why is None:
        return
    del engine["speculative"]
    engine["speculative_method"] = method
    result.ignored.append(("--speculative-config (draft tokens)", None, why + "; async scheduling follows it"))


def _not_vllm_serve(words: list[str]) -> UserError:
    return UserError(f"{excerpt(' '.join(words), 60)} is not a `vllm serve` command (expected `vllm serve MODEL "
                     f"--flag ...`, `python -m vllm.entrypoints.openai.api_server --model MODEL ...`, or the "
                     f"words after `vllm serve` with a catalog model, a catalog hf_id or a folder holding "
                     f"config.json as MODEL)")


def _environment(result: Translation, env: list[tuple[str, str]]) -> None:
    """The command's environment assignments: mapped (ENV_MODELLED), ignored with why, or unknown."""
    from sim.scenario import set_path

    for name, value in env:
        if name in ENV_MODELLED:
            field_path, parse = ENV_MODELLED[name]
            try:
                parsed = parse(value)
            except ValueError as e:
                raise UserError(f"environment {printable(name, 60)}={printable(value, 60)}: {e}") from None
            result.mapped.append((f"{name}={value}", field_path, parsed))
            result.raw = set_path(result.raw, field_path.split("."), parsed)
        elif name in ENV_IGNORED:
            result.ignored.append((f"{name}={value}", None, ENV_IGNORED[name]))
        else:
            result.unknown.append((f"{name}={value} (environment)", None))


def _pipeline_parallel_remark(result: Translation) -> None:
    pp = result.raw.get("engine", {}).get("pipeline_parallel_size", 1)
    if pp > 1:
        result.remarks.append(f"pipeline parallel {pp}: kvtwin runs the model on the tp GPUs without pipeline "
                              f"stages (per-stage memory and timing are not modelled); the setting decides auto "
                              f"async scheduling only (off with pp > 1 in vLLM 0.14)")


def _expert_parallel(result: Translation) -> None:
    """--enable-expert-parallel: whole experts over every GPU of the engine, ep = tp x dp."""
    par = result.raw.get("parallelism", {})
    if "ep" in par:
        par["ep"] = par.get("tp", 1) * par.get("dp", 1) if par["ep"] else 1


# the flags that set parallelism.dp_load_balancing, and the mode each turns on (engine/arg_utils.py,
# 0.19: --data-parallel-rank implies external balancing, --data-parallel-start-rank hybrid)
_BALANCING_FLAGS = {"--data-parallel-hybrid-lb": "hybrid", "--data-parallel-external-lb": "external",
                    "--data-parallel-rank": "external", "--data-parallel-start-rank": "hybrid"}


def _dp_load_balancing(result: Translation) -> None:
    """The dp balancing flags -> parallelism.dp_load_balancing (the last one given wins; --no-... and
    false leave it internal); a flag's own value (a rank) is not a mode."""
    mode = None
    for flag, target, value in result.mapped:
        if target == "parallelism.dp_load_balancing":
            name = _canonical(flag.split(" ")[0])
            base = "--" + name[5:] if name.startswith("--no-") else name
            base = _BY_NAME[base].flag if base in _BY_NAME else base
            mode = _BALANCING_FLAGS[base] if value is not False else "internal"
    if mode is not None:
        result.raw.setdefault("parallelism", {})["dp_load_balancing"] = mode


def _one_flag(name: str, value: Optional[str]):
    """The Modelled entry for a modelled flag, else None (the flag is ignored or unknown)."""
    base = "--" + name[5:] if name.startswith("--no-") else name
    if base in _BY_NAME:
        return _BY_NAME[base]
    if base in IGNORED or name in IGNORED or base in lora_flags.LORA_FLAGS:
        return None
    close = difflib.get_close_matches(base, list(_BY_NAME), n=1, cutoff=0.85)
    if close:
        raise UserError(f"vLLM flag {printable(name, 60)}: unknown; did you mean {close[0]}? (a misspelt flag would "
                        f"otherwise leave {_BY_NAME[close[0]].field} at its default)")
    return None


def _parse(m: Modelled, name: str, value: Optional[str]) -> Any:
    if m.boolean and value is None:
        return not name.startswith("--no-")
    if value is None:
        raise UserError(f"vLLM flag {name}: needs a value ({m.field})")
    try:
        parsed = m.parse(value)
    except ValueError as e:
        raise UserError(f"vLLM flag {name} {printable(value, 60)}: {e}") from None
    return (not parsed) if m.boolean and name.startswith("--no-") else parsed


def _sorted_out(result: Translation, flags: list[tuple[str, Optional[str]]]) -> Translation:
    for name, value in flags:
        base = "--" + name[5:] if name.startswith("--no-") else name
        if name == "--model" or base in _BY_NAME or base in lora_flags.LORA_FLAGS:
            continue            # (the LoRA flags: lora_flags.apply)
        why = IGNORED.get(base) or IGNORED.get(name)
        if base == "--kv-transfer-config":            # one side of a P/D deployment: say what kvtwin needs
            from sim.disagg_config import kv_transfer_note
            result.ignored.append((name, value, kv_transfer_note(value)))
        elif why is not None:
            result.ignored.append((name, value, why[1]))
        else:
            result.unknown.append((name, value))
    return result


def catalog_model(model: str, base_dir: Optional[Path]) -> Any:
    """vLLM's MODEL as a scenario `model`: a catalog name, a Hugging Face id the catalog lists
    (hf_id), or a local folder with config.json ({hf_config: path})."""
    from sim.core.catalog import catalog_entry, model_names

    if model in model_names():
        return model
    by_hf_id = {str(catalog_entry("models", name).get("hf_id", "")).lower(): name for name in model_names()}
    if model.lower() in by_hf_id:
        return by_hf_id[model.lower()]
    same_shape = {_without_tuning(hf_id): name for hf_id, name in by_hf_id.items()}
    if _without_tuning(model.lower()) in same_shape:     # a base model and its -Instruct share one shape
        return same_shape[_without_tuning(model.lower())]
    folder = Path(model).expanduser()
    if not folder.is_absolute() and base_dir is not None:
        folder = base_dir / folder
    if (folder / "config.json").is_file():
        return {"hf_config": str(folder.resolve())}
    close = [c for c in difflib.get_close_matches(model.lower(), list(by_hf_id), n=3, cutoff=0.6)
             if _size(c) == _size(model.lower())]            # never a 7B for a 72B
    hint = f"; did you mean {close[0]} (catalog {by_hf_id[close[0]]})?" if close else ""
    raise UserError(f"model {excerpt(model, 80)} is neither a catalog model, a catalog hf_id nor a local folder with "
                    f"config.json{hint}; pass --model-name CATALOG_NAME or a folder holding its config.json "
                    f"(catalog: {', '.join(model_names())})")


TUNING_SUFFIXES = ("-instruct", "-chat", "-it")


def _without_tuning(hf_id: str) -> str:
    """The id without its instruction-tuning suffix: Llama-3.1-8B-Instruct -> Llama-3.1-8B."""
    return next((hf_id[: -len(s)] for s in TUNING_SUFFIXES if hf_id.endswith(s)), hf_id)


def _size(hf_id: str) -> Optional[str]:
    """The parameter count an id states ('72b' in qwen2.5-72b-instruct), else None."""
    import re

    found = re.findall(r"(?<![a-z0-9.])(\d+(?:\.\d+)?[bm])(?![a-z0-9])", hf_id.rsplit("/", 1)[-1])
    return found[-1] if found else None


def _scenario_name(model: Any) -> str:
    text = str(model).rstrip("/").rsplit("/", 1)[-1]
    return "".join(c if c.isalnum() or c in "-_." else "-" for c in text).lower() or "vllm"


# ----------------------------------------------------------------------------- the docs' flag table

def flag_table_markdown() -> str:
    """docs/live_endpoints.md's table: each modelled vLLM flag, its scenario field and vLLM's default."""
    rows = ["| vLLM flag | scenario field | vLLM default |", "|---|---|---|"]
    for m in MODELLED:
        names = ", ".join(f"`{n}`" for n in (m.flag, *m.aliases))
        if m.boolean:
            names += f", `--no-{m.flag[2:]}`"
        rows.append(f"| {names} | `{m.field}` | {m.vllm_default} |")
    return "\n".join(rows)


# ----------------------------------------------------------------------------- `simrun from-vllm`

def from_vllm_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        prog="simrun from-vllm",
        description="Write a kvtwin scenario from a `vllm serve` command line. Example: "
                    "simrun from-vllm \"vllm serve Qwen/Qwen2.5-7B-Instruct --max-num-seqs 64\" "
                    "--device h100-sxm --out qwen.yaml  (or: simrun from-vllm --device h200 -- vllm serve ...)")
    p.add_argument("command", nargs="+", help="the vLLM command: one quoted string, or its words after --")
    p.add_argument("--device", required=True,
                   help="catalog device the server runs on (vLLM's flags do not name the GPU)")
    p.add_argument("--model-name", help="catalog model to use when MODEL is not in the catalog")
    p.add_argument("--out", type=out_file_arg, help="scenario file to write (default: print it)")
    p.add_argument("--force", action="store_true", help="replace an --out file kvtwin did not write, or "
                   "sections of an earlier from-vllm file edited by hand (sections you added are kept)")
    p.add_argument("--strict", action="store_true", help="fail on flags kvtwin does not know")
    p.add_argument("--vllm-version", help="the vLLM release the command ran on (e.g. 0.19.0): written to "
                                          "engine.vllm_version, which picks vLLM's defaults and behaviour "
                                          "(default: the scenario default, 0.19)")
    p.add_argument("--spec-metrics", type=Path, help="a /metrics scrape of that server: its vllm:spec_decode_* "
                   "counters set engine.speculative's acceptance (any method, ngram and draft_model too)")
    args = p.parse_args(argv)
    from sim.core.catalog import device_names

    if args.out is not None:             # checked before translating, as every --out is
        check_out_file(args.out, WRITTEN_BY, force=args.force)

    if args.device not in device_names():
        close = sorted(d for d in device_names() if d.startswith(args.device.lower())) or \
            difflib.get_close_matches(args.device, device_names(), n=1, cutoff=0.5)
        hint = f"did you mean {' or '.join(close)}? " if close else ""
        raise UserError(f"--device {args.device!r}: not in the catalog; {hint}(catalog: {', '.join(device_names())})")
    command = without_secrets(args.command[0] if len(args.command) == 1 else args.command)
    result = translate(command, args.device, Path.cwd(), args.model_name, spec_metrics=args.spec_metrics)
    if args.vllm_version is not None:
        set_vllm_version(result, args.vllm_version)
    use_v1_by_release(result)
    if args.strict and result.unknown:
        names = capped([printable(f, 100) for f, _ in result.unknown], "unknown flags", 10)
        raise UserError(f"unknown vLLM flag(s) {', '.join(names)} (--strict)")
    from sim.scenario import validate_scenario

    scenario = validate_scenario(result.raw, base_dir=Path.cwd(), source="the translated vLLM command")
    result.remarks.append(f"vLLM engine: {scenario.engine_generation.upper()} ({scenario.engine_generation_why()})")
    kept = sections_to_keep(args.out, result.raw, args.force) if args.out is not None else {}
    added = lora_flags.workload_sections(result, kept)      # --lora-modules: workload.lora (unless kept)
    if result.lora_adapters:
        validate_scenario({**result.raw, **added, **({"workload": kept["workload"]} if "workload" in kept else {})},
                          base_dir=Path.cwd(), source="the translated vLLM command")
    text = scenario_text(result, command, kept, added)
    if args.out is None:
        _report(result, None)
        print(text, end="")
        return 0
    from sim.output.io import write_text

    write_text(args.out, text)
    _report(result, args.out)
    return 0


def set_vllm_version(result: Translation, version: str) -> None:
    """Write `--vllm-version` into engine.vllm_version (checked when the scenario is validated)."""
    from sim.scenario import set_path

    result.raw = set_path(result.raw, ["engine", "vllm_version"], version)
    result.mapped.append((f"--vllm-version {version}", "engine.vllm_version", version))


def use_v1_by_release(result: Translation) -> None:
    """VLLM_USE_V1 on a release that does not read it (before 0.6.4, or from 0.11.1 when vllm/envs.py
    dropped it): no effect, so engine.vllm_engine stays auto and a remark says so. On a release that
    reads it the mapped value stands, and validation refuses what vLLM refuses (VLLM_USE_V1=0 on
    0.11.0; VLLM_USE_V1=1 with a feature V1 lacks)."""
    from sim.core import vllm_versions

    engine = result.raw.get("engine", {})
    version = engine.get("vllm_version") or vllm_versions.DEFAULT_VERSION
    if "vllm_engine" not in engine or vllm_versions.reads_use_v1(version):
        return
    del engine["vllm_engine"]
    result.mapped = [(flag, fld, None if fld == "engine.vllm_engine" else value) for flag, fld, value in result.mapped]
    result.remarks.append(f"VLLM_USE_V1: vLLM {version} does not read it (VLLM_USE_V1 exists from 0.6.4 to 0.11.0, "
                          f"vllm/envs.py), so the release's default engine runs (engine.vllm_engine: auto, "
                          f"{vllm_versions.engine_generation(version).upper()})")


def async_scheduling_note(raw: dict) -> str:
    """What async scheduling resolves to for the translated scenario, and why."""
    from sim.core import vllm_versions

    engine = raw.get("engine", {})
    setting = engine.get("async_scheduling", "auto")
    if setting != "auto":
        return f"async scheduling: {'on' if setting else 'off'} (set by the command)"
    on, why = vllm_versions.async_scheduling_auto(
        engine.get("vllm_version"), platform="cpu" if raw.get("device") == "cpu" else "cuda",
        pipeline_parallel=engine.get("pipeline_parallel_size", 1), speculative_method=engine.get("speculative_method") or (engine.get("speculative") or {}).get("method"),
        executor=engine.get("distributed_executor_backend"))
    return f"async scheduling: {'on' if on else 'off'} under auto ({why})"


# the first line of every scenario from-vllm writes: it marks the file as kvtwin's to replace
WRITTEN_BY = "# written by `simrun from-vllm`"
# the header line recording a digest of the translated sections: tells a hand edit from a rerun
DIGEST_LINE = "# translated sections digest: "


def scenario_text(result: Translation, command: str | list[str], kept: Optional[dict] = None,
                  added: Optional[dict] = None) -> str:
    """The scenario YAML, headed by comments recording the command and each flag's fate; `kept`
    are the sections a user added to an earlier file (see sections_to_keep), written after;
    `added` the sections a flag implies outside the translation (--lora-modules' workload.lora)."""
    shown = command if isinstance(command, str) else shlex.join(command)
    head = [f"{WRITTEN_BY} from: {printable(' '.join(shown.split()), MAX_COMMAND_CHARS)}"]
    head += [f"#   {line}" for line in capped(_mapped_lines(result), "mapped flags")]
    head += [f"#   {note}" for note in result.notes()]
    head += [f"# {printable(remark, 300)}" for remark in result.remarks]
    head.append(f"# {async_scheduling_note(result.raw)}")
    if kept:
        head.append(f"# Kept from the file this one replaced: {', '.join(kept)}.")
    if "workload" not in (kept or {}):
        but = " apart from workload.lora" if "workload" in (added or {}) else ""
        head.append(f"# The workload is kvtwin's default{but}: edit `workload` to describe your traffic.")
    head.append(f"{DIGEST_LINE}{translation_digest(result.raw)} (sections you add are kept on a rerun)")
    return "\n".join(head) + "\n" + yaml.safe_dump({**result.raw, **(added or {}), **(kept or {})}, sort_keys=False)


def translation_digest(raw: dict) -> str:
    import hashlib
    import json

    return hashlib.sha256(json.dumps(raw, sort_keys=True, default=str).encode()).hexdigest()[:16]


def sections_to_keep(out: Path, raw: dict, force: bool) -> dict:
    """The top-level sections of an earlier from-vllm file at `out` that the translation does not
    write (workload, slo, ...): kept, so a rerun never drops a user's additions. Sections it does
    write that were edited by hand since (the recorded digest differs) are refused without --force:
    the translation would replace them. A file kvtwin did not write is replaced whole (--force)."""
    try:
        text = out.read_text()
    except (FileNotFoundError, IsADirectoryError, UnicodeDecodeError):
        return {}
    if not text.startswith(WRITTEN_BY):
        return {}
    try:
        old = yaml.safe_load(text)
    except yaml.YAMLError as e:
        if force:
            return {}
        raise UserError(f"{out}: not valid YAML any more ({str(e).splitlines()[0]}), so its own sections cannot "
                        f"be kept; fix it, or pass --force to replace it") from None
    old = old if isinstance(old, dict) else {}
    kept = {k: v for k, v in old.items() if k not in raw}
    ours = {k: v for k, v in old.items() if k in raw}
    recorded = next((line[len(DIGEST_LINE):].split()[0] for line in text.splitlines()
                     if line.startswith(DIGEST_LINE)), None)
    edited = sorted(k for k in raw if ours.get(k) != raw[k]) if recorded != translation_digest(ours) else []
    if edited and not force:
        raise UserError(f"{out}: {', '.join(edited)} differ{'s' if len(edited) == 1 else ''} from what from-vllm "
                        f"wrote there (edited by hand?) and the translation would replace "
                        f"{'it' if len(edited) == 1 else 'them'}; pass --force to replace (sections you added, "
                        f"{', '.join(kept) or 'none here'}, are kept either way), or pick another --out")
    return kept


def _report(result: Translation, out: Optional[Path]) -> None:
    from sim.output.console import err_console

    lines = [f"mapped   {line}" for line in capped(_mapped_lines(result), "mapped flags")]
    lines += capped([f"ignored  {_shown(flag, value)}: {why}" for flag, value, why in result.ignored], "ignored flags")
    lines += capped([f"UNKNOWN  {_shown(flag, value)}: not in kvtwin's flag table; ignored"
                     for flag, value in result.unknown], "unknown flags")
    if out is not None:
        lines.append(f"wrote {printable(str(out))}")
    for line in lines:
        err_console.print(line, markup=False, highlight=False, soft_wrap=True)


def _mapped_lines(result: Translation) -> list[str]:
    return [f"{printable(flag, 300)} -> {fld} = {value if value is not None else '(kept: auto)'}"
            for flag, fld, value in result.mapped]
