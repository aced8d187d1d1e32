"""rlmerge: merge RL-trained LLM agents that share a base model into one checkpoint.

The functions here call the rlmerge library in this process (no subprocess, no command line):
a merge's keywords become the library's recipe, read and checked as a recipe file is. Failures
raise :class:`MergeError` (:class:`UsageError`, also a ``ValueError``, for a bad request), made
by the library's binding with its message. The GIL is released while a call runs, and Ctrl-C
stops the call it interrupts cleanly: nothing is left at the output path.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from typing import Any, Dict, List, Mapping, Optional, Sequence, Union

# Headless: with XDG_RUNTIME_DIR unset, libwayland (which Mesa's Vulkan drivers load while wgpu
# lists adapters) prints "error: XDG_RUNTIME_DIR is invalid" on stderr though nothing failed.
# rlmerge never presents anything, so any folder quiets it; set only where unset, as the command
# does, before the library's first thread.
if not os.environ.get("XDG_RUNTIME_DIR"):
    os.environ["XDG_RUNTIME_DIR"] = tempfile.gettempdir()

from . import _rlmerge as _native  # noqa: E402
from ._rlmerge import MergeError, UsageError, __version__  # noqa: E402

__all__ = [
    "MergeError",
    "UsageError",
    "merge",
    "run",
    "convert",
    "extract_lora",
    "moe",
    "analyze",
    "verify",
    "methods",
    "__version__",
]

PathLike = Union[str, bytes, "os.PathLike[str]"]


#: A Hugging Face Hub id as the command reads one: org/name, optionally @revision.
_HUB_ID = re.compile(r"[A-Za-z0-9_.][A-Za-z0-9_.-]*/[A-Za-z0-9_.][A-Za-z0-9_.-]*(@[A-Za-z0-9_./-]+)?")


def _path(value: Any, what: str) -> str:
    """A path argument as text: ``str``, ``bytes`` or ``os.PathLike`` (decoded as the OS does);
    anything else is a :class:`UsageError` raised before anything is written."""
    if isinstance(value, (str, bytes, os.PathLike)):
        text = os.fsdecode(os.fspath(value))
        if text == "" or "\0" in text:
            raise UsageError(f"{what} must be a path, got {value!r}")
        return text
    raise UsageError(f"{what} must be a path (str, bytes or os.PathLike), got {type(value).__name__} {value!r}")


def _where(name: Any, what: str = "model") -> str:
    """A model as the command takes it: an existing path made absolute, a Hub id or
    ``BASE+ADAPTER`` as given; anything else is a :class:`UsageError` naming it."""
    text = _path(name, what)
    if os.path.exists(text):
        return os.path.abspath(text)
    if _HUB_ID.fullmatch(text) or "+" in text:
        return text
    raise UsageError(f"{what} {text!r}: neither a folder nor a Hub id (org/name): no such folder "
                     f"here ({os.getcwd()}){_native.sibling_hint(text.rstrip('/'))}")


def _check_common(device: Any, threads: Any) -> None:
    """The compute keywords every call takes, checked in the API's own words."""
    _check_keywords(device=device, threads=threads)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


#: What each keyword of the API takes: its check, and the words a UsageError says of it. Every
#: keyword of every call is checked here, alike, before the library sees it (a bool is no
#: number, a string no bool, a dict no list).
_KEYWORDS = {
    "flag": (lambda v: isinstance(v, bool), "must be True or False"),
    "text": (lambda v: v is None or isinstance(v, str), "must be a string (or None)"),
    "size": (lambda v: v is None or isinstance(v, str) or (_is_number(v) and v >= 1),
             "must be a size: a number of bytes ≥ 1, or a string such as '5GB' (or None)"),
    "seed": (lambda v: v is None or (isinstance(v, int) and not isinstance(v, bool)
                                     and 0 <= v < 2 ** 64),
             "must be a whole number in [0, 2**64) (or None)"),
    "number": (lambda v: v is None or _is_number(v), "must be a number (or None)"),
    "svc": (lambda v: v is None or isinstance(v, bool) or _is_number(v),
            "must be a number α > 0, True (α = 0.1), or False/None"),
    "threads": (lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 0,
                "must be a whole number ≥ 0 (0: all cores)"),
    "device": (lambda v: isinstance(v, str) and v in ("auto", "cpu", "gpu"),
               "must be 'auto', 'cpu' or 'gpu'"),
    "mapping": (lambda v: v is None or isinstance(v, Mapping), "must be a dict (or None)"),
}

