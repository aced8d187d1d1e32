from typing import Any, List, Mapping, Optional, Tuple

__version__: str

class MergeError(Exception):
    """A merge, analysis or check failed (bad input, I/O); the message says what and where."""

class UsageError(MergeError, ValueError):
    """The request itself is wrong (unknown method or parameter, bad path, value out of range)."""

def merge(recipe: Mapping[str, Any], out: str, keywords: Mapping[str, Any]) -> str:
    """Merges a recipe given as data (a mergekit recipe's keys) into ``out``; the record as JSON.
    ``keywords`` holds every key of a merge: device, quiet, force, out_dtype, shard_size, threads,
    allow_missing_tensors, allow_nonfinite."""

def run(recipe: str, out: str, keywords: Mapping[str, Any],
        intermediate_dir: Optional[str] = None) -> str:
    """Runs a mergekit YAML recipe file into ``out`` (``keywords`` as for merge; a multi-stage
    recipe's earlier stages kept in ``intermediate_dir``); the record as JSON."""

def moe(config_path: Optional[str], config: Optional[Mapping[str, Any]], out: str,
        keywords: Mapping[str, Any], allow_all_same: bool,
        intermediate_dir: Optional[str] = None) -> str:
    """Builds a mixture of experts into ``out`` from the mergekit-moe config file (or
    multi-stage recipe) ``config_path`` or the dict ``config``; what was built as JSON."""

def extract_lora(base: str, model: str, out: str, rank: Optional[int], rel_error: Optional[float],
                 distribute_scale: bool, embed_lora: bool, skip_undecomposable: bool,
                 include: List[str], exclude: List[str], threads: int,
                 force: bool, sv_epsilon: float = 0.0, save_modules: List[str] = ...,
                 max_held_mib: Optional[int] = None) -> str:
    """Extracts a PEFT LoRA adapter of ``model`` against ``base`` into ``out``; what it kept as
    JSON."""

def convert(source: str, out: str, keywords: Mapping[str, Any]) -> str:
    """Converts one checkpoint into ``out`` (``keywords`` as for merge, ``raw_f32_agents`` keeping
    fp32 masters); the record as JSON."""

def verify(dir: str, against: bool = False, device: str = "auto") -> Tuple[List[str], List[str], List[str]]:
    """Checks a merged folder: (checks passed, checks skipped, problems found)."""

def analyze(keywords: Mapping[str, Any]) -> str:
    """What each agent changed, as ``rlmerge analyze --json`` prints it. ``keywords`` holds every
    key: base, models, per_tensor, merged, plot, epsilon, device, quiet, threads,
    tokenizer_source, allow_missing_tensors, allow_nonfinite."""

def methods() -> str:
    """Every merge method with its parameters, as ``rlmerge methods --json`` prints them."""

def call(args: List[str], capture: bool = True) -> Tuple[int, str, Optional[str]]:
    """The ``rlmerge`` command pip installs: (exit code, captured output, error line or None).

    Exit codes: 0 success, 1 failure, 2 usage error. The GIL is released while it runs; Ctrl-C
    stops it at its next tile and raises KeyboardInterrupt here.
    """