_KEYWORD_KINDS = {
    "quiet": "flag", "force": "flag", "allow_missing_tensors": "flag",
    "allow_nonfinite": "flag", "allow_dense_agents": "flag", "raw_f32_agents": "flag",
    "per_tensor": "flag", "against": "flag", "method": "text", "out_dtype": "text",
    "shard_size": "size", "seed": "seed", "epsilon": "number", "svc": "svc",
    "threads": "threads", "device": "device", "tokenizer": "mapping",
}


def _check_keywords(**keywords: Any) -> None:
    """Each keyword's type, checked alike: a UsageError naming the keyword and what it takes."""
    for name, value in keywords.items():
        check, takes = _KEYWORDS[_KEYWORD_KINDS[name]]
        if not check(value):
            raise UsageError(f"{name} {takes}, got {type(value).__name__} {value!r}")


def _check_value(key: str, value: Any, lists: int = 0) -> None:
    """A method parameter: a number, a bool, a string, or a list of them (a gradient); inside a
    list one value per model (itself a gradient) — no deeper (a value containing itself would
    otherwise recurse without end)."""
    if isinstance(value, (list, tuple)):
        if lists >= 2:
            raise UsageError(f"parameter {key!r} nests lists more than two deep: give a value, a "
                             "gradient [a, b, …], or one of them per model")
        for v in value:
            _check_value(key, v, lists + 1)
        return
    if value is None:
        raise UsageError(f"parameter {key!r} is None: give it a value, or leave it out for its default")
    if not isinstance(value, (bool, int, float, str)):
        raise UsageError(f"parameter {key!r} must be a number, a bool or a string, got {type(value).__name__}")


def _summary(record_json: str, out: str) -> Dict[str, Any]:
    """What a merge wrote: its record (as saved in ``rlmerge_record.json``) as a dict, plus ``out``
    (the folder, absolute) and ``shards`` (the weight files written). The keys a caller reads most:

    - ``method``: the method and its parameters; ``epsilon``; ``out_dtype`` / ``main_dtype``;
    - ``agents``: one dict per agent, in order — ``path``; ``lambda`` (RAM+ global scope and
      ``ram``: one λ; ``None`` where λ varies); ``lambdas`` (RAM+ layer, module or tensor scope:
      λ by layer, module kind or tensor name); ``counts`` (``unique`` and ``shared`` changed
      elements, when a probe ran);
    - ``inputs`` / ``outputs``: every file read and written, with its CRC-32;
    - ``warnings``: what the merge told you;
    - ``notes``: what it noticed around the output (scratch that killed merges left beside it,
      removed or named with its size) — not saved in the folder's record.
    """
    record = json.loads(record_json)
    record["out"] = os.path.abspath(out)
    record["shards"] = [o["file"] for o in record.get("outputs", [])
                        if o["file"].endswith(".safetensors")]
    # λ per group (layer / module scope) or per tensor, by agent.
    scoped = record.get("group_lambdas") or record.get("tensor_lambdas") or []
    for t, agent in enumerate(record.get("agents", [])):
        if scoped:
            agent["lambdas"] = {name: values[t] for name, values in scoped}
    return record


def _finished(record_json: str, out: str) -> Dict[str, Any]:
    """:func:`_summary` of a merge that has finished: a Ctrl-C while it is read says that the
    output is complete (the binding says the same of one that came as the merge finished)."""
    try:
        return _summary(record_json, out)
    except KeyboardInterrupt:
        raise KeyboardInterrupt(
            f"interrupted after the merge had finished: the output at {out} is complete") from None


def _split_params(models: Sequence[str], params: Mapping[str, Any],
                  given: Sequence[PathLike]) -> tuple:
    """Recipe parameters: scalars for every model; a list (one value per model) or a dict
    (model → value) per model. A value that is itself a list is a mergekit gradient."""
    shared: Dict[str, Any] = {}
    per_model: List[Dict[str, Any]] = [{} for _ in models]
    for key, value in params.items():
        if isinstance(value, Mapping):
            names = {}
            for i, m in enumerate(given):
                for alias in {os.fspath(m), models[i], os.path.basename(os.fspath(m).rstrip("/"))}:
                    names.setdefault(alias, i)
            for name, v in value.items():
                if os.fspath(name) not in names:
                    raise UsageError(
                        f"parameter {key!r} names {name!r}, which is not one of the models merged")
                per_model[names[os.fspath(name)]][key] = v
        elif isinstance(value, (list, tuple)):
            if len(value) != len(models):
                raise UsageError(
                    f"parameter {key!r} has {len(value)} values for {len(models)} models "
                    "(a list gives one value per model; a gradient goes per model)")
            for i, v in enumerate(value):
                per_model[i][key] = v
        else:
            shared[key] = value
    return shared, per_model


def merge(base: PathLike, models: Sequence[PathLike], method: str = "ram+", out: Optional[PathLike] = None,
          *, device: str = "auto", quiet: bool = True, force: bool = False,
          out_dtype: Optional[str] = None, shard_size: Optional[str] = None, threads: int = 0,
          tokenizer_source: Optional[str] = None, tokenizer: Optional[Mapping[str, Any]] = None,
          allow_missing_tensors: bool = False, allow_nonfinite: bool = False,
          allow_dense_agents: bool = False, raw_f32_agents: bool = False,
          seed: Optional[int] = None, names: Optional[Sequence[str]] = None,
          config_from: Optional[str] = None,
          svc: Union[None, bool, float] = None, **params: Any) -> Dict[str, Any]:
    """Merges ``models`` (agents fine-tuned from ``base``) with ``method`` into the folder ``out``.

    ``base`` and each model are folders or Hugging Face Hub ids (``org/name``,
    ``org/name@revision``), taken from the HF cache or downloaded into it. A model may be a LoRA
    agent: a PEFT adapter folder, or ``"BASE+ADAPTER"`` with BASE the merge's base.

    Parameters are keywords as in a mergekit recipe: ``density=0.5``, ``rule="official"``; a
    list gives one value per model (``weight=[0.7, 0.3]``), a dict names models
    (``weight={"coder": 0.7, "tools": 0.3}``). ``device`` is ``"auto"``, ``"cpu"`` or ``"gpu"``.
    ``tokenizer_source`` (``"base"``, ``"union"`` or a model) or ``tokenizer`` (mergekit's section:
    ``{"source": ..., "tokens": {...}, "pad_to_multiple_of": n}``) sets the output's vocabulary;
    agents that added tokens then merge their embeddings token by token.
    ``allow_missing_tensors=True`` merges a tensor some agents lack from those that have it (and
    ignores tensors the base lacks) instead of refusing them; ``allow_nonfinite=True`` merges NaN
    and ±Inf inputs by IEEE rules instead of refusing them; ``allow_dense_agents=True`` silences
    the warning for an agent that changed nearly every element (unlike an RL agent of this base).
    ``config_from`` (``"base"``, or an agent's folder or name) says whose config.json the merged
    model takes — needed where an agent's config differs from the base's in a key that changes how
    the weights are used (rope, context length, attention windows, activation, norms).
    ``raw_f32_agents=True`` reads agents' F32 weights over a BF16/F16 base as stored; by default
    they are fp32 master weights, read as their rounding to the base's dtype.
    ``names`` gives the agents names (one per model, in order) for the card, the record and the
    figures. ``seed`` seeds the random masks of dare_linear, dare_ties, della and della_linear (the same
    seed, the same bytes). ``svc=ALPHA`` (``True``: α = 0.1)
    calibrates each merged matrix's spectrum after the method (SVC, SPEC §4e), as ``--svc`` does.
    Returns the merge's record as a dict (method, λ per agent, input and output checksums) with
    ``out`` and the ``shards`` written. Raises :class:`MergeError` (:class:`UsageError` for a bad
    request); nothing is left at ``out`` when it fails.
    """
    if out is None:
        raise UsageError("merge needs out=, the folder to write the merged model into")
    out = _path(out, "out")
    if isinstance(models, (str, bytes, os.PathLike)):
        raise UsageError("models must be a list of folders, not one path")
    _check_keywords(method=method, device=device, threads=threads, quiet=quiet, force=force,
                    out_dtype=out_dtype, shard_size=shard_size, seed=seed, svc=svc,
                    tokenizer=tokenizer, allow_missing_tensors=allow_missing_tensors,
                    allow_nonfinite=allow_nonfinite, allow_dense_agents=allow_dense_agents,
                    raw_f32_agents=raw_f32_agents)
    for key, value in params.items():
        if isinstance(value, Mapping):
            for v in value.values():
                _check_value(key, v)
        else:
            _check_value(key, value)
    base = _where(base, "base")
    wheres = [_where(m) for m in models]
    shared, per_model = _split_params(wheres, params, list(models))
    names = _names(names, len(wheres))
    recipe: Dict[str, Any] = {
        "merge_method": method,
        "base_model": base,
        "models": [dict({"model": m}, **({"parameters": p} if p else {}),
                        **({"name": n} if n is not None else {}))
                   for m, p, n in zip(wheres, per_model, names)],
    }
    if shared:
        recipe["parameters"] = shared
    if config_from is not None:
        if not isinstance(config_from, (str, os.PathLike)):
            raise UsageError(f"config_from must be 'base' or a model (a string or a path), got "
                             f"{type(config_from).__name__} {config_from!r}")
        named = os.fspath(config_from)
        recipe["config_from"] = named if named == "base" or named in (names or []) else _where(named)
    if tokenizer_source is not None:
        if not isinstance(tokenizer_source, (str, os.PathLike)):
            raise UsageError(f"tokenizer_source must be 'base', 'union' or a model, got "
                             f"{type(tokenizer_source).__name__} {tokenizer_source!r}")
        recipe["tokenizer_source"] = _where(tokenizer_source) if tokenizer_source not in ("base", "union") else tokenizer_source
    if tokenizer is not None:
        recipe["tokenizer"] = dict(tokenizer)
    if svc is not None and svc is not False:
        recipe["svc"] = True if svc is True else {"alpha": svc}
    # The recipe goes to the library as data, read and checked as a recipe file is; what it
    # says of the recipe is said in this function's keywords.
    keywords = _keywords(device, quiet, force, out_dtype, shard_size, threads,
                         allow_missing_tensors, allow_nonfinite, allow_dense_agents,
                         raw_f32_agents, seed)
    record = _native.merge(recipe, out, keywords)
    return _finished(record, out)


def _names(names: Any, models: int) -> List[Optional[str]]:
    """``names`` checked: ``None``, or a list (or tuple) of one string per model."""
    if names is None:
        return [None] * models
    if not isinstance(names, (list, tuple)) or not all(isinstance(n, str) for n in names):
        raise UsageError(f"names must be a list of strings, one per model, got "
                         f"{type(names).__name__} {names!r}")
    if len(names) != models:
        raise UsageError(f"names has {len(names)} names for {models} models: give one per model")
    return list(names)


def _keywords(device: str, quiet: bool, force: bool, out_dtype: Optional[str],
              shard_size: Any, threads: int, allow_missing_tensors: bool,
              allow_nonfinite: bool, allow_dense_agents: bool, raw_f32_agents: bool,
              seed: Any) -> Dict[str, Any]:
    """A merge's keywords as the native ``merge`` and ``run`` take them (each checked by
    :func:`_check_keywords`); a shard size as the library reads one (``"5GB"``, ``"2GiB"`` or a
    number of bytes)."""
    _check_keywords(device=device, threads=threads, quiet=quiet, force=force, out_dtype=out_dtype,
                    shard_size=shard_size, seed=seed, allow_missing_tensors=allow_missing_tensors,
                    allow_nonfinite=allow_nonfinite, allow_dense_agents=allow_dense_agents,
                    raw_f32_agents=raw_f32_agents)
    if _is_number(shard_size):
        shard_size = int(shard_size) if float(shard_size).is_integer() else shard_size
    return {"device": device, "quiet": quiet, "force": force, "out_dtype": out_dtype,
            "shard_size": None if shard_size is None else str(shard_size), "threads": threads,
            "allow_missing_tensors": allow_missing_tensors, "allow_nonfinite": allow_nonfinite,
            "allow_dense_agents": allow_dense_agents, "raw_f32_agents": raw_f32_agents,
            "seed": seed}


def run(recipe: PathLike, out: PathLike, *, device: str = "auto", quiet: bool = True,
        force: bool = False, out_dtype: Optional[str] = None, shard_size: Optional[str] = None,
        threads: int = 0, allow_missing_tensors: bool = False,
        allow_nonfinite: bool = False, allow_dense_agents: bool = False,
        raw_f32_agents: bool = False, seed: Optional[int] = None,
        intermediate_dir: Optional[PathLike] = None) -> Dict[str, Any]:
    """Runs a mergekit YAML recipe into ``out``, as ``rlmerge run``; returns what :func:`merge`
    returns. A keyword given replaces the recipe's setting (``seed``, ``out_dtype``,
    ``shard_size``); the recipe saved with the merge says what it ran with. A multi-stage recipe
    (several YAML documents, each with a ``name:``, as mergekit-multi reads them) runs stage by
    stage; ``intermediate_dir`` keeps each earlier stage in ``intermediate_dir/NAME`` (by default
    they are scratch, removed when the run ends)."""
    _check_common(device, threads)
    out = _path(out, "out")
    kept = None if intermediate_dir is None else _path(intermediate_dir, "intermediate_dir")
    record = _native.run(_path(recipe, "recipe"), out,
                         _keywords(device, quiet, force, out_dtype, shard_size, threads,
                                   allow_missing_tensors, allow_nonfinite, allow_dense_agents,
                                   raw_f32_agents, seed), kept)
    return _finished(record, out)


def convert(source: PathLike, out: PathLike, *, quiet: bool = True, force: bool = False,
            out_dtype: Optional[str] = None, shard_size: Optional[str] = None, threads: int = 0,
            allow_nonfinite: bool = False, raw_f32: bool = False) -> Dict[str, Any]:
    """Converts one checkpoint into a Hugging Face safetensors folder ``out``, as
    ``rlmerge convert``: ``source`` is a folder (safetensors, ``pytorch_model.bin``, a verl actor
    folder of FSDP rank shards), a Hub id, or ``"BASE+ADAPTER"`` (the adapter applied to its
    base). A verl checkpoint's fp32 masters are written rounded to bf16 as verl's converter writes
    them, or as stored with ``raw_f32=True``. Returns what :func:`merge` returns."""
    out = _path(out, "out")
    record = _native.convert(_where(source, "source"), out,
                             _keywords("cpu", quiet, force, out_dtype, shard_size, threads, False,
                                       allow_nonfinite, True, raw_f32, None))
    return _finished(record, out)


def extract_lora(base: PathLike, model: PathLike, out: PathLike, *, rank: Optional[int] = None,
                 rel_error: Optional[float] = None, distribute_scale: bool = True,
                 embed_lora: bool = False, skip_undecomposable: bool = False,
                 include: Union[None, str, Sequence[str]] = None,
                 exclude: Union[None, str, Sequence[str]] = None, sv_epsilon: float = 0.0,
                 save_modules: Sequence[str] = (), max_held_mib: Optional[int] = None,
                 threads: int = 0, force: bool = False) -> Dict[str, Any]:
    """Extracts a PEFT LoRA adapter of ``model`` against ``base`` into ``out``, as
    ``rlmerge extract-lora`` (mergekit's ``mergekit-extract-lora``): each changed matrix's update
    at rank ``rank`` (the command's default where ``None``: 32; or the least rank within
    ``rel_error``; singular values at most ``sv_epsilon`` dropped), changed embeddings and norms
    saved whole (``embed_lora=True`` factors embeddings, ``skip_undecomposable=True`` leaves
    vectors out, ``save_modules`` names modules saved whole), ``include``/``exclude`` regular
    expressions on module names (one, or a list of which any matches); a matrix's update larger
    than ``max_held_mib`` MiB in f32 (the command's default where ``None``: 1024) is factored
    from its Gram matrix as its rows are read, never held. Returns what it kept:
    ``modules`` (each one's ``rank``, ``kept`` = ‖Δ_r‖/‖Δ‖ and ``norm``), ``whole``, ``skipped``,
    ``unchanged`` and ``kept`` over every factored module."""
    _check_common("cpu", threads)
    if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int) or rank < 0):
        raise UsageError(f"rank must be a whole number (≥ 1), got {rank!r}")
    if max_held_mib is not None and (isinstance(max_held_mib, bool)
                                     or not isinstance(max_held_mib, int)
                                     or not 0 <= max_held_mib < 2**63):
        raise UsageError(f"max_held_mib must be a whole number of MiB (≥ 0), got {max_held_mib!r}")
    for name, value in (("rel_error", rel_error), ("sv_epsilon", sv_epsilon)):
        if value is not None and (isinstance(value, bool) or not _is_number(value)):
            raise UsageError(f"{name} must be a number, got {value!r}")
    filters = []
    for name, value in (("include", include), ("exclude", exclude)):
        if isinstance(value, str):
            value = [value]
        if value is not None and (not isinstance(value, (list, tuple))
                                  or not all(isinstance(v, str) for v in value)):
            raise UsageError(f"{name} must be a regular expression (str) or a list of them, got {value!r}")
        filters.append(list(value or ()))
    if isinstance(save_modules, str) or not all(isinstance(m, str) for m in save_modules):
        raise UsageError(f"save_modules must be a list of module names, got {save_modules!r}")
    return json.loads(_native.extract_lora(
        _where(base, "base"), _where(model, "model"), _path(out, "out"), rank,
        None if rel_error is None else float(rel_error), bool(distribute_scale),
        bool(embed_lora), bool(skip_undecomposable), filters[0], filters[1], threads, bool(force),
        float(sv_epsilon), list(save_modules), max_held_mib))


def _paths_as_text(value: Any) -> Any:
    """A config's value with every ``os.PathLike`` (a ``pathlib.Path`` model) as its text, in
    dicts, lists and tuples at any depth."""
    if isinstance(value, os.PathLike):
        return os.fsdecode(os.fspath(value))
    if isinstance(value, Mapping):
        return {k: _paths_as_text(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_paths_as_text(v) for v in value]
    return value


def moe(config: Union[PathLike, Mapping[str, Any]], out: PathLike, *, quiet: bool = True,
        force: bool = False, out_dtype: Optional[str] = None, shard_size: Optional[str] = None,
        threads: int = 0, seed: Optional[int] = None, allow_all_same: bool = False,
        allow_nonfinite: bool = False,
        intermediate_dir: Optional[PathLike] = None) -> Dict[str, Any]:
    """Builds a mixture of experts into ``out``, as ``rlmerge moe`` (mergekit's ``mergekit-moe``):
    ``config`` is a mergekit-moe YAML file or a dict with its keys (``base_model``, ``experts``
    with ``source_model`` and ``positive_prompts``/``negative_prompts``, ``gate_mode``
    ``cheap_embed``, ``random`` or ``uniform_random``, ``dtype``, ``experts_per_token``,
    ``shared_experts``, ``architecture``), or a multi-stage recipe file whose final stage is
    that config and whose earlier stages are merges it names as experts (``intermediate_dir``
    keeps them in ``intermediate_dir/NAME``). ``seed`` seeds random routers and noise;
    ``allow_all_same`` lets every expert be one model. Returns what was built: ``architecture``,
    ``experts``, ``layers``, ``tensors``, ``bytes``, ``dtype``, ``degenerate_layers`` (routers
    too alike) and ``zero_biases``."""
    keywords = _keywords("cpu", quiet, force, out_dtype, shard_size, threads, False,
                         allow_nonfinite, True, False, seed)
    if not isinstance(allow_all_same, bool):
        raise UsageError(f"allow_all_same must be True or False, got {allow_all_same!r}")
    out = _path(out, "out")
    if isinstance(config, Mapping):
        if intermediate_dir is not None:
            raise UsageError("intermediate_dir is for a multi-stage recipe file, not a config dict")
        built = _native.moe(None, _paths_as_text(config), out, keywords, allow_all_same)
    else:
        kept = None if intermediate_dir is None else _path(intermediate_dir, "intermediate_dir")
        built = _native.moe(_path(config, "config"), None, out, keywords, allow_all_same, kept)
    return json.loads(built)


def analyze(base: PathLike, models: Sequence[PathLike], per_tensor: bool = False, *,
            merged: Optional[PathLike] = None, plot: Optional[PathLike] = None,
            epsilon: Optional[float] = None, device: str = "auto", quiet: bool = True,
            threads: int = 0, tokenizer_source: Optional[str] = None,
            allow_missing_tensors: bool = False, allow_nonfinite: bool = False,
            allow_dense_agents: bool = False, raw_f32_agents: bool = False,
            names: Optional[Sequence[str]] = None) -> Dict[str, Any]:
    """What each agent changed (the data of ``rlmerge analyze --json``): density, unique and
    shared counts, ρ and λ per agent, by module and tensor with ``per_tensor``; with ``merged``,
    the retention of each agent in that merged folder; with ``plot``, SVG figures written there.
    ``tokenizer_source`` (``"base"``, ``"union"`` or a model) compares agents that added tokens
    token by token, as :func:`merge` merges them.
    """
    if isinstance(models, (str, bytes, os.PathLike)):
        raise UsageError("models must be a list of folders, not one path")
    _check_keywords(device=device, threads=threads, per_tensor=per_tensor, epsilon=epsilon,
                    quiet=quiet, allow_missing_tensors=allow_missing_tensors,
                    allow_nonfinite=allow_nonfinite, allow_dense_agents=allow_dense_agents,
                    raw_f32_agents=raw_f32_agents)
    if tokenizer_source is not None and not isinstance(tokenizer_source, (str, os.PathLike)):
        raise UsageError(f"tokenizer_source must be 'base', 'union' or a model, got "
                         f"{type(tokenizer_source).__name__} {tokenizer_source!r}")
    if tokenizer_source is not None and tokenizer_source not in ("base", "union"):
        tokenizer_source = _where(tokenizer_source)
    keywords = {
        "base": _where(base, "base"), "models": [_where(m) for m in models],
        "per_tensor": per_tensor,
        "merged": None if merged is None else _path(merged, "merged"),
        "plot": None if plot is None else _path(plot, "plot"),
        "epsilon": None if epsilon is None else float(epsilon), "device": device, "quiet": quiet,
        "threads": threads, "tokenizer_source": tokenizer_source,
        "allow_missing_tensors": allow_missing_tensors, "allow_nonfinite": allow_nonfinite,
        "allow_dense_agents": allow_dense_agents, "raw_f32_agents": raw_f32_agents,
        "names": [n for n in _names(names, len(models)) if n is not None],
    }
    return json.loads(_native.analyze(keywords))


def verify(dir: PathLike, against: bool = False, *, device: str = "auto") -> Dict[str, Any]:
    """Checks a merged folder against its record (every checksum, the structure); with
    ``against``, recomputes the merge from the recorded inputs and compares the bytes. Returns
    what it found: ``{"path", "ok", "checks", "skipped", "problems", "notes"}`` — ``ok`` is
    False when a check failed, and ``problems`` says which; ``notes`` names scratch folders that
    killed runs left in or beside it, with their size and how to remove them. Raises :class:`MergeError` when the folder cannot
    be checked at all (no readable record)."""
    dir = _path(dir, "dir")
    _check_keywords(device=device, against=against)
    checks, skipped, problems, notes = _native.verify(dir, against, device)
    return {"path": os.path.abspath(dir), "ok": not problems, "checks": checks,
            "skipped": skipped, "problems": problems, "notes": notes}


def methods() -> List[Dict[str, Any]]:
    """Every merge method: name, description, reference and parameters (scope, default, range)."""
    return json.loads(_native.methods())
